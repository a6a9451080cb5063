"""SearXNG's JSON API as pure functions: the query parameters, the reply, its failures.

No I/O here: `searxng.py` sends the request and hands the status, headers and body to these
functions, which turn them into sources or into one of the project's search errors.

The reply (``/search?format=json``) is ``{"query", "results": [{"url", "title", "content",
"engine", "engines", "score", "category", ...}], "answers", "corrections", "infoboxes",
"suggestions", "unresponsive_engines": [[engine, reason], ...]}``; results come best first.
SearXNG's API has no result count, so the top ``limit`` are taken here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from schemas.route import Source
from services.errors import (
    NoResults,
    SearchError,
    SearchRateLimited,
    SearchUnavailable,
)

# What a source keeps: enough for a reader and a prompt, not whole pages.
TITLE_CHARS = 300
SNIPPET_CHARS = 500


class _Result(msgspec.Struct):
    url: str | None = None
    title: str | None = None
    content: str | None = None


class _Reply(msgspec.Struct):
    results: list[_Result] = []
    unresponsive_engines: list[list[Any]] = []


class _ErrorReply(msgspec.Struct):
    error: str = ""


_reply_decoder = msgspec.json.Decoder(_Reply)
_error_decoder = msgspec.json.Decoder(_ErrorReply)


def search_params(
    query: str, *, categories: Sequence[str] = (), language: str | None = None
) -> dict[str, str]:
    """The query string for ``/search``: JSON output, and only the settings that are set."""
    params = {"q": query, "format": "json"}
    if categories:
        params["categories"] = ",".join(categories)
    if language:
        params["language"] = language
    return params


def clean(text: str | None, limit: int) -> str:
    """One line of plain text, whitespace collapsed, at most ``limit`` characters."""
    flat = " ".join((text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1].rstrip() + "…"


def parse_results(body: bytes, *, query: str, limit: int, address: str) -> list[Source]:
    """The top ``limit`` distinct results of a 200 reply, or a `SearchError` saying why not."""
    try:
        reply = _reply_decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise SearchError(f"SearXNG at {address} sent JSON of an unexpected shape: {exc}") from None
    except msgspec.DecodeError:
        raise not_json(address, "application/json", body) from None
    sources: list[Source] = []
    seen: set[str] = set()
    for result in reply.results:
        url = (result.url or "").strip()
        if not url or url in seen:
            continue
        seen.add(url)
        sources.append(
            Source(
                title=clean(result.title, TITLE_CHARS) or url,
                url=url,
                snippet=clean(result.content, SNIPPET_CHARS),
            )
        )
        if len(sources) == limit:
            break
    if not sources:
        silent = describe_unresponsive(reply.unresponsive_engines)
        raise NoResults(
            f"SearXNG found no results for {clean(query, 200)!r}"
            + (f" (engines that did not answer: {silent})" if silent else "")
        )
    return sources


def describe_unresponsive(engines: Sequence[Sequence[Any]]) -> str:
    """``google (timeout), brave (too many requests)`` from SearXNG's pairs."""
    parts = []
    for entry in engines:
        if entry:
            name = str(entry[0])
            reason = str(entry[1]) if len(entry) > 1 else "no reason given"
            parts.append(f"{name} ({reason})")
    return ", ".join(parts)


def failure_for_status(status: int, content_type: str, body: bytes, address: str) -> SearchError:
    """The error a non-200 reply from SearXNG stands for, with what an operator can do."""
    detail = _error_text(content_type, body)
    said = f": {detail}" if detail else ""
    if status == 429:
        return SearchRateLimited(
            f"SearXNG at {address} answered HTTP 429 (too many requests){said}; its limiter "
            "or an upstream engine is throttling this host"
        )
    if status == 403:
        return SearchError(
            f"SearXNG at {address} answered HTTP 403 (forbidden){said}; is `json` listed "
            "under search.formats in its settings.yml?"
        )
    if status in (502, 503, 504):
        return SearchUnavailable(f"SearXNG at {address} is unavailable: HTTP {status}{said}")
    return SearchError(f"SearXNG at {address} answered HTTP {status}{said}")


def not_json(address: str, content_type: str, body: bytes) -> SearchError:
    """A 200 whose body is not SearXNG's JSON (a proxy's page, the HTML interface)."""
    start = body[:120].decode(errors="replace")
    return SearchError(
        f"SearXNG at {address} answered with something that is not JSON "
        f"({content_type or 'no content type'}): {start!r}; does SEARXNG_URL point at SearXNG?"
    )


def is_json(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() in ("application/json", "text/json")


def _error_text(content_type: str, body: bytes) -> str:
    """SearXNG's ``{"error": ...}`` text, or the start of a plain-text body; '' for pages."""
    if is_json(content_type):
        try:
            return clean(_error_decoder.decode(body).error, 200)
        except msgspec.DecodeError:
            return ""
    if content_type.startswith("text/plain"):
        return clean(body.decode(errors="replace"), 200)
    return ""
