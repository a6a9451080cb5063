"""Stopping ``coordinator up``: does it end, within seconds, leaving nothing behind, every time?

    .venv/bin/python -m benchmarks.up_stop [--runs 100] [--embedded-pg] [--seed N]

Each run starts ``coordinator up`` in a session of its own, with a fresh ``COORDINATOR_HOME``,
an Ollama stand-in (``devtools/fakes/ollama.py``) and a scratch database on the machine's
PostgreSQL (``--embedded-pg``: the embedded one ``up`` starts when ``PG_DSN`` is unset). It
waits for the ``ready`` line, lets the stack run a moment (drawn per run: none, up to 0.2 s,
or up to 2 s, a third each; every fifth run first answers one ``coordinator ask``), sends
SIGINT or SIGTERM (in turn), and checks that:

- ``up`` exits within ``--within`` seconds (default 10) with status 0, saying ``stack
  stopped``;
- nothing it started still runs: no process of its process group, none whose command line
  names its home (its nats-server, runs in a session of its own; an embedded PostgreSQL);
- ``stack.json`` is gone.

It prints each failed run, then the runs, the failures and the seconds from the signal to the
exit (p50, p95, max), and writes them to ``benchmarks/results/up-stop-<time>.json``. Exit
status: 1 when any run failed. ``tests/integration/test_up_stop.py`` runs a few of these
trials in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Final

from benchmarks.stack import load_average, percentile, table, write_result
from devtools.fakes.ollama import FakeOllama
from devtools.servers import Postgres, free_port

COORDINATOR: Final = str(Path(sys.executable).parent / "coordinator")
MODEL: Final = "qwen2.5:0.5b"
READY_TIMEOUT_S: Final = 60.0
# How long a run may take to exit before it counts as failed (the benchmark's target).
WITHIN_S: Final = 10.0
# Settings a run must not inherit from this process's environment.
_UNSET: Final = ("NATS_URL", "PG_DSN", "OLLAMA_HOST", "WORKER_ID", "WORKER_SUPPORTS")


@dataclass
class Trial:
    """One start and stop of ``coordinator up``, and what was found after."""

    signal: str
    after_s: float
    asked: bool
    exit_s: float | None = None
    """Seconds from the signal to the exit; None: it did not exit in time (then killed)."""
    status: int | None = None
    said_stopped: bool = False
    left: list[str] = field(default_factory=list)
    """Processes of the stack still running after it exited."""
    stack_file_left: bool = False
    problem: str = ""
    """Why it failed before the stop (it never got ready, the ask failed)."""

    @property
    def ok(self) -> bool:
        return (
            not self.problem
            and self.exit_s is not None
            and self.status == 0
            and self.said_stopped
            and not self.left
            and not self.stack_file_left
        )

    def describe(self) -> str:
        if self.problem:
            return self.problem
        if self.exit_s is None:
            return f"no exit {self.signal} + {self.after_s:.2f} s; left: {self.left}"
        return (
            f"{self.signal} after {self.after_s:.2f} s: exit {self.status} in {self.exit_s:.2f} s"
            f"{'' if self.said_stopped else ', no “stack stopped”'}"
            f"{f', left running: {self.left}' if self.left else ''}"
            f"{', stack.json left' if self.stack_file_left else ''}"
        )


def up_env(home: Path, ollama_url: str, pg_dsn: str | None) -> dict[str, str]:
    """The environment of one ``coordinator up``: this one without Coordinator settings."""
    env = {k: v for k, v in os.environ.items() if k not in _UNSET}
    env.update(
        LOG_FORMAT="json",
        OLLAMA_HOST=ollama_url,
        COORDINATOR_HOME=str(home),
        GATEWAY_PORT=str(free_port()),
    )
    if pg_dsn is not None:
        env["PG_DSN"] = pg_dsn
    return env


def start_up(home: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """``coordinator up`` in a session of its own (its process group is its pid), its
    output to files in ``home``."""
    home.mkdir(parents=True, exist_ok=True)
    with (home / "up.stdout").open("wb") as out, (home / "up.stderr").open("wb") as err:
        return subprocess.Popen(
            [COORDINATOR, "up"], env=env, stdout=out, stderr=err, start_new_session=True
        )


def wait_ready(up: subprocess.Popen[bytes], home: Path, timeout_s: float = READY_TIMEOUT_S) -> str:
    """Wait for ``up``'s ``ready`` line; returns its banner. Raises if it ends or never gets
    there."""
    deadline = time.monotonic() + timeout_s
    banner = ""
    while time.monotonic() < deadline:
        banner = (home / "up.stderr").read_text(errors="replace")
        if any(line.startswith("ready") for line in banner.splitlines()):
            return banner
        if up.poll() is not None:
            raise RuntimeError(f"coordinator up ended early ({up.returncode}): {banner}")
        time.sleep(0.05)
    raise RuntimeError(f"coordinator up not ready in {timeout_s:g} s: {banner}")


def ask(env: dict[str, str], timeout_s: float = 30.0) -> str | None:
    """One ``coordinator ask`` (again while the worker is still registering); None when it
    was answered, else why not."""
    deadline = time.monotonic() + timeout_s
    while True:
        done = subprocess.run(
            [COORDINATOR, "ask", "1+1は？", "--model", MODEL],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if done.returncode == 0:
            return None
        if "no_worker" not in done.stderr or time.monotonic() > deadline:
            return f"ask failed ({done.returncode}): {done.stderr.strip()}"
        time.sleep(0.2)


def leftovers(pgid: int, home: Path) -> list[str]:
    """Processes still running that a stack started: in its process group (``up`` ran as its
    leader), or naming its home on their command line (nats-server's store, PostgreSQL's
    data directory)."""
    shown = subprocess.run(
        ["ps", "-eo", "pid=,pgid=,stat=,args="], capture_output=True, text=True, check=True
    )
    left = []
    for line in shown.stdout.splitlines():
        pid, group, stat, args = [*line.split(None, 3), ""][:4]
        if stat.startswith("Z"):
            continue  # ended, not yet reaped by its parent
        if int(group) == pgid or str(home) in args:
            left.append(f"{pid} {args}")
    return left


def stop_up(up: subprocess.Popen[bytes], home: Path, sig: signal.Signals, within_s: float) -> Trial:
    """Send ``sig`` to ``up`` and check how it ended (killing what is left, if anything)."""
    trial = Trial(signal=sig.name, after_s=0.0, asked=False)
    began = time.monotonic()
    up.send_signal(sig)
    try:
        up.wait(within_s)
        trial.exit_s = time.monotonic() - began
        trial.status = up.returncode
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        up.wait()
    trial.said_stopped = "stack stopped" in (home / "up.stderr").read_text(errors="replace")
    trial.left = leftovers(up.pid, home)
    trial.stack_file_left = (home / "stack.json").exists()
    for entry in trial.left:  # leave nothing behind for the next run either
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(entry.split()[0]), signal.SIGKILL)
    return trial


def run_trial(
    home: Path,
    env: dict[str, str],
    sig: signal.Signals,
    after_s: float,
    *,
    asking: bool = False,
    within_s: float = WITHIN_S,
) -> Trial:
    """Start ``coordinator up``, let it run ``after_s`` (answering one ask first when
    ``asking``), stop it with ``sig``; what was found."""
    up = start_up(home, env)
    try:
        wait_ready(up, home)
        problem = ask(env) if asking else None
        time.sleep(after_s)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        problem = str(exc)
    trial = stop_up(up, home, sig, within_s)
    trial.after_s, trial.asked, trial.problem = after_s, asking, problem or ""
    return trial


async def _scratch_database(postgres: Postgres) -> str:
    await postgres.start()
    return await postgres.create_database()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.up_stop", description=__doc__)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--embedded-pg", action="store_true", help="leave PG_DSN unset")
    parser.add_argument("--within", type=float, default=WITHIN_S, help="seconds to exit")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    rng = random.Random(seed)
    trials: list[Trial] = []
    postgres = Postgres()
    with ExitStack() as stack, FakeOllama() as ollama:
        pg_dsn = None if args.embedded_pg else asyncio.run(_scratch_database(postgres))
        stack.callback(postgres.stop)
        for n in range(args.runs):
            home = Path(tempfile.mkdtemp(prefix="coord-up-stop-"))
            sig = signal.SIGINT if n % 2 == 0 else signal.SIGTERM
            trial = run_trial(
                home,
                up_env(home, ollama.url, pg_dsn),
                sig,
                # A third right at the ready line (the services still starting: where stops
                # hung), a third within 0.2 s of it, a third later.
                round(rng.choice([0.0, rng.uniform(0.0, 0.2), rng.uniform(0.2, 2.0)]), 3),
                asking=n % 5 == 4,
                within_s=args.within,
            )
            trials.append(trial)
            if trial.ok:
                shutil.rmtree(home, ignore_errors=True)
            else:
                print(f"run {n + 1} FAILED: {trial.describe()} (logs in {home})", flush=True)
        if pg_dsn is not None:
            asyncio.run(postgres.drop_database(pg_dsn))
    exits = [t.exit_s for t in trials if t.exit_s is not None]
    failed = [t for t in trials if not t.ok]
    exit_s = {
        "p50": round(percentile(exits, 50), 2),
        "p95": round(percentile(exits, 95), 2),
        "max": round(max(exits, default=float("nan")), 2),
    }
    figure = {
        "runs": len(trials),
        "failed": len(failed),
        "embedded_pg": args.embedded_pg,
        "within_s": args.within,
        "seed": seed,
        "exit_s": exit_s,
        "load_average": load_average(),
        "failures": [asdict(t) for t in failed],
    }
    print(
        table(
            ["runs", "failed", "exit p50 s", "exit p95 s", "exit max s"],
            [[len(trials), len(failed), *exit_s.values()]],
        )
    )
    print(f"written to {write_result('up-stop', figure)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
