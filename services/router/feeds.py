"""The router's views of the ``asleep`` and ``stats`` buckets: each entry the KV watch
(`services.runtime.watch.follow_bucket`) delivers, applied to the fleet view. (The
``workers`` bucket has its own feed: `services.runtime.registry`.)"""

from __future__ import annotations

from nats.js.kv import KeyValue

from schemas.workers import worker_record_decoder
from services.fleet.figures import decode_figure
from services.router.view import FleetView
from services.runtime.watch import value_of


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
    view.figures.put(*decode_figure(data))
