"""``coordinator up`` stopped by SIGINT and by SIGTERM, again and again: each time it exits
with status 0 and leaves nothing behind (no process of its group, no nats-server or
PostgreSQL of its home, no stack.json). A stack that was killed is named as such by the
commands that read its stack.json, and the next ``coordinator up`` replaces it.

The trials are `benchmarks.up_stop`'s, which runs a hundred of them."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import suppress
from pathlib import Path
from typing import Final

from benchmarks.up_stop import run_trial, start_up, stop_up, up_env, wait_ready
from devtools.fakes.ollama import FakeOllama
from services.cli import stackfile
from tests.harness import run_cli

# What these catch is a stop that never ends. The stack stops in a second or two
# (`benchmarks.up_stop` measures it); only past this long does a stop count as hung.
HUNG_AFTER_S: Final = 60.0

# (signal, seconds the stack runs after it is ready, whether it answers one ask first)
TRIALS: Final = [
    (signal.SIGINT, 0.0, False),
    (signal.SIGTERM, 0.0, False),
    (signal.SIGINT, 0.5, False),
    (signal.SIGTERM, 1.5, False),
    (signal.SIGINT, 0.2, True),
    (signal.SIGTERM, 0.0, True),
]


async def test_coordinator_up_stopped_again_and_again_ends_each_time_leaving_nothing(
    tmp_path: Path, ollama: FakeOllama, pg_dsn: str
) -> None:
    failed = []
    for n, (sig, after_s, asking) in enumerate(TRIALS):
        home = tmp_path / f"home-{n}"
        env = up_env(home, ollama.url, pg_dsn)
        trial = await asyncio.to_thread(
            run_trial, home, env, sig, after_s, asking=asking, within_s=HUNG_AFTER_S
        )
        if not trial.ok:
            failed.append(f"trial {n}: {trial.describe()}")
    assert failed == []


async def test_coordinator_up_stops_the_postgresql_it_started(
    tmp_path: Path, ollama: FakeOllama
) -> None:
    home = tmp_path / "home"
    env = up_env(home, ollama.url, pg_dsn=None)
    trial = await asyncio.to_thread(
        run_trial, home, env, signal.SIGTERM, 0.0, within_s=HUNG_AFTER_S
    )
    assert trial.ok, trial.describe()
    assert not (home / "pg" / "postmaster.pid").exists()


async def test_a_killed_stack_is_named_by_commands_and_replaced_by_the_next_up(
    tmp_path: Path, ollama: FakeOllama, pg_dsn: str
) -> None:
    home = tmp_path / "home"
    state = home / "stack.json"
    env = up_env(home, ollama.url, pg_dsn)
    first = start_up(home, env)
    try:
        await asyncio.to_thread(wait_ready, first, home)
        left = stackfile.read(state)
        assert left is not None
        assert left.pid == first.pid
        assert left.nats_pid is not None
    finally:
        # Killed outright: its nats-server (a session of its own) and stack.json stay.
        with suppress(ProcessLookupError):
            os.kill(first.pid, signal.SIGKILL)
        first.wait()
    assert stackfile.is_running(left.nats_pid, left.nats_started)

    shown = await asyncio.to_thread(run_cli, "workers", env=env)
    assert shown.returncode == 1
    assert shown.stderr == (
        f"error unavailable: the stack recorded in {state} is not running "
        f"(pid {first.pid} gone); start it with `coordinator up` or remove the file\n"
    )

    second = start_up(home, env)
    try:
        banner = await asyncio.to_thread(wait_ready, second, home)
        assert f"{state}: its stack (pid {first.pid}) is gone; replacing it" in banner
        assert f"stopped the nats-server it left running (pid {left.nats_pid})" in banner
        assert not stackfile.is_running(left.nats_pid, left.nats_started)
        now = stackfile.read(state)
        assert now is not None
        assert now.pid == second.pid

        # A second stack on the same home is refused, and the running one's record kept.
        refused = await asyncio.to_thread(run_cli, "up", env=env)
        assert refused.returncode == 2
        assert f"a stack already runs from {home} (coordinator up, pid {second.pid}" in (
            refused.stderr
        )
        assert stackfile.read(state) == now

        workers = await asyncio.to_thread(run_cli, "workers", env=env)
        assert workers.returncode == 0, workers.stderr
    finally:
        trial = await asyncio.to_thread(stop_up, second, home, signal.SIGINT, HUNG_AFTER_S)
    assert trial.ok, trial.describe()
