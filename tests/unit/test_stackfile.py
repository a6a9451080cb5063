"""The stack file: a stack that was killed is told apart from one that runs, and said so."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.cli import stackfile
from services.cli.client import find_nats_url, find_pg_dsn
from services.cli.stackfile import StackRecord
from services.errors import Unavailable


def gone_pid() -> int:
    """The id of a process that has ended and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_record_reads_back_as_written_and_a_broken_one_as_none(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    assert stackfile.read(path) is None
    record = StackRecord(nats_url="nats://127.0.0.1:4222", pg_dsn="postgresql://x", pid=1)
    stackfile.write(path, record)
    assert stackfile.read(path) == record
    assert [p.name for p in tmp_path.iterdir()] == ["stack.json"]  # no partial file left
    path.write_text('{"nats_url": ')
    assert stackfile.read(path) is None


def test_a_record_from_before_the_processes_were_timed_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    path.write_text('{"nats_url": "nats://127.0.0.1:4222", "pg_dsn": "postgresql://x", "pid": 7}')
    assert stackfile.read(path) == StackRecord(
        nats_url="nats://127.0.0.1:4222", pg_dsn="postgresql://x", pid=7
    )


def test_this_process_runs_and_one_that_ended_does_not() -> None:
    me = os.getpid()
    assert stackfile.is_running(me, stackfile.process_started(me))
    assert stackfile.is_running(me, None)
    assert not stackfile.is_running(gone_pid(), None)


def test_a_process_id_used_again_by_another_process_is_not_the_stack() -> None:
    me = os.getpid()
    if stackfile.process_started(me) is None:
        pytest.skip("this system cannot say when a process started")
    assert not stackfile.is_running(me, "a start long ago")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="zombies are read from /proc")
def test_a_process_that_ended_but_was_not_reaped_does_not_run() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.01)  # until it has ended (its parent, this test, has not reaped it)
        assert not stackfile.is_running(proc.pid, None)
    finally:
        proc.wait()


def test_a_stop_of_a_leftover_touches_only_the_process_recorded() -> None:
    # A process id whose start does not match is someone else's now: left alone.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not stackfile.stop_leftover(sleeper.pid, "a start long ago")
        assert sleeper.poll() is None
        started = stackfile.process_started(sleeper.pid)
        if started is None:
            pytest.skip("this system cannot say when a process started")
        assert stackfile.stop_leftover(sleeper.pid, started)
        assert sleeper.wait(timeout=10) != 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_commands_say_a_stack_that_was_killed_is_not_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.setenv("COORDINATOR_HOME", str(tmp_path))
    assert find_nats_url() == "nats://127.0.0.1:4222"  # no stack recorded
    path = tmp_path / "stack.json"
    me = os.getpid()
    running = StackRecord(nats_url="nats://127.0.0.1:4999", pid=me, started=None)
    stackfile.write(path, running)
    assert find_nats_url() == "nats://127.0.0.1:4999"
    dead = gone_pid()
    stackfile.write(path, StackRecord(nats_url="nats://127.0.0.1:4999", pid=dead))
    with pytest.raises(Unavailable) as raised:
        find_nats_url()
    assert raised.value.message == (
        f"the stack recorded in {path} is not running (pid {dead} gone); "
        "start it with `coordinator up` or remove the file"
    )
    monkeypatch.setenv("NATS_URL", "nats://elsewhere:4222")
    assert find_nats_url() == "nats://elsewhere:4222"  # NATS_URL comes first


def test_the_doctor_takes_the_stacks_postgresql_only_for_the_stacks_nats_and_pg_dsn_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PG_DSN", raising=False)
    monkeypatch.setenv("COORDINATOR_HOME", str(tmp_path))
    stack_nats = "nats://127.0.0.1:4999"
    assert find_pg_dsn(stack_nats) is None  # no stack recorded
    path = tmp_path / "stack.json"
    running = StackRecord(nats_url=stack_nats, pg_dsn="postgresql://stack/db", pid=os.getpid())
    stackfile.write(path, running)
    assert find_pg_dsn(stack_nats) == "postgresql://stack/db"
    # Beside another NATS (NATS_URL names one), the stack's PostgreSQL is not that fleet's.
    assert find_pg_dsn("nats://elsewhere:4222") is None
    stackfile.write(path, StackRecord(nats_url=stack_nats, pg_dsn="", pid=os.getpid()))
    assert find_pg_dsn(stack_nats) is None  # a record from before it started PostgreSQL
    stackfile.write(path, StackRecord(nats_url=stack_nats, pg_dsn="postgresql://x", pid=gone_pid()))
    assert find_pg_dsn(stack_nats) is None  # killed: its addresses serve nothing
    monkeypatch.setenv("PG_DSN", "postgresql://mine/db")
    stackfile.write(path, running)
    assert find_pg_dsn(stack_nats) == "postgresql://mine/db"  # PG_DSN comes first
