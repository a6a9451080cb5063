"""``coordinator stats | alias | judge`` as a user runs them: the real command in a process,
against the stats service, a real nats-server and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, free_port
from tests.harness import clean_env, run_cli
from tests.integration.test_judge import VERDICTS, done_task
from tests.integration.test_stats import (
    all_acked,
    bus,
    eventually,
    publish_all,
    running_stats,
    settings_for,
)
from tests.integration.test_stats_replay import MODEL, T0, task


async def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(run_cli, *args, env=env)


async def test_stats_prints_the_figures_and_exclude_include_rebuild_change_them(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
    events = [e for i in range(4) for e in task(f"t-{i}", worker="mac", at=T0 + i, total_ms=1000)]
    async with (
        bus(nats_server.url) as (nc, js),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        last = await publish_all(js, events)
        await eventually(lambda: all_acked(js, last), what="the tasks to be projected")

        table = await cli("stats", env=env)
        as_json = await cli("stats", "--json", "--worker", "mac", env=env)
        excluded = await cli(
            "stats",
            "exclude",
            "--worker",
            "mac",
            "--since",
            str(T0 + 2.5),
            "--reason",
            "dup",
            env=env,
        )
        exclusion_id = excluded.stdout.split()[1]
        listed = await cli("stats", "exclusions", env=env)
        after = await cli("stats", "--json", env=env)
        rebuilt = await cli("stats", "rebuild", env=env)
        included = await cli("stats", "include", exclusion_id, env=env)
        unknown = await cli("stats", "include", "x-nope", env=env)
        bad_time = await cli(
            "stats", "exclude", "--worker", "mac", "--since", "yesterday", "--reason", "r", env=env
        )
        milliseconds = await cli(
            "stats",
            "exclude",
            "--worker",
            "mac",
            "--since",
            str(int(T0 * 1000)),
            "--reason",
            "r",
            env=env,
        )
        no_timeout = await cli("stats", "rebuild", "--timeout", "1e308", env=env)

    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[:5] == ["MODEL", "DOMAIN", "WORKER", "N", "FAIL"]
    assert row.split()[:7] == [MODEL, "code", "mac", "4", "0", "1000", "1000"]
    assert json.loads(as_json.stdout)["figures"][0]["count"] == 4

    assert excluded.returncode == 0, excluded.stderr
    assert excluded.stdout.startswith(f"excluded: {exclusion_id}  worker mac  model *")
    assert exclusion_id in listed.stdout
    assert json.loads(after.stdout)["figures"][0]["count"] == 2
    assert json.loads(after.stdout)["active_exclusions"] == 1
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.startswith(f"rebuilt from {last + 1} events (up to #{last + 1})")
    assert included.stdout.startswith(f"withdrawn: {exclusion_id}")

    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        "error not_found: no exclusion 'x-nope'",
    )
    assert bad_time.returncode == 2
    assert "'yesterday' is not a time" in bad_time.stderr
    assert milliseconds.returncode == 2
    assert "argument --since: '1700000000000' must be a time from 1970-01-01" in (
        milliseconds.stderr
    )
    assert "(that looks like milliseconds: times are epoch seconds" in milliseconds.stderr
    assert no_timeout.returncode == 2
    assert "'1e308' is not a timeout: give seconds above 0, at most 86400" in no_timeout.stderr


async def test_alias_add_list_remove(nats_server: NatsServer, pg_dsn: str, tmp_path: Path) -> None:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
    async with (
        bus(nats_server.url) as (nc, _),
        running_stats(nc, settings_for(nats_server, pg_dsn)),
    ):
        added = await cli("alias", "add", "hf.co/elyza/ELYZA-JP-8B:Q4_K_M", "elyza-jp-8b", env=env)
        listed = await cli("alias", "list", env=env)
        removed = await cli("alias", "remove", "hf.co/elyza/ELYZA-JP-8B:Q4_K_M", env=env)
        again = await cli("alias", "remove", "hf.co/elyza/ELYZA-JP-8B:Q4_K_M", env=env)
        empty = await cli("alias", "list", "--json", env=env)

    assert added.stdout.strip() == "hf.co/elyza/ELYZA-JP-8B:Q4_K_M -> elyza-jp-8b"
    assert listed.stdout.startswith("hf.co/elyza/ELYZA-JP-8B:Q4_K_M -> elyza-jp-8b  (since ")
    assert removed.returncode == 0
    assert again.returncode == 1
    assert "error not_found" in again.stderr
    assert json.loads(empty.stdout) == {"aliases": []}


async def test_stats_without_a_stats_service_says_so(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))

    result = await cli("stats", env=env)

    # Asked again while nobody answers (a stats instance may be starting), then said so.
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "asking again for up to 10 s: no_responder: no service answers coordinator.stats: is "
        "the stack running?",
        "error no_responder: no service answered coordinator.stats in 10 s of asking: is the "
        "stack running?",
    ]


async def test_judge_runs_from_flags_or_environment_and_fails_clearly(
    nats_server: NatsServer, pg_dsn: str, tmp_path: Path
) -> None:
    asleep = f"http://127.0.0.1:{free_port()}"
    base = clean_env(NATS_URL=nats_server.url, PG_DSN=pg_dsn, COORDINATOR_HOME=str(tmp_path))
    with FakeOllama(replies=VERDICTS) as judge_host:
        async with (
            bus(nats_server.url) as (nc, js),
            running_stats(nc, settings_for(nats_server, pg_dsn)),
        ):
            last = await publish_all(js, done_task("t-1", "answer-good"))
            await eventually(lambda: all_acked(js, last), what="the task to be projected")

            unconfigured = await cli("judge", env=base)
            neither = await cli(
                "judge",
                "--host",
                asleep,
                "--fallback-host",
                asleep,
                "--model",
                "gemma3:1b",
                env=base,
            )
            env = {**base, "JUDGE_MODEL": "gemma3:1b", "JUDGE_OLLAMA_HOST": asleep}
            judged = await cli("judge", "--fallback-host", judge_host.url, env=env)
            repeated = await cli("judge", "--host", judge_host.url, env=env)

    assert (unconfigured.returncode, unconfigured.stderr.strip()) == (
        2,
        "error config: JUDGE_MODEL is required but not set",
    )
    assert neither.returncode == 1
    assert neither.stderr.startswith("error judge_unavailable: no judge host answers")
    assert judged.returncode == 0, judged.stderr
    assert judged.stdout.splitlines() == [
        "scored 0.90 t-1 qwen2.5:7b (mac) [code]",
        "judge: 1 judged (1 scored, 0 malformed), 0 already scored, 0 errors; "
        f"gemma3:1b at {judge_host.url}",
    ]
    assert repeated.stdout.startswith("judge: 0 judged")
