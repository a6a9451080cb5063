"""A task attempt's life on the bus, for every service that runs tasks.

Claiming an attempt (its ``started``, refused for a copy the reaper has moved on), storing an
outcome once (a message id per attempt, so a retried publish, a redelivered task or
a second process racing for the same attempt stores one outcome: the first), finding what a
task's stream already holds, and keeping a long task's message from being redelivered.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from types import TracebackType
from typing import NamedTuple, Protocol, Self

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from schemas import message_ids
from schemas.events import (
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    task_event_decoder,
)
from schemas.queries import LastEvent, LastEventQuery
from schemas.subjects import (
    EVENTS_STREAM,
    LAST_EVENT,
    task_event,
    task_event_source,
    task_events,
    workers_task_event,
)
from schemas.tasks import TaskMessage
from services.errors import NotFound
from services.runtime.bus import (
    fences_by_subject,
    is_wrong_last_sequence,
    last_sequence_said,
    publish_event,
)
from services.runtime.request import call

log = structlog.get_logger("outcomes")

# How long an outcome event is tried before giving up (the caller returns the task), and the
# longest pause between two tries. Long enough to outlast a cluster electing the event log's
# leader (seconds): an outcome given up on while it may have been stored makes its task look
# lost, and the reaper moves a task that has in fact ended.
OUTCOME_RETRY_S = 30.0
OUTCOME_RETRY_MAX_DELAY_S = 2.0


async def store_outcome(
    js: JetStreamContext,
    outcome: TaskCompleted | TaskFailed,
    *,
    by: str | None = None,
    retry_s: float = OUTCOME_RETRY_S,
    first_delay_s: float = 0.2,
    fence: tuple[str, int] | None = None,
) -> None:
    """Publish ``outcome`` with its attempt's message id, retrying with backoff for up to
    ``retry_s`` (its message id keeps a retry single); raise at last. ``by``: the worker
    recording it, on its own subject (None: the router or the reaper). ``fence``: stored only
    while that is the subject's last sequence (`publish_event`'s ``expect_last``); a refusal
    is raised at once (`is_wrong_last_sequence`)."""
    delay = first_delay_s
    deadline = time.monotonic() + retry_s
    while True:
        try:
            await publish_event(
                js,
                outcome,
                msg_id=message_ids.outcome(outcome.task_id, outcome.attempt, by),
                by=by,
                expect_last=fence,
            )
            return
        except Exception as exc:
            if fence is not None and is_wrong_last_sequence(exc):
                raise
            if time.monotonic() + delay >= deadline:
                raise
            log.warning(
                "storing the outcome failed; retrying", task_id=outcome.task_id, error=repr(exc)
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, OUTCOME_RETRY_MAX_DELAY_S)


class Stored(NamedTuple):
    """A message of ``EVENTS`` as a read found it."""

    subject: str
    data: bytes
    seq: int


class EventReads(Protocol):
    """Where a process that may not read the event log itself reads a task's last events."""

    async def last(self, subject: str) -> Stored | None: ...


# A read of the event log: JetStream's own, or one asked of a service (`RouterReads`).
Reads = JetStreamContext | EventReads


class RouterReads:
    """A worker with an identity reads its tasks' events through the router
    (`schemas.subjects.LAST_EVENT`), which answers only about the tasks routed to it: the
    server's permissions cannot keep a direct get to one task (a ``*`` in the task's place of
    the subject reads every task's last event)."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc

    async def last(self, subject: str) -> Stored | None:
        query = msgspec.json.encode(LastEventQuery(subject=subject))
        try:
            reply = await call(self.nc, LAST_EVENT, query, LAST_EVENT_TIMEOUT_S)
        except NotFound:
            return None
        event = msgspec.json.decode(reply, type=LastEvent)
        return Stored(event.subject, event.data, event.seq)


LAST_EVENT_TIMEOUT_S = 5.0


async def last_stored(js: Reads, subject: str, *, leader: bool = False) -> Stored | None:
    """The last message on ``subject`` (wildcards allowed) in ``EVENTS``; None when there is
    none. Read through ``js`` when it is not JetStream's (`RouterReads`; never the leader's).

    A direct get names the subject in the API subject
    (``$JS.API.DIRECT.GET.EVENTS.<subject>``), so a worker's NATS user may read its tasks'
    events and nothing else; a stream made before ``allow_direct`` gets the plain request.
    Any copy of a replicated stream may answer a direct get, one that lags included; with
    ``leader`` the stream's leader answers (the plain request, which a worker's NATS user may
    not make): it holds every write acknowledged before the question.
    """
    if not isinstance(js, JetStreamContext):
        if leader:
            raise ValueError("a read through a service is never the stream leader's")
        return await js.last(subject)
    try:
        if leader:
            stored = await js.get_last_msg(EVENTS_STREAM, subject)
        else:
            try:
                stored = await js.get_last_msg(EVENTS_STREAM, subject, direct=True)
            except nats.errors.NoRespondersError:
                stored = await js.get_last_msg(EVENTS_STREAM, subject)
    except NotFoundError:
        return None
    return Stored(stored.subject or subject, stored.data or b"", stored.seq or 0)


async def last_on(js: Reads, subject: str, *, leader: bool = False) -> bytes | None:
    """The data of the last message on ``subject`` in ``EVENTS`` (`last_stored`)."""
    stored = await last_stored(js, subject, leader=leader)
    return None if stored is None else stored.data


class Sourced(NamedTuple):
    """A task event as stored: the worker its subject names (None: the router's or the
    reaper's), and its sequence in ``EVENTS`` (0 when the read did not say)."""

    event: TaskEvent
    source: str | None
    seq: int = 0


async def last_task_events(
    js: Reads,
    task_id: str,
    kind: str,
    *,
    workers_only: bool = False,
    leader: bool = False,
) -> list[Sourced]:
    """The task's last ``kind`` event from the router or reaper (unless ``workers_only``) and
    the last from any worker (`schemas.subjects.task_event`), each with its source; read from
    the stream's leader with ``leader`` (`last_stored`)."""
    subjects = [workers_task_event(task_id, kind)]
    if not workers_only:
        subjects.insert(0, task_event(task_id, kind))
    found: list[Sourced] = []
    for subject in subjects:
        stored = await last_stored(js, subject, leader=leader)
        if stored is not None:
            found.append(
                Sourced(
                    task_event_decoder.decode(stored.data),
                    task_event_source(stored.subject),
                    stored.seq,
                )
            )
    return found


async def stored_ends(js: Reads, task_id: str, *, leader: bool = False) -> list[Sourced]:
    """The task's last outcome events of each kind and source (`last_task_events`): the last
    ``completed`` a worker stored, and the last ``failed`` from a worker and from the router
    or the reaper. Only workers complete a task, so nobody asks for the router's and reaper's
    ``completed`` subject, which a worker's NATS user may not read (a worker checking its
    redelivered task would wait out every such read)."""
    return [
        *await last_task_events(js, task_id, "completed", workers_only=True, leader=leader),
        *await last_task_events(js, task_id, "failed", leader=leader),
    ]


def outcome_among(
    ends: list[Sourced], attempt: int, accepted: Callable[[Sourced], bool]
) -> TaskCompleted | TaskFailed | None:
    """The outcome among ``ends`` of this attempt or a later one that ``accepted`` takes
    (by `services.fleet.binding`), if there is one."""
    for sourced in ends:
        event = sourced[0]
        if (
            isinstance(event, TaskCompleted | TaskFailed)
            and event.attempt >= attempt
            and accepted(sourced)
        ):
            return event
    return None


async def stored_outcome(
    js: Reads,
    task_id: str,
    attempt: int,
    accepted: Callable[[Sourced], bool],
    *,
    leader: bool = False,
) -> TaskCompleted | TaskFailed | None:
    """The outcome stored for this attempt of the task or a later one that ``accepted`` takes,
    if there is one (`stored_ends`, `outcome_among`)."""
    return outcome_among(await stored_ends(js, task_id, leader=leader), attempt, accepted)


async def routings(js: JetStreamContext, task_id: str) -> list[TaskRouted]:
    """Every stored ``routed`` of the task, oldest first, read from the stream's leader in
    order through the task's ``routed`` subject. A few reads: a task is routed once per
    attempt, and this is asked only off the hot path (an earlier attempt's end, a worker's
    question about a task it holds)."""
    subject = task_event(task_id, "routed")
    found: list[TaskRouted] = []
    seq = 1
    while True:
        try:
            msg = await js.get_msg(EVENTS_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return found
        event = task_event_decoder.decode(msg.data or b"")
        if isinstance(event, TaskRouted):
            found.append(event)
        if msg.seq is None:
            return found
        seq = msg.seq + 1


async def routing_of(js: JetStreamContext, task_id: str, attempt: int) -> TaskRouted | None:
    """The stored ``routed`` of this attempt of the task (its last, if it was stored more than
    once); None when the log holds none (`routings`)."""
    return next((r for r in reversed(await routings(js, task_id)) if r.attempt == attempt), None)


async def current_attempt(js: Reads, task_id: str) -> int | None:
    """The attempt the task's latest ``routed`` names: the only one that may still run.

    The reaper moves a task by routing attempt N+1 before anything else, so a worker that
    finds a lower number on its message holds a stale copy and must not run it. None when
    no ``routed`` is stored (the log was cut): the caller runs what it holds.
    """
    data = await last_on(js, task_event(task_id, "routed"))
    if data is None:
        return None
    event = task_event_decoder.decode(data)
    return event.attempt if isinstance(event, TaskRouted) else None


async def moved_on(js: Reads, task: TaskMessage) -> bool:
    """Does the task's last ``routed`` name a later attempt than this copy's?"""
    current = await current_attempt(js, task.task_id)
    return current is not None and current > task.attempt


async def superseded(js: Reads, task: TaskMessage) -> bool:
    """Was this copy's attempt moved on, or failed for good by the reaper (or the router)?
    Asked when its fence was refused: either moves it (`services.reaper.actions`)."""
    if await moved_on(js, task):
        return True
    data = await last_on(js, task_event(task.task_id, "failed"))
    failed = task_event_decoder.decode(data) if data is not None else None
    return isinstance(failed, TaskFailed) and failed.attempt >= task.attempt


async def fenced_out(
    js: Reads, task: TaskMessage, fence: tuple[str, int], refusal: BaseException
) -> bool:
    """Was this attempt's fenced write refused because it was moved on or failed for good?

    The refusal itself says which sequence is now the last on the attempt's ``routed``
    subject, as the stream's leader found it with the write: a later one is a newer
    ``routed`` (a move, or the reaper's fence before it fails the attempt); an earlier one
    (0 included) is its ``routed`` gone, the log cut. Only when the refusal does not say is
    the log read (`superseded`), and that read may come from a copy that lags: a worker
    whose node was cut off reads its own node's, which has not heard of the move yet."""
    said = last_sequence_said(refusal)
    if said is not None:
        return said > fence[1]
    return await superseded(js, task)


def attempt_fence(nc: Client, task: TaskMessage) -> tuple[str, int] | None:
    """The fence of this attempt's own events (its ``started`` and its outcome): stored only
    while the attempt's ``routed`` is the task's last one, so nothing of an attempt the
    reaper moved on is stored after the move. The server checks it with the write itself, and
    refuses a write racing a move (nats-server 2.11 and newer; None on an older server, or for
    a message without its ``routed_seq``)."""
    if task.routed_seq is not None and fences_by_subject(nc):
        return (task_event(task.task_id, "routed"), task.routed_seq)
    return None


async def store_attempt_outcome(
    nc: Client,
    js: JetStreamContext,
    task: TaskMessage,
    outcome: TaskCompleted | TaskFailed,
    by: str,
    *,
    retry_s: float = OUTCOME_RETRY_S,
    reads: Reads | None = None,
) -> bool:
    """Store a worker's outcome of the attempt ``task`` is a copy of, fenced (`attempt_fence`),
    trying for up to ``retry_s``: False when the task was moved on or failed for good
    meanwhile and nothing was stored (the reaper routed another attempt, or failed this one,
    while it ran: the task has its one outcome elsewhere)."""
    fence = attempt_fence(nc, task)
    try:
        await store_outcome(js, outcome, by=by, fence=fence, retry_s=retry_s)
    except Exception as exc:
        if fence is None or not is_wrong_last_sequence(exc):
            raise
        if await fenced_out(reads or js, task, fence, exc):
            return False
        await store_outcome(js, outcome, by=by)  # its ``routed`` is gone (the log was cut)
    return True


class NotAlone(Exception):
    """A claim made alone (`claim`) found something of the task stored after what its worker
    judged: a start, an outcome or a move its read of the log had not shown. The message goes
    back to the queue, and its redelivery judges the task again."""


async def claim(
    nc: Client,
    js: JetStreamContext,
    started: TaskStarted,
    task: TaskMessage,
    *,
    alone_after: int | None = None,
    reads: Reads | None = None,
) -> bool:
    """Store this attempt's ``started``, unless the task was moved on: False then (attempt
    fencing), and nothing is stored.

    The reaper routes attempt N+1 before it deletes attempt N's copies, so a copy that got
    here first (a worker back from the dead, a ghost queue pulled at last) is recognised.
    With the attempt's ``routed_seq`` and nats-server 2.11 (asked each time: a cluster's
    servers may differ), the fence is the publish itself: stored only while that ``routed``
    is the task's last one. Otherwise the task's last ``routed`` is looked up first. A
    publish that fails is tried once more (a second copy after a lost acknowledgement is
    what a redelivery gives anyway).

    ``alone_after``, for a kind that never runs a task twice: the sequence of the newest
    event of the task its worker read and judged (the attempt's ``routed`` at least). The
    fence is then every event of the task: stored only while nothing of it was stored after
    that, so a start or an outcome that a lagging copy of the log hid from the worker's read
    is never run past. Refused so, it returns False when the task was moved on, and raises
    `NotAlone` otherwise.
    """
    read = reads or js  # the task's events (`RouterReads` for a worker with an identity)
    fence = attempt_fence(nc, task)
    if fence is None and await moved_on(read, task):
        return False
    if fence is not None and alone_after is not None:
        fence = (task_events(task.task_id), max(fence[1], alone_after))
    failures = 0
    while True:
        try:
            await publish_event(js, started, expect_last=fence)
            return True
        except Exception as exc:
            if fence is not None and is_wrong_last_sequence(exc):
                if alone_after is not None and _newer_said(fence, exc):
                    if await moved_on(read, task):
                        return False
                    raise NotAlone(
                        f"something of task {task.task_id} was stored after it was judged"
                    ) from exc
                if await fenced_out(read, task, fence, exc):
                    return False
                fence = None  # its ``routed`` is gone (the log was cut): run what is held
                continue
            failures += 1
            if failures > 1:
                raise
            log.warning("storing the started event failed; trying again", error=repr(exc))


def _newer_said(fence: tuple[str, int], refusal: BaseException) -> bool:
    """Does a refused fence's refusal name a later sequence than the fence's (or none)?"""
    said = last_sequence_said(refusal)
    return said is None or said > fence[1]


async def last_started(js: Reads, task_id: str, attempt: int) -> Sourced | None:
    """The latest ``started`` of this attempt, with the worker whose subject it is on: who
    began it, on which host, when."""
    stored = await last_stored(js, workers_task_event(task_id, "started"))
    if stored is None:
        return None
    event = task_event_decoder.decode(stored.data)
    if isinstance(event, TaskStarted) and event.attempt == attempt:
        return Sourced(event, task_event_source(stored.subject), stored.seq)
    return None


class KeepAlive:
    """Tells JetStream a task is still being worked on, so its message is not redelivered.

    ``in_progress()`` goes out at most every ``ack_wait_s / 3``: on `progress` (call it as
    output arrives) and, while the work is silent (loading a model, waiting for a slow
    server), from a timer. A failed ``in_progress()`` (the bus is reconnecting) is logged,
    never raised into the work. Use as ``async with KeepAlive(msg, ack_wait_s) as alive``.
    A timer, not a task: most work ends long before the first beat, and then costs nothing.
    """

    def __init__(self, msg: Msg, ack_wait_s: float) -> None:
        self.msg = msg
        self.interval_s = ack_wait_s / 3
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None
        self._beating: asyncio.Task[None] | None = None

    async def progress(self) -> None:
        """Signal life if the last signal is older than the interval."""
        if time.monotonic() - self._last < self.interval_s:
            return
        self._last = time.monotonic()
        try:
            await self.msg.in_progress()
        except Exception as exc:
            log.warning("in_progress failed", subject=self.msg.subject, error=repr(exc))

    def _schedule(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(self.interval_s, self._beat)

    def _beat(self) -> None:
        self._beating = asyncio.create_task(self.progress())
        self._schedule()

    async def __aenter__(self) -> Self:
        self._last = time.monotonic()
        self._schedule()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._beating is not None and not self._beating.done():
            self._beating.cancel()
            with suppress(asyncio.CancelledError):
                await self._beating
