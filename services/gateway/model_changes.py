"""Ollama's model changes through the gateway, the I/O: one ``model_change`` task per machine
(`services.gateway.model_change_api` says which machines, and reads the bodies), routed as
the CLI routes them (the route protocol's one client, asked again by task id after a
silence), their progress written as one Ollama stream as it arrives, or one answer at the
end. A change goes on when its HTTP client goes away: it is the machines' business, not the
connection's (a pull half done would be pulled again).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Final

import msgspec
import structlog
from aiohttp import web
from nats.aio.client import Client

from schemas.route import ModelProgress, RouteRequest
from schemas.subjects import ROUTE
from services.errors import Unavailable
from services.gateway.bus import FleetBus, SharedReplies
from services.gateway.common import ApiError
from services.gateway.model_change_api import Asked, MergedProgress, failed_line
from services.gateway.responses import JSON, NDJSON
from services.gateway.settings import GatewaySettings
from services.runtime.lifecycle import TaskSet
from services.runtime.request import ReplySubject, StreamedRequest, new_task_id

log = structlog.get_logger("gateway")

# How long a change may take on one machine (a pull of tens of GB on a slow line).
CHANGE_TIMEOUT_S: Final = 6 * 3600.0
# The gateway waits that long and a margin for the router's answer.
WAIT_MARGIN_S: Final = 60.0

_encoder = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Ended:
    """One machine's change ended: None if it went through, else why not."""

    failure: ApiError | None


class ModelChanges:
    """Runs model changes on chosen machines for the gateway's handlers; each machine's task
    runs in ``tasks`` so that a client gone away does not stop it."""

    def __init__(
        self, nc: Client, bus: FleetBus, tasks: TaskSet, settings: GatewaySettings
    ) -> None:
        self.nc = nc
        self.bus = bus
        self.tasks = tasks
        self.settings = settings

    async def answer(
        self,
        request: web.Request,
        asked: Asked,
        model: str,
        machines: list[str],
        client: str | None,
    ) -> web.StreamResponse:
        """Make the change on ``machines`` and answer as Ollama does: pull and create stream
        their progress unless asked not to (then the last line, ``{"status": "success"}``),
        copy and delete an empty 200; a failure on any machine is Ollama's error, naming
        each machine that failed."""
        started = time.perf_counter()
        failures: dict[str, ApiError] = {}
        response: web.StreamResponse | None = None
        merged = MergedProgress()
        try:
            async for worker, item in self._changes(asked, model, machines, client):
                if isinstance(item, Ended):
                    if item.failure is not None:
                        failures[worker] = item.failure
                    continue
                line = merged.add(worker, item)
                if not asked.stream or line is None:
                    continue
                if response is None:
                    response = web.StreamResponse(headers={"Content-Type": NDJSON})
                    await response.prepare(request)
                await response.write(_encoder.encode(line) + b"\n")
            if response is not None:
                end = failed_line(failures) if failures else {"status": "success"}
                await response.write(_encoder.encode(end) + b"\n")
                await response.write_eof()
                return response
            if failures:
                status = next(iter(failures.values())).status
                body = _encoder.encode(failed_line(failures))
                return web.Response(status=status, body=body, content_type=JSON)
            if asked.change.op in ("copy", "delete"):
                return web.Response(status=200)
            return web.Response(body=b'{"status":"success"}', content_type=JSON)
        finally:
            log.info(
                "request",
                path=request.path,
                model=model,
                machines=machines,
                failed=sorted(failures),
                ms=round((time.perf_counter() - started) * 1000, 2),
            )

    async def _changes(
        self, asked: Asked, model: str, machines: list[str], client: str | None
    ) -> AsyncIterator[tuple[str, ModelProgress | Ended]]:
        """Each machine's progress and end, as they arrive, until every machine has ended."""
        arrived: asyncio.Queue[tuple[str, ModelProgress | Ended]] = asyncio.Queue()
        for worker in machines:
            route = RouteRequest(
                prompt="",
                model=model,
                task_type="model_change",
                change=asked.change,
                worker=worker,
                wait=True,
                stream=True,
                timeout_s=CHANGE_TIMEOUT_S,
                task_id=new_task_id(),
                client=client,
            )
            self.tasks.spawn(self._one(worker, route, arrived), name=f"change-{worker}")
        ended = 0
        while ended < len(machines):
            worker, item = await arrived.get()
            ended += isinstance(item, Ended)
            yield worker, item

    async def _one(
        self,
        worker: str,
        route: RouteRequest,
        arrived: asyncio.Queue[tuple[str, ModelProgress | Ended]],
    ) -> None:
        opened: list[str] = []

        async def open_replies() -> ReplySubject:
            inbox, queue = self.bus.replies.open()
            opened.append(inbox)
            return SharedReplies(inbox, queue)

        call = StreamedRequest(
            self.nc,
            ROUTE,
            _encoder.encode(route),
            open_replies=open_replies,
            timeout_s=CHANGE_TIMEOUT_S + WAIT_MARGIN_S,
            reask_s=self.settings.gateway_reask_s,
        )
        failure: ApiError | None = None
        try:
            final = b""
            async for item in self.bus.refusals(call.replies()):
                if isinstance(item, bytes):
                    final = item
                elif item.progress is not None:
                    arrived.put_nowait((worker, item.progress))
            self.bus.final(final)
        except ApiError as exc:
            failure = exc
        except Exception as exc:  # the bus: said as the machine's failure, never lost
            failure = ApiError(503, Unavailable.code, f"{type(exc).__name__}: {exc}")
        finally:
            for inbox in opened:
                self.bus.replies.close(inbox)
            arrived.put_nowait((worker, Ended(failure)))
