"""``coordinator stats | alias | judge | bench``: the statistics, for people and for cron.

``stats`` and ``alias`` talk to the stats service over NATS (``coordinator.stats…``, see
``schemas/stats.py``); ``stats serve`` runs that service. ``judge`` and ``bench`` are jobs:
``judge`` reads the read model (``PG_DSN``) and calls the judge host directly, ``bench`` goes
through the router like any client. All follow the CLI's exit statuses (0 success, 1 failed,
2 usage or configuration); ``bench`` adds 3 for "all done, but a worker was slow".

Reading the arguments is `stats_args`, the replies as lines `stats_format` (both pure); here
are the parsers and the calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from schemas.stats import (
    AliasesReply,
    AliasRemoveRequest,
    AliasRequest,
    AliasView,
    ExcludeRequest,
    ExclusionsQuery,
    ExclusionsReply,
    ExclusionView,
    IncludeRequest,
    ParkedReply,
    RebuildReply,
    StatsQuery,
    StatsReply,
)
from schemas.subjects import (
    ALIAS_ADD,
    ALIAS_REMOVE,
    ALIASES,
    STATS,
    STATS_EXCLUDE,
    STATS_EXCLUSIONS,
    STATS_INCLUDE,
    STATS_PARKED,
    STATS_REBUILD,
)
from services.cli.client import find_nats_url, open_client, say_asking_again
from services.cli.stats_args import model_list, time_arg, timeout_arg
from services.cli.stats_format import (
    aliases_lines,
    exclusion_line,
    exclusions_lines,
    figures_lines,
    parked_lines,
    rebuild_line,
)
from services.runtime.logging import setup_logging
from services.runtime.request import UNSERVED_FOR_S, call

EXIT_FAILED = 1

_json = msgspec.json.Encoder()
T = TypeVar("T")


def register(sub: Any) -> None:
    """Add ``stats``, ``alias``, ``judge`` and ``bench`` to the ``coordinator`` parser."""
    stats = sub.add_parser(
        "stats",
        help="figures per model, domain and worker; exclusions, rebuild; 'serve' runs the service",
        description="Without an action: print the figures (exclusions left out, aliases applied).",
    )
    stats.add_argument("--json", action="store_true", help="print the reply body as is")
    stats.add_argument("--model")
    stats.add_argument("--worker")
    stats.add_argument("--domain")
    stats.set_defaults(func=cmd_figures)
    actions = stats.add_subparsers(dest="stats_command", metavar="ACTION")

    serve = actions.add_parser("serve", help="run the stats service (configured by environment)")
    serve.set_defaults(func=cmd_serve)

    exclude = actions.add_parser(
        "exclude", help="leave a worker's outcomes in a time range out of every figure"
    )
    exclude.add_argument("--worker", required=True)
    exclude.add_argument("--model", help="only this model (default: every model)")
    exclude.add_argument(
        "--since", required=True, type=time_arg, help="ISO 8601, epoch seconds, or '2h ago'"
    )
    exclude.add_argument("--until", type=time_arg, help="default: open-ended")
    exclude.add_argument("--reason", required=True)
    exclude.add_argument("--json", action="store_true")
    exclude.set_defaults(func=cmd_exclude)

    include = actions.add_parser("include", help="withdraw an exclusion")
    include.add_argument("exclusion_id")
    include.add_argument("--reason", default="")
    include.add_argument("--json", action="store_true")
    include.set_defaults(func=cmd_include)

    exclusions = actions.add_parser("exclusions", help="list the exclusions")
    exclusions.add_argument("--all", action="store_true", help="withdrawn ones too")
    exclusions.add_argument("--json", action="store_true")
    exclusions.set_defaults(func=cmd_exclusions)

    rebuild = actions.add_parser(
        "rebuild", help="replay the event log into fresh tables and swap them in"
    )
    rebuild.add_argument("--timeout", type=timeout_arg, default=3600.0, help="seconds to wait")
    rebuild.add_argument("--json", action="store_true")
    rebuild.set_defaults(func=cmd_rebuild)

    parked = actions.add_parser(
        "parked", help="the events the projection could not apply (newest first)"
    )
    parked.add_argument("--json", action="store_true")
    parked.set_defaults(func=cmd_parked)

    alias = sub.add_parser("alias", help="model aliases: several names, one statistics key")
    alias_actions = alias.add_subparsers(dest="alias_command", required=True, metavar="ACTION")
    add = alias_actions.add_parser("add", help="OLD is from now on a name of NEW")
    add.add_argument("old")
    add.add_argument("new")
    add.set_defaults(func=cmd_alias_add)
    remove = alias_actions.add_parser("remove", help="OLD keys its own statistics again")
    remove.add_argument("old")
    remove.set_defaults(func=cmd_alias_remove)
    listing = alias_actions.add_parser("list", help="every alias and where it leads")
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=cmd_alias_list)

    judge = sub.add_parser(
        "judge", help="score done, unscored tasks with an LLM judge (a job for cron)"
    )
    judge.add_argument("--host", help="judge Ollama (JUDGE_OLLAMA_HOST)")
    judge.add_argument("--fallback-host", help="when the judge host does not answer")
    judge.add_argument("--model", help="judge model (JUDGE_MODEL)")
    judge.add_argument("--batch-limit", type=int, help="verdicts per run (BATCH_LIMIT)")
    judge.set_defaults(func=cmd_judge)

    bench = sub.add_parser("bench", help="the nightly benchmark through the router (for cron)")
    bench.add_argument("--models", help="comma-separated (default: every model served)")
    bench.add_argument("--prompts", type=Path, help="a .json list or one prompt per line")
    bench.add_argument("--timeout", type=timeout_arg, default=300.0, help="seconds per prompt")
    bench.set_defaults(func=cmd_bench)


# -- plumbing ---------------------------------------------------------------------------------


def _run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    setup_logging("error", "console", stream=sys.stderr)
    return asyncio.run(main())


def _request(
    subject: str, body: msgspec.Struct | None, timeout_s: float = 30.0, *, query: bool = False
) -> bytes:
    """``query``: the request changes nothing, so it is asked again while nobody can serve it
    (a stats instance taking over); a change is asked once, and its error said."""

    async def go() -> bytes:
        nc = await open_client()
        try:
            return await call(
                nc,
                subject,
                b"{}" if body is None else _json.encode(body),
                timeout_s,
                unserved_s=UNSERVED_FOR_S if query else None,
                on_unserved=say_asking_again,
            )
        finally:
            await nc.close()

    return _run(go)


# -- stats ------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from services.cli.stopping import budget_of
    from services.runtime.lifecycle import run_until_stopped
    from services.runtime.tracing import setup_tracing
    from services.stats.service import run
    from services.stats.settings import StatsSettings

    settings = StatsSettings.from_env()
    setup_logging(settings.log_level, settings.log_format)
    setup_tracing("coordinator-stats")
    run_until_stopped(lambda stop: run(settings, stop), budget_s=budget_of(settings))
    return 0


def cmd_figures(args: argparse.Namespace) -> int:
    query = StatsQuery(model=args.model, worker=args.worker, domain=args.domain)
    body = _request(STATS, query, query=True)
    if args.json:
        print(body.decode())
        return 0
    for line in figures_lines(msgspec.json.decode(body, type=StatsReply)):
        print(line)
    return 0


def cmd_exclude(args: argparse.Namespace) -> int:
    request = ExcludeRequest(
        worker=args.worker, model=args.model, since=args.since, until=args.until, reason=args.reason
    )
    body = _request(STATS_EXCLUDE, request)
    if args.json:
        print(body.decode())
        return 0
    view = msgspec.json.decode(body, type=ExclusionView)
    print(f"excluded: {exclusion_line(view)}")
    print(f"(withdraw with: coordinator stats include {view.exclusion_id})", file=sys.stderr)
    return 0


def cmd_include(args: argparse.Namespace) -> int:
    body = _request(
        STATS_INCLUDE, IncludeRequest(exclusion_id=args.exclusion_id, reason=args.reason)
    )
    if args.json:
        print(body.decode())
        return 0
    print(f"withdrawn: {exclusion_line(msgspec.json.decode(body, type=ExclusionView))}")
    return 0


def cmd_exclusions(args: argparse.Namespace) -> int:
    body = _request(STATS_EXCLUSIONS, ExclusionsQuery(withdrawn=args.all), query=True)
    if args.json:
        print(body.decode())
        return 0
    for line in exclusions_lines(msgspec.json.decode(body, type=ExclusionsReply)):
        print(line)
    return 0


def cmd_rebuild(args: argparse.Namespace) -> int:
    print("rebuilding the statistics from the event log…", file=sys.stderr)
    body = _request(STATS_REBUILD, None, timeout_s=args.timeout)
    if args.json:
        print(body.decode())
        return 0
    print(rebuild_line(msgspec.json.decode(body, type=RebuildReply)))
    return 0


def cmd_parked(args: argparse.Namespace) -> int:
    body = _request(STATS_PARKED, None, query=True)
    if args.json:
        print(body.decode())
        return 0
    for line in parked_lines(msgspec.json.decode(body, type=ParkedReply)):
        print(line)
    return 0


# -- alias ------------------------------------------------------------------------------------


def cmd_alias_add(args: argparse.Namespace) -> int:
    body = _request(ALIAS_ADD, AliasRequest(alias=args.old, canonical=args.new))
    view = msgspec.json.decode(body, type=AliasView)
    print(f"{view.alias} -> {view.canonical}")
    return 0


def cmd_alias_remove(args: argparse.Namespace) -> int:
    _request(ALIAS_REMOVE, AliasRemoveRequest(alias=args.old))
    print(f"{args.old} is no longer an alias")
    return 0


def cmd_alias_list(args: argparse.Namespace) -> int:
    body = _request(ALIASES, None, query=True)
    if args.json:
        print(body.decode())
        return 0
    for line in aliases_lines(msgspec.json.decode(body, type=AliasesReply)):
        print(line)
    return 0


# -- jobs -------------------------------------------------------------------------------------


def judge_environment(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment with the judge's flags applied over it (flags win)."""
    env = dict(environ)
    flags = {
        "JUDGE_OLLAMA_HOST": args.host,
        "JUDGE_FALLBACK_HOST": args.fallback_host,
        "JUDGE_MODEL": args.model,
        "BATCH_LIMIT": None if args.batch_limit is None else str(args.batch_limit),
    }
    env.update({name: value for name, value in flags.items() if value is not None})
    if not env.get("NATS_URL"):
        env["NATS_URL"] = find_nats_url()
    return env


def cmd_judge(args: argparse.Namespace) -> int:
    from services.runtime.bus import connect
    from services.stats.judge import Judge, JudgeSettings, summary
    from services.stats.store import Store

    settings = JudgeSettings.from_env(judge_environment(args, os.environ))

    async def go() -> int:
        store = await Store.connect(settings.pg_dsn, max_size=2)
        try:
            nc = await connect(settings.nats_url, "coordinator-judge", connect_timeout_s=5.0)
            try:
                report = await Judge(nc.jetstream(), store, settings).run()
            finally:
                await nc.close()
        finally:
            await store.close()
        print(summary(report, settings.judge_model))
        for error in report.errors:
            print(f"error judge_failed: {error}", file=sys.stderr)
        if report.stopped:
            print(f"error judge_unavailable: {report.stopped}", file=sys.stderr)
        return 0 if report.ok else EXIT_FAILED

    return _run(go)


def cmd_bench(args: argparse.Namespace) -> int:
    from services.stats.bench import Bench, load_prompts
    from services.stats.bench_prompts import BUILTIN_PROMPTS
    from services.stats.bench_report import summary, table, warnings

    prompts = load_prompts(args.prompts) if args.prompts else list(BUILTIN_PROMPTS)
    models = model_list(args.models)

    def say(line: str) -> None:
        print(line, flush=True)

    def warn(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    async def go() -> int:
        nc = await open_client()
        try:
            bench = Bench(nc, timeout_s=args.timeout, say=say)
            say(f"bench {bench.report.run_id}: {len(prompts)} prompt(s)")
            report = await bench.run(prompts, models)
        finally:
            await nc.close()
        say("")
        for line in table(report):
            say(line)
        for note in report.notes:
            warn(f"note: {note}")
        for line in warnings(report):
            warn(line)
        say(summary(report))
        return report.exit_status

    return _run(go)
