"""Whether a reaper runs: a retryable failure is final for its waiting client unless a reaper
will move the task on (`services.router.waiting.Waiter`)."""

from __future__ import annotations

import asyncio
import time
from typing import Final

import nats.errors
from nats.aio.client import Client

from schemas.subjects import REAPER_SERVICE

# How often the router asks whether a reaper runs (to know if a retryable failure moves on).
REAPER_PING_S: Final = 2.0


class ReaperWatch:
    """Asks ``$SRV.PING`` of the reaper service every `REAPER_PING_S`."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self._seen = float("-inf")
        self._asked = float("-inf")

    async def watch(self) -> None:
        """Ask every `REAPER_PING_S` whether a reaper runs, so `runs` rarely has to."""
        while True:
            await self._ask()
            await asyncio.sleep(REAPER_PING_S)

    async def _ask(self) -> None:
        try:
            await self.nc.request(f"$SRV.PING.{REAPER_SERVICE}", b"", timeout=0.5)
        except nats.errors.NoRespondersError:
            self._asked = float("-inf")  # a quick no: asking again costs nothing
        except Exception:
            self._asked = time.monotonic()  # no answer in time: not again at once
        else:
            self._seen = time.monotonic()

    async def runs(self) -> bool:
        """Does a reaper answer ``$SRV.PING`` (lately, or now)? Then a retryable failure will
        be moved on (`Waiter`)."""
        now = time.monotonic()
        if now - self._seen < 3 * REAPER_PING_S:
            return True
        if now - self._asked >= REAPER_PING_S / 4:
            await self._ask()
        return time.monotonic() - self._seen < 3 * REAPER_PING_S
