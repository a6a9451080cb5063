"""The gateway service: Ollama's and OpenAI's HTTP APIs (and the task API) in front of
``coordinator.route``, on aiohttp: the app's routes, each a thin handler, and the lifecycle.

Every generation (and every embedding batch) is routed with ``wait`` and its answer relayed as
it arrives (`relay`). Ollama's ``/api/show``, preloads, an embedding request with nothing to
embed, a pull by a key that is not an operator's, and the model listings are answered from
``coordinator.workers`` alone: no task. The operator's pulls, creates, copies and removals are
a ``model_change`` task per machine (`model_changes`). The bodies, shapes and statuses are
pure functions in the API modules (`ollama_api`, `ollama_answers`, `openai_api`,
`openai_answers`, `task_api`, `model_change_api`, `fleet`, `common`); reading bodies and
writing errors is `responses`, the bus is `bus`.

Every request ends in one ``request`` log line (path, model, status, code, and the task when
there was one), refusals before routing included.

The dashboard (``/dashboard``) and Prometheus' ``/metrics`` are `dashboard`, fed from the bus
by `feed` (the registry, the event log, the read-only endpoints).

Who may ask is `access` (API keys from the ``gateway_keys`` bucket, their checks in `keys`):
a request that needs a key and lacks one is a 401 before any handler runs, and the key's name
travels with the task as ``client``. Slow clients are bounded: the header by `connections`,
the body by ``GATEWAY_BODY_TIMEOUT_S`` (408), an idle connection by aiohttp's keep-alive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import Final

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client

from schemas.queries import TaskQuery
from schemas.route import RouteRequest
from schemas.subjects import ROUTE, TASK
from services import __version__
from services.errors import ConfigError, Forbidden, WaitTimeout
from services.fleet.model_matrix import known_size
from services.gateway import (
    anthropic_api,
    fleet,
    model_change_api,
    ollama_api,
    openai_api,
    openai_responses_api,
)
from services.gateway.access import Access, acts_as_operator, client_of
from services.gateway.anthropic_answers import AnthropicShape
from services.gateway.bus import QUERY_TIMEOUT_S, FleetBus
from services.gateway.common import OLLAMA_API_VERSION, ApiError, Ask, Instant, Shape, model_named
from services.gateway.connections import GuardedSite, HeaderDeadline
from services.gateway.dashboard import Dashboard
from services.gateway.feed import Feed
from services.gateway.fleet import Served
from services.gateway.keys import always_keyed, is_loopback, open_refusal
from services.gateway.model_changes import ModelChanges
from services.gateway.ollama_answers import OllamaEmbedShape, OllamaShape, ollama_pull
from services.gateway.openai_answers import OpenAIEmbedShape, OpenAIShape
from services.gateway.openai_responses_answers import ResponsesShape
from services.gateway.relay import Relay
from services.gateway.responses import JSON, NDJSON, json_errors, read_body, refused
from services.gateway.settings import GatewaySettings
from services.gateway.task_api import TaskShape, task_route
from services.runtime.bus import connect
from services.runtime.lifecycle import TaskSet, close_bus, stop_within

log = structlog.get_logger("gateway")

_encoder = msgspec.json.Encoder()

# At a stop, open HTTP requests get this long (aiohttp's shutdown_timeout), then are cut.
SHUTDOWN_S: Final = 5.0

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
        self.relay = Relay(nc, self.bus, self.tasks, settings)
        self.changes = ModelChanges(nc, self.bus, self.tasks, settings)
        self.access = Access(
            always=always_keyed(settings.gateway_host, allow_open=settings.gateway_allow_open),
            retry_after_s=settings.gateway_retry_after_s,
        )
        self.deadline = HeaderDeadline(settings.gateway_header_timeout_s)
        self.feed = Feed(nc, self.bus, settings)
        self.dashboard = Dashboard(self.feed)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.settings.gateway_max_body_bytes,
            # JSON errors around everything (no text/plain 500, whatever fails); then the
            # header deadline: a refused request has ended its header too; then the key.
            middlewares=[
                json_errors(retry_after_s=self.settings.gateway_retry_after_s),
                self.deadline.middleware,
                self.access.middleware,
            ],
        )
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
        routes.add_post("/api/create", self.api_create)
        routes.add_post("/api/copy", self.api_copy)
        routes.add_delete("/api/delete", self.api_delete)
        routes.add_get("/v1/models", self.v1_models)
        routes.add_get("/v1/models/{model:.+}", self.v1_model)
        routes.add_post("/v1/chat/completions", self.v1_chat)
        routes.add_post("/v1/completions", self.v1_completions)
        routes.add_post("/v1/embeddings", self.v1_embeddings)
        routes.add_post("/v1/responses", self.v1_responses)
        routes.add_post("/v1/messages", self.v1_messages)
        routes.add_post("/v1/messages/count_tokens", self.v1_count_tokens)
        routes.add_post("/route", self.route)
        routes.add_get("/task/{task_id}", self.task)
        self.dashboard.add_routes(routes)
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
            body = fleet.openai_model(asked, known.workers, known.aliases, settling=known.settling)
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

    async def api_pull(self, request: web.Request) -> web.StreamResponse:
        """``POST /api/pull``: for the operator, a pull onto the machines (`_change`); for
        another key, nothing to do for a model the fleet serves (success at once), a 403
        for any other."""
        if acts_as_operator(request):
            return await self._change(request, model_change_api.pull_request)
        shape = OllamaShape(model="", chat=False)
        body = b""
        try:
            body = await self._read(request)
            asked = ollama_api.ollama_model_request(body, "pull")
            try:
                await self._serving(asked.model)
            except ApiError as exc:
                if exc.status != 404:
                    raise
                raise ApiError(
                    403, Forbidden.code, f"{exc.message}; only an operator's key may pull models"
                ) from None
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return web.Response(
            body=ollama_pull(stream=asked.stream),
            content_type=NDJSON if asked.stream else JSON,
        )

    async def api_create(self, request: web.Request) -> web.StreamResponse:
        return await self._change(request, model_change_api.create_request)

    async def api_copy(self, request: web.Request) -> web.StreamResponse:
        return await self._change(request, model_change_api.copy_request)

    async def api_delete(self, request: web.Request) -> web.StreamResponse:
        return await self._change(request, model_change_api.delete_request)

    async def _change(
        self, request: web.Request, parse: Callable[[bytes], model_change_api.Asked]
    ) -> web.StreamResponse:
        """A change to the machines' models (`model_changes`): the operator's only; on the
        machines ``X-Coordinator-Machines`` names, else those `machines_for` chooses."""
        shape = OllamaShape(model="", chat=False)
        body = b""
        try:
            if not acts_as_operator(request):
                raise ApiError(
                    403, Forbidden.code, "only an operator's key may change the machines' models"
                )
            body = await self._read(request)
            asked = parse(body)
            named = model_change_api.named_machines(
                request.headers.get(model_change_api.MACHINES_HEADER)
            )
            known = await self.bus.fleet()
            model, machines = model_change_api.machines_for(
                asked, named, known.workers, known.aliases
            )
            if asked.change.op == "pull":
                size = known_size(model, known.workers)
                asked = dataclasses.replace(
                    asked, change=msgspec.structs.replace(asked.change, size=size)
                )
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return await self.changes.answer(request, asked, model, machines, client_of(request))

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

    async def v1_responses(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request,
            openai_responses_api.openai_responses,
            lambda model, ask: ResponsesShape(
                model, echo=(ask.echo if ask else None) or {}, created=int(time.time())
            ),
        )

    async def v1_messages(self, request: web.Request) -> web.StreamResponse:
        return await self._ask(
            request,
            anthropic_api.anthropic_messages,
            lambda model, ask: AnthropicShape(model),
            adjust=self._thinking_if_it_can,
        )

    async def _thinking_if_it_can(self, route: RouteRequest) -> RouteRequest:
        """Anthropic's clients ask every model to think (Claude Code sends ``adaptive`` and an
        effort): as Ollama's own Anthropic layer does, a model the fleet serves without
        ``thinking`` is asked without it, rather than refused. A model the fleet does not
        serve now goes to the router as asked, which says why."""
        if not route.think:
            return route
        try:
            served = await self._serving(route.model)
        except ApiError:
            return route
        if "thinking" in served.capabilities:
            return route
        return msgspec.structs.replace(route, think=None)

    async def v1_count_tokens(self, request: web.Request) -> web.Response:
        """``POST /v1/messages/count_tokens``: an estimate, without a task
        (`services.gateway.anthropic_api.anthropic_count_tokens`)."""
        body = b""
        try:
            body = await self._read(request)
            counted = anthropic_api.anthropic_count_tokens(body)
        except ApiError as exc:
            return self._refused(request, AnthropicShape(model=""), exc, model_named(body))
        return web.json_response(counted)

    async def _ask(
        self,
        request: web.Request,
        parse: Parser,
        make_shape: MakeShape,
        *,
        adjust: Callable[[RouteRequest], Awaitable[RouteRequest]] | None = None,
    ) -> web.StreamResponse:
        body = b""
        try:
            body = await self._read(request)
            ask = parse(body, timeout_s=self.settings.gateway_task_timeout_s)
            if not isinstance(ask, Ask):
                return await self._instant(request, ask)
            route = ask.route if adjust is None else await adjust(ask.route)
        except ApiError as exc:
            return self._refused(request, make_shape("", None), exc, model_named(body))
        route = msgspec.structs.replace(route, client=client_of(request))
        return await self.relay.serve(request, route, make_shape(route.model, ask))

    # -- the task API ----------------------------------------------------------------------------

    async def route(self, request: web.Request) -> web.StreamResponse:
        """``POST /route``: the bus's route request and reply, as docs/interfaces.md has them."""
        shape = TaskShape()
        body = b""
        try:
            body = await self._read(request)
            # ``client`` is the gateway's to say, whatever the body claims.
            asked = msgspec.structs.replace(task_route(body), client=client_of(request))
            if asked.wait or asked.stream:
                return await self.relay.serve(request, asked, shape)
            reply = await self.bus.call(ROUTE, _encoder.encode(asked), QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._refused(request, shape, exc, model_named(body))
        return web.Response(body=reply, content_type=JSON)

    async def task(self, request: web.Request) -> web.Response:
        """``GET /task/{id}``: the task as the stats service knows it."""
        query = TaskQuery(task_id=request.match_info["task_id"], client=client_of(request))
        try:
            reply = await self.bus.call(TASK, _encoder.encode(query), QUERY_TIMEOUT_S)
        except ApiError as exc:
            return self._refused(request, TaskShape(), exc)
        return web.Response(body=reply, content_type=JSON)

    # -- helpers ---------------------------------------------------------------------------------

    async def _serving(self, model: str) -> Served:
        """The model ``model`` names and the live workers serving it: a bare name is its
        ``:latest``, an alias followed, as the router resolves them."""
        known = await self.bus.fleet()
        return fleet.serving(model, known.workers, known.aliases, settling=known.settling)

    async def _read(self, request: web.Request) -> bytes:
        """The body, within the size limit and ``GATEWAY_BODY_TIMEOUT_S`` (else 408: a body
        shorter than its ``Content-Length`` ends here, not in a hang)."""
        timeout_s = self.settings.gateway_body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                # Inflated here, not by aiohttp, which refuses br and zstd in plain text.
                return await read_body(
                    request, self.settings.gateway_max_body_bytes, server_decompresses=False
                )
        except TimeoutError:
            raise ApiError(
                408,
                WaitTimeout.code,
                f"the request body did not arrive in {timeout_s:g} s (GATEWAY_BODY_TIMEOUT_S)",
            ) from None

    def _refused(
        self, request: web.Request, shape: Shape, exc: ApiError, model: str = ""
    ) -> web.Response:
        response = refused(
            request, shape, exc, retry_after_s=self.settings.gateway_retry_after_s, model=model
        )
        if exc.status in (408, 413):
            # The body is not read (whole): the connection cannot carry another request.
            response.force_close()
        return response


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
        gateway.app(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=SHUTDOWN_S,
        keepalive_timeout=gateway.settings.gateway_keepalive_timeout_s,
        auto_decompress=False,  # `read_body` inflates, in the API's own errors
    )
    await runner.setup()
    try:
        await GuardedSite(runner, host, port, gateway.deadline).start()
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
        await gateway.access.start(nc)
        await gateway.feed.start()
        keys = len(gateway.access.table)
        why = open_refusal(settings.gateway_host, allow_open=settings.gateway_allow_open, keys=keys)
        if why is not None:
            raise ConfigError(why)
        runner = await serve(gateway, settings.gateway_host, settings.gateway_port)
        log.info(
            "gateway ready",
            url=f"http://{settings.gateway_host}:{settings.gateway_port}",
            keys_required=gateway.access.table.required,
            keys=keys,
        )
        if not gateway.access.table.required and not is_loopback(settings.gateway_host):
            log.warning(
                "GATEWAY_ALLOW_OPEN: no API key is required, so anyone who reaches "
                f"{settings.gateway_host}:{settings.gateway_port} may use the fleet"
            )
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
            gateway.feed.close()  # the dashboard's streams end, so the server stops at once
            await stop_within("the HTTP server", runner.cleanup(), SHUTDOWN_S + 1.0)
    finally:
        await gateway.feed.stop()
        await gateway.tasks.wait(timeout_s=2.0)
        await gateway.access.stop()
        await gateway.replies.stop()
        await close_bus(nc)
