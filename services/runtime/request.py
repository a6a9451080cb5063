"""Calling a service over NATS: request/reply and streamed replies, error replies raised.

Any process that calls a service endpoint uses this (the CLI, the bench job, tests,
benchmarks): the trace context goes along, an error reply is raised as the catalogued class
of its code (`services.errors.from_code`: ``no_worker`` is `NoWorker`, a code nobody
catalogued a `RemoteError` that keeps it), and the bus's own failures are mapped to the
project's errors here, by nats.py's classes: nobody answering (or in time) is `NoResponder`,
a request over the server's ``max_payload`` `TooLarge`, a closed or reconnecting connection
`Unavailable`.

A route request that waits names its task (`new_task_id`) and is asked again, with the same
id, when the router goes silent for too long (``reask_s``): a router answers such a request
as the task it names, so a client whose router died while it waited (or whose connection
dropped the answer) still gets the outcome. `StreamedRequest` is that protocol's one client:
the CLI uses it through `stream_call` (a reply subject of its own), the gateway with the reply
subject it shares between requests.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Final, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.route import CHUNK_HEADER, ErrorBody, StreamChunk
from services.errors import (
    CoordinatorError,
    NoResponder,
    TooLarge,
    Unavailable,
    WaitTimeout,
    from_code,
)
from services.runtime.tracing import inject_context

# The errors of the connection itself: the call may work again once it has reconnected.
_CONNECTION_ERRORS = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
)

_error_decoder = msgspec.json.Decoder(ErrorBody)
_chunk_decoder = msgspec.json.Decoder(StreamChunk)

# A route request waiting on a router that says nothing for this long is asked again by its
# task id: a router that died takes its answer with it, and a live one stays silent until the
# end of a task that streams nothing.
REASK_AFTER_S = 10.0
# How long a request that may be asked again is asked again while nobody can serve it (see the
# module's docstring): past a JetStream cluster's leader election (4 to 9 s) and a service's
# start, short enough that a stack that is not running is said so within seconds.
UNSERVED_FOR_S: Final = 10.0
# How often it is asked meanwhile.
ASK_AGAIN_EVERY_S: Final = 0.5

# Told, once per spell, that a request found nobody able to serve it and is asked again: the
# error it got, and for how long at most it is asked (a CLI says so on stderr).
OnUnserved = Callable[[CoordinatorError, float], None]


def new_task_id() -> str:
    """Time-ordered, unique and safe as a subject token: the router's ids, and the ids a
    client chooses for its own route requests (`schemas.route.RouteRequest.task_id`)."""
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:12]}"


@contextmanager
def _bus_errors(subject: str) -> Iterator[None]:
    """nats.py's failures to send, as the project's errors (a timeout is the caller's to say)."""
    try:
        yield
    except nats.errors.NoRespondersError as exc:
        raise NoResponder(f"no service answers {subject}: is the stack running?") from exc
    except nats.errors.MaxPayloadError as exc:
        raise TooLarge(f"the request to {subject} is over the NATS server's max_payload") from exc
    except _CONNECTION_ERRORS as exc:
        raise Unavailable(f"{subject}: the NATS connection failed: {exc}") from exc


async def call(
    nc: Client,
    subject: str,
    body: bytes,
    timeout_s: float,
    *,
    unserved_s: float | None = None,
    on_unserved: OnUnserved | None = None,
) -> bytes:
    """Request/reply; an error reply raises the catalogued class of its code.

    The current trace context goes along (``traceparent``), so the service continues it. With
    ``unserved_s`` (a request that may be asked again: one that changes nothing), a request
    nobody can serve just now (nobody listens on ``subject``, an ``unavailable`` reply, the
    connection reconnecting) is asked again every `ASK_AGAIN_EVERY_S` for up to ``unserved_s``
    before its error is raised; one not answered within ``timeout_s`` is not.
    """
    unserved = None if unserved_s is None else _Unserved(subject, unserved_s, on_unserved)
    while True:
        try:
            return await _call_once(nc, subject, body, timeout_s)
        except (Unavailable, NoResponder) as exc:
            if unserved is None or not _nobody_could_serve(exc):
                raise
            await unserved.wait(exc)


async def _call_once(nc: Client, subject: str, body: bytes, timeout_s: float) -> bytes:
    with _bus_errors(subject):
        try:
            reply = await nc.request(
                subject, body, timeout=timeout_s, headers=inject_context({}) or None
            )
        except nats.errors.TimeoutError as exc:
            raise NoResponder(f"{subject} did not answer within {timeout_s:g} s") from exc
    raise_if_error(reply.data, reply.headers or {})
    return reply.data


def _nobody_could_serve(exc: Unavailable | NoResponder) -> bool:
    """Does ``exc`` say that nobody could serve the request just now (rather than that nobody
    answered it in time, which asking again would only make longer)?"""
    return isinstance(exc, Unavailable) or isinstance(exc.__cause__, nats.errors.NoRespondersError)


class _Unserved:
    """A spell of answers saying that nobody can serve a request just now, bounded by
    ``within_s`` from its first answer."""

    def __init__(self, subject: str, within_s: float, on_unserved: OnUnserved | None) -> None:
        self.subject = subject
        self.within_s = within_s
        self.on_unserved = on_unserved
        self.since: float | None = None

    def end(self) -> None:
        """The request was served (or is held by a service): a later spell is bounded anew."""
        self.since = None

    async def wait(self, exc: Unavailable | NoResponder) -> None:
        """Wait until the request is to be asked again; raise when the spell has lasted
        ``within_s``: ``exc``'s class, saying how long it was asked."""
        now = time.monotonic()
        if self.since is None:
            self.since = now
            if self.on_unserved is not None:
                self.on_unserved(exc, self.within_s)
        left = self.since + self.within_s - now
        if left <= 0:
            if isinstance(exc, NoResponder):
                raise NoResponder(
                    f"no service answered {self.subject} in {self.within_s:g} s of asking: "
                    "is the stack running?"
                ) from exc
            raise Unavailable(
                f"{self.subject} was still unavailable after asking again for "
                f"{self.within_s:g} s: {exc.message}"
            ) from exc
        await asyncio.sleep(min(ASK_AGAIN_EVERY_S, left))


def raise_if_error(data: bytes, headers: dict[str, str]) -> None:
    """Raise the error a reply is (``Nats-Service-Error-Code``), as its code's class."""
    code = headers.get("Nats-Service-Error-Code")
    if code is None:
        return
    try:
        detail = _error_decoder.decode(data).error
    except msgspec.DecodeError:
        raise from_code(code, headers.get("Nats-Service-Error", "")) from None
    raise from_code(detail.code, detail.message)


class ReplySubject(Protocol):
    """A reply subject and what arrives on it: a subscription of its own (`stream_call`), or
    one of many on a subscription shared by the caller's requests (the gateway's)."""

    @property
    def inbox(self) -> str: ...

    async def next_msg(self, timeout_s: float) -> Msg | None:
        """The next reply within ``timeout_s``; None after as long a silence."""
        ...

    async def close(self) -> None: ...


OpenReplySubject = Callable[[], Awaitable[ReplySubject]]


class StreamedRequest:
    """One request whose answer comes as chunks, then one final reply: the route protocol,
    as every caller speaks it (the CLI through `stream_call`, the gateway with its shared
    reply subject). In steps: `send`, `replies` (each reply read: a chunk, the final reply, a
    silence or a refusal handled), `_ask_again`.

    A refusal that comes after the request was asked again may be stale: a router that took
    an earlier copy decided before another router recorded the task from a later one, and its
    answer was held up (a node cut off, a client reconnecting meanwhile that lost the other
    router's answer). So such a refusal is checked once: the request is asked again on a
    fresh reply subject (``open_replies``), where nothing sent before can arrive, and that
    answer is the one taken (a router answers a request naming a recorded task as the task).

    ``timeout_s`` bounds the silence before the answer's end. With ``reask_s`` (a request
    that can be asked again, such as a route request naming its task), a silence that long
    sends the request again to the same reply subject, and a bus with nobody to answer at
    that moment (a router restarting) is waited out rather than an error. With ``unserved``
    as well, a request that nobody can serve just now (nobody listens on ``subject`` before a
    service took it, or an ``unavailable`` reply) is asked again every `ASK_AGAIN_EVERY_S`
    for as long as it allows before its error is raised. Errors are raised as the catalogued
    classes of their codes; a silence of ``timeout_s`` is `WaitTimeout`.
    """

    def __init__(
        self,
        nc: Client,
        subject: str,
        body: bytes,
        *,
        open_replies: OpenReplySubject,
        timeout_s: float,
        reask_s: float | None = None,
        unserved: _Unserved | None = None,
        on_ask_again: Callable[[], None] | None = None,
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.body = body
        self.open_replies = open_replies
        self._replies: ReplySubject | None = None
        self.timeout_s = timeout_s
        self.reask_s = reask_s
        self.unserved = unserved
        self.on_ask_again = on_ask_again
        self.headers = inject_context({}) or None
        self.asked_again = False
        """Asked again after a silence: a "no responders" answer then only means that nobody
        was there to take the repeat, and the next silence asks again."""
        self.checked = False
        """A refusal after asking again was checked on a fresh reply subject."""
        self.heard = time.monotonic()

    @property
    def inbox(self) -> str:
        """The reply subject the answer comes to now."""
        assert self._replies is not None, "replies() opens it"
        return self._replies.inbox

    async def send(self) -> None:
        with _bus_errors(self.subject):
            await self.nc.publish(self.subject, self.body, reply=self.inbox, headers=self.headers)
        self.heard = time.monotonic()

    async def replies(self) -> AsyncIterator[StreamChunk | bytes]:
        """Send the request, then yield its chunks and, last, its final reply's bytes."""
        self._replies = await self.open_replies()
        try:
            async for item in self._read():
                yield item
        finally:
            await self._replies.close()

    async def _read(self) -> AsyncIterator[StreamChunk | bytes]:
        await self.send()
        while True:
            msg = await self._next()
            if msg is None:
                continue  # a silence, asked again
            headers = msg.headers or {}
            if headers.get("Status") == "503":
                if not self.asked_again:
                    await self._unserved(
                        NoResponder(f"no service answers {self.subject}: is the stack running?")
                    )
                continue
            self.heard = time.monotonic()
            if CHUNK_HEADER in headers:
                if self.unserved is not None:
                    self.unserved.end()
                yield _chunk_decoder.decode(msg.data)
                continue
            try:
                raise_if_error(msg.data, headers)
            except Unavailable as exc:
                await self._unserved(exc)
                continue
            except CoordinatorError:
                if not self.asked_again or self.checked:
                    raise
                await self._check_refusal()
                continue
            yield msg.data
            return

    async def _check_refusal(self) -> None:
        """Ask again on a fresh reply subject: a refusal after asking again may be stale."""
        assert self._replies is not None
        stale, self._replies = self._replies, await self.open_replies()
        await stale.close()
        self.checked = True
        self.heard = time.monotonic()
        await self._ask_again()

    async def _next(self) -> Msg | None:
        """The next reply; None after a silence that asked the request again. Raises when
        the silence has lasted ``timeout_s`` (or would not be asked again)."""
        silent_s = time.monotonic() - self.heard
        wait_s = self.timeout_s - silent_s
        if self.reask_s is not None:
            wait_s = min(wait_s, self.reask_s)
        failed: Unavailable | None = None
        assert self._replies is not None
        try:
            with _bus_errors(self.subject):
                msg = await self._replies.next_msg(max(wait_s, 0.001))
        except Unavailable as exc:  # the connection is reconnecting
            msg, failed = None, exc
        if msg is not None:
            return msg
        if self.reask_s is None or time.monotonic() - self.heard >= self.timeout_s:
            if failed is not None:
                raise failed
            raise WaitTimeout(f"{self.subject}: nothing arrived for {self.timeout_s:g} s")
        if failed is not None:
            await asyncio.sleep(min(self.reask_s, 1.0))  # ask once it is back
        elif self.unserved is not None:
            self.unserved.end()  # silence: a service holds the request
        self.asked_again = True
        await self._ask_again()
        return None

    async def _unserved(self, exc: Unavailable | NoResponder) -> None:
        """Nobody could serve the request just now: ask again while ``unserved`` allows,
        else raise ``exc``."""
        if self.unserved is None:
            raise exc
        await self.unserved.wait(exc)
        await self._ask_again()

    async def _ask_again(self) -> None:
        """The same request to the same reply subject (a router answers a route request
        naming its task as that task); failing to send it is left to the next silence."""
        if self.on_ask_again is not None:
            self.on_ask_again()
        with suppress(Unavailable, NoResponder), _bus_errors(self.subject):
            await self.nc.publish(self.subject, self.body, reply=self.inbox, headers=self.headers)


async def stream_call(
    nc: Client,
    subject: str,
    body: bytes,
    timeout_s: float,
    *,
    reask_s: float | None = None,
    unserved_s: float | None = None,
    on_unserved: OnUnserved | None = None,
) -> AsyncIterator[StreamChunk | bytes]:
    """A `StreamedRequest` on reply subjects of its own, each subscribed before the request
    goes out so that no chunk can be missed: its chunks, then its final reply (yielded as
    bytes). ``unserved_s``: how long a request nobody can serve just now is asked again."""

    async def open_replies() -> ReplySubject:
        return await _Subscribed.open(nc)

    request = StreamedRequest(
        nc,
        subject,
        body,
        open_replies=open_replies,
        timeout_s=timeout_s,
        reask_s=reask_s,
        unserved=None if unserved_s is None else _Unserved(subject, unserved_s, on_unserved),
    )
    async for item in request.replies():
        yield item


class _Subscribed:
    """A reply subject with a subscription of its own."""

    def __init__(self, inbox: str, sub: Subscription) -> None:
        self.inbox = inbox
        self._sub = sub

    @classmethod
    async def open(cls, nc: Client) -> _Subscribed:
        inbox = nc.new_inbox()
        return cls(inbox, await nc.subscribe(inbox))

    async def next_msg(self, timeout_s: float) -> Msg | None:
        try:
            return await self._sub.next_msg(timeout=timeout_s)
        except nats.errors.TimeoutError:
            return None

    async def close(self) -> None:
        with suppress(Exception):
            await self._sub.unsubscribe()
