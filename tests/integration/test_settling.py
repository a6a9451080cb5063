"""No verdicts on stale views: after a nats-server restart the router, the reaper and the
gateway wait for the registry to settle (`services.fleet.settling`) before saying a worker
is not live. The incident: a graceful restart with every worker alive, and 2.8 s later the
reaper failed tasks ``no_alternative_worker (reason=ghost_pending)``, the router answered
``no_worker`` and the gateway 404."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Literal

import httpx
import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import ROUTE, WORKERS_BUCKET
from schemas.workers import WorkerRecord
from services.runtime.bus import ensure_streams
from tests.harness import ServiceRunner, eventually, workers_live
from tests.integration.test_gateway import start_gateway

PLAIN = "qwen2.5:0.5b"
THINKER = "qwen3:0.6b"
# Longer than the services' WORKER_TTL_S (3 s): every heartbeat from before it is stale after.
OUTAGE_S = 4.0
# The gateway's WORKER_TTL_S in the dashboard's test (shorter than `OUTAGE_S`).
DASHBOARD_TTL_S = 3.0
# How long after a reconnect the gateway's view may settle at the latest: a TTL, and the time
# a registry that does not answer yet right after the restart adds (`stall.FAILOVER_S`, 9 s).
SETTLED_WITHIN_S = DASHBOARD_TTL_S + 9.0 + 5.0


def silent_worker(beat: float, state: Literal["idle", "busy"]) -> WorkerRecord:
    """A record the test puts in the registry itself: a worker serving PLAIN that heartbeated
    at ``beat`` and never again."""
    return WorkerRecord(
        worker_id="cpu-silent",
        host="host-silent",
        instance_id="i-1",
        pid=1,
        version="t",
        supports=["cpu_inference"],
        models=[PLAIN],
        started_at=beat,
        heartbeat_at=beat,
        state=state,
    )


async def reconnecting(url: str) -> Client:
    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)


def restart(server: NatsServer, outage_s: float) -> None:
    """A graceful restart (SIGTERM) on the same port and store, after ``outage_s``."""
    server.stop()
    time.sleep(outage_s)
    server.start()


async def task_subjects(nc: Client) -> list[str]:
    """Every task event's subject in ``EVENTS``."""
    info = await nc.jetstream().stream_info("EVENTS", subjects_filter="events.task.>")
    return sorted(info.state.subjects or {})


async def test_a_nats_server_restart_under_load_fails_no_task(
    nats_server: NatsServer, runner: ServiceRunner
) -> None:
    with FakeOllama(delay_s=0.1) as fake:
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        runner.worker(nats_server.url, fake.url, "cpu-2")
        nc = await reconnecting(nats_server.url)
        try:
            await workers_live(nc, 2)
            answers: list[str] = []
            loading = asyncio.Event()

            async def client() -> None:
                """Ask and wait, again and again; retry what is answered `unavailable`, as a
                client should (and what went unanswered while the server was away)."""
                body = msgspec.json.encode({"prompt": "1+1", "model": PLAIN, "wait": True})
                while not loading.is_set():
                    try:
                        msg = await nc.request(ROUTE, body, timeout=8)
                    except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                        answers.append(type(exc).__name__)
                        await asyncio.sleep(0.1)
                        continue
                    reply: dict[str, Any] = msgspec.json.decode(msg.data)
                    error = (msg.headers or {}).get("Nats-Service-Error-Code")
                    answers.append(error or str(reply.get("status")))
                    if error == "unavailable":
                        await asyncio.sleep(0.1)

            clients = [asyncio.create_task(client()) for _ in range(4)]
            await asyncio.sleep(1.5)
            await asyncio.to_thread(restart, nats_server, OUTAGE_S)
            await asyncio.sleep(6.0)  # the settling window and well beyond
            loading.set()
            await asyncio.gather(*clients)

            refusals = {a for a in answers if a not in ("done", "TimeoutError")}
            assert "failed" not in answers
            assert refusals <= {"unavailable", "NoRespondersError"}, answers
            assert answers.count("done") > 20

            # Every task submitted ends done: none failed, and a request answered
            # `unavailable` left no task behind (it was never submitted).
            async def open_tasks() -> list[str]:
                """The events of every task submitted that has not completed."""
                subjects = await task_subjects(nc)
                completed = {s.split(".")[2] for s in subjects if s.endswith(".completed")}
                return [s for s in subjects if s.split(".")[2] not in completed]

            async def all_ended() -> bool:
                return not await open_tasks()

            try:
                await eventually(all_ended, timeout_s=30, interval_s=0.5)
            except AssertionError:
                js = nc.jetstream()
                failures = [
                    (await js.get_last_msg("EVENTS", subject)).data
                    for subject in await open_tasks()
                    if subject.endswith(".failed")
                ]
                raise AssertionError(
                    f"tasks still open: {await open_tasks()}; {failures}"
                ) from None
            assert not [s for s in await task_subjects(nc) if s.endswith(".failed")]
        finally:
            await nc.close()


async def test_the_gateway_answers_503_with_retry_after_while_the_router_rereads_the_registry(
    nats_server: NatsServer, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[THINKER]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url, gateway_retry_after_s=7)
        nc = await reconnecting(nats_server.url)
        http = httpx.AsyncClient(base_url=url, timeout=10)
        try:
            await workers_live(nc, 1)
            # A worker serving PLAIN alone, live until the outage and silent after it (its
            # machine went down meanwhile): after the restart the router waits a TTL for it.
            workers = await nc.jetstream().key_value(WORKERS_BUCKET)
            silent = silent_worker(time.time(), "idle")
            await workers.put("cpu-silent", msgspec.json.encode(silent))
            await workers_live(nc, 2)
            await asyncio.to_thread(restart, nats_server, OUTAGE_S)

            async def routed() -> httpx.Response | None:
                # Until the router answers again, the gateway hears no responder.
                reply = await http.post("/v1/completions", json={"model": PLAIN, "prompt": "hi"})
                return None if reply.json()["error"]["code"] == "no_responder" else reply

            openai_reply = await eventually(routed, timeout_s=15, interval_s=0.05)
            ollama_reply = await http.post(
                "/api/generate", json={"model": PLAIN, "prompt": "hi", "stream": False}
            )
            for refused in (openai_reply, ollama_reply):
                assert refused.status_code == 503, refused.text
                assert refused.headers["Retry-After"] == "7"
            assert openai_reply.json()["error"]["code"] == "unavailable"
            assert "reading the worker registry again" in ollama_reply.json()["error"]

            # Once the window has passed, the silent worker is dead by the one rule, and a
            # model only it served is unknown: Ollama's 404.
            async def settled() -> httpx.Response | None:
                reply = await http.post("/api/generate", json={"model": PLAIN, "prompt": "hi"})
                return reply if reply.status_code == 404 else None

            after = await eventually(settled, timeout_s=10, interval_s=0.2)
            assert "model not found" in after.json()["error"]
        finally:
            await http.aclose()
            await nc.close()


async def test_the_dashboard_shows_no_worker_lost_until_its_view_has_settled_after_a_reconnect(
    nats_server: NatsServer, runner: ServiceRunner
) -> None:
    """After an outage longer than ``WORKER_TTL_S`` the gateway's watch hands back a worker's
    record from before it, its heartbeat stale: right after the gateway's reconnect the
    dashboard shows the worker in its last state, and ``lost`` only once a TTL has passed since
    the reconnect with no heartbeat. The test writes the worker's record itself, so no
    heartbeat comes after the outage."""
    nc = await reconnecting(nats_server.url)
    try:
        # The bucket keeps the entry through the outage (a TTL of its own, longer than the
        # test), so the watch hands the record from before it back after the reconnect.
        workers = await ensure_streams(nc.jetstream(), worker_ttl_s=300.0)
        with capture_logs() as logs:
            url = await start_gateway(runner, nats_server.url, worker_ttl_s=DASHBOARD_TTL_S)
            async with httpx.AsyncClient(base_url=url, timeout=10) as http:

                async def shown() -> dict[str, Any]:
                    """The worker's row with the time of the build it is from."""
                    state = (await http.get("/dashboard/state")).json()
                    rows = [w for w in state["workers"] if w["worker_id"] == "cpu-silent"]
                    return {"now": state["summary"]["now"], **(rows[0] if rows else {})}

                beat = time.time()
                busy = silent_worker(beat, "busy")
                await workers.put("cpu-silent", msgspec.json.encode(busy))

                # The gateway holds the last heartbeat before the outage.
                async def holds_it() -> bool:
                    return (await shown()).get("last_heartbeat") == beat

                await eventually(holds_it, timeout_s=10)

                nats_server.stop()
                await asyncio.sleep(OUTAGE_S)  # the outage itself: longer than the TTL
                back_at = time.time()
                await asyncio.to_thread(nats_server.start)

                async def gateway_reconnected() -> bool:
                    return any(
                        e["event"] == "nats reconnected"
                        and e.get("client") == "coordinator-gateway"
                        for e in logs
                    )

                await eventually(gateway_reconnected, timeout_s=15)
                reconnected_seen = time.time()

                # The first build after the reconnect: the worker in its last state.
                async def built_since_reconnect() -> dict[str, Any] | None:
                    row = await shown()
                    return row if row["now"] >= reconnected_seen else None

                first = await eventually(built_since_reconnect, timeout_s=5)
                assert first["state"] == "busy", first
                assert first["last_heartbeat"] == beat

                # No heartbeat since: lost, once a TTL has passed since the reconnect.
                async def lost() -> dict[str, Any] | None:
                    row = await shown()
                    return row if row["state"] == "lost" else None

                after = await eventually(lost, timeout_s=SETTLED_WITHIN_S)
                assert after["now"] >= back_at + DASHBOARD_TTL_S, (after, back_at)
                assert after["last_heartbeat"] == beat
        settling = [e for e in logs if e["event"] == "reading the registry again after a reconnect"]
        assert [e["awaited"] for e in settling] == [["cpu-silent"]], settling
    finally:
        await nc.close()
