"""A second process bound to an existing worker's consumer, without taking the lease.

It stands for the case the lease exists to prevent (two processes with one worker id): even
then the consumer's ``max_ack_pending=1`` must keep the server from handing out two tasks.
Run as ``python -m tests.integration.second_puller`` with the worker's environment.
"""

from __future__ import annotations

import asyncio

from services.backends.choose import make_backend
from services.runtime import waitfor
from services.runtime.bus import connect, ensure_streams
from services.runtime.consumers import bind
from services.runtime.lifecycle import close_bus, run_until_stopped, stop_budget_s
from services.runtime.settings import WorkerSettings
from services.runtime.taskloop import Source, TaskLoop
from services.worker.service import Inference, inference_loop_settings


async def main(stop: asyncio.Event) -> None:
    settings = WorkerSettings.from_env()
    nc = await connect(settings.nats_url, "second-puller")
    backend = make_backend(
        settings.worker_backend,
        ollama_host=settings.ollama_host,
        openai_base_url=settings.openai_base_url,
        openai_api_key=settings.openai_api_key,
        connect_timeout_s=settings.backend_connect_timeout_s,
    )
    kind = Inference(nc, settings, backend)
    kind.served = await kind.discover_models(stop)
    loop = TaskLoop(nc, kind, inference_loop_settings(settings))
    loop.runner.registry = await ensure_streams(loop.js, worker_ttl_s=settings.worker_ttl_s)
    own = kind.queues()[0]
    source = Source(own, await bind(loop.js, own, settings.ack_wait_s))
    print("bound", flush=True)
    try:
        await loop.serve([source], stop)
    finally:
        await source.sub.unsubscribe()
        await backend.aclose()
        await close_bus(nc)


if __name__ == "__main__":
    waitfor.install()
    run_until_stopped(main, budget_s=stop_budget_s(WorkerSettings.from_env().stop_grace_s))
