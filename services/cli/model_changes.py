"""``coordinator pull``, ``create``, ``copy`` and ``rm``: a change to the models of chosen
machines, carried out by each machine's worker through its backend's own API, each a
``model_change`` task routed to that worker (it finishes the task it runs first; a sleeping
machine is woken for it). Each machine's progress is printed as it streams back, then its
outcome; the exit status is 1 when any machine failed. Only the operator may change models.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Final

import msgspec
from nats.aio.client import Client

from schemas.queries import WorkersReply, WorkerView
from schemas.route import ModelProgress, RouteReply, RouteRequest
from schemas.subjects import ROUTE, WORKERS
from schemas.work import ModelChange
from services.cli.client import open_client, say_asking_again
from services.cli.modelfile import parse_modelfile
from services.errors import BadRequest, CoordinatorError
from services.fleet.model_matrix import holds, known_size
from services.runtime.logging import setup_logging
from services.runtime.request import (
    REASK_AFTER_S,
    UNSERVED_FOR_S,
    call,
    new_task_id,
    stream_call,
)

# How long a change may take on one machine (a pull of tens of GB on a slow line).
DEFAULT_TIMEOUT_S: Final = 6 * 3600.0
# A pull's progress is printed again once its share done has moved this far.
PRINT_STEP: Final = 0.1

_reply_decoder = msgspec.json.Decoder(RouteReply)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    def machines(parser: argparse.ArgumentParser, *, every: str) -> None:
        group = parser.add_mutually_exclusive_group(required=True)
        group.add_argument("--on", nargs="+", metavar="WORKER", help="the machines, by worker id")
        group.add_argument("--all", action="store_true", help=f"{every} (live ones)")
        parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S")

    pull = sub.add_parser("pull", help="pull a model onto chosen machines (through their Ollama)")
    pull.add_argument("model")
    pull.add_argument("--insecure", action="store_true", help="allow a registry without TLS")
    machines(pull, every="every registered Ollama machine that lacks it")
    pull.set_defaults(func=cmd_change, op="pull")

    create = sub.add_parser("create", help="create a model from a Modelfile on chosen machines")
    create.add_argument("model")
    create.add_argument("-f", "--file", type=Path, required=True, help="the Modelfile")
    machines(create, every="every registered machine that has its FROM model")
    create.set_defaults(func=cmd_change, op="create")

    copy = sub.add_parser("copy", help="copy a model under another name on chosen machines")
    copy.add_argument("source")
    copy.add_argument("model", metavar="destination")
    machines(copy, every="every registered machine that has the source")
    copy.set_defaults(func=cmd_change, op="copy")

    rm = sub.add_parser("rm", help="remove a model from chosen machines")
    rm.add_argument("model")
    machines(rm, every="every registered machine that has it")
    rm.set_defaults(func=cmd_change, op="delete")


def change_of(args: argparse.Namespace) -> ModelChange:
    """The change the command line asks for (a Modelfile read for ``create``)."""
    match args.op:
        case "create":
            try:
                text = args.file.read_text(encoding="utf-8")
            except OSError as exc:
                raise BadRequest(f"cannot read the Modelfile {args.file}: {exc}") from None
            return parse_modelfile(text)
        case "copy":
            return ModelChange(op="copy", source=args.source)
        case "pull":
            return ModelChange(op="pull", insecure=args.insecure)
        case _:
            return ModelChange(op="delete")


def machines_for(
    change: ModelChange, model: str, workers: Sequence[WorkerView], on: Sequence[str] | None
) -> list[str]:
    """The worker ids the change goes to: those named (a sleeping machine is not among the
    live ``workers``: the router wakes it, or says it knows no such worker), or with ``on``
    None every live one it makes sense on (a pull: those that lack the model; a removal:
    those that have it; a copy or create: those that have its source)."""
    if on is not None:
        return list(dict.fromkeys(on))
    known = {w.worker_id: w for w in workers if w.tier != "web"}
    wanted = model if change.op in ("pull", "delete") else change.source or model
    chosen = [w.worker_id for w in known.values() if holds(w, wanted) != (change.op == "pull")]
    if not chosen:
        raise BadRequest(f"no registered machine to {change.op} {model} on")
    return sorted(chosen)


def progress_text(step: ModelProgress) -> str:
    """One step as a line: ``pulling 3f2a1b9c: 45% (1.2 of 2.6 GB)``, else its status."""
    if step.total and step.completed is not None:
        share = step.completed / step.total
        return (
            f"{step.status}: {share:.0%} ({step.completed / 1e9:.1f} of {step.total / 1e9:.1f} GB)"
        )
    return step.status


class _Printer:
    """Prints a machine's steps: each new status, and a download each `PRINT_STEP` on."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self.status = ""
        self.share = -1.0

    def step(self, step: ModelProgress) -> None:
        share = step.completed / step.total if step.total and step.completed is not None else -1
        done = share >= 1 > self.share
        if step.status == self.status and share < self.share + PRINT_STEP and not done:
            return
        self.status, self.share = step.status, share
        print(f"{self.worker}: {progress_text(step)}", flush=True)


async def _change_on(
    nc: Client, worker: str, model: str, change: ModelChange, timeout_s: float
) -> bool:
    """The change on one machine, its steps printed; True when it went through."""
    request = RouteRequest(
        prompt="",
        model=model,
        task_type="model_change",
        change=change,
        worker=worker,
        wait=True,
        stream=True,
        timeout_s=timeout_s,
        task_id=new_task_id(),
    )
    printer = _Printer(worker)
    final = b""
    try:
        async for item in stream_call(
            nc,
            ROUTE,
            msgspec.json.encode(request),
            timeout_s,
            reask_s=REASK_AFTER_S,
            unserved_s=UNSERVED_FOR_S,
            on_unserved=say_asking_again,
        ):
            if isinstance(item, bytes):
                final = item
            elif item.progress is not None:
                printer.step(item.progress)
    except CoordinatorError as exc:
        print(f"{worker}: {exc.code}: {exc.message}", file=sys.stderr)
        return False
    reply = _reply_decoder.decode(final)
    if reply.status != "done":
        failure = reply.failure
        said = f"{failure.code}: {failure.message}" if failure else reply.error or reply.status
        print(f"{worker}: failed: {said}", file=sys.stderr)
        return False
    print(f"{worker}: {reply.response}")
    return True


def cmd_change(args: argparse.Namespace) -> int:
    setup_logging("error", "console", stream=sys.stderr)
    change = change_of(args)

    async def go() -> list[bool]:
        nc = await open_client()
        try:
            listed = await call(
                nc, WORKERS, b"{}", 10.0, unserved_s=UNSERVED_FOR_S, on_unserved=say_asking_again
            )
            workers = msgspec.json.decode(listed, type=WorkersReply).workers
            on = None if args.all else args.on
            chosen = machines_for(change, args.model, workers, on)
            sized = change
            if change.op == "pull":
                sized = msgspec.structs.replace(change, size=known_size(args.model, workers))
            return list(
                await asyncio.gather(
                    *(_change_on(nc, w, args.model, sized, args.timeout) for w in chosen)
                )
            )
        finally:
            await nc.close()

    done = asyncio.run(go())
    return 0 if all(done) else 1
