"""`coordinator models` as a table (`services.fleet.model_matrix` says what is in it). Pure."""

from __future__ import annotations

import time

from services.fleet.model_matrix import Matrix


def _size(size: int) -> str:
    if not size:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    seconds = max(now - at, 0.0)
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def table(found: Matrix, now: float | None = None) -> list[str]:
    """``found`` as the lines ``coordinator models`` prints."""
    if not found.models:
        return ["no live worker serves a model"]
    now = time.time() if now is None else now
    lines = [
        f"{'MODEL':<28} {'WORKER':<16} {'SIZE':>9} {'QUANT':<8} {'DIGEST':<12} "
        f"{'LOADED':<6} {'LAST USED':<12} {'SPEED':>12}"
    ]
    for row in found.models:
        for n, copy in enumerate(row.copies):
            loaded = "-" if copy.loaded is None else ("yes" if copy.loaded else "no")
            speed = f"{copy.tokens_per_s:.1f} tok/s" if copy.tokens_per_s is not None else "-"
            last = _ago(copy.last_used, now) if found.figures else "?"
            name = row.model if n == 0 else ""
            lines.append(
                f"{name:<28} {copy.worker:<16} {_size(copy.size):>9} "
                f"{copy.quantization or '-':<8} {copy.digest[:12] or '-':<12} {loaded:<6} "
                f"{last:<12} {speed:>12}"
            )
        if row.digests_differ:
            held = ", ".join(f"{c.worker} {c.digest[:12]}" for c in row.copies if c.digest)
            lines.append(f"  ! {row.model} differs by digest between workers: {held}")
    if not found.figures:
        lines.append("(the stats service did not answer: last use and speed are unknown)")
    return lines
