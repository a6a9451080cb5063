"""Messages in the ``TASKS`` stream: one per attempt at a task."""

from __future__ import annotations

from typing import Any

from schemas.base import Wire
from schemas.route import TaskType


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
    submitted_at: float
