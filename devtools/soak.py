"""Run chosen tests many times in a row and list every failure with its log.

A test that fails one run in twenty fails CI one day in twenty: a flake is found by running what
a change touched again and again before it is merged, not by retrying it in CI. Each run is a
fresh pytest process (its own servers, its own event loop); its whole output is kept under
``--logs`` (default ``.soak/<time>/run-<n>.log``), and the summary names each failed test with
the run and the log that show it. The exit status is 0 only when every run passed.

    scripts/soak -n 20 tests/integration/test_routers.py
    scripts/soak -n 20 --timing          # the timing-sensitive files, 20 runs each
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Final

# The files whose tests depend most on timing (faults, restarts, several routers, processes,
# settling after a reconnect, the cluster, partitions, follow-ups, stalls, lost settlements).
TIMING_SENSITIVE: Final = (
    "tests/integration/test_cluster_faults.py",
    "tests/integration/test_kill_restart.py",
    "tests/integration/test_restarts.py",
    "tests/integration/test_routers.py",
    "tests/integration/test_processes.py",
    "tests/integration/test_settling.py",
    "tests/integration/test_cluster.py",
    "tests/integration/test_partition.py",
    "tests/integration/test_follow.py",
    "tests/integration/test_stall.py",
    "tests/integration/test_acks.py",
)
_FAILED: Final = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
_SUMMARY: Final = re.compile(
    r"^=* ?(\d+ (?:passed|failed|error|skipped|deselected).*? in [\d.]+s)", re.MULTILINE
)


def run_once(tests: list[str], log: Path, pytest_args: list[str]) -> tuple[int, list[str], str]:
    """One pytest run of ``tests``, its output written to ``log``: (exit status, the tests that
    failed or errored, pytest's summary line)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args]
    with log.open("w") as out:
        status = subprocess.call([*command, *tests], stdout=out, stderr=subprocess.STDOUT)
    text = log.read_text(errors="replace")
    summary = _SUMMARY.findall(text)
    return status, _FAILED.findall(text), summary[-1] if summary else f"exit status {status}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", nargs="*", help="test files or node ids (pytest's syntax)")
    parser.add_argument("-n", "--runs", type=int, default=20, help="runs of each (default 20)")
    parser.add_argument(
        "--timing", action="store_true", help="add the timing-sensitive files to the tests"
    )
    parser.add_argument(
        "--each", action="store_true", help="run each file on its own (else all in one run)"
    )
    parser.add_argument("--logs", type=Path, help="where to keep each run's output")
    parser.add_argument("--pytest", default="", help="more pytest arguments, space-separated")
    args = parser.parse_args(argv)
    tests = list(args.tests) + (list(TIMING_SENSITIVE) if args.timing else [])
    if not tests or args.runs < 1:
        parser.error("name at least one test (or --timing), and at least one run")
    logs = args.logs or Path(".soak") / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    groups = [[t] for t in tests] if args.each else [tests]
    failures: list[tuple[str, str]] = []  # (test, log)
    failed_runs = 0
    started = time.monotonic()
    for group in groups:
        name = Path(group[0].split("::")[0]).stem if len(group) == 1 else "all"
        for run in range(1, args.runs + 1):
            log = logs / f"{name}-run-{run:03d}.log"
            status, failed, summary = run_once(group, log, args.pytest.split())
            mark = "ok  " if status == 0 else "FAIL"
            print(f"{mark} {name} run {run}/{args.runs}: {summary}", flush=True)
            if status != 0:
                failed_runs += 1
                failures += [(test, str(log)) for test in failed or [f"{name} (exit {status})"]]
    total = len(groups) * args.runs
    minutes = (time.monotonic() - started) / 60
    print(f"\n{total - failed_runs} of {total} runs passed in {minutes:.1f} min; logs in {logs}")
    if failures:
        print("failures:")
        for test, count in Counter(test for test, _ in failures).most_common():
            where = ", ".join(log for t, log in failures if t == test)
            print(f"  {count}x {test}\n      {where}")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
