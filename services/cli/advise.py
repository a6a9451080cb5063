"""``coordinator models advise``: where models should live. The I/O edge of
`services.fleet.placement`: it reads the live workers (the router's ``coordinator.workers``),
the sleeping ones (the ``asleep`` bucket), the figures (``coordinator.stats``, when the stats
service answers) and the task and worker events of the last ``--days`` (straight from
``EVENTS``), and prints the demand and the proposals. It changes nothing.

Reading ``EVENTS`` needs a NATS user that may make a consumer on it: the operator's identity
in a fleet with identities.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import sys
import time
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from schemas import queries, stats
from schemas.events import AnyEvent, any_event_decoder
from schemas.subjects import ASLEEP_BUCKET, EVENTS_STREAM, STATS, WORKERS
from schemas.workers import WorkerRecord, worker_record_decoder
from services.cli.client import open_client, say_asking_again
from services.errors import CoordinatorError, Unavailable
from services.fleet import placement
from services.runtime.aliases import consumer_name, rename_on_reset
from services.runtime.bus import bucket_keys
from services.runtime.logging import setup_logging
from services.runtime.request import UNSERVED_FOR_S, call

# The events the advice reads: the tasks', and the workers' (when a machine slept).
ADVICE_SUBJECTS: Final = ("events.task.>", "events.worker.>")
# A read of the log that delivers nothing for this long has stopped: it fails.
READ_IDLE_S: Final = 15.0
# How long a JetStream request may take (a user without the right is not answered at all).
JS_TIMEOUT_S: Final = 5.0
# What a refusal adds: who may read the log (`services.cli.permissions`).
OPERATOR: Final = " (reading the event log and the asleep bucket takes the operator's NATS user)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``coordinator models advise``."""
    parser.add_argument(
        "--days",
        type=_positive_days,
        default=7.0,
        metavar="N",
        help="the window of demand read from the event log: the last N days (default 7)",
    )
    parser.add_argument("--json", action="store_true", help="print every field as JSON")


def _positive_days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of days: {text!r}") from None
    if not 0 < days <= 3650:
        raise argparse.ArgumentTypeError(f"days must be more than 0 and at most 3650, not {text}")
    return days


def cmd_advise(args: argparse.Namespace) -> int:
    """Read the fleet and the window's events, print the advice; change nothing."""
    setup_logging("error", "console", stream=sys.stderr)
    until = time.time()
    since = until - args.days * placement.DAY_S
    fleet, figures, sleepers, events = asyncio.run(_read(since))
    advice = placement.advise(
        events,
        msgspec.json.decode(fleet, type=queries.WorkersReply).workers,
        None if figures is None else msgspec.json.decode(figures, type=stats.StatsReply).figures,
        sleepers=sleepers,
        since=since,
        until=until,
    )
    if args.json:
        print(placement.encode(advice).decode())
    else:
        print("\n".join(lines(advice)))
    return 0


async def _read(
    since: float,
) -> tuple[bytes, bytes | None, list[WorkerRecord], list[AnyEvent]]:
    nc = await open_client()
    try:
        fleet = await call(
            nc, WORKERS, b"{}", 10.0, unserved_s=UNSERVED_FOR_S, on_unserved=say_asking_again
        )
        try:
            figures: bytes | None = await call(nc, STATS, b"{}", 5.0)
        except CoordinatorError:
            figures = None  # speeds then come from the window's own completions
        js = nc.jetstream(timeout=JS_TIMEOUT_S)
        sleepers = await read_sleepers(js)
        events: list[AnyEvent] = []
        for subject in ADVICE_SUBJECTS:
            events.extend(await read_events(js, subject, since))
        return fleet, figures, sleepers, events
    finally:
        await nc.close()


async def read_sleepers(js: JetStreamContext) -> list[WorkerRecord]:
    """The records of the ``asleep`` bucket: the machines asleep now (none without it)."""
    try:
        keys = await bucket_keys(js, ASLEEP_BUCKET)
        kv = await js.key_value(ASLEEP_BUCKET)
    except nats.js.errors.NotFoundError:
        return []  # no worker ever slept here
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        raise Unavailable(f"cannot read the {ASLEEP_BUCKET} bucket: {exc!r}{OPERATOR}") from exc
    records = []
    for key in keys:
        with suppress(nats.js.errors.KeyNotFoundError, msgspec.DecodeError):
            entry = await kv.get(key)
            records.append(worker_record_decoder.decode(entry.value or b""))
    return records


async def read_events(js: JetStreamContext, subject: str, since: float) -> list[AnyEvent]:
    """The events on ``subject`` stored in ``EVENTS`` from ``since`` (epoch seconds) on, in
    stream order, through an ordered consumer (ephemeral, nothing acknowledged), up to the
    last one stored when the read began; one that does not decode is passed over.

    (The router's and the reaper's readers of the log by time follow it for good, and the
    stats service's replay reads by sequence: this one reads a window once and ends.)"""
    try:
        last = (await js.stream_info(EVENTS_STREAM)).state.last_seq or 0
    except nats.js.errors.NotFoundError as exc:
        raise Unavailable(f"no {EVENTS_STREAM} stream: run `coordinator setup`") from exc
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        raise Unavailable(f"cannot read the {EVENTS_STREAM} stream: {exc!r}{OPERATOR}") from exc
    events: list[AnyEvent] = []
    done = asyncio.Event()
    delivered = 0

    async def on_msg(msg: Msg) -> None:
        nonlocal delivered
        delivered += 1
        with suppress(msgspec.DecodeError):
            events.append(any_event_decoder.decode(msg.data))
        metadata = msg.metadata
        if metadata.num_pending == 0 or metadata.sequence.stream >= last:
            done.set()

    start = datetime.datetime.fromtimestamp(since, tz=datetime.UTC)
    try:
        sub = await js.subscribe(
            subject,
            stream=EVENTS_STREAM,
            cb=on_msg,
            ordered_consumer=True,
            config=ConsumerConfig(
                name=consumer_name("advise"),
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=start,
            ),
        )
    except (nats.errors.Error, nats.js.errors.Error) as exc:
        raise Unavailable(
            f"cannot read the event log ({EVENTS_STREAM}): {exc!r}{OPERATOR}"
        ) from exc
    rename_on_reset(sub, "advise")
    try:
        try:
            info = await sub.consumer_info()
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            raise Unavailable(f"cannot follow the read of {EVENTS_STREAM}: {exc!r}") from exc
        if not info.num_pending and not (info.delivered and info.delivered.consumer_seq):
            return events  # nothing stored in the window
        seen = -1
        while not done.is_set():
            if delivered == seen:
                raise Unavailable(
                    f"the event log stopped delivering after {delivered} events "
                    f"(nothing for {READ_IDLE_S:g} s)"
                )
            seen = delivered
            with suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), READ_IDLE_S)
    finally:
        with suppress(Exception):
            await sub.unsubscribe()
    return events


def lines(advice: placement.Advice) -> list[str]:
    """The advice for people: the demand per model, then each proposal with its expected
    effect, why, and the command that would carry it out; then the notes."""
    days = f"{_num(advice.days)} day" + ("" if advice.days == 1 else "s")
    out = [f"demand over the last {days}, per day:"]
    if advice.demand:
        out.append(
            f"  {'MODEL':<32} {'REQUESTS':>8} {'TOKENS':>9} {'WAIT p50':>9}  COLD LOADS (worker)"
        )
        for d in advice.demand:
            cold = ", ".join(f"{w} {_num(n)}" for w, n in d.cold_loads_per_day.items()) or "-"
            out.append(
                f"  {d.model:<32} {_num(d.requests_per_day):>8} {_tokens(d.tokens_per_day):>9} "
                f"{_seconds(d.wait_p50_s):>9}  {cold}"
            )
    else:
        out.append("  no request")
    out.append("")
    if not advice.proposals:
        out.append("no proposal: the models are where their demand wants them")
    else:
        out.append("proposals (nothing is changed):")
        for n, p in enumerate(advice.proposals, 1):
            out.append(f"{n:>3}. {_headline(p)}")
            out.append(f"     why: {p.reason}")
            verb = "pull" if p.action == "pull" else "rm"
            out.append(f"     to do it: coordinator {verb} {p.model} --on {p.worker}")
    if advice.notes:
        out.append("notes:")
        out.extend(f"  ! {note}" for note in advice.notes)
    if not advice.figures:
        out.append("(the stats service did not answer: speeds are the window's own)")
    return out


def _headline(p: placement.Proposal) -> str:
    if p.action == "remove":
        return f"remove {p.model} from {p.worker} (unused)"
    where = " and ".join(p.sources)
    effects = []
    before, after = p.before, p.after
    if before is not None and after is not None:
        if before.asked_asleep_per_day:
            effects.append(
                f"{_num(before.asked_asleep_per_day)} requests a day that found {where} asleep "
                f"would find {p.worker} awake"
            )
        effects.append(
            f"{_num(before.cold_loads_per_day)} cold loads a day on {where} would become "
            f"{_num(after.cold_loads_per_day)}"
        )
        if before.wait_p50_s is not None:
            effects.append(f"wait p50 {_seconds(before.wait_p50_s)} → {_seconds(after.wait_p50_s)}")
    return f"pull {p.model} onto {p.worker}: " + "; ".join(effects)


def _num(value: float) -> str:
    return f"{value:.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def _tokens(value: float) -> str:
    return f"{value / 1000:.1f}k" if value >= 1000 else f"{value:.0f}"


def _seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f} s"
