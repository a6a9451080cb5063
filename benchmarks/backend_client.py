"""The HTTP client under the Ollama backend: CPU and wall time per streamed call, per library.

    .venv/bin/python -m benchmarks.backend_client [--calls 2000] [--rounds 3] [--warmup 200]

Starts the instant Ollama stand-in (`benchmarks.standin`, its own process, so its CPU is not
counted) on loopback and makes, from this process, ``--calls`` streamed ``POST /api/chat``
calls one after the other with each client, after ``--warmup`` calls of it:

- ``backend``: the whole ``OllamaBackend.generate`` (the backends' HTTP client,
  `services.backends.http`, with the answer parsed and the connection kept): what a worker
  spends per generation on the backend's side;
- ``httpx``: ``AsyncClient.stream`` and ``aiter_lines``;
- ``aiohttp``: ``ClientSession.post`` and the body read line by line (``async for`` on
  ``content``).

(The small hand-written HTTP/1.1 client the figures of 2026-12-01 compare with, ``http1``,
was retired for one library: it is in the git history.)

Each call sends the same body (encoded per call with msgspec, as the backend does) and reads
the answer to its end, line by line; every client keeps its connection between calls. A round
runs each client once, in a rotated order; per client the figure is the process time
(``time.process_time()``, user + system of this process) and the wall time divided by the
calls, and the median over the rounds. The table and ``benchmarks/results/
backend-client-<time>.json`` give each round, the medians and the load average.

"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Final

import aiohttp
import httpx
import msgspec

from benchmarks.stack import load_average, median, table, write_result
from schemas.route import ToolCall
from schemas.work import Work
from services.backends.ollama import OllamaBackend

MODEL: Final = "qwen2.5:0.5b"
BODY: Final = {
    "model": MODEL,
    "stream": True,
    "messages": [{"role": "user", "content": "Say something short."}],
    "options": {"temperature": 0},
}
HEADERS: Final = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}
PATH: Final = "/api/chat"

_encoder = msgspec.json.Encoder()

# One call: send the body, read the answer's lines to the end; returns the lines read.
Call = Callable[[], Awaitable[int]]


@asynccontextmanager
async def backend_client(base_url: str) -> AsyncIterator[Call]:
    backend = OllamaBackend(base_url)
    work = Work(prompt="Say something short.", options={"temperature": 0})

    async def call() -> int:
        pieces = 0

        async def on_chunk(
            response: str, thinking: str, tool_calls: list[ToolCall] | None = None
        ) -> None:
            nonlocal pieces
            pieces += 1

        generation = await backend.generate(MODEL, work, timeout_s=30, on_chunk=on_chunk)
        assert generation.response
        return pieces + 1  # the text pieces and the final line

    try:
        yield call
    finally:
        await backend.aclose()


@asynccontextmanager
async def httpx_client(base_url: str) -> AsyncIterator[Call]:
    client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=5.0))

    async def call() -> int:
        lines = 0
        async with client.stream(
            "POST", PATH, content=_encoder.encode(BODY), headers=HEADERS
        ) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line:
                    lines += 1
        return lines

    try:
        yield call
    finally:
        await client.aclose()


@asynccontextmanager
async def aiohttp_client(base_url: str) -> AsyncIterator[Call]:
    session = aiohttp.ClientSession(
        base_url=base_url, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0)
    )

    async def call() -> int:
        lines = 0
        async with session.post(PATH, data=_encoder.encode(BODY), headers=HEADERS) as reply:
            assert reply.status == 200
            async for line in reply.content:
                if line.strip():
                    lines += 1
        return lines

    try:
        yield call
    finally:
        await session.close()


CLIENTS: dict[str, Callable[[str], AbstractAsyncContextManager[Call]]] = {
    "backend": backend_client,
    "httpx": httpx_client,
    "aiohttp": aiohttp_client,
}


async def run_one(name: str, base_url: str, calls: int, warmup: int) -> dict[str, float]:
    async with CLIENTS[name](base_url) as call:
        for _ in range(warmup):
            await call()
        walls: list[float] = []
        cpu_started = time.process_time()
        started = time.perf_counter()
        for _ in range(calls):
            began = time.perf_counter()
            lines = await call()
            walls.append(time.perf_counter() - began)
            if lines != 3:  # two text lines and the final one
                raise RuntimeError(f"{name}: {lines} lines in an answer")
        wall = time.perf_counter() - started
        cpu = time.process_time() - cpu_started
    return {
        "cpu_ms_per_call": round(cpu * 1000 / calls, 4),
        "wall_ms_per_call": round(wall * 1000 / calls, 4),
        "wall_p50_ms": round(median(walls) * 1000, 4),
    }


async def measure(
    names: list[str], base_url: str, calls: int, rounds: int, warmup: int
) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for number in range(rounds):
        order = names[number % len(names) :] + names[: number % len(names)]
        load = load_average()
        figures = {name: await run_one(name, base_url, calls, warmup) for name in order}
        runs.append({"round": number + 1, "order": order, "load_average": load, **figures})
        print(
            f"round {number + 1}: "
            + ", ".join(f"{n} {figures[n]['cpu_ms_per_call']:.3f} ms CPU" for n in names)
            + f" (load {load[0]})",
            file=sys.stderr,
        )
    medians = {
        name: {
            key: round(median([r[name][key] for r in runs]), 4)
            for key in ("cpu_ms_per_call", "wall_ms_per_call", "wall_p50_ms")
        }
        for name in names
    }
    return {
        "setup": {
            "standin": "benchmarks.standin (instant, 2 text lines + the final line)",
            "request": f"POST {PATH}, stream, read line by line, connection kept",
            "calls_per_round": calls,
            "warmup_per_round": warmup,
            "rounds": rounds,
            "versions": {"httpx": httpx.__version__, "aiohttp": aiohttp.__version__},
        },
        "runs": runs,
        "median_of_rounds": medians,
    }


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_for(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.backend_client", description=__doc__
    )
    parser.add_argument("--calls", type=int, default=2000, help="per client per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=200, help="per client per round")
    parser.add_argument(
        "--clients", default=",".join(CLIENTS), help="comma-separated: backend,httpx,aiohttp"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.clients.split(",") if n]
    port = _free_port()
    standin = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.standin", "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    try:
        _wait_for(port)
        figure = asyncio.run(
            measure(
                names,
                f"http://127.0.0.1:{port}",
                args.calls,
                args.rounds,
                args.warmup,
            )
        )
    finally:
        standin.terminate()
        standin.wait(10)
    path = write_result("backend-client", figure)
    m = figure["median_of_rounds"]
    rows: list[list[Any]] = []
    for name in names:
        row: list[Any] = [name]
        row += [r[name]["cpu_ms_per_call"] for r in figure["runs"]]
        row += [m[name]["cpu_ms_per_call"], m[name]["wall_ms_per_call"], m[name]["wall_p50_ms"]]
        rows.append(row)
    headers = [
        "client",
        *(f"CPU ms, round {r['round']}" for r in figure["runs"]),
        "CPU ms/call",
        "wall ms/call",
        "wall p50 ms",
    ]
    print(table(headers, rows))
    print(f"medians of {args.rounds} rounds of {args.calls} calls; {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
