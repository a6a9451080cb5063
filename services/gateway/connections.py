"""The gateway's connections: a header deadline aiohttp does not have, and the site that
listens with it.

aiohttp's own timers cover the rest: ``keepalive_timeout`` closes a connection that waits for
a request (from when it opens, and from the end of each response) and, in aiohttp 3.14, also
one whose request header is still incomplete by then; ``lingering_time`` bounds how long an
unread body is discarded after a response. What it lacks is a short limit on a header that
trickles in (a slowloris client keeps many connections open that way, each for the whole
keep-alive time). `HeaderDeadline` adds one: from the first byte of a request to the moment
its handler runs (the whole header parsed), at most ``header_timeout_s``, else the connection
is closed. The body's own limit is the service's (``GATEWAY_BODY_TIMEOUT_S``).

It wraps aiohttp's protocol (the runner's `web.Server`, a protocol factory) without changing
it: every call asyncio makes is passed on, and the middleware says when a request starts and
ends.
"""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web
from aiohttp.typedefs import Handler

log = structlog.get_logger("gateway")


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's protocol, and a timer while a request header arrives."""

    def __init__(self, inner: asyncio.Protocol, deadline: HeaderDeadline) -> None:
        self.inner = inner
        self.deadline = deadline
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio's calls, passed on ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.deadline.connections[transport] = self
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.busy and self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.deadline.header_timeout_s, self._expired)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        if self.transport is not None:
            self.deadline.connections.pop(self.transport, None)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- the deadline ------------------------------------------------------------------------

    def started(self) -> None:
        """A request's header is whole and its handler runs: no deadline while it does."""
        self.busy = True
        self._cancel()

    def ended(self) -> None:
        """The handler returned: the next byte starts the next request's deadline."""
        self.busy = False

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _expired(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        log.info(
            "connection closed: its request header did not arrive in time",
            peer=str(self.transport.get_extra_info("peername")),
            header_timeout_s=self.deadline.header_timeout_s,
        )
        self.transport.close()


class HeaderDeadline:
    """The header deadline of every connection of one listener: its protocol factory
    (`wrap`) and the middleware that marks when a request runs."""

    def __init__(self, header_timeout_s: float) -> None:
        self.header_timeout_s = header_timeout_s
        self.connections: dict[asyncio.BaseTransport, _Guarded] = {}

    def wrap(self, server: web.Server) -> _Guarded:
        """A new connection's protocol: ``server``'s own, guarded."""
        return _Guarded(server(), self)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        guarded = self.connections.get(request.transport) if request.transport else None
        if guarded is not None:
            guarded.started()
        try:
            return await handler(request)
        finally:
            if guarded is not None:
                guarded.ended()


class GuardedSite(web.BaseSite):
    """`web.TCPSite`, with `HeaderDeadline` on every connection."""

    __slots__ = ("_deadline", "_host", "_port")

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, deadline: HeaderDeadline
    ) -> None:
        super().__init__(runner)
        self._host = host
        self._port = port
        self._deadline = deadline

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self._deadline.wrap(server),
            self._host,
            self._port,
            backlog=self._backlog,
        )
