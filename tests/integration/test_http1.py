"""The small HTTP/1.1 client of the worker's hot path, against real sockets: body framings,
kept-alive connections, a connection the server closed while idle, and failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from services.backends.http1 import Http1Error, LinePool, usable_for

Answer = Callable[[bytes], bytes]


class Server:
    """Answers each request (read up to its body) with ``answer(body)``; counts connections.
    With ``close_after`` set, the server closes a connection after that many answers."""

    def __init__(self, answer: Answer, close_after: int | None = None) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                body = await reader.readexactly(length)
                writer.write(self.answer(body))
                await writer.drain()
                answered += 1
                if self.close_after is not None and answered >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/prefix"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()


def chunked(*lines: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head + b"".join(b"%X\r\n%s\r\n" % (len(x), x) for x in lines) + b"0\r\n\r\n"


async def lines_of(pool: LinePool) -> tuple[int, list[bytes]]:
    async with pool.post("/api/generate", b"{}", "application/x-ndjson") as reply:
        return reply.status, [line async for line in reply.lines()]


@pytest.fixture
async def pool_factory() -> AsyncIterator[Callable[[str], LinePool]]:
    pools: list[LinePool] = []

    def make(url: str) -> LinePool:
        pools.append(LinePool(url, connect_timeout_s=2.0))
        return pools[-1]

    yield make
    for pool in pools:
        await pool.aclose()


async def test_chunked_lines_split_across_chunks_and_the_connection_is_kept(
    pool_factory: Callable[[str], LinePool],
) -> None:
    async with Server(lambda _: chunked(b'{"a":', b'1}\n{"b":2}\n', b'{"c":3}')) as server:
        pool = pool_factory(server.url)
        for _ in range(3):
            assert await lines_of(pool) == (200, [b'{"a":1}', b'{"b":2}', b'{"c":3}'])
        assert server.connections == 1


async def test_content_length_and_close_delimited_bodies(
    pool_factory: Callable[[str], LinePool],
) -> None:
    sized = b"HTTP/1.1 404 Not Found\r\nContent-Length: 20\r\n\r\n" + b'{"error":"no model"}'
    async with Server(lambda _: sized) as server:
        pool = pool_factory(server.url)
        async with pool.post("/api/generate", b"{}", "application/json") as reply:
            assert reply.status == 404
            assert await reply.read() == b'{"error":"no model"}'
    old = b"HTTP/1.0 200 OK\r\n\r\nline one\nline two\n"
    async with Server(lambda _: old, close_after=1) as server:
        pool = pool_factory(server.url)
        assert await lines_of(pool) == (200, [b"line one", b"line two"])
        assert await lines_of(pool) == (200, [b"line one", b"line two"])
        assert server.connections == 2  # read to the close: never reused


async def test_a_kept_connection_the_server_closed_is_replaced(
    pool_factory: Callable[[str], LinePool],
) -> None:
    async with Server(lambda _: chunked(b"ok\n"), close_after=1) as server:
        pool = pool_factory(server.url)
        assert await lines_of(pool) == (200, [b"ok"])
        await asyncio.sleep(0.05)  # the server has closed the kept connection by now
        assert await lines_of(pool) == (200, [b"ok"])
        assert server.connections == 2


async def test_an_answer_given_up_midway_closes_its_connection(
    pool_factory: Callable[[str], LinePool],
) -> None:
    async with Server(lambda _: chunked(b"one\n", b"two\n")) as server:
        pool = pool_factory(server.url)
        async with pool.post("/x", b"{}", "application/x-ndjson") as reply:
            async for _ in reply.lines():
                break
        assert await lines_of(pool) == (200, [b"one", b"two"])
        assert server.connections == 2


async def test_failures_are_http1_errors(pool_factory: Callable[[str], LinePool]) -> None:
    cut = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab"
    async with Server(lambda _: cut, close_after=1) as s:  # closed in the middle of a chunk
        pool = pool_factory(s.url)
        with pytest.raises(Http1Error):
            await lines_of(pool)
    pool = pool_factory(s.url)  # nothing listens there any more
    with pytest.raises(Http1Error):
        await lines_of(pool)


def test_only_plain_http_without_a_proxy_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    assert usable_for("http://mac.lan:11434")
    assert not usable_for("https://ollama.example.org")
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.lan:3128")
    assert not usable_for("http://mac.lan:11434")
