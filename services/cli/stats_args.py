"""The statistics commands' arguments read (pure): times as an operator types them, timeouts,
comma-separated model lists. The parsers themselves are `stats_commands.register`."""

from __future__ import annotations

import argparse
import math
import re
import time
from datetime import datetime

from schemas.route import MAX_TIMEOUT_S
from schemas.stats import time_problem

# "2h ago", or "-2h" (as --since=-2h: argparse takes a bare "-2h" for an option).
_RELATIVE = re.compile(r"^(?:-\s*(\d+(?:\.\d+)?)\s*([smhdw])|(\d+(?:\.\d+)?)\s*([smhdw])\s+ago)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_time(text: str, now: float | None = None) -> float:
    """Epoch seconds from ``text``: ``now``; ``90m ago``, ``2h ago``, ``3d ago`` (or ``-2h``);
    epoch seconds; or ISO 8601 (``2025-06-01``, ``2025-06-01T02:00``, ``…+09:00``, ``…Z``),
    local time when it names no zone. Raises ValueError saying what is accepted: a form it
    does not know, or a time out of the range a request may name (`schemas.stats.time_problem`:
    1970 to 9999; a time in milliseconds is told so)."""
    at = _parse_time(text, now)
    problem = time_problem(repr(text), at)
    if problem is not None:
        raise ValueError(problem)
    return at


def _parse_time(text: str, now: float | None) -> float:
    value = text.strip()
    current = time.time() if now is None else now
    if value.lower() == "now":
        return current
    relative = _RELATIVE.match(value.lower())
    if relative is not None:
        amount, unit = (
            relative.group(1) or relative.group(3),
            relative.group(2) or relative.group(4),
        )
        return current - float(amount) * _UNIT_S[unit]
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        if math.isfinite(number):
            return number
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a time: use ISO 8601 (2025-06-01T02:00, local time unless a zone "
            "is given), epoch seconds, 'now', or '30m ago' / '2h ago' / '3d ago'"
        ) from None
    try:
        return parsed.timestamp()
    except (ValueError, OverflowError, OSError):
        # A local time at the ends of datetime's range (year 1) has no epoch seconds.
        raise ValueError(f"{text!r} is not a time from 1970-01-01 to 9999-12-31") from None


def time_arg(text: str) -> float:
    """`parse_time` as an argparse ``type``: a refusal is a usage error."""
    try:
        return parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def timeout_arg(text: str) -> float:
    """A timeout in seconds, as an argparse ``type``: above zero, at most a day
    (`schemas.route.MAX_TIMEOUT_S`, beyond which a timer overflows)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a timeout: give seconds above 0, at most {MAX_TIMEOUT_S:.0f} (a day)"
        )
    return value


def model_list(text: str | None) -> list[str] | None:
    """``--models a, b`` as ``["a", "b"]``; None (every model served) when not given."""
    return [m.strip() for m in text.split(",") if m.strip()] if text else None
