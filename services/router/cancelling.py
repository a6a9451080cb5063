"""The ``coordinator.cancel`` endpoints: a client's cancel passed on to the workers.

Who cancels is the identity the cancel's subject names (``coordinator.cancel.from.<identity>``,
which the server lets only that identity publish); on ``coordinator.cancel`` (a bus without
users), the identity whose inbox its reply subject is. Only a task's owner and the operator
may cancel it (`services.fleet.identity.may_see`).

The router publishes a `CancelNotice` on ``coordinator.cancel.<task_id>`` (core NATS): the
worker running the task stops it, and one that takes it later fails it unrun. A client that
never learned its task's id names the reply subject of its waiting route request instead.

Any router may take the cancel, whichever took the route request: a reply subject this one
does not hold is asked of the other routers (`services.router.peers`), and a task it does not
know as queued or running is looked up in the event log (routed before this router started,
say), then asked of the others (being submitted by one of them just now).
"""

from __future__ import annotations

from collections.abc import Mapping

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext

from schemas.events import encoder
from schemas.route import CancelNotice, CancelReply
from schemas.subjects import InvalidId, cancel_notice, sender_of_cancel
from services.errors import BadRequest, NotFound
from services.fleet.identity import Owner, is_operator, may_see
from services.router.following import task_owner
from services.router.peers import Peers
from services.router.requests import parse_cancel_request
from services.runtime.endpoints import reply_subject, request_subject
from services.runtime.outcomes import current_attempt, stored_outcome

log = structlog.get_logger("router")


class Canceller:
    """Answers cancel requests over the router's view of what is under way."""

    def __init__(
        self,
        nc: Client,
        inflight: Mapping[str, object],
        waiters: Mapping[str, object],
        waiting_on: Mapping[str, str],
        peers: Peers,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.inflight = inflight
        self.waiters = waiters
        self.waiting_on = waiting_on
        self.peers = peers

    async def handle(self, body: bytes) -> bytes:
        """Pass a cancel on to the workers: the one running the task stops it, and one that has
        not taken it yet fails it unrun when it does. Refused for a task no router knows as
        queued or running (it has ended, or is unknown)."""
        request = parse_cancel_request(body)
        sender = sender_of_cancel(request_subject.get())
        viewer = (
            Owner.asking(reply_subject.get(), request.client)
            if sender is None
            else Owner.of(sender, request.client)
        )
        if request.task_id is None:
            # A reply subject is held a moment after its answer (`services.router.waiting`):
            # its task may have ended. Only whoever may read that reply may cancel by it.
            task_id = await self.peers.holder_of(reply_to=request.reply_to)
            asked_by = Owner.asking(request.reply_to, request.client)
            if (
                task_id is None
                or not may_see(asked_by, viewer)
                or not await self._under_way(task_id)
            ):
                raise NotFound(f"no route request waits on {request.reply_to} (it was answered)")
        else:
            task_id = request.task_id
            try:
                cancel_notice(task_id)
            except InvalidId as exc:
                raise BadRequest(str(exc)) from None
            if not await self._may_cancel(task_id, viewer) or not await self._under_way(task_id):
                raise NotFound(
                    f"task {task_id} is not queued or running (it has ended, or is unknown)"
                )
        await self.nc.publish(
            cancel_notice(task_id),
            encoder.encode(CancelNotice(task_id=task_id, reason=request.reason)),
        )
        log.info("cancel requested", task_id=task_id, reason=request.reason)
        return encoder.encode(CancelReply(task_id=task_id, status="cancelling"))

    async def _may_cancel(self, task_id: str, viewer: Owner) -> bool:
        """Whether the task is ``viewer``'s to cancel, by its ``submitted`` (stored before it
        is queued). One not stored yet (another router is submitting it this moment) is
        cancelled only by the operator, or in a fleet without identities."""
        if is_operator(viewer.asker):
            return True
        owner = await task_owner(self.js, task_id)
        return viewer.asker is None if owner is None else may_see(owner, viewer)

    async def _under_way(self, task_id: str) -> bool:
        """Is the task queued or running: in this router's view, else by the event log (the
        attempt its latest ``routed`` names has no outcome stored), else in another router's
        hands?"""
        if task_id in self.inflight or task_id in self.waiters:
            return True
        attempt = await current_attempt(self.js, task_id)
        if attempt is not None:
            # Any recorder's outcome ends the attempt here: a cancel needs no proof of origin.
            return await stored_outcome(self.js, task_id, attempt, lambda _: True) is None
        return await self.peers.holder_of(task_id=task_id) is not None
