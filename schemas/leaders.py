"""The ``leaders`` KV bucket: who acts for a role that runs active/standby (the reaper, the
stats projection). One entry per role, held as a lease and refreshed every heartbeat
interval by the instance that acts; the bucket's TTL (``WORKER_TTL_S``) frees the entry of
one that died."""

from __future__ import annotations

import msgspec

from schemas.base import Wire


class LeaderRecord(Wire, frozen=True, kw_only=True):
    role: str
    """The role, which is also the key: ``reaper`` or ``stats``."""
    instance_id: str
    """This process, unique per start: two processes on one host are two instances."""
    host: str
    pid: int
    version: str
    started_at: float
    """When the process started (it may have stood by before it took the role)."""
    since: float
    """When it took the role."""
    heartbeat_at: float
    """When it last renewed the entry (its own clock): the lease's freshness."""


leader_record_decoder = msgspec.json.Decoder(LeaderRecord)
