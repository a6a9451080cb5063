"""Messages in the ``TASKS`` stream: one per attempt at a task."""

from __future__ import annotations

from typing import Any, Final

from schemas.base import Wire
from schemas.route import ChatMessage, TaskType

# Task kinds that one host serves (lesson 8): they are never re-dispatched to another worker,
# not by the reaper, not by a worker taking over a dead one's message. Their failures surface.
NON_RETRYABLE_TASK_TYPES: Final[frozenset[TaskType]] = frozenset({"web_search"})


def is_retryable(task_type: TaskType) -> bool:
    """May a task of this kind be run again (re-routed, re-run) after an attempt was lost?"""
    return task_type not in NON_RETRYABLE_TASK_TYPES


class TaskMessage(Wire, frozen=True, kw_only=True):
    """The work a worker pulls from its queue."""

    task_id: str
    attempt: int
    model: str
    prompt: str
    task_type: TaskType = "inference"
    domain: str | None = None
    options: dict[str, Any] | None = None
    timeout_s: float
    stream: bool = False
    stream_subject: str | None = None
    """Where the worker publishes `StreamChunk`s as they arrive (core NATS, not stored)."""
    submitted_at: float
    messages: list[ChatMessage] | None = None
    """A conversation for the backend's chat API; ``prompt`` holds it as text."""
    think: bool | str | None = None
    routed_seq: int | None = None
    """Where this attempt's ``routed`` event is in ``EVENTS``: the worker stores ``started``
    only while that is still the task's last ``routed`` (attempt fencing in one round trip).
    None from a router or reaper that predates it: the worker looks the attempt up."""

    @property
    def retryable(self) -> bool:
        """False for kinds that are never re-dispatched (`NON_RETRYABLE_TASK_TYPES`)."""
        return is_retryable(self.task_type)
