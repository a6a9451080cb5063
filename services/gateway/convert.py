"""The gateway's pure half: API bodies to route requests, route replies to API bodies, error
codes to HTTP statuses. No I/O; `services.gateway.service` does the HTTP and the NATS.

Three APIs come in:

- Ollama's (``/api/generate``, ``/api/chat``): NDJSON streamed unless ``"stream": false``;
  thinking in ``thinking`` (generate) or ``message.thinking`` (chat); errors ``{"error": msg}``.
- OpenAI's (``/v1/chat/completions``, ``/v1/completions``): one JSON body unless
  ``"stream": true``, then Server-Sent Events ending with ``data: [DONE]``; thinking in
  ``reasoning`` (the name Ollama's own ``/v1`` uses; a legacy completion drops it, as Ollama's
  does); errors ``{"error": {"message", "type", "param", "code"}}`` with the project's code.
- The task API (``POST /route``): `RouteRequest` and `RouteReply` as they are on the bus.

Ollama's model management is answered from the fleet's worker list, never routed: ``/api/show``
and ``/api/pull`` for a model a live worker serves, and the preloads (``/api/generate`` with an
empty prompt, ``/api/chat`` with no messages) that load a model and return at once.

A conversation travels to the worker as `RouteRequest.messages` (the worker sends it to its
backend's chat API); the request's ``prompt`` is `chat_prompt` of it, the text statistics,
the judge and older workers see.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, Final, Protocol, TypeVar

import msgspec

from schemas.queries import WorkerView
from schemas.route import ChatMessage, ErrorBody, ErrorDetail, RouteReply, RouteRequest, StreamChunk

# The Ollama API version whose shapes the gateway speaks (thinking, /api/ps fields, /v1).
OLLAMA_API_VERSION: Final = "0.12.0"

# How long Ollama keeps a model loaded after use; `/api/ps` reports expiry this far ahead.
KEEP_ALIVE_S: Final = 300.0

_NS_PER_MS = 1_000_000
_NS_PER_S = 1_000_000_000
_encoder = msgspec.json.Encoder()


class ApiError(Exception):
    """A request the gateway answers with an HTTP error, in the API's own error shape."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Ask:
    """One generation request, whichever API it came through."""

    @property
    def stream(self) -> bool:
        """What the HTTP client asked for: pieces as they come, or the whole answer."""
        return self.route.stream

    route: RouteRequest
    """Always ``wait``; ``stream`` as the HTTP client asked (``stream`` below)."""
    include_usage: bool = False
    """OpenAI's ``stream_options.include_usage``."""


@dataclass(frozen=True, slots=True)
class Preload:
    """An Ollama request that only loads a model (``/api/generate`` with an empty prompt,
    ``/api/chat`` with no messages), or unloads it (the same with ``keep_alive`` 0). The
    gateway answers it at once when a live worker serves the model; no task is routed."""

    model: str
    chat: bool
    unload: bool


# -- request bodies: the fields the gateway uses; others are ignored, as Ollama ignores them ----


class _OllamaMessage(msgspec.Struct):
    role: str
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[Any] | None = None


class _OllamaGenerate(msgspec.Struct):
    model: str = ""
    prompt: str = ""
    system: str | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    think: bool | str | None = None
    images: list[str] | None = None
    format: Any = None
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    keep_alive: Any = None


class _OllamaChat(msgspec.Struct):
    model: str = ""
    # Ollama's CLI loads a model with ``"messages": null``.
    messages: list[_OllamaMessage] | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    think: bool | str | None = None
    tools: list[Any] | None = None
    format: Any = None
    keep_alive: Any = None


class _OllamaModelRequest(msgspec.Struct):
    """``/api/show`` and ``/api/pull``: the model by ``model`` or its older name ``name``
    (Ollama's CLI sends both, one of them empty)."""

    model: str | None = None
    name: str | None = None
    stream: bool | None = None


class _ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class _OpenAIMessage(msgspec.Struct):
    role: str
    content: str | list[_ContentPart] | None = None
    tool_calls: list[Any] | None = None


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _ResponseFormat(msgspec.Struct):
    type: str = "text"


class _Sampling(msgspec.Struct):
    """OpenAI's sampling fields, shared by both endpoints."""

    model: str = ""
    stream: bool = False
    stream_options: _StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None


class _OpenAIChat(_Sampling):
    messages: list[_OpenAIMessage] = msgspec.field(default_factory=list)
    tools: list[Any] | None = None
    response_format: _ResponseFormat | None = None
    reasoning_effort: str | None = None


class _OpenAICompletion(_Sampling):
    prompt: str | list[str] = ""
    suffix: str | None = None


T = TypeVar("T")


def _decode(body: bytes, kind: type[T], what: str) -> T:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, "bad_request", f"invalid {what} request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, "bad_request", f"{what} request is not valid JSON: {exc}") from None


def _refuse(field: str, present: object) -> None:
    """Features the fleet cannot honour are refused by name, never silently dropped."""
    if present:
        raise ApiError(400, "unsupported", f"'{field}' is not supported by the Coordinator gateway")


def _require_model(model: str) -> None:
    if not model.strip():
        raise ApiError(400, "bad_request", "model is required")


def _route(
    model: str,
    prompt: str,
    *,
    stream: bool,
    timeout_s: float | None,
    options: dict[str, Any] | None = None,
    messages: list[ChatMessage] | None = None,
    think: bool | str | None = None,
) -> RouteRequest:
    _require_model(model)
    if not prompt.strip():
        raise ApiError(400, "bad_request", "the prompt (or every message) is empty")
    return RouteRequest(
        prompt=prompt,
        model=model,
        options=options or None,
        wait=True,
        stream=stream,
        timeout_s=timeout_s,
        messages=messages,
        think=think,
    )


# Roles as the chat APIs name them -> the wire's; OpenAI's newer "developer" is a system prompt.
_ROLES: Final[dict[str, Any]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_ROLE_LABELS: Final = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def _message(role: str, content: str) -> ChatMessage:
    if role not in _ROLES:
        raise ApiError(400, "bad_request", f"unknown message role {role!r}")
    return ChatMessage(role=_ROLES[role], content=content)


def chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """A conversation as one text, for statistics, the judge and workers that predate
    ``messages``: a lone user message is itself; otherwise system messages first, then the
    turns in order, each as ``Role: content``, blank-line separated, ending ``Assistant:``."""
    if len(messages) == 1 and messages[0].role == "user":
        return messages[0].content
    ordered = [m for m in messages if m.role == "system"] + [
        m for m in messages if m.role != "system"
    ]
    turns = [f"{_ROLE_LABELS[m.role]}: {m.content}" for m in ordered]
    return "\n\n".join([*turns, "Assistant:"])


def _chat(messages: list[ChatMessage]) -> tuple[str, list[ChatMessage]]:
    if not any(m.content.strip() for m in messages):
        raise ApiError(400, "bad_request", "messages must hold at least one non-empty message")
    return chat_prompt(messages), messages


def ollama_generate(body: bytes, *, timeout_s: float | None) -> Ask | Preload:
    """``POST /api/generate``; a ``system`` prompt makes it a two-message conversation; an
    empty prompt (Ollama's test is exactly ``""``) is a `Preload`, unloading when
    ``keep_alive`` is zero."""
    req = _decode(body, _OllamaGenerate, "generate")
    _refuse("images", req.images)
    _refuse("format", req.format)
    _refuse("suffix", req.suffix)
    _refuse("template", req.template)
    _refuse("raw", req.raw)
    if req.prompt == "":
        _require_model(req.model)
        return Preload(model=req.model, chat=False, unload=keep_alive_ns(req.keep_alive) == 0)
    messages = None
    prompt = req.prompt
    if req.system and req.prompt.strip():
        prompt, messages = _chat([_message("system", req.system), _message("user", req.prompt)])
    route = _route(
        req.model,
        prompt,
        stream=req.stream,
        timeout_s=timeout_s,
        options=req.options,
        messages=messages,
        think=req.think,
    )
    return Ask(route=route)


def ollama_chat(body: bytes, *, timeout_s: float | None) -> Ask | Preload:
    """``POST /api/chat``; no messages at all is a `Preload`, unloading when ``keep_alive``
    is under a second (Ollama's chat test: whole seconds are zero)."""
    req = _decode(body, _OllamaChat, "chat")
    _refuse("tools", req.tools)
    _refuse("format", req.format)
    if not req.messages:
        _require_model(req.model)
        keep = keep_alive_ns(req.keep_alive)
        return Preload(model=req.model, chat=True, unload=keep is not None and keep < _NS_PER_S)
    for m in req.messages:
        _refuse("images", m.images)
        _refuse("tool_calls", m.tool_calls)
    prompt, messages = _chat([_message(m.role, m.content) for m in req.messages])
    route = _route(
        req.model,
        prompt,
        stream=req.stream,
        timeout_s=timeout_s,
        options=req.options,
        messages=messages,
        think=req.think,
    )
    return Ask(route=route)


def _sampling_options(req: _Sampling) -> dict[str, Any]:
    """OpenAI's sampling fields under Ollama's option names (what tasks carry)."""
    _refuse("n", req.n is not None and req.n != 1)
    options: dict[str, Any] = {}
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            options[name] = value
    if req.stop is not None:
        options["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is not None:
        options["num_predict"] = limit
    return options


def _text_of(message: _OpenAIMessage) -> str:
    if message.content is None:
        _refuse("tool_calls", message.tool_calls)
        return ""
    if isinstance(message.content, str):
        return message.content
    texts: list[str] = []
    for part in message.content:
        if part.type != "text" or part.text is None:
            raise ApiError(
                400, "unsupported", f"content parts of type '{part.type}' are not supported"
            )
        texts.append(part.text)
    return "".join(texts)


def openai_chat(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/chat/completions``; ``reasoning_effort`` becomes Ollama's ``think``."""
    req = _decode(body, _OpenAIChat, "chat completion")
    _refuse("tools", req.tools)
    if req.response_format is not None and req.response_format.type != "text":
        _refuse("response_format", req.response_format.type)
    prompt, messages = _chat([_message(m.role, _text_of(m)) for m in req.messages])
    think: bool | str | None = None
    if req.reasoning_effort is not None:
        think = False if req.reasoning_effort == "none" else req.reasoning_effort
    route = _route(
        req.model,
        prompt,
        stream=req.stream,
        timeout_s=timeout_s,
        options=_sampling_options(req),
        messages=messages,
        think=think,
    )
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Ask(route=route, include_usage=include_usage)


def openai_completion(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/completions`` (legacy): one prompt; a list must hold exactly one."""
    req = _decode(body, _OpenAICompletion, "completion")
    _refuse("suffix", req.suffix)
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "unsupported", "exactly one prompt per request is supported")
        prompt = prompt[0]
    route = _route(
        req.model, prompt, stream=req.stream, timeout_s=timeout_s, options=_sampling_options(req)
    )
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Ask(route=route, include_usage=include_usage)


# Go's time.ParseDuration units, which Ollama's ``keep_alive`` strings use ("5m", "0s", "1h30m").
_GO_UNITS: Final = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "μs": 1_000,
    "ms": _NS_PER_MS,
    "s": _NS_PER_S,
    "m": 60 * _NS_PER_S,
    "h": 3600 * _NS_PER_S,
}
_GO_PART: Final = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_GO_DURATION: Final = re.compile(f"(?:{_GO_PART})+")
# What Ollama makes of a negative keep_alive: keep the model loaded for ever.
FOREVER_NS: Final = 2**63 - 1


def keep_alive_ns(value: Any) -> int | None:
    """Ollama's ``keep_alive`` in nanoseconds, as Ollama reads it: a number is seconds, a
    string a Go duration ("0", "0s", "5m"); negative is for ever; None when not given."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value):
        if value < 0 or math.isinf(value):
            return FOREVER_NS
        return min(int(value * _NS_PER_S), FOREVER_NS)
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
        400, "bad_request", f"invalid keep_alive {value!r}: seconds, or a duration like '5m'"
    )


@dataclass(frozen=True, slots=True)
class ModelAsk:
    """A ``/api/show`` or ``/api/pull`` request: which model, and (pull) streamed or not."""

    model: str
    stream: bool = True


def ollama_model_request(body: bytes, what: str) -> ModelAsk:
    """``POST /api/show`` or ``/api/pull`` (``what`` names it in errors): ``model``, else the
    older ``name``; ``stream`` is true unless ``false``."""
    req = _decode(body, _OllamaModelRequest, what)
    model = req.model or req.name or ""
    _require_model(model)
    return ModelAsk(model=model, stream=req.stream is not False)


def task_route(body: bytes) -> RouteRequest:
    """``POST /route``: the bus's own `RouteRequest` (unknown fields refused)."""
    return _decode(body, RouteRequest, "route")


# -- error statuses ------------------------------------------------------------------------------

_REFUSAL_STATUS: Final = {
    "bad_request": 400,
    "prompt_too_large": 400,
    "unsupported": 400,
    "invalid_id": 400,
    "not_found": 404,
    "worker_unavailable": 503,
    "unavailable": 503,
    "no_responder": 503,
    "busy": 503,
    "timeout": 504,
}
_FAILURE_STATUS: Final = {
    "backend_timeout": 504,
    "timeout": 504,
    "wake_timeout": 503,
}


def refusal_status(code: str, *, fleet_has_workers: bool) -> int:
    """The HTTP status of a request the router (or the bus) refused.

    ``no_worker`` is an unknown model (404, Ollama's status for one) while some worker is
    live, and a fleet without capacity (503) when none is.
    """
    if code == "no_worker":
        return 404 if fleet_has_workers else 503
    return _REFUSAL_STATUS.get(code, 500)


def failure_status(code: str) -> int:
    """The HTTP status of a task that ran and failed: the upstream failed (502), or timed out
    (504), or a sleeping worker did not wake (503)."""
    return _FAILURE_STATUS.get(code, 502)


def failure_of(reply: RouteReply) -> tuple[str, str]:
    """(code, reason) of a failed reply, whose ``error`` reads ``code: reason``."""
    code, sep, reason = (reply.error or "failed").partition(": ")
    return (code, reason) if sep else ("failed", code)


# -- response shapes -------------------------------------------------------------------------------


def iso_now(at: float | None = None) -> str:
    """RFC 3339 UTC with microseconds and a ``Z``, as Ollama stamps ``created_at``."""
    moment = datetime.fromtimestamp(time.time() if at is None else at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Shape(Protocol):
    """How one API writes what the fleet answers."""

    @property
    def stream_type(self) -> str:
        """The streamed response's content type."""
        ...

    @property
    def start_on_accept(self) -> bool:
        """Start the streamed response as soon as the task is accepted (else: at the first
        text, so a task that fails before any output still gets a proper HTTP status)."""
        ...

    def piece(self, chunk: StreamChunk) -> bytes | None:
        """One streamed piece, or None to send nothing for it."""
        ...

    def end(self, reply: RouteReply) -> bytes:
        """What closes a stream for a done (or, task API only, failed) task."""
        ...

    def whole(self, reply: RouteReply) -> bytes:
        """The whole answer, not streamed."""
        ...

    def error(self, status: int, code: str, message: str) -> bytes:
        """An error body."""
        ...

    def stream_error(self, code: str, message: str) -> bytes:
        """An error after the stream has started (its status is already 200)."""
        ...


def _ns(ms: float | None) -> int | None:
    return None if ms is None else round(ms * _NS_PER_MS)


def _line(payload: dict[str, Any]) -> bytes:
    return _encoder.encode(payload) + b"\n"


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else _encoder.encode(payload)
    return b"data: " + data + b"\n\n"


@dataclass(frozen=True, slots=True)
class OllamaShape:
    """``/api/generate`` (``chat=False``) and ``/api/chat`` (``chat=True``)."""

    model: str
    chat: bool
    stream_type: str = "application/x-ndjson"
    start_on_accept: bool = False

    def _text(self, response: str, thinking: str | None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": response}
            if thinking:
                message["thinking"] = thinking
            return {"message": message}
        text: dict[str, Any] = {"response": response}
        if thinking:
            text["thinking"] = thinking
        return text

    def piece(self, chunk: StreamChunk) -> bytes | None:
        if not (chunk.response or chunk.thinking):
            return None
        return _line(
            {
                "model": self.model,
                "created_at": iso_now(),
                **self._text(chunk.response, chunk.thinking),
                "done": False,
            }
        )

    def _final(self, response: str, thinking: str | None, reply: RouteReply) -> dict[str, Any]:
        final: dict[str, Any] = {
            "model": self.model,
            "created_at": iso_now(),
            **self._text(response, thinking),
            "done": True,
            "done_reason": "stop",
        }
        durations, tokens = reply.durations, reply.tokens
        figures = {
            "total_duration": _ns(durations.total_ms) if durations else None,
            "load_duration": _ns(durations.load_ms) if durations else None,
            "prompt_eval_count": tokens.prompt if tokens else None,
            "prompt_eval_duration": _ns(durations.prompt_eval_ms) if durations else None,
            "eval_count": tokens.eval if tokens else None,
            "eval_duration": _ns(durations.eval_ms) if durations else None,
        }
        final.update({k: v for k, v in figures.items() if v is not None})
        return final

    def end(self, reply: RouteReply) -> bytes:
        return _line(self._final("", None, reply))

    def whole(self, reply: RouteReply) -> bytes:
        return _encoder.encode(self._final(reply.response or "", reply.thinking, reply))

    def error(self, status: int, code: str, message: str) -> bytes:
        return _encoder.encode({"error": message})

    def stream_error(self, code: str, message: str) -> bytes:
        return _line({"error": message})


def _openai_error(status: int, code: str, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "api_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def _usage(reply: RouteReply) -> dict[str, int] | None:
    if reply.tokens is None:
        return None
    prompt = reply.tokens.prompt or 0
    completion = reply.tokens.eval or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@dataclass(frozen=True, slots=True)
class OpenAIShape:
    """``/v1/chat/completions`` (``chat=True``) and ``/v1/completions``; the id is the task's."""

    model: str
    chat: bool
    include_usage: bool = False
    created: int = 0
    stream_type: str = "text/event-stream"
    start_on_accept: bool = False

    def _id(self, task_id: str) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{task_id}"

    def _object(self, streamed: bool) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if streamed else "chat.completion"

    def _chunk(self, task_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id(task_id),
            "object": self._object(True),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(self, text: str, thinking: str, finish: str | None) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            delta["reasoning"] = thinking
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def piece(self, chunk: StreamChunk) -> bytes | None:
        thinking = chunk.thinking if self.chat else ""
        if not (chunk.response or thinking):
            return None
        return _event(self._chunk(chunk.task_id, [self._choice(chunk.response, thinking, None)]))

    def end(self, reply: RouteReply) -> bytes:
        finish = self._chunk(reply.task_id, [self._choice("", "", "stop")])
        events = [_event(finish)]
        usage = _usage(reply)
        if self.include_usage and usage is not None:
            events.append(_event({**finish, "choices": [], "usage": usage}))
        events.append(_event("[DONE]"))
        return b"".join(events)

    def whole(self, reply: RouteReply) -> bytes:
        text = reply.response or ""
        choice: dict[str, Any]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reply.thinking:
                message["reasoning"] = reply.thinking
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}
        body: dict[str, Any] = {
            "id": self._id(reply.task_id),
            "object": self._object(False),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        usage = _usage(reply)
        if usage is not None:
            body["usage"] = usage
        return _encoder.encode(body)

    def error(self, status: int, code: str, message: str) -> bytes:
        return _encoder.encode(_openai_error(status, code, message))

    def stream_error(self, code: str, message: str) -> bytes:
        return _event(_openai_error(502, code, message))


@dataclass(frozen=True, slots=True)
class TaskShape:
    """``POST /route``: chunks and the reply as the bus has them (NDJSON when streamed); a
    failed task is a reply like any other (status ``failed``), not an HTTP error."""

    stream_type: str = "application/x-ndjson"
    start_on_accept: bool = True

    def piece(self, chunk: StreamChunk) -> bytes | None:
        return _encoder.encode(chunk) + b"\n"

    def end(self, reply: RouteReply) -> bytes:
        return _encoder.encode(reply) + b"\n"

    def whole(self, reply: RouteReply) -> bytes:
        return _encoder.encode(reply)

    def error(self, status: int, code: str, message: str) -> bytes:
        return error_body(code, message)

    def stream_error(self, code: str, message: str) -> bytes:
        return error_body(code, message) + b"\n"


def error_body(code: str, message: str) -> bytes:
    """The project's own error body: ``{"error": {"code", "message"}}``."""
    return _encoder.encode(ErrorBody(error=ErrorDetail(code=code, message=message)))


# -- the fleet as model lists ---------------------------------------------------------------------


def served_models(workers: Sequence[WorkerView]) -> dict[str, list[WorkerView]]:
    """Each model live inference workers serve, with those workers (web-search ones left out:
    they take no inference tasks), sorted by name."""
    served: dict[str, list[WorkerView]] = {}
    for worker in workers:
        if worker.tier == "web":
            continue
        for model in worker.models:
            served.setdefault(model, []).append(worker)
    return dict(sorted(served.items()))


_DETAILS: Final = {
    "parent_model": "",
    "format": "",
    "family": "",
    "families": None,
    "parameter_size": "",
    "quantization_level": "",
}


def ollama_tags(workers: Sequence[WorkerView]) -> bytes:
    """``GET /api/tags``: the union of the live workers' models. Size and digest are unknown
    to the fleet (0 and ""); ``modified_at`` is when a worker serving it last checked in;
    ``workers`` (not in Ollama's shape) names them."""
    models = [
        {
            "name": model,
            "model": model,
            "modified_at": iso_now(max(w.last_heartbeat for w in serving)),
            "size": 0,
            "digest": "",
            "details": _DETAILS,
            "workers": [w.worker_id for w in serving],
        }
        for model, serving in served_models(workers).items()
    ]
    return _encoder.encode({"models": models})


def ollama_ps(workers: Sequence[WorkerView]) -> bytes:
    """``GET /api/ps``: the models live workers are running a task of, as of their last
    heartbeat; ``expires_at`` is that heartbeat plus Ollama's default keep-alive."""
    running: dict[str, list[WorkerView]] = {}
    for worker in workers:
        if worker.state == "busy" and worker.current_model:
            running.setdefault(worker.current_model, []).append(worker)
    models = [
        {
            "name": model,
            "model": model,
            "size": 0,
            "digest": "",
            "details": _DETAILS,
            "expires_at": iso_now(max(w.last_heartbeat for w in busy) + KEEP_ALIVE_S),
            "size_vram": 0,
            "context_length": 0,
            "workers": [w.worker_id for w in busy],
        }
        for model, busy in sorted(running.items())
    ]
    return _encoder.encode({"models": models})


def openai_models(workers: Sequence[WorkerView]) -> bytes:
    """``GET /v1/models``: the same union as ``/api/tags``."""
    data = [
        {
            "id": model,
            "object": "model",
            "created": int(max(w.last_heartbeat for w in serving)),
            "owned_by": "coordinator",
        }
        for model, serving in served_models(workers).items()
    ]
    return _encoder.encode({"object": "list", "data": data})


# -- Ollama's model management, answered from the fleet's worker list ------------------------------


def workers_serving(
    model: str, workers: Sequence[WorkerView], *, pull: bool = False
) -> list[WorkerView]:
    """The live inference workers that serve ``model`` (its exact name, as the router matches
    it), else the error: 404 in Ollama's words while some inference worker is live (for a pull:
    saying the gateway cannot pull, and where the served models are listed), 503 when none is
    (`refusal_status`'s rule for ``no_worker``)."""
    serving = served_models(workers).get(model)
    if serving:
        return serving
    if not any(w.tier != "web" for w in workers):
        raise ApiError(
            refusal_status("no_worker", fleet_has_workers=False),
            "no_worker",
            f"model '{model}' is not served: no inference worker is live",
        )
    message = f"model '{model}' not found"
    if pull:
        message += (
            ": the Coordinator gateway cannot pull models onto its workers, and no live worker"
            " serves this one; GET /api/tags lists the models the fleet serves"
        )
    raise ApiError(refusal_status("no_worker", fleet_has_workers=True), "no_worker", message)


def ollama_show(model: str, serving: Sequence[WorkerView]) -> bytes:
    """``POST /api/show`` for a model the ``serving`` workers serve. The fleet knows a model by
    name only: template, parameters and details are empty; ``model_info`` holds an empty
    ``general.architecture`` (Ollama 0.12's ``ollama show`` reads that key unchecked);
    ``capabilities`` is ``["completion"]`` (each served model passed a worker's sanity
    generation); ``modified_at`` and ``workers`` (not in Ollama's shape) as in ``/api/tags``."""
    workers = [w.worker_id for w in serving]
    modelfile = (
        "# Modelfile generated by the Coordinator gateway: the fleet knows this model by name\n"
        f"# served by: {', '.join(workers)}\n"
        f"FROM {model}\n"
    )
    return _encoder.encode(
        {
            "modelfile": modelfile,
            "parameters": "",
            "template": "",
            "details": _DETAILS,
            "model_info": {"general.architecture": ""},
            "capabilities": ["completion"],
            "modified_at": iso_now(max(w.last_heartbeat for w in serving)),
            "workers": workers,
        }
    )


# What a pull of a model that is already there reports, in Ollama's words (less the layers).
PULL_STEPS: Final = ("pulling manifest", "success")


def ollama_pull(*, stream: bool) -> bytes:
    """``POST /api/pull`` of a model the fleet serves: nothing to do, so success at once
    (NDJSON steps when streamed, else the last one)."""
    if stream:
        return b"".join(_line({"status": step}) for step in PULL_STEPS)
    return _encoder.encode({"status": PULL_STEPS[-1]})


def ollama_preload(preload: Preload, at: float | None = None) -> bytes:
    """The answer to a `Preload`, Ollama's: one JSON object, empty text, ``done_reason``
    ``load`` (or ``unload``)."""
    text: dict[str, Any] = (
        {"message": {"role": "assistant", "content": ""}} if preload.chat else {"response": ""}
    )
    return _encoder.encode(
        {
            "model": preload.model,
            "created_at": iso_now(at),
            **text,
            "done": True,
            "done_reason": "unload" if preload.unload else "load",
        }
    )
