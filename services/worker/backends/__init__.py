"""Model-server backends. Each maps its server's failures to the project's backend errors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas.events import Durations, Tokens

# Called as output arrives, so a long generation can tell the bus it is still working.
Progress = Callable[[], Awaitable[None]]
# Called with each piece of output as it arrives: (response piece, thinking piece).
OnChunk = Callable[[str, str], Awaitable[None]]


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
    ) -> Generation:
        """Run one prompt to completion within ``timeout_s``; ``on_chunk`` sees the pieces."""
        ...

    async def aclose(self) -> None: ...
