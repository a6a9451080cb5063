"""A stand-in for the Ollama HTTP API: real HTTP/1.1 over a real socket, fake models.

It answers the endpoints a worker uses (``/api/tags``, ``/api/generate``, ``/api/chat``,
``/api/embed``, ``/api/embeddings``, ``/api/show``, ``/api/ps``, ``/api/version``, ``/``) with
Ollama's shapes and status codes: NDJSON streamed with chunked transfer encoding by default, one
JSON object with ``"stream": false``, durations in nanoseconds, ``{"error": ...}`` bodies on
failure. Ollama's model management too (``/api/pull``, ``/api/create``, ``/api/copy``,
``DELETE /api/delete``), whose state and answers `devtools.fakes.ollama_models` keeps: a pulled,
created or copied model is served (listed, shown, run); a created one's ``system``, messages and
parameters apply to its chats as Ollama applies them (the system prompt counts in
``prompt_eval_count``; a ``num_predict`` parameter limits its answers).

It also serves Ollama's OpenAI-compatible API under ``/v1`` (``GET /v1/models``,
``GET /v1/models/{model}``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/embeddings``) with the shapes of Ollama 0.12's compatibility layer: not streamed
unless ``"stream": true``; streamed as Server-Sent Events (``data: {json}\n\n`` ...
``data: [DONE]\n\n``); a thinking model's thinking in the ``reasoning`` field of ``message`` /
``delta`` (Ollama's name, not ``reasoning_content`` as llama.cpp and DeepSeek call it); ``usage``
in tokens, no timings; errors as ``{"error": {"message", "type", "param": null, "code": null}}``,
the type being ``invalid_request_error`` for a body Ollama cannot take and ``api_error`` for
anything the model handler refuses (an unknown model included: 404, ``model 'x' not found``).

Answers are deterministic: a prompt holding a small integer sum or product (``"1+1は？"``,
``"what is 6*7"``) is answered with the result; anything else is echoed back as
``"Echo from <model>: <prompt[:200]>"``, unless the ``replies`` knob names an answer for a
substring of the prompt. The prompt of a chat is its last user message (all the text parts
of it, for an OpenAI message made of parts).

Capabilities (what ``/api/show`` lists and what Ollama checks before running a model):

- every served model has ``completion``, except ``embedding_models``, which have only
  ``embedding`` (chat and generate on them: HTTP 400 ``"<model>" does not support chat`` /
  ``generate``); ``thinking_models`` think (``thinking`` apart from the answer; ``think: true``
  elsewhere: 400 ``"<model>" does not support thinking``); ``tool_models`` take ``tools``
  (elsewhere: 400 ``registry.ollama.ai/library/<name>:<tag> does not support tools``: Ollama
  names the model in full there); ``insert_models`` take a ``suffix`` (elsewhere: ``... does
  not support insert``); ``vision_models`` look at images. Images sent to any other model are
  decoded (bad base64 is refused) and then ignored, as Ollama does; any served model embeds.
- Defaults: ``DEFAULT_MODELS`` are served; the capability lists name models that are not all
  served by default (add them to ``models`` to serve them): thinking ``qwen3:0.6b``; tools
  ``qwen2.5:0.5b``, ``qwen3:0.6b``, ``qwen2.5-coder:1.5b``; vision ``gemma3:4b``; embedding
  ``nomic-embed-text:latest`` (768 dimensions), ``all-minilm:latest`` (384); insert
  ``qwen2.5-coder:1.5b``.

Rules for the features a model may have:

- Tools (``/api/chat`` and ``/v1/chat/completions`` with ``tools``): when the last message is
  the user's and the prompt (or, if a ``replies`` substring matches, that reply) mentions a
  tool's function name (case-insensitive), the assistant calls every tool so mentioned, in the
  order of ``tools``, with empty content and ``done_reason`` ``stop`` (OpenAI:
  ``finish_reason`` ``tool_calls``). Arguments are built from the tool's JSON-schema
  ``parameters``: its ``required`` properties (all of them when none is required), each
  ``name=value`` (or ``name="a value"``) written in the prompt taken as given, otherwise a
  value by type: a string is the first "double-quoted" phrase of the prompt, else the prompt;
  an integer or a number is the first number in the prompt, else 0; a boolean ``true``; an
  enum its first value; an array one item; an object its properties in turn. Streamed, each
  call comes in a chunk of its own (``done: false``) before the final chunk. When the last
  message(s) are ``role: "tool"`` results the answer is text:
  ``"Based on the tool result: <tool_name> returned <content>"`` (``results`` and ``; ``-joined
  for several), unless ``replies`` matches the results.
- Structured output (``format``; OpenAI ``response_format``): ``"json"`` (OpenAI
  ``json_object``) gives ``{"response": "<answer>"}``; a JSON schema gives an instance of it:
  all its properties (required ones first), ``name=value`` from the prompt where given,
  else strings the answer (or a sample for ``format`` date-time, date, time, email, uri, uuid,
  ...), numbers the first number in the answer (an echo's model name aside), else in the
  prompt, else 0, within ``minimum`` / ``maximum``, booleans ``true``, ``enum`` / ``const``
  honoured, arrays ``minItems`` items (at least one), ``$ref`` / ``$defs``, ``anyOf`` /
  ``oneOf`` (the first non-null choice) and ``allOf`` followed; ``pattern`` is not (the object
  comes as JSON text in the content, as a model writes it). Any other ``format`` fails as
  Ollama's runner does: HTTP 500 ``invalid format: "<raw>"; expected "json" or a valid JSON
  Schema object``, or, streamed, an ``{"error": ...}`` line after a 200.
- Images (``images`` on ``/api/generate`` and on chat messages, ``image_url`` data URLs on
  ``/v1``): a vision model's answer ends with ``[N image(s): <size> bytes sha256:<12 hex>; ...]``
  (not when a ``replies`` answer is used). ``/_fake/stats`` ``last_images`` counts the images of
  the last generation request.
- Embeddings: a vector is the sum of pseudo-random vectors, one per lower-cased word of the
  text, seeded by the model and the word (so texts sharing words are close), of the model's
  ``embedding_length`` (embedding models: 768, ``all-minilm`` 384, ``mxbai`` 1024; chat models:
  896 to 5120 by size). ``/api/embed`` and ``/v1/embeddings`` L2-normalise it in float32 (then
  cut to ``dimensions`` and normalise again, as Ollama does) and send float32 digits;
  ``/api/embeddings`` (legacy) sends it as it is, not normalised. Embedding models have a
  512-token context (chat models: ``num_ctx``, 4096 by default), tokens counted by the fake's
  tokenizer (words and punctuation marks).

Behaviour is steered through attributes (``delay_s``, ``fail_status``, ``models``, ...), from
Python or over HTTP (``POST /_fake/config`` with the same names), so a copy started in another
process (``python -m devtools.fakes.ollama --port P``) can be steered too. ``GET /_fake/stats``
reports how many generations were asked for and how many ran at once (``generate_calls``,
``chat_calls``, ``openai_calls`` for ``/v1/chat/completions`` and ``/v1/completions``,
``embed_calls`` for the three embedding endpoints, ``concurrent_max``, ``in_flight``, plus
``connections`` opened, generations ``cancelled`` because the client hung up and
``last_images``); ``GET /_fake/calls`` (``{"calls": FakeOllama.calls()}``) lists every
call with the wall-clock times it began and ended and the prompt it answers, so a test can
tell whether generations of one prompt on two stand-ins overlapped; ``GET /_fake/last``
(``FakeOllama.last()``) gives the last request body received by each API (``last_chat``,
``last_generate``, ``last_embed`` for ``/api/embed`` and ``/api/embeddings``,
``last_embeddings`` for ``/api/embeddings`` alone, ``last_openai`` for any ``/v1`` POST), as
parsed, even when it was refused, so that tests can check ``options``,
``keep_alive``, ``tools``, ``format`` and ``images`` arrived unchanged (``last("chat")`` gives
one of them);
``POST /_fake/reset`` zeroes the counters, forgets those bodies and the loaded models, and
restores the knobs given at construction.

Options are checked as Ollama does: an unknown name is ignored (Ollama only logs it; note that
``mirostat``, ``tfs_z`` and the like are gone from Ollama's options since 0.7), a known one of
the wrong type fails with HTTP 500 ``option "top_k" must be of type integer``. ``keep_alive``
(seconds, or a Go duration such as ``"10m"``; negative: forever) sets the ``expires_at`` that
``/api/ps`` shows; ``0`` unloads the model after the request (with no prompt: at once, and
``done_reason`` ``unload``); a changed ``num_ctx`` reloads the model (``/api/ps``
``context_length``, and a ``size`` that is the file's and its context cache's, as Ollama
estimates what a loaded model takes).

Standard library only.
"""

from __future__ import annotations

import argparse
import base64
import calendar
import copy
import functools
import hashlib
import http
import itertools
import json
import math
import os
import random
import re
import select
import signal
import socket
import string
import struct
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, ClassVar, Self, cast
from urllib.parse import unquote, urlsplit

__all__ = [
    "DEFAULT_EMBEDDING_MODELS",
    "DEFAULT_INSERT_MODELS",
    "DEFAULT_MODELS",
    "DEFAULT_REGISTRY",
    "DEFAULT_THINKING_MODELS",
    "DEFAULT_TOOL_MODELS",
    "DEFAULT_VISION_MODELS",
    "OLLAMA_VERSION",
    "FakeOllama",
    "main",
]

DEFAULT_MODELS: tuple[str, ...] = ("qwen2.5:0.5b", "gemma3:1b")
DEFAULT_THINKING_MODELS: tuple[str, ...] = ("qwen3:0.6b",)
DEFAULT_TOOL_MODELS: tuple[str, ...] = ("qwen2.5:0.5b", "qwen3:0.6b", "qwen2.5-coder:1.5b")
DEFAULT_VISION_MODELS: tuple[str, ...] = ("gemma3:4b",)
DEFAULT_EMBEDDING_MODELS: tuple[str, ...] = ("nomic-embed-text:latest", "all-minilm:latest")
DEFAULT_INSERT_MODELS: tuple[str, ...] = ("qwen2.5-coder:1.5b",)
# What /api/pull finds (the `registry` knob): every model the defaults name, and a few more.
DEFAULT_REGISTRY: tuple[str, ...] = (
    *DEFAULT_MODELS,
    "qwen3:0.6b",
    "qwen2.5-coder:1.5b",
    "gemma3:4b",
    *DEFAULT_EMBEDDING_MODELS,
    "llama3.2:1b",
    "llama3.2:3b",
    "smollm2:135m",
)
OLLAMA_VERSION = "0.12.0"

# Synthetic speeds used for the reported (not slept) prompt evaluation and generation times.
PROMPT_EVAL_NS_PER_TOKEN = 100_000  # 10 000 tokens/s
EVAL_NS_PER_TOKEN = 2_000_000  # 500 tokens/s

_NS_PER_MS = 1_000_000
_KEEP_ALIVE_NS = 5 * 60 * 1_000_000_000
_FOREVER_NS = 2**63 - 1  # Go's math.MaxInt64 duration: what a negative keep_alive means
_DEFAULT_NUM_CTX = 4096  # OLLAMA_CONTEXT_LENGTH's default
_CHAT_CONTEXT = 32768  # a chat model's trained context (model_info)
_EMBEDDING_CONTEXT = 512  # an embedding model's
_MODIFIED_AT = "2025-06-01T12:00:00.123456789Z"
_MODIFIED_UNIX = calendar.timegm(time.strptime(_MODIFIED_AT[:19], "%Y-%m-%dT%H:%M:%S"))
_OPENAI_FINGERPRINT = "fp_ollama"
_REGISTRY = "registry.ollama.ai"

_MODEL_LISTS = (
    "models",
    "registry",
    "thinking_models",
    "tool_models",
    "vision_models",
    "embedding_models",
    "insert_models",
)
_KNOBS = (
    "delay_s",
    "fail_status",
    "models",
    "thinking_models",
    "tool_models",
    "vision_models",
    "embedding_models",
    "insert_models",
    "load_ms",
    "chunk_delay_s",
    "error_after_chunks",
    "drop_after_chunks",
    "reset_after_chunks",
    "replies",
    "registry",
    "pull_chunk_delay_s",
    "disk_free_bytes",
)
_MODEL_MANAGEMENT = {
    ("POST", "/api/pull"),
    ("POST", "/api/create"),
    ("POST", "/api/copy"),
    ("DELETE", "/api/delete"),
}
_LAST = ("last_chat", "last_generate", "last_embed", "last_embeddings", "last_openai")

# "1+1", "12 * 3", "２×３" (full-width digits and signs too); no minus, it would catch dates.
_ARITHMETIC = re.compile(r"([-−]?\d+)\s*([+＋*＊×])\s*([-−]?\d+)")
_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w+")
_PIECE = re.compile(r"\s*\S{1,6}\s*")
_PARAMETERS = re.compile(r"(\d+(?:\.\d+)?)([bm])", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_QUOTED = re.compile(r'"([^"\n]+)"|“([^”\n]+)”')
_EXPLICIT = re.compile(r"""(?<![\w.])([A-Za-z_][\w-]*)\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s,;]+))""")

_FAILURE_MESSAGES = {
    500: "llama runner process has terminated: signal: killed",
    503: "server busy, please try again.  maximum pending requests exceeded",
}

# api.Options of Ollama 0.12: the JSON name of each option and its Go kind.
_OPTION_KINDS: dict[str, str] = {
    **dict.fromkeys(
        (
            "num_keep",
            "seed",
            "num_predict",
            "top_k",
            "repeat_last_n",
            "num_ctx",
            "num_batch",
            "num_gpu",
            "main_gpu",
            "num_thread",
        ),
        "integer",
    ),
    **dict.fromkeys(
        (
            "top_p",
            "min_p",
            "typical_p",
            "temperature",
            "repeat_penalty",
            "presence_penalty",
            "frequency_penalty",
        ),
        "float32",
    ),
    "stop": "array",
    "use_mmap": "boolean",
}

# Samples for a JSON schema's string "format".
_STRING_FORMATS = {
    "date-time": "2025-06-01T12:00:00Z",
    "date": "2025-06-01",
    "time": "12:00:00",
    "duration": "PT1H",
    "email": "user@example.com",
    "idn-email": "user@example.com",
    "hostname": "example.com",
    "idn-hostname": "example.com",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "uri": "https://example.com/",
    "uri-reference": "https://example.com/",
    "iri": "https://example.com/",
    "url": "https://example.com/",
    "uuid": "123e4567-e89b-42d3-a456-426614174000",
}

_IMAGE_DATA_URL_TYPES = ("jpeg", "jpg", "png", "webp")


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
    return _timestamp(time.time_ns())


def _normalize(name: str) -> str:
    """Ollama's short name: a missing tag means ``latest``; names compare case-insensitively."""
    name = name.strip().lower()
    if name.startswith(f"{_REGISTRY}/"):
        name = name.removeprefix(f"{_REGISTRY}/")
    name = name.removeprefix("library/")
    last = name.rsplit("/", 1)[-1]
    return name if ":" in last else f"{name}:latest"


def _full_name(name: str) -> str:
    """The name as Ollama's ``model.Name.String()`` spells it: host/namespace/model:tag."""
    rest, tag = name, "latest"
    if rest.rfind(":") > rest.rfind("/"):
        rest, tag = rest.rsplit(":", 1)
    parts = rest.split("/")
    model = parts[-1]
    namespace = parts[-2] if len(parts) >= 2 else "library"
    host = "/".join(parts[:-2]) if len(parts) >= 3 else _REGISTRY
    host = host.split("://", 1)[-1]
    return f"{host}/{namespace}/{model}:{tag}"


def _go_quote(text: str) -> str:
    """``text`` as Go's ``%q`` (``strconv.Quote``) writes it."""
    escapes = {"\a": r"\a", "\b": r"\b", "\f": r"\f", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    escapes |= {"\v": r"\v", "\\": r"\\", '"': r"\""}
    out = []
    for char in text:
        if char in escapes:
            out.append(escapes[char])
        elif char.isprintable() or char == " ":
            out.append(char)
        elif ord(char) < 0x80:
            out.append(f"\\x{ord(char):02x}")
        elif ord(char) < 0x10000:
            out.append(f"\\u{ord(char):04x}")
        else:
            out.append(f"\\U{ord(char):08x}")
    return '"' + "".join(out) + '"'


def _go_json(value: object) -> str:
    """Compact JSON as Go's ``json.Marshal`` writes it: map keys sorted, ``<>&`` escaped."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=True)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
        text = text.replace(char, escaped)
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


_B64_VALUES = {char: index for index, char in enumerate(string.ascii_uppercase)}
_B64_VALUES |= {char: 26 + i for i, char in enumerate(string.ascii_lowercase)}
_B64_VALUES |= {char: 52 + i for i, char in enumerate(string.digits)}
_B64_VALUES |= {"+": 62, "/": 63}
_B64_ALPHABET = {ord(char) for char in _B64_VALUES}


def _go_b64decode(text: str) -> bytes:
    """Go's ``base64.StdEncoding`` decoding (padding required, CR and LF skipped); ValueError
    with Go's ``illegal base64 data at input byte N`` when the text is not base64."""
    src = text.encode()
    size, si = len(src), 0
    newlines = (ord("\n"), ord("\r"))

    def corrupt(at: int) -> ValueError:
        return ValueError(f"illegal base64 data at input byte {at}")

    while True:  # one quantum of up to four characters a turn, as Go's decodeQuantum
        seen = 0
        while seen < 4:
            if si == size:
                if seen == 0:
                    break
                raise corrupt(si - seen)
            char = src[si]
            si += 1
            if char in _B64_ALPHABET:
                seen += 1
                continue
            if char in newlines:
                continue
            if char != ord("="):
                raise corrupt(si - 1)
            if seen in (0, 1):
                raise corrupt(si - 1)  # padding too early
            if seen == 2:
                while si < size and src[si] in newlines:
                    si += 1
                if si == size:
                    raise corrupt(size)  # not enough padding
                if src[si] != ord("="):
                    raise corrupt(si - 1)
                si += 1
            while si < size and src[si] in newlines:
                si += 1
            if si < size:
                raise corrupt(si)  # trailing garbage
            break
        if si >= size:
            break
    cleaned = bytes(byte for byte in src if byte not in newlines)
    return base64.b64decode(cleaned, validate=True)


_GO_UNITS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,  # U+00B5
    "μs": 1_000,  # U+03BC
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_GO_DURATION_PART = re.compile(r"([0-9]*)(?:\.([0-9]*))?([^0-9.]*)")


def _go_duration(text: str) -> int:
    """Go's ``time.ParseDuration`` (nanoseconds); ValueError with Go's message."""
    quoted = '"' + text + '"'
    rest = text
    sign = 1
    if rest[:1] in ("-", "+"):
        sign = -1 if rest[0] == "-" else 1
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise ValueError(f"time: invalid duration {quoted}")
    total = 0
    while rest:
        match = _GO_DURATION_PART.match(rest)
        assert match is not None  # the pattern matches any text
        whole, fraction, unit = match.group(1), match.group(2), match.group(3)
        if not whole and not fraction:
            raise ValueError(f"time: invalid duration {quoted}")
        if not unit:
            raise ValueError(f"time: missing unit in duration {quoted}")
        if unit not in _GO_UNITS:
            raise ValueError(f"time: unknown unit {_go_quote(unit)} in duration {quoted}")
        scale = _GO_UNITS[unit]
        total += int(whole or "0") * scale
        if fraction:
            total += int(int(fraction) * scale / 10 ** len(fraction))
        rest = rest[match.end() :]
        if total > _FOREVER_NS:
            raise ValueError(f"time: invalid duration {quoted}")
    return sign * total


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


def _image_note(images: Sequence[bytes]) -> str:
    """What a vision model says it saw: how many images, each one's size and sha256 prefix."""
    seen = "; ".join(
        f"{len(data)} bytes sha256:{hashlib.sha256(data).hexdigest()[:12]}" for data in images
    )
    return f"[{len(images)} image{'' if len(images) == 1 else 's'}: {seen}]"


def _tool_result_answer(results: Sequence[tuple[str, str]]) -> str:
    said = "; ".join(
        f"{name} returned {content[:200]}" if name else content[:200] for name, content in results
    )
    return f"Based on the tool result{'' if len(results) == 1 else 's'}: {said}"


def _parameter_count(normalized: str) -> int:
    tag = normalized.rsplit(":", 1)[-1]
    match = _PARAMETERS.search(tag)
    if match is None:
        if "minilm" in normalized:
            return 23_000_000
        if "embed" in normalized:
            return 137_000_000
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


def _context_bytes(normalized: str, num_ctx: int) -> int:
    """The memory a loaded model's context cache takes (keys and values for ``num_ctx``
    tokens): about 128 KiB a token for a 7B model, in proportion to the parameters."""
    return num_ctx * (_parameter_count(normalized) // 56_000)


def _embedding_length(normalized: str, embedding_model: bool) -> int:
    """The model's ``<family>.embedding_length``: its vectors' size."""
    if embedding_model:
        if "minilm" in normalized:
            return 384
        if "mxbai" in normalized or "bge-large" in normalized:
            return 1024
        return 768
    count = _parameter_count(normalized)
    for limit, length in (
        (550_000_000, 896),
        (800_000_000, 1024),
        (1_200_000_000, 1152),
        (2_000_000_000, 1536),
        (4_500_000_000, 2560),
        (9_000_000_000, 4096),
    ):
        if count <= limit:
            return length
    return 5120


def _f32(values: Iterable[float]) -> list[float]:
    """The values rounded to float32, as Python floats."""
    return list(array("f", values))


@functools.lru_cache(maxsize=8192)
def _word_vector(seed: str, word: str, size: int) -> tuple[float, ...]:
    digest = hashlib.sha256(f"{seed}\0{word}".encode()).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    return tuple(rng.random() * 2 - 1 for _ in range(size))


def _raw_embedding(normalized: str, text: str, size: int) -> list[float]:
    """The model's (not normalised) float32 vector for ``text``: the sum of one pseudo-random
    vector per lower-cased word, so texts sharing words point the same way."""
    words = [word.lower() for word in _WORD.findall(text)] or [""]
    total = [0.0] * size
    for word in words:
        total = [a + b for a, b in zip(total, _word_vector(normalized, word, size), strict=True)]
    return _f32(total)


def _normalized(vector: Sequence[float]) -> list[float]:
    """Ollama's ``normalize``: L2 normalisation computed in float32 as Go does it."""
    total = 0.0
    pack, unpack = struct.Struct("<f").pack, struct.Struct("<f").unpack
    for value in vector:
        square = unpack(pack(value * value))[0]
        total = unpack(pack(total + square))[0]
    norm = unpack(pack(1.0 / max(math.sqrt(total), 1e-12)))[0]
    return _f32(value * norm for value in vector)


def _float32_json(value: float) -> float:
    """A float32 value written with the fewest digits that read back as it (Go's encoding of a
    ``float32``), as a Python float that ``json`` prints with those digits."""
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        text = f"{value:.{digits}g}"
        if struct.pack("<f", float(text)) == packed:
            return float(text)
    return value


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


def _unmarshal_error(
    value: object, where: str, go_type: str, *, literal: bool = False
) -> _ApiError:
    """Go's ``json.UnmarshalTypeError`` for ``value`` at ``Struct.field.path`` (HTTP 400);
    ``literal``: a number that does not fit an integer, which Go quotes."""
    kind = _json_type(value)
    if literal and kind == "number":
        kind = f"number {value!r}"
    return _ApiError(
        400, f"json: cannot unmarshal {kind} into Go struct field {where} of type {go_type}"
    )


def _field(
    body: dict[str, Any],
    key: str,
    kind: type | tuple[type, ...],
    struct: str,
    go_type: str | None = None,
    *,
    path: str | None = None,
) -> Any:
    """``body[key]`` if absent, null or of ``kind``; otherwise Go's unmarshal error (HTTP 400).

    ``struct`` and ``path`` name the field as Go does (``ChatRequest.messages.role``: the
    innermost struct decoded, then the path from the top). A JSON boolean fits only a ``bool``
    kind (Python would let it pass for an ``int``)."""
    value = body.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if value is None or (
        isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool))
    ):
        return value
    go_types = {str: "string", bool: "bool", dict: "map[string]interface {}", int: "int"}
    raise _unmarshal_error(
        value,
        f"{struct}.{path or key}",
        go_type or go_types.get(kinds[0], kinds[0].__name__),
        literal=kinds == (int,) and isinstance(value, float),
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


def _keep_alive(body: dict[str, Any]) -> int | None:
    """``keep_alive`` in nanoseconds as Ollama's ``api.Duration`` reads it (None: not given)."""
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _FOREVER_NS if value < 0 else int(value * 1_000_000_000)
    if isinstance(value, str):
        try:
            duration = _go_duration(value)
        except ValueError as exc:
            raise _ApiError(400, str(exc)) from None
        return _FOREVER_NS if duration < 0 else duration
    go_type = {"bool": "bool", "array": "[]interface {}", "object": "map[string]interface {}"}
    raise _ApiError(400, f"Unsupported type: '{go_type[_json_type(value)]}'")


def _check_options(options: dict[str, Any]) -> None:
    """Ollama's ``Options.FromMap``: unknown names ignored, wrong types refused (HTTP 500)."""
    for key, value in options.items():
        kind = _OPTION_KINDS.get(key)
        if kind is None or value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        problem = None
        if kind in ("integer", "float32") and not number:
            problem = f"of type {kind}"
        elif kind == "boolean" and not isinstance(value, bool):
            problem = "of type boolean"
        elif kind == "array":
            if not isinstance(value, list):
                problem = "of type array"
            elif not all(isinstance(item, str) for item in value):
                problem = "of an array of strings"
        if problem is not None:
            raise _ApiError(500, f"option {_go_quote(key)} must be {problem}")


def _num_ctx(options: dict[str, Any]) -> int:
    value = options.get("num_ctx")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return int(value)
    return _DEFAULT_NUM_CTX


def _format_error(value: object) -> str | None:
    """What Ollama's runner says of a ``format`` that is neither "json" nor a schema."""
    if value is None or value in ("", "json") or isinstance(value, dict):
        return None
    raw = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return f'invalid format: {_go_quote(raw)}; expected "json" or a valid JSON Schema object'


def _images(value: object, where: str) -> list[bytes]:
    """A list of base64 images (``[]api.ImageData``), decoded as Go's JSON decoder does."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise _unmarshal_error(value, where, "[]api.ImageData")
    images = []
    for item in value:
        if item is None:
            images.append(b"")
            continue
        if not isinstance(item, str):
            raise _unmarshal_error(item, where, "api.ImageData")
        try:
            images.append(_go_b64decode(item))
        except ValueError as exc:
            raise _ApiError(400, str(exc)) from None
    return images


def _tools(body: dict[str, Any], struct: str, go_type: str) -> list[dict[str, Any]]:
    """The ``tools`` of a request, type-checked as Go's decoder does (leniently inside)."""
    value = body.get("tools")
    if value is None:
        return []
    if not isinstance(value, list):
        raise _unmarshal_error(value, f"{struct}.tools", go_type)
    tools = []
    for item in value:
        if not isinstance(item, dict):
            raise _unmarshal_error(item, f"{struct}.tools", "api.Tool")
        _field(item, "type", str, "Tool", path="tools.type")
        function = _field(item, "function", dict, "Tool", "api.ToolFunction", path="tools.function")
        function = function or {}
        _field(function, "name", str, "ToolFunction", path="tools.function.name")
        _field(function, "description", str, "ToolFunction", path="tools.function.description")
        _field(
            function,
            "parameters",
            dict,
            "ToolFunction",
            "api.ToolFunctionParameters",
            path="tools.function.parameters",
        )
        tools.append(item)
    return tools


def _tool_name(tool: dict[str, Any]) -> str:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""


def _sorted_keys(value: Any) -> Any:
    """``value`` with its objects' keys sorted, as Go marshals a ``map[string]any``."""
    if isinstance(value, dict):
        return {key: _sorted_keys(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(item) for item in value]
    return value


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
    if name in ("delay_s", "load_ms", "chunk_delay_s", "pull_chunk_delay_s"):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(f"{name} must be a number >= 0")
        return float(value)
    if name == "fail_status":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
            raise ValueError("fail_status must be null or an HTTP status (100-599)")
        return value
    if name in _MODEL_LISTS:
        if isinstance(value, str) or not isinstance(value, list | tuple):
            raise ValueError(f"{name} must be a list of model names")
        if not all(isinstance(item, str) and item for item in value):
            raise ValueError(f"{name} must be a list of non-empty strings")
        return list(value)
    if name in ("error_after_chunks", "drop_after_chunks", "reset_after_chunks", "disk_free_bytes"):
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


# --------------------------------------------------------------------------- JSON schemas


def _is_null_schema(schema: object) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "null"


def _is_any_schema(schema: dict[str, Any]) -> bool:
    """A schema that constrains nothing (``{}``): Ollama's grammar then allows any JSON."""
    keys = ("type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf", "$ref")
    return not any(key in schema for key in keys)


class _Filler:
    """Builds a deterministic instance of a JSON schema (a ``format``, a tool's parameters).

    ``text`` fills strings, ``numbers`` (the numbers found in some text) fill numbers, and
    ``explicit`` (``name=value`` pairs from the prompt) wins for properties of that name.
    ``all_properties`` fills every property; otherwise only the required ones (all of them when
    an object requires none)."""

    def __init__(
        self,
        root: object,
        *,
        text: str,
        numbers: Sequence[str],
        explicit: dict[str, str],
        all_properties: bool,
    ) -> None:
        self.root = root
        self.text = text
        self.numbers = list(numbers)
        self.explicit = explicit
        self.all_properties = all_properties

    def instance(self) -> Any:
        return self._value(self.root, None, 0)

    def _resolve(self, ref: str) -> object:
        if not ref.startswith("#"):
            return None
        target: object = self.root
        for part in ref[1:].split("/")[1:] if ref != "#" else []:
            key = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and key in target:
                target = target[key]
            elif isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            else:
                return None
        return target

    def _flatten(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        """``schema`` with its ``$ref`` followed and its ``allOf`` merged in."""
        ref = schema.get("$ref")
        if isinstance(ref, str):
            target = self._resolve(ref)
            rest = {key: value for key, value in schema.items() if key != "$ref"}
            if isinstance(target, dict) and depth < 16:
                schema = {**self._flatten(target, depth + 1), **rest}
            else:
                schema = rest
        parts = schema.get("allOf")
        if isinstance(parts, list):
            merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
            for part in parts:
                if not isinstance(part, dict):
                    continue
                for key, value in self._flatten(part, depth + 1).items():
                    if key == "properties" and isinstance(value, dict):
                        merged["properties"] = {**merged.get("properties", {}), **value}
                    elif key == "required" and isinstance(value, list):
                        merged["required"] = [*merged.get("required", []), *value]
                    else:
                        merged.setdefault(key, value)
            schema = merged
        return schema

    def _value(self, schema: object, key: str | None, depth: int) -> Any:
        if depth > 24 or not isinstance(schema, dict):
            return self.text  # `true` or a schema Ollama would not constrain
        schema = self._flatten(schema, depth)
        if "const" in schema:
            return schema["const"]
        explicit = self.explicit.get(key) if key is not None else None
        enum = schema.get("enum")
        if isinstance(enum, list) and enum:
            for option in enum:
                if explicit is not None and explicit in (option, json.dumps(option)):
                    return option
            return enum[0]
        for keyword in ("anyOf", "oneOf"):
            options = schema.get(keyword)
            if isinstance(options, list) and options:
                chosen = next((o for o in options if not _is_null_schema(o)), options[0])
                rest = {k: v for k, v in schema.items() if k != keyword}
                merged = {**rest, **chosen} if isinstance(chosen, dict) else rest
                return self._value(merged, key, depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "null" if kind else None)
        if not isinstance(kind, str):
            if "properties" in schema or "required" in schema:
                kind = "object"
            elif "items" in schema or "prefixItems" in schema:
                kind = "array"
            else:
                kind = "string"
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind in ("integer", "number"):
            return self._number(schema, explicit, integer=kind == "integer")
        if kind == "boolean":
            return explicit is None or explicit.lower() not in ("false", "no", "0", "off")
        if kind == "null":
            return None
        return self._string(schema, explicit)

    def _object(self, schema: dict[str, Any], depth: int) -> dict[str, Any]:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        required = schema.get("required")
        required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
        names = [n for n in properties if n in required] + [
            n for n in properties if n not in required
        ]
        if not self.all_properties and required:
            names = [n for n in names if n in required]
        result = {name: self._value(properties[name], name, depth + 1) for name in names}
        for name in required:
            result.setdefault(name, self.explicit.get(name, self.text))
        return result

    def _array(self, schema: dict[str, Any], depth: int) -> list[Any]:
        low, high = schema.get("minItems"), schema.get("maxItems")
        count = max(1, low) if isinstance(low, int) else 1
        if isinstance(high, int):
            count = min(count, max(high, 0))
        prefix = schema.get("prefixItems")
        items = schema.get("items")
        values = []
        if isinstance(prefix, list):
            values = [self._value(part, None, depth + 1) for part in prefix[:count]]
        while len(values) < count:
            values.append(self._value(items, None, depth + 1))
        return values

    def _number(self, schema: dict[str, Any], explicit: str | None, *, integer: bool) -> Any:
        value: float | None = None
        if explicit is not None:
            with suppress(ValueError):
                value = float(explicit)
        if value is None:
            value = float(self.numbers[0]) if self.numbers else 0.0
        step = 1.0 if integer else 0.5
        low, high = schema.get("minimum"), schema.get("maximum")
        above, below = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(above, int | float) and not isinstance(above, bool) and value <= above:
            value = above + step
        if isinstance(low, int | float) and not isinstance(low, bool) and value < low:
            value = float(low)
        if isinstance(below, int | float) and not isinstance(below, bool) and value >= below:
            value = below - step
        if isinstance(high, int | float) and not isinstance(high, bool) and value > high:
            value = float(high)
        if integer:
            return math.ceil(value) if isinstance(low, int | float) else int(value)
        return int(value) if value.is_integer() else value

    def _string(self, schema: dict[str, Any], explicit: str | None) -> str:
        if explicit is not None:
            text = explicit
        else:
            kind = schema.get("format")
            text = _STRING_FORMATS.get(kind, self.text) if isinstance(kind, str) else self.text
        low, high = schema.get("minLength"), schema.get("maxLength")
        if isinstance(low, int) and len(text) < low:
            text += "x" * (low - len(text))
        if isinstance(high, int) and high >= 0:
            text = text[:high]
        return text


def _explicit_values(prompt: str) -> dict[str, str]:
    """The ``name=value`` pairs written in a prompt (the first of each name)."""
    values: dict[str, str] = {}
    for match in _EXPLICIT.finditer(prompt):
        name = match.group(1)
        value = match.group(2)
        if value is None:
            value = match.group(3)
        if value is None:
            value = match.group(4).rstrip(".!?)")
        values.setdefault(name, value)
    return values


def _tool_call(index: int, tool: dict[str, Any], prompt: str) -> dict[str, Any]:
    """One call of ``tool`` (Ollama 0.12's native shape: ``index`` left out when 0)."""
    function = tool.get("function") or {}
    parameters = function.get("parameters") if isinstance(function, dict) else None
    quoted = _QUOTED.search(prompt)
    text = next(g for g in quoted.groups() if g) if quoted else prompt.strip()[:200]
    filler = _Filler(
        parameters if isinstance(parameters, dict) else {"type": "object"},
        text=text,
        numbers=_NUMBER.findall(prompt),
        explicit=_explicit_values(prompt),
        all_properties=False,
    )
    arguments = filler.instance()
    call: dict[str, Any] = {
        "name": _tool_name(tool),
        "arguments": _sorted_keys(arguments if isinstance(arguments, dict) else {}),
    }
    return {"function": {"index": index, **call} if index else call}


def _structured(format_: object, answer: str, prompt: str) -> str | None:
    """The content for a ``format`` ("json" or a schema), or None when there is none;
    numbers come from ``prompt``, ``name=value`` pairs too."""
    if format_ == "json" or (isinstance(format_, dict) and _is_any_schema(format_)):
        return json.dumps({"response": answer}, ensure_ascii=False)
    if not isinstance(format_, dict):
        return None
    filler = _Filler(
        format_,
        text=answer,
        numbers=_NUMBER.findall(prompt),
        explicit=_explicit_values(prompt),
        all_properties=True,
    )
    return json.dumps(filler.instance(), ensure_ascii=False)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class _Msg:
    """A chat message as Ollama's ``api.Message`` holds it."""

    role: str
    content: str
    images: tuple[bytes, ...] = ()
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_name: str = ""
    group: int = 0  # the OpenAI message it came from (one message may give several)


def _chat_prompt(messages: Sequence[_Msg]) -> tuple[str, int]:
    """The text a chat answers (the last user message) and the prompt's token count."""
    users = [m for m in messages if m.role == "user"]
    if users:
        last = users[-1]
        parts = [m.content for m in messages if m.group == last.group and m.role == "user"]
        prompt = "\n".join(part for part in parts if part)
    else:
        prompt = messages[-1].content if messages else ""
    return prompt, sum(_count_tokens(m.content) + 4 for m in messages)


def _tool_results(messages: Sequence[_Msg]) -> tuple[tuple[str, str], ...]:
    """The trailing ``role: "tool"`` messages of a chat, as (tool name, content)."""
    results: list[tuple[str, str]] = []
    for message in reversed(messages):
        if message.role != "tool":
            break
        results.append((message.tool_name, message.content))
    return tuple(reversed(results))


@dataclass(frozen=True)
class _Knobs:
    """A snapshot of the behaviour knobs, taken once per request."""

    delay_s: float
    fail_status: int | None
    chunk_delay_s: float
    error_after_chunks: int | None
    drop_after_chunks: int | None
    reset_after_chunks: int | None = None


_PLAIN_KNOBS = _Knobs(0.0, None, 0.0, None, None)


@dataclass(frozen=True)
class _Ask:
    """One generation request, whichever API (Ollama's own or OpenAI's) it came through."""

    model: str
    prompt: str
    prompt_tokens: int
    empty: bool  # nothing to answer: Ollama just loads the model
    think: bool | str | None
    num_predict: object  # as given; only a positive number limits the answer
    stream: bool
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    tools: tuple[dict[str, Any], ...] = ()
    format: object = None  # "json", a schema, or anything else (refused when the model runs)
    images: tuple[bytes, ...] = ()
    tool_results: tuple[tuple[str, str], ...] = ()
    suffix: str = ""
    keep_alive_ns: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- the fake


class FakeOllama:
    """An Ollama look-alike serving real HTTP on ``host:port`` (port 0: pick a free one).

    Knobs (plain attributes, also settable with ``configure()`` or ``POST /_fake/config``);
    they steer ``/v1/chat/completions`` and ``/v1/completions`` just as they do ``/api/chat``:

    - ``delay_s``: seconds to wait before answering ``/api/generate``, ``/api/chat`` and the
      embedding endpoints;
    - ``fail_status``: answer those with this HTTP status and an ``{"error": ...}`` body
      (in OpenAI's shape, type ``api_error``, on ``/v1``);
    - ``models``: the models served (``/api/tags``; others get 404);
    - ``thinking_models``: served models that think (``thinking`` apart from the answer);
    - ``tool_models``: served models that take ``tools``;
    - ``vision_models``: served models that look at images;
    - ``embedding_models``: served models that only embed (capabilities ``["embedding"]``);
    - ``insert_models``: served models that take a ``suffix`` (fill in the middle);
    - ``load_ms``: ``load_duration`` reported on the first call of each model (cold start);
    - ``chunk_delay_s``: seconds between streamed chunks;
    - ``error_after_chunks``: after N streamed pieces, send Ollama's mid-stream
      ``{"error": ...}`` line and end the stream (no ``done`` line); on ``/v1`` an SSE event
      ``data: {"error": {...}}`` and the end, with no ``finish_reason`` and no ``[DONE]``;
    - ``drop_after_chunks``: after N streamed pieces, cut the connection (a crash);
    - ``reset_after_chunks``: after N streamed pieces, reset the connection (a TCP RST, as
      a client sees a server process that died with the request unread, or a proxy that
      gave up); 0: before any answer, once the request is read. Embedding requests, which
      are not streamed, are reset before any answer whatever N;
    - ``replies``: ``{substring: answer}``; a prompt containing a substring gets that answer
      (the first that matches, in order) instead of the usual one: a judge's verdict, say;
    - ``registry``: the models ``/api/pull`` finds (others: ``pull model manifest: file does
      not exist``), ``DEFAULT_REGISTRY`` by default; a pull serves the build named by ``copy``;
    - ``pull_chunk_delay_s``: seconds between the progress lines of ``/api/pull`` and
      ``/api/create`` (not streamed: the time they take all the same);
    - ``disk_free_bytes``: the free disk, None (the default) for no limit; a pull takes the
      blobs' bytes from it, a delete gives back those of the blobs no other model uses, and a
      blob that does not fit fails its pull with Ollama's ``write <blob>-partial: no space left
      on device`` once its progress reached the free bytes.

    A model's size, digest and details (``/api/tags``) are its manifest's, as Ollama's: the
    weights' blob is ``_size`` of the name less its template and config blobs.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        models: Iterable[str] = DEFAULT_MODELS,
        *,
        thinking_models: Iterable[str] = DEFAULT_THINKING_MODELS,
        tool_models: Iterable[str] = DEFAULT_TOOL_MODELS,
        vision_models: Iterable[str] = DEFAULT_VISION_MODELS,
        embedding_models: Iterable[str] = DEFAULT_EMBEDDING_MODELS,
        insert_models: Iterable[str] = DEFAULT_INSERT_MODELS,
        registry: Iterable[str] = DEFAULT_REGISTRY,
        delay_s: float = 0.0,
        fail_status: int | None = None,
        load_ms: float = 0.0,
        replies: dict[str, str] | None = None,
        copy: str = "",
    ) -> None:
        self.host = host
        self.port = port
        self.copy = copy
        """Which build of its models this server holds: another ``copy`` lists other digests
        under the same names (a model pulled at another time, or created from a Modelfile)."""
        self._defaults: dict[str, Any] = {
            "delay_s": _check_knob("delay_s", delay_s),
            "fail_status": _check_knob("fail_status", fail_status),
            "models": _check_knob("models", list(models)),
            "thinking_models": _check_knob("thinking_models", list(thinking_models)),
            "tool_models": _check_knob("tool_models", list(tool_models)),
            "vision_models": _check_knob("vision_models", list(vision_models)),
            "embedding_models": _check_knob("embedding_models", list(embedding_models)),
            "insert_models": _check_knob("insert_models", list(insert_models)),
            "load_ms": _check_knob("load_ms", load_ms),
            "chunk_delay_s": 0.0,
            "error_after_chunks": None,
            "drop_after_chunks": None,
            "reset_after_chunks": None,
            "replies": _check_knob("replies", dict(replies or {})),
            "registry": _check_knob("registry", list(registry)),
            "pull_chunk_delay_s": 0.0,
            "disk_free_bytes": None,
        }
        self.delay_s: float = 0.0
        self.fail_status: int | None = None
        self.models: list[str] = []
        self.thinking_models: list[str] = []
        self.tool_models: list[str] = []
        self.vision_models: list[str] = []
        self.embedding_models: list[str] = []
        self.insert_models: list[str] = []
        self.load_ms: float = 0.0
        self.chunk_delay_s: float = 0.0
        self.error_after_chunks: int | None = None
        self.drop_after_chunks: int | None = None
        self.reset_after_chunks: int | None = None
        self.replies: dict[str, str] = {}
        self.registry: list[str] = []
        self.pull_chunk_delay_s: float = 0.0
        self.disk_free_bytes: int | None = None
        self._lock = threading.Lock()
        self._generate_calls = 0
        self._chat_calls = 0
        self._openai_calls = 0
        self._embed_calls = 0
        self._in_flight = 0
        self._concurrent_max = 0
        self._connections_opened = 0
        self._cancelled_calls = 0
        self._last_images = 0
        self._last: dict[str, Any] = dict.fromkeys(_LAST)
        # Every call's time in flight, wall clock, by call number: (api, started_at, ended_at
        # or None while it runs, the prompt once read).
        self._calls: dict[int, tuple[str, float, float | None, str | None]] = {}
        self._call_numbers = itertools.count()
        # The call each handler thread is serving (a connection's requests come one by one).
        self._serving = threading.local()
        # normalized name -> (expiry as time.time_ns(), num_ctx)
        self._loaded: dict[str, tuple[int, int]] = {}
        self._connections: set[socket.socket] = set()
        self._handler_threads: set[threading.Thread] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        from devtools.fakes.ollama_models import ModelShelf  # it builds on this module

        self._models = ModelShelf(self)  # the models pulled, created and copied
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
                "embed_calls": self._embed_calls,
                "concurrent_max": self._concurrent_max,
                "in_flight": self._in_flight,
                "connections": self._connections_opened,
                "cancelled": self._cancelled_calls,
                "last_images": self._last_images,
            }

    def calls(self) -> list[dict[str, Any]]:
        """Every call since the last reset, in the order they began: ``api``, ``started_at``
        and ``ended_at`` (wall-clock seconds; None while it runs), and ``prompt`` (what a
        generation answers; None for a call refused before its body was read), so that tests
        on several stand-ins, in several processes, can tell whether two generations of one
        prompt overlapped."""
        with self._lock:
            return [
                {"api": api, "started_at": started, "ended_at": ended, "prompt": prompt}
                for api, started, ended, prompt in self._calls.values()
            ]

    def last(self, api: str | None = None) -> Any:
        """The last request body each API received, as parsed (None before the first):
        ``{"last_chat", "last_generate", "last_embed", "last_embeddings", "last_openai"}``, or,
        given ``api`` (``"chat"`` or ``"last_chat"``, ...), that API's body alone."""
        with self._lock:
            if api is None:
                return copy.deepcopy(self._last)
            key = api if api.startswith("last_") else f"last_{api}"
            if key not in self._last:
                raise KeyError(f"unknown API {api!r}; known: {', '.join(self._last)}")
            return copy.deepcopy(self._last[key])

    def reset(self) -> None:
        """Zero the counters, forget loaded models, the last bodies and the models pulled,
        created or copied, restore the knobs given at construction."""
        with self._lock:
            self._generate_calls = 0
            self._chat_calls = 0
            self._openai_calls = 0
            self._embed_calls = 0
            self._concurrent_max = self._in_flight
            self._connections_opened = 0
            self._cancelled_calls = 0
            self._last_images = 0
            self._last = dict.fromkeys(_LAST)
            self._calls = {n: call for n, call in self._calls.items() if call[2] is None}
            self._loaded.clear()
        self._models.clear()
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
            reset_after_chunks=self.reset_after_chunks,
        )

    # ---------------------------------------------------------------- used by the handler

    def _remember(self, api: str, body: dict[str, Any]) -> None:
        with self._lock:
            self._last[api] = copy.deepcopy(body)

    def _saw_images(self, count: int) -> None:
        with self._lock:
            self._last_images = count

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

    def _served_name(self, normalized: str) -> str:
        """The name the model is served under (the case Ollama's manifests have)."""
        for model in list(self.models):
            if _normalize(model) == normalized:
                return model
        return normalized

    def _listed(self, knob: str, normalized: str) -> bool:
        return normalized in {_normalize(model) for model in list(getattr(self, knob))}

    def _thinks(self, normalized: str) -> bool:
        return self._listed("thinking_models", normalized)

    def _embeds_only(self, normalized: str) -> bool:
        return self._listed("embedding_models", normalized)

    def _capabilities(self, normalized: str) -> list[str]:
        """``/api/show``'s capabilities, in Ollama's order."""
        if self._embeds_only(normalized):
            return ["embedding"]
        capabilities = ["completion"]
        for knob, capability in (
            ("vision_models", "vision"),
            ("tool_models", "tools"),
            ("insert_models", "insert"),
            ("thinking_models", "thinking"),
        ):
            if self._listed(knob, normalized):
                capabilities.append(capability)
        return capabilities

    def _context_length(self, normalized: str) -> int:
        return _EMBEDDING_CONTEXT if self._embeds_only(normalized) else _CHAT_CONTEXT

    def _load(self, normalized: str, keep_alive_ns: int | None = None, num_ctx: int = 0) -> int:
        """Mark the model loaded for ``keep_alive_ns`` (default five minutes) with ``num_ctx``;
        the ``load_duration`` (ns) to report for this call: ``load_ms`` when it was not loaded
        or loaded with another context size."""
        now = time.time_ns()
        duration = _KEEP_ALIVE_NS if keep_alive_ns is None else keep_alive_ns
        num_ctx = min(num_ctx or _DEFAULT_NUM_CTX, self._context_length(normalized))
        with self._lock:
            entry = self._loaded.get(normalized)
            cold = entry is None or entry[0] <= now or entry[1] != num_ctx
            self._loaded[normalized] = (min(now + duration, now + _FOREVER_NS), num_ctx)
        return int(self.load_ms * _NS_PER_MS) if cold else 0

    def _unload(self, normalized: str) -> None:
        with self._lock:
            self._loaded.pop(normalized, None)

    def _loaded_models(self) -> dict[str, tuple[int, int]]:
        """The models loaded now: normalized name -> (expiry in ns, num_ctx)."""
        now = time.time_ns()
        with self._lock:
            return {name: entry for name, entry in self._loaded.items() if entry[0] > now}

    def _cancelled(self) -> None:
        with self._lock:
            self._cancelled_calls += 1

    @contextmanager
    def _track(self, api: str) -> Iterator[Callable[[], None]]:
        """Count one call of ``api`` (``generate``, ``chat``, ``openai`` or ``embed``) while it
        runs; a model-management call (``pull``, ``create``, ``copy``, ``delete``) is only
        listed by `calls`.

        Yields ``release``, which ends the call's time in flight; the handler calls it
        just before the last bytes of the answer go out, so that a client holding the whole
        answer never sees the generation still in flight (one-at-a-time checks would otherwise
        race the handler thread). Leaving the block releases it too.
        """
        runs = int(api in ("generate", "chat", "openai", "embed"))  # a model at work
        with self._lock:
            if api == "chat":
                self._chat_calls += 1
            elif api == "openai":
                self._openai_calls += 1
            elif api == "embed":
                self._embed_calls += 1
            elif api == "generate":
                self._generate_calls += 1
            self._in_flight += runs
            self._concurrent_max = max(self._concurrent_max, self._in_flight)
            number = next(self._call_numbers)
            self._calls[number] = (api, time.time(), None, None)
        self._serving.number = number
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._in_flight -= runs
                    if number in self._calls:
                        _, started, _, prompt = self._calls[number]
                        self._calls[number] = (api, started, time.time(), prompt)

        try:
            yield release
        finally:
            release()

    def _asked(self, prompt: str) -> None:
        """Note the prompt of the call this thread is serving (`calls`)."""
        number = getattr(self._serving, "number", None)
        with self._lock:
            if number in self._calls:
                api, started, ended, _ = self._calls[number]
                self._calls[number] = (api, started, ended, prompt)

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


def _ndjson(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def _sse(payload: dict[str, Any] | str) -> bytes:
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def _timestamp(ns: int) -> str:
    """A Go ``time.Time`` in UTC as its JSON encoder writes it (RFC 3339 with nanoseconds,
    trailing zeros trimmed, no fraction at all when it is zero)."""
    seconds, fraction = divmod(ns, 1_000_000_000)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    digits = f"{fraction:09d}".rstrip("0")
    return f"{stamp}.{digits}Z" if digits else f"{stamp}Z"


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
        elif method == "POST" and path == "/api/embed":
            self._embed(raw)
        elif method == "POST" and path == "/api/embeddings":
            self._legacy_embeddings(raw)
        elif method == "POST" and path == "/api/show":
            self._show(raw)
        elif (method, path) in _MODEL_MANAGEMENT:
            self._manage(path.removeprefix("/api/"), raw)
        elif method == "GET" and path == "/v1/models":
            self._send_openai_json(200, self._openai_models())
        elif method == "GET" and path.startswith("/v1/models/"):
            self._openai_retrieve(unquote(path.removeprefix("/v1/models/")))
        elif method == "POST" and path == "/v1/chat/completions":
            self._openai_generation(raw, chat=True)
        elif method == "POST" and path == "/v1/completions":
            self._openai_generation(raw, chat=False)
        elif method == "POST" and path == "/v1/embeddings":
            self._openai_embeddings(raw)
        elif method == "GET" and path == "/_fake/stats":
            self._send_json(200, self._fake.stats())
        elif method == "GET" and path == "/_fake/calls":
            self._send_json(200, {"calls": self._fake.calls()})
        elif method == "GET" and path == "/_fake/last":
            self._send_json(200, self._fake.last())
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

    def _send_bytes(self, status: int, data: bytes, content_type: str | None) -> None:
        self.send_response(status)
        if content_type is not None:  # None: Go's answer when a handler writes no body
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
        return self._fake._models.entry(name)

    def _tags(self) -> dict[str, Any]:
        return {"models": [self._model_entry(name) for name in list(self._fake.models)]}

    def _ps(self) -> dict[str, Any]:
        served = {_normalize(name): name for name in list(self._fake.models)}
        running = []
        loaded = self._fake._loaded_models()
        # Ollama lists the model with the longest time left first.
        for normalized, (expires_ns, num_ctx) in sorted(
            loaded.items(), key=lambda item: -item[1][0]
        ):
            name = served.get(normalized)
            if name is None:
                continue
            entry = self._model_entry(name)
            del entry["modified_at"]
            entry["expires_at"] = _timestamp(expires_ns)
            # What the loaded model takes: its file and the cache of its context, all of it
            # in (V)RAM here: Ollama's estimate, which is more than the file /api/tags sizes.
            entry["size"] += _context_bytes(self._fake._models.weights(normalized), num_ctx)
            entry["size_vram"] = entry["size"]
            entry["context_length"] = num_ctx
            running.append(entry)
        return {"models": running}

    def _show(self, raw: bytes) -> None:
        body = _parse_object(raw)
        name = _field(body, "model", str, "ShowRequest") or _field(body, "name", str, "ShowRequest")
        if not name:
            raise _ApiError(400, "model is required")
        fake = self._fake
        normalized = fake._find(name)
        if normalized is None:
            raise _ApiError(404, f"model '{name}' not found")
        weights = fake._models.weights(normalized)  # a created model's are its base's
        details = _details(weights)
        family = details["family"]
        capabilities = fake._capabilities(normalized)
        embedding_only = capabilities == ["embedding"]
        model_info: dict[str, Any] = {
            "general.architecture": family,
            "general.parameter_count": _parameter_count(weights),
            f"{family}.context_length": fake._context_length(normalized),
            f"{family}.embedding_length": _embedding_length(weights, embedding_only),
        }
        if embedding_only:
            model_info[f"{family}.pooling_type"] = 1
        template = "{{ .Prompt }}"
        if "tools" in capabilities:
            template = "{{- if .Tools }}{{ .Tools }}{{ end }}" + template
        if "insert" in capabilities:
            template = "{{- if .Suffix }}<fim_prefix>{{ .Prompt }}<fim_suffix>{{ .Suffix }}"
            template += "<fim_middle>{{- else }}{{ .Prompt }}{{- end }}"
        if "thinking" in capabilities:
            template += "{{ if .Think }}<think>{{ end }}"
        reply: dict[str, Any] = {
            "template": template,
            "details": details,
            "model_info": model_info,
        }
        if "vision" in capabilities:
            reply["projector_info"] = {
                "general.architecture": "clip",
                "clip.has_vision_encoder": True,
                "clip.vision.image_size": 896,
            }
        reply["capabilities"] = capabilities
        # Its Modelfile, parameters, system prompt, ... and modified_at: what its layers say.
        self._send_json(200, fake._models.shown(normalized, reply))

    def _manage(self, api: str, raw: bytes) -> None:
        """``/api/pull``, ``/api/create``, ``/api/copy``, ``/api/delete`` (`ollama_models`).

        Copy and delete answer 200 with no body. Pull and create stream their progress,
        ``pull_chunk_delay_s`` apart; not streamed, they answer (``application/json``, as
        Ollama's ``waitForStream``) the last progress object, or the first error with its
        status (500 unless it has one)."""
        fake = self._fake
        with fake._track(api) as self._release:
            progress = fake._models.answer(api, _parse_object(raw))
            knobs = _Knobs(0.0, None, fake.pull_chunk_delay_s, None, None)
            if progress is None:
                self._send_bytes(200, b"", None)
            elif progress.stream:
                lines = (_ndjson(event) for event in progress.events)
                self._send_stream("application/x-ndjson", lines, lambda: [], b"", knobs)
            else:
                status, latest = 200, {}
                for sent, event in enumerate(progress.events):
                    if sent and not self._pause(knobs.chunk_delay_s):
                        self.close_connection = True
                        return
                    if "error" in event:
                        status, latest = event.get("status", 500), {"error": event["error"]}
                        break
                    status, latest = 200, event
                data = json.dumps(latest, ensure_ascii=False, separators=(",", ":")).encode()
                self._send_bytes(status, data, "application/json")

    # ---------------------------------------------------------------- generation

    def _generation(self, raw: bytes, *, chat: bool) -> None:
        started = time.monotonic_ns()
        with self._fake._track("chat" if chat else "generate") as self._release:
            ask = self._native_ask(raw, chat=chat)
            self._fake._asked(ask.prompt)
            prepared = self._prepare(ask, chat=chat, started_ns=started)
            if prepared is None:
                return
            plan, knobs = prepared
            if ask.empty:
                # An empty prompt (or no messages) just loads (or, keep_alive 0, unloads).
                self._send_json(200, self._load_reply(ask.model, chat, plan.done_reason))
            elif plan.format_error is not None:
                # The runner refuses the format: after a 200 when streaming, as Ollama does.
                if not ask.stream:
                    raise _ApiError(500, plan.format_error)
                error = _ndjson({"error": plan.format_error})
                self._send_stream(
                    "application/x-ndjson", iter(()), lambda: [error], error, _PLAIN_KNOBS
                )
            elif ask.stream:
                self._stream(plan, knobs)
            else:
                self._send_json(200, plan.whole())

    def _native_ask(self, raw: bytes, *, chat: bool) -> _Ask:
        """Read an ``/api/generate`` or ``/api/chat`` body."""
        body = _parse_object(raw)
        self._fake._remember("last_chat" if chat else "last_generate", body)
        struct = self._go_structs[chat]
        model: str = _field(body, "model", str, struct) or ""
        stream_field: bool | None = _field(body, "stream", bool, struct)
        options: dict[str, Any] = _field(body, "options", dict, struct) or {}
        options = self._fake._models.options(model, options)  # over the model's parameters
        think = body.get("think")
        if think is not None and not isinstance(think, bool | str):
            raise _ApiError(400, 'think must be a boolean or string ("high", "medium", "low")')
        if isinstance(think, str) and think not in ("high", "medium", "low"):
            raise _ApiError(
                400,
                f"invalid think value: {_go_quote(think)} "
                '(must be "high", "medium", "low", true, or false)',
            )
        keep_alive = _keep_alive(body)
        tools: list[dict[str, Any]] = []
        tool_results: tuple[tuple[str, str], ...] = ()
        suffix = ""
        if chat:
            messages = self._messages(body)
            tools = _tools(body, struct, "api.Tools")
            prompt, prompt_tokens = _chat_prompt(self._fake._models.chat_messages(model, messages))
            if tools:
                prompt_tokens += _count_tokens(json.dumps(tools))
            empty = not messages
            images = [image for message in messages for image in message.images]
            tool_results = _tool_results(messages)
        else:
            prompt = _field(body, "prompt", str, struct) or ""
            system = _field(body, "system", str, struct) or self._fake._models.system(model)
            suffix = _field(body, "suffix", str, struct) or ""
            images = _images(body.get("images"), f"{struct}.images")
            prompt_tokens = _count_tokens(system) + _count_tokens(prompt) + 4
            empty = prompt == ""
        self._fake._saw_images(len(images))
        return _Ask(
            model=model,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            empty=empty,
            think=think,
            num_predict=options.get("num_predict"),
            stream=True if stream_field is None else stream_field,
            tools=tuple(tools),
            format=body.get("format"),
            images=tuple(images),
            tool_results=tool_results,
            suffix=suffix,
            keep_alive_ns=keep_alive,
            options=options,
        )

    def _prepare(self, ask: _Ask, *, chat: bool, started_ns: int) -> tuple[_Plan, _Knobs] | None:
        """Ollama's chat or generate handler, whichever API asked: check the model, ``think``,
        the capabilities and the options, apply the knobs, plan the answer. None if the client
        hung up (or ``stop()`` was called) during ``delay_s``; the connection is then closed."""
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
        knobs = fake._knobs()

        def plan(done_reason: str, **answer: Any) -> _Plan:
            return _Plan(
                model=model,
                chat=chat,
                done_reason=done_reason,
                prompt_eval_count=0 if ask.empty else ask.prompt_tokens,
                started_ns=started_ns,
                **answer,
            )

        if ask.empty and ask.keep_alive_ns == 0:
            fake._unload(normalized)  # Ollama expires the runner before anything else
            return plan("unload"), knobs
        think = ask.think
        if fake._thinks(normalized):
            if isinstance(think, str) and not normalized.startswith("gpt-oss"):
                raise _ApiError(
                    400, f"think value {json.dumps(think)} is not supported for this model"
                )
            think_on = think is None or bool(think)
        else:
            if think:
                raise _ApiError(400, f"{_go_quote(model)} does not support thinking")
            think_on = False
        capabilities = fake._capabilities(normalized)
        if "completion" not in capabilities:
            raise _ApiError(
                400, f"{_go_quote(model)} does not support {'chat' if chat else 'generate'}"
            )
        missing = []
        if chat and ask.tools and "tools" not in capabilities:
            missing.append("tools")
        if not chat and ask.suffix and "insert" not in capabilities:
            missing.append("insert")
        if missing:
            # Go's errors.Join puts a newline between several missing capabilities.
            full = _full_name(fake._served_name(normalized))
            raise _ApiError(400, f"{full} does not support " + "\n".join(missing))
        _check_options(ask.options)

        if not self._pause(knobs.delay_s):
            self.close_connection = True
            return None
        if knobs.reset_after_chunks == 0:
            self._reset()
            return None
        if knobs.fail_status is not None:
            status = knobs.fail_status
            message = _FAILURE_MESSAGES.get(status) or _phrase(status)
            raise _ApiError(status, message)

        load_ns = fake._load(normalized, ask.keep_alive_ns, _num_ctx(ask.options))
        if ask.empty:
            return plan("load", load_ns=load_ns), knobs
        format_error = _format_error(ask.format)
        if format_error is not None:
            return plan("stop", load_ns=load_ns, format_error=format_error), knobs

        tool_calls: list[dict[str, Any]] = []
        if ask.tool_results:
            said = "\n".join(content for _, content in ask.tool_results)
            answer = fake._reply(said) or _tool_result_answer(ask.tool_results)
        else:
            reply = fake._reply(ask.prompt)
            if ask.tools:
                mentioned = (reply if reply is not None else ask.prompt).lower()
                chosen = [
                    tool
                    for tool in ask.tools
                    if _tool_name(tool) and _tool_name(tool).lower() in mentioned
                ]
                tool_calls = [_tool_call(i, tool, ask.prompt) for i, tool in enumerate(chosen)]
            if reply is not None:
                answer = reply
            else:
                answer = _answer(model, ask.prompt)
                if ask.images and "vision" in capabilities:
                    answer = f"{answer} {_image_note(ask.images)}"
        said = answer.removeprefix(f"Echo from {model}: ")  # its numbers, not the model's
        structured = _structured(ask.format, answer, said + "\n" + ask.prompt)
        content = "" if tool_calls else (structured or answer)
        thinking_pieces = _pieces(_thinking(ask.prompt, answer)) if think_on else []
        response_pieces = _pieces(content)
        done_reason = "stop"
        limit = ask.num_predict
        if isinstance(limit, float) and not isinstance(limit, bool):
            limit = int(limit)
        wanted = len(thinking_pieces) + len(response_pieces)
        if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < wanted:
            done_reason = "length"
            thinking_pieces = thinking_pieces[:limit]
            response_pieces = response_pieces[: limit - len(thinking_pieces)]
        tool_tokens = sum(len(_pieces(json.dumps(call["function"]))) for call in tool_calls)
        return plan(
            done_reason,
            thinking_pieces=thinking_pieces,
            response_pieces=response_pieces,
            tool_calls=tool_calls,
            tool_tokens=tool_tokens,
            load_ns=load_ns,
        ), knobs

    def _messages(self, body: dict[str, Any]) -> list[_Msg]:
        """``/api/chat`` messages, read as ``api.Message`` (whose own UnmarshalJSON lowers the
        role, and makes Go name a bad field ``ChatRequest.messages.<field>``)."""
        raw = _field(body, "messages", list, "ChatRequest", "[]api.Message") or []
        messages: list[_Msg] = []
        for index, item in enumerate(raw):
            if not isinstance(item, dict):
                raise _unmarshal_error(item, "ChatRequest.messages", "api.Message")

            def text(key: str, item: dict[str, Any] = item) -> str:
                value = _field(item, key, str, "ChatRequest", path=f"messages.{key}")
                return value or ""

            role = text("role").lower()
            content = text("content")
            text("thinking")
            images = _images(item.get("images"), "ChatRequest.messages.images")
            messages.append(
                _Msg(
                    role=role,
                    content=content,
                    images=tuple(images),
                    tool_calls=tuple(self._native_tool_calls(item)),
                    tool_name=text("tool_name"),
                    group=index,
                )
            )
        return messages

    def _native_tool_calls(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        where = "ChatRequest.messages.tool_calls"
        value = item.get("tool_calls")
        if value is None:
            return []
        if not isinstance(value, list):
            raise _unmarshal_error(value, where, "[]api.ToolCall")
        calls = []
        for call in value:
            if not isinstance(call, dict):
                raise _unmarshal_error(call, where, "api.ToolCall")
            function = call.get("function")
            if function is not None and not isinstance(function, dict):
                raise _unmarshal_error(function, f"{where}.function", "api.ToolCallFunction")
            function = function or {}
            name = function.get("name")
            if name is not None and not isinstance(name, str):
                raise _unmarshal_error(name, f"{where}.function.name", "string")
            arguments = function.get("arguments")
            if arguments is not None and not isinstance(arguments, dict):
                raise _unmarshal_error(
                    arguments, f"{where}.function.arguments", "api.ToolCallFunctionArguments"
                )
            calls.append({"function": {"name": name or "", "arguments": arguments or {}}})
        return calls

    def _load_reply(self, model: str, chat: bool, done_reason: str) -> dict[str, Any]:
        reply: dict[str, Any] = {"model": model, "created_at": _now()}
        if chat:
            reply["message"] = {"role": "assistant", "content": ""}
        else:
            reply["response"] = ""
        reply["done"] = True
        reply["done_reason"] = done_reason
        return reply

    def _stream(self, plan: _Plan, knobs: _Knobs) -> None:
        """Stream ``plan`` as Ollama's NDJSON."""
        self._send_stream(
            "application/x-ndjson",
            (_ndjson(payload) for payload in plan.chunks()),
            lambda: [_ndjson(plan.final())],
            _ndjson({"error": _FAILURE_MESSAGES[500]}),
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
        writes, each in its own HTTP chunk, ``chunk_delay_s`` apart; ``error_after_chunks``,
        ``drop_after_chunks`` and ``reset_after_chunks`` cut it short, with ``error``, with a
        dropped connection or with a reset one."""
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
            if knobs.reset_after_chunks is not None and (last or sent >= knobs.reset_after_chunks):
                self._reset()
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

    # ---------------------------------------------------------------- embeddings

    def _embed(self, raw: bytes) -> None:
        """``POST /api/embed``: ``input`` a string or a list of strings."""
        started = time.monotonic_ns()
        with self._fake._track("embed") as self._release:
            body = _parse_object(raw)
            self._fake._remember("last_embed", body)
            model: str = _field(body, "model", str, "EmbedRequest") or ""
            truncate: bool | None = _field(body, "truncate", bool, "EmbedRequest")
            dimensions: int = _field(body, "dimensions", int, "EmbedRequest") or 0
            options: dict[str, Any] = _field(body, "options", dict, "EmbedRequest") or {}
            keep_alive = _keep_alive(body)
            inputs = _embed_inputs(body.get("input"))
            result = self._embedding_run(
                model,
                inputs,
                truncate=truncate is not False,
                dimensions=dimensions,
                keep_alive_ns=keep_alive,
                options=options,
                started_ns=started,
            )
            if result is None:
                return
            vectors, count, load_ns = result
            if not inputs:
                self._send_json(200, {"model": model, "embeddings": []})
                return
            reply: dict[str, Any] = {
                "model": model,
                "embeddings": [[_float32_json(value) for value in vector] for vector in vectors],
                "total_duration": load_ns + max(1, time.monotonic_ns() - started),
                "load_duration": load_ns or max(1, time.monotonic_ns() - started),
            }
            if count:
                reply["prompt_eval_count"] = count  # omitempty in Go
            self._send_json(200, reply)

    def _legacy_embeddings(self, raw: bytes) -> None:
        """``POST /api/embeddings``: one ``prompt``, a vector Ollama does not normalise."""
        started = time.monotonic_ns()
        with self._fake._track("embed") as self._release:
            body = _parse_object(raw)
            self._fake._remember("last_embed", body)
            self._fake._remember("last_embeddings", body)
            model: str = _field(body, "model", str, "EmbeddingRequest") or ""
            prompt: str = _field(body, "prompt", str, "EmbeddingRequest") or ""
            options: dict[str, Any] = _field(body, "options", dict, "EmbeddingRequest") or {}
            keep_alive = _keep_alive(body)
            if not model:
                raise _ApiError(400, "model is required")
            result = self._embedding_run(
                model,
                [prompt] if prompt else [],
                truncate=None,
                dimensions=0,
                keep_alive_ns=keep_alive,
                options=options,
                started_ns=started,
            )
            if result is None:
                return
            vectors, _, _ = result
            # float32 values sent as float64, as Ollama's []float64 conversion does.
            self._send_json(200, {"embedding": vectors[0] if vectors else []})

    def _openai_embeddings(self, raw: bytes) -> None:
        """``POST /v1/embeddings``, through Ollama's compatibility layer to ``/api/embed``."""
        started = time.monotonic_ns()
        with self._fake._track("embed") as self._release:
            try:
                if not raw.strip():
                    raise _ApiError(400, "EOF")
                body = _parse_object(raw)
                self._fake._remember("last_openai", body)
                model: str = _field(body, "model", str, "EmbedRequest") or ""
                dimensions: int = _field(body, "dimensions", int, "EmbedRequest") or 0
                encoding: str = _field(body, "encoding_format", str, "EmbedRequest") or ""
                if encoding and encoding.lower() not in ("float", "base64"):
                    raise _ApiError(
                        400,
                        f"Invalid value for 'encoding_format' = {encoding}. "
                        "Supported values: ['float', 'base64'].",
                    )
                value = body.get("input")
                if value == "":
                    value = [""]
                if value is None or value == []:
                    raise _ApiError(400, "invalid input")
            except _ApiError as exc:
                raise exc.as_openai("invalid_request_error") from None
            try:
                inputs = _embed_inputs(value)
                result = self._embedding_run(
                    model,
                    inputs,
                    truncate=True,
                    dimensions=dimensions,
                    keep_alive_ns=None,
                    options={},
                    started_ns=started,
                )
            except _ApiError as exc:
                raise exc.as_openai("api_error") from None
            if result is None:
                return
            vectors, count, _ = result
            data: list[dict[str, Any]] = []
            for index, vector in enumerate(vectors):
                embedding: list[float] | str
                if encoding.lower() == "base64":
                    packed = struct.pack(f"<{len(vector)}f", *vector)
                    embedding = base64.b64encode(packed).decode()
                else:
                    embedding = [_float32_json(value) for value in vector]
                data.append({"object": "embedding", "embedding": embedding, "index": index})
            self._send_openai_json(
                200,
                {
                    "object": "list",
                    "data": data or None,  # Go's nil slice
                    "model": model,
                    "usage": {"prompt_tokens": count, "total_tokens": count},
                },
            )

    def _embedding_run(
        self,
        model: str,
        inputs: list[str],
        *,
        truncate: bool | None,
        dimensions: int,
        keep_alive_ns: int | None,
        options: dict[str, Any],
        started_ns: int,
    ) -> tuple[list[list[float]], int, int] | None:
        """Ollama's embedding handlers past the body: the model, its options, the knobs, the
        context check (``truncate`` None: the legacy handler, which neither checks nor
        normalises), the vectors. Returns (vectors, prompt tokens, load ns); None if the client
        hung up during ``delay_s``."""
        fake = self._fake
        normalized = fake._find(model) if model else None
        if normalized is None:
            raise _ApiError(404, f"model {_go_quote(model)} not found, try pulling it first")
        _check_options(options)
        knobs = fake._knobs()
        if not self._pause(knobs.delay_s):
            self.close_connection = True
            return None
        if knobs.reset_after_chunks is not None:
            self._reset()
            return None
        if knobs.fail_status is not None:
            status = knobs.fail_status
            raise _ApiError(status, _FAILURE_MESSAGES.get(status) or _phrase(status))
        num_ctx = _num_ctx(options)
        load_ns = fake._load(normalized, keep_alive_ns, num_ctx)
        context = min(num_ctx, fake._context_length(normalized))
        size = _embedding_length(fake._models.weights(normalized), fake._embeds_only(normalized))
        texts: list[str] = []
        count = 0
        for given in inputs:
            text = given
            tokens = list(_TOKEN.finditer(text))
            if truncate is not None and len(tokens) > context:
                if not truncate:
                    raise _ApiError(400, "input exceeds maximum context length")
                if context <= 0:
                    raise _ApiError(400, "input after truncation exceeds maximum context length")
                text = text[: tokens[context - 1].end()]
                tokens = tokens[:context]
            count += len(tokens)
            texts.append(text)
        vectors = []
        for text in texts:
            vector = _raw_embedding(normalized, text, size)
            if truncate is not None:
                vector = _normalized(vector)
                if 0 < dimensions < len(vector):
                    vector = _normalized(vector[:dimensions])
            vectors.append(vector)
        return vectors, count, load_ns

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
            self._fake._asked(ask.prompt)
            try:
                prepared = self._prepare(ask, chat=chat, started_ns=started)
            except _ApiError as exc:
                raise exc.as_openai("api_error") from None
            if prepared is None:
                return
            plan, knobs = prepared
            reply = _OpenAIReply.of(plan, include_usage=ask.include_usage)
            if plan.format_error is not None:
                if not ask.stream:
                    raise _ApiError(500, plan.format_error, openai_type="api_error")
                # Ollama's writer turns the handler's {"error"} line into an empty chunk.
                broken = _sse(reply.broken())
                self._send_stream(
                    "text/event-stream", iter(()), lambda: [broken], broken, _PLAIN_KNOBS
                )
                return
            if not ask.stream:
                self._send_openai_json(200, reply.whole())
                return
            self._send_stream(
                "text/event-stream",
                (_sse(payload) for payload in reply.chunks()),
                lambda: [_sse(payload) for payload in reply.final()],
                _sse(_openai_error(_FAILURE_MESSAGES[500], "api_error")),
                knobs,
            )

    def _openai_ask(self, raw: bytes, *, chat: bool) -> _Ask:
        """Read a ``ChatCompletionRequest`` or a ``CompletionRequest`` body as Ollama does."""
        if not raw.strip():
            raise _ApiError(400, "EOF")  # what Go's decoder says of an empty body
        body = _parse_object(raw)
        self._fake._remember("last_openai", body)
        struct = "ChatCompletionRequest" if chat else "CompletionRequest"
        model: str = _field(body, "model", str, struct) or ""
        stream: bool = _field(body, "stream", bool, struct) or False
        stream_options: dict[str, Any] = (
            _field(body, "stream_options", dict, struct, "openai.StreamOptions") or {}
        )
        include_usage: bool = (
            _field(
                stream_options,
                "include_usage",
                bool,
                "StreamOptions",
                path="stream_options.include_usage",
            )
            or False
        )
        max_tokens: int | None = _field(body, "max_tokens", int, struct, "int")
        _field(body, "temperature", (int, float), struct, "float64" if chat else "float32")
        think: str | None = None
        tools: list[dict[str, Any]] = []
        format_: object = None
        images: list[bytes] = []
        tool_results: tuple[tuple[str, str], ...] = ()
        suffix = ""
        if chat:
            messages = self._openai_messages(body)
            if not messages:
                raise _ApiError(400, "[] is too short - 'messages'")
            tools = _tools(body, struct, "[]api.Tool")
            prompt, prompt_tokens = _chat_prompt(self._fake._models.chat_messages(model, messages))
            if tools:
                prompt_tokens += _count_tokens(json.dumps(tools))
            empty = False
            reasoning = _field(body, "reasoning", dict, struct, "openai.Reasoning") or {}
            think = _field(
                reasoning, "effort", str, "Reasoning", path="reasoning.effort"
            ) or _field(body, "reasoning_effort", str, struct)
            if think is not None and think not in ("high", "medium", "low"):
                # The chat handler's ThinkValue refuses it (an api_error, through the writer).
                raise _ApiError(
                    400,
                    f"invalid think value: {_go_quote(think)} "
                    '(must be "high", "medium", "low", true, or false)',
                    openai_type="api_error",
                )
            format_ = self._openai_format(body)
            images = [image for message in messages for image in message.images]
            tool_results = _tool_results(messages)
        else:
            prompt = _field(body, "prompt", str, struct) or ""
            suffix = _field(body, "suffix", str, struct) or ""
            system = self._fake._models.system(model)  # the generate handler's
            prompt_tokens = _count_tokens(system) + _count_tokens(prompt) + 4
            empty = prompt == ""
        self._fake._saw_images(len(images))
        return _Ask(
            model=model,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            empty=empty,
            think=think,
            num_predict=max_tokens,
            stream=stream,
            include_usage=include_usage,
            tools=tuple(tools),
            format=format_,
            images=tuple(images),
            tool_results=tool_results,
            suffix=suffix,
        )

    def _openai_format(self, body: dict[str, Any]) -> object:
        """``response_format`` as the ``format`` Ollama's compatibility layer makes of it."""
        struct = "ChatCompletionRequest"
        spec = _field(body, "response_format", dict, struct, "openai.ResponseFormat")
        if not spec:
            return None
        kind: str = _field(spec, "type", str, "ResponseFormat", path="response_format.type") or ""
        kind = kind.strip().lower()
        if kind == "json_object":
            return "json"
        if kind == "json_schema":
            schema = _field(
                spec,
                "json_schema",
                dict,
                "ResponseFormat",
                "openai.JsonSchema",
                path="response_format.json_schema",
            )
            return schema.get("schema") if schema else None
        return None

    def _openai_messages(self, body: dict[str, Any]) -> list[_Msg]:
        """OpenAI messages as Ollama's: string content, or one message per text or image part;
        ``tool_calls`` with JSON-string arguments; a tool result's name from its
        ``tool_call_id``."""
        raw = _field(body, "messages", list, "ChatCompletionRequest", "[]openai.Message") or []
        items: list[dict[str, Any]] = []
        for item in raw:
            if not isinstance(item, dict):
                raise _unmarshal_error(item, "ChatCompletionRequest.messages", "openai.Message")
            for key in ("role", "name", "tool_call_id", "reasoning"):
                _field(item, key, str, "Message", path=f"messages.{key}")
            self._openai_tool_calls(item)  # type-check them before converting anything
            items.append(item)
        messages: list[_Msg] = []
        for group, item in enumerate(items):
            role = (item.get("role") or "").lower()
            tool_name = ""
            if role == "tool":
                tool_name = item.get("name") or self._name_of_call(items, item)
            content = item.get("content")
            has_calls = item.get("tool_calls") is not None
            if isinstance(content, str):
                calls = self._openai_tool_calls(item, parse=True)
                messages.append(_Msg(role, content, (), tuple(calls), tool_name, group))
            elif isinstance(content, list):
                first = len(messages)
                for part in content:
                    messages.append(self._openai_part(role, part, group))
                if len(messages) > first and has_calls:
                    calls = self._openai_tool_calls(item, parse=True)
                    last = messages[-1]
                    messages[-1] = _Msg(
                        last.role,
                        last.content,
                        last.images,
                        tuple(calls),
                        tool_name or last.tool_name,
                        group,
                    )
            elif not has_calls:
                # content is optional only beside tool calls
                go_type = {
                    "null": "<nil>",
                    "number": "float64",
                    "object": "map[string]interface {}",
                }
                kind = _json_type(content)
                raise _ApiError(400, f"invalid message content type: {go_type.get(kind, kind)}")
            else:
                calls = self._openai_tool_calls(item, parse=True)
                messages.append(_Msg(role, "", (), tuple(calls), tool_name, group))
        return messages

    def _openai_part(self, role: str, part: object, group: int) -> _Msg:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(part, dict) or kind not in ("text", "image_url"):
            raise _ApiError(400, "invalid message format")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _ApiError(400, "invalid message format")
            return _Msg(role, part["text"], group=group)
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str):
            raise _ApiError(400, "invalid message format")
        for name in _IMAGE_DATA_URL_TYPES:
            prefix = f"data:image/{name};base64,"
            if url.startswith(prefix):
                url = url.removeprefix(prefix)
                break
        else:
            raise _ApiError(400, "invalid image input")  # remote URLs included
        try:
            data = _go_b64decode(url)
        except ValueError:
            raise _ApiError(400, "invalid message format") from None
        return _Msg(role, "", (data,), group=group)

    def _openai_tool_calls(
        self, item: dict[str, Any], *, parse: bool = False
    ) -> list[dict[str, Any]]:
        """An OpenAI message's ``tool_calls``, type-checked; with ``parse``, in Ollama's
        native shape (arguments decoded from their JSON string)."""
        value = item.get("tool_calls")
        where = "messages.tool_calls"
        if value is None:
            return []
        if not isinstance(value, list):
            raise _unmarshal_error(value, f"Message.{where}", "[]openai.ToolCall")
        calls = []
        for call in value:
            if not isinstance(call, dict):
                raise _unmarshal_error(call, f"Message.{where}", "openai.ToolCall")
            for key in ("id", "type"):
                _field(call, key, str, "ToolCall", path=f"{where}.{key}")
            _field(call, "index", int, "ToolCall", path=f"{where}.index")
            function = call.get("function")
            if function is not None and not isinstance(function, dict):
                raise _unmarshal_error(function, f"ToolCall.{where}.function", _OPENAI_FUNCTION)
            function = function or {}
            # The function is an anonymous struct: Go names no struct for its fields.
            name = _field(function, "name", str, "", path=f"{where}.function.name") or ""
            arguments = _field(function, "arguments", str, "", path=f"{where}.function.arguments")
            if not parse:
                continue
            try:
                decoded = json.loads(arguments or "")
            except ValueError:
                decoded = []
            if decoded is not None and not isinstance(decoded, dict):
                raise _ApiError(400, "invalid tool call arguments")
            calls.append({"function": {"name": name, "arguments": decoded or {}}})
        return calls

    @staticmethod
    def _name_of_call(items: Sequence[dict[str, Any]], item: dict[str, Any]) -> str:
        """The function name of the (last) tool call whose id a tool message answers."""
        wanted = item.get("tool_call_id")
        if not wanted:
            return ""
        for message in reversed(items):
            for call in message.get("tool_calls") or []:
                if isinstance(call, dict) and call.get("id") == wanted:
                    function = call.get("function") or {}
                    return str(function.get("name") or "")
        return ""

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

    def _reset(self) -> None:
        """Reset the connection now: its descriptor closed with a zero linger, so the kernel
        sends a TCP RST (no FIN first, which a shutdown would send); what the handler still
        tries to write or close of it fails quietly."""
        self.close_connection = True
        with suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            os.close(self.connection.detach())


def _embed_inputs(value: object) -> list[str]:
    """``/api/embed``'s ``input``: a string (none if empty) or a list of strings."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise _ApiError(400, "invalid input type")


def _phrase(status: int) -> str:
    try:
        return http.HTTPStatus(status).phrase.lower()
    except ValueError:
        return f"fake failure (HTTP {status})"


_OPENAI_FUNCTION = (
    'struct { Name string "json:\\"name\\""; Arguments string "json:\\"arguments\\"" }'
)


@dataclass(frozen=True)
class _Plan:
    """What one generation will say, streamed or whole."""

    model: str
    chat: bool
    done_reason: str
    prompt_eval_count: int
    started_ns: int
    load_ns: int = 0
    thinking_pieces: list[str] = field(default_factory=list)
    response_pieces: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # native shape
    tool_tokens: int = 0  # what the tool calls cost to generate
    format_error: str | None = None  # the runner refuses the format

    @property
    def eval_count(self) -> int:
        return len(self.thinking_pieces) + len(self.response_pieces) + self.tool_tokens

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": _now()}

    def _text(
        self, content: str, thinking: str | None, tool_calls: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            return {"message": message}
        text: dict[str, Any] = {"response": content}
        if thinking:
            text["thinking"] = thinking
        return text

    def chunks(self) -> Iterator[dict[str, Any]]:
        """The streamed lines before the final one: thinking pieces first, then the answer,
        then each tool call in a line of its own (as Ollama's tool parser emits them)."""
        for piece in self.thinking_pieces:
            yield {**self._head(), **self._text("", piece), "done": False}
        for piece in self.response_pieces:
            yield {**self._head(), **self._text(piece, None), "done": False}
        for call in self.tool_calls:
            yield {**self._head(), **self._text("", None, [call]), "done": False}

    def _metrics(self) -> dict[str, Any]:
        prompt_ns = self.prompt_eval_count * PROMPT_EVAL_NS_PER_TOKEN
        eval_ns = self.eval_count * EVAL_NS_PER_TOKEN
        wall_ns = time.monotonic_ns() - self.started_ns
        metrics: dict[str, Any] = {"done": True, "done_reason": self.done_reason}
        if not self.chat:
            metrics["context"] = []
        metrics.update(
            total_duration=wall_ns + self.load_ns + prompt_ns + eval_ns,
            load_duration=self.load_ns,
            prompt_eval_count=self.prompt_eval_count,
            prompt_eval_duration=prompt_ns,
            eval_count=self.eval_count,
            eval_duration=eval_ns,
        )
        return metrics

    def final(self) -> dict[str, Any]:
        """The last streamed line: empty text, ``done: true`` and the figures."""
        return {**self._head(), **self._text("", None), **self._metrics()}

    def whole(self) -> dict[str, Any]:
        """The ``"stream": false`` answer."""
        thinking = "".join(self.thinking_pieces) or None
        text = self._text("".join(self.response_pieces), thinking, self.tool_calls)
        return {**self._head(), **text, **self._metrics()}


def _tool_call_id() -> str:
    """Ollama's ``call_`` and eight random lower-case letters or digits."""
    return "call_" + "".join(random.choices(string.ascii_lowercase + string.digits, k=8))


@dataclass(frozen=True)
class _OpenAIReply:
    """A plan in the shapes of Ollama's OpenAI compatibility layer (0.12.0): ``chat.completion``
    and ``chat.completion.chunk`` for a chat, ``text_completion`` for a legacy completion.

    Each streamed chat delta carries ``"role": "assistant"`` and ``content`` (``""`` beside
    thinking and tool calls); thinking goes in ``reasoning``. The finishing chunk has an empty
    ``content`` and the ``finish_reason`` (``tool_calls`` once a call was sent); with
    ``stream_options.include_usage`` a chunk with no choices and the ``usage`` follows (legacy
    completion chunks then also carry zero ``usage``, as Ollama's do). A legacy completion
    drops the thinking, as Ollama does (its pieces stream as empty text). Tool calls get an
    ``id`` (``call_`` and 8 random characters), their ``index`` and JSON-string ``arguments``
    (keys sorted, ``<>&`` escaped: Go's ``json.Marshal``).
    """

    plan: _Plan
    include_usage: bool
    id: str
    created: int
    tool_calls: list[dict[str, Any]]

    @classmethod
    def of(cls, plan: _Plan, *, include_usage: bool) -> _OpenAIReply:
        prefix = "chatcmpl" if plan.chat else "cmpl"
        calls = []
        for call in plan.tool_calls:
            function = call["function"]
            calls.append(
                {
                    "id": _tool_call_id(),
                    "index": function.get("index", 0),
                    "type": "function",
                    "function": {
                        "name": function["name"],
                        "arguments": _go_json(function["arguments"]),
                    },
                }
            )
        return cls(
            plan, include_usage, f"{prefix}-{random.randrange(999)}", int(time.time()), calls
        )

    def _usage(self) -> dict[str, int]:
        prompt = self.plan.prompt_eval_count
        completion = self.plan.eval_count
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _choice(
        self,
        text: str,
        thinking: str | None,
        finish: str | None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if not self.plan.chat:
            return {"text": text, "index": 0, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            delta["reasoning"] = thinking
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _chunk(self, choices: list[dict[str, Any]], model: str | None = None) -> dict[str, Any]:
        model = self.plan.model if model is None else model
        if self.plan.chat:
            return {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": model,
                "system_fingerprint": _OPENAI_FINGERPRINT,
                "choices": choices,
            }
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "choices": choices,
            "model": model,
            "system_fingerprint": _OPENAI_FINGERPRINT,
        }
        if self.include_usage:
            chunk["usage"] = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        return chunk

    def _finish_reason(self) -> str:
        return "tool_calls" if self.tool_calls else self.plan.done_reason

    def chunks(self) -> Iterator[dict[str, Any]]:
        """The streamed pieces: thinking first, then the answer, then each tool call."""
        for piece in self.plan.thinking_pieces:
            yield self._chunk([self._choice("", piece, None)])
        for piece in self.plan.response_pieces:
            yield self._chunk([self._choice(piece, None, None)])
        for call in self.tool_calls:
            yield self._chunk([self._choice("", None, None, [call])])

    def final(self) -> list[dict[str, Any] | str]:
        """What ends the stream: the ``finish_reason`` chunk, the usage chunk, ``[DONE]``."""
        finish = self._chunk([self._choice("", None, self._finish_reason())])
        events: list[dict[str, Any] | str] = [finish]
        if self.include_usage:
            events.append({**finish, "choices": [], "usage": self._usage()})
        events.append("[DONE]")
        return events

    def broken(self) -> dict[str, Any]:
        """What Ollama's writer makes of the handler's ``{"error": ...}`` line: a chunk with
        nothing in it (no model, no finish), after which the stream just ends."""
        return self._chunk([self._choice("", None, None)], model="")

    def whole(self) -> dict[str, Any]:
        """The not-streamed answer."""
        plan = self.plan
        text = "".join(plan.response_pieces)
        choice: dict[str, Any]
        if plan.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking := "".join(plan.thinking_pieces):
                message["reasoning"] = thinking
            if self.tool_calls:
                message["tool_calls"] = self.tool_calls
            choice = {"index": 0, "message": message, "finish_reason": self._finish_reason()}
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
        prog="python -m devtools.fakes.ollama", description="Serve a fake Ollama HTTP API."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=11434, help="0 picks a free port")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="comma-separated")
    for knob, default in (
        ("thinking-models", DEFAULT_THINKING_MODELS),
        ("tool-models", DEFAULT_TOOL_MODELS),
        ("vision-models", DEFAULT_VISION_MODELS),
        ("embedding-models", DEFAULT_EMBEDDING_MODELS),
        ("insert-models", DEFAULT_INSERT_MODELS),
    ):
        parser.add_argument(f"--{knob}", default=",".join(default), help="comma-separated")
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
            tool_models=names(args.tool_models),
            vision_models=names(args.vision_models),
            embedding_models=names(args.embedding_models),
            insert_models=names(args.insert_models),
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
    # Serve with the package's copy of this module, the one `ollama_models` builds on (run as
    # __main__, this one is a second copy, whose errors and classes would not be the same).
    from devtools.fakes.ollama import main as package_main

    raise SystemExit(package_main())
