"""Conversations and the route requests they become, the same for Ollama's and OpenAI's APIs:
roles, the conversation as one text (`chat_prompt`), images, output formats and tool calls.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from schemas.route import ChatMessage, OutputFormat, RouteRequest, ToolCall, image_problem
from services.gateway.common import ApiError, check_limits, encoder, require_model, shown

# Roles as the chat APIs name them -> the wire's; OpenAI's newer "developer" is a system prompt.
_ROLES: Final[dict[str, Any]] = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_ROLE_LABELS: Final = {"system": "System", "user": "User", "assistant": "Assistant", "tool": "Tool"}


def message(role: str, content: str, **fields: Any) -> ChatMessage:
    """One turn; roles compare case-insensitively, as Ollama reads them."""
    wire_role = _ROLES.get(role.lower())
    if wire_role is None:
        raise ApiError(400, "bad_request", f"unknown message role {shown(role)}")
    return ChatMessage(role=wire_role, content=content, **fields)


def _turn_text(m: ChatMessage) -> str:
    text = m.content
    if m.images:
        count = len(m.images)
        text = f"{text} [{count} image{'s' if count > 1 else ''}]".lstrip()
    for call in m.tool_calls or ():
        text = f"{text} [calls {call.name}({arguments_text(call)})]".lstrip()
    return text


def chat_prompt(messages: Sequence[ChatMessage]) -> str:
    """A conversation as one text, for statistics, the judge and workers that predate
    ``messages``: a lone user message is itself; otherwise system messages first, then the
    turns in order, each as ``Role: content``, blank-line separated, ending ``Assistant:``.
    Images show as ``[N images]``, tool calls as ``[calls name({...})]``, a tool's result as
    ``Tool (name): result``."""
    if len(messages) == 1 and messages[0].role == "user":
        return _turn_text(messages[0])
    ordered = [m for m in messages if m.role == "system"] + [
        m for m in messages if m.role != "system"
    ]
    turns = []
    for m in ordered:
        label = _ROLE_LABELS[m.role]
        if m.role == "tool" and m.tool_name:
            label = f"{label} ({m.tool_name})"
        turns.append(f"{label}: {_turn_text(m)}")
    return "\n\n".join([*turns, "Assistant:"])


def conversation(messages: list[ChatMessage]) -> tuple[str, list[ChatMessage]]:
    """The prompt text of ``messages`` and the messages; at least one must say something (a
    text, an image or a tool call)."""
    if not any(m.content.strip() or m.images or m.tool_calls for m in messages):
        raise ApiError(400, "bad_request", "messages must hold at least one non-empty message")
    return chat_prompt(messages), messages


def route(
    model: str, prompt: str, *, stream: bool, timeout_s: float | None, **work: Any
) -> RouteRequest:
    """A route request that waits for its task; ``work`` are `RouteRequest`'s work fields.
    Refused (a 400) when it holds more than a request may (`check_limits`)."""
    require_model(model)
    if not prompt.strip():
        raise ApiError(400, "bad_request", "the prompt (or every message) is empty")
    if not work.get("options"):
        work["options"] = None
    return check_limits(
        RouteRequest(
            prompt=prompt, model=model, wait=True, stream=stream, timeout_s=timeout_s, **work
        )
    )


def check_images(images: list[str] | None, where: str = "") -> list[str] | None:
    """Base64 images as Ollama takes them (no ``data:`` prefix); None for none."""
    problem = image_problem(images, where)
    if problem is not None:
        raise ApiError(400, "bad_request", problem)
    return images or None


def output_format(value: Any) -> OutputFormat | None:
    """Ollama's ``format``: ``"json"``, a JSON schema object, or none (absent, null, ``""``);
    anything else is refused in Ollama's words."""
    if value is None or value == "":
        return None
    if value == "json":
        return "json"
    if isinstance(value, dict):
        return value
    text = encoder.encode(encoder.encode(value).decode()).decode()
    if len(text) > 80:
        text = f"{text[:79]}…"
    raise ApiError(
        400,
        "bad_request",
        f'invalid format: {text}; expected "json" or a valid JSON Schema object',
    )


_THINK_LEVELS: Final = ("high", "medium", "low", "max")


def think(value: bool | str | None) -> bool | str | None:
    """Ollama's ``think``: true, false, or a level; another string is refused in Ollama's
    words (before a task is routed, not as a backend failure)."""
    if isinstance(value, str) and value not in _THINK_LEVELS:
        raise ApiError(
            400,
            "bad_request",
            f'invalid think value: "{value[:80]}" (must be "high", "medium", "low", "max", true,'
            " or false)",
        )
    return value


# -- tool calls ---------------------------------------------------------------------------------


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None) -> Any:
    """A tool as the chat API takes it (``{"type": "function", "function": {...}}``), for the
    APIs that declare tools otherwise (Anthropic's ``input_schema``, the Responses API's flat
    function); no parameters is an object without properties."""
    function: dict[str, Any] = {
        "name": name,
        "parameters": parameters or {"type": "object", "properties": {}},
    }
    if description:
        function["description"] = description
    return {"type": "function", "function": function}


def forced_tool(name: str | None = None) -> dict[str, Any]:
    """The option that holds the model to calling a tool (any, or the one ``name``d), as the
    chat API's ``tool_choice`` says it: an OpenAI-compatible backend holds the model to it,
    Ollama ignores it."""
    choice: Any = "required" if name is None else {"type": "function", "function": {"name": name}}
    return {"tool_choice": choice}


def tool_result(
    text: str, images: list[str] | None, call_id: str, names: dict[str, str]
) -> ChatMessage:
    """A tool's result answering the call ``call_id``, named after that call (``names``: the
    calls seen so far, by id), as Ollama's layers name it."""
    return message(
        "tool", text, images=images or None, tool_name=names.get(call_id), tool_call_id=call_id
    )


def arguments_of(text: str) -> dict[str, Any] | str:
    """OpenAI's ``arguments`` text as the JSON object it holds, or the text as it came when it
    is not one (OpenAI's API allows any text; the model sees it unchanged)."""
    try:
        parsed = msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return text
    return parsed if isinstance(parsed, dict) else text


def arguments_text(call: ToolCall) -> str:
    """A call's arguments as OpenAI's JSON text (compact, keys in the model's order)."""
    if isinstance(call.arguments, str):
        return call.arguments
    return encoder.encode(call.arguments).decode()


def call_id(call: ToolCall, task_id: str, position: int) -> str:
    """The call's own id, else one stable for its task and position: a client that sends the
    conversation back names the same call the same way."""
    return call.id or f"call_{task_id}_{position}"


def embedding_route(
    model: str, inputs: list[str], *, timeout_s: float | None, **work: Any
) -> RouteRequest:
    """One embedding task for the whole batch: ``input`` the texts (one vector each, in
    order), ``prompt`` them joined, as the router would join them, for statistics. Refused
    (a 400) when it holds more than a request may (`check_limits`)."""
    require_model(model)
    if not work.get("options"):
        work["options"] = None
    return check_limits(
        RouteRequest(
            prompt="\n".join(inputs),
            model=model,
            task_type="embedding",
            input=inputs,
            wait=True,
            stream=False,
            timeout_s=timeout_s,
            **work,
        )
    )
