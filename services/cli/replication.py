"""How many servers of a JetStream cluster keep each stream and bucket: ``coordinator setup
--replicas N``.

JetStream changes a stream's replica count in place: the new replicas copy the stream from
its leader while it goes on taking writes, and a consumer whose own replica count is unset
(every consumer the services make) follows its stream. A KV bucket is a stream
(``KV_<bucket>``) and changes the same way. So a fleet moves from one replica to three
without stopping and without losing a message; this module asks for the change, then waits
until every new replica has caught up, so that "done" means each stream survives the loss of
a server.

A single server keeps one copy of everything; it is refused more, as a cluster is refused
more replicas than it has servers up (JetStream would refuse too, but only one stream at a
time: the first refusal here comes before any stream has changed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from nats.js import JetStreamContext
from nats.js.api import StreamInfo
from nats.js.errors import APIError

from schemas.subjects import (
    ASLEEP_BUCKET,
    EVENTS_STREAM,
    GATEWAY_KEYS_BUCKET,
    LEADERS_BUCKET,
    STATS_BUCKET,
    TASKS_STREAM,
    WORKERS_BUCKET,
)
from services.errors import ConfigError, Unavailable

# Every bucket `coordinator setup` makes, and with the two streams every stream the fleet keeps.
FLEET_BUCKETS: Final = (
    WORKERS_BUCKET,
    STATS_BUCKET,
    ASLEEP_BUCKET,
    GATEWAY_KEYS_BUCKET,
    LEADERS_BUCKET,
)
# The buckets whose entries are leases: their TTL is the workers' (``WORKER_TTL_S``).
LEASE_BUCKETS: Final = (WORKERS_BUCKET, LEADERS_BUCKET)
FLEET_STREAMS: Final = (TASKS_STREAM, EVENTS_STREAM, *(f"KV_{b}" for b in FLEET_BUCKETS))
# JetStream's answer when no set of servers can hold the replicas asked for.
NO_SUITABLE_PEERS: Final = 10005
# How long the new replicas get to catch up before setup says which have not.
CATCH_UP_S: Final = 120.0


@dataclass(frozen=True)
class Replication:
    """One stream after the change: its replica count, leader, and how many copies are current
    (the leader's included)."""

    stream: str
    replicas: int
    leader: str | None
    current: int
    messages: int

    def line(self) -> str:
        where = f", leader {self.leader}" if self.leader else ""
        return (
            f"{self.stream}: {self.replicas} replica(s), {self.current} current{where}, "
            f"{self.messages} msgs"
        )


def servers_up(server_info: dict[str, Any]) -> list[str]:
    """The client URLs of the cluster's servers up now, as the connected server advertises
    them (itself included); [] when it advertises none (``no_advertise``) or is not clustered."""
    return [str(url) for url in server_info.get("connect_urls") or []]


def check_replicas_possible(server_info: dict[str, Any], where: str, replicas: int) -> None:
    """Refuse ``replicas`` a server or cluster cannot keep, before anything changes."""
    if replicas == 1:
        return
    cluster = server_info.get("cluster")
    if not cluster:
        raise ConfigError(
            f"NATS at {where} is a single server, not a JetStream cluster: it keeps one copy of "
            f"each stream, not {replicas} (render a cluster with `coordinator deploy render nats "
            "--cluster …`, see deploy/README.md)"
        )
    up = servers_up(server_info)
    if up and len(up) < replicas:
        raise ConfigError(
            f"NATS cluster {cluster!r} has {len(up)} server(s) up ({', '.join(sorted(up))}): "
            f"it cannot keep {replicas} replicas of a stream"
        )


def replication_of(info: StreamInfo) -> Replication:
    """What a stream's info says of its copies."""
    cluster = info.cluster
    followers = (cluster.replicas or []) if cluster is not None else []
    leader = cluster.leader if cluster is not None else None
    current = (1 if leader or cluster is None else 0) + sum(
        1 for peer in followers if peer.current and not peer.offline
    )
    return Replication(
        stream=info.config.name or "?",
        replicas=info.config.num_replicas or 1,
        leader=leader,
        current=current,
        messages=info.state.messages,
    )


async def set_replicas(
    js: JetStreamContext,
    server_info: dict[str, Any],
    where: str,
    replicas: int,
    *,
    streams: Sequence[str] = FLEET_STREAMS,
    catch_up_s: float = CATCH_UP_S,
) -> list[Replication]:
    """Give every stream in ``streams`` ``replicas`` copies, then wait until all are current.

    Raises `ConfigError` when the server or cluster cannot keep that many, `Unavailable` when
    some copies have not caught up within ``catch_up_s`` (they go on catching up; run setup
    again, or `coordinator doctor`, to see them).
    """
    check_replicas_possible(server_info, where, replicas)
    for name in streams:
        info = await js.stream_info(name)
        if (info.config.num_replicas or 1) == replicas:
            continue
        try:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))
        except APIError as exc:
            if exc.err_code == NO_SUITABLE_PEERS:
                raise ConfigError(
                    f"NATS at {where} cannot keep {replicas} replicas of {name}: {exc.description}"
                    " (fewer servers up than replicas?)"
                ) from exc
            raise
    return await _caught_up(js, streams, replicas, catch_up_s)


async def _caught_up(
    js: JetStreamContext, streams: Sequence[str], replicas: int, within_s: float
) -> list[Replication]:
    deadline = time.monotonic() + within_s
    while True:
        found = [replication_of(await js.stream_info(name)) for name in streams]
        behind = [r for r in found if r.current < replicas]
        if not behind:
            return found
        if time.monotonic() > deadline:
            raise Unavailable(
                f"after {within_s:g} s, not every replica has caught up: "
                + "; ".join(f"{r.stream} {r.current} of {replicas} current" for r in behind)
                + " (they go on catching up: run `coordinator doctor` to follow them)"
            )
        await asyncio.sleep(0.25)
