"""A small HTTP/1.1 client for the request on a worker's hot path: a streamed POST whose
answer is read line by line (Ollama's NDJSON), on kept-alive connections.

Inside a worker under load, a generation over aiohttp costs about 0.5 ms of CPU more than
over this client (httpx about 3 ms more): over the 0.3 ms a general library was allowed
(``benchmarks/README.md``, "The one task loop against the tree before it"). It speaks only
what that request needs: one write for the request, a status line, headers, and a body that
is chunked, sized by ``Content-Length`` or ended by the server closing the connection.
Anything else a backend is asked (the model list, model facts, embeddings) and any setup it
does not cover (TLS, a proxy from the environment) stays with aiohttp: `usable_for` says
which.

A connection goes back to the pool only when its answer was read to the end; one given up
(an error, a cancel, a timeout) is closed. A kept-alive connection the server has closed
meanwhile is noticed before any answer arrives and the request goes once more on a new one.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Final
from urllib.parse import urlsplit

# Connections kept open between requests (a worker makes one request at a time).
MAX_IDLE: Final = 4
_READ_LIMIT: Final = 1 << 20


class Http1Error(Exception):
    """The connection failed, or the answer is not HTTP/1.1 as expected."""


class Http1ConnectTimeout(Http1Error):
    """No connection within the connect timeout."""


def usable_for(base_url: str) -> bool:
    """Plain ``http://`` with no proxy configured in the environment (aiohttp's path takes
    those)."""
    parts = urlsplit(base_url)
    return parts.scheme == "http" and bool(parts.hostname) and not urllib.request.getproxies()


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        with suppress(Exception):
            self.writer.close()


class Reply:
    """A streamed answer: its status, then its body as lines (`lines`) or whole (`read`)."""

    def __init__(self, connection: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self._connection = connection
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        self._length = int(length) if length is not None and not self._chunked else None
        self.reusable = headers.get("connection", "").lower() != "close" and (
            self._chunked or self._length is not None
        )
        self.complete = False

    async def _pieces(self) -> AsyncIterator[bytes]:
        reader = self._connection.reader
        if self._chunked:
            while True:
                size_line = await reader.readline()
                try:
                    size = int(size_line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise Http1Error(f"malformed chunk size {size_line[:40]!r}") from None
                if size == 0:
                    while (await reader.readline()).strip():  # trailers, then the blank line
                        pass
                    break
                data = await reader.readexactly(size + 2)
                yield data[:-2]
        elif self._length is not None:
            left = self._length
            while left > 0:
                data = await reader.read(min(left, 65536))
                if not data:
                    raise Http1Error("connection closed before the end of the answer")
                left -= len(data)
                yield data
        else:
            while data := await reader.read(65536):
                yield data
        self.complete = True

    async def lines(self) -> AsyncIterator[bytes]:
        """The body split at line ends (without them), the last line even if unterminated."""
        rest = b""
        try:
            async for data in self._pieces():
                rest += data
                if b"\n" in rest:
                    *whole, rest = rest.split(b"\n")
                    for line in whole:
                        yield line
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise Http1Error(f"connection lost: {exc or type(exc).__name__}") from exc
        if rest:
            yield rest

    async def read(self) -> bytes:
        """The whole body."""
        try:
            return b"".join([data async for data in self._pieces()])
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise Http1Error(f"connection lost: {exc or type(exc).__name__}") from exc


class LinePool:
    """Kept-alive connections to one HTTP server, for streamed POSTs read line by line."""

    def __init__(self, base_url: str, *, connect_timeout_s: float) -> None:
        parts = urlsplit(base_url)
        assert parts.hostname is not None
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    @asynccontextmanager
    async def post(self, path: str, body: bytes, accept: str) -> AsyncIterator[Reply]:
        """POST ``body`` (JSON) to ``path``; the reply's body is read within the block."""
        request = (
            f"POST {self._prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
            f"Accept: {accept}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nUser-Agent: coordinator\r\n\r\n"
        ).encode() + body
        connection, reply = await self._send(request)
        try:
            yield reply
        finally:
            if reply.complete and reply.reusable and len(self._idle) < MAX_IDLE:
                self._idle.append(connection)
            else:
                connection.close()

    async def _send(self, request: bytes) -> tuple[_Connection, Reply]:
        while self._idle:
            connection = self._idle.pop()
            try:
                return connection, await self._exchange(connection, request)
            except _Closed:
                connection.close()  # closed by the server while idle: try another
            except BaseException:
                connection.close()
                raise
        connection = await self._connect()
        try:
            return connection, await self._exchange(connection, request)
        except _Closed as exc:
            connection.close()
            raise Http1Error("the server closed the connection without answering") from exc
        except BaseException:
            connection.close()
            raise

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, limit=_READ_LIMIT
                )
        except TimeoutError as exc:
            raise Http1ConnectTimeout(
                f"no connection to {self._host}:{self._port} within {self._connect_timeout_s:g} s"
            ) from exc
        except OSError as exc:
            raise Http1Error(f"{exc.strerror or exc}") from exc
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, request: bytes) -> Reply:
        try:
            connection.writer.write(request)
            await connection.writer.drain()
            status_line = await connection.reader.readline()
        except OSError as exc:
            raise _Closed from exc
        if not status_line:
            raise _Closed
        try:
            version, code, *_ = status_line.decode("latin-1").split(" ", 2)
            status = int(code)
        except ValueError:
            raise Http1Error(f"not an HTTP answer: {status_line[:60]!r}") from None
        if not version.startswith("HTTP/1."):
            raise Http1Error(f"not an HTTP/1 answer: {status_line[:60]!r}")
        headers: dict[str, str] = {}
        try:
            while (line := await connection.reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                headers[name.strip().lower()] = value.strip()
        except (OSError, asyncio.LimitOverrunError, ValueError) as exc:
            raise Http1Error(f"malformed answer headers: {exc}") from exc
        if version == "HTTP/1.0" and headers.get("connection", "").lower() != "keep-alive":
            headers["connection"] = "close"
        return Reply(connection, status, headers)


class _Closed(Exception):
    """The connection was closed before any answer: safe to send the request again."""
