"""``coordinator.route``: submit a prompt."""

from __future__ import annotations

import base64
import binascii
from typing import Any, Final, Literal, Protocol

import msgspec

from schemas.base import Wire
from schemas.measures import Durations, Tokens

# Defined with `Work` (which a route request is); re-exported here, where every reader has
# always imported them from.
from schemas.work import ChatMessage as ChatMessage  # noqa: PLC0414
from schemas.work import ChatRole as ChatRole  # noqa: PLC0414
from schemas.work import OutputFormat as OutputFormat  # noqa: PLC0414
from schemas.work import TaskType as TaskType  # noqa: PLC0414
from schemas.work import ToolCall as ToolCall  # noqa: PLC0414
from schemas.work import Work, work_only

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


def image_problem(images: list[str] | None, where: str = "") -> str | None:
    """Why ``images`` are not images as Ollama takes them (base64 without a ``data:``
    prefix), naming the first bad one (``where`` prefixes its path); None when they are."""
    for index, image in enumerate(images or ()):
        try:
            base64.b64decode(image, validate=True)
        except (binascii.Error, ValueError):
            return (
                f"invalid image: {where}images[{index}] is not base64 data (send the image's "
                "bytes base64-encoded, without a data: prefix)"
            )
    return None


# -- what one request may hold ------------------------------------------------------------------
# Caps far above what a real client sends, so that one request cannot make the router, the
# workers and the statistics walk, send and store a hundred thousand of anything. The NATS
# message limit bounds a request's bytes; these bound its counts, which bytes do not (100,000
# empty options fit in a megabyte).

MAX_OPTIONS: Final = 256
"""Keys in ``options``: Ollama's options are a few dozen known names."""
MAX_MESSAGES: Final = 1024
"""Turns in ``messages``."""
MAX_TOOLS: Final = 128
"""Tool definitions in ``tools`` (OpenAI's own limit)."""
MAX_TOOL_CALLS: Final = 128
"""Tool calls in one message."""
MAX_IMAGES: Final = 64
"""Images in the whole request: ``images`` and every message's together."""
MAX_STOP: Final = 16
"""Stop sequences in ``options.stop``."""
MAX_INPUTS: Final = 2048
"""Texts in an embedding request's ``input`` (OpenAI's own limit)."""
MAX_TIMEOUT_S: Final = 86_400.0
"""A task's ``timeout_s``: a day. Past that a timer overflows (a socket's timeout is a C
``timeval``) and the reaper would never call the task stuck."""
MAX_QUERY_ITEMS: Final = 256
"""Entries in a list of a request to the stats service (a baselines query's models): each
is a database query of its own."""
MAX_NESTING: Final = 64
"""Levels of JSON objects and arrays within each other in a request body (the request
itself is the first): room for any JSON schema a ``format`` or a tool takes, and far below
the depth at which a recursive encoder (the worker's, PostgreSQL's) gives up."""


def count_problem(field: str, count: int, cap: int, unit: str = "entries") -> str | None:
    """Why ``count`` ``unit`` in ``field`` are too many (naming the field and the cap), or None."""
    if count <= cap:
        return None
    return f"{field} has {count} {unit}, over the limit of {cap}"


def _children(value: Any) -> Any:
    if isinstance(value, dict):
        return value.values()
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.astuple(value)
    return value


def nested_deeper_than(value: Any, levels: int) -> bool:
    """Do objects and arrays (dicts, lists, Structs) nest more than ``levels`` deep in
    ``value``? Walked level by level, without recursion, stopping at the first level over."""
    containers = (dict, list, tuple, msgspec.Struct)
    level = [value] if isinstance(value, containers) else []
    depth = 0
    while level:
        depth += 1
        if depth > levels:
            return True
        level = [
            child for item in level for child in _children(item) if isinstance(child, containers)
        ]
    return False


def too_deep(what: str) -> str:
    """The refusal of a ``what`` nested deeper than `MAX_NESTING`."""
    return f"{what} nests objects and arrays more than {MAX_NESTING} levels deep"


def nesting_problem(value: Any, what: str) -> str | None:
    """Why ``value`` (a decoded ``what``) nests too deep (`too_deep`), or None."""
    return too_deep(what) if nested_deeper_than(value, MAX_NESTING) else None


def _stop_problem(options: dict[str, Any]) -> str | None:
    stop = options.get("stop")
    if stop is None or isinstance(stop, str):
        return None
    if not isinstance(stop, list) or not all(isinstance(text, str) for text in stop):
        return "options.stop must be a string or a list of strings"
    return count_problem("options.stop", len(stop), MAX_STOP, "stop sequences")


def request_problem(request: RouteRequest) -> str | None:
    """Why ``request`` holds more than a request may (the caps above, each refusal naming
    the field and its cap), or None when it is within them. Nesting is the decoder's check
    (`nesting_problem`): it is a property of the body, whatever the field."""
    messages = request.messages or ()
    images = len(request.images or ()) + sum(len(m.images or ()) for m in messages)
    problems = (
        count_problem("options", len(request.options or ()), MAX_OPTIONS, "keys"),
        _stop_problem(request.options or {}),
        count_problem("messages", len(messages), MAX_MESSAGES, "messages"),
        count_problem("tools", len(request.tools or ()), MAX_TOOLS, "tools"),
        count_problem("images (over the request and its messages)", images, MAX_IMAGES, "images"),
        count_problem("input", len(request.input or ()), MAX_INPUTS, "texts"),
        *(
            count_problem(f"messages[{i}].tool_calls", len(m.tool_calls), MAX_TOOL_CALLS, "calls")
            for i, m in enumerate(messages)
            if m.tool_calls
        ),
    )
    return next((problem for problem in problems if problem is not None), None)


class RouteRequest(Work, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a client asks for: the `Work` for the backend, and how to route and answer it.
    Unknown fields are refused: a typo must not pass silently.

    A `Work` by inheritance rather than holding one, so the request keeps its flat JSON
    shape (``{"prompt", "model", "stream", ...}``, what clients and the ``nats`` CLI send)
    while every work field is still declared once, in `Work`; the router nests the work
    part (`work`) in the ``submitted`` event and the task message."""

    model: str
    worker: str | None = None
    wait: bool = False
    timeout_s: float | None = msgspec.field(default=None)
    task_id: str | None = None
    """The task's id, chosen by the client (None: the router makes one). A request naming a
    task that was submitted already submits nothing: it is answered as that task (its end,
    for a client that waits, at once if it has ended; else ``queued``). So a client whose
    router died, or whose connection dropped, while it waited asks again with the same id
    and gets the task's outcome. At most 64 letters, digits, ``-`` and ``_``."""
    client: str | None = None
    """The name of the gateway key the request came in with (``coordinator keys``). The
    gateway sets it, overwriting anything an HTTP client sent; None through an open gateway or
    straight over NATS (where the sender's NATS user is what is trusted)."""

    @property
    def work(self) -> Work:
        """What the client asked the backend for, without the routing fields."""
        return work_only(self)


class ErrorDetail(Wire, frozen=True, kw_only=True):
    """An error as data: the code programs branch on, the message people read."""

    code: str
    message: str

    @property
    def summary(self) -> str:
        """``code: message`` (the code alone without a message), for people: what a
        reply's ``error`` text says."""
        return f"{self.code}: {self.message}" if self.message else self.code


DoneReason = Literal["stop", "length", "tool_calls"]


class RouteReply(Wire, frozen=True, kw_only=True):
    """The router's answer; with ``wait`` it comes when the task has ended."""

    task_id: str
    status: TaskStatus
    queue: str
    worker: str
    response: str | None = None
    thinking: str | None = None
    error: str | None = None
    """A failed task's ``failure`` as one line, ``code: message``, for people and for readers
    that predate ``failure``. Never parsed: read ``failure``."""
    failure: ErrorDetail | None = None
    """Why the task failed (``status`` ``failed``): the code of the ``failed`` event and its
    reason. Absent in a reply from a router that predates it (see `failure_of`)."""
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
    tool_calls: list[ToolCall] | None = None
    """The calls to tools the model answered with (``response`` may be empty then)."""
    done_reason: DoneReason | None = None
    """Why the generation ended: ``stop`` (its end or a stop sequence), ``length`` (the token
    limit), ``tool_calls``; None when the backend did not say."""
    embeddings: list[bytes] | None = None
    """An embedding task's vectors, one per input, each little-endian float32 (base64 in JSON:
    the bytes OpenAI's ``encoding_format: "base64"`` gives); see `schemas.vectors`."""


class Failed(Protocol):
    """A reply or view that may say why its task failed (`RouteReply`, ``TaskView``)."""

    @property
    def failure(self) -> ErrorDetail | None: ...

    @property
    def error(self) -> str | None: ...


# The code of a failure whose code is not known: one told by a reply that predates ``failure``.
UNKNOWN_FAILURE: Final = "failed"


def failure_of(reply: Failed) -> ErrorDetail:
    """Why the task of ``reply`` failed: its ``failure``; from a sender that predates that
    field, code `UNKNOWN_FAILURE` with the ``error`` text as the message (not parsed: the
    text is for people)."""
    if reply.failure is not None:
        return reply.failure
    return ErrorDetail(code=UNKNOWN_FAILURE, message=reply.error or "no reason given")


class ErrorBody(Wire, frozen=True, kw_only=True):
    """The body of every error reply: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorDetail


# Header that marks a message on a streaming reply subject as a chunk, with its sequence
# number; the message without it is the final reply (a `RouteReply` or an error). The first
# chunk, seq 0 with no text, comes from the router just before the task is queued: it tells
# the client the task id, so the client can cancel the task before any output arrives.
CHUNK_HEADER: Final = "Coordinator-Chunk"


class ModelProgress(Wire, frozen=True, kw_only=True):
    """How a change to a machine's models is getting on, as Ollama streams it (``/api/pull``,
    ``/api/create``): a status, and for a layer being downloaded its digest and bytes."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


class StreamChunk(Wire, frozen=True, kw_only=True):
    """A piece of output, sent as the backend produces it (``stream: true``)."""

    task_id: str
    seq: int
    """The piece's number within its attempt, from 1 (0: the router's first chunk)."""
    response: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] | None = None
    attempt: int | None = None
    """The attempt whose output this is: a task the reaper moves starts its answer again in
    its new attempt. None in the router's first chunk, and from a worker that predates it."""
    progress: ModelProgress | None = None
    """A ``model_change`` task's progress (its chunks carry no text)."""


class CancelRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.cancel``: stop a queued or running task (its client went away, say).

    Name the task, or (a client waiting on a reply that never learned the task's id) the reply
    subject of its still-unanswered route request."""

    task_id: str | None = None
    reply_to: str | None = None
    reason: str = ""
    client: str | None = None
    """The gateway key the cancel came in with: heeded from a gateway only."""


class CancelNotice(Wire, frozen=True, kw_only=True):
    """What workers hear on ``coordinator.cancel.<task_id>``: stop this task.

    From the router, for a client's cancel: every attempt (``up_to_attempt`` None). From the
    reaper, when it moves a task on: the attempts it replaced (``up_to_attempt`` N), so a
    worker still running one stops, and the new attempt, which may land on the same worker,
    runs."""

    task_id: str
    reason: str = ""
    up_to_attempt: int | None = None

    def stops(self, attempt: int) -> bool:
        """Does this notice stop ``attempt`` of its task?"""
        return self.up_to_attempt is None or attempt <= self.up_to_attempt


class CancelReply(Wire, frozen=True, kw_only=True):
    """The cancel notice went out; the task ends ``failed`` with code ``cancelled`` when a live
    worker holds it or takes it, and is not run."""

    task_id: str
    status: Literal["cancelling"]


class HoldsQuery(Wire, frozen=True, kw_only=True):
    """Between routers, on ``coordinator.router.holds``: which of you holds this waiting route
    request (its reply subject) or this task (being submitted, or waited on)? Only a router
    that does answers, with a `HoldsReply`."""

    task_id: str | None = None
    reply_to: str | None = None


class HoldsReply(Wire, frozen=True, kw_only=True):
    """The task the asked-about request or task is, from the router that holds it."""

    task_id: str
