"""Who may use the gateway: the ``gateway_keys`` bucket watched into a `KeyTable`, and the
middleware that refuses a request without a known key (401, in the API's own error shape).

The watch delivers every change as it is made, so a key added or revoked with ``coordinator
keys`` counts at once, without a restart. What is decided (hashes, names, which API a path
is, when keys are required) is `services.gateway.keys`, pure.
"""

from __future__ import annotations

import asyncio
from contextlib import suppress
from typing import Final

import msgspec
import nats.errors
import structlog
from aiohttp import web
from aiohttp.typedefs import Handler
from nats.aio.client import Client
from nats.js.kv import KeyValue

from schemas.subjects import GATEWAY_KEYS_BUCKET
from services.errors import Unavailable
from services.gateway.common import ApiError
from services.gateway.keys import INVALID_API_KEY, KeyTable, Refusal, is_public, record_decoder
from services.gateway.responses import refused, shape_of
from services.runtime.bus import ensure_bucket
from services.runtime.watch import follow_bucket, value_of

log = structlog.get_logger("gateway")

# The name of the key a request came in with (unset: no key is required).
CLIENT: Final = web.RequestKey("client", str)
OPERATOR: Final = web.RequestKey("operator", bool)
# How long the gateway waits, at start, for the bucket's current keys.
READY_TIMEOUT_S: Final = 10.0


class Access:
    """The keys the gateway knows, kept up to date from the bucket, and the check of each
    request against them."""

    def __init__(self, *, always: bool, retry_after_s: int) -> None:
        self.table = KeyTable(always=always)
        self.retry_after_s = retry_after_s
        self._watch: asyncio.Task[None] | None = None

    async def start(self, nc: Client) -> None:
        """Open the bucket (made if missing and this NATS user may) and load its keys; the
        watch then runs until `stop`. Fails rather than serve with keys unknown."""
        try:
            kv = await ensure_bucket(nc.jetstream(), GATEWAY_KEYS_BUCKET, ttl_s=None)
        except nats.errors.TimeoutError:
            # What a NATS user gets for a subject it may not publish to: no answer.
            raise Unavailable(
                f"the gateway keys (bucket {GATEWAY_KEYS_BUCKET}) cannot be looked up: does "
                "NATS answer, and may this NATS user read the bucket (deploy/nats)?"
            ) from None
        ready = asyncio.Event()
        self._watch = asyncio.create_task(
            follow_bucket(nc, kv, self._on_entry, ready), name="watch-gateway-keys"
        )
        try:
            async with asyncio.timeout(READY_TIMEOUT_S):
                await ready.wait()
        except TimeoutError:
            await self.stop()
            raise Unavailable(
                f"the gateway keys (bucket {GATEWAY_KEYS_BUCKET}) could not be read in "
                f"{READY_TIMEOUT_S:g} s: may this NATS user watch it?"
            ) from None

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    def _on_entry(self, entry: KeyValue.Entry) -> None:
        if (value := value_of(entry)) is None:
            if self.table.remove(entry.key):
                log.info("gateway key revoked", key_name=entry.key, keys=len(self.table))
            return
        # The bucket's key is the name: a value that says otherwise does not rename it.
        record = msgspec.structs.replace(record_decoder.decode(value), name=entry.key)
        self.table.put(record)
        log.info(
            "gateway key known",
            key_name=record.name,
            priority=record.priority,
            keys=len(self.table),
        )

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Refuse a request without a known key when keys are required; else note the key's
        name (`CLIENT`) and bind it to the request's log lines."""
        if is_public(request.path):
            return await handler(request)
        found = self.table.identify(
            request.headers.get("Authorization"), request.headers.get("x-api-key")
        )
        if isinstance(found, Refusal):
            shape = shape_of(request.path)
            error = ApiError(401, INVALID_API_KEY, found.message)
            response = refused(request, shape, error, retry_after_s=self.retry_after_s)
            response.headers["WWW-Authenticate"] = 'Bearer realm="coordinator"'
            return response
        if found is None:
            return await handler(request)
        request[CLIENT] = found.name
        request[OPERATOR] = found.operator
        with structlog.contextvars.bound_contextvars(client=found.name, priority=found.priority):
            return await handler(request)


def client_of(request: web.Request) -> str | None:
    """The name of the key ``request`` came in with; None when none was required."""
    name: str | None = request.get(CLIENT)
    return name


def acts_as_operator(request: web.Request) -> bool:
    """Whether ``request`` speaks for the operator: it came in with an operator's key, or
    through an open gateway (no key, and no task of one; as an Ollama without keys, anyone
    who reaches it). The operator sees every task's id and changes the machines' models."""
    return request.get(CLIENT) is None or bool(request.get(OPERATOR))
