"""The gateway service: Ollama's and OpenAI's HTTP APIs (and the task API) in front of
``coordinator.route``, on aiohttp.

Every generation is routed with ``wait`` and ``stream``: the router's first chunk (seq 0) names
the task, so a client that goes away (aiohttp cancels its handler, or a write fails) has its
task cancelled through ``coordinator.cancel``; pieces are forwarded as the worker produces
them; the HTTP status is decided only when the first text (or the end) arrives, so a task
that fails before any output still gets a proper error status. Ollama's model management
(``/api/show``, ``/api/pull``, preloads) is answered from ``coordinator.workers`` alone: no
task. The shapes and statuses are pure functions in `services.gateway.convert`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.queries import TaskQuery, WorkersReply, WorkerView
from schemas.route import (
    CHUNK_HEADER,
    CancelRequest,
    ErrorBody,
    RouteReply,
    RouteRequest,
    StreamChunk,
)
from schemas.subjects import CANCEL, ROUTE, TASK, WORKERS
from services import __version__
from services.gateway import convert
from services.gateway.convert import (
    ApiError,
    Ask,
    OllamaShape,
    OpenAIShape,
    Preload,
    Shape,
    TaskShape,
)
from services.runtime.bus import connect
from services.runtime.errors import ConfigError
from services.runtime.lifecycle import TaskSet
from services.runtime.settings import GatewaySettings

log = structlog.get_logger("gateway")

# Chat histories can be long; the router still enforces MAX_PROMPT_CHARS on the prompt.
MAX_BODY_BYTES: Final = 16 * 1024 * 1024
# Request/reply calls that only read (workers, a task) or cancel.
QUERY_TIMEOUT_S: Final = 5.0
# A client that leaves before the router took its request: cancel tries, and the pause between.
CANCEL_TRIES: Final = 3
CANCEL_RETRY_S: Final = 0.2
# The router replies within the task's timeout plus its margin; the gateway waits beyond that.
WAIT_MARGIN_S: Final = 60.0
JSON: Final = "application/json"
NDJSON: Final = "application/x-ndjson"
TASK_HEADER: Final = "X-Coordinator-Task"

_encoder = msgspec.json.Encoder()
_chunk_decoder = msgspec.json.Decoder(StreamChunk)
_reply_decoder = msgspec.json.Decoder(RouteReply)
_error_decoder = msgspec.json.Decoder(ErrorBody)
_workers_decoder = msgspec.json.Decoder(WorkersReply)

Parser = Callable[..., Ask | Preload]


class Replies:
    """One subscription for every reply the gateway waits on (``<inbox>.<n>`` each), as
    nats.py's own requests do: no SUB and UNSUB on the bus per request."""

    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self._queues: dict[str, asyncio.Queue[Msg]] = {}
        self._count = 0
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(f"{self.prefix}.*", cb=self._deliver)

    async def stop(self) -> None:
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()

    async def _deliver(self, msg: Msg) -> None:
        queue = self._queues.get(msg.subject)
        if queue is not None:
            queue.put_nowait(msg)

    def open(self) -> tuple[str, asyncio.Queue[Msg]]:
        """A fresh reply subject and the queue its messages arrive in."""
        self._count += 1
        subject = f"{self.prefix}.{self._count}"
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._queues[subject] = queue
        return subject, queue

    def close(self, subject: str) -> None:
        self._queues.pop(subject, None)


async def next_msg(queue: asyncio.Queue[Msg], timeout_s: float) -> Msg | None:
    """The next message, or None after ``timeout_s`` of silence."""
    try:
        async with asyncio.timeout(timeout_s):
            return await queue.get()
    except TimeoutError:
        return None


class Gateway:
    """The HTTP handlers; one NATS connection shared by every request."""

    def __init__(self, nc: Client, settings: GatewaySettings) -> None:
        self.nc = nc
        self.settings = settings
        self.tasks = TaskSet()
        self.replies = Replies(nc)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        routes = app.router
        # add_get also answers HEAD, which Ollama's CLI sends to / to see the server is up.
        routes.add_get("/", self.root)
        routes.add_get("/api/version", self.version)
        routes.add_get("/api/tags", self.tags)
        routes.add_get("/api/ps", self.ps)
        routes.add_post("/api/generate", self.api_generate)
        routes.add_post("/api/chat", self.api_chat)
        routes.add_post("/api/show", self.api_show)
        routes.add_post("/api/pull", self.api_pull)
        routes.add_get("/v1/models", self.v1_models)
        routes.add_post("/v1/chat/completions", self.v1_chat)
        routes.add_post("/v1/completions", self.v1_completions)
        routes.add_post("/route", self.route)
        routes.add_get("/task/{task_id}", self.task)
        return app

    # -- small endpoints ---------------------------------------------------------------------

    async def root(self, request: web.Request) -> web.Response:
        """What Ollama answers at ``/``; some clients probe it."""
        return web.Response(text="Ollama is running")

    async def version(self, request: web.Request) -> web.Response:
        body = {"version": convert.OLLAMA_API_VERSION, "coordinator": __version__}
        return web.Response(body=_encoder.encode(body), content_type=JSON)

    async def tags(self, request: web.Request) -> web.Response:
        return await self._listing(convert.ollama_tags, OllamaShape(model="", chat=False))

    async def ps(self, request: web.Request) -> web.Response:
        return await self._listing(convert.ollama_ps, OllamaShape(model="", chat=False))

    async def v1_models(self, request: web.Request) -> web.Response:
        return await self._listing(convert.openai_models, OpenAIShape(model="", chat=True))

    async def _listing(
        self, render: Callable[[list[WorkerView]], bytes], shape: Shape
    ) -> web.Response:
        try:
            workers = await self._workers()
        except ApiError as exc:
            return self._error(shape, exc)
        return web.Response(body=render(workers), content_type=JSON)

    # -- Ollama's model management: the worker list, no task ---------------------------------

    async def api_show(self, request: web.Request) -> web.Response:
        """``POST /api/show``: a model a live worker serves, in Ollama's shape."""
        try:
            asked = convert.ollama_model_request(await _read(request), "show")
            serving = await self._serving(asked.model)
        except ApiError as exc:
            return self._error(OllamaShape(model="", chat=False), exc)
        return web.Response(body=convert.ollama_show(asked.model, serving), content_type=JSON)

    async def api_pull(self, request: web.Request) -> web.Response:
        """``POST /api/pull``: the gateway cannot pull; a model the fleet serves is a success
        at once, any other a 404 that says so."""
        try:
            asked = convert.ollama_model_request(await _read(request), "pull")
            await self._serving(asked.model, pull=True)
        except ApiError as exc:
            return self._error(OllamaShape(model="", chat=False), exc)
        return web.Response(
            body=convert.ollama_pull(stream=asked.stream),
            content_type=NDJSON if asked.stream else JSON,
        )

    async def _preload(self, request: web.Request, preload: Preload) -> web.Response:
        """A load (or unload) of a served model: answered at once. Workers keep their models
        loaded as their own Ollama decides; nothing is loaded or unloaded here."""
        await self._serving(preload.model)
        log.info(
            "request",
            path=request.path,
            model=preload.model,
            preload="unload" if preload.unload else "load",
            status=200,
        )
        return web.Response(body=convert.ollama_preload(preload), content_type=JSON)

    # -- generation --------------------------------------------------------------------------

    async def api_generate(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(
            request, convert.ollama_generate, lambda model, ask: OllamaShape(model, chat=False)
        )

    async def api_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(
            request, convert.ollama_chat, lambda model, ask: OllamaShape(model, chat=True)
        )

    async def v1_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, convert.openai_chat, _openai_shape(chat=True))

    async def v1_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generation(request, convert.openai_completion, _openai_shape(chat=False))

    async def _generation(
        self,
        request: web.Request,
        parse: Parser,
        make_shape: Callable[[str, Ask | None], Shape],
    ) -> web.StreamResponse:
        try:
            body = await _read(request)
            ask = parse(body, timeout_s=self.settings.gateway_task_timeout_s)
            if isinstance(ask, Preload):
                return await self._preload(request, ask)
        except ApiError as exc:
            return self._error(make_shape("", None), exc)
        return await self._serve(request, ask.route, make_shape(ask.route.model, ask))

    # -- the task API ------------------------------------------------------------------------

    async def route(self, request: web.Request) -> web.StreamResponse:
        """``POST /route``: the bus's route request and reply, as DESIGN.md has them."""
        shape = TaskShape()
        try:
            body = await _read(request)
            asked = convert.task_route(body)
            if asked.wait or asked.stream:
                return await self._serve(request, asked, shape)
            reply = await self._call(ROUTE, body, QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._error(shape, exc)
        return web.Response(body=reply, content_type=JSON)

    async def task(self, request: web.Request) -> web.Response:
        """``GET /task/{id}``: the task as the stats service knows it."""
        query = TaskQuery(task_id=request.match_info["task_id"])
        try:
            reply = await self._call(TASK, _encoder.encode(query), QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._error(TaskShape(), exc)
        return web.Response(body=reply, content_type=JSON)

    # -- the route call ----------------------------------------------------------------------

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
        try:
            await self.nc.publish(ROUTE, _encoder.encode(route), reply=inbox)
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
                reply = await self._final(msg.data, headers, shape)
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
            status = exc.status
            if response is None:
                return self._error(shape, exc)
            # Too late for a status: say it the way the API says errors mid-stream.
            await response.write(shape.stream_error(exc.code, exc.message))
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # nginx's "client closed request", for the log line only
            self.tasks.spawn(self._cancel_abandoned(inbox, queue, task_id), name="cancel")
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
                stream=stream,
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    async def _final(self, data: bytes, headers: dict[str, str], shape: Shape) -> RouteReply:
        """The router's last message as a reply; refusals and failed tasks as `ApiError`."""
        if headers.get("Status") == "503":
            raise ApiError(503, "no_responder", "no router answers coordinator.route")
        code = headers.get("Nats-Service-Error-Code")
        if code is not None:
            message = _error_message(data, headers)
            has_workers = await self._fleet_has_workers() if code == "no_worker" else False
            status = convert.refusal_status(code, fleet_has_workers=has_workers)
            if status == 404 and code == "no_worker":
                message = f"model not found: {message}"
            raise ApiError(status, code, message)
        reply = _reply_decoder.decode(data)
        if reply.status == "failed" and not isinstance(shape, TaskShape):
            failure, reason = convert.failure_of(reply)
            raise ApiError(
                convert.failure_status(failure),
                failure,
                f"task {reply.task_id} failed on worker {reply.worker}: {reason}",
            )
        return reply

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

    async def _cancel_abandoned(
        self, inbox: str, queue: asyncio.Queue[Msg], task_id: str | None
    ) -> None:
        """The client went away: cancel its task, by id when the id came, else by the route
        request's reply subject (tried a few times: the router may not have taken it yet)."""
        cancel = CancelRequest(
            task_id=task_id,
            reply_to=None if task_id else inbox,
            reason="the HTTP client disconnected",
        )
        try:
            for attempt in range(CANCEL_TRIES):
                try:
                    await self._call(CANCEL, _encoder.encode(cancel), QUERY_TIMEOUT_S)
                except ApiError as exc:
                    if exc.code != "not_found" or attempt == CANCEL_TRIES - 1 or task_id:
                        raise
                    if any(CHUNK_HEADER not in (m.headers or {}) for m in _drain(queue)):
                        return  # answered (refused, or ended) in the meantime
                    await asyncio.sleep(CANCEL_RETRY_S)
                    continue
                log.info("client went away; task cancelled", task_id=task_id, inbox=inbox)
                return
        except ApiError as exc:
            log.info("client went away; nothing cancelled", task_id=task_id, error=exc.message)
        except Exception as exc:
            log.warning("client went away; cancel failed", task_id=task_id, error=repr(exc))
        finally:
            self.replies.close(inbox)

    # -- bus helpers -------------------------------------------------------------------------

    async def _call(self, subject: str, body: bytes, timeout_s: float) -> bytes:
        """Request/reply; an error reply or a silent bus becomes an `ApiError`."""
        try:
            reply = await self.nc.request(subject, body, timeout=timeout_s)
        except nats.errors.NoRespondersError:
            raise ApiError(503, "no_responder", f"no service answers {subject}") from None
        except nats.errors.TimeoutError:
            raise ApiError(504, "timeout", f"{subject} did not answer in {timeout_s:g} s") from None
        headers = reply.headers or {}
        code = headers.get("Nats-Service-Error-Code")
        if code is not None:
            status = convert.refusal_status(code, fleet_has_workers=True)
            raise ApiError(status, code, _error_message(reply.data, headers))
        return reply.data

    async def _workers(self) -> list[WorkerView]:
        return (await self._fleet()).workers

    async def _fleet(self) -> WorkersReply:
        return _workers_decoder.decode(await self._call(WORKERS, b"{}", QUERY_TIMEOUT_S))

    async def _serving(self, model: str, *, pull: bool = False) -> list[WorkerView]:
        """The live workers serving ``model``, an alias followed as the router follows it."""
        fleet = await self._fleet()
        return convert.workers_serving(fleet.aliases.get(model, model), fleet.workers, pull=pull)

    async def _fleet_has_workers(self) -> bool:
        """Is any inference worker live? (Then an unserved model is unknown, not unserved.)"""
        try:
            return any(w.tier != "web" for w in await self._workers())
        except ApiError:
            return False

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


def _drain(queue: asyncio.Queue[Msg]) -> list[Msg]:
    msgs: list[Msg] = []
    while not queue.empty():
        msgs.append(queue.get_nowait())
    return msgs


def _openai_shape(*, chat: bool) -> Callable[[str, Ask | None], Shape]:
    def make(model: str, ask: Ask | None) -> Shape:
        return OpenAIShape(
            model=model,
            chat=chat,
            include_usage=ask is not None and ask.include_usage,
            created=int(time.time()),
        )

    return make


async def _read(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, "bad_request", f"request body over {MAX_BODY_BYTES // (1024 * 1024)} MiB"
        ) from None


def _error_message(data: bytes, headers: dict[str, str]) -> str:
    try:
        return _error_decoder.decode(data).error.message
    except msgspec.DecodeError:
        return headers.get("Nats-Service-Error", "") or "error"


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
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await gateway.tasks.wait(timeout_s=2.0)
        await gateway.replies.stop()
        with suppress(Exception):
            await nc.drain()
