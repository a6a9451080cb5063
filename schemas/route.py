"""``coordinator.route``: submit a prompt."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from schemas.base import Wire

TaskType = Literal["inference", "web_search"]
TaskStatus = Literal["queued", "running", "done", "failed"]


class RouteRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client asks for. Unknown fields are refused: a typo must not pass silently."""

    prompt: str
    model: str
    worker: str | None = None
    task_type: TaskType = "inference"
    domain: str | None = None
    options: dict[str, Any] | None = None
    wait: bool = False
    timeout_s: float | None = msgspec.field(default=None)
    stream: bool = False


class RouteReply(Wire, frozen=True, kw_only=True):
    """The router's answer; with ``wait`` it comes when the task has ended."""

    task_id: str
    status: TaskStatus
    queue: str
    worker: str
    response: str | None = None
    thinking: str | None = None
    error: str | None = None


class ErrorDetail(Wire, frozen=True, kw_only=True):
    code: str
    message: str


class ErrorBody(Wire, frozen=True, kw_only=True):
    """The body of every error reply: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorDetail
