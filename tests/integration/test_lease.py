"""The registry lease's release, on a real nats-server."""

from __future__ import annotations

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from schemas.subjects import WORKERS_BUCKET
from schemas.workers import WorkerRecord
from services.runtime.bus import ensure_bucket
from services.runtime.lease import Lease


def record(instance_id: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id="w1",
        host="h",
        instance_id=instance_id,
        pid=1,
        version="0",
        started_at=1.0,
        heartbeat_at=1.0,
        models=["m"],
        supports=["cpu_inference"],
        backend="http://127.0.0.1:1",
    )


async def test_release_deletes_the_entry_after_a_heartbeat_stored_unbeknown(nc: Client) -> None:
    """A heartbeat cancelled in flight can be stored while the process keeps the older
    revision: the release still removes the entry (it was left behind before)."""
    kv = await ensure_bucket(nc.jetstream(), WORKERS_BUCKET, ttl_s=30)
    lease = Lease(kv, "w1", ttl_s=30, record=lambda: record("mine"))
    await lease.acquire()
    await kv.update("w1", msgspec.json.encode(record("mine")), last=lease.revision)

    await lease.release()

    with pytest.raises(KeyNotFoundError):
        await kv.get("w1")


async def test_release_leaves_an_entry_another_instance_took_over(nc: Client) -> None:
    kv = await ensure_bucket(nc.jetstream(), WORKERS_BUCKET, ttl_s=30)
    lease = Lease(kv, "w1", ttl_s=30, record=lambda: record("mine"))
    await lease.acquire()
    await kv.update("w1", msgspec.json.encode(record("theirs")), last=lease.revision)

    await lease.release()

    entry = await kv.get("w1")
    assert msgspec.json.decode(entry.value or b"", type=WorkerRecord).instance_id == "theirs"
