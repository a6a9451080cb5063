"""A registry that stopped storing heartbeats while the connection stayed up.

While a JetStream cluster elects the ``workers`` bucket's leader (seconds: longer than a
TTL), no heartbeat is stored and every worker's entry ages, though the workers are fine; a
view judged by those entries would find them all dead (the router refusing ``no_worker``, the
reaper failing running tasks). So when a view has heard from no worker for a third of a TTL
(`services.fleet.settling.is_quiet`), this asks whether the bucket answers (its stream's
info, with its leader); while it does not, the view settles again, waiting for the workers that
were live to heartbeat again (`SettlingTracker.wait_for`). The view's own watch may be what
went quiet: its consumer lost with the node that held it, the connection still up. When the
bucket answers with a revision newer than the watch has read (`BucketCursor`), the watch
starts again from the bucket's current values, and the view settles meanwhile. Settling after
a stall allows the workers, beyond a TTL, the time their connections take to leave a node
that was cut off (`FAILOVER_S`): a partition stalls the bucket and cuts workers off at once.
A quiet registry that answers, its watch in step, is a fleet whose workers all went silent:
verdicts go ahead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final

import structlog
from nats.js import JetStreamContext
from nats.js.api import ClusterInfo, PeerInfo

from schemas.subjects import WORKERS_BUCKET
from schemas.workers import WorkerRecord
from services.fleet.settling import SettlingTracker, awaited_after_outage, is_quiet
from services.runtime.bus import MAX_OUTSTANDING_PINGS, PING_INTERVAL_S
from services.runtime.watch import BucketCursor

log = structlog.get_logger("stall")

# How often a view's quiet is looked at, and how long the bucket gets to answer.
LOOK_S: Final = 0.25
PROBE_TIMEOUT_S: Final = 0.5
# A replicated stream's leader that has heard from none of its replicas for this long is cut
# off from them: it still answers, but stores nothing the others will keep (its followers,
# healthy, are heard every second; this leaves room for a busy machine).
ISOLATED_AFTER_S: Final = 2.0
# How long a worker connected to a node that was cut off takes to notice and move to another
# (its pings unanswered): a registry stalled by that cut hears from it this much later.
FAILOVER_S: Final = PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1)


def leader_cut_off(replicas: Sequence[PeerInfo]) -> bool:
    """Has a replicated stream's leader heard from none of its ``replicas`` for
    `ISOLATED_AFTER_S` (each one offline, or silent that long)? A leader on a node cut off
    from the cluster answers for a few seconds more before it steps down."""
    return bool(replicas) and all(
        r.offline or (r.active or 0) / 1e9 > ISOLATED_AFTER_S for r in replicas
    )


def _led(cluster: ClusterInfo) -> bool:
    """Has a replicated stream a leader that hears its replicas?"""
    return bool(cluster.leader) and not leader_cut_off(cluster.replicas or [])


async def bucket_revision(js: JetStreamContext, bucket: str = WORKERS_BUCKET) -> int | None:
    """The bucket's newest revision, or None when its stream does not answer (replicated:
    has no leader, or a leader cut off from every replica)."""
    try:
        info = await asyncio.wait_for(js.stream_info(f"KV_{bucket}"), PROBE_TIMEOUT_S)
    except Exception:
        return None
    cluster = info.cluster
    if cluster is not None and cluster.name and not _led(cluster):
        return None
    return int(info.state.last_seq)


async def watch_stalls(
    js: JetStreamContext,
    settling: SettlingTracker,
    records: Callable[[], Iterable[WorkerRecord]],
    cursor: BucketCursor,
    ttl_s: float,
) -> None:
    """Keep ``settling`` unsettled while the registry is quiet and its bucket does not answer,
    and start the watch (``cursor``) again when it fell behind (run it as a task; cancel to
    stop)."""
    stalled = False
    while True:
        await asyncio.sleep(LOOK_S)
        stalled = await look_once(js, settling, records, cursor, ttl_s, stalled=stalled)


async def look_once(
    js: JetStreamContext,
    settling: SettlingTracker,
    records: Callable[[], Iterable[WorkerRecord]],
    cursor: BucketCursor,
    ttl_s: float,
    *,
    stalled: bool = False,
) -> bool:
    """One look (`watch_stalls`); a caller about to say that no worker is live makes one
    too, so a verdict never waits on the watcher's next look. True while the bucket does not
    answer (``stalled``: it did not at the last look, for the log)."""
    current = list(records())
    if not is_quiet(current, time.time(), ttl_s):
        return False
    revision = await bucket_revision(js)
    if revision is not None and not cursor.behind(revision):
        if stalled:
            log.info("the worker registry answers again")
        return False
    # Settle again: the workers live when it went quiet must be heard again, within a TTL
    # of the time their connections take to leave a node cut off (`FAILOVER_S`).
    settling.wait_for(time.time() + FAILOVER_S, awaited_after_outage(current, ttl_s))
    if revision is not None:
        log.warning(
            "the worker registry's watch fell behind (its consumer was lost?); reading "
            "the bucket again",
            watched=cursor.revision,
            stored=revision,
        )
        cursor.restart.set()
    elif not stalled:
        log.warning(
            "the worker registry stores no heartbeats (a JetStream leader election?); "
            "no worker is judged dead until it does",
            within_s=ttl_s,
        )
    return revision is None
