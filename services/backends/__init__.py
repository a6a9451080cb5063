"""Model-server backends. Each maps its server's failures to the project's backend errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.events import Durations, Tokens
from schemas.models import ModelFacts
from schemas.route import DoneReason, ModelProgress, ToolCall
from schemas.work import ModelChange, Work
from services.errors import BackendError, BackendServerError

# Called as output arrives, so a long generation can tell the bus it is still working.
Progress = Callable[[], Awaitable[None]]

# Called with each step of a change to the server's models (a pull's bytes, say).
OnModelProgress = Callable[[ModelProgress], Awaitable[None]]


class OnChunk(Protocol):
    """Called with each piece of output as it arrives: text, thinking, and tool calls when a
    piece completes some (Ollama sends each call whole; OpenAI-compatible servers in
    fragments, which the backend puts together first)."""

    async def __call__(
        self, response: str, thinking: str, tool_calls: list[ToolCall] | None = None
    ) -> None: ...


# How long the rest of a streamed body is read after its last message (see `drain`).
DRAIN_S = 1.0


async def drain(lines: AsyncIterator[Any]) -> None:
    """Read what follows a stream's last message (from a well-behaved server only the body's
    end), so the connection goes back to the pool instead of being closed: a new TCP
    connection per task costs more than the rest of the request. A server that keeps the
    body open past it only loses that connection's reuse."""
    with suppress(Exception):
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass


def answer_error(status: int, message: str) -> BackendError:
    """The failure a server's answer with HTTP ``status`` (not 200) is: a 5xx is the
    server's own (`BackendServerError`: another server may do the work), any other the
    request's (a 4xx: a bad request, a model that refuses the input; no server would do
    better)."""
    return BackendServerError(message) if status >= 500 else BackendError(message)


def embedding_work(inputs: list[str]) -> Work:
    """The work of embedding ``inputs`` for a call of the worker's own (a sanity run, a
    probe), not a client's task."""
    return Work(prompt="\n".join(inputs), task_type="embedding", input=inputs)


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished generation; ``thinking`` is kept apart from ``response``."""

    response: str
    thinking: str | None
    durations: Durations
    tokens: Tokens = field(default_factory=Tokens)
    first_token_ms: float | None = None
    tool_calls: list[ToolCall] | None = None
    done_reason: DoneReason | None = None
    """Why it ended, as the server said it (``stop``, ``length``; OpenAI-compatible servers
    also ``tool_calls``), except that a ``stop`` after tool calls is ``tool_calls`` (Ollama
    says ``stop`` then; the gateway says ``stop`` again to Ollama's clients); ``length``
    stays (the calls may be cut). None if the server did not say, or said something else
    (Ollama's ``load``)."""


@dataclass(frozen=True, slots=True)
class Embedding:
    """One embedding call's vectors, one per input in order, little-endian float32 each
    (`schemas.vectors`)."""

    vectors: list[bytes]
    durations: Durations
    tokens: Tokens = field(default_factory=Tokens)


class Backend(Protocol):
    """What the worker needs from a model server."""

    @property
    def address(self) -> str: ...

    async def list_models(self) -> list[str]:
        """Names of the models the server can run; raises `BackendUnavailable` when it is down."""
        ...

    async def generate(
        self,
        model: str,
        work: Work,
        *,
        timeout_s: float,
        progress: Progress | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Generation:
        """Run ``work`` to completion on ``model`` (the name the server knows it by) within
        ``timeout_s``; ``on_chunk`` sees the pieces.

        With ``messages`` the conversation goes to the server's chat API instead of the
        prompt (which then holds the same conversation as text); ``think`` is Ollama's
        switch. ``images`` go with the prompt (a conversation carries its own per message),
        ``tools`` and ``format`` to the server as the chat APIs take them, ``keep_alive``
        and every option as given (a server without the notion ignores them). The server is
        always asked to stream, whatever ``stream`` says (that is for the client)."""
        ...

    async def embed(self, model: str, work: Work, *, timeout_s: float) -> Embedding:
        """One vector per input of ``work.input``, in one call. ``normalize`` false asks
        for the model's own vectors (Ollama's older ``/api/embeddings``, one call per
        input)."""
        ...

    async def model_facts(self, served: list[str]) -> dict[str, ModelFacts]:
        """What the server says of each served model (by its served name): capabilities,
        digest, size, details. A model it says nothing of is left out (the worker then
        registers `ModelFacts`'s defaults)."""
        ...

    async def resident_models(self) -> dict[str, int] | None:
        """The models the server holds in memory now (by served name), which start without
        a cold load, each with the memory it takes (bytes; 0 when not said); None when the
        server has no way to say. Raises `BackendUnavailable` when it is down,
        `BackendError` when it answers otherwise."""
        ...

    async def change_model(
        self, model: str, change: ModelChange, *, timeout_s: float, on_progress: OnModelProgress
    ) -> None:
        """Make ``change`` to ``model`` on the server through its own API, within
        ``timeout_s``, ``on_progress`` seeing each step; raises `BackendError` with the
        server's reason when it refuses or fails (a server that cannot change its models at
        all says so)."""
        ...

    async def aclose(self) -> None: ...
