"""``coordinator doctor``'s checks of a JetStream cluster: pure functions of what was gathered.

When the server the doctor reaches is one node of a cluster, three more lines:

- ``cluster peers``: every server of the meta group (the cluster's JetStream), as its leader
  sees it; a peer offline or not current is a problem (a second one lost stops every write).
- ``meta leader``: the server that decides where streams live; none means fewer than a
  majority of the servers are up, and JetStream refuses every change.
- ``stream replicas``: each of the fleet's streams and buckets: as many copies as the cluster
  can keep (one copy on a cluster is a single point of failure), a leader, and every follower
  current and within `MAX_REPLICA_LAG` operations of it.

The meta group is visible only to the system account's user (``NATS_SYSTEM_USER``); without
it the first two lines are skipped and say so.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from nats.js.api import StreamInfo

from services.cli.doctor_line import Check, ok, problem

# A follower this many operations behind its leader is lagging, not just between two writes.
MAX_REPLICA_LAG: Final = 100
# The copies a stream should have on a cluster: enough to lose one server (setup --replicas 3).
WANTED_REPLICAS: Final = 3


@dataclass(frozen=True)
class Peer:
    """One server as a raft group's leader sees it."""

    name: str
    current: bool
    offline: bool = False
    lag: int = 0


@dataclass(frozen=True)
class MetaGroup:
    """The cluster's meta group, from its leader's ``JSZ`` (None when no leader answered)."""

    cluster: str
    leader: str | None
    peers: tuple[Peer, ...]  # the leader first, then the followers
    size: int


def meta_from_jsz(replies: Sequence[Mapping[str, Any]]) -> MetaGroup | None:
    """The meta group from the servers' answers to ``$SYS.REQ.SERVER.PING.JSZ``: the
    leader's own view when it answered; None when no server answered as clustered."""
    views: list[tuple[Any, Mapping[str, Any]]] = []
    for reply in replies:
        meta = (reply.get("data") or {}).get("meta_cluster")
        if meta:
            views.append(((reply.get("server") or {}).get("name"), meta))
    if not views:
        return None
    leader = next((meta.get("leader") for _, meta in views if meta.get("leader")), None)
    own = next((meta for name, meta in views if leader and name == leader), None)
    if own is None:
        # No leader elected, or the one the others name did not answer (it just went away):
        # nobody speaks for the group. The followers' view of it says who they know.
        _, meta = views[0]
        return MetaGroup(
            cluster=str(meta.get("name", "?")),
            leader=None,
            peers=tuple(_peer(p) for p in meta.get("replicas") or []),
            size=int(meta.get("cluster_size") or 0),
        )
    peers = (Peer(str(leader), current=True), *(_peer(p) for p in own.get("replicas") or []))
    return MetaGroup(
        cluster=str(own.get("name", "?")),
        leader=leader,
        peers=peers,
        size=int(own.get("cluster_size") or len(peers)),
    )


def _peer(raw: Mapping[str, Any]) -> Peer:
    return Peer(
        name=str(raw.get("name", "?")),
        current=bool(raw.get("current")),
        offline=bool(raw.get("offline")),
        lag=int(raw.get("lag") or 0),
    )


def check_peers(meta: MetaGroup | None, meta_error: str) -> Check:
    """Every peer of the meta group online and current."""
    if meta is None:
        return Check("cluster peers", "skipped", meta_error)
    problems = [_peer_problem(p) for p in meta.peers if _peer_problem(p)]
    if meta.leader is None:
        return problem("cluster peers", [f"no leader to ask; {len(meta.peers)} peer(s) known"])
    if len(meta.peers) < meta.size:
        problems.append(f"{meta.size - len(meta.peers)} of {meta.size} peer(s) unknown")
    if problems:
        return problem("cluster peers", problems)
    names = ", ".join(sorted(p.name for p in meta.peers))
    return ok("cluster peers", f"{len(meta.peers)} of cluster {meta.cluster}: {names}, all current")


def _peer_problem(peer: Peer) -> str:
    if peer.offline:
        return f"{peer.name} is offline"
    if not peer.current:
        return f"{peer.name} is not current" + (f" ({peer.lag} behind)" if peer.lag else "")
    if peer.lag > MAX_REPLICA_LAG:
        return f"{peer.name} lags {peer.lag} operations behind"
    return ""


def check_meta_leader(meta: MetaGroup | None, meta_error: str) -> Check:
    if meta is None:
        return Check("meta leader", "skipped", meta_error)
    if meta.leader is None:
        return problem(
            "meta leader",
            [
                "none: fewer than a majority of the cluster's servers are up, and JetStream "
                "refuses every change until they are"
            ],
        )
    return ok("meta leader", meta.leader)


def check_stream_replicas(
    streams: Mapping[str, StreamInfo | None], unanswered: Sequence[str], cluster_size: int
) -> Check:
    """Each stream has the copies the cluster can keep, a leader, and followers in step."""
    wanted = min(WANTED_REPLICAS, cluster_size) if cluster_size else WANTED_REPLICAS
    problems = [
        f"{name} does not answer (no leader: too few of its servers up?)" for name in unanswered
    ]
    counts: set[int] = set()
    for name, info in streams.items():
        if info is None:
            continue  # missing: the streams check says so
        replicas = info.config.num_replicas or 1
        counts.add(replicas)
        if replicas < wanted:
            problems.append(
                f"{name} has {replicas} replica(s), the cluster can keep {wanted} (a server "
                f"lost is {name} lost): run `coordinator setup --replicas {wanted}`"
            )
        cluster = info.cluster
        if cluster is None or not cluster.leader:
            problems.append(f"{name} has no leader")
            continue
        followers = cluster.replicas or []
        if len(followers) < replicas - 1:
            problems.append(f"{name}: {replicas - 1 - len(followers)} replica(s) not placed")
        for peer in followers:
            lag = peer.lag or 0
            if peer.offline:
                problems.append(f"{name}: replica on {peer.name} is offline")
            elif not peer.current:
                problems.append(f"{name}: replica on {peer.name} is not current ({lag} behind)")
            elif lag > MAX_REPLICA_LAG:
                problems.append(f"{name}: replica on {peer.name} lags {lag} operations behind")
    if problems:
        return problem("stream replicas", problems)
    each = ", ".join(str(c) for c in sorted(counts)) or "?"
    return ok("stream replicas", f"{len(streams)} streams, {each} replicas each, all current")


def cluster_checks(
    meta: MetaGroup | None,
    meta_error: str,
    streams: Mapping[str, StreamInfo | None],
    unanswered: Sequence[str],
) -> list[Check]:
    """The cluster's three lines, in order."""
    size = meta.size if meta is not None else 0
    return [
        check_peers(meta, meta_error),
        check_meta_leader(meta, meta_error),
        check_stream_replicas(streams, unanswered, size),
    ]
