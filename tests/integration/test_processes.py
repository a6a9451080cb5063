"""Services as separate processes, the way a fleet runs them: the ``coordinator`` command."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import nats
from nats.aio.client import Client

from benchmarks.up_stop import up_env
from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from services.cli.stack import DEFAULT_NATS_PORT, embedded_nats
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    request,
    run_cli,
    workers_live,
)

MODEL = "qwen2.5:0.5b"


def worker_env(nats_server: NatsServer, ollama: FakeOllama, worker_id: str) -> dict[str, str]:
    return clean_env(
        NATS_URL=nats_server.url,
        OLLAMA_HOST=ollama.url,
        WORKER_ID=worker_id,
        WORKER_HOST="box-a",
        HEARTBEAT_INTERVAL_S="0.5",
        WORKER_TTL_S="3",
    )


async def test_a_second_process_with_the_same_worker_id_is_refused_naming_the_holder(
    nats_server: NatsServer, nc: Client, ollama: FakeOllama, processes: Processes
) -> None:
    env = worker_env(nats_server, ollama, "cpu-1")
    first = processes.start([COORDINATOR, "worker"], env)
    await workers_live_via_kv(nc, "cpu-1")

    calls_before = ollama.stats()["generate_calls"]
    second = processes.start([COORDINATOR, "worker"], {**env, "WORKER_HOST": "box-b"})
    _, stderr = await asyncio.to_thread(second.communicate, timeout=30)
    # Refused before its sanity runs: the shared backend saw nothing of it.
    assert ollama.stats()["generate_calls"] == calls_before

    assert second.returncode != 0
    assert "duplicate_worker" in stderr
    assert "already running: host box-a" in stderr
    assert f"pid {first.pid}" in stderr
    assert "started 20" in stderr
    assert first.poll() is None


async def workers_live_via_kv(nc: Client, worker_id: str) -> None:
    kv = None
    for _ in range(200):
        try:
            kv = await nc.jetstream().key_value("workers")
            entry = await kv.get(worker_id)
            # Listing its models: past its sanity runs, not only holding its lease.
            if msgspec.json.decode(entry.value or b"{}").get("models"):
                return
        except Exception:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"worker {worker_id} never registered (bucket: {kv})")


async def test_two_processes_bound_to_one_worker_queue_never_run_two_tasks_at_once(
    nats_server: NatsServer,
    nc: Client,
    ollama: FakeOllama,
    processes: Processes,
    runner: ServiceRunner,
) -> None:
    env = worker_env(nats_server, ollama, "cpu-1")
    processes.start([COORDINATOR, "worker"], env)
    await workers_live_via_kv(nc, "cpu-1")
    puller = processes.start([sys.executable, "-m", "tests.integration.second_puller"], env)
    assert puller.stdout is not None
    assert (await asyncio.to_thread(puller.stdout.readline)).strip() == "bound"
    runner.router(nats_server.url)
    await workers_live(nc, 1)
    ollama.delay_s = 0.2
    calls_before = ollama.stats()["generate_calls"]  # the workers' sanity runs
    ended = await nc.subscribe("events.task.*.*.completed")

    for i in range(8):
        body, _ = await request(nc, "coordinator.route", {"prompt": f"{i}+1", "model": MODEL})
        assert body["status"] == "queued"
    for _ in range(8):
        await ended.next_msg(timeout=30)

    stats = ollama.stats()
    assert stats["generate_calls"] - calls_before == 8
    assert stats["concurrent_max"] == 1


async def wait_until_ready(up: subprocess.Popen[str]) -> str:
    """Read ``coordinator up``'s banner up to its ``ready`` line."""
    assert up.stderr is not None
    banner: list[str] = []
    while not any(line.startswith("ready") for line in banner):
        line = await asyncio.to_thread(up.stderr.readline)
        if not line:
            out, err = await asyncio.to_thread(up.communicate, timeout=15)
            raise AssertionError(f"coordinator up ended early: {''.join(banner)}{err}\n{out}")
        banner.append(line)
    return "".join(banner)


async def test_coordinator_up_runs_the_stack_that_ask_and_task_then_use(
    tmp_path: Path, ollama: FakeOllama, processes: Processes, pg_dsn: str
) -> None:
    env = clean_env(OLLAMA_HOST=ollama.url, COORDINATOR_HOME=str(tmp_path / "home"), PG_DSN=pg_dsn)
    up = processes.start([COORDINATOR, "up"], env)
    text = await wait_until_ready(up)
    assert "(embedded, store" in text
    assert "Ctrl-C" in text
    assert (tmp_path / "home" / "stack.json").exists()

    answer = await asyncio.to_thread(run_cli, "ask", "1+1は？", "--model", MODEL, env=env)
    for _ in range(100):  # the worker may still be registering
        if answer.returncode == 0:
            break
        assert "no_worker" in answer.stderr, answer.stderr
        await asyncio.sleep(0.2)
        answer = await asyncio.to_thread(run_cli, "ask", "1+1は？", "--model", MODEL, env=env)
    assert answer.returncode == 0, answer.stderr
    assert answer.stdout.strip() == "2"
    task_id = answer.stderr.split()[1]

    shown = await asyncio.to_thread(run_cli, "task", task_id, env=env)
    for _ in range(50):  # the projection follows the event log within moments
        if shown.returncode == 0 and "done" in shown.stdout:
            break
        await asyncio.sleep(0.1)
        shown = await asyncio.to_thread(run_cli, "task", task_id, env=env)
    assert shown.returncode == 0, shown.stderr
    assert "status  done" in shown.stdout
    assert "durations  total" in shown.stdout
    assert "response  2" in shown.stdout

    workers = await asyncio.to_thread(run_cli, "workers", env=env)
    assert MODEL in workers.stdout

    unknown = await asyncio.to_thread(run_cli, "ask", "hi", "--model", "nope:1b", env=env)
    assert unknown.returncode == 1
    assert unknown.stderr.startswith("error no_worker:")

    up.send_signal(signal.SIGINT)
    _, rest = await asyncio.to_thread(up.communicate, timeout=30)
    assert up.returncode == 0, rest
    assert "stack stopped" in rest
    assert not (tmp_path / "home" / "stack.json").exists()


async def logged(up: subprocess.Popen[str], *events: str) -> None:
    """Read ``up``'s log (JSON lines on stdout) until each of ``events`` has been logged."""
    assert up.stdout is not None
    waiting = set(events)
    while waiting:
        line = await asyncio.to_thread(up.stdout.readline)
        if not line:
            raise AssertionError(f"coordinator up ended before logging {sorted(waiting)}")
        if line.startswith("{"):
            waiting.discard(msgspec.json.decode(line).get("event"))


def as_a_shell_runs_it(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``command`` run by ``sh`` as typed, in ``cwd``, with no Coordinator setting and a
    ``PATH`` without the project's virtualenv."""
    env = {k: v for k, v in clean_env().items() if k != "COORDINATOR_HOME"}
    env["PATH"] = "/usr/bin:/bin"
    return subprocess.run(
        ["/bin/sh", "-c", command],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_banner_of_coordinator_up_names_commands_and_a_dashboard_that_work_as_printed(
    tmp_path: Path, ollama: FakeOllama, processes: Processes, pg_dsn: str
) -> None:
    home = tmp_path / "home"
    env = up_env(home, ollama.url, pg_dsn)
    up = processes.start([COORDINATOR, "up"], env)
    banner = await wait_until_ready(up)
    assert up.stderr is not None
    ask_line = banner.splitlines()[-1]
    workers_line = await asyncio.to_thread(up.stderr.readline)
    await logged(up, "router ready", "worker ready", "gateway ready")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    dashboards = [line.split()[1] for line in banner.splitlines() if line.startswith("dashboard")]
    asked = await asyncio.to_thread(as_a_shell_runs_it, ask_line.removeprefix("ready"), elsewhere)
    listed = await asyncio.to_thread(as_a_shell_runs_it, workers_line, elsewhere)
    async with httpx.AsyncClient(timeout=30) as http:
        page = await http.get(dashboards[0])

    # The executable that runs, by its absolute path, and the stack's home, which is not the
    # default one: what a new shell needs to find the stack.
    assert os.path.isabs(COORDINATOR)
    assert ask_line == (
        f'ready       COORDINATOR_HOME={home} {COORDINATOR} ask "1+1は？" --model {MODEL}'
    )
    assert workers_line == f"            COORDINATOR_HOME={home} {COORDINATOR} workers\n"
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout == "2\n"
    assert listed.returncode == 0, listed.stderr
    assert MODEL in listed.stdout
    assert dashboards == [f"http://127.0.0.1:{env['GATEWAY_PORT']}/dashboard"]
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")

    up.send_signal(signal.SIGINT)
    await asyncio.to_thread(up.communicate, timeout=30)
    assert up.returncode == 0


async def test_coordinator_up_says_plainly_when_ollama_cannot_be_reached(
    tmp_path: Path, processes: Processes, pg_dsn: str
) -> None:
    env = clean_env(
        OLLAMA_HOST="http://127.0.0.1:9", COORDINATOR_HOME=str(tmp_path / "home"), PG_DSN=pg_dsn
    )
    up = processes.start([COORDINATOR, "up"], env)
    banner = await wait_until_ready(up)
    assert "Ollama at http://127.0.0.1:9 cannot be reached" in banner
    up.send_signal(signal.SIGINT)
    await asyncio.to_thread(up.communicate, timeout=30)
    assert up.returncode == 0


async def test_coordinator_up_starts_an_embedded_postgresql_when_pg_dsn_is_unset(
    tmp_path: Path, ollama: FakeOllama, processes: Processes
) -> None:
    env = clean_env(OLLAMA_HOST=ollama.url, COORDINATOR_HOME=str(tmp_path / "home"))
    up = processes.start([COORDINATOR, "up"], env)
    banner = await wait_until_ready(up)
    assert "(embedded)" in banner.split("PostgreSQL", 1)[1].split("\n", 1)[0]

    # The stats service answers from that database: an unknown task is a clean not_found.
    shown = await asyncio.to_thread(run_cli, "task", "no-such-task", env=env)
    assert shown.returncode == 1
    assert shown.stderr.startswith("error not_found:"), shown.stderr

    up.send_signal(signal.SIGINT)
    await asyncio.to_thread(up.communicate, timeout=30)
    assert up.returncode == 0


def test_a_worker_with_a_malformed_setting_stops_at_start_naming_it() -> None:
    result = run_cli("worker", env=clean_env(HEARTBEAT_INTERVAL_S="soon"))
    assert result.returncode == 2
    assert "HEARTBEAT_INTERVAL_S='soon' is malformed" in result.stderr


async def test_an_embedded_nats_server_with_4222_taken_listens_where_it_says(
    tmp_path: Path,
) -> None:
    """`coordinator up` with 4222 taken (the machine's own NATS, or a listener held here): the
    server picks its own port, and the URL handed on is the one in its ports file, never a port
    freed for it that another process could have taken meanwhile."""
    with contextlib.ExitStack() as held:
        listener = held.enter_context(socket.socket())
        with contextlib.suppress(OSError):  # taken already: by the machine's NATS
            listener.bind(("127.0.0.1", DEFAULT_NATS_PORT))
            listener.listen()
        with embedded_nats(tmp_path) as server:
            assert not server.url.endswith(f":{DEFAULT_NATS_PORT}")
            nc = await nats.connect(server.url, allow_reconnect=False)
            try:
                await nc.jetstream().add_stream(name="HERE", subjects=["here"])
            finally:
                await nc.close()
            # The stream is in this server's store: the URL is this server's.
            assert _found(tmp_path / "nats", "HERE")
            assert _found(tmp_path, f"nats-server_{server.pid}.ports")
    assert not _found(tmp_path, "nats-server_*.ports")  # gone with the server


def _found(under: Path, pattern: str) -> list[Path]:
    return list(under.rglob(pattern))
