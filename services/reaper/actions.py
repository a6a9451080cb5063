"""The reaper's writes: moving a task (a new attempt), failing it, reporting a duplicate.

Moving attempt N to attempt N+1, in this order (`services.runtime.dispatch`, which sends the
router's attempt 1 too; each write rides out a bus outage):

1. the task's ``submitted`` event is read back: its `schemas.work.Work` (everything the
   client asked for, ``stream`` included) goes into the new message whole, so the new
   attempt runs as the client asked;
2. ``routed`` (attempt N+1) is stored: the fence. Taken as a duplicate of one that sends
   the attempt elsewhere (a task judged never routed that its router routed meanwhile),
   that one stands and the move goes no further. From now on a worker holding a copy of
   attempt N finds a newer attempt routed and drops it unrun (``services/worker``), the
   server refuses attempt N's outcome (`services.runtime.outcomes.attempt_fence`), and the
   router and the stats projection count only attempt N+1's outcome. An outcome of attempt
   N stored before the fence is then looked for, on the stream's leader (which holds every
   write before the fence): if there is one, the task ended as it was being moved, and
   attempt N+1 goes no further (its ``routed`` changes nothing: a task's first end
   stands). Otherwise a cancel notice for
   attempts up to N goes out, so a worker still generating one (a worker judged dead that
   is not, a stuck one) stops it instead of running beside attempt N+1;
3. every copy of attempts up to N still in ``TASKS`` is deleted, so none can run later (a copy
   in flight on a dead worker is deleted too: its consumer will not redeliver it, and the
   server frees that worker's one-task slot at once);
4. the task message of attempt N+1 goes to its new queue (``Nats-Msg-Id <task>:<N+1>``).

Every write carries a message id of its attempt, so a reaper that dies halfway and looks again
(or a second reaper) repeats none of them: a repeated ``routed`` or message is dropped by the
stream, and a routed attempt whose message never went out is found as a ghost and moved on.

Failing deletes the copies first, stores the task's latest ``routed`` once more (moving the
fence: a worker still running the attempt finds it moved and the failure stored, and stores
nothing), then the failure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

import msgspec
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError

from schemas import message_ids
from schemas.events import (
    TaskFailed,
    TaskRouted,
    TaskSubmitted,
    WorkerDuplicate,
    encoder,
    task_event_decoder,
)
from schemas.route import CancelNotice
from schemas.subjects import TASKS_STREAM, cancel_notice, task_event
from services.errors import SubmissionLost
from services.fleet.dispatch import routed_event
from services.reaper.decisions import Fail, Move
from services.reaper.detectors import DuplicateFinding
from services.runtime.bus import publish_event
from services.runtime.dispatch import RoutedElsewhere, Withdrawn, dispatch
from services.runtime.outcomes import last_on, store_outcome

log = structlog.get_logger("reaper")


class _Queued(msgspec.Struct):
    """The two fields of a task message that say which attempt of which task it is."""

    task_id: str
    attempt: int


_queued_decoder = msgspec.json.Decoder(_Queued)

# JetStream's error code for a delete of a message that is not there (any more).
MSG_DELETE_FAILED = 10057

QueueIndex = dict[str, list[tuple[int, int]]]
"""task id -> [(stream sequence, attempt)] of its messages on one queue."""


async def queue_index(js: JetStreamContext, queue: str) -> QueueIndex:
    """Every message on ``queue`` still in ``TASKS`` (queued or in flight), by task."""
    index: QueueIndex = {}
    seq = 1
    while True:
        try:
            raw = await js.get_msg(TASKS_STREAM, seq=seq, subject=queue, next=True)
        except NotFoundError:
            return index
        if raw.seq is None:
            return index
        try:
            queued = _queued_decoder.decode(raw.data or b"")
        except msgspec.DecodeError:
            pass  # not a task message: the workers terminate it
        else:
            index.setdefault(queued.task_id, []).append((raw.seq, queued.attempt))
        seq = raw.seq + 1


def copies_up_to(index: QueueIndex, task_id: str, attempt: int) -> list[int]:
    """Stream sequences of the task's messages of ``attempt`` or earlier."""
    return [seq for seq, a in index.get(task_id, []) if a <= attempt]


class Actions:
    """Writes to the bus on the reaper's behalf."""

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js

    async def submission(self, task_id: str) -> TaskSubmitted:
        """The task as it was submitted, from the event log."""
        data = await last_on(self.js, task_event(task_id, "submitted"))
        event = task_event_decoder.decode(data) if data is not None else None
        if not isinstance(event, TaskSubmitted):
            raise SubmissionLost(f"task {task_id}: its submission is not in the event log")
        return event

    async def move(
        self, move: Move, copies: Iterable[int], ended: Callable[[], Awaitable[bool]]
    ) -> bool:
        """Route the task again as ``move.attempt`` and take its older copies out of the
        queues (`services.runtime.dispatch`). False when ``ended()``, asked once the new
        attempt is routed, says the task ended meanwhile, or when the attempt was routed
        elsewhere: its new attempt is not queued then."""
        submitted = await self.submission(move.task_id)
        decision = move.decision
        routed = routed_event(
            submitted,
            move.attempt,
            decision,
            reason=move.reason,
            domain=move.domain,
            at=time.time(),
        )

        def ours(stored: TaskRouted) -> bool:
            # This move asked again (this reaper's, or another's), not a routing elsewhere.
            return (stored.attempt, stored.queue, stored.worker) == (
                move.attempt,
                decision.queue,
                decision.worker_id,
            )

        async def before_queue() -> bool:
            if await ended():
                return False
            notice = CancelNotice(
                task_id=move.task_id,
                reason=f"moved on as attempt {move.attempt} ({move.reason})",
                up_to_attempt=move.attempt - 1,
            )
            await self.nc.publish(cancel_notice(move.task_id), encoder.encode(notice))
            await self.remove(copies)
            return True

        try:
            await dispatch(self.js, submitted, routed, ours=ours, before_queue=before_queue)
        except RoutedElsewhere as exc:
            # A task the reaper took for never routed that its router routed meanwhile (its
            # write held up by an election): that routing stands, and a copy queued here
            # would run where no outcome of it is taken.
            log.warning(
                "attempt already routed elsewhere; the move queues nothing",
                task_id=move.task_id,
                attempt=move.attempt,
                routed_to=exc.stored.worker if exc.stored is not None else None,
                move_to=decision.worker_id,
            )
            return False
        except Withdrawn:
            return False
        return True

    async def fail(self, fail: Fail, copies: Iterable[int]) -> None:
        """Take the task's copies out of the queues, move its attempt's fence, then store
        its failure."""
        await self.remove(copies)
        await self.refence(fail.task_id, fail.attempt)
        await store_outcome(
            self.js,
            TaskFailed(
                at=time.time(),
                task_id=fail.task_id,
                attempt=fail.attempt,
                worker=fail.worker,
                code=fail.code,
                reason=fail.reason,
            ),
        )

    async def refence(self, task_id: str, attempt: int) -> None:
        """Store the task's latest ``routed`` once more, unchanged. A worker still running the
        attempt being failed (judged dead, but only cut off) then finds its fence moved and
        the failure stored, and neither claims nor completes it
        (`services.runtime.outcomes.superseded`). Every reader takes a repeated ``routed`` of
        an attempt under way or over as nothing new."""
        subject = task_event(task_id, "routed")
        data = await last_on(self.js, subject, leader=True)
        if data is not None:
            await self.js.publish(
                subject,
                data,
                headers={"Nats-Msg-Id": message_ids.routed_again_as_failed(task_id, attempt)},
            )

    async def remove(self, copies: Iterable[int]) -> None:
        """Delete task messages by stream sequence; one already gone (acked) is fine."""
        for seq in copies:
            try:
                await self.js.delete_msg(TASKS_STREAM, seq)
            except APIError as exc:
                # Gone already: 404, or 10057 ("no message found", "stream store EOF").
                if not isinstance(exc, NotFoundError) and exc.err_code != MSG_DELETE_FAILED:
                    raise

    async def report_duplicate(self, finding: DuplicateFinding) -> None:
        """The event (``events.worker.<id>.duplicate``) that ``coordinator workers`` shows."""
        await publish_event(
            self.js,
            WorkerDuplicate(
                at=time.time(),
                worker_id=finding.worker_id,
                reason=finding.detail,
                num_waiting=finding.num_waiting,
                instances=list(finding.instances),
                hosts=list(finding.hosts),
            ),
        )
