"""Anthropic's Messages API, requests: ``/v1/messages`` and ``/v1/messages/count_tokens``
bodies to route requests, mapped the way Ollama's own Anthropic layer maps them
(``anthropic/anthropic.go`` in Ollama's source), so that Claude Code and the ``anthropic``
SDK run on the fleet's models.

- ``system`` (a text, or text blocks joined) is the first message, ``role: "system"``; a
  message of role ``system`` (which newer clients send among the turns) is one too.
- Content blocks: ``text``; ``image`` with a ``base64`` source (a JPEG, PNG, GIF or WebP),
  which becomes the message's ``images`` (a ``url`` source is refused: the gateway fetches
  nothing); an assistant's ``tool_use`` is a tool call (its ``id``, ``name`` and ``input``);
  a user's ``tool_result`` is a ``tool`` message answering that call (its text, or its text
  and image blocks), placed before the rest of the user's turn, as Ollama places it; an
  assistant's ``thinking`` and ``redacted_thinking`` are accepted and not carried (chat
  messages have no field for them).
- ``max_tokens`` (required, as Anthropic requires it) is ``num_predict``; ``temperature``,
  ``top_p`` and ``top_k`` keep their names in ``options``; ``stop_sequences`` is ``stop``.
- ``tools`` (``name``, ``description``, ``input_schema``) are function tools; Anthropic's
  server tools (web search, code execution, computer use…) are refused by name.
  ``tool_choice`` ``none`` sends no tools, ``auto`` is the default, ``any`` and ``tool``
  travel as the option ``tool_choice`` (OpenAI's ``required`` and named function), as the
  OpenAI API's do: an OpenAI-compatible backend holds the model to it, Ollama ignores it.
- ``thinking`` ``enabled`` (or ``adaptive``) is ``think: true``, ``disabled`` false; without
  it, ``output_config.effort`` is a think level.
- ``metadata`` and ``service_tier`` are accepted and not carried; ``mcp_servers`` and
  ``container`` are refused by name.

``count_tokens`` is an estimate, as Ollama's is: a quarter of the characters of the system
prompt, the messages and the tools (no backend has a tokenizer the gateway can ask).

Answers are written by `services.gateway.anthropic_answers`. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from schemas.route import MAX_MESSAGES, ChatMessage, ToolCall
from services.gateway.common import ApiError, Ask, check_count, decode, encoder, refuse, shown
from services.gateway.conversation import (
    check_images,
    conversation,
    forced_tool,
    function_tool,
    message,
    route,
    tool_result,
)

_IMAGE_TYPES: Final = ("image/jpeg", "image/png", "image/gif", "image/webp")
# Ollama's think levels for Anthropic's ``output_config.effort`` (xhigh is high, as there).
_EFFORTS: Final[dict[str, bool | str]] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "max",
}


class _Source(msgspec.Struct):
    type: str = ""
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class _Block(msgspec.Struct):
    type: str
    text: str | None = None
    source: _Source | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[_Block] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class _Message(msgspec.Struct):
    role: str
    content: str | list[_Block]


class _Tool(msgspec.Struct):
    name: str = ""
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class _ToolChoice(msgspec.Struct):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Thinking(msgspec.Struct):
    type: str
    budget_tokens: int | None = None


class _OutputConfig(msgspec.Struct):
    effort: str | None = None


class _Conversation(msgspec.Struct):
    """What ``count_tokens`` reads; a messages request has it all."""

    model: str = ""
    messages: list[_Message] = msgspec.field(default_factory=list)
    system: str | list[_Block] | None = None
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    output_config: _OutputConfig | None = None
    mcp_servers: Any = None
    container: Any = None


class _Messages(_Conversation):
    max_tokens: int | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None


def _image(source: _Source | None) -> str:
    if source is None or source.type != "base64":
        kind = "none" if source is None else shown(source.type)
        raise ApiError(
            400,
            "unsupported",
            f"image source type {kind} is not supported by the Coordinator gateway: send the"
            ' image inline ({"type": "base64", "media_type": "image/png", "data": ...})',
        )
    if (source.media_type or "").lower() not in _IMAGE_TYPES:
        raise ApiError(
            400,
            "bad_request",
            f"invalid image media_type {shown(source.media_type)}: one of "
            f"{', '.join(_IMAGE_TYPES)}",
        )
    data = source.data or ""
    check_images([data])
    return data


def _result(block: _Block) -> tuple[str, list[str]]:
    """A ``tool_result``'s content: its text and its images."""
    if block.content is None or isinstance(block.content, str):
        return block.content or "", []
    texts, images = [], []
    for part in block.content:
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "image":
            images.append(_image(part.source))
        else:
            raise ApiError(
                400,
                "unsupported",
                f"tool_result content blocks of type {shown(part.type)} are not supported",
            )
    return "".join(texts), images


def _turn(m: _Message, names: dict[str, str]) -> list[ChatMessage]:
    """One Anthropic message as chat turns: a user's tool results first (one ``tool`` turn
    each), then what it says. ``names``: the tool calls seen so far, by id."""
    role = m.role.lower()
    if role not in ("user", "assistant", "system"):
        raise ApiError(
            400,
            "bad_request",
            f"invalid message role {shown(m.role)}: 'user', 'assistant' or 'system'",
        )
    blocks = [_Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    texts: list[str] = []
    images: list[str] = []
    calls: list[ToolCall] = []
    results: list[ChatMessage] = []
    for block in blocks:
        kind = block.type
        if kind == "text":
            texts.append(block.text or "")
        elif kind == "image":
            images.append(_image(block.source))
        elif kind == "tool_use" and role == "assistant":
            if not block.id or not block.name:
                raise ApiError(400, "bad_request", "a tool_use block needs its 'id' and 'name'")
            names[block.id] = block.name
            calls.append(
                ToolCall(
                    name=block.name, arguments=block.input or {}, id=block.id, index=len(calls)
                )
            )
        elif kind == "tool_result" and role == "user":
            if not block.tool_use_id:
                raise ApiError(400, "bad_request", "a tool_result block needs its 'tool_use_id'")
            text, result_images = _result(block)
            results.append(tool_result(text, result_images, block.tool_use_id, names))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise ApiError(
                400,
                "unsupported",
                f"{role} content blocks of type {shown(kind)} are not supported by the"
                " Coordinator gateway",
            )
    text = "".join(texts)
    if text or images or calls or not results:
        results.append(message(role, text, images=images or None, tool_calls=calls or None))
    return results


def _system(system: str | list[_Block] | None) -> list[ChatMessage]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    else:
        for block in system:
            if block.type != "text":
                raise ApiError(
                    400, "bad_request", f"system blocks are text blocks, not {shown(block.type)}"
                )
        text = "".join(block.text or "" for block in system)
    return [message("system", text)] if text else []


def _tools(req: _Conversation) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """The function tools and the option that carries a forcing ``tool_choice``."""
    tools = []
    for tool in req.tools or ():
        if tool.type not in (None, "custom"):
            raise ApiError(
                400,
                "unsupported",
                f"Anthropic's server tool {shown(tool.type)} is not supported by the"
                " Coordinator gateway: declare the tool with a name and an input_schema",
            )
        if not tool.name:
            raise ApiError(400, "bad_request", "every tool needs a 'name'")
        tools.append(function_tool(tool.name, tool.description, tool.input_schema))
    choice = req.tool_choice
    if choice is None or choice.type == "auto":
        return tools or None, {}
    if choice.type == "none":
        return None, {}
    if choice.type == "any":
        return tools or None, forced_tool()
    if choice.type == "tool":
        if not choice.name or choice.name not in {tool.name for tool in req.tools or ()}:
            raise ApiError(
                400,
                "bad_request",
                f"tool_choice names tool {shown(choice.name)}, which is not among the tools",
            )
        return tools or None, forced_tool(choice.name)
    raise ApiError(
        400,
        "bad_request",
        f"invalid tool_choice type {shown(choice.type)}: 'auto', 'any', 'tool' or 'none'",
    )


def _think(req: _Conversation) -> bool | str | None:
    if req.thinking is not None:
        kind = req.thinking.type
        if kind in ("enabled", "adaptive"):
            return True
        if kind == "disabled":
            return False
        raise ApiError(
            400,
            "bad_request",
            f"invalid thinking type {shown(kind)}: 'enabled', 'adaptive' or 'disabled'",
        )
    effort = (req.output_config.effort or "").strip().lower() if req.output_config else ""
    return _EFFORTS.get(effort)


def _conversation(req: _Conversation) -> list[ChatMessage]:
    refuse("mcp_servers", req.mcp_servers, "tools run on the client's side")
    refuse("container", req.container)
    check_count("messages", req.messages, MAX_MESSAGES, "messages")
    names: dict[str, str] = {}
    turns = _system(req.system)
    for m in req.messages:
        turns += _turn(m, names)
    return turns


def anthropic_messages(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/messages``."""
    req = decode(body, _Messages, "messages")
    if req.max_tokens is None:
        raise ApiError(400, "bad_request", "max_tokens: Field required")
    if req.max_tokens < 1:
        raise ApiError(400, "bad_request", "max_tokens: must be at least 1")
    options: dict[str, Any] = {"num_predict": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        value = getattr(req, name)
        if value is not None:
            options[name] = value
    if req.stop_sequences:
        options["stop"] = req.stop_sequences
    tools, forcing = _tools(req)
    text, messages = conversation(_conversation(req))
    ask = route(
        req.model,
        text,
        stream=req.stream,
        timeout_s=timeout_s,
        options={**options, **forcing},
        messages=messages,
        think=_think(req),
        tools=tools,
    )
    return Ask(route=ask)


def anthropic_count_tokens(body: bytes) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": N}``, estimated (see the
    module's docstring) from a request checked as a messages request is."""
    req = decode(body, _Conversation, "count_tokens")
    if not req.model.strip():
        raise ApiError(400, "bad_request", "model is required")
    turns = _conversation(req)
    tools, _ = _tools(req)
    _think(req)
    characters = sum(len(t.content) + len(t.role) for t in turns)
    characters += sum(len(encoder.encode(c.arguments)) for t in turns for c in t.tool_calls or ())
    characters += len(encoder.encode(tools)) if tools else 0
    return {"input_tokens": max(characters // 4, 1 if turns else 0)}
