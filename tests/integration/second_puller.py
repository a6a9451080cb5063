"""A second process bound to an existing worker's consumer, without taking the lease.

It stands for the case the lease exists to prevent (two processes with one worker id): even
then the consumer's ``max_ack_pending=1`` must keep the server from handing out two tasks.
Run as ``python -m tests.integration.second_puller`` with the worker's environment.
"""

from __future__ import annotations

import asyncio

from services.runtime.bus import connect
from services.runtime.lifecycle import run_until_stopped
from services.runtime.settings import WorkerSettings
from services.worker.service import Worker, make_backend


async def main(stop: asyncio.Event) -> None:
    settings = WorkerSettings.from_env()
    nc = await connect(settings.nats_url, "second-puller")
    backend = make_backend(settings)
    worker = Worker(nc, settings, backend)
    worker.served = await worker.discover_models(stop)
    sub = await worker.ensure_consumer()
    print("bound", flush=True)
    try:
        await worker.serve(sub, stop)
    finally:
        await sub.unsubscribe()
        await backend.aclose()
        await nc.drain()


if __name__ == "__main__":
    run_until_stopped(main)
