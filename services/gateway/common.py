"""What every API module of the gateway shares: its error, the request it hands the service
(`Ask`, or an `Instant` answered without a task), the `Shape` that writes answers, body
decoding, Ollama's ``keep_alive``, timestamps, and the HTTP status of every error code.

Pure: no I/O. The API modules (`services.gateway.ollama_api`, `openai_api`, `task_api`) and the
fleet listings (`services.gateway.fleet`) build on it; `services.gateway.service` (with `relay`
and `responses`) does the HTTP and the NATS.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sized
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, Protocol, TypeVar

import msgspec

from schemas.route import (
    RouteReply,
    RouteRequest,
    StreamChunk,
    count_problem,
    nesting_problem,
    request_problem,
)
from schemas.subjects import InvalidId
from services.errors import (
    BackendError,
    BadRequest,
    CoordinatorError,
    NoWorker,
    Unsupported,
    error_class,
)
from services.runtime.endpoints import decode_body

# The Ollama API version whose shapes the gateway speaks (thinking, /api/ps fields, /v1).
OLLAMA_API_VERSION: Final = "0.12.0"

# How long Ollama keeps a model loaded after use; `/api/ps` reports expiry this far ahead.
KEEP_ALIVE_S: Final = 300.0

NS_PER_MS: Final = 1_000_000
NS_PER_S: Final = 1_000_000_000
encoder: Final = msgspec.json.Encoder()


class ApiError(CoordinatorError):
    """A request the gateway answers with an HTTP error, in the API's own error shape: a
    `CoordinatorError` carrying the code it was given (a catalogued one, or the router's or a
    task's) and the HTTP ``status`` that code has here (`refusal_status`, `failure_status`)."""

    def __init__(self, status: int, code: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.close = close
        """Close the connection after the answer: the request's body was not read whole."""


@dataclass(frozen=True, slots=True)
class Ask:
    """One request that becomes a task, whichever API it came through, and how its answer is
    to be written."""

    route: RouteRequest
    """Always ``wait``; ``stream`` as the HTTP client asked."""
    include_usage: bool = False
    """OpenAI's ``stream_options.include_usage``."""
    base64_vectors: bool = False
    """OpenAI's ``encoding_format: "base64"``: each vector as the base64 of its float32 bytes."""
    echo: dict[str, Any] | None = None
    """The request's own fields its answer repeats (OpenAI's Responses API: instructions,
    tools, the text format…), as the client sent them."""

    @property
    def stream(self) -> bool:
        """What the HTTP client asked for: pieces as they come, or the whole answer."""
        return self.route.stream


class Instant(Protocol):
    """A request answered at once, without a task, when a live worker serves its model (a
    preload, an embedding request with nothing to embed)."""

    @property
    def model(self) -> str:
        """The model as the client named it."""
        ...

    @property
    def kind(self) -> str:
        """What it is, for the log line (``load``, ``unload``, ``empty embed``)."""
        ...

    def answer(self, at: float | None = None) -> bytes:
        """The whole answer, in the API's shape."""
        ...


class Shape(Protocol):
    """How one API writes what the fleet answers."""

    @property
    def stream_type(self) -> str:
        """The streamed response's content type."""
        ...

    @property
    def start_on_accept(self) -> bool:
        """Start the streamed response as soon as the task is accepted (else: at the first
        output, so a task that fails before any output still gets a proper HTTP status)."""
        ...

    def piece(self, chunk: StreamChunk) -> bytes | None:
        """One streamed piece, or None to send nothing for it."""
        ...

    def end(self, reply: RouteReply) -> bytes:
        """What closes a stream for a done (or, task API only, failed) task."""
        ...

    def whole(self, reply: RouteReply) -> bytes:
        """The whole answer, not streamed (may raise `ApiError` for a reply it cannot write)."""
        ...

    def error(self, status: int, code: str, message: str) -> bytes:
        """An error body."""
        ...

    def stream_error(self, code: str, message: str) -> bytes:
        """An error after the stream has started (its status is already 200)."""
        ...


# -- request bodies -----------------------------------------------------------------------------

T = TypeVar("T")


def decode(body: bytes, kind: type[T], what: str) -> T:
    """``body`` as ``kind``; a body that is not one (malformed JSON, not an object, a field of
    the wrong type, not UTF-8, nested too deep: `decode_body`) is a 400 naming the request
    and the field."""
    try:
        return decode_body(body, kind, f"{what} request")
    except BadRequest as exc:
        raise ApiError(400, exc.code, exc.message) from None


def check_limits(request: RouteRequest) -> RouteRequest:
    """``request`` unless it holds more than a request may (`request_problem`), or nests too
    deep as it is routed (a tool call's ``arguments`` text is parsed here): a 400 naming the
    field and the cap, before anything is routed."""
    problem = request_problem(request) or nesting_problem(request, "the request as routed")
    if problem is not None:
        raise ApiError(400, BadRequest.code, problem)
    return request


def check_count(field: str, items: Sized, cap: int, unit: str = "entries") -> None:
    """A 400 naming ``field`` and ``cap`` when ``items`` are more than ``cap`` (`count_problem`):
    for a body's list checked before it is worked through, not only once routed."""
    problem = count_problem(field, len(items), cap, unit)
    if problem is not None:
        raise ApiError(400, BadRequest.code, problem)


def shown(value: Any, limit: int = 80) -> str:
    """``value`` as a message quotes it: its ``repr``, cut to ``limit`` characters (a client's
    value may be megabytes, or nested too deep to print)."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<a {type(value).__name__} nested too deep to show>"
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def refuse(field: str, present: object, why: str = "") -> None:
    """Features the fleet cannot honour are refused by name, never silently dropped."""
    if present:
        reason = f": {why}" if why else ""
        raise ApiError(
            400, Unsupported.code, f"'{field}' is not supported by the Coordinator gateway{reason}"
        )


def require_model(model: str) -> None:
    if not model.strip():
        raise ApiError(400, BadRequest.code, "model is required")


# Go's time.ParseDuration units, which Ollama's ``keep_alive`` strings use ("5m", "0s", "1h30m").
_GO_UNITS: Final = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "μs": 1_000,
    "ms": NS_PER_MS,
    "s": NS_PER_S,
    "m": 60 * NS_PER_S,
    "h": 3600 * NS_PER_S,
}
_GO_PART: Final = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_GO_DURATION: Final = re.compile(f"(?:{_GO_PART})+")
# What Ollama makes of a negative keep_alive: keep the model loaded for ever.
FOREVER_NS: Final = 2**63 - 1


def _seconds(value: Any) -> float | None:
    """A number of seconds as a float; None for NaN, an integer past a float's range (a
    route request could not carry it) and anything that is not a number."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return None if math.isnan(seconds) else seconds


def keep_alive_ns(value: Any) -> int | None:
    """Ollama's ``keep_alive`` in nanoseconds, as Ollama reads it: a number is seconds, a
    string a Go duration ("0", "0s", "5m"); negative is for ever; None when not given."""
    if value is None:
        return None
    seconds = _seconds(value)
    if seconds is not None:
        if seconds < 0 or seconds * NS_PER_S >= FOREVER_NS:  # inf, and 1e308 (inf in ns)
            return FOREVER_NS
        return int(seconds * NS_PER_S)
    if isinstance(value, str):
        negative = value.startswith("-")
        text = value[1:] if value[:1] in ("+", "-") else value
        if text == "0":
            return 0
        if _GO_DURATION.fullmatch(text):
            parts = re.findall(_GO_PART, text)
            total = int(sum(Decimal(number) * _GO_UNITS[unit] for number, unit in parts))
            return FOREVER_NS if negative and total else min(total, FOREVER_NS)
    raise ApiError(
        400, BadRequest.code, f"invalid keep_alive {shown(value)}: seconds, or a duration like '5m'"
    )


def keep_alive(value: Any) -> float | str | None:
    """``keep_alive`` checked (`keep_alive_ns`) and passed on as the client gave it."""
    keep_alive_ns(value)
    return value if isinstance(value, (int, float, str)) else None


class _Named(msgspec.Struct):
    """The model a body names, for the log line of a body refused before it was read whole."""

    model: str | None = None
    name: str | None = None


_named_decoder = msgspec.json.Decoder(_Named)


def model_named(body: bytes) -> str:
    """The ``model`` (or ``name``) a body names, or "" when it names none or is not JSON."""
    try:
        named = _named_decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return ""
    return named.model or named.name or ""


def too_large(limit: int, length: int | None = None) -> str:
    """Why a body over the gateway's limit is refused, naming the limit and its variable."""
    size = f"of {length} bytes " if length is not None else ""
    return (
        f"the request body {size}is over the gateway's limit of {limit} bytes"
        f" ({limit / 2**20:g} MiB, GATEWAY_MAX_BODY_BYTES)"
    )


# -- answers ------------------------------------------------------------------------------------


def iso_now(at: float | None = None) -> str:
    """RFC 3339 UTC with microseconds and a ``Z``, as Ollama stamps ``created_at``."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def ns(ms: float | None) -> int | None:
    """Milliseconds (how the fleet measures) as Ollama's nanoseconds."""
    return None if ms is None else round(ms * NS_PER_MS)


def line(payload: dict[str, Any]) -> bytes:
    """One NDJSON line."""
    return encoder.encode(payload) + b"\n"


def event(payload: dict[str, Any] | str) -> bytes:
    """One Server-Sent Event's ``data:``."""
    data = payload.encode() if isinstance(payload, str) else encoder.encode(payload)
    return b"data: " + data + b"\n\n"


def vectors(reply: RouteReply) -> list[bytes]:
    """An embedding reply's vectors; a done reply without them is the worker's failure."""
    if reply.embeddings is None:
        raise ApiError(
            502,
            BackendError.code,
            f"task {reply.task_id} on worker {reply.worker} returned no embeddings",
        )
    return reply.embeddings


# -- error statuses -----------------------------------------------------------------------------


def refusal_status(code: str, *, fleet_has_workers: bool) -> int:
    """The HTTP status of a request the router (or the bus) refused: its error class's
    (`services.errors`), or `InvalidId`'s.

    ``no_worker`` is an unknown model (404, Ollama's status for one) while some worker is
    live, and a fleet without capacity (503) when none is. A model no live worker's copy of
    can do what the request needs (``unsupported_capability``) is Ollama's 400.
    """
    if code == NoWorker.code and not fleet_has_workers:
        return 503
    if code == InvalidId.code:
        return InvalidId.http_status
    return error_class(code).http_status


def failure_status(code: str) -> int:
    """The HTTP status of a task that ran and failed, its error class's: the upstream failed
    (502), or timed out (504), or a sleeping worker did not wake (503)."""
    return error_class(code).failed_http_status
