"""OpenAI's API, requests: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
bodies to route requests, mapped the way Ollama's own ``/v1`` layer maps them
(``openai/openai.go`` in Ollama's source).

- Sampling: ``temperature``, ``top_p``, ``seed``, ``stop``, ``presence_penalty``,
  ``frequency_penalty`` keep their names in ``options``; ``max_completion_tokens`` (else
  ``max_tokens``) is ``num_predict``. Ollama's own ``options`` (``num_ctx``, which coding
  agents need long) are carried to the backend, where Ollama's ``/v1`` drops them; OpenAI's
  fields win over the same option. Unlike Ollama's layer, an absent temperature or top_p is
  left to the model (Ollama's layer sets OpenAI's 1.0).
- ``reasoning_effort`` (or ``reasoning.effort``) is ``think``, clamped as Ollama clamps it.
- ``response_format``: ``json_object`` is format ``"json"``, ``json_schema`` its ``schema``.
- ``tools`` pass unchanged; ``tool_choice`` ``"none"`` sends none, ``"auto"`` is the default;
  ``"required"`` or a named function travels as the option ``tool_choice``: an
  OpenAI-compatible backend (llama.cpp, vLLM) holds the model to it, and Ollama ignores it,
  as Ollama's own ``/v1`` does (refusing it would break clients that work against Ollama).
- Content parts ``text`` and ``image_url`` (a ``data:`` URL of a JPEG, PNG or WebP image,
  which becomes the message's base64 ``images``; a remote URL is refused: the gateway fetches
  nothing); assistant ``tool_calls`` (their ``arguments`` text parsed to an object, or kept
  as text when it is not one); ``role: "tool"`` with ``tool_call_id`` (and ``name``, else the
  name of the call it answers, as Ollama's layer finds it).
- Refused by name: ``n`` > 1, ``logprobs``, token-id prompts and inputs, other content parts.

Answers are written by `services.gateway.openai_answers`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from schemas.route import MAX_MESSAGES, ChatMessage, OutputFormat, ToolCall
from services.gateway.common import ApiError, Ask, check_count, decode, refuse, shown
from services.gateway.conversation import (
    arguments_of,
    check_images,
    conversation,
    embedding_route,
    message,
    route,
)

# The data URLs Ollama's layer takes: a blank type (bare base64, as /api/chat takes), or these.
_DATA_PREFIXES: Final = (
    "data:;base64,",
    *(f"data:image/{kind};base64," for kind in ("jpeg", "jpg", "png", "webp")),
)
_REMOTE_IMAGE: Final = (
    "remote images are not fetched by the Coordinator gateway: send the image inline as a"
    " data: URL (data:image/png;base64,...)"
)
_TOKEN_IDS: Final = "token ids are not supported by the Coordinator gateway: send the texts"


class _ImageUrl(msgspec.Struct):
    url: str = ""
    detail: str | None = None


class _Part(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: _ImageUrl | str | None = None


class _Function(msgspec.Struct):
    name: str = ""
    arguments: str | dict[str, Any] | None = None


class _ToolCall(msgspec.Struct):
    function: _Function
    id: str | None = None
    type: str = "function"


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Part] | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning: str | None = None
    """A model's earlier reasoning: accepted, not carried (chat messages have no field)."""


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _JsonSchema(msgspec.Struct):
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool | None = None


class _ResponseFormat(msgspec.Struct):
    type: str = "text"
    json_schema: _JsonSchema | None = None


class _Reasoning(msgspec.Struct):
    effort: str | None = None


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
    logprobs: Any = None
    options: dict[str, Any] | None = None
    """Ollama's own options (``num_ctx``…), which Ollama's ``/v1`` drops: carried here."""


class _Chat(_Sampling):
    messages: list[_Message] = msgspec.field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: _ResponseFormat | None = None
    reasoning_effort: str | None = None
    reasoning: _Reasoning | None = None


class _Completion(_Sampling):
    prompt: Any = ""
    suffix: str | None = None


class _Embeddings(msgspec.Struct):
    model: str = ""
    input: Any = None
    encoding_format: str | None = None
    dimensions: int | None = None


def _sampling_options(req: _Sampling) -> dict[str, Any]:
    """OpenAI's sampling fields under Ollama's option names (what tasks carry)."""
    refuse("n", req.n is not None and req.n != 1, "one choice per request")
    refuse("logprobs", req.logprobs, "the fleet's answers carry no token log probabilities")
    options: dict[str, Any] = dict(req.options or {})
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


def _image(part: _Part) -> str:
    return image_of_url(
        part.image_url.url if isinstance(part.image_url, _ImageUrl) else part.image_url or ""
    )


def image_of_url(url: str) -> str:
    """The base64 image a ``data:`` URL holds, as Ollama's layer takes it; a remote URL is
    refused (the gateway fetches nothing)."""
    if url.startswith(("http://", "https://")):
        raise ApiError(400, "unsupported", _REMOTE_IMAGE)
    data = next((url[len(p) :] for p in _DATA_PREFIXES if url[: len(p)].lower() == p), None)
    if data is None:
        raise ApiError(
            400,
            "bad_request",
            "invalid image input: an image_url is a data: URL of a JPEG, PNG or WebP image"
            " (data:image/png;base64,...)",
        )
    check_images([data])
    return data


def _content(m: _Message) -> tuple[str, list[str] | None]:
    if m.content is None or isinstance(m.content, str):
        return m.content or "", None
    texts: list[str] = []
    images: list[str] = []
    for part in m.content:
        if part.type == "text" and part.text is not None:
            texts.append(part.text)
        elif part.type == "image_url":
            images.append(_image(part))
        else:
            raise ApiError(
                400, "unsupported", f"content parts of type '{part.type}' are not supported"
            )
    return "".join(texts), images or None


def _note_calls(names: dict[str, str], m: _Message) -> None:
    """Add the calls of ``m`` to ``names`` (call id -> function name), so that a later tool
    result finds its call's name as Ollama's layer does: the last message with the id wins
    (and within one message, the first call with it). One pass, not a search per result."""
    names.update((call.id, call.function.name) for call in reversed(m.tool_calls or ()) if call.id)


def _chat_message(m: _Message, names: dict[str, str]) -> ChatMessage:
    text, images = _content(m)
    calls = [
        ToolCall(
            name=call.function.name,
            arguments=(
                arguments_of(call.function.arguments)
                if isinstance(call.function.arguments, str)
                else call.function.arguments or {}
            ),
            id=call.id,
            index=position,
        )
        for position, call in enumerate(m.tool_calls or ())
    ]
    tool_name = None
    if m.role.lower() == "tool":
        tool_name = m.name or (names.get(m.tool_call_id) if m.tool_call_id else None)
    return message(
        m.role,
        text,
        images=images,
        tool_calls=calls or None,
        tool_name=tool_name,
        tool_call_id=m.tool_call_id if m.role.lower() == "tool" else None,
    )


# Ollama's think levels for OpenAI's efforts (thinkFromReasoningEffort in Ollama's layer).
_THINK: Final[dict[str, bool | str]] = {
    "none": False,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "max": "max",
    "xhigh": "max",
    "ultra": "max",
}


def _think(req: _Chat) -> bool | str | None:
    return think_of_effort(
        req.reasoning.effort if req.reasoning is not None else req.reasoning_effort
    )


def think_of_effort(effort: str | None) -> bool | str | None:
    """OpenAI's reasoning effort as Ollama's ``think`` (`_THINK`); None when not given."""
    if not effort:
        return None
    if effort not in _THINK:
        raise ApiError(
            400,
            "bad_request",
            f"invalid reasoning value: {shown(effort)} (must be one of {', '.join(_THINK)})",
        )
    return _THINK[effort]


def _format(response_format: _ResponseFormat | None) -> OutputFormat | None:
    if response_format is None:
        return None
    kind = response_format.type.strip().lower()
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        schema = response_format.json_schema
        if schema is None or schema.schema is None:
            raise ApiError(
                400, "bad_request", "response_format json_schema needs json_schema.schema"
            )
        return schema.schema
    refuse(f"response_format type '{response_format.type}'", True)
    return None


def _tools(tools: list[dict[str, Any]] | None, choice: Any) -> list[dict[str, Any]] | None:
    if choice == "none":
        return None
    return tools or None


def _tool_choice(choice: Any) -> dict[str, Any]:
    """The option that carries a forcing ``tool_choice`` (see the module docstring)."""
    if choice is None or choice in ("auto", "none"):
        return {}
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        return {"tool_choice": choice}
    raise ApiError(
        400,
        "bad_request",
        f'invalid tool_choice {shown(choice)}: "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
    )


def openai_chat(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/chat/completions``."""
    req = decode(body, _Chat, "chat completion")
    check_count("messages", req.messages, MAX_MESSAGES, "messages")
    options = {**_sampling_options(req), **_tool_choice(req.tool_choice)}
    names: dict[str, str] = {}
    turns = []
    for m in req.messages:
        turns.append(_chat_message(m, names))
        _note_calls(names, m)
    text, messages = conversation(turns)
    ask = route(
        req.model,
        text,
        stream=req.stream,
        timeout_s=timeout_s,
        options=options,
        messages=messages,
        think=_think(req),
        tools=_tools(req.tools, req.tool_choice),
        format=_format(req.response_format),
    )
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Ask(route=ask, include_usage=include_usage)


def _is_token_ids(value: Any) -> bool:
    """A prompt or input of token ids: integers, or lists of them."""
    return isinstance(value, list) and any(
        isinstance(item, int) or (isinstance(item, list) and item) for item in value
    )


def openai_completion(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/completions`` (legacy): one prompt (a list must hold exactly one); a
    ``suffix`` fills in between (the model needs ``insert``)."""
    req = decode(body, _Completion, "completion")
    options = _sampling_options(req)
    prompt = req.prompt
    refuse("token-id prompts", _is_token_ids(prompt), _TOKEN_IDS)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "unsupported", "exactly one prompt per request is supported")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "bad_request", "invalid completion request: prompt is a string")
    ask = route(
        req.model,
        prompt,
        stream=req.stream,
        timeout_s=timeout_s,
        options=options,
        suffix=req.suffix or None,
    )
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Ask(route=ask, include_usage=include_usage)


def openai_embeddings(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/embeddings``: one task for the whole batch (``input`` a string, which may be
    empty, or a non-empty list of strings); ``encoding_format`` ``float`` or ``base64``;
    ``user`` is ignored."""
    req = decode(body, _Embeddings, "embeddings")
    encoding = (req.encoding_format or "float").lower()
    if encoding not in ("float", "base64"):
        raise ApiError(
            400,
            "bad_request",
            f"Invalid value for 'encoding_format' = {req.encoding_format}."
            " Supported values: ['float', 'base64'].",
        )
    refuse("token-id input", _is_token_ids(req.input), _TOKEN_IDS)
    value = req.input
    inputs = [value] if isinstance(value, str) else value
    if not isinstance(inputs, list) or not inputs or not all(isinstance(t, str) for t in inputs):
        raise ApiError(400, "bad_request", "invalid input: a string or a list of strings")
    ask = embedding_route(
        req.model,
        inputs,
        timeout_s=timeout_s,
        dimensions=req.dimensions if req.dimensions and req.dimensions > 0 else None,
    )
    return Ask(route=ask, base64_vectors=encoding == "base64")
