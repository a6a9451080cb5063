"""The gateway's side of the bus: replies it waits on, request/reply calls, the router's
final message read as a reply or an error, and the cancel of a task whose client went away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.queries import WorkersReply, WorkerView
from schemas.route import CHUNK_HEADER, CancelRequest, RouteReply, StreamChunk, failure_of
from schemas.subjects import WORKERS, cancel_from
from services.errors import (
    CoordinatorError,
    NoResponder,
    NotFound,
    NoWorker,
    TooLarge,
    WaitTimeout,
)
from services.gateway.common import ApiError, encoder, failure_status, refusal_status
from services.runtime.bus import identity_of
from services.runtime.request import raise_if_error

log = structlog.get_logger("gateway")

# Request/reply calls that only read (workers, a task) or cancel.
QUERY_TIMEOUT_S: Final = 5.0
# A client that leaves before the router took its request: cancel tries, and the pause between.
CANCEL_TRIES: Final = 3
CANCEL_RETRY_S: Final = 0.2

_reply_decoder = msgspec.json.Decoder(RouteReply)
_workers_decoder = msgspec.json.Decoder(WorkersReply)


class Replies:
    """One subscription for every reply the gateway waits on (``<inbox>.<n>`` each), as
    nats.py's own requests do: no SUB and UNSUB on the bus per request."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[Msg]] = {}
        self._count = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self.prefix}.*", cb=self._deliver)

    async def stop(self) -> None:
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    async def _deliver(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg)

    def open(self) -> tuple[str, asyncio.Queue[Msg]]:
        """A fresh reply subject and the queue its messages arrive in."""
        self._count += 1
        subject = f"{self.prefix}.{self._count}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._queues[subject] = queue
        return subject, queue

    def close(self, subject: str) -> None:
        self._queues.pop(subject, None)


class SharedReplies:
    """One reply subject of `Replies`, as a streamed request reads it
    (`services.runtime.request.ReplySubject`). Closing it is its opener's: a relay whose client
    went away hands it to the cancel, which still reads what arrives."""

    def __init__(self, inbox: str, queue: asyncio.Queue[Msg]) -> None:
        self.inbox = inbox
        self._queue = queue

    async def next_msg(self, timeout_s: float) -> Msg | None:
        """The next message, or None after ``timeout_s`` of silence."""
        try:
            async with asyncio.timeout(timeout_s):
                return await self._queue.get()
        except TimeoutError:
            return None

    async def close(self) -> None:
        """Nothing here: its opener closes it (`Replies.close`)."""


class FleetBus:
    """The calls the gateway makes on the bus, over one connection and one `Replies`."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.replies = Replies(nc)

    async def call(self, subject: str, body: bytes, timeout_s: float) -> bytes:
        """Request/reply; an error reply or a silent bus becomes an `ApiError`."""
        try:
            reply = await self.nc.request(subject, body, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise ApiError(503, NoResponder.code, f"no service answers {subject}") from None
        except nats.errors.TimeoutError:
            raise ApiError(
                504, WaitTimeout.code, f"{subject} did not answer in {timeout_s:g} s"
            ) from None
        except nats.errors.MaxPayloadError:
            raise ApiError(
                413,
                TooLarge.code,
                f"the request is {len(body)} bytes, over what one NATS message can hold "
                f"({self.nc.max_payload} bytes, the server's max_payload)",
            ) from None
        try:
            raise_if_error(reply.data, reply.headers or {})
        except CoordinatorError as exc:
            status = refusal_status(exc.code, fleet_has_workers=True)
            raise ApiError(status, exc.code, exc.message) from None
        return reply.data

    async def workers(self) -> list[WorkerView]:
        return (await self.fleet()).workers

    async def fleet(self) -> WorkersReply:
        return _workers_decoder.decode(await self.call(WORKERS, b"{}", QUERY_TIMEOUT_S))

    async def has_workers(self) -> bool:
        """Is any inference worker live? (Then an unserved model is unknown, not unserved.)"""
        try:
            return any(w.tier != "web" for w in await self.workers())
        except ApiError:
            return False

    async def refusals(
        self, items: AsyncIterator[StreamChunk | bytes]
    ) -> AsyncIterator[StreamChunk | bytes]:
        """A streamed request's chunks and final reply, its errors as `ApiError` with their
        classes' statuses. ``no_worker`` is an unknown model ("model not found", 404) while
        some worker is live, a fleet without capacity (503) when none is."""
        try:
            async for item in items:
                yield item
        except ApiError:
            raise
        except CoordinatorError as exc:
            message = exc.message
            has_workers = await self.has_workers() if exc.code == NoWorker.code else False
            status = refusal_status(exc.code, fleet_has_workers=has_workers)
            if status == 404 and exc.code == NoWorker.code:
                message = f"model not found: {message}"
            raise ApiError(status, exc.code, message) from exc

    @staticmethod
    def final(data: bytes, *, failed_is_error: bool = True) -> RouteReply:
        """The router's final reply; a failed task (``failed_is_error``) as `ApiError`."""
        reply = _reply_decoder.decode(data)
        if reply.status == "failed" and failed_is_error:
            failure = failure_of(reply)
            raise ApiError(
                failure_status(failure.code),
                failure.code,
                f"task {reply.task_id} failed on worker {reply.worker}: {failure.message}",
            )
        return reply

    async def cancel_abandoned(
        self, inbox: str, queue: asyncio.Queue[Msg], task_id: str | None, client: str | None
    ) -> None:
        """The client went away: cancel its task, by id when the id came, else by the route
        request's reply subject (tried a few times: the router may not have taken it yet).
        ``client``: the key the task came in with, whose task it is."""
        cancel = CancelRequest(
            task_id=task_id,
            reply_to=None if task_id else inbox,
            reason="the HTTP client disconnected",
            client=client,
        )
        # On the subject naming this gateway: only a gateway's identity may speak for a key.
        cancel_subject = cancel_from(identity_of(self.nc))
        try:
            for attempt in range(CANCEL_TRIES):
                try:
                    await self.call(cancel_subject, encoder.encode(cancel), QUERY_TIMEOUT_S)
                except ApiError as exc:
                    if exc.code != NotFound.code or attempt == CANCEL_TRIES - 1 or task_id:
                        raise
                    if any(CHUNK_HEADER not in (m.headers or {}) for m in drain(queue)):
                        return  # answered (refused, or ended) in the meantime
                    await asyncio.sleep(CANCEL_RETRY_S)
                    continue
                log.info("client went away; task cancelled", task_id=task_id, inbox=inbox)
                return
        except ApiError as exc:
            log.info("client went away; nothing cancelled", task_id=task_id, error=exc.message)
        except Exception as exc:
            log.warning("client went away; cancel failed", task_id=task_id, error=repr(exc))
        finally:
            self.replies.close(inbox)


def drain(queue: asyncio.Queue[Msg]) -> list[Msg]:
    """What has arrived on ``queue`` and not been taken yet."""
    msgs: list[Msg] = []
    while not queue.empty():
        msgs.append(queue.get_nowait())
    return msgs
