"""``coordinator``: run a service, the whole stack, or talk to a running one.

Exit status: 0 on success; 1 when the request failed (the error's code and message on stderr);
2 for bad usage or configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from schemas import events, leaders, queries, route, stats, tasks, vectors, workers
from schemas.models import COMPLETION, facts_in
from schemas.subjects import STATS, TASK, WORKERS
from services import __version__
from services.cli import (
    advise,
    deploy,
    doctor,
    identities,
    join,
    keys,
    model_changes,
    model_table,
    stats_commands,
)
from services.cli.client import open_client, route_and_wait, say_asking_again
from services.cli.stopping import budget_of
from services.errors import ConfigError, CoordinatorError
from services.fleet import model_matrix
from services.gateway.settings import GatewaySettings
from services.reaper.settings import ReaperSettings
from services.router.settings import RouterSettings
from services.runtime import waitfor
from services.runtime.lifecycle import run_until_stopped
from services.runtime.logging import setup_logging
from services.runtime.request import UNSERVED_FOR_S, call
from services.runtime.settings import Settings, WebSearchSettings, WorkerSettings
from services.runtime.tracing import setup_tracing
from services.stats.settings import StatsSettings

EXIT_FAILED = 1
EXIT_USAGE = 2

_json = msgspec.json.Encoder()


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``coordinator`` console command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    waitfor.install()  # no cancellation lost: every stop ends (`services.runtime.waitfor`)
    try:
        code = args.func(args)
    except CoordinatorError as exc:  # error replies too (`services.runtime.request`)
        print(f"error {exc.code}: {exc.message}", file=sys.stderr)
        code = EXIT_USAGE if exc.code == ConfigError.code else EXIT_FAILED
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coordinator", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"coordinator {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser(
        "up", help="run the whole stack on this machine (embedded NATS and PostgreSQL when unset)"
    )
    up.add_argument(
        "--identities",
        nargs="?",
        type=Path,
        const=Path(),
        default=None,
        metavar="DIR",
        help="each service its own identity, from the fleet's keys (DIR; default "
        "$COORDINATOR_IDENTITIES or ~/.config/coordinator/identities), on NATS_URL",
    )
    up.set_defaults(func=cmd_up)

    for name, helptext in (
        ("router", "run the router alone (configured by the environment)"),
        ("worker", "run one worker alone (configured by the environment)"),
        ("web-search", "run one web-search worker alone (configured by the environment)"),
        ("reaper", "run the reaper alone: moves work off dead, stuck or silent workers"),
        ("gateway", "run the HTTP gateway alone: the fleet as one Ollama/OpenAI endpoint"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.set_defaults(func=cmd_service, service=name)

    ask = sub.add_parser("ask", help="route a prompt, wait, print the answer")
    ask.add_argument("prompt")
    ask.add_argument(
        "--model", "-m", help="required for inference; web_search: the summary model (optional)"
    )
    ask.add_argument(
        "--type",
        dest="task_type",
        choices=("inference", "web_search"),
        default="inference",
        help="web_search: search the web, answer from the results, list the sources",
    )
    ask.add_argument("--worker", "-w")
    ask.add_argument("--domain")
    ask.add_argument("--timeout", type=float, default=None, help="seconds the task may run")
    ask.add_argument("--json", action="store_true", help="print the reply body as is")
    ask.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    ask.set_defaults(func=cmd_ask)

    embed = sub.add_parser(
        "embed", help="embed texts with a model; print one JSON array of floats per text"
    )
    embed.add_argument("text", nargs="+", help="each text gets one vector, in order")
    embed.add_argument("--model", "-m", required=True)
    embed.add_argument("--dimensions", type=int, default=None, help="cut vectors to this length")
    embed.add_argument("--worker", "-w")
    embed.add_argument("--timeout", type=float, default=None, help="seconds the task may run")
    embed.add_argument("--json", action="store_true", help="print the reply body as is")
    embed.set_defaults(func=cmd_embed)

    task = sub.add_parser("task", help="show one task")
    task.add_argument("task_id")
    task.add_argument("--json", action="store_true")
    task.set_defaults(func=cmd_task)

    ws = sub.add_parser("workers", help="list live workers")
    ws.add_argument("--json", action="store_true")
    ws.set_defaults(func=cmd_workers)

    mods = sub.add_parser(
        "models",
        help="the fleet's models: which worker has which copy, loaded or not, last use, speed",
    )
    mods.add_argument("--json", action="store_true")
    mods.set_defaults(func=cmd_models)
    models_sub = mods.add_subparsers(dest="models_command", metavar="ACTION")
    advice = models_sub.add_parser(
        "advise",
        help="where models should live: placements proposed from the demand; changes nothing",
    )
    advise.add_arguments(advice)
    advice.set_defaults(func=advise.cmd_advise)

    sch = sub.add_parser("schemas", help="wire types")
    sch_sub = sch.add_subparsers(dest="schemas_command", required=True, metavar="ACTION")
    export = sch_sub.add_parser("export", help="write one JSON Schema per wire type into DIR")
    export.add_argument("dir", type=Path)
    export.set_defaults(func=cmd_schemas_export)

    # stats (figures; `stats serve` runs the service), alias, judge, bench
    stats_commands.register(sub)
    # setup, health, deploy render; doctor
    deploy.register(sub)
    doctor.register(sub)
    keys.register(sub)  # the gateway's API keys
    identities.register(sub)  # invite, revoke, identities: one NATS identity each
    join.register(sub)
    model_changes.register(sub)  # pull, create, copy, rm on chosen machines
    return parser


# -- services -----------------------------------------------------------------------------------


def cmd_service(args: argparse.Namespace) -> int:
    settings: Settings
    runner: Callable[[Any, asyncio.Event], Awaitable[None]]
    if args.service == "router":
        from services.router.service import run as runner

        settings = RouterSettings.from_env()
    elif args.service == "worker":
        from services.worker.service import run as run_worker

        runner = functools.partial(run_worker, own_process=True)
        settings = WorkerSettings.from_env()
    elif args.service == "web-search":
        from services.web_search.service import run as runner

        settings = WebSearchSettings.from_env()
    elif args.service == "reaper":
        from services.reaper.service import run as runner

        settings = ReaperSettings.from_env()
    elif args.service == "gateway":
        from services.gateway.service import run as runner

        settings = GatewaySettings.from_env()
    else:
        from services.stats.service import run as runner

        settings = StatsSettings.from_env()
    setup_logging(settings.log_level, settings.log_format)
    setup_tracing(f"coordinator-{args.service}")
    run_until_stopped(lambda stop: runner(settings, stop), budget_s=budget_of(settings))
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    from services.cli.identities import default_store
    from services.cli.stack import up

    identities = args.identities
    if identities == Path():
        identities = default_store()
    return up(identities)


# -- client commands ----------------------------------------------------------------------------


def _request(subject: str, body: bytes, timeout_s: float) -> bytes:
    """A query (it changes nothing, so it is asked again while nobody can serve it)."""

    async def go() -> bytes:
        nc = await open_client()
        try:
            return await call(
                nc,
                subject,
                body,
                timeout_s,
                unserved_s=UNSERVED_FOR_S,
                on_unserved=say_asking_again,
            )
        finally:
            await nc.close()

    setup_logging("error", "console", stream=sys.stderr)
    return asyncio.run(go())


def cmd_ask(args: argparse.Namespace) -> int:
    if not args.model and args.task_type != "web_search":
        print("error bad_usage: --model is required unless --type web_search", file=sys.stderr)
        return EXIT_USAGE
    request = route.RouteRequest(
        prompt=args.prompt,
        # A web search without --model is summarised by the web worker's own model.
        model=args.model or route.DEFAULT_MODEL,
        task_type=args.task_type,
        worker=args.worker,
        domain=args.domain,
        wait=True,
        timeout_s=args.timeout,
    )
    # The router waits for the task's own timeout plus a margin; wait a little longer than that.
    budget = (args.timeout or 300.0) + 60.0
    if args.stream:
        request = msgspec.structs.replace(request, stream=True)
    body = route_and_wait(request, budget, quiet=args.json or not args.stream)
    if args.json:
        print(body.decode())
    reply = msgspec.json.decode(body, type=route.RouteReply)
    if reply.status == "failed":
        print(
            f"error task_failed: task {reply.task_id} on {reply.worker}: "
            f"{route.failure_of(reply).summary}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if not args.json:
        if not args.stream:
            print(reply.response or "")
        if reply.sources and reply.note is None:
            # With a note the response already is the plain list of sources.
            print_sources(reply.sources)
        print(f"task {reply.task_id} done on {reply.worker}", file=sys.stderr)
        if reply.note:
            print(f"note: {reply.note}", file=sys.stderr)
    return 0


def cmd_embed(args: argparse.Namespace) -> int:
    """One embedding task for every text; each vector printed as a JSON array, in order."""
    request = route.RouteRequest(
        prompt="",
        model=args.model,
        task_type="embedding",
        input=list(args.text),
        dimensions=args.dimensions,
        worker=args.worker,
        wait=True,
        timeout_s=args.timeout,
    )
    body = route_and_wait(request, (args.timeout or 300.0) + 60.0, quiet=True)
    if args.json:
        print(body.decode())
    reply = msgspec.json.decode(body, type=route.RouteReply)
    if reply.status == "failed":
        print(
            f"error task_failed: task {reply.task_id} on {reply.worker}: "
            f"{route.failure_of(reply).summary}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if not args.json:
        for vector in reply.embeddings or []:
            print(_json.encode(vectors.to_floats(vector)).decode())
        print(
            f"task {reply.task_id} done on {reply.worker}: {len(reply.embeddings or [])} "
            f"vectors of {vectors.dimensions((reply.embeddings or [b''])[0])} dimensions",
            file=sys.stderr,
        )
    return 0


def print_sources(sources: Sequence[route.Source]) -> None:
    """A web-search answer's sources, numbered as the answer cites them: ``[n] title`` + url."""
    print("\nSources:")
    for n, source in enumerate(sources, start=1):
        print(f"[{n}] {source.title}\n    {source.url}")


def cmd_task(args: argparse.Namespace) -> int:
    body = _request(TASK, _json.encode(queries.TaskQuery(task_id=args.task_id)), 10.0)
    if args.json:
        print(body.decode())
        return 0
    view = msgspec.json.decode(body, type=queries.TaskView)
    rows: list[tuple[str, Any]] = [
        ("task", view.task_id),
        ("status", view.status),
        ("model", view.model),
        ("domain", view.domain),
        ("type", view.task_type),
        ("worker", view.worker),
        ("queue", view.queue),
        ("attempts", view.attempts),
        ("created", _when(view.created_at)),
        ("ended", _when(view.ended_at)),
    ]
    if view.durations is not None:
        d = view.durations
        rows.append(
            (
                "durations",
                f"total {d.total_ms:.0f} ms, load {_ms(d.load_ms)}, "
                f"prompt eval {_ms(d.prompt_eval_ms)}, eval {_ms(d.eval_ms)}",
            )
        )
    if view.tokens is not None:
        rows.append(("tokens", f"prompt {view.tokens.prompt}, eval {view.tokens.eval}"))
    if view.failure is not None or view.error:
        rows.append(("error", route.failure_of(view).summary))
    if view.thinking:
        rows.append(("thinking", view.thinking))
    rows.append(("response", view.response))
    for key, value in rows:
        if value is not None:
            print(f"{key:>10}  {value}")
    return 0


def cmd_workers(args: argparse.Namespace) -> int:
    body = _request(WORKERS, b"{}", 10.0)
    if args.json:
        print(body.decode())
        return 0
    reply = msgspec.json.decode(body, type=queries.WorkersReply)
    if not reply.workers:
        print("no live workers")
        return 0
    header = (
        "WORKER",
        "HOST",
        "TIER",
        "STATE",
        "HEALTH",
        "QUEUE",
        "HEARTBEAT",
        "MODELS (*: in memory)",
    )
    print("{:<20} {:<16} {:<4} {:<8} {:<8} {:>5} {:>9}  {}".format(*header))
    now = time.time()
    for w in reply.workers:
        print(
            f"{w.worker_id:<20} {w.host:<16} {w.tier:<4} {w.state:<8} {w.health:<8} "
            f"{w.queue_depth:>5} {now - w.last_heartbeat:>7.1f}s  "
            f"{', '.join(_with_capabilities(w))}"
        )
        if w.health == "degraded":
            since = f" for {now - w.health_since:.0f} s" if w.health_since else ""
            print(f"  ! degraded{since}: {w.health_reason or 'no reason given'}")
        for problem in w.problems:
            print(f"  ! {problem}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """The model matrix (`services.cli.model_matrix`): the live workers from the router, the
    figures from the stats service when it answers (else without last use and speed)."""

    async def go() -> tuple[bytes, bytes | None]:
        nc = await open_client()
        try:
            fleet = await call(
                nc,
                WORKERS,
                b"{}",
                10.0,
                unserved_s=UNSERVED_FOR_S,
                on_unserved=say_asking_again,
            )
            try:
                figures: bytes | None = await call(nc, STATS, b"{}", 5.0)
            except CoordinatorError:
                figures = None
            return fleet, figures
        finally:
            await nc.close()

    setup_logging("error", "console", stream=sys.stderr)
    fleet, figures = asyncio.run(go())
    found = model_matrix.matrix(
        msgspec.json.decode(fleet, type=queries.WorkersReply).workers,
        None if figures is None else msgspec.json.decode(figures, type=stats.StatsReply).figures,
    )
    if args.json:
        print(model_matrix.encode(found).decode())
    else:
        print("\n".join(model_table.table(found)))
    return 0


def _with_capabilities(worker: queries.WorkerView) -> list[str]:
    """Each model, marked ``*`` when its backend holds it in memory (no cold load), with what
    it can do beyond plain generation: ``qwen3:8b* (tools,thinking)``."""
    shown = []
    resident = set(worker.resident or ())
    for model in worker.models:
        name = f"{model}*" if model in resident else model
        extra = [c for c in facts_in(worker.facts, model).capabilities if c != COMPLETION]
        shown.append(f"{name} ({','.join(extra)})" if extra else name)
    return shown


def cmd_schemas_export(args: argparse.Namespace) -> int:
    args.dir.mkdir(parents=True, exist_ok=True)
    types: dict[str, Any] = {
        "RouteRequest": route.RouteRequest,
        "RouteReply": route.RouteReply,
        "ErrorBody": route.ErrorBody,
        "CancelRequest": route.CancelRequest,
        "CancelReply": route.CancelReply,
        "CancelNotice": route.CancelNotice,
        "TaskMessage": tasks.TaskMessage,
        "TaskEvent": events.TaskEvent,
        "WorkerEvent": events.WorkerEvent,
        "StatsEvent": events.StatsEvent,
        "QualityEvent": events.QualityEvent,
        "BenchEvent": events.BenchEvent,
        "RoutingFigure": stats.RoutingFigure,
        "WorkerRecord": workers.WorkerRecord,
        "LeaderRecord": leaders.LeaderRecord,
        "TaskQuery": queries.TaskQuery,
        "TaskView": queries.TaskView,
        "WorkersReply": queries.WorkersReply,
    }
    for name, tp in types.items():
        path = args.dir / f"{name}.json"
        path.write_bytes(
            msgspec.json.format(_json.encode(msgspec.json.schema(tp)), indent=2) + b"\n"
        )
        print(path)
    return 0


def _when(at: float | None) -> str | None:
    return None if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


if __name__ == "__main__":
    main()
