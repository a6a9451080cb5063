"""The gateway service: Ollama's and OpenAI's HTTP APIs (and the task API) in front of
``coordinator.route``, on aiohttp.

Every generation (and every embedding batch) is routed with ``wait``: the router's first chunk
(seq 0) names the task, so a client that goes away (aiohttp cancels its handler, or a write
fails) has its task cancelled through ``coordinator.cancel``; pieces are forwarded as the
worker produces them; the HTTP status is decided only when the first output (or the end)
arrives, so a task that fails before any output still gets a proper error status. Ollama's
model management (``/api/show``, ``/api/pull``, preloads, an embedding request with nothing to
embed) and the model listings are answered from ``coordinator.workers`` alone: no task. The
bodies, shapes and statuses are pure functions in the API modules (`ollama_api`,
`ollama_answers`, `openai_api`, `openai_answers`, `task_api`, `fleet`, `common`).

Every request ends in one ``request`` log line (path, model, status, code, and the task when
there was one), refusals before routing included.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Final

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client

from schemas.queries import TaskQuery
from schemas.route import (
    CHUNK_HEADER,
    RouteRequest,
    StreamChunk,
)
from schemas.subjects import ROUTE, TASK
from services import __version__
from services.gateway import fleet, ollama_api, openai_api
from services.gateway.bus import QUERY_TIMEOUT_S, FleetBus, next_msg
from services.gateway.common import (
    OLLAMA_API_VERSION,
    ApiError,
    Ask,
    Instant,
    Shape,
    model_named,
    too_large,
)
from services.gateway.fleet import Served
from services.gateway.ollama_answers import OllamaEmbedShape, OllamaShape, ollama_pull
from services.gateway.openai_answers import OpenAIEmbedShape, OpenAIShape
from services.gateway.task_api import TaskShape, task_route
from services.runtime.bus import connect
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import GatewaySettings

log = structlog.get_logger("gateway")

# The router replies within the task's timeout plus its margin; the gateway waits beyond that.
WAIT_MARGIN_S: Final = 60.0
JSON: Final = "application/json"
NDJSON: Final = "application/x-ndjson"
TASK_HEADER: Final = "X-Coordinator-Task"

_encoder = msgspec.json.Encoder()
_chunk_decoder = msgspec.json.Decoder(StreamChunk)

Parser = Callable[..., Ask | Instant]
MakeShape = Callable[[str, Ask | None], Shape]


class Gateway:
    """The HTTP handlers; one NATS connection shared by every request."""

    def __init__(self, nc: Client, settings: GatewaySettings) -> None:
        self.nc = nc
        self.settings = settings
        self.tasks = TaskSet()
        self.bus = FleetBus(nc)
        self.replies = self.bus.replies

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.gateway_max_body_bytes)
        routes = app.router
        # add_get also answers HEAD, which Ollama's CLI sends to / to see the server is up.
        routes.add_get("/", self.root)
        routes.add_get("/api/version", self.version)
        routes.add_get("/api/tags", self.tags)
        routes.add_get("/api/ps", self.ps)
        routes.add_post("/api/generate", self.api_generate)
        routes.add_post("/api/chat", self.api_chat)
        routes.add_post("/api/embed", self.api_embed)
        routes.add_post("/api/embeddings", self.api_embeddings)
        routes.add_post("/api/show", self.api_show)
        routes.add_post("/api/pull", self.api_pull)
        routes.add_get("/v1/models", self.v1_models)
        routes.add_get("/v1/models/{model:.+}", self.v1_model)
        routes.add_post("/v1/chat/completions", self.v1_chat)
        routes.add_post("/v1/completions", self.v1_completions)
        routes.add_post("/v1/embeddings", self.v1_embeddings)
        routes.add_post("/route", self.route)
        routes.add_get("/task/{task_id}", self.task)
        return app

    # -- small endpoints -------------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        """What Ollama answers at ``/``; some clients probe it."""
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        body = {"version": OLLAMA_API_VERSION, "coordinator": __version__}
        return web.Response(body=_encoder.encode(body), content_type=JSON)

    async def tags(self, request: web.Request) -> web.Response:
        return await self._listing(request, fleet.ollama_tags, OllamaShape(model="", chat=False))

    async def ps(self, request: web.Request) -> web.Response:
        return await self._listing(request, fleet.ollama_ps, OllamaShape(model="", chat=False))

    async def v1_models(self, request: web.Request) -> web.Response:
        return await self._listing(request, fleet.openai_models, OpenAIShape(model="", chat=True))

    async def _listing(
        self, request: web.Request, render: fleet.Listing, shape: Shape
    ) -> web.Response:
        try:
            workers = await self.bus.workers()
        except ApiError as exc:
            return self._refused(request, shape, exc)
        return web.Response(body=render(workers), content_type=JSON)

    async def v1_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: a served model (bare names and aliases resolved), or
        OpenAI's 404."""
        asked = request.match_info["model"]
        shape = OpenAIShape(model=asked, chat=True)
        try:
            known = await self.bus.fleet()
            body = fleet.openai_model(asked, known.workers, known.aliases)
        except ApiError as exc:
            return self._refused(request, shape, exc, asked)
        return web.Response(body=body, content_type=JSON)

    # -- Ollama's model management: the worker list, no task -------------------------------------

    async def api_show(self, request: web.Request) -> web.Response:
        """``POST /api/show``: a model a live worker serves, in Ollama's shape."""
        shape = OllamaShape(model="", chat=False)
        body = b""
        try:
            body = await self._read(request)
            asked = ollama_api.ollama_model_request(body, "show")
            served = await self._serving(asked.model)
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return web.Response(body=fleet.ollama_show(asked.model, served), content_type=JSON)

    async def api_pull(self, request: web.Request) -> web.Response:
        """``POST /api/pull``: the gateway cannot pull; a model the fleet serves is a success
        at once, any other a 404 that says so."""
        shape = OllamaShape(model="", chat=False)
        body = b""
        try:
            body = await self._read(request)
            asked = ollama_api.ollama_model_request(body, "pull")
            await self._serving(asked.model, pull=True)
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return web.Response(
            body=ollama_pull(stream=asked.stream),
            content_type=NDJSON if asked.stream else JSON,
        )

    async def _instant(self, request: web.Request, instant: Instant) -> web.Response:
        """A preload (or unload), or an embedding request with nothing to embed, of a served
        model: answered at once. Workers keep their models loaded as their own Ollama
        decides; nothing is loaded or unloaded here."""
        await self._serving(instant.model)
        log.info(
            "request", path=request.path, model=instant.model, instant=instant.kind, status=200
        )
        return web.Response(body=instant.answer(), content_type=JSON)

    # -- generation and embeddings ---------------------------------------------------------------

    async def api_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request, ollama_api.ollama_generate, lambda model, ask: OllamaShape(model, chat=False)
        )

    async def api_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request, ollama_api.ollama_chat, lambda model, ask: OllamaShape(model, chat=True)
        )

    async def api_embed(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request, ollama_api.ollama_embed, lambda model, ask: OllamaEmbedShape(model)
        )

    async def api_embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request,
            ollama_api.ollama_embeddings,
            lambda model, ask: OllamaEmbedShape(model, legacy=True),
        )

    async def v1_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(request, openai_api.openai_chat, _openai_shape(chat=True))

    async def v1_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(request, openai_api.openai_completion, _openai_shape(chat=False))

    async def v1_embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request,
            openai_api.openai_embeddings,
            lambda model, ask: OpenAIEmbedShape(model, base64=bool(ask and ask.base64_vectors)),
        )

    async def _ask(
        self, request: web.Request, parse: Parser, make_shape: MakeShape
    ) -> web.StreamResponse:
        body = b""
        try:
            body = await self._read(request)
            ask = parse(body, timeout_s=self.settings.gateway_task_timeout_s)
            if not isinstance(ask, Ask):
                return await self._instant(request, ask)
        except ApiError as exc:
            return self._refused(request, make_shape("", None), exc, model_named(body))
        return await self._serve(request, ask.route, make_shape(ask.route.model, ask))

    # -- the task API ----------------------------------------------------------------------------

    async def route(self, request: web.Request) -> web.StreamResponse:
        """``POST /route``: the bus's route request and reply, as DESIGN.md has them."""
        shape = TaskShape()
        body = b""
        try:
            body = await self._read(request)
            asked = task_route(body)
            if asked.wait or asked.stream:
                return await self._serve(request, asked, shape)
            reply = await self.bus.call(ROUTE, body, QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return web.Response(body=reply, content_type=JSON)

    async def task(self, request: web.Request) -> web.Response:
        """``GET /task/{id}``: the task as the stats service knows it."""
        query = TaskQuery(task_id=request.match_info["task_id"])
        try:
            reply = await self.bus.call(TASK, _encoder.encode(query), QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._refused(request, TaskShape(), exc)
        return web.Response(body=reply, content_type=JSON)

    # -- the route call --------------------------------------------------------------------------

    async def _serve(
        self, request: web.Request, route: RouteRequest, shape: Shape
    ) -> web.StreamResponse:
        """Route ``route`` (``wait`` set; ``stream`` as the client asked) and answer in
        ``shape``. A client that goes away has its task cancelled."""
        started = time.perf_counter()
        stream = route.stream
        inbox, queue = self.replies.open()
        handed_over = False  # to the task that cancels for a client gone away
        task_id: str | None = None
        response: web.StreamResponse | None = None
        status = 200
        code: str | None = None
        try:
            encoded = _encoder.encode(route)
            if len(encoded) > self.nc.max_payload:
                # A NATS server with a lower limit than the shipped 8 MB: refused here, in the
                # API's shape, rather than as a failed publish.
                raise ApiError(
                    413,
                    "too_large",
                    f"the request is {len(encoded)} bytes as a route request, over the NATS "
                    f"server's max_payload of {self.nc.max_payload} bytes (set "
                    "GATEWAY_MAX_BODY_BYTES below it, or raise max_payload on every server)",
                )
            await self.nc.publish(ROUTE, encoded, reply=inbox)
            wait_s = self._wait_s(route)
            while True:
                msg = await next_msg(queue, wait_s)
                if msg is None:
                    raise ApiError(504, "timeout", f"no answer from the router within {wait_s:g} s")
                headers = msg.headers or {}
                if CHUNK_HEADER in headers:
                    chunk = _chunk_decoder.decode(msg.data)
                    task_id = chunk.task_id
                    piece = shape.piece(chunk)
                    if response is None and (piece is not None or shape.start_on_accept):
                        response = await self._start(request, shape, task_id)
                    if piece is not None and response is not None:
                        await response.write(piece)
                    continue
                reply = await self.bus.final(
                    msg.data, headers, failed_is_error=not isinstance(shape, TaskShape)
                )
                task_id = reply.task_id
                if not stream:
                    return web.Response(
                        body=shape.whole(reply), content_type=JSON, headers={TASK_HEADER: task_id}
                    )
                if response is None:
                    response = await self._start(request, shape, task_id)
                await response.write(shape.end(reply))
                await response.write_eof()
                return response
        except ApiError as exc:
            status, code = exc.status, exc.code
            if response is None:
                return self._error(shape, exc)
            # Too late for a status: say it the way the API says errors mid-stream.
            await response.write(shape.stream_error(exc.code, exc.message))
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # nginx's "client closed request", for the log line only
            self.tasks.spawn(self.bus.cancel_abandoned(inbox, queue, task_id), name="cancel")
            handed_over = True
            raise
        finally:
            if not handed_over:
                self.replies.close(inbox)
            log.info(
                "request",
                path=request.path,
                model=route.model,
                task_id=task_id,
                status=status,
                code=code,
                stream=stream,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    async def _start(self, request: web.Request, shape: Shape, task_id: str) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": shape.stream_type,
                "Cache-Control": "no-cache",
                TASK_HEADER: task_id,
            }
        )
        await response.prepare(request)
        return response

    def _wait_s(self, route: RouteRequest) -> float:
        if route.timeout_s is not None:
            return route.timeout_s + WAIT_MARGIN_S
        return self.settings.gateway_reply_timeout_s

    # -- bus helpers -----------------------------------------------------------------------------

    async def _serving(self, model: str, *, pull: bool = False) -> Served:
        """The model ``model`` names and the live workers serving it: a bare name is its
        ``:latest``, an alias followed, as the router resolves them."""
        known = await self.bus.fleet()
        return fleet.serving(model, known.workers, known.aliases, pull=pull)

    async def _read(self, request: web.Request) -> bytes:
        """The body, refused at once when its ``Content-Length`` is over the limit (and when
        a chunked one grows over it)."""
        limit = self.settings.gateway_max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            raise ApiError(413, "too_large", too_large(limit, length))
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, "too_large", too_large(limit)) from None

    def _refused(
        self, request: web.Request, shape: Shape, exc: ApiError, model: str = ""
    ) -> web.Response:
        """The error answer to a request refused before (or without) routing, with its log
        line."""
        log.info("request", path=request.path, model=model, status=exc.status, code=exc.code)
        return self._error(shape, exc)

    def _error(self, shape: Shape, exc: ApiError) -> web.Response:
        headers = {}
        if exc.status == 503:
            headers["Retry-After"] = str(self.settings.gateway_retry_after_s)
        return web.Response(
            status=exc.status,
            body=shape.error(exc.status, exc.code, exc.message),
            content_type=JSON,
            headers=headers,
        )


def _openai_shape(*, chat: bool) -> MakeShape:
    def make(model: str, ask: Ask | None) -> Shape:
        return OpenAIShape(
            model=model,
            chat=chat,
            include_usage=ask is not None and ask.include_usage,
            created=int(time.time()),
        )

    return make


async def serve(gateway: Gateway, host: str, port: int) -> web.AppRunner:
    """Start serving ``gateway`` on ``host:port``; returns the runner to clean up."""
    # handler_cancellation: a client that disconnects cancels its handler, which cancels the
    # client's task; without it a non-streamed request would run on unnoticed.
    runner = web.AppRunner(
        gateway.app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            f"the gateway cannot listen on {host}:{port} (GATEWAY_HOST, GATEWAY_PORT): {exc}"
        ) from exc
    return runner


async def run(settings: GatewaySettings, stop: asyncio.Event) -> None:
    """Run the gateway until ``stop`` is set."""
    nc = await connect(settings.nats_url, "coordinator-gateway", auth=settings.nats_auth())
    gateway = Gateway(nc, settings)
    try:
        await gateway.replies.start()
        runner = await serve(gateway, settings.gateway_host, settings.gateway_port)
        log.info("gateway ready", url=f"http://{settings.gateway_host}:{settings.gateway_port}")
        if settings.gateway_max_body_bytes > nc.max_payload:
            log.warning(
                "GATEWAY_MAX_BODY_BYTES is over the NATS server's max_payload: bodies between "
                "the two are refused with 413 (the shipped NATS configuration has 8MB)",
                gateway_max_body_bytes=settings.gateway_max_body_bytes,
                max_payload=nc.max_payload,
            )
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await gateway.tasks.wait(timeout_s=2.0)
        await gateway.replies.stop()
        with suppress(Exception):
            await nc.drain()
