"""OpenAI's Responses API, answers: what the fleet replies, as ``/v1/responses`` writes it.

One ``response`` object (``id`` ``resp_<task id>``, ``status`` ``completed``, or
``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens`` at the token limit;
``usage`` ``input_tokens`` / ``output_tokens`` / ``total_tokens``; the request's own fields
repeated, `services.gateway.common.Ask.echo`), its ``output`` items in the order Ollama's
layer writes them: a ``reasoning`` item (the thinking as its ``summary_text``), one
``function_call`` per call (``call_id``, ``name``, ``arguments`` as JSON text), and a
``message`` with one ``output_text`` part.

Streamed (``"stream": true``), Server-Sent Events with their ``event:`` names and a
``sequence_number``: ``response.created``, ``response.in_progress``; for each item
``response.output_item.added``, its content (``response.reasoning_summary_text.delta`` /
``.done``; ``response.content_part.added``, ``response.output_text.delta`` / ``.done``,
``response.content_part.done``; ``response.function_call_arguments.delta`` / ``.done``) and
``response.output_item.done``; then ``response.completed`` with the whole response. Errors are
OpenAI's ``{"error": {...}}``, a streamed one an ``error`` event. Pure: no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from schemas.route import RouteReply, StreamChunk, ToolCall
from services.gateway.common import encoder
from services.gateway.conversation import arguments_text, call_id
from services.gateway.openai_answers import openai_error


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: ToolCall, task_id: str, position: int, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{task_id}_{position}",
        "type": "function_call",
        "status": status,
        "call_id": call_id(call, task_id, position),
        "name": call.name,
        "arguments": arguments_text(call) if status == "completed" else "",
    }


def _usage(reply: RouteReply) -> dict[str, Any]:
    tokens = reply.tokens
    prompt = (tokens.prompt if tokens else None) or 0
    completion = (tokens.eval if tokens else None) or 0
    return {
        "input_tokens": prompt,
        "output_tokens": completion,
        "total_tokens": prompt + completion,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


@dataclass(slots=True)
class ResponsesShape:
    """``/v1/responses``; the id is the task's. One per request: a stream's open item, its
    items done and its event count are its state."""

    model: str
    echo: dict[str, Any] = field(default_factory=dict)
    created: int = 0
    stream_type: str = "text/event-stream"
    start_on_accept: bool = False
    _seq: int = 0
    _started: bool = False
    _open: str | None = None
    """The type of the item being streamed (``reasoning`` or ``message``), if one is open."""
    _text: str = ""
    """What the open item has said so far."""
    _done: list[dict[str, Any]] = field(default_factory=list)
    _calls: int = 0

    def _response(
        self, task_id: str, status: str, output: list[dict[str, Any]], reply: RouteReply | None
    ) -> dict[str, Any]:
        incomplete = reply is not None and reply.done_reason == "length"
        echo = self.echo
        return {
            "id": f"resp_{task_id}",
            "object": "response",
            "created_at": self.created,
            "completed_at": int(time.time()) if reply is not None else None,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "model": self.model,
            "previous_response_id": None,
            "instructions": echo.get("instructions"),
            "output": output,
            "error": None,
            "tools": echo.get("tools", []),
            "tool_choice": echo.get("tool_choice", "auto"),
            "parallel_tool_calls": True,
            "text": echo.get("text", {"format": {"type": "text"}}),
            "temperature": echo.get("temperature", 1.0),
            "top_p": echo.get("top_p", 1.0),
            "max_output_tokens": echo.get("max_output_tokens"),
            "reasoning": echo.get("reasoning"),
            "truncation": "disabled",
            "store": False,
            "background": False,
            "metadata": {},
            "usage": _usage(reply) if reply is not None else None,
        }

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {"type": kind, "sequence_number": self._seq, **payload}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(data) + b"\n\n"

    def _begin(self, task_id: str) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        created = self._response(task_id, "in_progress", [], None)
        return [
            self._event("response.created", {"response": created}),
            self._event("response.in_progress", {"response": created}),
        ]

    def _item_id(self, task_id: str, kind: str) -> str:
        return f"{'rs' if kind == 'reasoning' else 'msg'}_{task_id}_{len(self._done)}"

    def _close(self, task_id: str) -> list[bytes]:
        """The open item's closing events; it joins the items done."""
        kind, text = self._open, self._text
        if kind is None:
            return []
        index = len(self._done)
        item_id = self._item_id(task_id, kind)
        self._open, self._text = None, ""
        where = {"item_id": item_id, "output_index": index}
        if kind == "reasoning":
            item = {"id": item_id, "type": "reasoning", "summary": [_summary(text)]}
            events = [
                self._event(
                    "response.reasoning_summary_text.done",
                    {**where, "summary_index": 0, "text": text},
                )
            ]
        else:
            item = _message(item_id, text)
            part = {**where, "content_index": 0}
            events = [
                self._event("response.output_text.done", {**part, "text": text, "logprobs": []}),
                self._event("response.content_part.done", {**part, "part": _text_part(text)}),
            ]
        self._done.append(item)
        events.append(
            self._event("response.output_item.done", {"output_index": index, "item": item})
        )
        return events

    def _say(self, task_id: str, kind: str, delta: str) -> list[bytes]:
        events = []
        if self._open != kind:
            events += self._close(task_id)
            self._open = kind
            index, item_id = len(self._done), self._item_id(task_id, kind)
            if kind == "reasoning":
                item: dict[str, Any] = {"id": item_id, "type": "reasoning", "summary": []}
            else:
                item = {**_message(item_id, ""), "status": "in_progress", "content": []}
            events.append(
                self._event("response.output_item.added", {"output_index": index, "item": item})
            )
            if kind == "message":
                events.append(
                    self._event(
                        "response.content_part.added",
                        {
                            "item_id": item_id,
                            "output_index": index,
                            "content_index": 0,
                            "part": _text_part(""),
                        },
                    )
                )
        self._text += delta
        where = {"item_id": self._item_id(task_id, kind), "output_index": len(self._done)}
        if kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_summary_text.delta",
                    {**where, "summary_index": 0, "delta": delta},
                )
            )
        else:
            events.append(
                self._event(
                    "response.output_text.delta",
                    {**where, "content_index": 0, "delta": delta, "logprobs": []},
                )
            )
        return events

    def _call_events(self, calls: Sequence[ToolCall], task_id: str) -> list[bytes]:
        events = self._close(task_id)
        for call in calls:
            index = len(self._done)
            done = _call_item(call, task_id, self._calls, "completed")
            self._calls += 1
            where = {"item_id": done["id"], "output_index": index}
            events += [
                self._event(
                    "response.output_item.added",
                    {
                        "output_index": index,
                        "item": {**done, "status": "in_progress", "arguments": ""},
                    },
                ),
                self._event(
                    "response.function_call_arguments.delta", {**where, "delta": done["arguments"]}
                ),
                self._event(
                    "response.function_call_arguments.done",
                    {**where, "arguments": done["arguments"]},
                ),
                self._event("response.output_item.done", {"output_index": index, "item": done}),
            ]
            self._done.append(done)
        return events

    def piece(self, chunk: StreamChunk) -> bytes | None:
        if not (chunk.response or chunk.thinking or chunk.tool_calls):
            return None
        events = self._begin(chunk.task_id)
        if chunk.thinking:
            events += self._say(chunk.task_id, "reasoning", chunk.thinking)
        if chunk.response:
            events += self._say(chunk.task_id, "message", chunk.response)
        if chunk.tool_calls:
            events += self._call_events(chunk.tool_calls, chunk.task_id)
        return b"".join(events)

    def end(self, reply: RouteReply) -> bytes:
        events = self._begin(reply.task_id)
        unsent = (reply.tool_calls or [])[self._calls :]
        if unsent:
            events += self._call_events(unsent, reply.task_id)
        events += self._close(reply.task_id)
        response = self._response(reply.task_id, "completed", self._done, reply)
        events.append(self._event("response.completed", {"response": response}))
        return b"".join(events)

    def whole(self, reply: RouteReply) -> bytes:
        output: list[dict[str, Any]] = []
        if reply.thinking:
            output.append(
                {
                    "id": f"rs_{reply.task_id}_0",
                    "type": "reasoning",
                    "summary": [_summary(reply.thinking)],
                }
            )
        output += [
            _call_item(call, reply.task_id, position, "completed")
            for position, call in enumerate(reply.tool_calls or ())
        ]
        if reply.response or not reply.tool_calls:
            output.append(_message(f"msg_{reply.task_id}_{len(output)}", reply.response or ""))
        return encoder.encode(self._response(reply.task_id, "completed", output, reply))

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode(openai_error(status, code, message))

    def stream_error(self, code: str, message: str) -> bytes:
        return self._event("error", {"code": code, "message": message, "param": None})


def _summary(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def _message(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "status": "completed",
        "role": "assistant",
        "content": [_text_part(text)],
    }
