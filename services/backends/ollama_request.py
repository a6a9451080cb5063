"""Request bodies for Ollama. Pure.

The project's wire types follow Ollama's, so requests go nearly as they came: every option,
``keep_alive``, ``think``, ``format``, images and tools as given. Tools exist only in
``/api/chat``, so a task with tools but no conversation goes there as one user message (with
its images); ``suffix`` exists only in ``/api/generate`` and goes only there.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.route import ChatMessage, OutputFormat, ToolCall


def generate_body(
    model: str,
    prompt: str,
    *,
    options: dict[str, Any] | None,
    messages: list[ChatMessage] | None,
    think: bool | str | None,
    images: list[str] | None,
    tools: list[dict[str, Any]] | None,
    format: OutputFormat | None,
    keep_alive: float | str | None,
    suffix: str | None,
) -> tuple[str, dict[str, Any]]:
    """The path (``/api/chat`` or ``/api/generate``) and the streamed request of one
    generation."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if messages or tools:
        conversation = messages or [ChatMessage(role="user", content=prompt, images=images or None)]
        body["messages"] = [_message(m) for m in conversation]
        if tools:
            body["tools"] = tools
        path = "/api/chat"
    else:
        body["prompt"] = prompt
        if images:
            body["images"] = images
        if suffix:
            body["suffix"] = suffix
        path = "/api/generate"
    if options:
        body["options"] = options
    if think is not None:
        body["think"] = think
    if format is not None:
        body["format"] = format
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    return path, body


def embed_body(
    model: str,
    inputs: list[str],
    *,
    truncate: bool | None,
    dimensions: int | None,
    keep_alive: float | str | None,
    options: dict[str, Any] | None,
) -> dict[str, Any]:
    """One ``/api/embed`` request for every input."""
    body: dict[str, Any] = {"model": model, "input": inputs}
    if truncate is not None:
        body["truncate"] = truncate
    if dimensions is not None:
        body["dimensions"] = dimensions
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if options:
        body["options"] = options
    return body


def legacy_embed_body(
    model: str, text: str, keep_alive: float | str | None, options: dict[str, Any] | None
) -> dict[str, Any]:
    """One ``/api/embeddings`` request: one input, no ``truncate`` or ``dimensions``."""
    body: dict[str, Any] = {"model": model, "prompt": text}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    if options:
        body["options"] = options
    return body


def _message(message: ChatMessage) -> dict[str, Any]:
    """A turn in ``/api/chat``'s shape: tool calls as ``{"function": {"name", "arguments"}}``
    with the arguments an object (text from an OpenAI client that is a JSON object is
    decoded; other text goes as it came, for Ollama to refuse in its words). Call ids go as
    ``id`` and ``tool_call_id`` when the client gave them: newer Ollama versions read them,
    older ones ignore fields they do not know."""
    shaped: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.images:
        shaped["images"] = message.images
    if message.tool_calls:
        shaped["tool_calls"] = [_call(call) for call in message.tool_calls]
    if message.tool_name:
        shaped["tool_name"] = message.tool_name
    if message.tool_call_id:
        shaped["tool_call_id"] = message.tool_call_id
    return shaped


def _call(call: ToolCall) -> dict[str, Any]:
    shaped: dict[str, Any] = {
        "function": {"name": call.name, "arguments": _arguments(call.arguments)}
    }
    if call.id:
        shaped["id"] = call.id
    return shaped


def _arguments(arguments: dict[str, Any] | str) -> dict[str, Any] | str:
    if isinstance(arguments, dict):
        return arguments
    try:
        decoded = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return arguments
    return decoded if isinstance(decoded, dict) else arguments
