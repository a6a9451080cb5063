"""The dashboard's and the metrics' HTTP side: the page and its files, its data (one JSON
snapshot, or a stream of server-sent events), and ``GET /metrics`` for Prometheus.

**Keys.** The page and its files (``/dashboard``, ``/dashboard/static/…``) are the same for
everyone and tell nothing about the fleet, so they load without a key (a browser sends no
``Authorization`` header on a page load). The data (``/dashboard/state``,
``/dashboard/stream``) and ``/metrics`` need the key like every other route
(`services.gateway.access`). The page asks for the key, keeps it in ``sessionStorage`` (this
tab only, gone when it closes) and sends it as ``Authorization: Bearer`` on its requests; the
stream is read with ``fetch`` (``EventSource`` cannot send a header), so the key is never in
a URL, a log or the browser's history. A strict Content-Security-Policy (scripts and styles
from the gateway alone, no inline script) and text-only rendering keep other script away
from the key.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress
from importlib import resources
from typing import Final

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from services.gateway.access import acts_as_operator, client_of
from services.gateway.common import encoder
from services.gateway.dashboard_view import TASK_SECTIONS, for_key
from services.gateway.feed import Feed

# The files under static/ the page uses, with their types.
STATIC: Final = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
}
PAGE: Final = "dashboard.html"
# Headers on everything the dashboard serves.
SAFE_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
PAGE_HEADERS: Final = {
    **SAFE_HEADERS,
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
}
# A comment line on a quiet stream, so proxies and the page know it is alive.
KEEPALIVE_S: Final = 15.0
# The longest a scrape waits for the event log's state before using the last one read.
SCRAPE_READ_S: Final = 2.0


def _read_static(name: str) -> bytes:
    return (resources.files("services.gateway") / "static" / name).read_bytes()


def frame(event: str, data: bytes) -> bytes:
    """One server-sent event (the JSON has no newline, so it is one ``data`` line)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


class Dashboard:
    """The handlers; the files are read once, at start."""

    def __init__(self, feed: Feed) -> None:
        self.feed = feed
        self.page = _read_static(PAGE)
        self.files = {name: _read_static(name) for name in STATIC}

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/dashboard", self.html)
        router.add_get("/dashboard/static/{name}", self.static)
        router.add_get("/dashboard/state", self.state)
        router.add_get("/dashboard/stream", self.stream)
        router.add_get("/metrics", self.metrics)

    async def html(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.page, content_type="text/html", charset="utf-8", headers=PAGE_HEADERS
        )

    async def static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in STATIC:
            raise web.HTTPNotFound(text="no such file", headers=SAFE_HEADERS)
        return web.Response(
            body=self.files[name], content_type=STATIC[name], charset="utf-8", headers=SAFE_HEADERS
        )

    async def state(self, request: web.Request) -> web.Response:
        """Every section at once, and every sample kept: what the page starts from, and what a
        script reads."""
        feed = self.feed
        if not feed.encoded:
            feed.build(time.time())
        encoded = {**feed.encoded, **self._for_viewer(request)}
        body = b"{" + b",".join(b'"%s":%s' % (k.encode(), v) for k, v in encoded.items())
        samples = encoder.encode(list(feed.known.board.samples))
        body += b',"samples":' + samples + b"}"
        return web.Response(body=body, content_type="application/json", headers=SAFE_HEADERS)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Server-sent events: every section first, then each one again when it changes;
        ``series`` (every sample kept) first, then ``samples`` (the new ones) as they come."""
        feed = self.feed
        response = web.StreamResponse(
            headers={
                **SAFE_HEADERS,
                "Content-Type": "text/event-stream; charset=utf-8",
                "X-Accel-Buffering": "no",  # a proxy in front must not hold events back
            }
        )
        await response.prepare(request)
        await response.write(b"retry: 2000\n\n")
        sent: dict[str, int] = {}
        cursor = -1
        while not feed.closed:
            parts = []
            changed = {n for n, v in list(feed.versions.items()) if sent.get(n) != v}
            own = self._for_viewer(request) if changed & set(TASK_SECTIONS) else {}
            for name in changed:
                sent[name] = feed.versions[name]
                parts.append(frame(name, own.get(name, feed.encoded[name])))
            board = feed.known.board
            newest = board.samples[-1].index if board.samples else 0
            if cursor < 0 or newest > cursor:
                samples = board.samples_after(max(cursor, 0))
                event = "series" if cursor < 0 else "samples"
                parts.append(frame(event, encoder.encode(samples)))
                cursor = newest
            await response.write(b"".join(parts) if parts else b": keep-alive\n\n")
            await feed.pulse.wait(KEEPALIVE_S)
        return response

    def _for_viewer(self, request: web.Request) -> dict[str, bytes]:
        """The sections naming tasks as this viewer sees them, encoded; none when it sees the
        fleet's as built (the operator's key, an open gateway)."""
        client = client_of(request)
        if acts_as_operator(request) or client is None or not self.feed.built:
            return {}
        own = for_key(self.feed.built, client, self.feed.known.board)
        return {name: encoder.encode(value) for name, value in own.items()}

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus' text exposition format; the gauges' sources read fresh."""
        # On failure the last state read stands (or none: those gauges are left out).
        with suppress(TimeoutError):
            async with asyncio.timeout(SCRAPE_READ_S):
                await self.feed.refresh()
        return web.Response(
            body=generate_latest(self.feed.metrics.registry),
            # Text format 0.0.4: what every Prometheus reads (the names are plain ASCII).
            headers={**SAFE_HEADERS, "Content-Type": CONTENT_TYPE_PLAIN_0_0_4},
        )
