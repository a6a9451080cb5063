"""The first connection to NATS: a CLI command gives up at once, a service waits for NATS.

Real processes (the ``coordinator`` command) against a port where nothing listens, a port that
accepts connections but never speaks, and a nats-server started later on the port.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import nats
import pytest

from devtools.servers import NatsServer, free_port
from services.errors import StopRequested
from services.runtime.bus import connect
from tests.harness import COORDINATOR, Processes, clean_env, eventually, request, run_cli

WAITING = "cannot reach NATS; trying again"


@contextmanager
def silent_server() -> Iterator[str]:
    """A NATS URL whose port accepts connections (the kernel's backlog) but never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"nats://127.0.0.1:{s.getsockname()[1]}"


def log_lines_until(proc: subprocess.Popen[str], event: str, count: int) -> list[dict[str, Any]]:
    """Read the service's JSON log lines until ``count`` of them are ``event`` (or it exits)."""
    assert proc.stdout is not None
    seen: list[dict[str, Any]] = []
    for line in proc.stdout:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            seen.append(entry)
            if len(seen) >= count:
                break
    return seen


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(("workers",), id="workers"),
        pytest.param(("task", "some-task"), id="task"),
        pytest.param(("ask", "hi", "--model", "m"), id="ask"),
    ],
)
def test_a_cli_command_fails_at_once_naming_nats_when_nothing_listens(
    args: tuple[str, ...],
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    began = time.monotonic()
    result = run_cli(*args, env=clean_env(NATS_URL=url), timeout=30)
    assert result.returncode == 1
    assert (
        result.stderr.strip()
        == f"error unavailable: cannot reach NATS at {url}: connection refused"
    )
    assert result.stdout == ""
    assert time.monotonic() - began < 20


def test_a_cli_command_given_a_cluster_names_every_url_it_tried() -> None:
    urls = [f"nats://127.0.0.1:{free_port()}" for _ in range(3)]
    result = run_cli("workers", env=clean_env(NATS_URL=",".join(urls)), timeout=30)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"error unavailable: cannot reach NATS at {', '.join(urls)}: connection refused"
    )


async def test_a_client_given_a_cluster_connects_to_a_server_that_is_up(
    nats_server: NatsServer,
) -> None:
    # The first two are down: each is tried, and the third one answers.
    down = [f"nats://127.0.0.1:{free_port()}" for _ in range(2)]
    nc = await connect(",".join([*down, nats_server.url]), "test", connect_timeout_s=5.0)
    try:
        assert nc.connected_url is not None and nc.connected_url.port == nats_server.port
    finally:
        await nc.close()


async def test_a_node_that_never_answers_costs_one_servers_timeout_and_the_next_is_tried(
    nats_server: NatsServer,
) -> None:
    """A cluster node that is powered off answers nothing: the client gives it its connect
    timeout and goes on to the next server, whichever order it tries them in (nats.py
    shuffles them), instead of spending the whole attempt on it."""
    with silent_server() as silent:
        for _ in range(6):  # about half of them try the silent one first
            nc = await connect(f"{silent},{nats_server.url}", "test", connect_timeout_s=1.0)
            try:
                assert nc.connected_url is not None and nc.connected_url.port == nats_server.port
            finally:
                await nc.close()


def test_a_malformed_server_in_nats_url_stops_a_service_naming_it() -> None:
    result = run_cli(
        "router", env=clean_env(NATS_URL="nats://127.0.0.1:4222, nats://a host:4222"), timeout=30
    )
    assert result.returncode == 2
    assert "NATS_URL: 'nats://a host:4222' is malformed" in result.stderr


def test_a_cli_command_gives_up_on_a_server_that_never_answers() -> None:
    with silent_server() as url:
        result = run_cli("workers", env=clean_env(NATS_URL=url), timeout=30)
    assert result.returncode == 1
    # open_client's bound: one connection attempt of at most 3 s, not endless retries.
    assert (
        result.stderr.strip()
        == f"error unavailable: cannot reach NATS at {url}: no answer within 3 s"
    )


async def test_a_service_waits_for_nats_logging_each_attempt_and_stops_on_sigterm(
    processes: Processes,
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    router = processes.start([COORDINATOR, "router"], clean_env(NATS_URL=url))
    waits = await asyncio.wait_for(asyncio.to_thread(log_lines_until, router, WAITING, 2), 60)
    assert len(waits) == 2, router.poll()
    assert all(w["level"] == "warning" for w in waits)
    assert all(w["url"] == url and w["error"] == "connection refused" for w in waits)
    assert [w["attempt"] for w in waits] == [1, 2]
    assert router.poll() is None

    router.send_signal(signal.SIGTERM)
    # Promptly, and the usual way: exit status 0.
    assert await asyncio.to_thread(router.wait, 5) == 0


async def test_a_service_started_before_nats_connects_once_nats_is_up(
    processes: Processes,
) -> None:
    port = free_port()
    url = f"nats://127.0.0.1:{port}"
    router = processes.start([COORDINATOR, "router"], clean_env(NATS_URL=url))
    await asyncio.wait_for(asyncio.to_thread(log_lines_until, router, WAITING, 1), 60)

    with tempfile.TemporaryDirectory(prefix="coord-nats-") as store:
        server = NatsServer(store, port).start()
        try:
            nc = await nats.connect(url)
            try:

                async def answers() -> dict[str, Any] | None:
                    try:
                        body, _ = await request(nc, "coordinator.workers", {}, timeout_s=1.0)
                    except Exception:
                        return None
                    return body

                body = await eventually(answers, timeout_s=30, interval_s=0.2)
                assert body["workers"] == []
            finally:
                await nc.close()
            router.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(router.wait, 15) == 0
        finally:
            server.stop()


async def test_stop_interrupts_a_connection_attempt_in_progress() -> None:
    stop = asyncio.Event()
    with silent_server() as url:
        asyncio.get_running_loop().call_later(0.5, stop.set)
        began = time.monotonic()
        with pytest.raises(StopRequested):
            # Without the stop, this attempt would wait 60 s for the server's INFO.
            await connect(url, "test", connect_timeout_s=60.0, stop=stop)
    assert time.monotonic() - began < 10
