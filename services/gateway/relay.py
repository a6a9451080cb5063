"""The route call relayed to an HTTP client: a route request to ``coordinator.route`` with
``wait``, the router's chunks and final reply written in the API's shape as they arrive.

The router's first chunk (seq 0) names the task, so a client that goes away (aiohttp cancels
its handler, or a write fails) has its task cancelled through ``coordinator.cancel``; pieces
are forwarded as the worker produces them; the HTTP status is decided only when the first
output (or the end) arrives, so a task that fails before any output still gets a proper error
status. Every relayed request ends in one ``request`` log line.

Each request names its task (``task_id``, chosen here), so when the router says nothing for
``GATEWAY_REASK_S`` (it died with the answer, or the connection lost it) the same request is sent
again: a router answers it as the task it names (`services.router.following`), and a stream
gets the rest of the answer that its lost pieces held. The protocol is spoken by
`services.runtime.request.StreamedRequest`, as the CLI speaks it; its errors become the API's
statuses here (`FleetBus.refusals`). A stream's pieces are written as
`services.gateway.streamed` says: a task run again by a newer attempt neither repeats nor
garbles what was written, and ends in the API's mid-stream error when its answer does not
continue it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Final

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client
from nats.aio.msg import Msg

from schemas.route import RouteRequest, StreamChunk
from schemas.subjects import ROUTE
from services.errors import TooLarge
from services.gateway.bus import FleetBus, SharedReplies
from services.gateway.common import ApiError, Shape
from services.gateway.responses import JSON, error_response
from services.gateway.settings import GatewaySettings
from services.gateway.streamed import Sent
from services.gateway.task_api import TaskShape
from services.runtime.lifecycle import TaskSet
from services.runtime.request import ReplySubject, StreamedRequest, new_task_id

log = structlog.get_logger("gateway")

# The router replies within the task's timeout plus its margin; the gateway waits beyond that.
WAIT_MARGIN_S: Final = 60.0
TASK_HEADER: Final = "X-Coordinator-Task"

_encoder = msgspec.json.Encoder()
_chunk_decoder = msgspec.json.Decoder(StreamChunk)


class Relay:
    """Routes requests and relays the answers; the cancels of clients gone away run in
    ``tasks``."""

    def __init__(
        self, nc: Client, bus: FleetBus, tasks: TaskSet, settings: GatewaySettings
    ) -> None:
        self.nc = nc
        self.bus = bus
        self.replies = bus.replies
        self.tasks = tasks
        self.settings = settings

    async def serve(
        self, request: web.Request, route: RouteRequest, shape: Shape
    ) -> web.StreamResponse:
        """Route ``route`` (``wait`` set; ``stream`` as the client asked) and answer in
        ``shape``. A client that goes away has its task cancelled."""
        started = time.perf_counter()
        stream = route.stream
        if route.task_id is None:
            route = msgspec.structs.replace(route, task_id=new_task_id())
        opened: list[tuple[str, asyncio.Queue[Msg]]] = []  # reply subjects, the current last

        async def open_replies() -> ReplySubject:
            inbox, queue = self.replies.open()
            opened.append((inbox, queue))
            return SharedReplies(inbox, queue)

        handed_over: str | None = None  # to the task that cancels for a client gone away
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
                    TooLarge.code,
                    f"the request is {len(encoded)} bytes as a route request, over the NATS "
                    f"server's max_payload of {self.nc.max_payload} bytes (set "
                    "GATEWAY_MAX_BODY_BYTES below it, or raise max_payload on every server)",
                )
            call = StreamedRequest(
                self.nc,
                ROUTE,
                encoded,
                open_replies=open_replies,
                timeout_s=self._wait_s(route),
                reask_s=self.settings.gateway_reask_s,
                on_ask_again=lambda: log.info(
                    "no word from the router; asking again by task id", task_id=route.task_id
                ),
            )
            sent = Sent(route.task_id)  # what the stream has written of the answer
            final = b""
            async for item in self.bus.refusals(call.replies()):
                if isinstance(item, bytes):
                    final = item  # the last item: the reply
                    break
                task_id = item.task_id
                fresh = sent.add(item)
                piece = None if fresh is None else shape.piece(fresh)
                if response is None and (piece is not None or shape.start_on_accept):
                    response = await self._start(request, shape, task_id)
                if piece is not None and response is not None:
                    await response.write(piece)
            reply = self.bus.final(final, failed_is_error=not isinstance(shape, TaskShape))
            task_id = reply.task_id
            if not stream:
                return web.Response(
                    body=shape.whole(reply), content_type=JSON, headers={TASK_HEADER: task_id}
                )
            if response is None:
                response = await self._start(request, shape, task_id)
            rest = sent.rest(reply)
            if rest is not None and (piece := shape.piece(rest)) is not None:
                await response.write(piece)
            await response.write(shape.end(reply))
            await response.write_eof()
            return response
        except ApiError as exc:
            status, code = exc.status, exc.code
            if response is None:
                return error_response(shape, exc, retry_after_s=self.settings.gateway_retry_after_s)
            # Too late for a status: say it the way the API says errors mid-stream.
            await response.write(shape.stream_error(exc.code, exc.message))
            await response.write_eof()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = 499  # nginx's "client closed request", for the log line only
            if opened:
                inbox, queue = opened[-1]
                self.tasks.spawn(
                    self.bus.cancel_abandoned(inbox, queue, task_id, route.client), name="cancel"
                )
                handed_over = inbox
            raise
        finally:
            for inbox, _ in opened:
                if inbox != handed_over:
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
