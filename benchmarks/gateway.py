"""The gateway's added latency and its throughput, against the Ollama stand-in called directly.

    .venv/bin/python -m benchmarks.gateway [--requests 400] [--workers 4] [--clients 8]

It starts its own nats-server (the pinned wheel's, temporary store), the Ollama stand-in, the
router, ``--workers`` workers and the gateway, each as its own process started the way an
operator starts them (``coordinator router`` etc., configured by the environment only). Then:

- **latency at one client**: ``POST /api/generate`` (``"stream": false``, a one-token answer),
  alternately to the stand-in directly and to the gateway, ``--requests`` of each after a
  warm-up; p50 and p99 of each, and the gateway's added time (the difference). The same
  requests over NATS (``coordinator.route`` with ``wait``), without HTTP in front, show how
  the added time splits between the gateway and the fleet behind it.
- **CPU per request**: the CPU time (user + system) each process spent on ``--requests``
  gateway requests, divided by their number: what a request costs where, whatever else the
  machine runs at the time (latency on a busy 2-core machine is mostly waiting for a core).
- **throughput**: ``--clients`` clients sending as fast as they can through the gateway for
  ``--seconds``; requests per second (and the stand-in's own figure for comparison).

The figures, and the machine they were measured on, go to
``benchmarks/results/gateway-<time>.json``.

Target: p50 added at most 3 ms (popular Python LLM routers add about 12 ms per request on
these machines).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
import nats

from devtools.servers import free_port, running_nats, wait_for_port

RESULTS: Final = Path(__file__).resolve().parent / "results"
ROOT: Final = Path(__file__).resolve().parent.parent
COORDINATOR: Final = str(Path(sys.executable).parent / "coordinator")
TARGET_P50_ADDED_MS: Final = 3.0
MODEL: Final = "qwen2.5:0.5b"
PROMPT: Final = "1+1は？"
BODY: Final = {"model": MODEL, "prompt": PROMPT, "stream": False}


@contextmanager
def process(args: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """A child process, stopped with SIGTERM (then SIGKILL) at the end."""
    proc = subprocess.Popen(
        args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def environment(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("NATS_", "WORKER_"))}
    return {**keep, "LOG_FORMAT": "json", **extra}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(ms: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(ms, 0.50), 3),
        "p99_ms": round(percentile(ms, 0.99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
    }


async def timed(call: Callable[[], Awaitable[None]]) -> float:
    started = time.perf_counter()
    await call()
    return (time.perf_counter() - started) * 1000


async def latency(direct: str, gateway: str, nats_url: str, requests: int) -> dict[str, Any]:
    """One client: stand-in, gateway and bare NATS route calls, interleaved."""
    nc = await nats.connect(nats_url)
    route = msgspec.json.encode({"prompt": PROMPT, "model": MODEL, "wait": True})
    async with httpx.AsyncClient(timeout=30) as http:

        async def via_http(base: str) -> None:
            reply = await http.post(f"{base}/api/generate", json=BODY)
            reply.raise_for_status()

        async def via_nats() -> None:
            reply = await nc.request("coordinator.route", route, timeout=30)
            assert b'"done"' in reply.data, reply.data

        calls = {
            "direct": lambda: via_http(direct),
            "gateway": lambda: via_http(gateway),
            "nats_route": via_nats,
        }
        for _ in range(50):  # warm-up: connections, caches, the model "loaded"
            for call in calls.values():
                await call()
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(requests):
            for name, call in calls.items():
                times[name].append(await timed(call))
    await nc.close()
    figures = {name: summary(ms) for name, ms in times.items()}
    for name in ("gateway", "nats_route"):
        figures[f"{name}_added"] = {
            "p50_ms": round(figures[name]["p50_ms"] - figures["direct"]["p50_ms"], 3),
            "p99_ms": round(figures[name]["p99_ms"] - figures["direct"]["p99_ms"], 3),
        }
    return figures


async def throughput(base: str, clients: int, seconds: float) -> dict[str, float]:
    """``clients`` clients sending back to back for ``seconds``: requests per second."""
    done = 0
    failed = 0
    deadline = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal done, failed
        while time.monotonic() < deadline:
            reply = await http.post(f"{base}/api/generate", json=BODY)
            if reply.status_code == 200:
                done += 1
            else:
                failed += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        started = time.monotonic()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.monotonic() - started
    return {"requests_per_s": round(done / elapsed, 1), "done": done, "failed": failed}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def cpu_per_request(
    gateway: str, processes: dict[str, int], requests: int
) -> dict[str, float]:
    """CPU milliseconds each process spends per gateway request (one client)."""
    before = {name: cpu_s(pid) for name, pid in processes.items()}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(requests):
            (await http.post(f"{gateway}/api/generate", json=BODY)).raise_for_status()
    return {
        name: round((cpu_s(pid) - before[name]) * 1000 / requests, 3)
        for name, pid in processes.items()
    }


def wait_until_served(gateway: str, workers: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            tags = httpx.get(f"{gateway}/api/tags", timeout=2).json()["models"]
            if tags and len(tags[0].get("workers", [])) >= workers:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{workers} workers did not register within {timeout_s:g} s")


def run(requests: int, workers: int, clients: int, seconds: float) -> dict[str, Any]:
    with ExitStack() as stack:
        server = stack.enter_context(running_nats())
        ollama_port, gateway_port = free_port(), free_port()
        direct = f"http://127.0.0.1:{ollama_port}"
        gateway = f"http://127.0.0.1:{gateway_port}"
        standin = stack.enter_context(
            process(
                [sys.executable, "-m", "devtools.fakes.ollama", "--port", str(ollama_port)],
                environment(),
            )
        )
        wait_for_port(ollama_port, timeout_s=60)
        env = environment(NATS_URL=server.url, OLLAMA_HOST=direct, GATEWAY_PORT=str(gateway_port))
        pids = {"stand-in": standin.pid}
        assert server.proc is not None
        pids["nats-server"] = server.proc.pid
        pids["router"] = stack.enter_context(process([COORDINATOR, "router"], env)).pid
        for n in range(workers):
            worker = process([COORDINATOR, "worker"], {**env, "WORKER_ID": f"w{n}"})
            pids[f"worker w{n}"] = stack.enter_context(worker).pid
        pids["gateway"] = stack.enter_context(process([COORDINATOR, "gateway"], env)).pid
        wait_for_port(gateway_port, timeout_s=60)
        wait_until_served(gateway, workers)
        figures = asyncio.run(latency(direct, gateway, server.url, requests))
        figures["cpu_ms_per_request"] = asyncio.run(cpu_per_request(gateway, pids, requests))
        figures["throughput_gateway"] = asyncio.run(throughput(gateway, clients, seconds))
        figures["throughput_direct"] = asyncio.run(throughput(direct, clients, seconds))
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gateway", description=__doc__)
    parser.add_argument("--requests", type=int, default=400, help="per target, one client")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8, help="for the throughput run")
    parser.add_argument("--seconds", type=float, default=10.0, help="for the throughput run")
    args = parser.parse_args(argv)

    figures = run(args.requests, args.workers, args.clients, args.seconds)
    print(f"{'one client':<24} {'p50 ms':>8} {'p99 ms':>8}")
    for name in ("direct", "gateway", "nats_route", "gateway_added", "nats_route_added"):
        row = figures[name]
        print(f"{name:<24} {row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f}")
    print(
        "CPU ms per gateway request: "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in figures["cpu_ms_per_request"].items())
    )
    for name in ("throughput_gateway", "throughput_direct"):
        row = figures[name]
        print(f"{name:<24} {row['requests_per_s']:>8.1f} req/s  ({row['failed']} failed)")
    added = figures["gateway_added"]["p50_ms"]
    verdict = "met" if added <= TARGET_P50_ADDED_MS else "MISSED"
    print(f"target p50 added <= {TARGET_P50_ADDED_MS:g} ms: {verdict} ({added:.2f} ms)")

    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    result = {
        "benchmark": "gateway",
        "at": stamp,
        "settings": vars(args),
        "figures": figures,
        "target_p50_added_ms": TARGET_P50_ADDED_MS,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
    }
    path = RESULTS / f"gateway-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
