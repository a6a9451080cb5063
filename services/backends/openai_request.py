"""Request bodies for OpenAI-compatible servers, from a task in Ollama's terms. Pure.

Options become request fields, base64 images ``image_url`` content parts, tool calls OpenAI's
``function`` objects with arguments as JSON text, ``format`` a ``response_format``.
``keep_alive`` has no counterpart (these servers keep their model loaded for as long as they
run) and is dropped.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from schemas.work import ChatMessage, OutputFormat, ToolCall, Work

# Ollama's option names mapped to request fields. The first group is OpenAI's own; the rest
# are the sampling fields llama.cpp's server takes under Ollama's very names (its
# ``/completion`` parameters, accepted by its chat API too), and LM Studio and vLLM take
# most of them; vLLM calls the repeat penalty ``repetition_penalty``, so both names go. A
# server ignores fields it does not know (llama.cpp, vLLM, Ollama do). Options fixed when a
# server loads its model (``num_ctx``, ``num_gpu``, ``num_thread``, ...) have no request
# field and are dropped.
_OPTION_FIELDS: dict[str, tuple[str, ...]] = {
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "seed": ("seed",),
    "stop": ("stop",),
    "num_predict": ("max_tokens",),
    "max_tokens": ("max_tokens",),
    "presence_penalty": ("presence_penalty",),
    "frequency_penalty": ("frequency_penalty",),
    "top_k": ("top_k",),
    "min_p": ("min_p",),
    "typical_p": ("typical_p",),
    "repeat_penalty": ("repeat_penalty", "repetition_penalty"),
    "repeat_last_n": ("repeat_last_n",),
    "mirostat": ("mirostat",),
    "mirostat_tau": ("mirostat_tau",),
    "mirostat_eta": ("mirostat_eta",),
    "num_keep": ("n_keep",),
    # Not Ollama's: OpenAI's own choice among the tools ("auto", "none", "required", or one
    # function), for a caller that has it (Ollama ignores an option it does not know).
    "tool_choice": ("tool_choice",),
}


def chat_body(model: str, work: Work) -> dict[str, Any]:
    """A streamed ``/chat/completions`` request (with usage asked for) for one generation: the
    conversation, or the prompt (with its images) as one user message. ``keep_alive`` has
    no field here, and a ``suffix`` is the caller's to refuse."""
    conversation = (
        _conversation(work.messages)
        if work.messages
        else [_message(ChatMessage(role="user", content=work.prompt, images=work.images or None))]
    )
    body: dict[str, Any] = {
        "model": model,
        "messages": conversation,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    for name, value in (work.options or {}).items():
        for target in _OPTION_FIELDS.get(name, ()):
            body[target] = value
    if isinstance(work.think, str):
        body["reasoning_effort"] = work.think  # how OpenAI's API (and Ollama's /v1) say it
    if work.tools:
        body["tools"] = work.tools
    if work.format is not None:
        body["response_format"] = _response_format(work.format)
    return body


def embeddings_body(model: str, work: Work) -> dict[str, Any]:
    """One ``/embeddings`` request for every input, vectors asked for as floats; of the
    rest only ``dimensions`` has a field in OpenAI's request."""
    body: dict[str, Any] = {"model": model, "input": work.input or [], "encoding_format": "float"}
    if work.dimensions is not None:
        body["dimensions"] = work.dimensions
    return body


def _conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in OpenAI's shape. A tool turn without a call id (a conversation in
    Ollama's terms, which has none) answers the earliest unanswered call of its tool in the
    assistant turn before it, or else the earliest unanswered call: OpenAI-compatible servers
    want every tool turn tied to a call of the assistant turn before it."""
    shaped: list[dict[str, Any]] = []
    waiting: list[tuple[str, str]] = []  # (call id, tool name) not answered yet
    for message in messages:
        if message.role == "assistant" and message.tool_calls:
            waiting = [(_call_id(c), c.name) for c in message.tool_calls]
        elif message.role == "tool":
            call_id = message.tool_call_id
            if call_id is None:
                named = [w for w in waiting if w[1] == message.tool_name]
                if named or waiting:
                    call_id = (named or waiting)[0][0]
            waiting = [w for w in waiting if w[0] != call_id]
            shaped.append(_tool_message(message, call_id))
            continue
        shaped.append(_message(message))
    return shaped


def _message(message: ChatMessage) -> dict[str, Any]:
    shaped: dict[str, Any] = {"role": message.role}
    if message.images:
        shaped["content"] = [
            {"type": "text", "text": message.content},
            *(
                {"type": "image_url", "image_url": {"url": _data_url(image)}}
                for image in message.images
            ),
        ]
    else:
        shaped["content"] = message.content
    if message.tool_calls:
        shaped["tool_calls"] = [
            {
                "id": _call_id(call),
                "type": "function",
                "function": {
                    "name": call.name,
                    "arguments": call.arguments
                    if isinstance(call.arguments, str)
                    else json.dumps(call.arguments, ensure_ascii=False),
                },
            }
            for call in message.tool_calls
        ]
    return shaped


def _tool_message(message: ChatMessage, call_id: str | None) -> dict[str, Any]:
    shaped: dict[str, Any] = {"role": "tool", "content": message.content}
    if call_id is not None:
        shaped["tool_call_id"] = call_id
    if message.tool_name:
        shaped["name"] = message.tool_name  # templates that name the tool read it
    return shaped


def _call_id(call: ToolCall) -> str:
    return call.id or f"call_{call.index}"


def _data_url(image: str) -> str:
    return f"data:{_mime_type(image)};base64,{image}"


def _mime_type(image: str) -> str:
    """The image type of base64 data, from its first bytes; PNG when they say nothing known
    (servers decode the bytes themselves, the type is a label)."""
    try:
        head = base64.b64decode(image[:24] + "=" * (-len(image[:24]) % 4))
    except (binascii.Error, ValueError):
        return "image/png"
    if head.startswith(b"\x89PNG"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "image/gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "image/webp"
    return "image/png"


def _response_format(format: OutputFormat) -> dict[str, Any]:
    """Ollama's ``format`` as ``response_format``: "json" is any JSON object, a schema is
    OpenAI's strict ``json_schema`` (llama.cpp turns it into a grammar)."""
    if format == "json":
        return {"type": "json_object"}
    return {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": format, "strict": True},
    }
