"""A stop ends, within its budget and with status 0, whatever became of the bus: every
service as its own process, stopped while its nats-server is gone for good (killed: the
client reconnects in vain) or no longer answers (SIGSTOP: the connection still looks up, and
a drain waits on it). And the one helper every service closes its connection with."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Literal

import nats
import pytest
from nats.aio.msg import Msg

from devtools.fakes.ollama import FakeOllama
from devtools.fakes.searxng import FakeSearxng
from devtools.servers import NatsServer, free_port
from services.cli.stopping import budget_of
from services.gateway.settings import GatewaySettings
from services.reaper.settings import ReaperSettings
from services.router.settings import RouterSettings
from services.runtime.lifecycle import CANCEL_S, CLOSE_S, DRAIN_S, close_bus
from services.runtime.settings import Settings, WebSearchSettings, WorkerSettings
from services.stats.settings import StatsSettings
from tests.harness import COORDINATOR, Processes, clean_env, eventually, logged

Away = Literal["killed", "stopped"]

# service: (command, the log line that says it is ready, its settings)
SERVICES: dict[str, tuple[list[str], str, type[Settings]]] = {
    "router": (["router"], "router ready", RouterSettings),
    "worker": (["worker"], "worker ready", WorkerSettings),
    "web-search": (["web-search"], "worker ready", WebSearchSettings),
    "reaper": (["reaper"], "reaper ready", ReaperSettings),
    "stats": (["stats", "serve"], "stats ready", StatsSettings),
    "gateway": (["gateway"], "gateway ready", GatewaySettings),
}


@pytest.fixture
def searxng() -> Iterator[FakeSearxng]:
    with FakeSearxng() as fake:
        yield fake


def take_bus_away(server: NatsServer, how: Away) -> None:
    assert server.proc is not None
    if how == "killed":
        server.proc.kill()
        server.proc.wait()
    else:
        os.kill(server.proc.pid, signal.SIGSTOP)


def bring_back(server: NatsServer, how: Away) -> None:
    if how == "stopped" and server.proc is not None:
        os.kill(server.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("how", ["killed", "stopped"])
@pytest.mark.parametrize("service", list(SERVICES))
async def test_a_service_stopped_while_the_bus_is_away_exits_within_its_budget_with_0(
    service: str,
    how: Away,
    nats_server: NatsServer,
    ollama: FakeOllama,
    searxng: FakeSearxng,
    pg_dsn: str,
    processes: Processes,
) -> None:
    command, ready, settings_type = SERVICES[service]
    env = clean_env(
        NATS_URL=nats_server.url,
        OLLAMA_HOST=ollama.url,
        SEARXNG_URL=searxng.url,
        PG_DSN=pg_dsn,
        WORKER_ID="web-1" if service == "web-search" else "cpu-1",
        GATEWAY_PORT=str(free_port()),
        STOP_GRACE_S="2",
    )
    budget_s = budget_of(settings_type.from_env(env))
    proc = processes.start([COORDINATOR, *command], env)
    await logged(proc, ready, timeout_s=30)
    take_bus_away(nats_server, how)
    try:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = await asyncio.to_thread(proc.communicate, timeout=budget_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{service} did not exit within its budget of {budget_s:g} s")
    finally:
        bring_back(nats_server, how)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in out + err
    assert "stop overran its budget" not in out  # ended by itself, not cut short


async def test_a_connection_closes_whatever_the_bus_state(nats_server: NatsServer) -> None:
    # The most close_bus may take: a drain cut short, then a close cut short, each cancelled.
    bound_s = DRAIN_S + CLOSE_S + 2 * CANCEL_S + 5.0

    connected = await nats.connect(nats_server.url)
    got: list[bytes] = []

    async def handle(msg: Msg) -> None:
        got.append(msg.data)

    await connected.subscribe("hello", cb=handle)
    await connected.publish("hello", b"in hand")
    await connected.flush()
    async with asyncio.timeout(bound_s):
        await close_bus(connected)
    assert connected.is_closed
    assert got == [b"in hand"]  # drained: the message in hand was handled
    async with asyncio.timeout(bound_s):
        await close_bus(connected)  # again: nothing to do, nothing raised

    unanswered = await nats.connect(nats_server.url)
    await unanswered.subscribe("hello", cb=handle)
    take_bus_away(nats_server, "stopped")
    try:
        async with asyncio.timeout(bound_s):
            await close_bus(unanswered)  # the drain waits on a server that never answers
    finally:
        bring_back(nats_server, "stopped")
    assert unanswered.is_closed

    reconnecting = await nats.connect(
        nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2
    )
    take_bus_away(nats_server, "killed")

    async def reconnecting_now() -> bool:
        return reconnecting.is_reconnecting

    await eventually(reconnecting_now)
    async with asyncio.timeout(bound_s):
        await close_bus(reconnecting)  # nats.py refuses to drain: closed all the same
    assert reconnecting.is_closed
