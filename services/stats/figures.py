"""From figure rows to the ``stats`` KV bucket: keys and values. Pure.

A KV key may hold only ``A-Z a-z 0-9 - _ / = .`` and its tokens (between dots) must not be
empty, while model names hold ``:``, ``/`` and ``.`` (``hf.co/elyza/…:Q4_K_M``). Each part is
therefore escaped: every byte outside ``A-Z a-z 0-9 -`` becomes ``_XX`` (its UTF-8 byte in
upper-case hex, ``_`` itself included), and an empty part is a lone ``_``. The escaping is
stable and reversible, so each (model, domain, worker) has exactly one key:
``<model>.<domain>.<worker>``, e.g. ``qwen2_2E5_3A7b.code.mac``. The router reads the values,
not the keys.
"""

from __future__ import annotations

import re

from schemas.stats import FigureView, RoutingFigure

_PLAIN = re.compile(rb"[A-Za-z0-9-]")


def escape_part(part: str) -> str:
    """One key token for ``part`` (see the module docstring)."""
    if not part:
        return "_"
    return "".join(
        chr(byte) if _PLAIN.fullmatch(bytes([byte])) else f"_{byte:02X}"
        for byte in part.encode("utf-8")
    )


def unescape_part(token: str) -> str:
    """The inverse of `escape_part`."""
    if token == "_":
        return ""
    out = bytearray()
    index = 0
    while index < len(token):
        if token[index] == "_":
            out.append(int(token[index + 1 : index + 3], 16))
            index += 3
        else:
            out.append(ord(token[index]))
            index += 1
    return out.decode("utf-8")


def kv_key(model: str, domain: str, worker: str) -> str:
    """The ``stats`` bucket key of a figure."""
    return ".".join(escape_part(p) for p in (model, domain, worker))


def routing_figure(view: FigureView, now: float) -> RoutingFigure:
    """The KV value for one figure row, stamped ``updated_at=now``."""
    rate = view.recent_failures / view.recent_count if view.recent_count else 0.0
    return RoutingFigure(
        model=view.model,
        domain=view.domain,
        worker=view.worker,
        count=view.count,
        failures=view.failures,
        recent_count=view.recent_count,
        recent_failure_rate=rate,
        typical_ms=view.p50_ms,
        p95_ms=view.p95_ms,
        load_ms_p50=view.load_ms_p50,
        warm_ms=view.warm_p50_ms,
        cold_load_ms=view.cold_load_ms_p50,
        tokens_per_s=view.tokens_per_s,
        quality_mean=view.quality_mean,
        quality_count=view.quality_count,
        last_at=view.last_at,
        updated_at=now,
    )
