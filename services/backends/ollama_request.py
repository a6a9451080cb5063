"""Request bodies for Ollama. Pure.

The project's wire types follow Ollama's, so requests go nearly as they came: every option,
``keep_alive``, ``think``, ``format``, images and tools as given. Tools exist only in
``/api/chat``, so a task with tools but no conversation goes there as one user message (with
its images); ``suffix`` exists only in ``/api/generate`` and goes only there.
"""

from __future__ import annotations

import json
from typing import Any

from schemas.work import ChatMessage, ToolCall, Work


def generate_body(model: str, work: Work) -> tuple[str, dict[str, Any]]:
    """The path (``/api/chat`` or ``/api/generate``) and the streamed request of one
    generation (streamed whatever ``work.stream`` says: see `services.backends.ollama`)."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if work.messages or work.tools:
        conversation = work.messages or [
            ChatMessage(role="user", content=work.prompt, images=work.images or None)
        ]
        body["messages"] = [_message(m) for m in conversation]
        if work.tools:
            body["tools"] = work.tools
        path = "/api/chat"
    else:
        body["prompt"] = work.prompt
        if work.images:
            body["images"] = work.images
        if work.suffix:
            body["suffix"] = work.suffix
        path = "/api/generate"
    if work.options:
        body["options"] = work.options
    if work.think is not None:
        body["think"] = work.think
    if work.format is not None:
        body["format"] = work.format
    if work.keep_alive is not None:
        body["keep_alive"] = work.keep_alive
    return path, body


def embed_body(model: str, work: Work) -> dict[str, Any]:
    """One ``/api/embed`` request for every input."""
    body: dict[str, Any] = {"model": model, "input": work.input or []}
    if work.truncate is not None:
        body["truncate"] = work.truncate
    if work.dimensions is not None:
        body["dimensions"] = work.dimensions
    if work.keep_alive is not None:
        body["keep_alive"] = work.keep_alive
    if work.options:
        body["options"] = work.options
    return body


def legacy_embed_body(model: str, text: str, work: Work) -> dict[str, Any]:
    """One ``/api/embeddings`` request for ``text``, one of ``work``'s inputs: no
    ``truncate`` or ``dimensions`` (the older API has neither)."""
    body: dict[str, Any] = {"model": model, "prompt": text}
    if work.keep_alive is not None:
        body["keep_alive"] = work.keep_alive
    if work.options:
        body["options"] = work.options
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
