"""Ollama's API, answers: what the fleet replies, as ``/api/generate``, ``/api/chat``,
``/api/embed``, ``/api/embeddings`` and ``/api/pull`` write it.

NDJSON streamed unless ``"stream": false``; thinking in ``thinking`` (generate) or
``message.thinking`` (chat); tool calls in ``message.tool_calls`` as
``{"id", "function": {"index", "name", "arguments": {...}}}``, streamed on a line of their own
with ``done: false`` as Ollama streams them; ``done_reason`` ``stop`` or ``length`` (a model that
stopped to call tools stopped: Ollama says ``stop``); errors ``{"error": msg}``. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from schemas.route import RouteReply, StreamChunk, ToolCall
from schemas.vectors import to_floats
from services.gateway.common import encoder, iso_now, line, ns, vectors
from services.gateway.conversation import arguments_of, call_id


def ollama_tool_calls(
    calls: Sequence[ToolCall], task_id: str, first: int = 0
) -> list[dict[str, Any]]:
    """Tool calls in Ollama's shape; ``first`` is the position of the first in the answer."""
    written = []
    for position, call in enumerate(calls, start=first):
        arguments = call.arguments
        if isinstance(arguments, str):
            # A backend's text that is not a JSON object stays the text it was.
            arguments = arguments_of(arguments)
        written.append(
            {
                "id": call_id(call, task_id, position),
                "function": {"index": position, "name": call.name, "arguments": arguments},
            }
        )
    return written


def done_reason(reply: RouteReply) -> str:
    """Ollama's: ``length`` at the token limit, else ``stop`` (tool calls included)."""
    return "length" if reply.done_reason == "length" else "stop"


def _figures(reply: RouteReply) -> dict[str, int]:
    durations, tokens = reply.durations, reply.tokens
    figures = {
        "total_duration": ns(durations.total_ms) if durations else None,
        "load_duration": ns(durations.load_ms) if durations else None,
        "prompt_eval_count": tokens.prompt if tokens else None,
        "prompt_eval_duration": ns(durations.prompt_eval_ms) if durations else None,
        "eval_count": tokens.eval if tokens else None,
        "eval_duration": ns(durations.eval_ms) if durations else None,
    }
    return {k: v for k, v in figures.items() if v is not None}


@dataclass(slots=True)
class OllamaShape:
    """``/api/generate`` (``chat=False``) and ``/api/chat`` (``chat=True``). One per request:
    it counts the tool calls it has streamed, so the end adds only those not streamed yet."""

    model: str
    chat: bool
    stream_type: str = "application/x-ndjson"
    start_on_accept: bool = False
    streamed_calls: int = 0

    def _text(
        self, response: str, thinking: str | None, calls: list[dict[str, Any]]
    ) -> dict[str, Any]:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": response}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"message": message}
        text: dict[str, Any] = {"response": response}
        if thinking:
            text["thinking"] = thinking
        return text

    def _line(self, response: str, thinking: str | None, calls: list[dict[str, Any]]) -> bytes:
        text = self._text(response, thinking, calls)
        return line({"model": self.model, "created_at": iso_now(), **text, "done": False})

    def piece(self, chunk: StreamChunk) -> bytes | None:
        calls = chunk.tool_calls if self.chat and chunk.tool_calls else []
        if not (chunk.response or chunk.thinking or calls):
            return None
        written = ollama_tool_calls(calls, chunk.task_id, self.streamed_calls)
        self.streamed_calls += len(calls)
        return self._line(chunk.response, chunk.thinking, written)

    def _final(self, response: str, thinking: str | None, reply: RouteReply) -> dict[str, Any]:
        calls = ollama_tool_calls(reply.tool_calls or [], reply.task_id) if self.chat else []
        return {
            "model": self.model,
            "created_at": iso_now(),
            **self._text(response, thinking, calls),
            "done": True,
            "done_reason": done_reason(reply),
            **_figures(reply),
        }

    def end(self, reply: RouteReply) -> bytes:
        ending = b""
        unsent = (reply.tool_calls or [])[self.streamed_calls :] if self.chat else []
        if unsent:
            ending = self._line(
                "", None, ollama_tool_calls(unsent, reply.task_id, self.streamed_calls)
            )
            self.streamed_calls += len(unsent)
        final = self._final("", None, reply)
        final.get("message", {}).pop("tool_calls", None)
        return ending + line(final)

    def whole(self, reply: RouteReply) -> bytes:
        return encoder.encode(self._final(reply.response or "", reply.thinking, reply))

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode({"error": message})

    def stream_error(self, code: str, message: str) -> bytes:
        return line({"error": message})


@dataclass(frozen=True, slots=True)
class OllamaEmbedShape:
    """``/api/embed`` (``{"model", "embeddings": [[...]], "total_duration", "load_duration",
    "prompt_eval_count"}``) and, ``legacy``, ``/api/embeddings`` (``{"embedding": [...]}``).
    Never streamed."""

    model: str
    legacy: bool = False
    stream_type: str = "application/json"
    start_on_accept: bool = False

    def piece(self, chunk: StreamChunk) -> bytes | None:
        return None

    def end(self, reply: RouteReply) -> bytes:
        return self.whole(reply) + b"\n"

    def whole(self, reply: RouteReply) -> bytes:
        found = vectors(reply)
        if self.legacy:
            return encoder.encode({"embedding": to_floats(found[0]) if found else []})
        body: dict[str, Any] = {"model": self.model, "embeddings": [to_floats(v) for v in found]}
        figures = _figures(reply)
        # Ollama's omitempty fields: durations and the prompt's token count, when known.
        for name in ("total_duration", "load_duration", "prompt_eval_count"):
            if figures.get(name):
                body[name] = figures[name]
        return encoder.encode(body)

    def error(self, status: int, code: str, message: str) -> bytes:
        return encoder.encode({"error": message})

    def stream_error(self, code: str, message: str) -> bytes:
        return line({"error": message})


# What a pull of a model that is already there reports, in Ollama's words (less the layers).
PULL_STEPS: Final = ("pulling manifest", "success")


def ollama_pull(*, stream: bool) -> bytes:
    """``POST /api/pull`` of a model the fleet serves: nothing to do, so success at once
    (NDJSON steps when streamed, else the last one)."""
    if stream:
        return b"".join(line({"status": step}) for step in PULL_STEPS)
    return encoder.encode({"status": PULL_STEPS[-1]})
