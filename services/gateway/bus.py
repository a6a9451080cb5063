"""The gateway's side of the bus: replies it waits on, request/reply calls, the router's
final message read as a reply or an error, and the cancel of a task whose client went away."""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.queries import WorkersReply, WorkerView
from schemas.route import CHUNK_HEADER, CancelRequest, ErrorBody, RouteReply, failure_of
from schemas.subjects import CANCEL, WORKERS
from services.errors import NoResponder, NotFound, NoWorker, TooLarge, WaitTimeout
from services.gateway.common import ApiError, encoder, failure_status, refusal_status

log = structlog.get_logger("gateway")

# Request/reply calls that only read (workers, a task) or cancel.
QUERY_TIMEOUT_S: Final = 5.0
# A client that leaves before the router took its request: cancel tries, and the pause between.
CANCEL_TRIES: Final = 3
CANCEL_RETRY_S: Final = 0.2

_reply_decoder = msgspec.json.Decoder(RouteReply)
_error_decoder = msgspec.json.Decoder(ErrorBody)
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


async def next_msg(queue: asyncio.Queue[Msg], timeout_s: float) -> Msg | None:
    """The next message, or None after ``timeout_s`` of silence."""
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return None


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
        headers = reply.headers or {}
        code = headers.get("Nats-Service-Error-Code")
        if code is not None:
            status = refusal_status(code, fleet_has_workers=True)
            raise ApiError(status, code, _error_message(reply.data, headers))
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

    async def final(
        self, data: bytes, headers: dict[str, str], *, failed_is_error: bool = True
    ) -> RouteReply:
        """The router's last message as a reply; refusals (and, ``failed_is_error``, failed
        tasks) as `ApiError`."""
        if headers.get("Status") == "503":
            raise ApiError(503, NoResponder.code, "no router answers coordinator.route")
        code = headers.get("Nats-Service-Error-Code")
        if code is not None:
            message = _error_message(data, headers)
            has_workers = await self.has_workers() if code == NoWorker.code else False
            status = refusal_status(code, fleet_has_workers=has_workers)
            if status == 404 and code == NoWorker.code:
                message = f"model not found: {message}"
            raise ApiError(status, code, message)
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
        self, inbox: str, queue: asyncio.Queue[Msg], task_id: str | None
    ) -> None:
        """The client went away: cancel its task, by id when the id came, else by the route
        request's reply subject (tried a few times: the router may not have taken it yet)."""
        cancel = CancelRequest(
            task_id=task_id,
            reply_to=None if task_id else inbox,
            reason="the HTTP client disconnected",
        )
        try:
            for attempt in range(CANCEL_TRIES):
                try:
                    await self.call(CANCEL, encoder.encode(cancel), QUERY_TIMEOUT_S)
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


def _error_message(data: bytes, headers: dict[str, str]) -> str:
    try:
        return _error_decoder.decode(data).error.message
    except msgspec.DecodeError:
        return headers.get("Nats-Service-Error", "") or "error"
