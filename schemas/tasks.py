"""Messages in the ``TASKS`` stream: one per attempt at a task."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Protocol

from schemas.base import Wire
from schemas.models import needed_capabilities
from schemas.route import ChatMessage, OutputFormat, TaskType

# Task kinds that one host serves (lesson 8): they are never re-dispatched to another worker,
# not by the reaper, not by a worker taking over a dead one's message. Their failures surface.
NON_RETRYABLE_TASK_TYPES: Final[frozenset[TaskType]] = frozenset({"web_search"})


# What the client asked the backend for: carried unchanged from the route request to the
# ``submitted`` event and to every attempt's task message (router and reaper copy these).
WORK_FIELDS: Final = (
    "prompt",
    "task_type",
    "domain",
    "options",
    "messages",
    "think",
    "images",
    "tools",
    "format",
    "keep_alive",
    "suffix",
    "input",
    "truncate",
    "dimensions",
    "normalize",
)


def work_of(source: object) -> dict[str, Any]:
    """The `WORK_FIELDS` of a route request or ``submitted`` event, to build a task from."""
    return {name: getattr(source, name) for name in WORK_FIELDS}


class _Work(Protocol):
    @property
    def task_type(self) -> TaskType: ...
    @property
    def tools(self) -> list[dict[str, Any]] | None: ...
    @property
    def images(self) -> list[str] | None: ...
    @property
    def messages(self) -> Sequence[ChatMessage] | None: ...
    @property
    def think(self) -> bool | str | None: ...
    @property
    def suffix(self) -> str | None: ...


def needs_of(work: _Work) -> tuple[str, ...]:
    """The model capabilities a request (or its ``submitted`` event) needs: the router and the
    reaper route it only to a worker whose copy of the model has them all."""
    return needed_capabilities(
        task_type=work.task_type,
        tools=bool(work.tools),
        images=bool(work.images) or any(m.images for m in work.messages or ()),
        think=work.think,
        suffix=bool(work.suffix),
    )


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
    """No longer set: a streaming task (``stream``) has its chunks published on
    `schemas.subjects.chunk_subject` and the router passes them on. Kept for old messages."""
    submitted_at: float
    messages: list[ChatMessage] | None = None
    """A conversation for the backend's chat API; ``prompt`` holds it as text."""
    think: bool | str | None = None
    images: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    format: OutputFormat | None = None
    keep_alive: float | str | None = None
    suffix: str | None = None
    input: list[str] | None = None
    truncate: bool | None = None
    dimensions: int | None = None
    normalize: bool = True
    routed_seq: int | None = None
    """Where this attempt's ``routed`` event is in ``EVENTS``: the worker stores ``started``
    only while that is still the task's last ``routed`` (attempt fencing in one round trip).
    None from a router or reaper that predates it: the worker looks the attempt up."""

    @property
    def retryable(self) -> bool:
        """False for kinds that are never re-dispatched (`NON_RETRYABLE_TASK_TYPES`)."""
        return is_retryable(self.task_type)
