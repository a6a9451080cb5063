"""Ollama's API, requests: ``/api/generate``, ``/api/chat``, ``/api/embed``, ``/api/embeddings``,
``/api/show`` and ``/api/pull`` bodies to route requests (or to answers given at once).

What a body says travels unchanged: ``options`` (every field), ``think``, ``keep_alive`` (checked,
passed as given), ``format`` (``"json"`` or a schema), ``images``, ``tools``, ``suffix``, and each
message's ``images``, ``tool_calls``, ``tool_name`` and ``tool_call_id``. A message's
``thinking`` (a model's earlier reasoning) is accepted and not carried: chat messages on the
wire have no field for it. What the fleet cannot honour is refused by name: ``template`` and
``raw`` (each worker's backend renders the model's own template), ``context`` (no token state
is kept between tasks), ``logprobs``. Unknown fields are ignored, as Ollama ignores them.
Answers are written by `services.gateway.ollama_answers`. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from schemas.route import MAX_MESSAGES, ChatMessage, ToolCall
from services.gateway.common import (
    NS_PER_S,
    ApiError,
    Ask,
    check_count,
    decode,
    encoder,
    iso_now,
    keep_alive,
    keep_alive_ns,
    refuse,
    require_model,
)
from services.gateway.conversation import (
    arguments_of,
    check_images,
    conversation,
    embedding_route,
    message,
    output_format,
    route,
    think,
)

_TEMPLATE_WHY = "each worker's backend renders the model's own template; a request cannot swap it"
_CONTEXT_WHY = (
    "the fleet keeps no token context between tasks; send the conversation to /api/chat as messages"
)
_LOGPROBS_WHY = "the fleet's answers carry no token log probabilities"


@dataclass(frozen=True, slots=True)
class Preload:
    """An Ollama request that only loads a model (``/api/generate`` with an empty prompt,
    ``/api/chat`` with no messages), or unloads it (the same with ``keep_alive`` 0). The
    gateway answers it at once when a live worker serves the model; no task is routed."""

    model: str
    chat: bool
    unload: bool

    @property
    def kind(self) -> str:
        return "unload" if self.unload else "load"

    def answer(self, at: float | None = None) -> bytes:
        """Ollama's: one JSON object, empty text, ``done_reason`` ``load`` (or ``unload``)."""
        text: dict[str, Any] = (
            {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        )
        return encoder.encode(
            {
                "model": self.model,
                "created_at": iso_now(at),
                **text,
                "done": True,
                "done_reason": self.kind,
            }
        )


@dataclass(frozen=True, slots=True)
class EmptyEmbed:
    """``/api/embed`` with no input (or ``/api/embeddings`` with an empty prompt): Ollama loads
    the model and answers no vectors; the gateway answers at once when a live worker serves
    the model."""

    model: str
    legacy: bool
    """``/api/embeddings``."""

    @property
    def kind(self) -> str:
        return "empty embed"

    def answer(self, at: float | None = None) -> bytes:
        if self.legacy:
            return encoder.encode({"embedding": []})
        return encoder.encode({"model": self.model, "embeddings": []})


# -- request bodies: the fields the gateway uses ------------------------------------------------


class _Function(msgspec.Struct):
    name: str = ""
    arguments: dict[str, Any] | str | None = None
    index: int | None = None


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str | None = None
    index: int | None = None
    """Where Open WebUI puts it (Ollama has it in ``function``)."""


class _Message(msgspec.Struct):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


class _Generate(msgspec.Struct):
    model: str = ""
    prompt: str | None = ""
    system: str | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    think: bool | str | None = None
    images: list[str] | None = None
    format: Any = None
    suffix: str | None = None
    template: str | None = None
    raw: bool | None = False
    context: list[int] | None = None
    keep_alive: Any = None
    logprobs: bool | None = False


class _Chat(msgspec.Struct):
    model: str = ""
    # Ollama's CLI loads a model with ``"messages": null``.
    messages: list[_Message] | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    think: bool | str | None = None
    tools: list[dict[str, Any]] | None = None
    format: Any = None
    keep_alive: Any = None
    logprobs: bool | None = False


class _Embed(msgspec.Struct):
    model: str = ""
    input: Any = None
    truncate: bool | None = None
    dimensions: int | None = None
    keep_alive: Any = None
    options: dict[str, Any] | None = None


class _Embeddings(msgspec.Struct):
    model: str = ""
    prompt: str | None = ""
    keep_alive: Any = None
    options: dict[str, Any] | None = None


class _ModelRequest(msgspec.Struct):
    """``/api/show`` and ``/api/pull``: the model by ``model`` or its older name ``name``
    (Ollama's CLI sends both, one of them empty)."""

    model: str | None = None
    name: str | None = None
    stream: bool | None = None


# -- generation ---------------------------------------------------------------------------------


def ollama_generate(body: bytes, *, timeout_s: float | None) -> Ask | Preload:
    """``POST /api/generate``; a ``system`` prompt makes it a two-message conversation; an
    empty prompt (Ollama's test is exactly ``""``) is a `Preload`, unloading when
    ``keep_alive`` is zero."""
    req = decode(body, _Generate, "generate")
    refuse("template", req.template, _TEMPLATE_WHY)
    refuse("raw", req.raw, _TEMPLATE_WHY)
    refuse("context", req.context, _CONTEXT_WHY)
    refuse("logprobs", req.logprobs, _LOGPROBS_WHY)
    images = check_images(req.images)
    work: dict[str, Any] = {
        "options": req.options,
        "think": think(req.think),
        "format": output_format(req.format),
        "keep_alive": keep_alive(req.keep_alive),
        "suffix": req.suffix or None,
    }
    prompt = req.prompt or ""
    if prompt == "":
        require_model(req.model)
        return Preload(model=req.model, chat=False, unload=keep_alive_ns(req.keep_alive) == 0)
    if req.system and prompt.strip():
        refuse("system together with suffix", req.suffix, "fill-in-the-middle takes no system")
        text, messages = conversation(
            [message("system", req.system), message("user", prompt, images=images)]
        )
        ask = route(
            req.model, text, stream=req.stream, timeout_s=timeout_s, messages=messages, **work
        )
    else:
        ask = route(
            req.model, prompt, stream=req.stream, timeout_s=timeout_s, images=images, **work
        )
    return Ask(route=ask)


def _tool_call(call: _ToolCall, position: int) -> ToolCall:
    arguments = call.function.arguments
    if isinstance(arguments, str):
        arguments = arguments_of(arguments)
    return ToolCall(
        name=call.function.name, arguments=arguments or {}, id=call.id or None, index=position
    )


def _chat_messages(messages: list[_Message]) -> list[ChatMessage]:
    """The conversation; a tool result that names its call by id only (Open WebUI's) gets the
    name of that call, as Ollama's ``/v1`` layer finds it (the last call with the id wins)."""
    names: dict[str, str] = {}
    turns = []
    for index, m in enumerate(messages):
        calls = [_tool_call(call, n) for n, call in enumerate(m.tool_calls or ())]
        names.update((call.id, call.name) for call in calls if call.id)
        tool_name = m.tool_name or None
        if tool_name is None and m.tool_call_id and m.role.lower() == "tool":
            tool_name = names.get(m.tool_call_id)
        turns.append(
            message(
                m.role,
                m.content or "",
                images=check_images(m.images, f"messages[{index}]."),
                tool_calls=calls or None,
                tool_name=tool_name,
                tool_call_id=m.tool_call_id or None,
            )
        )
    return turns


def ollama_chat(body: bytes, *, timeout_s: float | None) -> Ask | Preload:
    """``POST /api/chat``; no messages at all is a `Preload`, unloading when ``keep_alive``
    is under a second (Ollama's chat test: whole seconds are zero)."""
    req = decode(body, _Chat, "chat")
    check_count("messages", req.messages or (), MAX_MESSAGES, "messages")
    refuse("logprobs", req.logprobs, _LOGPROBS_WHY)
    work: dict[str, Any] = {
        "options": req.options,
        "think": think(req.think),
        "format": output_format(req.format),
        "keep_alive": keep_alive(req.keep_alive),
        "tools": req.tools or None,
    }
    if not req.messages:
        require_model(req.model)
        keep = keep_alive_ns(req.keep_alive)
        return Preload(model=req.model, chat=True, unload=keep is not None and keep < NS_PER_S)
    text, messages = conversation(_chat_messages(req.messages))
    ask = route(req.model, text, stream=req.stream, timeout_s=timeout_s, messages=messages, **work)
    return Ask(route=ask)


# -- embeddings ---------------------------------------------------------------------------------


def _inputs(value: Any) -> list[str]:
    """``input`` as Ollama's EmbedHandler reads it: a string (empty: nothing), a list of
    strings, or nothing."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    if isinstance(value, list) and all(isinstance(text, str) for text in value):
        return value
    raise ApiError(400, "bad_request", "invalid input type: input is a string or a list of strings")


def ollama_embed(body: bytes, *, timeout_s: float | None) -> Ask | EmptyEmbed:
    """``POST /api/embed``: one task for the whole batch; no input is an `EmptyEmbed`."""
    req = decode(body, _Embed, "embed")
    inputs = _inputs(req.input)
    keep = keep_alive(req.keep_alive)
    require_model(req.model)
    if not inputs:
        return EmptyEmbed(model=req.model, legacy=False)
    ask = embedding_route(
        req.model,
        inputs,
        timeout_s=timeout_s,
        options=req.options,
        keep_alive=keep,
        truncate=req.truncate,
        # Ollama: 0 (or less) is the model's own length.
        dimensions=req.dimensions if req.dimensions and req.dimensions > 0 else None,
    )
    return Ask(route=ask)


def ollama_embeddings(body: bytes, *, timeout_s: float | None) -> Ask | EmptyEmbed:
    """``POST /api/embeddings`` (Ollama's older endpoint): one prompt, its vector as the model
    makes it (not normalized); an empty prompt is an `EmptyEmbed`."""
    req = decode(body, _Embeddings, "embeddings")
    keep = keep_alive(req.keep_alive)
    require_model(req.model)
    if not req.prompt:
        return EmptyEmbed(model=req.model, legacy=True)
    ask = embedding_route(
        req.model,
        [req.prompt],
        timeout_s=timeout_s,
        options=req.options,
        keep_alive=keep,
        normalize=False,
    )
    return Ask(route=ask)


# -- model management ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelAsk:
    """A ``/api/show`` or ``/api/pull`` request: which model, and (pull) streamed or not."""

    model: str
    stream: bool = True


def ollama_model_request(body: bytes, what: str) -> ModelAsk:
    """``POST /api/show`` or ``/api/pull`` (``what`` names it in errors): ``model``, else the
    older ``name``; ``stream`` is true unless ``false``."""
    req = decode(body, _ModelRequest, what)
    model = req.model or req.name or ""
    require_model(model)
    return ModelAsk(model=model, stream=req.stream is not False)
