"""Liveness: is a worker's registry entry fresh? The one rule every service applies. Pure.

A worker heartbeats into the ``workers`` bucket; an entry is fresh while
``now - heartbeat_at < ttl_s`` (the bucket's TTL, ``WORKER_TTL_S``), and its worker is live
while the entry is fresh and the worker is not stopping. At exactly ``ttl_s`` the entry is
stale: the bucket may already have dropped it.

The bucket's TTL removes silent workers' entries, but nats-server 2.9 sends no notice when it
does, so a watcher must also judge freshness itself, with this rule.

A worker applies it to itself too (`in_touch`): one that has not stored a heartbeat for
nearly a TTL (a partition, a bus outage) may be judged dead any moment, and its task moved
to another worker, so it stops its work first (lesson: at most one generation per task).
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.workers import WorkerRecord


def is_fresh(heartbeat_at: float, now: float, ttl_s: float) -> bool:
    """Is a heartbeat sent at ``heartbeat_at`` younger than ``ttl_s`` at ``now``?"""
    return now - heartbeat_at < ttl_s


def stale_in(heartbeat_at: float, now: float, ttl_s: float) -> float:
    """Seconds from ``now`` until a heartbeat sent at ``heartbeat_at`` is stale (`is_fresh`);
    0 or less once it is."""
    return heartbeat_at + ttl_s - now


def is_live(record: WorkerRecord, now: float, ttl_s: float) -> bool:
    """Is ``record``'s worker live: its heartbeat fresh, and it is not stopping?"""
    return is_fresh(record.heartbeat_at, now, ttl_s) and record.state != "stopping"


def live(records: Iterable[WorkerRecord], now: float, ttl_s: float) -> list[WorkerRecord]:
    """The live workers among ``records`` (`is_live`), in their order."""
    return [r for r in records if is_live(r, now, ttl_s)]


def in_touch(stored_heartbeat_at: float, now: float, ttl_s: float, interval_s: float) -> bool:
    """May a worker whose last stored heartbeat was sent at ``stored_heartbeat_at`` go on
    working at ``now``? Only while that heartbeat stays fresh for one more heartbeat interval
    (``interval_s``): the worker stops a whole interval before anyone may judge its entry
    stale, which covers the reaper's look and a little clock skew between hosts."""
    return is_fresh(stored_heartbeat_at, now + interval_s, ttl_s)
