"""The router's views of the ``asleep`` and ``stats`` buckets: each entry the KV watch
(`services.runtime.watch.follow_bucket`) delivers, applied to the fleet view. (The
``workers`` bucket has its own feed: `services.router.registry`.)"""

from __future__ import annotations

import msgspec
from nats.js.kv import KeyValue

from schemas.workers import worker_record_decoder
from services.router.view import Figure, FleetView
from services.runtime.watch import value_of


class _FigureView(msgspec.Struct, frozen=True):
    """The fields of a ``stats`` bucket value that routing uses."""

    model: str
    domain: str
    worker: str
    recent_failure_rate: float = 0.0
    typical_ms: float | None = None


_figure_decoder = msgspec.json.Decoder(_FigureView)


def apply_sleeper(view: FleetView, entry: KeyValue.Entry) -> None:
    """A sleeping worker's entry came (or went)."""
    if (value := value_of(entry)) is None:
        view.remove_sleeper(entry.key)
    else:
        view.put_sleeper(worker_record_decoder.decode(value))


def apply_figure(view: FleetView, entry: KeyValue.Entry) -> None:
    """A figure was published; a deleted one leaves the last value in place."""
    if (data := value_of(entry)) is None:
        return
    value = _figure_decoder.decode(data)
    figure = Figure(typical_ms=value.typical_ms, recent_failure_rate=value.recent_failure_rate)
    view.put_figure(value.model, value.domain, value.worker, figure)
