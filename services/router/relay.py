"""Streamed answers, passed on: from the worker a task runs on to the client that asked.

Workers publish a task's chunks on ``coordinator.chunk.<worker id>.<task id>``; their NATS
users may publish under their own id only, and to no client's inbox. The router holds each
streaming client's reply subject and passes on a chunk only when it comes from the worker the
task's current attempt was routed to (for a pool's task, the first of the pool that streams
it), so no worker can write into another's answer or into a client's replies.
"""

from __future__ import annotations

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.subjects import POOL_NAMES, chunk_source

log = structlog.get_logger("router")


class ChunkRelay:
    """The streams being answered: task id -> the client's reply subject."""

    def __init__(self, nc: Client, routed_to: dict[str, tuple[str, float]]) -> None:
        self.nc = nc
        # The router's view of where each task runs (task id -> (worker id, time routed)).
        self.routed_to = routed_to
        self._clients: dict[str, str] = {}
        # A pool's task (shared CPU queue, web search): the pool member that streams it.
        self._pool_member: dict[str, str] = {}

    def open(self, task_id: str, reply_subject: str) -> None:
        self._clients[task_id] = reply_subject

    def close(self, task_id: str) -> None:
        self._clients.pop(task_id, None)
        self._pool_member.pop(task_id, None)

    def source_ok(self, task_id: str, worker_id: str) -> bool:
        """Does a chunk of ``task_id`` from ``worker_id`` come from where the task runs?"""
        routed = self.routed_to.get(task_id)
        if routed is None:
            return False
        if routed[0] not in POOL_NAMES:
            return routed[0] == worker_id
        member = self._pool_member.setdefault(task_id, worker_id)
        return member == worker_id

    async def on_chunk(self, msg: Msg) -> None:
        source = chunk_source(msg.subject)
        if source is None:
            return
        worker_id, task_id = source
        client = self._clients.get(task_id)
        if client is None:
            return  # nobody streams it (any more): a gap on nobody's screen
        if not self.source_ok(task_id, worker_id):
            log.warning(
                "chunk refused: not from the worker the task runs on",
                task_id=task_id,
                sent_by=worker_id,
                runs_on=(self.routed_to.get(task_id) or ("unknown",))[0],
            )
            return
        await self.nc.publish(client, msg.data, headers=msg.headers)
