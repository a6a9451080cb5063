"""SearXNG over HTTP, on the backends' HTTP client (`services.backends.http`); its failures
become the project's search errors here, at the edge."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlencode

import aiohttp

from schemas.route import Source
from services import __version__
from services.backends.http import HttpClient, describe
from services.errors import SearchTimeout, SearchUnavailable
from services.web_search.search import (
    failure_for_status,
    is_json,
    not_json,
    parse_results,
    search_params,
)


@dataclass(frozen=True, slots=True)
class _Reply:
    status: int
    content_type: str
    content: bytes


class SearxngClient:
    """A client for one SearXNG instance (``base_url`` may carry a path prefix)."""

    def __init__(self, base_url: str, *, connect_timeout_s: float = 5.0) -> None:
        self._client = HttpClient(
            base_url,
            connect_timeout_s=connect_timeout_s,
            headers={
                "Accept": "application/json",
                "User-Agent": f"coordinator-web-search/{__version__}",
            },
        )
        self._base_url = self._client.base_url

    @property
    def address(self) -> str:
        return self._base_url

    async def aclose(self) -> None:
        await self._client.aclose()

    async def search(
        self,
        query: str,
        *,
        limit: int,
        timeout_s: float,
        categories: Sequence[str] = (),
        language: str | None = None,
    ) -> list[Source]:
        """The top ``limit`` results for ``query``; a `SearchError` subclass when there are none
        (refused, timed out, throttled, an HTTP error, not JSON, or simply no results)."""
        params = search_params(query, categories=categories, language=language)
        reply = await self._get("/search", params, timeout_s)
        if reply.status != 200:
            raise failure_for_status(reply.status, reply.content_type, reply.content, self.address)
        if not is_json(reply.content_type):
            raise not_json(self.address, reply.content_type, reply.content)
        return parse_results(reply.content, query=query, limit=limit, address=self.address)

    async def check(self, timeout_s: float = 5.0) -> None:
        """Is SearXNG there with its JSON API on? Raises a `SearchError` saying what is wrong.

        An empty query costs no upstream search: SearXNG answers it 400 ``{"error": "No
        query"}`` when JSON output is enabled, and 403 when it is not.
        """
        reply = await self._get("/search", {"q": "", "format": "json"}, timeout_s)
        if reply.status in (200, 400) and is_json(reply.content_type):
            return
        if reply.status in (200, 400):
            raise not_json(self.address, reply.content_type, reply.content)
        raise failure_for_status(reply.status, reply.content_type, reply.content, self.address)

    async def _get(self, path: str, params: dict[str, str], timeout_s: float) -> _Reply:
        try:
            async with (
                asyncio.timeout(timeout_s),
                self._client.sent("GET", f"{path}?{urlencode(params)}") as reply,
            ):
                content = await reply.read()
                return _Reply(reply.status, reply.headers.get("Content-Type", ""), content)
        except aiohttp.ServerTimeoutError as exc:  # a TimeoutError too: first
            raise SearchTimeout(f"SearXNG at {self.address} timed out: {describe(exc)}") from exc
        except TimeoutError as exc:
            raise SearchTimeout(
                f"SearXNG at {self.address} did not answer within {timeout_s:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise SearchUnavailable(
                f"SearXNG at {self.address} cannot be reached: {describe(exc)}"
            ) from exc
