"""Following a KV bucket across nats-server restarts.

A KV watch is an ordered consumer the server keeps in memory: when the server restarts, the
consumer is gone, and the client only notices after missing two idle heartbeats (10 to 20 s
with nats.py's defaults). With heartbeats judged stale after a few seconds, that is long enough
to take every worker for dead. So a watch is started again, from the bucket's current values,
as soon as the connection has been re-established.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.kv import KeyValue

log = structlog.get_logger("watch")

# How often a quiet watch checks whether the connection was re-established meanwhile.
RECONNECT_CHECK_S = 0.25
# A watch that has not fed the bucket's current values this long after it started (a registry
# reads in milliseconds) is taken for one whose consumer was lost meanwhile.
READ_WITHIN_S: Final = 5.0


def value_of(entry: KeyValue.Entry) -> bytes | None:
    """A watched entry's value; None when it says its key is gone (deleted, purged, or
    emptied)."""
    return None if entry.operation in ("DEL", "PURGE") or not entry.value else entry.value


class BucketCursor:
    """How far a bucket's watch has read, and a way to make it start again from the bucket's
    current values: a watch whose consumer was lost with a cluster node falls silent with the
    connection still up (`services.runtime.stall`).

    ``revision`` is the newest entry's revision the watch fed, or the bucket's newest revision
    when a watch started once it has fed the current values, whichever is later: revisions in
    between that it never fed are gone (expired, or replaced), so nothing is behind.
    """

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.revision = 0
        self.restart = asyncio.Event()
        self.watching = (-1, False, 0.0)
        """The connection (`reconnects`) the current watch started on, whether it has fed the
        bucket's current values, and when it started (`time.monotonic`)."""

    def behind(self, revision: int) -> bool:
        """Has the bucket stored ``revision``, which the watch should have fed and has not?
        Only a watch on the current connection that has fed the current values should have (or
        that has been at it for `READ_WITHIN_S`): one starting, or reading them again after a
        reconnect, is catching up as it should (judged behind, it would be started again, and
        its view kept settling, for nothing)."""
        generation, read, since = self.watching
        if revision <= self.revision or generation != reconnects(self.nc):
            return False
        return read or time.monotonic() - since >= READ_WITHIN_S


def reconnects(nc: Client) -> int:
    """How many times this client has reconnected (it changes on every new connection)."""
    return int(nc.stats["reconnects"])


async def follow_bucket(
    nc: Client,
    kv: KeyValue,
    on_entry: Callable[[KeyValue.Entry], None],
    ready: asyncio.Event,
    *,
    on_watch: Callable[[int], None] | None = None,
    on_read: Callable[[int], None] | None = None,
    cursor: BucketCursor | None = None,
) -> None:
    """Feed every value of ``kv`` (current ones first, then changes) to ``on_entry``, for ever.

    ``ready`` is set once the current values have been fed. A value ``on_entry`` cannot decode
    is logged and skipped. Run it as a task; cancel it to stop.

    ``on_watch(generation)`` is called as each watch starts, before any of its values, and
    ``on_read(generation)`` once it has fed the current values, with the connection's
    `reconnects` count they belong to (`services.fleet.settling` keeps a view's settling so).
    With a ``cursor``, the watch keeps its revision and starts again when told to.
    """
    while True:
        seen = reconnects(nc)
        if on_watch is not None:
            on_watch(seen)
        if cursor is not None:
            cursor.watching = (seen, False, time.monotonic())
        try:
            start_revision = await _newest_revision(kv) if cursor is not None else 0
            watcher = await kv.watchall()
        except Exception as exc:  # the server is not back yet
            log.warning("bucket watch not started; trying again", error=repr(exc))
            await asyncio.sleep(1.0)
            continue
        if cursor is not None:
            cursor.restart.clear()
        try:
            while reconnects(nc) == seen and not (cursor and cursor.restart.is_set()):
                try:
                    entry = await watcher.updates(timeout=RECONNECT_CHECK_S)  # type: ignore[no-untyped-call]
                except nats.errors.TimeoutError:
                    continue
                if entry is None:
                    if cursor is not None:
                        cursor.revision = max(cursor.revision, start_revision)
                        cursor.watching = (seen, True, cursor.watching[2])
                    ready.set()
                    if on_read is not None:
                        on_read(seen)
                    continue
                if cursor is not None:
                    cursor.revision = max(cursor.revision, entry.revision or 0)
                try:
                    on_entry(entry)
                except msgspec.DecodeError:
                    log.warning("ignoring a malformed value", key=entry.key)
        finally:
            with suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]


async def _newest_revision(kv: KeyValue) -> int:
    """The bucket's newest revision (its stream's last sequence)."""
    status = await kv.status()
    return int(status.stream_info.state.last_seq)
