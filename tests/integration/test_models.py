"""``coordinator models``, as an operator runs it: the fleet's model matrix from the router's
live workers and the stats service's figures, two workers on two Ollama stand-ins that hold
different builds of one model. A real nats-server and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.errors import NoRespondersError

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.subjects import STATS
from tests.harness import ServiceRunner, clean_env, eventually, request, run_cli, workers_live

SHARED = "qwen2.5:0.5b"
ONLY_ONE = "gemma3:1b"


async def test_the_matrix_shows_each_copy_its_use_and_a_digest_that_differs(
    nats_server: NatsServer, pg_dsn: str, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    with (
        FakeOllama(models=[SHARED, ONLY_ONE]) as first,
        FakeOllama(models=[SHARED], copy="rebuilt") as second,
    ):
        runner.router(nats_server.url)
        runner.stats(nats_server.url, pg_dsn)
        runner.worker(nats_server.url, first.url, "cpu-1")
        runner.worker(nats_server.url, second.url, "cpu-2")
        await workers_live(nc, 2)
        asked = {"prompt": "1+1", "model": SHARED, "worker": "cpu-1", "wait": True}
        reply, headers = await request(nc, "coordinator.route", asked)
        assert "Nats-Service-Error-Code" not in headers, reply

        async def counted() -> bool:
            try:
                figures, _ = await request(nc, STATS, {"worker": "cpu-1"})
            except NoRespondersError:
                return False  # the stats service is starting
            return bool(figures.get("figures"))

        await eventually(counted, timeout_s=15)
        env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
        as_json = await asyncio.to_thread(run_cli, "models", "--json", env=env)
        table = await asyncio.to_thread(run_cli, "models", env=env)

    assert as_json.returncode == 0, as_json.stderr
    found: dict[str, Any] = json.loads(as_json.stdout)
    rows = {row["model"]: row for row in found["models"]}
    assert sorted(rows) == [ONLY_ONE, SHARED] and found["figures"] is True
    shared = {copy["worker"]: copy for copy in rows[SHARED]["copies"]}
    assert sorted(shared) == ["cpu-1", "cpu-2"]
    assert rows[SHARED]["digests_differ"] is True
    assert shared["cpu-1"]["digest"] != shared["cpu-2"]["digest"]
    assert shared["cpu-1"]["size"] > 0 and shared["cpu-1"]["quantization"]
    assert shared["cpu-1"]["tasks"] == 1 and shared["cpu-1"]["last_used"] is not None
    assert shared["cpu-1"]["tokens_per_s"] > 0
    assert shared["cpu-2"]["tasks"] == 0 and shared["cpu-2"]["last_used"] is None
    assert shared["cpu-1"]["loaded"] is not None  # the worker says what its backend holds
    assert [copy["worker"] for copy in rows[ONLY_ONE]["copies"]] == ["cpu-1"]
    assert rows[ONLY_ONE]["digests_differ"] is False

    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:4] == ["MODEL", "WORKER", "SIZE", "QUANT"]
    assert any(line.startswith(f"  ! {SHARED} differs by digest") for line in lines)
    assert any("tok/s" in line and "cpu-1" in line for line in lines)


async def test_without_the_stats_service_the_matrix_says_what_it_cannot_know(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    with FakeOllama(models=[SHARED]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        await workers_live(nc, 1)
        env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
        table = await asyncio.to_thread(run_cli, "models", env=env)

    assert table.returncode == 0, table.stderr
    assert "the stats service did not answer" in table.stdout
    assert SHARED in table.stdout
