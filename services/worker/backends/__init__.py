"""Model-server backends. Each maps its server's failures to the project's backend errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.events import Durations, Tokens
from schemas.route import ChatMessage

# Called as output arrives, so a long generation can tell the bus it is still working.
Progress = Callable[[], Awaitable[None]]
# Called with each piece of output as it arrives: (response piece, thinking piece).
OnChunk = Callable[[str, str], Awaitable[None]]

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


@dataclass(frozen=True, slots=True)
class Generation:
    """One finished generation; ``thinking`` is kept apart from ``response``."""

    response: str
    thinking: str | None
    durations: Durations
    tokens: Tokens = field(default_factory=Tokens)
    first_token_ms: float | None = None


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
        prompt: str,
        *,
        options: dict[str, Any] | None,
        timeout_s: float,
        progress: Progress | None = None,
        on_chunk: OnChunk | None = None,
        messages: list[ChatMessage] | None = None,
        think: bool | str | None = None,
    ) -> Generation:
        """Run one prompt to completion within ``timeout_s``; ``on_chunk`` sees the pieces.

        With ``messages`` the conversation goes to the server's chat API instead of ``prompt``
        (which then holds the same conversation as text); ``think`` is Ollama's switch."""
        ...

    async def aclose(self) -> None: ...
