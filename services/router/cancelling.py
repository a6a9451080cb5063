"""The ``coordinator.cancel`` endpoint: a client's cancel passed on to the workers.

The router publishes a `CancelNotice` on ``coordinator.cancel.<task_id>`` (core NATS): the
worker running the task stops it, and one that takes it later fails it unrun. A client that
never learned its task's id names the reply subject of its waiting route request instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from nats.aio.client import Client

from schemas.events import encoder
from schemas.route import CancelNotice, CancelReply
from schemas.subjects import InvalidId, cancel_notice
from services.router.requests import parse_cancel_request
from services.runtime.errors import BadRequest, NotFound

log = structlog.get_logger("router")


class Canceller:
    """Answers cancel requests over the router's view of what is under way."""

    def __init__(
        self,
        nc: Client,
        inflight: Mapping[str, object],
        waiters: Mapping[str, object],
        waiting_on: Mapping[str, str],
    ) -> None:
        self.nc = nc
        self.inflight = inflight
        self.waiters = waiters
        self.waiting_on = waiting_on

    async def handle(self, body: bytes) -> bytes:
        """Pass a cancel on to the workers: the one running the task stops it, and one that has
        not taken it yet fails it unrun when it does. Refused for a task no router saw routed
        or that has ended."""
        request = parse_cancel_request(body)
        task_id = request.task_id or self.waiting_on.get(request.reply_to or "")
        if task_id is None:
            raise NotFound(f"no route request waits on {request.reply_to} (it was answered)")
        try:
            notice = cancel_notice(task_id)
        except InvalidId as exc:
            raise BadRequest(str(exc)) from None
        if task_id not in self.inflight and task_id not in self.waiters:
            raise NotFound(f"task {task_id} is not queued or running (it has ended, or is unknown)")
        await self.nc.publish(
            notice, encoder.encode(CancelNotice(task_id=task_id, reason=request.reason))
        )
        log.info("cancel requested", task_id=task_id, reason=request.reason)
        return encoder.encode(CancelReply(task_id=task_id, status="cancelling"))
