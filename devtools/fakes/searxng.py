"""A stand-in for SearXNG's search API: real HTTP/1.1 over a real socket, made-up results.

``GET`` or ``POST`` ``/search`` (and ``/``) with SearXNG's parameters (``q``, ``format``,
``categories``, ``language``, ``pageno``, ...) answers as SearXNG does:

- ``format=json`` → 200 ``application/json`` with SearXNG's shape: ``{"query",
  "number_of_results", "results": [{"url", "title", "content", "engine", "engines",
  "positions", "score", "category", "template", "parsed_url", "publishedDate", ...}],
  "answers", "corrections", "infoboxes", "suggestions", "unresponsive_engines": [[engine,
  reason], ...]}``, results best first;
- an empty ``q`` with ``format=json`` → 400 ``{"error": "No query"}`` (no upstream search);
- JSON output not enabled (``json_enabled`` off) → 403 with Flask's HTML error page;
- no ``format`` (or ``html``) → 200 with an HTML page.

``/healthz`` answers ``OK``; ``/config`` a small JSON configuration.

Answers are deterministic: ``result_count`` results whose titles, addresses and snippets are
made from the query. Knobs (attributes, ``configure()``, or ``POST /_fake/config`` with the
same names, so a copy run as ``python -m devtools.fakes.searxng --port P`` can be steered too):

- ``mode``: ``"ok"``; ``"empty"`` (no results, two engines listed as unresponsive);
  ``"not_json"`` (200 with an HTML page, as a proxy in front of the wrong thing would send);
- ``fail_status``: answer searches with this status and the body SearXNG (or the proxy in
  front of it) sends: 429 ``text/plain`` "Too Many Requests", 500 ``{"error": "search
  error"}``, 502/503/504 a proxy's HTML page, others Flask's HTML error page;
- ``delay_s``: seconds before answering a search (interrupted when the client hangs up);
- ``result_count``: how many results a search finds (default 8);
- ``json_enabled``: whether ``json`` is among the instance's ``search.formats``.

``GET /_fake/stats`` reports ``search_calls``, ``concurrent_max``, ``in_flight`` and
``last_params`` (the parameters of the last search); ``POST /_fake/reset`` zeroes them and
restores the knobs given at construction. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import select
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType, TracebackType
from typing import Any, Self, cast
from urllib.parse import parse_qs, urlsplit

__all__ = ["MODES", "FakeSearxng", "main"]

MODES = ("ok", "empty", "not_json")
SEARXNG_VERSION = "2025.6.1+fake"
ENGINES = ("duckduckgo", "brave", "wikipedia", "startpage")

_KNOBS = ("mode", "fail_status", "delay_s", "result_count", "json_enabled")

_HTML_PAGE = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="UTF-8"><title>SearXNG</title>'
    '</head><body><form id="search" method="GET" action="/search">'
    '<input name="q" type="text"></form></body></html>\n'
)
_PROXY_PAGE = (
    "<html>\r\n<head><title>{status} {phrase}</title></head>\r\n<body>\r\n"
    "<center><h1>{status} {phrase}</h1></center>\r\n<hr><center>nginx</center>\r\n"
    "</body>\r\n</html>\r\n"
)
_FLASK_PAGE = (
    "<!doctype html>\n<html lang=en>\n<title>{status} {phrase}</title>\n"
    "<h1>{phrase}</h1>\n<p>{text}</p>\n"
)
_PHRASES = {
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    429: "Too Many Requests",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Temporarily Unavailable",
    504: "Gateway Time-out",
}


def _check_knob(name: str, value: object) -> Any:
    """The validated value for knob ``name``; ValueError when it does not fit."""
    if name == "mode":
        if value not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        return value
    if name == "fail_status":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
            raise ValueError("fail_status must be null or an HTTP error status (400-599)")
        return value
    if name == "delay_s":
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError("delay_s must be a number >= 0")
        return float(value)
    if name == "result_count":
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError("result_count must be an integer >= 0")
        return value
    if name == "json_enabled":
        if not isinstance(value, bool):
            raise ValueError("json_enabled must be true or false")
        return value
    raise ValueError(f"unknown knob {name!r}; known: {', '.join(_KNOBS)}")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "query"


def results_for(query: str, count: int, category: str = "general") -> list[dict[str, Any]]:
    """The made-up results for ``query``, in SearXNG's result shape, best first."""
    slug = _slug(query)
    results = []
    for i in range(1, count + 1):
        engines = [ENGINES[i % len(ENGINES)], ENGINES[(i + 1) % len(ENGINES)]]
        path = f"/{slug}/{i}"
        results.append(
            {
                "url": f"https://example.org{path}",
                "title": f"{query} - result {i}",
                "content": f"Snippet {i} about {query}: what this page says, in a sentence.",
                "engine": engines[0],
                "template": "default.html",
                "parsed_url": ["https", "example.org", path, "", "", ""],
                "img_src": "",
                "thumbnail": "",
                "priority": "",
                "engines": engines,
                "positions": [i, i + 1],
                "score": round(4.0 / i, 4),
                "category": category,
                "publishedDate": None,
                "pubdate": "",
            }
        )
    return results


class FakeSearxng:
    """A SearXNG look-alike serving real HTTP on ``host:port`` (port 0: pick a free one)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        mode: str = "ok",
        fail_status: int | None = None,
        delay_s: float = 0.0,
        result_count: int = 8,
        json_enabled: bool = True,
    ) -> None:
        self.host = host
        self.port = port
        self._defaults: dict[str, Any] = {
            "mode": _check_knob("mode", mode),
            "fail_status": _check_knob("fail_status", fail_status),
            "delay_s": _check_knob("delay_s", delay_s),
            "result_count": _check_knob("result_count", result_count),
            "json_enabled": _check_knob("json_enabled", json_enabled),
        }
        self.mode: str = "ok"
        self.fail_status: int | None = None
        self.delay_s: float = 0.0
        self.result_count: int = 8
        self.json_enabled: bool = True
        self._lock = threading.Lock()
        self._search_calls = 0
        self._in_flight = 0
        self._concurrent_max = 0
        self._last_params: dict[str, str] = {}
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._apply_defaults()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Self:
        """Serve in a daemon thread; returns self. Restarting reuses the port first bound."""
        if self._server is not None:
            return self
        self._stopping = threading.Event()
        server = _Server((self.host, self.port), self)
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"fake-searxng:{self.port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, cut open keep-alive connections, free the port."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = None
        self._thread = None
        self._stopping.set()
        server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        server.server_close()
        if thread is not None:
            thread.join(timeout=5)

    @property
    def url(self) -> str:
        if self.port == 0:
            raise RuntimeError("FakeSearxng has not been started")
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ---------------------------------------------------------------- knobs and counters

    def configure(self, **knobs: Any) -> dict[str, Any]:
        """Set several knobs at once (validated, all or none); returns the resulting config."""
        checked = {name: _check_knob(name, value) for name, value in knobs.items()}
        for name, value in checked.items():
            setattr(self, name, value)
        return self.config()

    def config(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _KNOBS}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "search_calls": self._search_calls,
                "concurrent_max": self._concurrent_max,
                "in_flight": self._in_flight,
                "last_params": dict(self._last_params),
            }

    def reset(self) -> None:
        """Zero the counters and restore the knobs given at construction."""
        with self._lock:
            self._search_calls = 0
            self._concurrent_max = self._in_flight
            self._last_params = {}
        self._apply_defaults()

    def _apply_defaults(self) -> None:
        for name, value in self._defaults.items():
            setattr(self, name, value)

    @contextmanager
    def _track(self, params: dict[str, str]) -> Iterator[None]:
        with self._lock:
            self._search_calls += 1
            self._last_params = dict(params)
            self._in_flight += 1
            self._concurrent_max = max(self._concurrent_max, self._in_flight)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1

    def _opened(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.add(connection)

    def _closed(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.discard(connection)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], fake: FakeSearxng) -> None:
        self.fake = fake
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that goes away (or stop() cutting connections) is not worth a traceback.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "granian"  # what SearXNG's container image answers with
    sys_version = ""

    @property
    def _fake(self) -> FakeSearxng:
        return cast(_Server, self.server).fake

    def setup(self) -> None:
        super().setup()
        with suppress(OSError):
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._fake._opened(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._fake._closed(self.connection)

    def log_message(self, format: str, *args: Any) -> None:
        """Silent: keep test output clean."""

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        parts = urlsplit(self.path)
        fields = parse_qs(parts.query, keep_blank_values=True)
        if method == "POST" and "x-www-form-urlencoded" in self.headers.get("Content-Type", ""):
            fields.update(parse_qs(raw.decode(errors="replace"), keep_blank_values=True))
        params = {key: values[-1] for key, values in fields.items()}
        try:
            self._route(method, parts.path, params, raw)
        except OSError:
            self.close_connection = True  # the client went away

    def _route(self, method: str, path: str, params: dict[str, str], raw: bytes) -> None:
        if path in ("/search", "/"):
            self._search(params)
        elif method == "GET" and path == "/healthz":
            self._send(200, b"OK", "text/plain; charset=utf-8")
        elif method == "GET" and path == "/config":
            self._send_json(200, self._config())
        elif method == "GET" and path == "/_fake/stats":
            self._send_json(200, self._fake.stats())
        elif method == "GET" and path == "/_fake/config":
            self._send_json(200, self._fake.config())
        elif method == "POST" and path == "/_fake/config":
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("send a JSON object of knobs")
                self._send_json(200, self._fake.configure(**body))
            except ValueError as exc:
                self._send_json(400, {"error": str(exc)})
        elif method == "POST" and path == "/_fake/reset":
            self._fake.reset()
            self._send_json(200, self._fake.config())
        else:
            self._flask_error(404, "The requested URL was not found on the server.")

    # ---------------------------------------------------------------- /search

    def _search(self, params: dict[str, str]) -> None:
        fake = self._fake
        output = params.get("format", "html")
        if output not in ("html", "json", "csv", "rss"):
            output = "html"
        if output == "json" and not fake.json_enabled:
            self._flask_error(
                403, "You don't have the permission to access the requested resource."
            )
            return
        query = params.get("q", "")
        if not query:
            if output == "json":
                self._send_json(400, {"error": "No query"})
            else:
                self._send(200, _HTML_PAGE.encode(), "text/html; charset=utf-8")
            return
        with fake._track(params):
            mode, status = fake.mode, fake.fail_status
            if not self._pause(fake.delay_s):
                self.close_connection = True
                return
            if status is not None:
                self._failure(status)
            elif mode == "not_json" or output != "json":
                self._send(200, _HTML_PAGE.encode(), "text/html; charset=utf-8")
            else:
                self._send_json(200, self._reply(query, params, mode))

    def _reply(self, query: str, params: dict[str, str], mode: str) -> dict[str, Any]:
        categories = [c for c in params.get("categories", "general").split(",") if c]
        empty = mode == "empty"
        results = [] if empty else results_for(query, self._fake.result_count, categories[0])
        return {
            "query": query,
            "number_of_results": 0,
            "results": results,
            "answers": [],
            "corrections": [],
            "infoboxes": [],
            "suggestions": [] if empty else [f"{query} explained", f"what is {query}"],
            "unresponsive_engines": (
                [["brave", "too many requests"], ["duckduckgo", "CAPTCHA"]] if empty else []
            ),
        }

    def _failure(self, status: int) -> None:
        phrase = _PHRASES.get(status, "Error")
        if status == 429:
            self._send(429, b"Too Many Requests", "text/plain; charset=utf-8")
        elif status == 500:
            self._send_json(500, {"error": "search error"})
        elif status in (502, 503, 504):
            page = _PROXY_PAGE.format(status=status, phrase=phrase)
            self._send(status, page.encode(), "text/html")
        else:
            self._flask_error(status, "The server could not handle the request.")

    def _pause(self, seconds: float) -> bool:
        """Wait ``seconds``; False if the client hung up meanwhile or ``stop()`` was called."""
        fake = self._fake
        remaining = seconds
        while remaining > 0:
            step = min(remaining, 0.02)
            readable, _, _ = select.select([self.connection], [], [], step)
            remaining -= step
            if fake._stopping.is_set():
                return False
            if readable:
                try:
                    if self.connection.recv(1, socket.MSG_PEEK) == b"":
                        return False
                except OSError:
                    return False
                fake._stopping.wait(remaining)  # a pipelined request: just wait
                remaining = 0
        return not fake._stopping.is_set()

    def _config(self) -> dict[str, Any]:
        return {
            "categories": ["general", "images", "news", "science", "it"],
            "engines": [
                {"name": name, "categories": ["general"], "enabled": True, "shortcut": name[:2]}
                for name in ENGINES
            ],
            "instance_name": "SearXNG",
            "default_locale": "",
            "safe_search": 0,
            "version": SEARXNG_VERSION,
        }

    # ---------------------------------------------------------------- writing

    def _send(self, status: int, data: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload, ensure_ascii=False).encode()
        self._send(status, data, "application/json")

    def _flask_error(self, status: int, text: str) -> None:
        page = _FLASK_PAGE.format(status=status, phrase=_PHRASES.get(status, "Error"), text=text)
        self._send(status, page.encode(), "text/html; charset=utf-8")


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.fakes.searxng", description="Serve a fake SearXNG search API."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080, help="0 picks a free port")
    parser.add_argument("--mode", choices=MODES, default="ok")
    parser.add_argument("--fail-status", type=int, default=None)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--results", type=int, default=8, help="results per search")
    parser.add_argument("--no-json", action="store_true", help="answer format=json with 403")
    args = parser.parse_args(argv)
    try:
        fake = FakeSearxng(
            args.host,
            args.port,
            mode=args.mode,
            fail_status=args.fail_status,
            delay_s=args.delay,
            result_count=args.results,
            json_enabled=not args.no_json,
        )
    except ValueError as exc:
        parser.error(str(exc))

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    fake.start()
    try:
        print(f"fake searxng listening on {fake.url}", flush=True)
        while not stop.wait(0.2):
            pass
    finally:
        fake.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
