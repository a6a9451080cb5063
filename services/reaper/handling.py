"""What the reaper does about its findings: decide, then carry the decisions out.

Each action is keyed by (task, attempt) and not repeated for `ACT_RETRY_S`, the time its own
events take to come back; if they never do (the write failed), it is tried again. Before
acting, the task is read back once more: one that ended or moved on meanwhile is left alone.
A duplicate worker is reported (an event and an error log) at most every `DUPLICATE_REPEAT_S`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Iterable

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from schemas.events import TaskCompleted, TaskFailed
from services.errors import SubmissionLost
from services.fleet.binding import refusal
from services.reaper.actions import Actions, QueueIndex, copies_up_to, queue_index
from services.reaper.decisions import Fail, Move, Wait, decide
from services.reaper.detectors import DuplicateFinding, TaskFinding
from services.reaper.settings import ReaperSettings
from services.reaper.view import ReaperView, TaskTrack, routing
from services.runtime.outcomes import Sourced, current_attempt, stored_outcome

log = structlog.get_logger("reaper")

# How long an action's own events get to come back before it is tried again.
ACT_RETRY_S = 15.0
# A duplicate that persists is reported again this often (event and error log).
DUPLICATE_REPEAT_S = 30.0
# Actions carried out at once (each is a handful of round trips to the server).
PARALLEL_ACTIONS = 8


class FindingHandler:
    """Acts on findings against ``view``, and counts what it did (moved, failed, duplicates)."""

    def __init__(self, nc: Client, view: ReaperView, settings: ReaperSettings) -> None:
        self.js: JetStreamContext = nc.jetstream()
        self.view = view
        self.settings = settings
        self.actions = Actions(nc, self.js)
        self._acted: dict[tuple[str, int], float] = {}
        self._reported: dict[str, float] = {}
        self.moved = 0
        self.failed = 0
        self.duplicates = 0

    def forget_old(self, now: float) -> None:
        """Let actions older than `ACT_RETRY_S` be tried again, if still needed."""
        self._acted = {k: at for k, at in self._acted.items() if now - at < ACT_RETRY_S}

    async def report(self, finding: DuplicateFinding, now: float) -> None:
        """Log and record a duplicate worker, unless it was reported lately."""
        if now - self._reported.get(finding.worker_id, float("-inf")) < DUPLICATE_REPEAT_S:
            return
        log.error(
            "duplicate worker",
            worker_id=finding.worker_id,
            detail=finding.detail,
            num_waiting=finding.num_waiting,
            instances=list(finding.instances),
            hosts=list(finding.hosts),
        )
        try:
            await self.actions.report_duplicate(finding)
        except Exception as exc:
            log.warning("could not record the duplicate", error=repr(exc))
            return
        self._reported[finding.worker_id] = now
        self.duplicates += 1

    async def act(
        self, findings: Iterable[TaskFinding], now: float, *, settling: bool = False
    ) -> None:
        """Decide for every finding (routing one after the other, so moved tasks spread out),
        then carry the decisions out a few at a time. While ``settling`` (the registry is
        being read again), a task no live worker could take is left for a later look."""
        queued = self.view.queued()
        plans: list[tuple[TaskFinding, TaskTrack, Move | Fail]] = []
        for finding in findings:
            key = (finding.task_id, finding.attempt)
            task = self.view.tasks.get(finding.task_id)
            if key in self._acted or task is None:
                continue
            plan = decide(
                finding,
                task,
                self.view.workers.values(),
                now=now,
                ttl_s=self.settings.worker_ttl_s,
                max_attempts=self.settings.max_attempts,
                gpu_models=self.settings.gpu_models,
                gpu_preference=self.settings.gpu_preference,
                figures=self.view.figures,
                queued=queued,
                settling=settling,
            )
            if isinstance(plan, Wait):
                log.info(
                    "verdict deferred: the registry is being read again",
                    task_id=plan.task_id,
                    attempt=plan.attempt,
                    reason=finding.reason,
                    detail=plan.reason,
                )
                continue
            if isinstance(plan, Move):
                work = (task.model or None, plan.domain)
                queued.setdefault(plan.decision.worker_id, Counter())[work] += 1
            self._acted[key] = now
            plans.append((finding, task, plan))
        if not plans:
            return
        queues = sorted({t.queue for _, t, _ in plans if t.queue is not None})
        indexes = dict(
            zip(
                queues,
                await asyncio.gather(*(queue_index(self.js, q) for q in queues)),
                strict=True,
            )
        )
        limit = asyncio.Semaphore(PARALLEL_ACTIONS)

        async def limited(work: Awaitable[None]) -> None:
            async with limit:
                await work

        await asyncio.gather(*(limited(self._carry_out(f, t, p, indexes)) for f, t, p in plans))

    async def _carry_out(
        self,
        finding: TaskFinding,
        task: TaskTrack,
        plan: Move | Fail,
        indexes: dict[str, QueueIndex],
    ) -> None:
        bound = log.bind(
            task_id=task.task_id,
            attempt=task.attempt,
            reason=finding.reason,
            worker=finding.worker,
            detail=finding.detail,
        )
        try:
            if await self._settled(task):
                bound.info("task settled meanwhile; nothing to do")
                return
            index = indexes.get(task.queue or "", {})
            in_queue = any(a == task.attempt for _, a in index.get(task.task_id, []))
            if finding.if_missing and in_queue:
                bound.info("its message is in the queue after all; it waits its turn")
                return
            copies = copies_up_to(index, task.task_id, task.attempt)
            if isinstance(plan, Move):
                try:
                    queued = await self.actions.move(plan, copies, lambda: self._ended(task))
                except SubmissionLost as exc:
                    plan = Fail(
                        task.task_id, max(task.attempt, 1), finding.worker, exc.code, exc.message
                    )
                else:
                    if not queued:
                        bound.info(
                            "task ended as it was being moved (or was routed elsewhere); "
                            "the new attempt not queued"
                        )
                        return
                    self.moved += 1
                    bound.warning(
                        "task moved",
                        new_attempt=plan.attempt,
                        to_worker=plan.decision.worker_id,
                        queue=plan.decision.queue,
                        removed_copies=len(copies),
                    )
                    return
            await self.actions.fail(plan, copies)
            self.failed += 1
            bound.error(
                "task failed by the reaper",
                failed_attempt=plan.attempt,
                code=plan.code,
                error=plan.reason,
                removed_copies=len(copies),
            )
        except Exception as exc:
            # Tried again once `ACT_RETRY_S` has passed, if the task still needs it then.
            bound.warning("action failed", error=repr(exc))

    async def _outcome(self, task: TaskTrack, *, leader: bool) -> TaskCompleted | TaskFailed | None:
        """An outcome of the task stored since the view last heard (events in transit), that
        the attempt's worker may record; read from the stream's leader with ``leader``."""
        after = task.attempt + 1 if task.status == "retry" else task.attempt

        def accepted(sourced: Sourced) -> bool:
            event, source, _ = sourced
            assert isinstance(event, TaskCompleted | TaskFailed)
            return refusal(event, source, routing(task), self.view.supports) is None

        return await stored_outcome(self.js, task.task_id, max(after, 1), accepted, leader=leader)

    async def _ended(self, task: TaskTrack) -> bool:
        """Did the task end (a completion, or a failure not to be moved on) before the move
        just routed? Asked of the stream's leader, which holds every write before the move."""
        found = await self._outcome(task, leader=True)
        return isinstance(found, TaskCompleted) or (found is not None and not found.retryable)

    async def _settled(self, task: TaskTrack) -> bool:
        """Has the task ended, or moved on, since the view last heard (events in transit, or
        stored by replication while this reaper was cut off from the node that stored them)?
        The stream's leader is asked: a copy that lags may not hold an end it has."""
        if await self._outcome(task, leader=True) is not None:
            return True
        current = await current_attempt(self.js, task.task_id)
        return current is not None and current > task.attempt
