"""``coordinator.route``: submit a prompt."""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from schemas.base import Wire
from schemas.measures import Durations, Tokens

TaskType = Literal["inference", "web_search"]
TaskStatus = Literal["queued", "running", "done", "failed"]

# A model name meaning "the model the serving worker is configured with". Only web-search
# workers honour it (their OLLAMA_MODEL); `model` is required on the wire, so a web-search
# request that does not care which model summarises says this instead.
DEFAULT_MODEL: Final = "default"


class Source(Wire, frozen=True, kw_only=True):
    """One search result a web-search answer rests on; answers cite it by its position (1-based)."""

    title: str
    url: str
    snippet: str = ""


ChatRole = Literal["system", "user", "assistant", "tool"]


class ChatMessage(Wire, frozen=True, kw_only=True):
    """One turn of a conversation, as Ollama's ``/api/chat`` and OpenAI's chat API take it."""

    role: ChatRole
    content: str


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
    messages: list[ChatMessage] | None = None
    """A conversation: workers send it to their backend's chat API. ``prompt`` then holds the
    same conversation as text (`services.gateway.convert.chat_prompt`), which is what statistics,
    the judge and a worker that predates this field use."""
    think: bool | str | None = None
    """Ollama's ``think`` (true, false, or "high" / "medium" / "low"); None: the model's default."""


class RouteReply(Wire, frozen=True, kw_only=True):
    """The router's answer; with ``wait`` it comes when the task has ended."""

    task_id: str
    status: TaskStatus
    queue: str
    worker: str
    response: str | None = None
    thinking: str | None = None
    error: str | None = None
    model: str | None = None
    """The model that did (or, for a web search whose summary failed, was asked to do) the work."""
    host: str | None = None
    """The host that did the work, when the worker reports it (web-search workers do)."""
    sources: list[Source] | None = None
    """Web search: the results the answer rests on, in the order the answer cites them."""
    note: str | None = None
    """Present when the task is done but not as asked. Web search: the summary failed (the note
    says why) and ``response`` is the plain list of results instead of an answer."""
    durations: Durations | None = None
    """What the backend measured, when the task is done (as in the ``completed`` event)."""
    tokens: Tokens | None = None


class ErrorDetail(Wire, frozen=True, kw_only=True):
    code: str
    message: str


class ErrorBody(Wire, frozen=True, kw_only=True):
    """The body of every error reply: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorDetail


# Header that marks a message on a streaming reply subject as a chunk, with its sequence
# number; the message without it is the final reply (a `RouteReply` or an error). The first
# chunk, seq 0 with no text, comes from the router just before the task is queued: it tells
# the client the task id, so the client can cancel the task before any output arrives.
CHUNK_HEADER: Final = "Coordinator-Chunk"


class StreamChunk(Wire, frozen=True, kw_only=True):
    """A piece of output, sent as the backend produces it (``stream: true``)."""

    task_id: str
    seq: int
    response: str = ""
    thinking: str = ""


class CancelRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.cancel``: stop a queued or running task (its client went away, say).

    Name the task, or (a client waiting on a reply that never learned the task's id) the reply
    subject of its still-unanswered route request."""

    task_id: str | None = None
    reply_to: str | None = None
    reason: str = ""


class CancelReply(Wire, frozen=True, kw_only=True):
    """The cancel notice went out; the task ends ``failed`` with code ``cancelled`` when a live
    worker holds it or takes it, and is not run."""

    task_id: str
    status: Literal["cancelling"]
