"""What a stream has written of a task's answer, across the task's attempts. Pure: no I/O.

A streamed answer reaches the gateway as pieces (`StreamChunk`s, numbered from 1 within
their attempt) and ends with the router's final reply, which holds the whole answer of the
attempt that completed. Whatever happened on the way, the client must end up with exactly
that answer, field by field (text, thinking, tool calls), or be told it cannot:

- the pieces of one attempt are written as they come, in order;
- once a piece is missed (a gap in the numbers: the router passing them on died, and the
  request was asked again), no more of that attempt's pieces are written: what they held
  comes with the final reply;
- a newer attempt (the reaper moved the task: its worker died mid-answer) generates its
  answer from the beginning again: of its pieces only what goes past what the stream has
  written is written, as long as they repeat it (a model that answers alike: the stand-ins,
  temperature 0, a fixed seed);
- before the end, the final reply's rest (what no written piece carried) is written,
  whenever it continues what was written;
- an answer that does not continue what was written (the new attempt said something else)
  cannot be mended in a stream, which cannot take text back: an `ApiError`
  (`StreamDiverged`) that the relay writes as the API's mid-stream error, naming the task so
  the client can read its whole answer (the task goes on to its end).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from schemas.route import RouteReply, StreamChunk, ToolCall
from services.errors import StreamDiverged
from services.gateway.common import ApiError

# The HTTP status a diverged stream is logged with (the client's was sent long before).
DIVERGED_STATUS: Final = 502


@dataclass(slots=True)
class Answer:
    """An answer so far: its text, its thinking and its tool calls."""

    response: str = ""
    thinking: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def add(self, chunk: StreamChunk) -> None:
        self.response += chunk.response
        self.thinking += chunk.thinking
        self.calls += chunk.tool_calls or ()

    @property
    def empty(self) -> bool:
        return not (self.response or self.thinking or self.calls)


def _said(call: ToolCall) -> tuple[str, object]:
    # What a call says; its id is the server's and differs between two runs of one answer.
    return call.name, call.arguments


class Sent:
    """What one stream has written, so the next piece and the final reply can be written
    without repeating or garbling it (see the module's rules)."""

    def __init__(self, task_id: str | None = None) -> None:
        self.task_id = task_id
        self.written = Answer()
        self.attempt = 0
        """The attempt whose pieces are being written (0: none came yet)."""
        self._seq = 0
        """The number of its last piece taken."""
        self._held = False
        """A piece of it was missed: the rest of its answer comes with the final reply."""
        self._again: Answer | None = None
        """A newer attempt's answer so far, while it repeats what an older one wrote."""

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        """What to write of ``chunk`` (None: nothing); raises `ApiError` when a newer
        attempt's answer does not continue what was written."""
        self.task_id = chunk.task_id
        if chunk.seq <= 0:
            return chunk  # the router's first chunk, which names the task: nothing to merge
        attempt = self.attempt if chunk.attempt is None else chunk.attempt
        if attempt < self.attempt:
            return None  # a late piece of an attempt moved on
        if attempt > self.attempt:
            self.attempt, self._seq, self._held = attempt, 0, False
            self._again = None if self.written.empty else Answer()
        if self._held or chunk.seq != self._seq + 1:
            self._held = True
            return None
        self._seq = chunk.seq
        if self._again is None:
            self.written.add(chunk)
            return chunk
        self._again.add(chunk)
        piece, behind = self._past_written(self._again, final=False)
        if not behind:
            self._again = None  # caught up: its pieces are written as they come from now on
        return piece

    def rest(self, reply: RouteReply) -> StreamChunk | None:
        """The part of a done ``reply`` no written piece carried, as one piece (None: none);
        raises `ApiError` when the answer does not continue what was written."""
        if reply.status != "done":
            return None
        final = Answer(reply.response or "", reply.thinking or "", list(reply.tool_calls or ()))
        piece, _ = self._past_written(final, final=True)
        return piece

    def _past_written(self, answer: Answer, *, final: bool) -> tuple[StreamChunk | None, bool]:
        """What ``answer`` adds to what was written, as a piece (None: nothing), which counts
        as written from now on; and whether ``answer`` is still behind what was written in
        some field (a newer attempt repeating it; never so for a ``final`` answer)."""
        written = self.written
        response = self._extra(written.response, answer.response, final)
        thinking = self._extra(written.thinking, answer.thinking, final)
        said, wrote = [_said(c) for c in answer.calls], [_said(c) for c in written.calls]
        if said[: len(wrote)] == wrote:
            calls: list[ToolCall] | None = answer.calls[len(wrote) :]
        elif wrote[: len(said)] == said and not final:
            calls = None
        else:
            raise self._diverged()
        behind = response is None or thinking is None or calls is None
        written.response += response or ""
        written.thinking += thinking or ""
        written.calls += calls or ()
        if not (response or thinking or calls):
            return None, behind
        piece = StreamChunk(
            task_id=self.task_id or "",
            seq=-1 if final else self._seq,  # -1: no piece of the bus, the final reply's rest
            response=response or "",
            thinking=thinking or "",
            tool_calls=calls or None,
            attempt=self.attempt or None,
        )
        return piece, behind

    def _extra(self, written: str, text: str, final: bool) -> str | None:
        """What ``text`` adds past ``written``; None while it only repeats part of it."""
        if text.startswith(written):
            return text[len(written) :]
        if written.startswith(text) and not final:
            return None
        raise self._diverged()

    def _diverged(self) -> ApiError:
        task = self.task_id or "?"
        return ApiError(
            DIVERGED_STATUS,
            StreamDiverged.code,
            f"task {task} was run again after its worker was lost mid-answer, and the new "
            "answer does not continue what this stream already sent; the task goes on: read "
            f"its whole answer with GET /task/{task}",
        )
