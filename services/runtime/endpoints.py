"""Request/reply endpoints on nats.micro, with the project's error shape.

nats.micro awaits one handler at a time per endpoint subscription, so a slow request (a route
with ``wait``) would hold up every other. Each request is therefore handled in its own task.

A request's body is decoded with `decode_body`, which turns every way a body can be
undecodable (not JSON, the wrong shape, a string that is not UTF-8, nesting too deep) into a
`BadRequest`: a known bad input never reaches the ``internal`` path, which stays for the
service's own failures (logged with their traceback; the reply names only the exception's
type and the start of its message).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Final, TypeVar, cast

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import ServiceUnavailableError
from nats.micro.request import Request
from nats.micro.service import Service
from opentelemetry import trace

from schemas.route import MAX_NESTING, ErrorBody, ErrorDetail, nesting_problem, too_deep
from schemas.subjects import InvalidId
from services.errors import BadRequest, CoordinatorError, TooLarge, Unavailable
from services.runtime.lifecycle import TaskSet
from services.runtime.tracing import extract_context

log = structlog.get_logger("endpoints")
tracer = trace.get_tracer("coordinator.endpoints")

Handler = Callable[[bytes], Awaitable[bytes | None]]
"""A request's reply; None: none from this request (another one answers its subject)."""

# The reply subject of the request being handled (each request runs in its own task), for a
# handler that sends more than one message back, such as a streamed route.
reply_subject: ContextVar[str] = ContextVar("reply_subject", default="")
# The subject a request came on: an endpoint on a wildcard subject reads its tokens.
request_subject: ContextVar[str] = ContextVar("request_subject", default="")

# An error's message in a reply: one that quotes the request (a bad id, say) must not make
# the reply as large as the request, nor its header longer than a header line should be.
MAX_ERROR_MESSAGE_CHARS: Final = 2000
MAX_ERROR_HEADER_CHARS: Final = 256

_encoder = msgspec.json.Encoder()

T = TypeVar("T")


def _utf8_error(body: bytes) -> str:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"at byte {exc.start}: {exc.reason}"
    return "a string in it is not"


# One decoder per request type: cheaper per call than `msgspec.json.decode`.
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}


def _decoder(kind: type[T]) -> msgspec.json.Decoder[T]:
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    return cast("msgspec.json.Decoder[T]", decoder)


def decode_body(body: bytes, kind: type[T], what: str) -> T:
    """``body`` decoded as ``kind``; every way it can be undecodable is a `BadRequest` that
    names ``what`` (``route request``, ``task query``...): malformed JSON, the wrong shape
    (msgspec's message names the field), a string that is not UTF-8 (naming the byte), and
    objects and arrays nested deeper than `schemas.route.MAX_NESTING`."""
    try:
        decoded = _decoder(kind).decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None
    except UnicodeDecodeError:
        # msgspec raises it for a string that is not UTF-8, with the offset in that string.
        raise BadRequest(f"{what} is not valid UTF-8 ({_utf8_error(body)})") from None
    except RecursionError:
        # msgspec stops at the interpreter's recursion limit (about a thousand levels).
        raise BadRequest(too_deep(what)) from None
    # Nesting deeper than MAX_NESTING needs more opening brackets than that (a bracket in a
    # string counts too, so this only ever walks more): most bodies are not walked at all.
    if body.count(b"{") + body.count(b"[") > MAX_NESTING:
        problem = nesting_problem(decoded, what)
        if problem is not None:
            raise BadRequest(problem)
    return decoded


def shortened(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked when cut."""
    return text if len(text) <= limit else f"{text[: limit - 1]}…"


def error_body(code: str, message: str) -> bytes:
    return _encoder.encode(ErrorBody(error=ErrorDetail(code=code, message=message)))


async def respond_error(request: Request, code: str, message: str) -> None:
    """Reply with the error body and the ``Nats-Service-Error(-Code)`` headers."""
    message = shortened(message, MAX_ERROR_MESSAGE_CHARS)
    # Header values cannot carry line breaks (nor, safely, any other control character).
    header = "".join(" " if ord(c) < 32 or ord(c) == 127 else c for c in message)
    await request.respond_error(
        code, shortened(header, MAX_ERROR_HEADER_CHARS), data=error_body(code, message)
    )


# NATS not serving a handler's own requests: no answer in time, nobody to answer, no
# JetStream leader, the connection down. Seen while a JetStream cluster elects a stream's
# leader (seconds) or a partition lasts; the same request may work moments later.
_BUS_FAILURES = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    ServiceUnavailableError,
)


def _failure(exc: Exception) -> tuple[str, str]:
    """The code and message of the error reply to a handler's exception. The bus failing the
    handler is ``unavailable`` (retryable: a client asks again), never ``internal``."""
    if isinstance(exc, CoordinatorError):
        return exc.code, exc.message
    if isinstance(exc, InvalidId):
        # An id that cannot be a subject token: the request's fault, whichever check found it.
        return exc.code, str(exc)
    if isinstance(exc, _BUS_FAILURES):
        return Unavailable.code, (
            f"NATS did not serve this request ({type(exc).__name__}): a JetStream leader "
            "being chosen, or a network fault; ask again"
        )
    return "internal", shortened(f"{type(exc).__name__}: {exc}", 200)


async def _answer(name: str, subject: str, handler: Handler, request: Request) -> None:
    """Handle one request in a span named ``name`` and reply: the handler's reply, or the
    error reply of what it raised."""
    # nats.micro's Request does not expose the reply subject; its message does.
    reply_to = request._msg.reply or ""
    reply_subject.set(reply_to)
    request_subject.set(request._msg.subject)
    with tracer.start_as_current_span(
        name,
        context=extract_context(request.headers),
        kind=trace.SpanKind.SERVER,
        attributes={"messaging.destination.name": subject},
    ) as span:
        try:
            reply = await handler(request.data)
        except Exception as exc:
            code, message = _failure(exc)
            if code == "internal":
                log.exception("endpoint failed", endpoint=name)
                span.set_status(trace.StatusCode.ERROR, repr(exc))
            span.set_attribute("coordinator.error_code", code)
        else:
            if not reply_to or reply is None:  # None: another request answers this one
                return
            try:
                await request.respond(reply)
                return
            except nats.errors.MaxPayloadError:
                code = TooLarge.code
                message = f"the reply is {len(reply)} bytes, over the NATS server's max_payload"
            span.set_attribute("coordinator.error_code", code)
        if not reply_to:
            return
        try:
            await respond_error(request, code, message)
        except Exception as exc:  # the connection, most likely: nobody left to tell
            log.warning("error reply failed", endpoint=name, code=code, error=repr(exc))


async def add_endpoint(
    service: Service, name: str, subject: str, handler: Handler, tasks: TaskSet
) -> None:
    """Serve ``subject`` with ``handler(body) -> reply``; a `CoordinatorError` (or an
    `InvalidId`) is an error reply with its code, any other exception ``internal``.

    Each request is handled in a span named ``name``, continuing the caller's trace when the
    request carries a ``traceparent`` header. A reply over the server's ``max_payload`` is
    the error ``too_large``; a request without a reply subject gets no answer.
    """

    async def on_request(request: Request) -> None:
        tasks.spawn(_answer(name, subject, handler, request), name=f"{name}-request")

    await service.add_endpoint(name=name, subject=subject, handler=on_request)


async def serve_subject(
    nc: Client, name: str, subject: str, handler: Handler, *, queue: str, tasks: TaskSet
) -> Subscription:
    """Serve ``subject`` as `add_endpoint` does, outside any micro service: a plain
    subscription in the queue group ``queue``, which the caller unsubscribes when this
    process stops serving it (what only one instance of a service answers at a time)."""

    async def on_msg(msg: Msg) -> None:
        tasks.spawn(_answer(name, subject, handler, Request(msg)), name=f"{name}-request")

    return await nc.subscribe(subject, queue=queue, cb=on_msg)
