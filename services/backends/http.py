"""The backends' one HTTP client: an aiohttp session per model server, for every call.

The session is made in the running loop on first use. It keeps connections alive between
calls (a new TCP connection per task costs more than the rest of the request), takes a proxy
from the environment (``HTTP(S)_PROXY``, ``NO_PROXY``) as httpx would, read once when the
backend is made (aiohttp's ``trust_env`` reads it, and ``~/.netrc``, on every request: 0.35
ms of CPU each), and keeps no cookies (model servers set none; a jar is consulted on every
request). There is no overall deadline here: the caller's ``asyncio.timeout`` is it; a
request has one for making a new connection (``sock_connect``: a kept-alive connection taken
from the pool arms no timer) and, when asked, one between two reads.

An answer read to its end gives its connection back to the pool; one given up (an error, a
cancel, a timeout) closes it, which is what stops a model server generating. A kept-alive
connection the server closed meanwhile (llama.cpp's server closes one after each streamed
answer without saying so) is noticed before any answer came, and the request goes once more
on a new connection: nothing was done, so sending again is safe.

aiohttp rather than httpx: inside a worker, a streamed generation over httpx costs about 3 ms
of CPU more (``benchmarks/README.md``, "The backends' HTTP client").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Final

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from aiohttp.http_exceptions import LineTooLong
from yarl import URL

from services.errors import BackendError

# The longest line read from a streamed answer (an older Ollama's final ``/api/generate``
# line carries the whole context as token ids).
MAX_LINE: Final = 64 << 20


class HttpClient:
    """Calls to one server at ``base_url`` (no trailing slash); ``headers`` go with each."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None
        try:
            self._proxy: tuple[URL | None, aiohttp.BasicAuth | None] = get_env_proxy_for_url(
                URL(self.base_url)
            )
        except LookupError:
            self._proxy = (None, None)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=self.timeout(None),
                proxy=self._proxy[0],
                proxy_auth=self._proxy[1],
                cookie_jar=aiohttp.DummyCookieJar(),
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def timeout(
        self, read_s: float | None, *, total_s: float | None = None
    ) -> aiohttp.ClientTimeout:
        """The connect deadline, ``read_s`` between two reads, ``total_s`` for the whole
        call (None: none of that kind)."""
        return aiohttp.ClientTimeout(
            total=total_s, sock_connect=self.connect_timeout_s, sock_read=read_s
        )

    @asynccontextmanager
    async def sent(
        self,
        method: str,
        path_or_url: str,
        *,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        deadlines: aiohttp.ClientTimeout | None = None,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The answer to one request, its body still to read (``path_or_url``: a path under
        ``base_url``, or a whole URL; ``deadlines``: `timeout`'s). Its connection goes back
        to the pool if the body was read to its end, and is closed otherwise."""
        url = path_or_url if "://" in path_or_url else self.base_url + path_or_url
        timeout = deadlines or self.timeout(None)

        async def send() -> aiohttp.ClientResponse:
            return await self._http().request(
                method, url, data=body, headers=headers, timeout=timeout
            )

        try:
            reply = await send()
        except aiohttp.ClientConnectorError:
            raise  # no connection at all: nothing to send again
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            reply = await send()  # a kept-alive one was closed meanwhile
        try:
            yield reply
        except BaseException:
            reply.close()  # given up midway (a cancel among others): the server stops
            raise
        reply.release()  # back to the pool when read to its end, else closed


async def lines(reply: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines (each with its line end), the last one even if unterminated."""
    try:
        while line := await reply.content.readline(max_line_length=MAX_LINE):
            yield line
    except LineTooLong as exc:
        raise BackendError(f"{reply.url.host} sent a line over {MAX_LINE} bytes") from exc


def describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
