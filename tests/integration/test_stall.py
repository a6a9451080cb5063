"""A worker process stopped mid-generation (SIGSTOP) never runs beside the attempt that replaces
it: its watchdog kills it before the reaper may move the task, so its backend stops generating
first (`services.runtime.watchdog`).

Worker ``gpu-a`` runs as its own process (``coordinator worker``, as a service manager runs it)
beside a slow Ollama stand-in; ``cpu-b``, the router and the reaper run here. The task goes to
``gpu-a``; once its generation is under way, ``gpu-a`` is stopped for 8 s. The stand-ins record
each generation's start and end (a generation ends when its client hangs up), which is what
"twice at once" is judged on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import suppress
from typing import Any

import msgspec
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import ROUTE
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    last_task_event,
    request,
    workers_live,
)
from tests.reaper_harness import MODEL

PROMPT = " ".join(f"word{i}" for i in range(40))
CHUNK_DELAY_S = 0.25  # a generation of about 10 s on the stalled worker's stand-in
TTL_S = 3.0
STOPPED_S = 8.0


async def test_a_worker_stopped_mid_generation_is_killed_before_its_task_is_moved(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, processes: Processes
) -> None:
    with FakeOllama(models=[MODEL]) as slow, FakeOllama(models=[MODEL]) as other:
        worker_a = processes.start(
            [COORDINATOR, "worker"],
            clean_env(
                NATS_URL=nats_server.url,
                OLLAMA_HOST=slow.url,
                WORKER_ID="gpu-a",
                WORKER_HOST="host-a",
                WORKER_SUPPORTS="gpu_inference",
                HEARTBEAT_INTERVAL_S="0.5",
                WORKER_TTL_S=str(TTL_S),
                ACK_WAIT_S="6",
            ),
        )
        runner.worker(nats_server.url, other.url, "cpu-b")
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        await workers_live(nc, 2, timeout_s=30)
        slow.configure(chunk_delay_s=CHUNK_DELAY_S)
        since = time.time()

        reply, _ = await request(nc, ROUTE, {"prompt": PROMPT, "model": MODEL})
        task_id = reply["task_id"]
        assert reply["worker"] == "gpu-a", reply

        def generating() -> bool:
            return any(c["prompt"] == PROMPT and c["ended_at"] is None for c in slow.calls())

        await eventually(lambda: asyncio.to_thread(generating), timeout_s=15)
        os.kill(worker_a.pid, signal.SIGSTOP)
        stopped_at = time.time()
        try:
            js = nc.jetstream()

            async def completed() -> dict[str, Any] | None:
                try:
                    event = await last_task_event(js, task_id, "completed")
                except Exception:
                    return None
                body: dict[str, Any] = msgspec.json.decode(event.data or b"")
                return body

            done = await eventually(completed, timeout_s=40, interval_s=0.2)
        finally:
            await asyncio.sleep(max(0.0, stopped_at + STOPPED_S - time.time()))
            with suppress(ProcessLookupError):
                os.kill(worker_a.pid, signal.SIGCONT)

        # Moved to the other worker as attempt 2, which gave the whole answer.
        assert (done["worker"], done["attempt"]) == ("cpu-b", 2), done
        assert done["response"] == f"Echo from {MODEL}: {PROMPT[:200]}"

        a_calls = [c for c in slow.calls() if c["started_at"] >= since]
        b_calls = [c for c in other.calls() if c["started_at"] >= since]
        assert len(a_calls) == 1 and len(b_calls) == 1, (a_calls, b_calls)
        a_call, b_call = a_calls[0], b_calls[0]
        # The stopped worker's generation ended (its client gone) before the other began, and
        # long before it would have ended on its own.
        assert a_call["ended_at"] is not None, a_call
        assert a_call["ended_at"] < b_call["started_at"], (a_call, b_call)
        assert a_call["ended_at"] - stopped_at < TTL_S

    # Its watchdog killed it, and said why.
    assert worker_a.wait(timeout=10) == -signal.SIGKILL
    _, stderr = worker_a.communicate(timeout=10)
    assert "watchdog: worker process" in stderr and "has not run for" in stderr, stderr
