"""What a finished generation measured: durations and token counts.

Shared by the task events, the route reply and the task view, so every reader sees one shape.
"""

from __future__ import annotations

from schemas.base import Wire


class Durations(Wire, frozen=True, kw_only=True):
    """Milliseconds, as the backend reported them; ``total_ms`` includes thinking and load."""

    total_ms: float
    load_ms: float | None = None
    prompt_eval_ms: float | None = None
    eval_ms: float | None = None
    first_token_ms: float | None = None
    """From sending the prompt to the first token (or thinking) arriving."""


class Tokens(Wire, frozen=True, kw_only=True):
    prompt: int | None = None
    eval: int | None = None
