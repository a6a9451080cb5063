"""The routing figures, from the ``figures`` table to the KV bucket ``stats``.

The figures of the keys each batch touched are recomputed, and go to the KV bucket, at most
once a second per key (`PUBLISH_INTERVAL_S`), and before a ``coordinator.stats`` answer; at
start every figure is recomputed, and at start and after a rebuild the whole bucket is brought
in line with the ``figures`` table (stale keys deleted).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from typing import Final

import nats.js.errors
import structlog
from nats.js.kv import KeyValue

from schemas.events import encoder
from services.stats.figures import kv_key, routing_figure
from services.stats.rows import FigureKey
from services.stats.store import Store

log = structlog.get_logger("stats")

# Routing figures of one key go to the KV bucket at most this often.
PUBLISH_INTERVAL_S: Final = 1.0


class FigurePublisher:
    """Keeps the figure rows and the KV bucket in step with the batches projected.

    Batches do not write figure rows: they note the keys they touched (`note_touched`), and a
    refresh runs beside them, one refresh at a time. ``kv`` is set once the bucket exists.
    """

    def __init__(self, store: Store, stopping: asyncio.Event) -> None:
        self.store = store
        self.kv: KeyValue | None = None
        self._stopping = stopping
        # Keys whose figure rows are behind their facts, and keys to put to KV.
        self._stale: set[FigureKey] = set()
        self._refresh_lock = asyncio.Lock()
        self._dirty: set[FigureKey] = set()
        self._full_sync = True
        self._publish_now = asyncio.Event()

    def note_touched(self, keys: set[FigureKey]) -> None:
        """Mark ``keys``' figure rows as behind their facts."""
        self._stale.update(keys)

    def resync(self) -> None:
        """Bring the whole bucket in line with the ``figures`` table now (after a rebuild)."""
        self._full_sync = True
        self._publish_now.set()

    def wake(self) -> None:
        """Publish now rather than at the next interval (a stop's last round)."""
        self._publish_now.set()

    async def refresh_stale(self) -> None:
        """Recompute the figure rows the batches since the last time touched (then to KV)."""
        async with self._refresh_lock:
            keys, self._stale = self._stale, set()
            if not keys:
                return
            try:
                await self.store.refresh_figures(keys)
            except BaseException:
                self._stale |= keys
                raise
        self._dirty |= keys

    async def run(self) -> None:
        """Every `PUBLISH_INTERVAL_S`, put the figures of the keys touched since to KV."""
        while True:
            with suppress(TimeoutError):
                await asyncio.wait_for(self._publish_now.wait(), timeout=PUBLISH_INTERVAL_S)
            self._publish_now.clear()
            await self.publish_figures()
            if self._stopping.is_set():
                return

    async def publish_figures(self) -> None:
        """Put the dirty keys' figures (all of them after start or a rebuild) to KV now."""
        assert self.kv is not None
        try:
            await self.refresh_stale()
        except Exception as exc:
            log.warning("refreshing figures failed; will retry", error=repr(exc))
        full, self._full_sync = self._full_sync, False
        keys, self._dirty = self._dirty, set()
        if not full and not keys:
            return
        try:
            views = await self.store.figures() if full else await self.store.figures_for(keys)
            now = time.time()
            written: set[str] = set()
            for view in views:
                if not view.worker:
                    continue  # a failure no worker took: nothing to route by
                key = kv_key(view.model, view.domain, view.worker)
                await self.kv.put(key, encoder.encode(routing_figure(view, now)))
                written.add(key)
            if full:
                try:
                    stale = set(await self.kv.keys()) - written
                except nats.js.errors.NoKeysError:
                    stale = set()
            else:
                stale = {kv_key(*key) for key in keys if key[2]} - written
            for key in stale:
                await self.kv.delete(key)
            log.debug("routing figures published", put=len(written), deleted=len(stale))
        except Exception as exc:
            log.warning("publishing routing figures failed; will retry", error=repr(exc))
            self._dirty |= keys
            self._full_sync = self._full_sync or full
