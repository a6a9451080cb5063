"""A worker cut off from NATS, but not from its backend, mid-task: no two generations at once.

The worker runs on a test host of its own (a network namespace), beside its own Ollama
stand-in on that host's loopback, as a fleet runs it; nats-server, the router, the reaper and a
second worker run on this machine. Cutting the host's link partitions the worker from the bus
while its generation goes on: the worker must stop that generation before the reaper can judge
it dead and move the task, and pull nothing until its lease is renewed.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from services.runtime.bus import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S, connect
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    last_task_event,
    logged,
    request,
    workers_live,
)
from tests.hosts import NetnsHost, netns_hosts, netns_unavailable

pytestmark = pytest.mark.skipif(
    (why := netns_unavailable()) is not None, reason=f"no test hosts: {why}"
)

MODEL = "qwen2.5:0.5b"
# Inside the test host: its own loopback, its own port space.
HOST_OLLAMA_PORT = 11434
# Each streamed piece this far apart: a generation of the prompt below lasts about 10 s.
CHUNK_DELAY_S = 0.25
PROMPT = " ".join(f"word{i}" for i in range(36))
TTL_S = 3.0


@pytest.fixture
def bus() -> Iterator[NatsServer]:
    """A nats-server that the test host can reach too (it listens on every address)."""
    with tempfile.TemporaryDirectory(prefix="coord-nats-") as store:
        server = NatsServer(store, listen="0.0.0.0").start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture
def host() -> Iterator[NetnsHost]:
    with netns_hosts(1) as hosts:
        yield hosts[0]


@pytest.fixture
async def client(bus: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(bus.url)
    yield nc
    await nc.close()


async def _fake_calls(url: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=5) as http:
        reply = await http.get(f"{url}/_fake/calls")
    calls: list[dict[str, Any]] = reply.json()["calls"]
    return calls


async def test_a_worker_cut_off_mid_task_stops_before_its_task_runs_elsewhere(
    bus: NatsServer,
    host: NetnsHost,
    client: Client,
    runner: ServiceRunner,
    processes: Processes,
) -> None:
    # The cut-off worker: a GPU worker (so it is preferred) with its backend on its own host.
    host_ollama = f"http://{host.ip}:{HOST_OLLAMA_PORT}"
    backend = processes.start(
        host.command(
            sys.executable,
            *("-m", "devtools.fakes.ollama", "--host", "0.0.0.0"),
            *("--port", str(HOST_OLLAMA_PORT), "--models", MODEL),
        ),
        clean_env(),
    )
    worker_a = processes.start(
        host.command(COORDINATOR, "worker"),
        clean_env(
            NATS_URL=f"nats://{host.gateway_ip}:{bus.port}",
            OLLAMA_HOST=f"http://127.0.0.1:{HOST_OLLAMA_PORT}",
            WORKER_ID="gpu-a",
            WORKER_HOST="host-a",
            WORKER_SUPPORTS="gpu_inference",
            HEARTBEAT_INTERVAL_S="0.5",
            WORKER_TTL_S=str(TTL_S),
            ACK_WAIT_S="6",
        ),
    )
    # The other worker, the router and the reaper on this machine.
    with FakeOllama(models=[MODEL]) as local:
        runner.worker(bus.url, local.url, "cpu-b")
        runner.router(bus.url)
        runner.reaper(bus.url)
        await workers_live(client, 2, timeout_s=30)
        assert backend.poll() is None and worker_a.poll() is None

        # Slow generations from now on; only the calls after this count.
        async with httpx.AsyncClient(timeout=5) as http:
            await http.post(f"{host_ollama}/_fake/config", json={"chunk_delay_s": CHUNK_DELAY_S})
        local.configure(chunk_delay_s=CHUNK_DELAY_S)
        since = time.time()

        notices: list[dict[str, Any]] = []

        async def on_notice(msg: Msg) -> None:
            notices.append(msgspec.json.decode(msg.data))

        await client.subscribe("coordinator.cancel.*", cb=on_notice)
        reply, _ = await request(client, "coordinator.route", {"prompt": PROMPT, "model": MODEL})
        task_id = reply["task_id"]
        assert reply["worker"] == "gpu-a"

        js = client.jetstream()

        async def started_on_a() -> bool:
            try:
                event = await last_task_event(js, task_id, "started")
            except Exception:
                return False
            return bool(msgspec.json.decode(event.data or b"")["worker"] == "gpu-a")

        await eventually(started_on_a, timeout_s=15)
        await asyncio.sleep(1.0)  # mid-generation
        host.cut()
        cut_at = time.time()
        try:

            async def completed() -> dict[str, Any] | None:
                try:
                    event = await last_task_event(js, task_id, "completed")
                except Exception:
                    return None
                body: dict[str, Any] = msgspec.json.decode(event.data or b"")
                return body

            done = await eventually(completed, timeout_s=40, interval_s=0.2)
        finally:
            await asyncio.sleep(max(0.0, cut_at + 8.0 - time.time()))  # an 8 s partition
            host.mend()

        # Moved to the other worker as attempt 2, which finished the whole answer.
        assert done["worker"] == "cpu-b"
        assert done["attempt"] == 2
        assert done["response"] == f"Echo from {MODEL}: {PROMPT[:200]}"

        # The cut-off worker comes back, and is live again (it pulls again).
        await eventually(lambda: _a_live(client), timeout_s=20)

        a_calls = [c for c in await _fake_calls(host_ollama) if c["started_at"] >= since]
        b_calls = [c for c in local.calls() if c["started_at"] >= since]
        assert len(a_calls) == 1, a_calls
        assert len(b_calls) == 1, b_calls
        a_call, b_call = a_calls[0], b_calls[0]
        # The cut-off worker stopped its generation (about 2.5 s after its last stored
        # heartbeat, well before it would have ended), and before the other one began.
        assert a_call["ended_at"] is not None
        assert a_call["ended_at"] - cut_at < TTL_S
        assert a_call["ended_at"] < b_call["started_at"], (a_call, b_call)

        # Moving the task told the attempt it replaced to stop.
        moves = [n for n in notices if n["task_id"] == task_id]
        assert moves and moves[0]["up_to_attempt"] == 1, notices

    # Its log says why it stopped, in terms an operator can act on, and that it is back. (Read
    # while it runs: it says it is back a moment after the heartbeat the test saw was stored.)
    log = await logged(worker_a, "heartbeats stored again; pulling tasks again")
    assert "out of touch with NATS" in log
    assert "Check the network between this host and the NATS server" in log
    worker_a.send_signal(signal.SIGTERM)


async def _a_live(client: Client) -> bool:
    """Has the cut-off worker stored a heartbeat since the link came back?"""
    body, _ = await request(client, "coordinator.workers", {}, timeout_s=2.0)
    return any(
        w["worker_id"] == "gpu-a" and time.time() - w["last_heartbeat"] < 1.0
        for w in body["workers"]
    )


async def test_a_client_leaves_a_server_cut_off_without_a_reset_for_another_one(
    bus: NatsServer, host: NetnsHost
) -> None:
    """A server whose link is cut sends no reset: only the client's own pings tell it the
    connection is dead. It moves to the next server of ``NATS_URL`` within a few pings, not
    the client library's default of minutes."""
    with tempfile.TemporaryDirectory(prefix="coord-nats-far-") as store:
        far = NatsServer(store, listen=host.ip, wrap=host.command()).start()
        try:
            nc = await _connected_beside(f"{far.url},{bus.url}", host.ip)
            try:
                host.cut()
                await eventually(
                    lambda: _connected_to(nc, "127.0.0.1"),
                    timeout_s=4 * PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1),
                    interval_s=0.2,
                )
                # It works there: a message goes round through the near server.
                got: asyncio.Queue[bytes] = asyncio.Queue()

                async def on_msg(msg: Msg) -> None:
                    await got.put(msg.data)

                await nc.subscribe("test.cut.echo", cb=on_msg)
                await nc.publish("test.cut.echo", b"here")
                assert await asyncio.wait_for(got.get(), 5) == b"here"
            finally:
                host.mend()
                await nc.close()
        finally:
            far.stop()


async def _connected_beside(url: str, address: str) -> Client:
    """A client given ``url`` that picked the server at ``address`` (it picks at random)."""
    for _ in range(40):
        nc = await connect(url, "test-cut-client")
        if await _connected_to(nc, address):
            return nc
        await nc.close()
    raise AssertionError(f"the client never connected to {address}")


async def _connected_to(nc: Client, address: str) -> bool:
    return nc.is_connected and nc.connected_url is not None and nc.connected_url.hostname == address
