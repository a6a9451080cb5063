"""Anthropic's Messages API, answers: what the fleet replies, as ``/v1/messages`` writes it.

One JSON body, ``{"id": "msg_<task id>", "type": "message", "role": "assistant", "model",
"content": [blocks], "stop_reason", "stop_sequence": null, "usage": {"input_tokens",
"output_tokens"}}``, its blocks in the order Ollama's layer writes them: ``thinking`` (with
an empty ``signature``: no model of the fleet signs its thinking), ``text``, then one
``tool_use`` per call (``id``, ``name``, ``input``). ``stop_reason`` is ``tool_use`` when the
model called tools, ``max_tokens`` at the token limit, else ``end_turn`` (a backend does not
say whether a stop sequence ended the answer).

Streamed (``"stream": true``), Server-Sent Events with their ``event:`` names, as the
``anthropic`` SDK reads them: ``message_start``; for each block ``content_block_start``, its
deltas (``thinking_delta``, ``text_delta``, or one ``input_json_delta`` with a call's whole
input) and ``content_block_stop``; then ``message_delta`` with the ``stop_reason`` and the
usage, and ``message_stop``. Errors are ``{"type": "error", "error": {"type", "message",
"code"}}`` with Anthropic's error types and the project's code (a streamed one as an
``error`` event). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from schemas.route import RouteReply, StreamChunk, ToolCall
from services.gateway.common import encoder
from services.gateway.conversation import arguments_text, call_id

# Anthropic's error types by HTTP status (its API reference, "Errors").
_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, code: str, message: str) -> dict[str, Any]:
    """Anthropic's error body; its type says what kind of failure the status is, ``code`` is
    the project's (a field Anthropic's clients pass over)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": code}}


def _sse(kind: str, payload: dict[str, Any]) -> bytes:
    """One Server-Sent Event with its name, as Anthropic's API sends it."""
    return b"event: " + kind.encode() + b"\ndata: " + encoder.encode(payload) + b"\n\n"


def _tool_use(call: ToolCall, task_id: str, position: int) -> dict[str, Any]:
    arguments = call.arguments if isinstance(call.arguments, dict) else {}
    return {
        "type": "tool_use",
        "id": call_id(call, task_id, position),
        "name": call.name,
        "input": arguments,
    }


def stop_reason(reply: RouteReply, *, called: bool = False) -> str:
    if called or reply.tool_calls or reply.done_reason == "tool_calls":
        return "tool_use"
    if reply.done_reason == "length":
        return "max_tokens"
    return "end_turn"


def _usage(reply: RouteReply) -> dict[str, int]:
    tokens = reply.tokens
    return {
        "input_tokens": (tokens.prompt if tokens else None) or 0,
        "output_tokens": (tokens.eval if tokens else None) or 0,
    }


@dataclass(slots=True)
class AnthropicShape:
    """``/v1/messages``; the id is the task's. One per request: a stream's open block and
    what it has written are its state."""

    model: str
    stream_type: str = "text/event-stream"
    start_on_accept: bool = False
    _started: bool = False
    _open: str | None = None
    """The type of the block being streamed (``thinking`` or ``text``), if one is open."""
    _index: int = 0
    """The index of the open block, or of the next one."""
    _calls: int = 0

    def _message(self, task_id: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"msg_{task_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
        }

    def _begin(self, task_id: str) -> list[bytes]:
        if self._started:
            return []
        self._started = True
        start = self._message(task_id, [])
        start["usage"] = {"input_tokens": 0, "output_tokens": 0}
        return [_sse("message_start", {"type": "message_start", "message": start})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        self._index += 1
        return [
            _sse("content_block_stop", {"type": "content_block_stop", "index": self._index - 1})
        ]

    def _delta(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self._open != kind:
            events += self._close()
            self._open = kind
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else ({"type": "text", "text": ""})
            )
            events.append(
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": self._index, "content_block": block},
                )
            )
        delta = (
            {"type": "thinking_delta", "thinking": text}
            if kind == "thinking"
            else {"type": "text_delta", "text": text}
        )
        events.append(
            _sse(
                "content_block_delta",
                {"type": "content_block_delta", "index": self._index, "delta": delta},
            )
        )
        return events

    def _tool_uses(self, calls: Sequence[ToolCall], task_id: str) -> list[bytes]:
        events = self._close()
        for call in calls:
            block = _tool_use(call, task_id, self._calls)
            self._calls += 1
            start = {**block, "input": {}}
            index = self._index
            self._index += 1
            events += [
                _sse(
                    "content_block_start",
                    {"type": "content_block_start", "index": index, "content_block": start},
                ),
                _sse(
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": arguments_text(call)},
                    },
                ),
                _sse("content_block_stop", {"type": "content_block_stop", "index": index}),
            ]
        return events

    def piece(self, chunk: StreamChunk) -> bytes | None:
        if not (chunk.response or chunk.thinking or chunk.tool_calls):
            return None
        events = self._begin(chunk.task_id)
        if chunk.thinking:
            events += self._delta("thinking", chunk.thinking)
        if chunk.response:
            events += self._delta("text", chunk.response)
        if chunk.tool_calls:
            events += self._tool_uses(chunk.tool_calls, chunk.task_id)
        return b"".join(events)

    def end(self, reply: RouteReply) -> bytes:
        events = self._begin(reply.task_id)
        unsent = (reply.tool_calls or [])[self._calls :]
        if unsent:
            events += self._tool_uses(unsent, reply.task_id)
        events += self._close()
        events.append(
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": stop_reason(reply, called=self._calls > 0),
                        "stop_sequence": None,
                    },
                    "usage": _usage(reply),
                },
            )
        )
        events.append(_sse("message_stop", {"type": "message_stop"}))
        return b"".join(events)

    def whole(self, reply: RouteReply) -> bytes:
        content: list[dict[str, Any]] = []
        if reply.thinking:
            content.append({"type": "thinking", "thinking": reply.thinking, "signature": ""})
        if reply.response or not reply.tool_calls:
            content.append({"type": "text", "text": reply.response or ""})
        content += [
            _tool_use(call, reply.task_id, position)
            for position, call in enumerate(reply.tool_calls or ())
        ]
        body = self._message(reply.task_id, content)
        body["stop_reason"] = stop_reason(reply)
        body["usage"] = _usage(reply)
        return encoder.encode(body)

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode(anthropic_error(status, code, message))

    def stream_error(self, code: str, message: str) -> bytes:
        return _sse("error", anthropic_error(502, code, message))
