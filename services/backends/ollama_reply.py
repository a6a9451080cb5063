"""What Ollama answers, read: the model list and ``/api/show``, the streamed generation (NDJSON
lines, the last one carrying the figures), embeddings and error bodies. Pure.

Durations come in nanoseconds and go on in milliseconds; thinking stays apart from the
response; each tool call comes whole, in a chunk of its own, and is numbered through the
whole generation.
"""

from __future__ import annotations

from typing import Any

import msgspec

from schemas.events import Durations, Tokens
from schemas.models import ModelDetails, ModelFacts
from schemas.route import DoneReason, ToolCall
from schemas.vectors import pack
from services.backends import Embedding, Generation
from services.errors import BackendError, BackendServerError

NS_PER_MS = 1_000_000


class Tag(msgspec.Struct):
    name: str
    digest: str = ""
    size: int = 0
    modified_at: str | None = None
    details: ModelDetails | None = None


class _Tags(msgspec.Struct):
    models: list[Tag] = []


class Show(msgspec.Struct):
    """``/api/show``: an Ollama before 0.6.4 or so sends no ``capabilities``."""

    capabilities: list[str] | None = None
    model_info: dict[str, Any] | None = None
    details: ModelDetails | None = None
    modified_at: str | None = None


class _Function(msgspec.Struct):
    name: str = ""
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class _ToolCall(msgspec.Struct):
    function: _Function = msgspec.field(default_factory=_Function)
    id: str | None = None  # newer Ollama versions number their calls


class _Message(msgspec.Struct):
    content: str = ""
    thinking: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Chunk(msgspec.Struct):
    """One NDJSON line of ``/api/generate`` (or ``/api/chat``, whose text is in ``message``);
    the last one (``done``) carries the figures."""

    response: str = ""
    thinking: str | None = None
    message: _Message | None = None
    done: bool = False
    done_reason: str | None = None
    error: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class _Embedded(msgspec.Struct):
    """``/api/embed``'s answer."""

    embeddings: list[list[float]] | None = None  # null for no input (Go's nil slice)
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None


class _LegacyEmbedded(msgspec.Struct):
    """``/api/embeddings``'s answer: one vector, no figures."""

    embedding: list[float] | None = None


_tags_decoder = msgspec.json.Decoder(_Tags)
_show_decoder = msgspec.json.Decoder(Show)
_chunk_decoder = msgspec.json.Decoder(_Chunk)
_embedded_decoder = msgspec.json.Decoder(_Embedded)
_legacy_decoder = msgspec.json.Decoder(_LegacyEmbedded)

# Ollama's ``done_reason`` words that are `DoneReason`s (it also says ``load`` and ``unload``
# for requests that only load or unload a model).
_DONE_REASONS: dict[str, DoneReason] = {"stop": "stop", "length": "length"}


def _ms(ns: int | None) -> float | None:
    return None if ns is None else ns / NS_PER_MS


class StreamedAnswer:
    """A streamed generation put together, line by line; the caller times it and passes the
    pieces on."""

    def __init__(self) -> None:
        self.response: list[str] = []
        self.thinking: list[str] = []
        self.tool_calls: list[ToolCall] = []
        self.first_token_ms: float | None = None

    def add(self, chunk: _Chunk) -> tuple[str, str, list[ToolCall]]:
        """Keep one line's text, thinking and tool calls (numbered through the generation),
        and return them."""
        text, think = chunk.response, chunk.thinking or ""
        calls: list[ToolCall] = []
        if chunk.message is not None:
            text, think = chunk.message.content, chunk.message.thinking or ""
            for call in chunk.message.tool_calls or ():
                calls.append(
                    ToolCall(
                        name=call.function.name,
                        arguments=call.function.arguments,
                        id=call.id,
                        index=len(self.tool_calls) + len(calls),
                    )
                )
            self.tool_calls.extend(calls)
        if text:
            self.response.append(text)
        if think:
            self.thinking.append(think)
        return text, think, calls

    def generation(self, last: _Chunk, wall_ms: float) -> Generation:
        """The generation, with the figures of its final (``done``) line; ``wall_ms`` is the
        caller's clock, for an Ollama that sends no total."""
        done_reason = _DONE_REASONS.get(last.done_reason or "")
        if done_reason == "stop" and self.tool_calls:
            done_reason = "tool_calls"  # Ollama says "stop"; OpenAI's word for it
        return Generation(
            response="".join(self.response),
            thinking="".join(self.thinking) or None,
            durations=Durations(
                total_ms=_ms(last.total_duration) or wall_ms,
                load_ms=_ms(last.load_duration),
                prompt_eval_ms=_ms(last.prompt_eval_duration),
                eval_ms=_ms(last.eval_duration),
            ),
            tokens=Tokens(prompt=last.prompt_eval_count, eval=last.eval_count),
            first_token_ms=self.first_token_ms,
            tool_calls=self.tool_calls or None,
            done_reason=done_reason,
        )


def decode_line(line: bytes) -> _Chunk:
    """One NDJSON line of the stream; a malformed line is a `BackendError`, an error Ollama
    reports in the stream (its runner failed mid-way) a `BackendServerError`."""
    try:
        chunk = _chunk_decoder.decode(line)
    except msgspec.DecodeError as exc:
        raise BackendError(f"Ollama sent a malformed line: {line[:200]!r}") from exc
    if chunk.error:
        raise BackendServerError(f"Ollama reported an error: {chunk.error}")
    return chunk


def model_names(content: bytes, address: str) -> list[str]:
    """The names in an ``/api/tags`` reply; a malformed one is a `BackendError`."""
    try:
        return [m.name for m in _tags_decoder.decode(content).models]
    except msgspec.DecodeError as exc:
        raise BackendError(f"Ollama at {address}: malformed /api/tags reply: {exc}") from exc


class _Running(msgspec.Struct):
    name: str
    size: int = 0
    """Bytes the loaded model takes, in VRAM and RAM (``size_vram`` is the VRAM part)."""


class _Ps(msgspec.Struct):
    models: list[_Running] = []


_ps_decoder = msgspec.json.Decoder(_Ps)


def running_sizes(content: bytes, address: str) -> dict[str, int]:
    """The models in an ``/api/ps`` reply (those loaded), each with the memory it takes in
    bytes; a malformed reply is a `BackendError`."""
    try:
        return {m.name: m.size for m in _ps_decoder.decode(content).models}
    except msgspec.DecodeError as exc:
        raise BackendError(f"Ollama at {address}: malformed /api/ps reply: {exc}") from exc


def decode_tags(content: bytes) -> dict[str, Tag]:
    """An ``/api/tags`` reply's entries by name (raises `msgspec.DecodeError`)."""
    return {t.name: t for t in _tags_decoder.decode(content).models}


def decode_show(content: bytes) -> Show:
    """An ``/api/show`` reply (raises `msgspec.DecodeError`)."""
    return _show_decoder.decode(content)


def embedding_of(content: bytes, inputs: int, address: str, wall_ms: float) -> Embedding:
    """``/api/embed``'s answer (raises `msgspec.DecodeError`), one vector per input;
    ``wall_ms`` is the caller's clock, for an Ollama that sends no total."""
    answer = _embedded_decoder.decode(content)
    embeddings = answer.embeddings or []
    if len(embeddings) != inputs:
        raise BackendError(
            f"Ollama at {address} gave {len(embeddings)} vectors for {inputs} inputs"
        )
    return Embedding(
        vectors=[pack(vector) for vector in embeddings],
        durations=Durations(
            total_ms=_ms(answer.total_duration) or wall_ms,
            load_ms=_ms(answer.load_duration),
            prompt_eval_ms=_ms(answer.prompt_eval_duration),
        ),
        tokens=Tokens(prompt=answer.prompt_eval_count),
    )


def legacy_vector(content: bytes) -> bytes:
    """``/api/embeddings``'s one vector (raises `msgspec.DecodeError`)."""
    return pack(_legacy_decoder.decode(content).embedding or [])


def facts_of(name: str, tag: Tag | None, show: Show) -> ModelFacts:
    """A served model's facts: digest, size, details and date from its ``/api/tags`` entry,
    capabilities and the context length from ``/api/show``. An Ollama too old to list
    capabilities leaves them at `ModelFacts`'s default."""
    fields: dict[str, Any] = {}
    if show.capabilities is not None:
        fields["capabilities"] = list(show.capabilities)
    details = (tag.details if tag else None) or show.details
    if details is not None:
        fields["details"] = details
    return ModelFacts(
        name=name,
        digest=tag.digest if tag else "",
        size=tag.size if tag else 0,
        context_length=_context_length(show.model_info),
        modified_at=(tag.modified_at if tag else None) or show.modified_at,
        **fields,
    )


def _context_length(model_info: dict[str, Any] | None) -> int | None:
    if not model_info:
        return None
    value = model_info.get(f"{model_info.get('general.architecture')}.context_length")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def error_text(text: str) -> str:
    try:
        decoded = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text[:300]
    if isinstance(decoded, dict) and "error" in decoded:
        return str(decoded["error"])
    return text[:300]
