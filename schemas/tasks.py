"""Messages in the ``TASKS`` stream: one per attempt at a task."""

from __future__ import annotations

from typing import Final

from schemas.base import Wire
from schemas.work import BothShapes, TaskType, Work

# Task kinds that one host serves (lesson 8), or that are for one machine (a change to its
# models): they are never re-dispatched to another worker, not by the reaper, not by a worker
# taking over a dead one's message. Their failures surface.
NON_RETRYABLE_TASK_TYPES: Final[frozenset[TaskType]] = frozenset({"web_search", "model_change"})


def is_retryable(task_type: TaskType) -> bool:
    """May a task of this kind be run again (re-routed, re-run) after an attempt was lost?"""
    return task_type not in NON_RETRYABLE_TASK_TYPES


class TaskMessage(Wire, frozen=True, kw_only=True):
    """The work a worker pulls from its queue: one attempt at a task. Read with
    `task_decoder`, which also reads the shape before `Work` (its fields at the top)."""

    task_id: str
    attempt: int
    model: str
    work: Work
    """What the client asked for: the router's from the route request, the reaper's (a
    moved attempt) from the ``submitted`` event."""
    timeout_s: float
    stream_subject: str | None = None
    """No longer set: a streaming task (``work.stream``) has its chunks published on
    `schemas.subjects.chunk_subject` and the router passes them on. Kept for old messages."""
    submitted_at: float
    routed_seq: int | None = None
    """Where this attempt's ``routed`` event is in ``EVENTS``: the worker stores ``started``
    only while that is still the task's last ``routed`` (attempt fencing in one round trip).
    None from a router or reaper that predates it: the worker looks the attempt up."""

    @property
    def retryable(self) -> bool:
        """False for kinds that are never re-dispatched (`NON_RETRYABLE_TASK_TYPES`)."""
        return is_retryable(self.work.task_type)


task_decoder: Final[BothShapes[TaskMessage]] = BothShapes(TaskMessage)
"""Every reader of task messages decodes with this: queued messages of the shape before
`Work` are read too."""
