"""OpenAI's API, answers: what the fleet replies, as ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/embeddings`` write it.

One JSON body unless ``"stream": true``, then Server-Sent Events ending with ``data: [DONE]``;
thinking in ``reasoning`` (the name Ollama's own ``/v1`` uses; a legacy completion drops it, as
Ollama's does); tool calls as ``[{"id", "type": "function", "function": {"name", "arguments":
JSON text}}]`` (streamed: the same in ``delta.tool_calls``, each with its ``index``);
``finish_reason`` ``tool_calls`` when the model called tools, ``length`` at the token limit,
else ``stop``; ids are ``chatcmpl-<task id>``; errors ``{"error": {"message", "type", "param",
"code"}}`` with the project's code. Pure: no I/O.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from schemas.route import RouteReply, StreamChunk, ToolCall
from schemas.vectors import to_floats
from services.gateway.common import encoder, event, vectors
from services.gateway.conversation import arguments_text, call_id


def openai_error(status: int, code: str, message: str) -> dict[str, Any]:
    """OpenAI's error body; the type says whose fault it is, the code is the project's."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def openai_tool_calls(
    calls: Sequence[ToolCall], task_id: str, first: int = 0
) -> list[dict[str, Any]]:
    """Tool calls in OpenAI's shape; ``first`` is the position of the first in the answer,
    which is also each call's ``index`` (what streaming clients gather deltas by)."""
    return [
        {
            "index": position,
            "id": call_id(call, task_id, position),
            "type": "function",
            "function": {"name": call.name, "arguments": arguments_text(call)},
        }
        for position, call in enumerate(calls, start=first)
    ]


def finish_reason(reply: RouteReply, *, called: bool = False) -> str:
    """``length`` at the token limit; ``tool_calls`` when the model called tools (Ollama's
    layer: a stop with calls); else ``stop``."""
    if reply.done_reason == "length":
        return "length"
    if called or reply.tool_calls or reply.done_reason == "tool_calls":
        return "tool_calls"
    return "stop"


def _usage(reply: RouteReply) -> dict[str, int] | None:
    if reply.tokens is None:
        return None
    prompt = reply.tokens.prompt or 0
    completion = reply.tokens.eval or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


@dataclass(slots=True)
class OpenAIShape:
    """``/v1/chat/completions`` (``chat=True``) and ``/v1/completions``; the id is the task's.
    One per request: it counts the tool calls it has streamed."""

    model: str
    chat: bool
    include_usage: bool = False
    created: int = 0
    stream_type: str = "text/event-stream"
    start_on_accept: bool = False
    streamed_calls: int = 0

    def _id(self, task_id: str) -> str:
        return f"{'chatcmpl' if self.chat else 'cmpl'}-{task_id}"

    def _object(self, streamed: bool) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if streamed else "chat.completion"

    def _chunk(self, task_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self._id(task_id),
            "object": self._object(True),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _choice(
        self,
        text: str,
        thinking: str,
        finish: str | None,
        calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            delta["reasoning"] = thinking
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta, "finish_reason": finish}

    def _calls_event(self, calls: Sequence[ToolCall], task_id: str) -> bytes:
        written = openai_tool_calls(calls, task_id, self.streamed_calls)
        self.streamed_calls += len(calls)
        return event(self._chunk(task_id, [self._choice("", "", None, written)]))

    def piece(self, chunk: StreamChunk) -> bytes | None:
        thinking = chunk.thinking if self.chat else ""
        calls = chunk.tool_calls if self.chat and chunk.tool_calls else []
        if not (chunk.response or thinking or calls):
            return None
        written = openai_tool_calls(calls, chunk.task_id, self.streamed_calls)
        self.streamed_calls += len(calls)
        choice = self._choice(chunk.response, thinking, None, written)
        return event(self._chunk(chunk.task_id, [choice]))

    def end(self, reply: RouteReply) -> bytes:
        events = []
        unsent = (reply.tool_calls or [])[self.streamed_calls :] if self.chat else []
        if unsent:
            events.append(self._calls_event(unsent, reply.task_id))
        if self.chat:
            reason = finish_reason(reply, called=self.streamed_calls > 0)
        else:
            reason = "length" if reply.done_reason == "length" else "stop"
        finish = self._chunk(reply.task_id, [self._choice("", "", reason)])
        events.append(event(finish))
        usage = _usage(reply)
        if self.include_usage and usage is not None:
            events.append(event({**finish, "choices": [], "usage": usage}))
        events.append(event("[DONE]"))
        return b"".join(events)

    def whole(self, reply: RouteReply) -> bytes:
        text = reply.response or ""
        choice: dict[str, Any]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if reply.thinking:
                message["reasoning"] = reply.thinking
            if reply.tool_calls:
                message["tool_calls"] = openai_tool_calls(reply.tool_calls, reply.task_id)
            choice = {"index": 0, "message": message, "finish_reason": finish_reason(reply)}
        else:
            reason = "length" if reply.done_reason == "length" else "stop"
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        body: dict[str, Any] = {
            "id": self._id(reply.task_id),
            "object": self._object(False),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }
        usage = _usage(reply)
        if usage is not None:
            body["usage"] = usage
        return encoder.encode(body)

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode(openai_error(status, code, message))

    def stream_error(self, code: str, message: str) -> bytes:
        return event(openai_error(502, code, message))


@dataclass(frozen=True, slots=True)
class OpenAIEmbedShape:
    """``/v1/embeddings``: ``{"object": "list", "data": [{"object": "embedding", "embedding",
    "index"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``; with ``base64`` each
    embedding is the base64 of its little-endian float32 bytes, as OpenAI encodes it. Never
    streamed."""

    model: str
    base64: bool = False
    stream_type: str = "application/json"
    start_on_accept: bool = False

    def piece(self, chunk: StreamChunk) -> bytes | None:
        return None

    def end(self, reply: RouteReply) -> bytes:
        return self.whole(reply) + b"\n"

    def whole(self, reply: RouteReply) -> bytes:
        data = [
            {
                "object": "embedding",
                "embedding": base64.b64encode(v).decode() if self.base64 else to_floats(v),
                "index": index,
            }
            for index, v in enumerate(vectors(reply))
        ]
        tokens = (reply.tokens.prompt if reply.tokens else None) or 0
        return encoder.encode(
            {
                "object": "list",
                "data": data,
                "model": self.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode(openai_error(status, code, message))

    def stream_error(self, code: str, message: str) -> bytes:
        return event(openai_error(502, code, message))
