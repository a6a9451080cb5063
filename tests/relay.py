"""A TCP relay between services and a nats-server: what a client sees of a link that goes down.

It can close every connection through it and refuse new ones for a while (`drop_for`), or
close them the moment given bytes pass one way, without passing those bytes on (`cut_on`):
an acknowledgement written just as the connection went down, a delivery sent just before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass


@dataclass
class Cut:
    """Close every connection when ``pattern`` next passes towards the server (``upstream``)
    or towards the client, dropping what carried it; `done` is set then."""

    pattern: bytes
    upstream: bool
    done: asyncio.Event


class Relay:
    """A TCP relay to one port of the loopback."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self._pairs: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self._cuts: list[Cut] = []

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def cut_on(self, pattern: bytes, *, upstream: bool) -> asyncio.Event:
        """Arm one cut (`Cut`); the returned event is set when it happened. The connections
        made afterwards pass everything."""
        done = asyncio.Event()
        self._cuts.append(Cut(pattern, upstream, done))
        return done

    def _cut_now(self, data: bytes, upstream: bool) -> bool:
        for cut in self._cuts:
            if cut.upstream == upstream and cut.pattern in data:
                self._cuts.remove(cut)
                cut.done.set()
                for writer in list(self._pairs):
                    writer.close()
                return True
        return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._pairs |= {writer, up_writer}

        async def pump(
            src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool
        ) -> None:
            with suppress(Exception):
                while data := await src.read(65536):
                    if self._cut_now(data, upstream):
                        break
                    dst.write(data)
                    await dst.drain()
            dst.close()
            with suppress(Exception):
                await dst.wait_closed()

        await asyncio.gather(pump(reader, up_writer, True), pump(up_reader, writer, False))
        self._pairs -= {writer, up_writer}

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _drop(self) -> None:
        assert self._server is not None
        self._server.close()  # new connections are refused
        for writer in list(self._pairs):
            writer.close()
        await asyncio.wait_for(asyncio.gather(*self._handlers, return_exceptions=True), 10)
        await self._server.wait_closed()

    async def drop_for(self, seconds: float) -> None:
        """Close every connection through the relay, and refuse new ones for ``seconds``."""
        await self._drop()
        await asyncio.sleep(seconds)
        await self._listen()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Relay]:
        await self._listen()
        try:
            yield self
        finally:
            await self._drop()
