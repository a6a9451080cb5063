"""Request/reply endpoints on nats.micro, with the project's error shape.

nats.micro awaits one handler at a time per endpoint subscription, so a slow request (a route
with ``wait``) would hold up every other. Each request is therefore handled in its own task.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar

import msgspec
import structlog
from nats.micro.request import Request
from nats.micro.service import Service
from opentelemetry import trace

from schemas.route import ErrorBody, ErrorDetail
from services.runtime.errors import CoordinatorError
from services.runtime.lifecycle import TaskSet
from services.runtime.tracing import extract_context

log = structlog.get_logger("endpoints")
tracer = trace.get_tracer("coordinator.endpoints")

Handler = Callable[[bytes], Awaitable[bytes]]

# The reply subject of the request being handled (each request runs in its own task), for a
# handler that sends more than one message back, such as a streamed route.
reply_subject: ContextVar[str] = ContextVar("reply_subject", default="")

_encoder = msgspec.json.Encoder()


def error_body(code: str, message: str) -> bytes:
    return _encoder.encode(ErrorBody(error=ErrorDetail(code=code, message=message)))


async def respond_error(request: Request, code: str, message: str) -> None:
    """Reply with the error body and the ``Nats-Service-Error(-Code)`` headers."""
    # Header values cannot carry line breaks.
    await request.respond_error(
        code, message.replace("\r", " ").replace("\n", " "), data=error_body(code, message)
    )


async def add_endpoint(
    service: Service, name: str, subject: str, handler: Handler, tasks: TaskSet
) -> None:
    """Serve ``subject`` with ``handler(body) -> reply``; a `CoordinatorError` is an error reply.

    Each request is handled in a span named ``name``, continuing the caller's trace when the
    request carries a ``traceparent`` header.
    """

    async def run(request: Request) -> None:
        # nats.micro's Request does not expose the reply subject; its message does.
        reply_subject.set(request._msg.reply or "")
        with tracer.start_as_current_span(
            name,
            context=extract_context(request.headers),
            kind=trace.SpanKind.SERVER,
            attributes={"messaging.destination.name": subject},
        ) as span:
            try:
                reply = await handler(request.data)
            except CoordinatorError as exc:
                span.set_attribute("coordinator.error_code", exc.code)
                await respond_error(request, exc.code, exc.message)
            except Exception as exc:
                log.exception("endpoint failed", endpoint=name)
                span.set_status(trace.StatusCode.ERROR, repr(exc))
                await respond_error(request, "internal", f"{type(exc).__name__}: {exc}")
            else:
                await request.respond(reply)

    async def on_request(request: Request) -> None:
        tasks.spawn(run(request), name=f"{name}-request")

    await service.add_endpoint(name=name, subject=subject, handler=on_request)
