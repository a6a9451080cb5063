"""A stand-in for the Ollama HTTP API: real HTTP/1.1 over a real socket, fake models.

It answers the endpoints a worker uses (``/api/tags``, ``/api/generate``, ``/api/chat``,
``/api/show``, ``/api/ps``, ``/api/version``, ``/``) with Ollama's shapes and status codes:
NDJSON streamed with chunked transfer encoding by default, one JSON object with
``"stream": false``, durations in nanoseconds, ``{"error": ...}`` bodies on failure.

It also serves Ollama's OpenAI-compatible API under ``/v1`` (``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /v1/chat/completions``, ``POST /v1/completions``) with
the shapes of Ollama 0.12.0's compatibility layer: not streamed unless ``"stream": true``;
streamed as Server-Sent Events (``data: {json}\n\n`` ... ``data: [DONE]\n\n``); a thinking
model's thinking in the ``reasoning`` field of ``message`` / ``delta`` (Ollama's name, not
``reasoning_content`` as llama.cpp and DeepSeek call it); ``usage`` in tokens, no timings;
errors as ``{"error": {"message", "type", "param": null, "code": null}}``, the type being
``invalid_request_error`` for a body Ollama cannot take and ``api_error`` for anything the
model handler refuses (an unknown model included: 404, ``model 'x' not found``).

Answers are deterministic: a prompt holding a small integer sum or product (``"1+1は？"``,
``"what is 6*7"``) is answered with the result; anything else is echoed back as
``"Echo from <model>: <prompt[:200]>"``, unless the ``replies`` knob names an answer for a
substring of the prompt. Models listed in ``thinking_models`` (and served)
also produce a ``thinking`` text, kept apart from the answer as Ollama does.

Behaviour is steered through attributes (``delay_s``, ``fail_status``, ``models``, ...), from
Python or over HTTP (``POST /_fake/config`` with the same names), so a copy started in another
process (``python -m tests.fakes.ollama --port P``) can be steered too. ``GET /_fake/stats``
reports how many generations were asked for and how many ran at once (``generate_calls``,
``chat_calls``, ``openai_calls`` for ``/v1/chat/completions`` and ``/v1/completions``,
``concurrent_max``, ``in_flight``, plus ``connections`` opened and generations ``cancelled``
because the client hung up); ``POST /_fake/reset`` zeroes the counters and restores the knobs
given at construction.

Standard library only.
"""

from __future__ import annotations

import argparse
import calendar
import hashlib
import http
import itertools
import json
import random
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, ClassVar, Self, cast
from urllib.parse import unquote, urlsplit

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_THINKING_MODELS",
    "OLLAMA_VERSION",
    "FakeOllama",
    "main",
]

DEFAULT_MODELS: tuple[str, ...] = ("qwen2.5:0.5b", "gemma3:1b")
DEFAULT_THINKING_MODELS: tuple[str, ...] = ("qwen3:0.6b",)
OLLAMA_VERSION = "0.12.0"

# Synthetic speeds used for the reported (not slept) prompt evaluation and generation times.
PROMPT_EVAL_NS_PER_TOKEN = 100_000  # 10 000 tokens/s
EVAL_NS_PER_TOKEN = 2_000_000  # 500 tokens/s

_NS_PER_MS = 1_000_000
_KEEP_ALIVE_NS = 5 * 60 * 1_000_000_000
_MODIFIED_AT = "2025-06-01T12:00:00.123456789Z"
_MODIFIED_UNIX = calendar.timegm(time.strptime(_MODIFIED_AT[:19], "%Y-%m-%dT%H:%M:%S"))
_OPENAI_FINGERPRINT = "fp_ollama"

_KNOBS = (
    "delay_s",
    "fail_status",
    "models",
    "thinking_models",
    "load_ms",
    "chunk_delay_s",
    "error_after_chunks",
    "drop_after_chunks",
    "replies",
)

# "1+1", "12 * 3", "２×３" (full-width digits and signs too); no minus, it would catch dates.
_ARITHMETIC = re.compile(r"([-−]?\d+)\s*([+＋*＊×])\s*([-−]?\d+)")
_TOKEN = re.compile(r"\w+|[^\w\s]")
_PIECE = re.compile(r"\s*\S{1,6}\s*")
_PARAMETERS = re.compile(r"(\d+(?:\.\d+)?)([bm])", re.IGNORECASE)

_FAILURE_MESSAGES = {
    500: "llama runner process has terminated: signal: killed",
    503: "server busy, please try again.  maximum pending requests exceeded",
}


class _ApiError(Exception):
    """Answer the request with ``status`` and Ollama's ``{"error": message}`` body, or, with an
    ``openai_type``, the OpenAI-compatible ``{"error": {"message", "type", ...}}`` body."""

    def __init__(self, status: int, message: str, *, openai_type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.openai_type = openai_type

    def as_openai(self, openai_type: str) -> _ApiError:
        """This error in OpenAI's shape (kept as it is if it already has one)."""
        if self.openai_type is not None:
            return self
        return _ApiError(self.status, self.message, openai_type=openai_type)

    def body(self) -> dict[str, Any]:
        if self.openai_type is None:
            return {"error": self.message}
        return _openai_error(self.message, self.openai_type)


# --------------------------------------------------------------------------- helpers


def _now() -> str:
    """The current UTC time as Go's RFC 3339 with nanoseconds (trailing zeros trimmed)."""
    ns = time.time_ns()
    seconds, fraction = divmod(ns, 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    digits = f"{fraction:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


def _normalize(name: str) -> str:
    """Ollama's short name: a missing tag means ``latest``; names compare case-insensitively."""
    name = name.strip().lower()
    if name.startswith("registry.ollama.ai/"):
        name = name.removeprefix("registry.ollama.ai/")
    name = name.removeprefix("library/")
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else f"{name}:latest"


def _count_tokens(text: str) -> int:
    return len(_TOKEN.findall(text))


def _pieces(text: str) -> list[str]:
    """Split into word-ish pieces whose concatenation is exactly ``text``."""
    if not text.strip():
        return [text] if text else []
    return _PIECE.findall(text)


def _answer(model: str, prompt: str) -> str:
    match = _ARITHMETIC.search(prompt)
    if match is not None:
        left = int(match.group(1).replace("−", "-"))
        right = int(match.group(3).replace("−", "-"))
        result = left + right if match.group(2) in "+＋" else left * right
        return str(result)
    return f"Echo from {model}: {prompt[:200]}"


def _thinking(prompt: str, answer: str) -> str:
    return (
        f"Let me think about: {prompt[:100].strip()}. "
        f"Working through it step by step, the answer is {answer[:40]}."
    )


def _parameter_count(normalized: str) -> int:
    tag = normalized.rsplit(":", 1)[-1]
    match = _PARAMETERS.search(tag)
    if match is None:
        return 3_000_000_000
    scale = 1_000_000_000 if match.group(2).lower() == "b" else 1_000_000
    return int(float(match.group(1)) * scale)


def _human_parameters(count: int) -> str:
    if count >= 1_000_000_000:
        return f"{count / 1_000_000_000:g}B"
    return f"{count / 1_000_000:.2f}M"


def _details(name: str) -> dict[str, Any]:
    normalized = _normalize(name)
    base = normalized.rsplit(":", 1)[0].rsplit("/", 1)[-1]
    family = base.split(".", 1)[0] or base
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family],
        "parameter_size": _human_parameters(_parameter_count(normalized)),
        "quantization_level": "Q4_K_M",
    }


def _size(name: str) -> int:
    return _parameter_count(_normalize(name)) * 6 // 10 + 50_000_000


def _digest(name: str) -> str:
    return hashlib.sha256(_normalize(name).encode()).hexdigest()


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _field(
    body: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    struct: str,
    go_type: str | None = None,
) -> Any:
    """``body[key]`` if absent, null or of ``kind``; otherwise Go's unmarshal error (HTTP 400).

    A JSON boolean fits only a ``bool`` kind (Python would let it pass for an ``int``)."""
    value = body.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or (
        isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    ):
        return value
    go_types = {str: "string", bool: "bool", dict: "map[string]interface {}", list: "[]api.Message"}
    raise _ApiError(
        400,
        f"json: cannot unmarshal {_json_type(value)} into Go struct field "
        f"{struct}.{key} of type {go_type or go_types.get(kinds[0], kinds[0].__name__)}",
    )


def _parse_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise _ApiError(400, "missing request body")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _ApiError(400, f"invalid JSON in request body: {exc}") from exc
    if not isinstance(body, dict):
        raise _ApiError(
            400, f"json: cannot unmarshal {_json_type(body)} into Go value of type object"
        )
    return body


def _chat_prompt(messages: list[dict[str, str]]) -> tuple[str, int]:
    """The text a chat answers (the last user message) and the prompt's token count."""
    users = [m["content"] for m in messages if m["role"] == "user"]
    prompt = users[-1] if users else (messages[-1]["content"] if messages else "")
    return prompt, sum(_count_tokens(m["content"]) + 4 for m in messages)


def _openai_error(message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def _namespace(name: str) -> str:
    """The namespace Ollama parses out of a model name (``library`` for plain names)."""
    parts = name.split("/")  # the tag is in the last part only
    return parts[-2] if len(parts) > 1 else "library"


def _openai_model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": _MODIFIED_UNIX, "owned_by": _namespace(name)}


def _copy(value: Any) -> Any:
    """A knob's value, with lists and dicts copied so callers cannot change the fake's."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


def _check_knob(name: str, value: object) -> Any:
    """The validated value for knob ``name``; ValueError when it does not fit."""
    if name in ("delay_s", "load_ms", "chunk_delay_s"):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a number >= 0")
        return float(value)
    if name == "fail_status":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
            raise ValueError("fail_status must be null or an HTTP status (100-599)")
        return value
    if name in ("models", "thinking_models"):
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list of model names")
        if not all(isinstance(item, str) and item for item in value):
            raise ValueError(f"{name} must be a list of non-empty strings")
        return list(value)
    if name in ("error_after_chunks", "drop_after_chunks"):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be null or an integer >= 0")
        return value
    if name == "replies":
        if not isinstance(value, dict) or not all(
            isinstance(key, str) and key and isinstance(text, str) for key, text in value.items()
        ):
            raise ValueError("replies must map non-empty prompt substrings to answer texts")
        return dict(value)
    raise ValueError(f"unknown knob {name!r}; known: {', '.join(_KNOBS)}")


@dataclass(frozen=True)
class _Knobs:
    """A snapshot of the behaviour knobs, taken once per request."""

    delay_s: float
    fail_status: int | None
    chunk_delay_s: float
    error_after_chunks: int | None
    drop_after_chunks: int | None


@dataclass(frozen=True)
class _Ask:
    """One generation request, whichever API (Ollama's own or OpenAI's) it came through."""

    model: str
    prompt: str
    prompt_tokens: int
    empty: bool  # nothing to answer: Ollama just loads the model
    think: bool | str | None
    num_predict: object  # as given; only a non-negative int limits the answer
    stream: bool
    include_usage: bool = False  # OpenAI's stream_options.include_usage


# --------------------------------------------------------------------------- the fake


class FakeOllama:
    """An Ollama look-alike serving real HTTP on ``host:port`` (port 0: pick a free one).

    Knobs (plain attributes, also settable with ``configure()`` or ``POST /_fake/config``);
    they steer ``/v1/chat/completions`` and ``/v1/completions`` just as they do ``/api/chat``:

    - ``delay_s``: seconds to wait before answering ``/api/generate`` and ``/api/chat``;
    - ``fail_status``: answer those with this HTTP status and an ``{"error": ...}`` body
      (in OpenAI's shape, type ``api_error``, on ``/v1``);
    - ``models``: the models served (``/api/tags``; others get 404);
    - ``thinking_models``: served models that think (``thinking`` apart from the answer);
    - ``load_ms``: ``load_duration`` reported on the first call of each model (cold start);
    - ``chunk_delay_s``: seconds between streamed chunks;
    - ``error_after_chunks``: after N streamed pieces, send Ollama's mid-stream
      ``{"error": ...}`` line and end the stream (no ``done`` line); on ``/v1`` an SSE event
      ``data: {"error": {...}}`` and the end, with no ``finish_reason`` and no ``[DONE]``;
    - ``drop_after_chunks``: after N streamed pieces, cut the connection (a crash);
    - ``replies``: ``{substring: answer}``; a prompt containing a substring gets that answer
      (the first that matches, in order) instead of the usual one: a judge's verdict, say.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Iterable[str] = DEFAULT_MODELS,
        *,
        thinking_models: Iterable[str] = DEFAULT_THINKING_MODELS,
        delay_s: float = 0.0,
        fail_status: int | None = None,
        load_ms: float = 0.0,
        replies: dict[str, str] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._defaults: dict[str, Any] = {
            "delay_s": _check_knob("delay_s", delay_s),
            "fail_status": _check_knob("fail_status", fail_status),
            "models": _check_knob("models", list(models)),
            "thinking_models": _check_knob("thinking_models", list(thinking_models)),
            "load_ms": _check_knob("load_ms", load_ms),
            "chunk_delay_s": 0.0,
            "error_after_chunks": None,
            "drop_after_chunks": None,
            "replies": _check_knob("replies", dict(replies or {})),
        }
        self.delay_s: float = 0.0
        self.fail_status: int | None = None
        self.models: list[str] = []
        self.thinking_models: list[str] = []
        self.load_ms: float = 0.0
        self.chunk_delay_s: float = 0.0
        self.error_after_chunks: int | None = None
        self.drop_after_chunks: int | None = None
        self.replies: dict[str, str] = {}
        self._lock = threading.Lock()
        self._generate_calls = 0
        self._chat_calls = 0
        self._openai_calls = 0
        self._in_flight = 0
        self._concurrent_max = 0
        self._connections_opened = 0
        self._cancelled_calls = 0
        self._loaded: dict[str, int] = {}  # normalized name -> expiry (time.time_ns())
        self._connections: set[socket.socket] = set()
        self._handler_threads: set[threading.Thread] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._apply_defaults()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Serve in a daemon thread; returns self. Restarting reuses the port first bound."""
        if self._server is not None:
            return self
        self._stopping = threading.Event()
        server = _Server((self.host, self.port), self)
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-ollama:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, cut open (keep-alive or streaming) connections, free the port."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = None
        self._thread = None
        self._stopping.set()
        server.shutdown()
        with self._lock:
            connections = list(self._connections)
            handlers = list(self._handler_threads)
        for connection in connections:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)
        for handler in handlers:
            handler.join(timeout=2)

    @property
    def url(self) -> str:
        if self.port == 0:
            raise RuntimeError("FakeOllama has not been started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- knobs and counters

    def configure(self, **knobs: Any) -> dict[str, Any]:
        """Set several knobs at once (validated, all or none); returns the resulting config."""
        checked = {name: _check_knob(name, value) for name, value in knobs.items()}
        for name, value in checked.items():
            setattr(self, name, value)
        return self.config()

    def config(self) -> dict[str, Any]:
        return {name: _copy(getattr(self, name)) for name in _KNOBS}

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "generate_calls": self._generate_calls,
                "chat_calls": self._chat_calls,
                "openai_calls": self._openai_calls,
                "concurrent_max": self._concurrent_max,
                "in_flight": self._in_flight,
                "connections": self._connections_opened,
                "cancelled": self._cancelled_calls,
            }

    def reset(self) -> None:
        """Zero the counters, forget loaded models, restore the knobs given at construction."""
        with self._lock:
            self._generate_calls = 0
            self._chat_calls = 0
            self._openai_calls = 0
            self._concurrent_max = self._in_flight
            self._connections_opened = 0
            self._cancelled_calls = 0
            self._loaded.clear()
        self._apply_defaults()

    def _apply_defaults(self) -> None:
        for name, value in self._defaults.items():
            setattr(self, name, _copy(value))

    def _knobs(self) -> _Knobs:
        return _Knobs(
            delay_s=self.delay_s,
            fail_status=self.fail_status,
            chunk_delay_s=self.chunk_delay_s,
            error_after_chunks=self.error_after_chunks,
            drop_after_chunks=self.drop_after_chunks,
        )

    # ---------------------------------------------------------------- used by the handler

    def _reply(self, prompt: str) -> str | None:
        """The ``replies`` answer for ``prompt``, or None when no substring matches."""
        for key, text in dict(self.replies).items():
            if key in prompt:
                return text
        return None

    def _find(self, name: str) -> str | None:
        """The served model ``name`` refers to (its normalized name), or None."""
        wanted = _normalize(name)
        served = {_normalize(model) for model in list(self.models)}
        return wanted if wanted in served else None

    def _thinks(self, normalized: str) -> bool:
        return normalized in {_normalize(model) for model in list(self.thinking_models)}

    def _load(self, normalized: str) -> int:
        """Mark the model loaded; the ``load_duration`` (ns) to report for this call."""
        now = time.time_ns()
        with self._lock:
            cold = normalized not in self._loaded
            self._loaded[normalized] = now + _KEEP_ALIVE_NS
        return int(self.load_ms * _NS_PER_MS) if cold else 0

    def _loaded_models(self) -> dict[str, int]:
        with self._lock:
            return dict(self._loaded)

    def _cancelled(self) -> None:
        with self._lock:
            self._cancelled_calls += 1

    @contextmanager
    def _track(self, api: str) -> Iterator[Callable[[], None]]:
        """Count one generation of ``api`` (``generate``, ``chat`` or ``openai``) while it runs.

        Yields ``release``, which ends the generation's time in flight; the handler calls it
        just before the last bytes of the answer go out, so that a client holding the whole
        answer never sees the generation still in flight (one-at-a-time checks would otherwise
        race the handler thread). Leaving the block releases it too.
        """
        with self._lock:
            if api == "chat":
                self._chat_calls += 1
            elif api == "openai":
                self._openai_calls += 1
            else:
                self._generate_calls += 1
            self._in_flight += 1
            self._concurrent_max = max(self._concurrent_max, self._in_flight)
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._in_flight -= 1

        try:
            yield release
        finally:
            release()

    def _opened(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections_opened += 1
            self._connections.add(connection)
            self._handler_threads.add(threading.current_thread())

    def _closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)
            self._handler_threads.discard(threading.current_thread())


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], fake: FakeOllama) -> None:
        self.fake = fake
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away (or stop() cutting connections) is not worth a traceback.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


# --------------------------------------------------------------------------- HTTP handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"FakeOllama/{OLLAMA_VERSION}"
    _go_structs: ClassVar[dict[bool, str]] = {False: "GenerateRequest", True: "ChatRequest"}

    _started = False  # response headers sent for the current request
    _head = False  # current request is HEAD: headers only

    @property
    def _fake(self) -> FakeOllama:
        return cast(_Server, self.server).fake

    # ---------------------------------------------------------------- plumbing

    def setup(self) -> None:
        super().setup()
        # As Go's net/http does: no Nagle, or header and body writes stall on delayed ACKs.
        with suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fake._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._fake._closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: keep test output clean."""

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_OPTIONS(self) -> None:
        self._dispatch("OPTIONS")

    def _dispatch(self, method: str) -> None:
        self._started = False
        self._release: Callable[[], None] | None = None
        self._head = method == "HEAD"
        try:
            raw = self._read_body()
        except ValueError as exc:
            self.close_connection = True
            self._send_json(400, {"error": f"malformed request body: {exc}"})
            return
        path = urlsplit(self.path).path
        try:
            self._route(method, path, raw)
        except _ApiError as exc:
            if self._started:
                self.close_connection = True
            elif exc.openai_type is not None:
                self._send_openai_json(exc.status, exc.body())
            else:
                self._send_json(exc.status, exc.body())
        except OSError:
            self.close_connection = True  # the client went away
        except Exception as exc:
            traceback.print_exc()
            if self._started:
                self.close_connection = True
            else:
                self._send_json(500, {"error": f"fake ollama bug: {exc!r}"})

    def _route(self, method: str, path: str, raw: bytes) -> None:
        read = method in ("GET", "HEAD")
        if read and path == "/":
            self._send_bytes(200, b"Ollama is running", "text/plain; charset=utf-8")
        elif read and path == "/api/version":
            self._send_json(200, {"version": OLLAMA_VERSION})
        elif read and path == "/api/tags":
            self._send_json(200, self._tags())
        elif method == "GET" and path == "/api/ps":
            self._send_json(200, self._ps())
        elif method == "POST" and path == "/api/generate":
            self._generation(raw, chat=False)
        elif method == "POST" and path == "/api/chat":
            self._generation(raw, chat=True)
        elif method == "POST" and path == "/api/show":
            self._show(raw)
        elif method == "GET" and path == "/v1/models":
            self._send_openai_json(200, self._openai_models())
        elif method == "GET" and path.startswith("/v1/models/"):
            self._openai_retrieve(unquote(path.removeprefix("/v1/models/")))
        elif method == "POST" and path == "/v1/chat/completions":
            self._openai_generation(raw, chat=True)
        elif method == "POST" and path == "/v1/completions":
            self._openai_generation(raw, chat=False)
        elif method == "GET" and path == "/_fake/stats":
            self._send_json(200, self._fake.stats())
        elif method == "GET" and path == "/_fake/config":
            self._send_json(200, self._fake.config())
        elif method == "POST" and path == "/_fake/config":
            body = _parse_object(raw)
            try:
                config = self._fake.configure(**body)
            except ValueError as exc:
                raise _ApiError(400, str(exc)) from exc
            self._send_json(200, config)
        elif method == "POST" and path == "/_fake/reset":
            self._fake.reset()
            self._send_json(200, self._fake.config())
        else:
            self._send_json(404, {"error": "not found"})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked_body()
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        size = int(length)
        if size < 0:
            raise ValueError("negative Content-Length")
        data = self.rfile.read(size)
        if len(data) != size:
            raise ValueError("body shorter than Content-Length")
        return data

    def _read_chunked_body(self) -> bytes:
        parts: list[bytes] = []
        while True:
            line = self.rfile.readline(65537)
            if not line:
                raise ValueError("truncated chunked body")
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while self.rfile.readline(65537) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _send_bytes(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._started = True
        self._released()
        if not self._head:
            self.wfile.write(data)
            self.wfile.flush()

    def _released(self) -> None:
        """The answer's last bytes go out next: the generation is no longer in flight."""
        if self._release is not None:
            self._release()
            self._release = None

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
        self._send_bytes(status, data, "application/json; charset=utf-8")

    def _send_openai_json(self, status: int, payload: dict[str, Any]) -> None:
        """As Ollama's ``/v1`` writers do: plain ``application/json``, Go's encoder newline."""
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"
        self._send_bytes(status, data, "application/json")

    # ---------------------------------------------------------------- model listing

    def _model_entry(self, name: str) -> dict[str, Any]:
        return {
            "name": name,
            "model": name,
            "modified_at": _MODIFIED_AT,
            "size": _size(name),
            "digest": _digest(name),
            "details": _details(name),
        }

    def _tags(self) -> dict[str, Any]:
        return {"models": [self._model_entry(name) for name in list(self._fake.models)]}

    def _ps(self) -> dict[str, Any]:
        served = {_normalize(name): name for name in list(self._fake.models)}
        running = []
        for normalized, expires_ns in self._fake._loaded_models().items():
            name = served.get(normalized)
            if name is None:
                continue
            seconds, fraction = divmod(expires_ns, 1_000_000_000)
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
            entry = self._model_entry(name)
            del entry["modified_at"]
            entry["expires_at"] = f"{stamp}.{fraction:09d}Z"
            entry["size_vram"] = entry["size"]
            entry["context_length"] = 4096
            running.append(entry)
        return {"models": running}

    def _show(self, raw: bytes) -> None:
        body = _parse_object(raw)
        name = _field(body, "model", str, "ShowRequest") or _field(body, "name", str, "ShowRequest")
        if not name:
            raise _ApiError(400, "model is required")
        normalized = self._fake._find(name)
        if normalized is None:
            raise _ApiError(404, f"model '{name}' not found")
        details = _details(name)
        family = details["family"]
        capabilities = ["completion"] + (["thinking"] if self._fake._thinks(normalized) else [])
        self._send_json(
            200,
            {
                "license": "",
                "modelfile": f"# Modelfile generated by the fake Ollama\nFROM {name}\n",
                "parameters": "",
                "template": "{{ .Prompt }}",
                "details": details,
                "model_info": {
                    "general.architecture": family,
                    "general.parameter_count": _parameter_count(normalized),
                    f"{family}.context_length": 32768,
                },
                "capabilities": capabilities,
                "modified_at": _MODIFIED_AT,
            },
        )

    # ---------------------------------------------------------------- generation

    def _generation(self, raw: bytes, *, chat: bool) -> None:
        started = time.monotonic_ns()
        with self._fake._track("chat" if chat else "generate") as self._release:
            ask = self._native_ask(raw, chat=chat)
            prepared = self._prepare(ask, chat=chat, started_ns=started)
            if prepared is None:
                return
            plan, knobs = prepared
            if ask.empty:
                # An empty prompt (or no messages) just loads the model.
                self._send_json(200, self._load_reply(ask.model, chat))
            elif ask.stream:
                self._stream(plan, knobs)
            else:
                self._send_json(200, plan.whole())

    def _native_ask(self, raw: bytes, *, chat: bool) -> _Ask:
        """Read an ``/api/generate`` or ``/api/chat`` body."""
        body = _parse_object(raw)
        struct = self._go_structs[chat]
        model: str = _field(body, "model", str, struct) or ""
        stream_field: bool | None = _field(body, "stream", bool, struct)
        options: dict[str, Any] = _field(body, "options", dict, struct) or {}
        think = body.get("think")
        if think is not None and not isinstance(think, bool | str):
            raise _ApiError(
                400, 'think must be a boolean or string ("high", "medium", "low", true, false)'
            )
        if chat:
            messages = self._messages(body)
            prompt, prompt_tokens = _chat_prompt(messages)
            empty = not messages
        else:
            prompt = _field(body, "prompt", str, struct) or ""
            system = _field(body, "system", str, struct) or ""
            prompt_tokens = _count_tokens(system) + _count_tokens(prompt) + 4
            empty = prompt == ""
        return _Ask(
            model=model,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            empty=empty,
            think=think,
            num_predict=options.get("num_predict"),
            stream=True if stream_field is None else stream_field,
        )

    def _prepare(self, ask: _Ask, *, chat: bool, started_ns: int) -> tuple[_Plan, _Knobs] | None:
        """Ollama's chat or generate handler, whichever API asked: check the model and
        ``think``, apply the knobs, plan the answer. None if the client hung up (or ``stop()``
        was called) during ``delay_s``; the connection is then closed."""
        fake = self._fake
        model = ask.model
        if not model:
            # Ollama's own (asymmetric) answers for a missing model name.
            raise (
                _ApiError(400, "model is required")
                if chat
                else _ApiError(404, "model '' not found")
            )
        normalized = fake._find(model)
        if normalized is None:
            raise _ApiError(404, f"model '{model}' not found")
        think = ask.think
        if fake._thinks(normalized):
            if isinstance(think, str) and not normalized.startswith("gpt-oss"):
                raise _ApiError(
                    400, f"think value {json.dumps(think)} is not supported for this model"
                )
            think_on = think is None or bool(think)
        else:
            if think:
                raise _ApiError(400, f"{json.dumps(model)} does not support thinking")
            think_on = False

        knobs = fake._knobs()
        if not self._pause(knobs.delay_s):
            self.close_connection = True
            return None
        if knobs.fail_status is not None:
            status = knobs.fail_status
            message = _FAILURE_MESSAGES.get(status) or _phrase(status)
            raise _ApiError(status, message)

        load_ns = fake._load(normalized)
        thinking_pieces: list[str] = []
        response_pieces: list[str] = []
        done_reason = "load"
        if not ask.empty:
            answer = fake._reply(ask.prompt)
            if answer is None:
                answer = _answer(model, ask.prompt)
            thinking_pieces = _pieces(_thinking(ask.prompt, answer)) if think_on else []
            response_pieces = _pieces(answer)
            done_reason = "stop"
            limit = ask.num_predict
            wanted = len(thinking_pieces) + len(response_pieces)
            if isinstance(limit, int) and not isinstance(limit, bool) and 0 <= limit < wanted:
                done_reason = "length"
                thinking_pieces = thinking_pieces[:limit]
                response_pieces = response_pieces[: limit - len(thinking_pieces)]
        plan = _Plan(
            model=model,
            chat=chat,
            thinking_pieces=thinking_pieces,
            response_pieces=response_pieces,
            done_reason=done_reason,
            prompt_eval_count=0 if ask.empty else ask.prompt_tokens,
            load_ns=load_ns,
            started_ns=started_ns,
        )
        return plan, knobs

    def _messages(self, body: dict[str, Any]) -> list[dict[str, str]]:
        raw = _field(body, "messages", list, "ChatRequest") or []
        messages: list[dict[str, str]] = []
        for item in raw:
            if not isinstance(item, dict):
                raise _ApiError(
                    400,
                    f"json: cannot unmarshal {_json_type(item)} into Go struct field "
                    "ChatRequest.messages of type api.Message",
                )
            role = _field(item, "role", str, "Message") or ""
            content = _field(item, "content", str, "Message") or ""
            messages.append({"role": role, "content": content})
        return messages

    def _load_reply(self, model: str, chat: bool) -> dict[str, Any]:
        reply: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            reply["message"] = {"role": "assistant", "content": ""}
        else:
            reply["response"] = ""
        reply["done"] = True
        reply["done_reason"] = "load"
        return reply

    def _stream(self, plan: _Plan, knobs: _Knobs) -> None:
        """Stream ``plan`` as Ollama's NDJSON."""

        def line(payload: dict[str, Any]) -> bytes:
            return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

        self._send_stream(
            "application/x-ndjson",
            (line(payload) for payload in plan.chunks()),
            lambda: [line(plan.final())],
            line({"error": _FAILURE_MESSAGES[500]}),
            knobs,
        )

    def _send_stream(
        self,
        content_type: str,
        pieces: Iterable[bytes],
        final: Callable[[], Sequence[bytes]],
        error: bytes,
        knobs: _Knobs,
    ) -> None:
        """Send a streamed body: the ``pieces`` (made as they are sent), then the ``final``
        writes, each in its own HTTP chunk, ``chunk_delay_s`` apart; ``error_after_chunks`` and
        ``drop_after_chunks`` cut it short, with ``error`` or with a dropped connection."""
        chunked = self.request_version != "HTTP/1.0"
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True  # HTTP/1.0: the end of the body is the end of the socket
        self.end_headers()
        self._started = True

        def write(data: bytes) -> None:
            if chunked:
                data = f"{len(data):X}\r\n".encode() + data + b"\r\n"
            self.wfile.write(data)
            self.wfile.flush()

        for sent, piece in enumerate(itertools.chain(pieces, [None])):
            last = piece is None  # None stands for the final writes
            if knobs.drop_after_chunks is not None and (last or sent >= knobs.drop_after_chunks):
                self._cut()
                return
            if knobs.error_after_chunks is not None and (last or sent >= knobs.error_after_chunks):
                self._released()
                write(error)
                break
            if sent and not self._pause(knobs.chunk_delay_s):
                self._cut()
                return
            if last:
                self._released()
            for data in final() if piece is None else [piece]:
                write(data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    # ---------------------------------------------------------------- OpenAI-compatible API

    def _openai_models(self) -> dict[str, Any]:
        # Go marshals the empty model list of a fresh Ollama as null.
        return {"object": "list", "data": [_openai_model(n) for n in self._fake.models] or None}

    def _openai_retrieve(self, name: str) -> None:
        if self._fake._find(name) is None:
            raise _ApiError(404, f"model '{name}' not found", openai_type="api_error")
        self._send_openai_json(200, _openai_model(name))

    def _openai_generation(self, raw: bytes, *, chat: bool) -> None:
        """``/v1/chat/completions`` (chat) or ``/v1/completions``: Ollama's compatibility layer
        reads the body (its errors: ``invalid_request_error``), hands it to the chat or generate
        handler (its errors: ``api_error``) and rewrites the answer in OpenAI's shapes."""
        started = time.monotonic_ns()
        with self._fake._track("openai") as self._release:
            try:
                ask = self._openai_ask(raw, chat=chat)
            except _ApiError as exc:
                raise exc.as_openai("invalid_request_error") from None
            try:
                prepared = self._prepare(ask, chat=chat, started_ns=started)
            except _ApiError as exc:
                raise exc.as_openai("api_error") from None
            if prepared is None:
                return
            plan, knobs = prepared
            reply = _OpenAIReply.of(plan, include_usage=ask.include_usage)
            if not ask.stream:
                self._send_openai_json(200, reply.whole())
                return

            def event(payload: dict[str, Any] | str) -> bytes:
                text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
                return f"data: {payload if isinstance(payload, str) else text}\n\n".encode()

            self._send_stream(
                "text/event-stream",
                (event(payload) for payload in reply.chunks()),
                lambda: [event(payload) for payload in reply.final()],
                event(_openai_error(_FAILURE_MESSAGES[500], "api_error")),
                knobs,
            )

    def _openai_ask(self, raw: bytes, *, chat: bool) -> _Ask:
        """Read a ``ChatCompletionRequest`` or a ``CompletionRequest`` body as Ollama does."""
        if not raw.strip():
            raise _ApiError(400, "EOF")  # what Go's decoder says of an empty body
        body = _parse_object(raw)
        struct = "ChatCompletionRequest" if chat else "CompletionRequest"
        model: str = _field(body, "model", str, struct) or ""
        stream: bool = _field(body, "stream", bool, struct) or False
        options: dict[str, Any] = (
            _field(body, "stream_options", dict, struct, "openai.StreamOptions") or {}
        )
        include_usage: bool = _field(options, "include_usage", bool, "StreamOptions") or False
        max_tokens: int | None = _field(body, "max_tokens", int, struct, "int")
        _field(body, "temperature", (int, float), struct, "float64")
        think: str | None = None
        if chat:
            messages = self._openai_messages(body)
            if not messages:
                raise _ApiError(400, "[] is too short - 'messages'")
            prompt, prompt_tokens = _chat_prompt(messages)
            empty = False
            reasoning = _field(body, "reasoning", dict, struct, "openai.Reasoning") or {}
            think = _field(reasoning, "effort", str, "Reasoning") or _field(
                body, "reasoning_effort", str, struct
            )
        else:
            prompt = _field(body, "prompt", str, struct) or ""
            prompt_tokens = _count_tokens(prompt) + 4
            empty = prompt == ""
        return _Ask(
            model=model,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            empty=empty,
            think=think,
            num_predict=max_tokens,
            stream=stream,
            include_usage=include_usage,
        )

    def _openai_messages(self, body: dict[str, Any]) -> list[dict[str, str]]:
        """OpenAI messages as Ollama's: string content, or text (and image) parts, one each."""
        raw = _field(body, "messages", list, "ChatCompletionRequest", "[]openai.Message") or []
        messages: list[dict[str, str]] = []
        for item in raw:
            if not isinstance(item, dict):
                raise _ApiError(
                    400,
                    f"json: cannot unmarshal {_json_type(item)} into Go struct field "
                    "ChatCompletionRequest.messages of type openai.Message",
                )
            role = _field(item, "role", str, "Message") or ""
            content = item.get("content")
            if isinstance(content, str):
                messages.append({"role": role, "content": content})
            elif isinstance(content, list):
                for part in content:
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind == "text" and isinstance(part.get("text"), str):
                        messages.append({"role": role, "content": part["text"]})
                    elif kind == "image_url":
                        messages.append({"role": role, "content": ""})
                    else:
                        raise _ApiError(400, "invalid message format")
            elif item.get("tool_calls"):
                messages.append({"role": role, "content": ""})  # content is optional with these
            else:
                go_type = {
                    "null": "<nil>",
                    "number": "float64",
                    "object": "map[string]interface {}",
                }
                kind = _json_type(content)
                raise _ApiError(400, f"invalid message content type: {go_type.get(kind, kind)}")
        return messages

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``, like a model computing; False if the client hung up meanwhile
        (Ollama then abandons the generation) or ``stop()`` was called."""
        fake = self._fake
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            if fake._stopping.is_set():
                return False
            readable, _, _ = select.select([self.connection], [], [], min(remaining, 0.02))
            if not readable:
                continue
            try:
                hung_up = self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                hung_up = True
            if hung_up:
                fake._cancelled()
                return False
            fake._stopping.wait(max(0.0, deadline - time.monotonic()))  # a pipelined request
        return not fake._stopping.is_set()

    def _cut(self) -> None:
        """Drop the connection mid-response, as a crashing server would."""
        self.close_connection = True
        with suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase.lower()
    except ValueError:
        return f"fake failure (HTTP {status})"


@dataclass(frozen=True)
class _Plan:
    """What one generation will say, streamed or whole."""

    model: str
    chat: bool
    thinking_pieces: list[str]
    response_pieces: list[str]
    done_reason: str
    prompt_eval_count: int
    load_ns: int
    started_ns: int

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now()}

    def _text(self, content: str, thinking: str | None) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            return {"message": message}
        text: dict[str, Any] = {"response": content}
        if thinking:
            text["thinking"] = thinking
        return text

    def chunks(self) -> Iterator[dict[str, Any]]:
        """The streamed lines before the final one: thinking pieces first, then the answer."""
        for piece in self.thinking_pieces:
            yield {**self._head(), **self._text("", piece), "done": False}
        for piece in self.response_pieces:
            yield {**self._head(), **self._text(piece, None), "done": False}

    def _metrics(self) -> dict[str, Any]:
        eval_count = len(self.thinking_pieces) + len(self.response_pieces)
        prompt_ns = self.prompt_eval_count * PROMPT_EVAL_NS_PER_TOKEN
        eval_ns = eval_count * EVAL_NS_PER_TOKEN
        wall_ns = time.monotonic_ns() - self.started_ns
        metrics: dict[str, Any] = {"done": True, "done_reason": self.done_reason}
        if not self.chat:
            metrics["context"] = []
        metrics.update(
            total_duration=wall_ns + self.load_ns + prompt_ns + eval_ns,
            load_duration=self.load_ns,
            prompt_eval_count=self.prompt_eval_count,
            prompt_eval_duration=prompt_ns,
            eval_count=eval_count,
            eval_duration=eval_ns,
        )
        return metrics

    def final(self) -> dict[str, Any]:
        """The last streamed line: empty text, ``done: true`` and the figures."""
        return {**self._head(), **self._text("", None), **self._metrics()}

    def whole(self) -> dict[str, Any]:
        """The ``"stream": false`` answer."""
        thinking = "".join(self.thinking_pieces) or None
        text = self._text("".join(self.response_pieces), thinking)
        return {**self._head(), **text, **self._metrics()}


@dataclass(frozen=True)
class _OpenAIReply:
    """A plan in the shapes of Ollama's OpenAI compatibility layer (0.12.0): ``chat.completion``
    and ``chat.completion.chunk`` for a chat, ``text_completion`` for a legacy completion.

    Each streamed chat delta carries ``"role": "assistant"`` and ``content`` (``""`` beside
    thinking); thinking goes in ``reasoning``. The finishing chunk has an empty ``content`` and
    the ``finish_reason``; with ``stream_options.include_usage`` a chunk with no choices and the
    ``usage`` follows (legacy completion chunks then also carry zero ``usage``, as Ollama's do).
    A legacy completion drops the thinking, as Ollama does (its pieces stream as empty text).
    """

    plan: _Plan
    include_usage: bool
    id: str
    created: int

    @classmethod
    def of(cls, plan: _Plan, *, include_usage: bool) -> _OpenAIReply:
        prefix = "chatcmpl" if plan.chat else "cmpl"
        return cls(plan, include_usage, f"{prefix}-{random.randrange(999)}", int(time.time()))

    def _usage(self) -> dict[str, int]:
        prompt = self.plan.prompt_eval_count
        completion = len(self.plan.thinking_pieces) + len(self.plan.response_pieces)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _choice(self, text: str, thinking: str | None, finish: str | None) -> dict[str, Any]:
        if not self.plan.chat:
            return {"text": text, "index": 0, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            delta["reasoning"] = thinking
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        if self.plan.chat:
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.plan.model,
                "system_fingerprint": _OPENAI_FINGERPRINT,
                "choices": choices,
            }
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "choices": choices,
            "model": self.plan.model,
            "system_fingerprint": _OPENAI_FINGERPRINT,
        }
        if self.include_usage:
            chunk["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return chunk

    def chunks(self) -> Iterator[dict[str, Any]]:
        """The streamed pieces: thinking first, then the answer."""
        for piece in self.plan.thinking_pieces:
            yield self._chunk([self._choice("", piece, None)])
        for piece in self.plan.response_pieces:
            yield self._chunk([self._choice(piece, None, None)])

    def final(self) -> list[dict[str, Any] | str]:
        """What ends the stream: the ``finish_reason`` chunk, the usage chunk, ``[DONE]``."""
        finish = self._chunk([self._choice("", None, self.plan.done_reason)])
        events: list[dict[str, Any] | str] = [finish]
        if self.include_usage:
            events.append({**finish, "choices": [], "usage": self._usage()})
        events.append("[DONE]")
        return events

    def whole(self) -> dict[str, Any]:
        """The not-streamed answer."""
        plan = self.plan
        text = "".join(plan.response_pieces)
        choice: dict[str, Any]
        if plan.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking := "".join(plan.thinking_pieces):
                message["reasoning"] = thinking
            choice = {"index": 0, "message": message, "finish_reason": plan.done_reason}
        else:
            choice = {"text": text, "index": 0, "finish_reason": plan.done_reason}
        return {
            "id": self.id,
            "object": "chat.completion" if plan.chat else "text_completion",
            "created": self.created,
            "model": plan.model,
            "system_fingerprint": _OPENAI_FINGERPRINT,
            "choices": [choice],
            "usage": self._usage(),
        }


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.ollama", description="Serve a fake Ollama HTTP API."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=11434, help="0 picks a free port")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated")
    parser.add_argument(
        "--thinking-models", default=",".join(DEFAULT_THINKING_MODELS), help="comma-separated"
    )
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--load-ms", type=float, default=0.0, help="cold-start load_duration")
    parser.add_argument("--fail-status", type=int, default=None)
    args = parser.parse_args(argv)

    def names(text: str) -> list[str]:
        return [name.strip() for name in text.split(",") if name.strip()]

    try:
        fake = FakeOllama(
            args.host,
            args.port,
            names(args.models),
            thinking_models=names(args.thinking_models),
            delay_s=args.delay,
            fail_status=args.fail_status,
            load_ms=args.load_ms,
        )
    except ValueError as exc:
        parser.error(str(exc))

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    fake.start()
    try:
        print(f"fake ollama listening on {fake.url}", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
