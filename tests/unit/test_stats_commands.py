"""The statistics commands' pure parts: times, tables, flags over the environment."""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from schemas.stats import FigureView, ParkedReply, ParkedView, RebuildReply
from services.cli.main import build_parser
from services.cli.stats_args import parse_time, timeout_arg
from services.cli.stats_commands import (
    cmd_alias_add,
    cmd_bench,
    cmd_exclude,
    cmd_figures,
    cmd_judge,
    cmd_parked,
    cmd_serve,
    judge_environment,
)
from services.cli.stats_format import figures_table, parked_lines, rebuild_line
from services.errors import ConfigError
from services.stats.baseline import Comparison
from services.stats.bench_prompts import BUILTIN_PROMPTS
from services.stats.bench_report import BenchReport, Result, describe_error
from services.stats.bench_report import table as bench_table
from services.stats.bench_report import warnings as bench_warnings
from services.stats.judge import JudgeReport, JudgeSettings, summary

NOW = 1_750_000_000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("now", NOW),
        ("90m ago", NOW - 5400),
        ("2h ago", NOW - 7200),
        ("3d  ago", NOW - 3 * 86400),
        ("-2h", NOW - 7200),  # as --since=-2h
        ("1700000000", 1_700_000_000.0),
        ("2025-06-01T02:00:00Z", datetime(2025, 6, 1, 2, tzinfo=UTC).timestamp()),
        ("2025-06-01T11:00+09:00", datetime(2025, 6, 1, 2, tzinfo=UTC).timestamp()),
    ],
)
def test_times_are_read_in_the_forms_an_operator_types(text: str, expected: float) -> None:
    assert parse_time(text, now=NOW) == expected


def test_a_time_without_a_zone_is_local_time() -> None:
    local = time.mktime((2025, 6, 1, 2, 0, 0, 0, 0, -1))

    assert parse_time("2025-06-01 02:00", now=NOW) == local
    assert parse_time("2025-06-01", now=NOW) == time.mktime((2025, 6, 1, 0, 0, 0, 0, 0, -1))


@pytest.mark.parametrize("text", ["yesterday", "2 fortnights ago", "nan", ""])
def test_anything_else_is_refused_saying_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_time(text, now=NOW)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("1700000000000", "(that looks like milliseconds: times are epoch seconds"),
        ("1e308", "not 1e+308"),
        ("-1e18", "not -1e+18"),
        ("9223372036854775808", "(that looks like nanoseconds"),
        ("1969-12-31T00:00Z", "not -86400"),
        ("99999999w ago", "must be a time from 1970-01-01 to 9999-12-31"),
        ("0001-01-01", "'0001-01-01' is not a time from 1970-01-01 to 9999-12-31"),
    ],
)
def test_a_time_out_of_range_is_refused_saying_the_range(text: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_time(text, now=NOW)

    assert says in str(refused.value)
    assert "1970-01-01" in str(refused.value)


@pytest.mark.parametrize("text", ["0", "-5", "nan", "inf", "1e308", "86401", "soon"])
def test_a_timeout_must_be_seconds_up_to_a_day(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="at most 86400"):
        timeout_arg(text)
    assert timeout_arg("86400") == 86400.0
    assert timeout_arg("0.5") == 0.5


@pytest.mark.parametrize(
    ("argv", "func"),
    [
        (["stats"], cmd_figures),
        (["stats", "parked"], cmd_parked),
        (["stats", "--json"], cmd_figures),
        (["stats", "serve"], cmd_serve),
        (["stats", "exclude", "--worker", "w", "--since", "1h ago", "--reason", "r"], cmd_exclude),
        (["alias", "add", "old", "new"], cmd_alias_add),
        (["judge", "--batch-limit", "3"], cmd_judge),
        (["bench", "--models", "a,b"], cmd_bench),
    ],
)
def test_the_commands_are_wired(argv: list[str], func: Any) -> None:
    assert build_parser().parse_args(argv).func is func


def test_alias_needs_an_action(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["alias"])

    assert exited.value.code == 2


def test_judge_flags_win_over_the_environment() -> None:
    args = argparse.Namespace(
        host="http://judge:11434", fallback_host=None, model=None, batch_limit=3
    )
    environ = {
        "JUDGE_OLLAMA_HOST": "http://old:11434",
        "JUDGE_FALLBACK_HOST": "http://mac:11434",
        "JUDGE_MODEL": "qwen3:8b",
        "PG_DSN": "postgresql://db/coordinator",
        "NATS_URL": "nats://bus:4222",
    }

    settings = JudgeSettings.from_env(judge_environment(args, environ))

    assert settings.judge_ollama_host == "http://judge:11434"
    assert settings.judge_fallback_host == "http://mac:11434"
    assert (settings.judge_model, settings.batch_limit) == ("qwen3:8b", 3)
    assert settings.nats_url == "nats://bus:4222"


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PG_DSN": "postgresql://db/c"}, "JUDGE_MODEL is required but not set"),
        ({"JUDGE_MODEL": "m"}, "PG_DSN is required but not set"),
        ({"PG_DSN": "x", "JUDGE_MODEL": "m", "BATCH_LIMIT": "0"}, "BATCH_LIMIT=0 must be"),
        ({"PG_DSN": "x", "JUDGE_MODEL": "m", "BATCH_LIMIT": "many"}, "BATCH_LIMIT='many'"),
        (
            {"PG_DSN": "x", "JUDGE_MODEL": "m", "BATCH_LIMIT": str(2**70)},
            "at most 10000",
        ),
        (
            {"PG_DSN": "x", "JUDGE_MODEL": "m", "JUDGE_TIMEOUT_S": "nan"},
            "JUDGE_TIMEOUT_S must be a positive number of seconds, at most 86400",
        ),
        (
            {"PG_DSN": "x", "JUDGE_MODEL": "m", "JUDGE_CONNECT_TIMEOUT_S": "1e308"},
            "JUDGE_CONNECT_TIMEOUT_S must be a positive number of seconds",
        ),
    ],
)
def test_judge_settings_name_what_is_wrong(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        JudgeSettings.from_env(environ)

    assert message in refused.value.message


def test_the_judge_summary_says_what_it_did_and_where() -> None:
    report = JudgeReport(host="http://mac:11434", scored=4, malformed=1, already_scored=2)

    assert summary(report, "qwen3:8b") == (
        "judge: 5 judged (4 scored, 1 malformed), 2 already scored, 0 errors; "
        "qwen3:8b at http://mac:11434"
    )


def test_the_figures_table_aligns_columns_and_shows_missing_figures_as_dashes() -> None:
    rows = [
        FigureView(
            model="qwen2.5:7b",
            domain="code",
            worker="mac",
            count=12,
            failures=1,
            mean_ms=950.4,
            p50_ms=900.0,
            p95_ms=2000.0,
            load_ms_p50=40.0,
            warm_p50_ms=860.0,
            tokens_per_s=55.55,
            quality_mean=0.8,
            quality_count=4,
            last_at=0.0,
        ),
        FigureView(
            model="gemma3:1b", domain="general", worker="", count=1, failures=1, last_at=0.0
        ),
    ]

    lines = figures_table(rows)

    assert lines[0].split() == [
        "MODEL",
        "DOMAIN",
        "WORKER",
        "N",
        "FAIL",
        "MEAN",
        "P50",
        "P95",
        "LOAD",
        "WARM",
        "TOK/S",
        "TTFT",
        "QUALITY",
    ]
    assert lines[1].split() == [
        "qwen2.5:7b",
        "code",
        "mac",
        "12",
        "1",
        "950",
        "900",
        "2000",
        "40",
        "860",
        "55.5",
        "-",
        "0.80",
        "(4)",
    ]
    assert lines[2].split()[:5] == ["gemma3:1b", "general", "-", "1", "1"]
    assert len({len(line) for line in lines[:1]}) == 1


def test_bench_progress_reasons_table_and_warnings() -> None:
    prompt = BUILTIN_PROMPTS[0]
    report = BenchReport(
        run_id="bench-1",
        results=[
            Result("gemma3:1b", "esxi", prompt, ok=True, total_ms=18010.0),
            Result(
                "gemma3:1b",
                "mac",
                prompt,
                ok=False,
                error="backend_error: boom",
                error_code="backend_error",
            ),
        ],
        comparisons=[Comparison("gemma3:1b", "esxi", 18010.0, 9005.0, 2.0, 5)],
    )

    assert describe_error("backend_timeout", "backend_timeout: Ollama timed out") == "timed out"
    assert describe_error("timeout", "timeout: coordinator.route did not answer") == "timed out"
    assert describe_error("no_worker", "no_worker: nobody") == "no_worker: nobody"
    lines = bench_table(report)
    assert lines[1].split() == ["gemma3:1b", "esxi", "1", "0", "18010", "9005", "2.00x", "SLOW"]
    assert lines[2].split() == ["gemma3:1b", "mac", "0", "1", "-", "-", "-"]
    [warning] = bench_warnings(report)
    assert warning.startswith("warning: gemma3:1b on esxi ran at 2.0x its baseline (18010 ms")
    assert report.exit_status == 1  # a failure outweighs the slowness
    assert BenchReport("r", report.results[:1], report.comparisons).exit_status == 3
    assert BenchReport("r", report.results[:1], []).exit_status == 0


def test_parked_events_are_listed_newest_first_with_what_is_left_out() -> None:
    views = [
        ParkedView(
            stream="EVENTS",
            stream_seq=seq,
            subject="events.stats.exclusion.added",
            kind="exclusion_added",
            error="time 1e+308 is out of range",
            parked_at=NOW,
        )
        for seq in (9, 5)
    ]

    lines = parked_lines(ParkedReply(parked=views, total=3))

    assert lines[0].startswith("EVENTS #9  exclusion_added  events.stats.exclusion.added  parked ")
    assert lines[0].endswith(": time 1e+308 is out of range")
    assert lines[2:] == [
        "… and 1 older",
        "a rebuild (coordinator stats rebuild) tries them again once the cause is fixed",
    ]
    assert parked_lines(ParkedReply(parked=[], total=0)) == ["no parked events"]


def test_a_rebuild_says_how_many_events_it_parked() -> None:
    reply = RebuildReply(
        events=10, last_seq=12, seconds=0.5, events_per_s=20.0, figures=3, parked=2
    )

    assert rebuild_line(reply) == (
        "rebuilt from 10 events (up to #12) in 0.5 s (20 events/s); 3 figure rows; "
        "2 event(s) parked (coordinator stats parked)"
    )
    clean = RebuildReply(events=10, last_seq=10, seconds=0.5, events_per_s=20.0, figures=3)
    assert rebuild_line(clean).endswith("3 figure rows")
