"""The gateway's dashboard and metrics over a real stack: nats-server, PostgreSQL, the Ollama
stand-ins, router, reaper, stats, workers (one of them a process of its own, to be killed) and
the gateway. The page is opened in a real browser (Debian's chromium, driven by playwright);
``/metrics`` is scraped and parsed as Prometheus parses it."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import EVENTS_STREAM, WORKERS_BUCKET
from schemas.workers import worker_record_decoder
from services.stats.bench import Bench
from services.stats.bench_prompts import BenchPrompt
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    workers_live,
)
from tests.integration.test_gateway import start_gateway
from tests.integration.test_gateway_keys import add_key, bearer

PLAIN = "qwen2.5:0.5b"
SMALL = "gemma3:1b"
CHROMIUM = "/usr/bin/chromium"
GRAFANA = Path(__file__).parents[2] / "deploy" / "grafana" / "coordinator.json"
ARTIFACTS = Path(__file__).parents[1] / "artifacts"
MUL = BenchPrompt("mul", "math", "What is 17*23? Answer with the number only.")


# -- metrics -------------------------------------------------------------------------------------


def scrape(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, by name and labels."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def grafana_metric_names() -> set[str]:
    """The metric names every query of the Grafana dashboard uses."""
    exprs = [
        target["expr"]
        for panel in json.loads(GRAFANA.read_text())["panels"]
        for target in panel.get("targets", [])
    ]
    assert exprs, "the dashboard queries nothing"
    return {name for expr in exprs for name in re.findall(r"\bcoordinator_[a-z_]+\b", expr)}


def family_of(name: str) -> str:
    """The metric family a sample name belongs to (a counter's ``_total``, a histogram's
    ``_bucket``, ``_sum`` and ``_count``)."""
    return re.sub(r"_(total|bucket|sum|count)$", "", name)


async def test_metrics_are_projections_of_real_tasks(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, pg_dsn: str
) -> None:
    with FakeOllama(models=[PLAIN], load_ms=1500.0) as fake:
        runner.stats(nats_server.url, pg_dsn)
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        key = await add_key(nc, "prometheus")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)
        fake.reset()  # the sanity run loaded the model: the first task loads it again, cold
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            refused = await http.get("/metrics")
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
            for prompt in ("1+1", "2+2"):
                done = await http.post(
                    "/api/generate",
                    json={"model": PLAIN, "prompt": prompt, "stream": False},
                    headers=bearer(key),
                )
                assert done.status_code == 200, done.text
            fake.fail_status = 400  # refused: a failure no other worker is asked to repeat
            failed = await http.post(
                "/api/generate",
                json={"model": PLAIN, "prompt": "3+3", "stream": False},
                headers=bearer(key),
            )
            fake.fail_status = None
            assert failed.status_code == 502

            async def settled() -> dict[Any, float] | None:
                text = (await http.get("/metrics", headers=bearer(key))).text
                samples = scrape(text)
                lag = value(samples, "coordinator_stats_lag_events")
                ended = value(
                    samples,
                    "coordinator_task_outcomes_total",
                    model=PLAIN,
                    worker="cpu-1",
                    kind="inference",
                    outcome="backend_error",
                )
                return samples if lag == 0 and ended == 1 else None

            samples = await eventually(settled, timeout_s=15, interval_s=0.3)
            response = await http.get("/metrics", headers=bearer(key))
        info = await nc.jetstream().stream_info(EVENTS_STREAM)
        entry = await (await nc.jetstream().key_value(WORKERS_BUCKET)).get("cpu-1")
        health = worker_record_decoder.decode(entry.value or b"").health
        await runner.stop_all()

    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    labels = {"model": PLAIN, "worker": "cpu-1"}
    ok = {**labels, "kind": "inference", "outcome": "done"}
    assert value(samples, "coordinator_task_outcomes_total", **ok) == 2
    assert value(samples, "coordinator_tasks_submitted_total", model=PLAIN, kind="inference") == 3
    durations = {**labels, "kind": "inference"}
    assert value(samples, "coordinator_task_duration_seconds_count", **durations) == 2
    assert (value(samples, "coordinator_task_duration_seconds_sum", **durations) or 0) > 1.5
    assert value(samples, "coordinator_time_to_first_token_seconds_count", **labels) == 2
    assert value(samples, "coordinator_cold_loads_total", **labels) == 1  # the first call only
    assert value(samples, "coordinator_model_load_seconds_count", **labels) == 2
    assert (value(samples, "coordinator_generated_tokens_total", **labels) or 0) > 0
    assert value(samples, "coordinator_worker_up", worker="cpu-1") == 1
    # As the worker's own probe says in the registry (the failure makes it probe its backend).
    healthy = value(samples, "coordinator_worker_healthy", worker="cpu-1")
    assert healthy == (1 if health == "healthy" else 0)
    assert value(samples, "coordinator_worker_queue_depth", worker="cpu-1") == 0
    assert value(samples, "coordinator_worker_in_flight", worker="cpu-1") == 0
    assert value(samples, "coordinator_tasks_open", status="running") == 0
    assert value(samples, "coordinator_event_log_messages") == info.state.messages
    assert value(samples, "coordinator_event_log_last_sequence") == info.state.last_seq
    assert value(samples, "coordinator_gateway_projected_sequence") == info.state.last_seq
    # submitted, routed, started and an outcome per task, at least.
    assert (value(samples, "coordinator_events_read_total", family="task") or 0) >= 12
    # Every metric the Grafana dashboard queries is one the gateway exposes.
    families = {family.name for family in text_string_to_metric_families(response.text)}
    missing = {name for name in grafana_metric_names() if family_of(name) not in families}
    assert missing == set()


# -- the page, in a real browser ---------------------------------------------------------------


@dataclass
class Fleet:
    """Stats, router, reaper, two workers on stand-ins of their own (``cpu-2`` a process, so it
    can be killed) and the gateway, which wants the key ``key``."""

    nc: Client
    url: str
    key: str
    fake_a: FakeOllama
    fake_b: FakeOllama
    cpu2: Any


@pytest.fixture
async def fleet(
    nats_server: NatsServer,
    nc: Client,
    runner: ServiceRunner,
    processes: Processes,
    pg_dsn: str,
) -> AsyncIterator[Fleet]:
    with (
        FakeOllama(models=[PLAIN, SMALL], load_ms=800.0) as fake_a,
        FakeOllama(models=[PLAIN, SMALL], load_ms=1200.0, copy="rebuilt") as fake_b,
    ):
        runner.stats(nats_server.url, pg_dsn)
        runner.router(nats_server.url)
        runner.reaper(nats_server.url)
        # A probe a second while degraded: a worker that failed a task is healthy again soon.
        runner.worker(nats_server.url, fake_a.url, "cpu-1", health_interval_s=1.0)
        env = clean_env(
            NATS_URL=nats_server.url,
            OLLAMA_HOST=fake_b.url,
            WORKER_ID="cpu-2",
            WORKER_HOST="host-cpu-2",
            HEARTBEAT_INTERVAL_S="0.5",
            WORKER_TTL_S="3",
            ACK_WAIT_S="6",
            HEALTH_INTERVAL_S="1",
        )
        cpu2 = processes.start([COORDINATOR, "worker"], env)
        key = await add_key(nc, "browser")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 2, timeout_s=30)
        for fake in (fake_a, fake_b):
            fake.reset()  # the sanity runs loaded the models: the first tasks load them, cold
        yield Fleet(nc, url, key, fake_a, fake_b, cpu2)
        await runner.stop_all()


async def projected(nc: Client) -> None:
    """Wait until the stats service has applied every event stored."""

    async def caught_up() -> bool:
        info = await nc.jetstream().consumer_info(EVENTS_STREAM, "stats")
        return not info.num_pending and not info.num_ack_pending

    await eventually(caught_up, timeout_s=15)


async def history(fleet: Fleet, http: httpx.AsyncClient) -> None:
    """Tasks of both models on both workers at varied speeds, a failure, and three nightly
    bench runs, the last one slow on ``cpu-1``: what the charts and tables have to show."""
    for i in range(12):
        worker, fake = ("cpu-1", fleet.fake_a) if i % 2 else ("cpu-2", fleet.fake_b)
        fake.delay_s = 0.05 * (i % 5)
        body: dict[str, Any] = {
            "prompt": f"{i}+{i}",
            "model": (PLAIN, SMALL)[i % 3 == 0],
            "worker": worker,
        }
        reply = await http.post("/route", json={**body, "wait": True}, headers=bearer(fleet.key))
        assert reply.json()["status"] == "done", reply.text
    fleet.fake_a.delay_s = fleet.fake_b.delay_s = 0.0
    fleet.fake_a.fail_status = 400  # refused: a failure no other worker is asked to repeat
    body = {"prompt": "fail", "model": PLAIN, "worker": "cpu-1", "wait": True}
    reply = await http.post("/route", json=body, headers=bearer(fleet.key))
    assert reply.json()["failure"]["code"] == "backend_error"

    async def health_of_cpu1() -> str:
        body = (await http.get("/dashboard/state", headers=bearer(fleet.key))).json()
        return str({w["worker_id"]: w["health"] for w in body["workers"]}["cpu-1"])

    # The failure makes cpu-1 probe its backend, which still fails: degraded until a probe
    # passes (one a second here), and no work meanwhile.
    await eventually(lambda: _is(health_of_cpu1(), "degraded"), timeout_s=15)
    fleet.fake_a.fail_status = None
    await eventually(lambda: _is(health_of_cpu1(), "healthy"), timeout_s=15)
    for slow in (False, False, True):
        await projected(fleet.nc)  # each run's baseline is the runs before it
        fleet.fake_a.delay_s = 0.4 if slow else 0.0
        report = await Bench(fleet.nc, timeout_s=20, say=lambda line: None).run([MUL], [PLAIN])
        assert bool(report.slow) is slow, report.comparisons
    fleet.fake_a.delay_s = 0.0


async def _is(value: Awaitable[str], expected: str) -> bool:
    return await value == expected


# Counts the pixels of a canvas close to one of some colours: has a chart drawn its series?
COLOURED_PIXELS = """([selector, colours]) => {
  const canvas = document.querySelector(selector);
  if (!canvas) return -1;
  const data = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
  let count = 0;
  for (let i = 0; i < data.length; i += 4) {
    const near = colours.some((rgb) => Math.abs(data[i] - rgb[0]) < 40
      && Math.abs(data[i + 1] - rgb[1]) < 40 && Math.abs(data[i + 2] - rgb[2]) < 40);
    if (near && data[i + 3] > 200) count += 1;
  }
  return count;
}"""
# The colours of the first four series (dashboard.js's PALETTE), and of a slow bench run.
SERIES = [[0x2F, 0x6F, 0xDB], [0xE0, 0x76, 0x1A], [0x1F, 0x9D, 0x6B], [0xC0, 0x26, 0x2D]]
SLOW_MARK = [[0xD6, 0x28, 0x28]]


async def test_the_dashboard_follows_the_fleet_live_in_a_browser(
    fleet: Fleet, tmp_path: Path
) -> None:
    from playwright.async_api import async_playwright, expect

    assert shutil.which(CHROMIUM), (
        "the browser test needs Debian's chromium: apt-get install chromium"
    )
    async with httpx.AsyncClient(base_url=fleet.url, timeout=30) as http:
        # The page and its files load without a key (a browser sends none on a page load);
        # the fleet's data does not, not even by a path that walks out of the files.
        assert (await http.get("/dashboard")).status_code == 200
        assert (await http.get("/dashboard/static/dashboard.js")).status_code == 200
        assert (await http.get("/dashboard/static/nope.js")).status_code == 404
        for path in ("/dashboard/state", "/dashboard/stream", "/dashboard/static/../state"):
            assert (await http.get(path)).status_code in (401, 404), path
        await history(fleet, http)

        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"]
            )
            page = await browser.new_page(viewport={"width": 1360, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{fleet.url}/dashboard")
            await expect(page.locator("#key-form")).to_be_visible()
            await page.fill("#key-input", fleet.key)
            await page.click("#key-form button[type=submit]")
            workers = page.locator("#workers tbody tr")
            await expect(workers).to_have_count(2, timeout=10_000)
            for worker in ("cpu-1", "cpu-2"):
                state = page.locator(f'tr[data-worker="{worker}"] td.state')
                await expect(state).to_have_text("idle", timeout=10_000)
            await page.evaluate("window.notReloaded = true")
            # Each model's copies, and the builds that differ (cpu-2's stand-in holds others).
            await expect(
                page.locator(f'#models tr[data-model="{PLAIN}"][data-worker]')
            ).to_have_count(2, timeout=10_000)
            await expect(page.locator(f'#models tr.differs[data-model="{PLAIN}"]')).to_contain_text(
                "differs by digest"
            )

            # A slow task shows up running, then done, with no reload.
            fleet.fake_a.delay_s = 3.0
            body = {"prompt": "slow", "model": PLAIN, "worker": "cpu-1"}
            reply = (await http.post("/route", json=body, headers=bearer(fleet.key))).json()
            task = reply["task_id"]
            running = page.locator(f'#open-tasks tr[data-task="{task}"] td.status')
            await expect(running).to_contain_text("running", timeout=10_000)
            busy = page.locator('tr[data-worker="cpu-1"] td.state')
            await expect(busy).to_have_text("busy", timeout=5_000)
            await expect(page.locator(f'#done-tasks tr[data-task="{task}"]')).to_have_count(
                1, timeout=15_000
            )
            await expect(running).to_have_count(0)
            fleet.fake_a.delay_s = 0.0

            # A worker killed while it runs a task: lost, and the reaper fails its task (it
            # was asked of that worker by name, so it is not moved).
            fleet.fake_b.delay_s = 30.0
            body = {"prompt": "doomed", "model": PLAIN, "worker": "cpu-2"}
            doomed = (await http.post("/route", json=body, headers=bearer(fleet.key))).json()
            await expect(page.locator('tr[data-worker="cpu-2"] td.state')).to_have_text(
                "busy", timeout=10_000
            )
            os.kill(fleet.cpu2.pid, signal.SIGKILL)
            await expect(page.locator('tr[data-worker="cpu-2"] td.state')).to_have_text(
                "lost", timeout=10_000
            )
            failure = page.locator(f'#failures tr[data-task="{doomed["task_id"]}"]')
            await expect(failure).to_contain_text("worker_unavailable", timeout=15_000)
            await expect(page.locator("#actions tbody")).to_contain_text("worker_unavailable")

            # Work under way for the picture: one task running on cpu-1, one queued behind it.
            fleet.fake_a.delay_s = 8.0
            for prompt in ("write a haiku", "and another"):
                body = {"prompt": prompt, "model": SMALL, "worker": "cpu-1"}
                await http.post("/route", json=body, headers=bearer(fleet.key))
            statuses = page.locator("#open-tasks td.status .badge")
            await expect(statuses).to_have_text(["running", "queued"], timeout=10_000)
            await page.wait_for_timeout(1500)  # a second of elapsed time on the clock
            ARTIFACTS.mkdir(exist_ok=True)
            await page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)

            # The charts have drawn their series, and the slow bench run is marked.
            for chart in ("#chart-p50", "#chart-p95", "#chart-tps", "#chart-bench"):
                drawn = await page.evaluate(COLOURED_PIXELS, [f"{chart} canvas", SERIES])
                assert drawn > 200, (chart, drawn)
            marked = await page.evaluate(COLOURED_PIXELS, ["#chart-bench canvas", SLOW_MARK])
            assert marked > 20, marked
            await expect(page.locator("#figures tbody tr")).not_to_have_count(0)
            # Each model's first task on each worker loaded it.
            await expect(page.locator("#cold-loads tbody td.num")).to_have_text(["1"] * 4)
            assert await page.evaluate("window.notReloaded") is True
            assert errors == []

            # On a phone: the tables become cards, nothing runs off the side.
            phone = await browser.new_page(viewport={"width": 390, "height": 844})
            await phone.goto(f"{fleet.url}/dashboard")
            await phone.fill("#key-input", fleet.key)
            await phone.click("#key-form button[type=submit]")
            await expect(phone.locator("#workers tbody tr")).to_have_count(2, timeout=10_000)
            overflow = await phone.evaluate(
                "document.documentElement.scrollWidth - window.innerWidth"
            )
            assert overflow <= 0, overflow
            await phone.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"))
            await phone.locator("#tasks-section").screenshot(
                path=str(ARTIFACTS / "dashboard-phone-tasks.png")
            )
            await browser.close()

        metrics = scrape((await http.get("/metrics", headers=bearer(fleet.key))).text)
    failed = {"action": "failed", "reason": "worker_unavailable"}
    assert value(metrics, "coordinator_reaper_actions_total", **failed) == 1
    assert value(metrics, "coordinator_worker_up", worker="cpu-2") == 0
