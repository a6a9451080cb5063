"""The nightly benchmark through the real router and workers (Ollama stand-ins), with the stats
service keeping its history in a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.events import BenchFinished, BenchResult, BenchStarted, any_event_decoder
from schemas.subjects import EVENTS_STREAM
from services.errors import NoWorker
from services.stats.bench import Bench
from services.stats.bench_prompts import BenchPrompt
from services.stats.bench_report import BenchReport, warnings
from tests.harness import ServiceRunner, clean_env, eventually, request, run_cli, workers_live

MODEL = "qwen2.5:0.5b"
MUL = BenchPrompt("mul", "math", "What is 17*23? Answer with the number only.")


@dataclass
class Fleet:
    """Router, stats and two workers: ``cpu-a`` on ``fake_a`` (two models), ``cpu-b`` on
    ``fake_b`` (one)."""

    nc: Client
    fake_a: FakeOllama
    fake_b: FakeOllama


@pytest.fixture
async def fleet(
    nats_server: NatsServer, pg_dsn: str, nc: Client, runner: ServiceRunner
) -> AsyncIterator[Fleet]:
    with FakeOllama(models=[MODEL, "gemma3:1b"]) as fake_a, FakeOllama(models=[MODEL]) as fake_b:
        runner.router(nats_server.url)
        runner.stats(nats_server.url, pg_dsn)
        runner.worker(nats_server.url, fake_a.url, "cpu-a")
        runner.worker(nats_server.url, fake_b.url, "cpu-b")
        await workers_live(nc, 2)
        yield Fleet(nc, fake_a, fake_b)
        # The services stop before the stand-ins and the database go.
        await runner.stop_all()


async def bench(
    nc: Client, prompts: list[BenchPrompt], models: list[str] | None = None, timeout_s: float = 10
) -> tuple[BenchReport, list[str]]:
    lines: list[str] = []
    report = await Bench(nc, timeout_s=timeout_s, say=lines.append).run(prompts, models)
    return report, lines


async def bench_events(nc: Client, run_id: str) -> list[Any]:
    js = nc.jetstream()
    sub = await js.subscribe(
        f"events.bench.{run_id}.>", stream=EVENTS_STREAM, ordered_consumer=True
    )
    events = []
    try:
        while True:
            msg = await sub.next_msg(timeout=2)
            events.append(any_event_decoder.decode(msg.data))
            if msg.metadata.num_pending == 0:
                return events
    finally:
        await sub.unsubscribe()


async def baseline_runs(nc: Client, worker: str) -> int:
    body, _ = await request(nc, "coordinator.stats.baselines", {"models": [MODEL]})
    return max((b["runs"] for b in body["baselines"] if b["worker"] == worker), default=0)


async def test_every_model_runs_on_every_worker_serving_it_and_the_run_is_recorded(
    fleet: Fleet,
) -> None:
    nc = fleet.nc
    prompts = [MUL, BenchPrompt("hello", "general", "Say hello.")]

    report, lines = await bench(nc, prompts)
    events = await bench_events(nc, report.run_id)

    pairs = sorted({(r.model, r.worker) for r in report.results})
    assert pairs == [("gemma3:1b", "cpu-a"), (MODEL, "cpu-a"), (MODEL, "cpu-b")]
    assert (len(report.results), report.failed, report.exit_status) == (6, 0, 0)
    assert all(line.startswith("done ") for line in lines)
    assert any(line.endswith(f"ms {MODEL} (cpu-b) [mul]") for line in lines)
    # Durations are the backend's own, from the task's `completed` event.
    assert all(r.total_ms is not None and r.total_ms > 0 for r in report.results)
    assert [type(e) for e in events] == [BenchStarted] + [BenchResult] * 6 + [BenchFinished]
    assert {e.index for e in events if isinstance(e, BenchResult)} == set(range(6))
    assert events[-1].ok == 6
    assert [c.ratio for c in report.comparisons] == [None, None, None]  # no history yet


async def test_a_worker_at_twice_its_baseline_is_warned_about_and_an_excluded_night_is_no_baseline(
    fleet: Fleet,
) -> None:
    nc, fake_b = fleet.nc, fleet.fake_b
    for fake in (fleet.fake_a, fleet.fake_b):
        fake.configure(delay_s=0.2)

    first, _ = await bench(nc, [MUL], [MODEL])
    await eventually(lambda: _at_least(baseline_runs(nc, "cpu-b"), 1))

    # cpu-b now runs twice (the duplicate-worker night): three times slower here.
    polluted_since = time.time()
    fake_b.configure(delay_s=0.6)
    second, _ = await bench(nc, [MUL], [MODEL])
    await eventually(lambda: _at_least(baseline_runs(nc, "cpu-b"), 2))

    excluded, _ = await request(
        nc,
        "coordinator.stats.exclude",
        {"worker": "cpu-b", "since": polluted_since, "until": time.time(), "reason": "dup"},
    )
    third, _ = await bench(nc, [MUL], [MODEL])

    assert first.exit_status == 0
    assert [c.worker for c in second.slow] == ["cpu-b"]
    assert second.exit_status == 3
    [warning] = warnings(second)
    assert warning.startswith(f"warning: {MODEL} on cpu-b ran at ")
    # The excluded night does not become the norm: tonight is still compared with the clean one.
    slow = {c.worker: c for c in third.comparisons}
    assert excluded["worker"] == "cpu-b"
    assert slow["cpu-b"].slow and slow["cpu-b"].baseline_runs == 1
    assert not slow["cpu-a"].slow and slow["cpu-a"].baseline_runs == 2


async def _at_least(count: Any, wanted: int) -> bool | None:
    return True if await count >= wanted else None


async def test_failures_show_as_they_happen_and_the_exit_status_says_so(
    nats_server: NatsServer, fleet: Fleet, tmp_path: Path
) -> None:
    fleet.fake_b.configure(delay_s=5.0)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"name": "mul", "prompt": MUL.prompt}]))
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path / "home"))

    result = await asyncio.to_thread(
        run_cli,
        "bench",
        "--models",
        f"{MODEL},llama-9000",
        "--prompts",
        str(prompts),
        "--timeout",
        "1",
        env=env,
    )

    assert result.returncode == 1, result.stderr
    out = result.stdout.splitlines()
    assert f"error - {MODEL} (cpu-b) timed out [mul]" in out
    assert "error - llama-9000 (-) no live worker serves it [mul]" in out
    assert any(line.startswith("done ") and f"{MODEL} (cpu-a) [mul]" in line for line in out)
    assert out[-1].endswith("1 done, 2 failed, 0 slow")
    assert any(line.startswith("MODEL") and "BASELINE_MS" in line for line in out)


async def test_with_no_live_worker_there_is_nothing_to_benchmark(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)

    async def router_up() -> bool | None:
        try:
            await request(nc, "coordinator.workers", {}, timeout_s=1)
        except Exception:
            return None
        return True

    await eventually(router_up)
    with pytest.raises(NoWorker):
        await bench(nc, [MUL])


def test_a_prompt_file_is_read_and_a_bad_one_refused(tmp_path: Path) -> None:
    from services.errors import ConfigError
    from services.stats.bench import load_prompts

    lines = tmp_path / "prompts.txt"
    lines.write_text("# nightly\nWhat is 2+2?\n\nPythonでソートを書いて\n")
    listed = tmp_path / "prompts.json"
    listed.write_text(json.dumps(["Say hi.", {"prompt": "Name a colour.", "name": "colour"}]))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "x", "dommain": "code"}]))

    assert [(p.name, p.domain) for p in load_prompts(lines)] == [
        ("prompt-1", "math"),
        ("prompt-2", "code"),
    ]
    assert [p.name for p in load_prompts(listed)] == ["prompt-1", "colour"]
    for path in (bad, tmp_path / "missing.txt"):
        with pytest.raises(ConfigError) as raised:
            load_prompts(path)
        assert str(path) in raised.value.message
