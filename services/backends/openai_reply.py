"""What OpenAI-compatible servers answer, read: the model list, llama.cpp's ``/props``, the
streamed chat completion, embeddings and error bodies. Pure.

Servers differ in what they report beyond the text: ``usage`` (asked for with
``stream_options.include_usage``) gives token counts, llama.cpp adds ``timings`` with prompt
and generation times, and thinking arrives as ``reasoning_content`` (llama.cpp, vLLM) or
``reasoning`` (Ollama). Whatever is missing stays ``None`` rather than being guessed. Tool
calls come in fragments, put together here.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas.events import Durations, Tokens
from schemas.models import COMPLETION, THINKING, TOOLS, VISION, ModelDetails, ModelFacts
from schemas.route import DoneReason, ToolCall
from schemas.vectors import pack
from services.backends import Embedding, Generation
from services.errors import BackendError, BackendServerError

# ``finish_reason`` as `DoneReason`; ``function_call`` is the older name of ``tool_calls``.
_DONE_REASONS: dict[str, DoneReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
}

# What a chat template says when its model reasons apart from its answer (Qwen3's switch,
# DeepSeek-R1's tags, the field llama.cpp and vLLM return the reasoning in).
_THINKING_MARKERS = ("<think>", "enable_thinking", "reasoning_content")


class _Meta(msgspec.Struct):
    """What llama.cpp's server adds to each ``/v1/models`` entry."""

    n_ctx_train: int | None = None
    n_params: int | None = None
    size: int | None = None
    ftype: str | None = None


class ModelEntry(msgspec.Struct):
    """One entry of ``/v1/models``."""

    id: str
    meta: _Meta | None = None


class _Models(msgspec.Struct):
    data: list[ModelEntry] = []


class _FunctionDelta(msgspec.Struct):
    name: str | None = None
    arguments: str | dict[str, Any] | None = None


class _ToolCallDelta(msgspec.Struct):
    index: int | None = None
    id: str | None = None
    function: _FunctionDelta | None = None


class _Delta(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCallDelta] | None = None


class _Choice(msgspec.Struct):
    delta: _Delta = msgspec.field(default_factory=_Delta)
    finish_reason: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _Timings(msgspec.Struct):
    """llama.cpp's server reports these with the last chunk."""

    prompt_n: int | None = None
    prompt_ms: float | None = None
    predicted_n: int | None = None
    predicted_ms: float | None = None


class _ErrorDetail(msgspec.Struct):
    message: str = ""


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    usage: _Usage | None = None
    timings: _Timings | None = None
    error: _ErrorDetail | None = None


class _Vector(msgspec.Struct):
    index: int = 0
    embedding: list[float] | str = []


class _Embeddings(msgspec.Struct):
    data: list[_Vector] | None = None  # Ollama's /v1 sends null for no vectors
    usage: _Usage | None = None


class _TemplateCaps(msgspec.Struct):
    supports_tools: bool = False
    supports_reasoning_effort: bool = False


class _Modalities(msgspec.Struct):
    vision: bool = False


class ServerProps(msgspec.Struct):
    """llama.cpp's ``GET /props`` (the parts read here)."""

    chat_template: str = ""
    chat_template_caps: _TemplateCaps | None = None
    modalities: _Modalities | None = None


_models_decoder = msgspec.json.Decoder(_Models)
_chunk_decoder = msgspec.json.Decoder(_Chunk)
_embeddings_decoder = msgspec.json.Decoder(_Embeddings)
_props_decoder = msgspec.json.Decoder(ServerProps)


@dataclass
class _PartialCall:
    """One streamed tool call being put together from its deltas."""

    id: str | None = None
    name: str = ""
    arguments: list[str] = field(default_factory=list)
    whole: dict[str, Any] | None = None  # a server that sends the arguments as an object


class ChatStream:
    """A streamed chat completion put together, chunk by chunk; the caller times it and
    passes the pieces on."""

    def __init__(self) -> None:
        self.response: list[str] = []
        self.thinking: list[str] = []
        self.calls: dict[int, _PartialCall] = {}
        self.finished_calls: list[ToolCall] | None = None
        self.first_token_ms: float | None = None
        self.usage: _Usage | None = None
        self.timings: _Timings | None = None
        self.finish_reason: str | None = None

    def note(self, chunk: _Chunk) -> None:
        """Keep the figures a chunk carries (usually the last)."""
        self.usage = chunk.usage or self.usage
        self.timings = chunk.timings or self.timings

    def add(self, choice: _Choice) -> tuple[str, str, bool, list[ToolCall] | None]:
        """Keep one choice's delta. Returns its text, its thinking, whether it said anything
        (text, thinking or a tool call), and the tool calls when this choice finished them."""
        delta = choice.delta
        think = delta.reasoning_content or delta.reasoning
        if delta.tool_calls:
            gather(self.calls, delta.tool_calls)
        said = bool(delta.content or think or delta.tool_calls)
        if delta.content:
            self.response.append(delta.content)
        if think:
            self.thinking.append(think)
        finished: list[ToolCall] | None = None
        if choice.finish_reason is not None:
            self.finish_reason = choice.finish_reason
            if self.calls and self.finished_calls is None:
                # The calls are whole once the server says why it stopped.
                finished = self.finished_calls = assemble(self.calls)
        return delta.content or "", think or "", said, finished

    def finish(self) -> list[ToolCall] | None:
        """At the stream's end: the tool calls of a server that sent no ``finish_reason``, if
        they were not finished yet."""
        if self.calls and self.finished_calls is None:
            self.finished_calls = assemble(self.calls)
            return self.finished_calls
        return None

    def generation(self, total_ms: float) -> Generation:
        """The generation, ``total_ms`` long by the caller's clock."""
        done_reason = _DONE_REASONS.get(self.finish_reason or "")
        if done_reason == "stop" and self.finished_calls:
            done_reason = "tool_calls"
        usage, timings = self.usage, self.timings
        return Generation(
            response="".join(self.response),
            thinking="".join(self.thinking) or None,
            durations=Durations(
                total_ms=total_ms,
                prompt_eval_ms=timings.prompt_ms if timings else None,
                eval_ms=timings.predicted_ms if timings else None,
            ),
            tokens=Tokens(
                prompt=(usage.prompt_tokens if usage else None)
                or (timings.prompt_n if timings else None),
                eval=(usage.completion_tokens if usage else None)
                or (timings.predicted_n if timings else None),
            ),
            first_token_ms=self.first_token_ms,
            tool_calls=self.finished_calls,
            done_reason=done_reason,
        )


def decode_chunk(data: str, address: str) -> _Chunk:
    """One ``data:`` line of the stream; a malformed line is a `BackendError`, an error the
    server reports in the stream a `BackendServerError`."""
    try:
        chunk = _chunk_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BackendError(f"malformed stream line: {data[:200]!r}") from exc
    if chunk.error is not None:
        raise BackendServerError(f"{address} reported an error: {chunk.error.message}")
    return chunk


def decode_models(content: bytes, address: str) -> list[ModelEntry]:
    """``/models``'s entries; a malformed reply is a `BackendError`."""
    try:
        return _models_decoder.decode(content).data
    except msgspec.DecodeError as exc:
        raise BackendError(f"{address}/models: malformed reply: {exc}") from exc


def decode_props(content: bytes) -> ServerProps | None:
    """llama.cpp's ``/props``, or None when the reply is not that (malformed, or without
    ``chat_template_caps`` and ``modalities``: not llama.cpp)."""
    try:
        props = _props_decoder.decode(content)
    except msgspec.DecodeError:
        return None
    if props.chat_template_caps is None and props.modalities is None:
        return None
    return props


def embedding_of(content: bytes, inputs: int, address: str, total_ms: float) -> Embedding:
    """``/embeddings``'s answer as one vector per input, in input order."""
    try:
        answer = _embeddings_decoder.decode(content)
    except msgspec.DecodeError as exc:
        raise BackendError(f"{address}/embeddings: malformed reply: {exc}") from exc
    data = answer.data or []
    if len(data) != inputs:
        raise BackendError(f"{address}/embeddings gave {len(data)} vectors for {inputs} inputs")
    vectors = [_packed(v.embedding) for v in sorted(data, key=lambda v: v.index)]
    return Embedding(
        vectors=vectors,
        durations=Durations(total_ms=total_ms),
        tokens=Tokens(prompt=answer.usage.prompt_tokens if answer.usage else None),
    )


def facts_of(name: str, capabilities: list[str], model: ModelEntry | None) -> ModelFacts:
    """A served model's facts: ``capabilities``, and what llama.cpp's model entry tells (the
    size, the parameter count, the quantization and the trained context length)."""
    meta = model.meta if model is not None else None
    return ModelFacts(
        name=name,
        capabilities=capabilities,
        size=(meta.size or 0) if meta else 0,
        details=ModelDetails(
            format="gguf",
            parameter_size=_human_number(meta.n_params) if meta.n_params else "",
            quantization_level=meta.ftype or "",
        )
        if meta
        else ModelDetails(),
        context_length=meta.n_ctx_train if meta else None,
    )


def template_capabilities(props: ServerProps | None) -> list[str]:
    """``completion``, and what llama.cpp's ``/props`` says its chat template can do."""
    capabilities = [COMPLETION]
    if props is not None:
        if props.chat_template_caps is not None and props.chat_template_caps.supports_tools:
            capabilities.append(TOOLS)
        if props.modalities is not None and props.modalities.vision:
            capabilities.append(VISION)
        if _thinks(props):
            capabilities.append(THINKING)
    return capabilities


def _thinks(props: ServerProps) -> bool:
    caps = props.chat_template_caps
    return (caps is not None and caps.supports_reasoning_effort) or any(
        marker in props.chat_template for marker in _THINKING_MARKERS
    )


def gather(calls: dict[int, _PartialCall], deltas: list[_ToolCallDelta]) -> None:
    """Add one chunk's tool-call deltas to the calls being put together, by ``index``. The
    id and name come whole in a call's first delta (later repeats are ignored), the arguments
    in fragments to join."""
    for position, delta in enumerate(deltas):
        call = calls.setdefault(
            delta.index if delta.index is not None else position, _PartialCall()
        )
        if delta.id and call.id is None:
            call.id = delta.id
        if delta.function is None:
            continue
        if delta.function.name and not call.name:
            call.name = delta.function.name
        arguments = delta.function.arguments
        if isinstance(arguments, dict):
            call.whole = arguments
        elif arguments:
            call.arguments.append(arguments)


def assemble(calls: dict[int, _PartialCall]) -> list[ToolCall]:
    """The finished calls in index order; arguments that are a JSON object become a dict,
    any other text stays as it came (OpenAI's API does not promise JSON)."""
    finished: list[ToolCall] = []
    for index in sorted(calls):
        call = calls[index]
        arguments: dict[str, Any] | str
        if call.whole is not None:
            arguments = call.whole
        else:
            text = "".join(call.arguments)
            try:
                decoded = json.loads(text) if text.strip() else {}
            except ValueError:
                decoded = None
            arguments = decoded if isinstance(decoded, dict) else text
        finished.append(ToolCall(name=call.name, arguments=arguments, id=call.id, index=index))
    return finished


def _packed(embedding: list[float] | str) -> bytes:
    """A vector as `schemas.vectors` bytes; a server that sends base64 anyway sent exactly
    those bytes (little-endian float32)."""
    if isinstance(embedding, str):
        return base64.b64decode(embedding)
    return pack(embedding)


def _human_number(count: int) -> str:
    """A parameter count as Ollama writes it (``135M``, ``494.03M``, ``3.2B``)."""
    for scale, unit, digits in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if count >= scale:
            number = count / scale
            return f"{number:.0f}{unit}" if number.is_integer() else f"{number:.{digits}f}{unit}"
    return str(count)


def error_text(text: str) -> str:
    """The message of an error body, in OpenAI's shape (``{"error": {"message"}}``) or
    Ollama's (``{"error": "..."}``); else the start of the body."""
    try:
        decoded = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text[:300]
    if isinstance(decoded, dict):
        error = decoded.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        if isinstance(message, str):
            return message
        if isinstance(error, str):
            return error
    return text[:300]
