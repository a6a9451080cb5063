"""OpenAI's Responses API, requests: ``/v1/responses`` bodies to route requests, stateless, as
Ollama's own layer maps them (``openai/responses.go`` in Ollama's source), for the ``openai``
client's ``responses.create`` and the Codex CLI.

- ``input``: a text (one user message) or items: messages (``role`` user, system,
  developer or assistant; ``content`` a text or ``input_text``, ``output_text`` and
  ``input_image`` parts, the image a ``data:`` URL), ``function_call`` (an assistant's tool
  call, its ``arguments`` JSON text parsed; consecutive calls join one assistant turn),
  ``function_call_output`` (a ``tool`` message answering the call with that ``call_id``,
  named after it), and ``reasoning`` (accepted, not carried: chat messages have no field).
- ``instructions`` is the first message, ``role: "system"``.
- ``max_output_tokens`` is ``num_predict``; ``temperature`` and ``top_p`` keep their names;
  Ollama's own ``options`` (``num_ctx``…) are carried, as on the chat API.
- ``tools`` of type ``function`` (``name``, ``description``, ``parameters``) are function
  tools, and a ``namespace``'s members are too, each named ``<namespace>.<name>``;
  ``tool_choice`` ``none`` sends none, ``required`` or a named function travels as the
  option ``tool_choice``, as the chat API's does.
- ``reasoning.effort`` is ``think``, as the chat API maps it; ``text.format`` ``json_schema``
  is the ``format`` schema, ``json_object`` ``"json"``.
- Refused by name: what needs state kept between requests (``previous_response_id``,
  ``conversation``, ``store: true``, ``background``, ``item_reference`` items), other tool
  types (web search, file search, computer use…), ``input_file`` parts, other item types.

The request's own fields that a response repeats (instructions, tools, the text format…)
travel in `services.gateway.common.Ask.echo`. Answers are written by
`services.gateway.openai_responses_answers`. Pure: no I/O.
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
    forced_tool,
    function_tool,
    message,
    route,
    tool_result,
)
from services.gateway.openai_api import image_of_url, think_of_effort

_STATEFUL: Final = (
    "the Coordinator gateway keeps no responses between requests: send the whole"
    " conversation as input"
)


class _Part(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: str | None = None
    file_id: str | None = None


class _Item(msgspec.Struct):
    type: str | None = None
    role: str | None = None
    content: str | list[_Part] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[_Part] | None = None


class _Tool(msgspec.Struct):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[_Tool] | None = None
    """A ``namespace``'s member tools."""


class _Format(msgspec.Struct):
    type: str = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class _Text(msgspec.Struct):
    format: _Format | None = None


class _Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class _Responses(msgspec.Struct):
    model: str = ""
    input: str | list[_Item] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[_Tool] | None = None
    tool_choice: Any = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    options: dict[str, Any] | None = None


def _parts(parts: str | list[_Part] | None, where: str) -> tuple[str, list[str]]:
    """A message's or an output's text and images."""
    if parts is None or isinstance(parts, str):
        return parts or "", []
    texts, images = [], []
    for part in parts:
        if part.type in ("input_text", "output_text"):
            texts.append(part.text or "")
        elif part.type == "input_image" and part.image_url:
            images.append(image_of_url(part.image_url))
        elif part.type == "input_image":
            raise ApiError(
                400,
                "unsupported",
                "an input_image needs its image_url (a data: URL); file ids"
                " are not supported by the Coordinator gateway",
            )
        else:
            raise ApiError(
                400,
                "unsupported",
                f"{where} content parts of type {shown(part.type)} are not supported by the"
                " Coordinator gateway",
            )
    check_images(images or None)
    return "".join(texts), images


def _turns(items: list[_Item]) -> list[ChatMessage]:
    turns: list[ChatMessage] = []
    names: dict[str, str] = {}
    for item in items:
        kind = item.type or ("message" if item.role else None)
        if kind == "message":
            text, images = _parts(item.content, "message")
            turns.append(message(item.role or "", text, images=images or None))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise ApiError(400, "bad_request", "a function_call needs its call_id and name")
            names[item.call_id] = item.name
            arguments = arguments_of(item.arguments) if item.arguments else {}
            last = turns[-1] if turns else None
            calls = [*(last.tool_calls or [])] if last and last.role == "assistant" else []
            call = ToolCall(name=item.name, arguments=arguments, id=item.call_id, index=len(calls))
            if last is not None and last.role == "assistant":
                turns[-1] = msgspec.structs.replace(last, tool_calls=[*calls, call])
            else:
                turns.append(message("assistant", "", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise ApiError(400, "bad_request", "a function_call_output needs its call_id")
            text, images = _parts(item.output, "function_call_output")
            turns.append(tool_result(text, images, item.call_id, names))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            refuse("item_reference", True, _STATEFUL)
        else:
            raise ApiError(
                400,
                "unsupported",
                f"input items of type {shown(kind)} are not supported by the Coordinator gateway",
            )
    return turns


def _functions(tool: _Tool, prefix: str = "") -> list[dict[str, Any]]:
    """A tool declaration as function tools: a ``namespace`` is its members, each named
    ``<namespace>.<name>``, as Ollama's layer expands it (a chat tool has a flat name)."""
    if tool.type == "namespace" and tool.name:
        inner = f"{prefix}{tool.name}."
        return [function for member in tool.tools or () for function in _functions(member, inner)]
    if tool.type != "function":
        raise ApiError(
            400,
            "unsupported",
            f"tools of type {shown(tool.type)} are not supported by the Coordinator gateway:"
            " declare a function tool",
        )
    if not tool.name:
        raise ApiError(400, "bad_request", "every function tool needs a 'name'")
    return [function_tool(f"{prefix}{tool.name}", tool.description, tool.parameters)]


def _tools(req: _Responses) -> tuple[list[dict[str, Any]] | None, dict[str, Any]]:
    """The function tools and the option that carries a forcing ``tool_choice``."""
    tools = [function for tool in req.tools or () for function in _functions(tool)]
    choice = req.tool_choice
    if choice is None or choice == "auto":
        return tools or None, {}
    if choice == "none":
        return None, {}
    if choice == "required":
        return tools or None, forced_tool()
    if isinstance(choice, dict) and choice.get("type") == "function" and choice.get("name"):
        return tools or None, forced_tool(str(choice["name"]))
    raise ApiError(
        400,
        "bad_request",
        f'invalid tool_choice {shown(choice)}: "none", "auto", "required" or'
        ' {"type": "function", "name": ...}',
    )


def _format(text: _Text | None) -> OutputFormat | None:
    kind = (text.format.type if text is not None and text.format is not None else "text").lower()
    if kind == "text":
        return None
    if kind == "json_object":
        return "json"
    assert text is not None and text.format is not None
    if kind == "json_schema":
        if text.format.schema is None:
            raise ApiError(400, "bad_request", "text.format json_schema needs its schema")
        return text.format.schema
    raise ApiError(400, "bad_request", f"invalid text.format type {shown(text.format.type)}")


def _echo(body: bytes) -> dict[str, Any]:
    """The request's fields a response repeats, as the client sent them."""
    sent = msgspec.json.decode(body)
    kept = ("instructions", "tools", "tool_choice", "text", "temperature", "top_p")
    echo = {name: sent[name] for name in kept if sent.get(name) is not None}
    for name in ("max_output_tokens", "reasoning"):
        echo[name] = sent.get(name)
    return echo


def openai_responses(body: bytes, *, timeout_s: float | None) -> Ask:
    """``POST /v1/responses``."""
    req = decode(body, _Responses, "responses")
    refuse("previous_response_id", req.previous_response_id, _STATEFUL)
    refuse("conversation", req.conversation, _STATEFUL)
    refuse("store", req.store, _STATEFUL)
    refuse("background", req.background, "a response is answered while the request waits")
    items = [_Item(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    check_count("input", items, MAX_MESSAGES, "items")
    turns = _turns(items)
    if req.instructions:
        turns.insert(0, message("system", req.instructions))
    options: dict[str, Any] = dict(req.options or {})
    if req.max_output_tokens is not None:
        options["num_predict"] = req.max_output_tokens
    for name in ("temperature", "top_p"):
        value = getattr(req, name)
        if value is not None:
            options[name] = value
    tools, forcing = _tools(req)
    text, messages = conversation(turns)
    ask = route(
        req.model,
        text,
        stream=req.stream,
        timeout_s=timeout_s,
        options={**options, **forcing},
        messages=messages,
        think=think_of_effort(req.reasoning.effort if req.reasoning else None),
        tools=tools,
        format=_format(req.text),
    )
    return Ask(route=ask, echo=_echo(body))
