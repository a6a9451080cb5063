"""The task API (``POST /route``, ``GET /task/{id}``): `RouteRequest` and `RouteReply` as they
are on the bus, and the project's own error body. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.route import ErrorBody, ErrorDetail, RouteReply, RouteRequest, StreamChunk
from services.gateway.common import check_limits, decode, encoder


def task_route(body: bytes) -> RouteRequest:
    """``POST /route``: the bus's own `RouteRequest` (unknown fields refused), within what a
    request may hold (`check_limits`; the router checks the rest)."""
    return check_limits(decode(body, RouteRequest, "route"))


def error_body(code: str, message: str) -> bytes:
    """The project's own error body: ``{"error": {"code", "message"}}``."""
    return encoder.encode(ErrorBody(error=ErrorDetail(code=code, message=message)))


@dataclass(frozen=True, slots=True)
class TaskShape:
    """``POST /route``: chunks and the reply as the bus has them (NDJSON when streamed); a
    failed task is a reply like any other (status ``failed``), not an HTTP error."""

    stream_type: str = "application/x-ndjson"
    start_on_accept: bool = True

    def piece(self, chunk: StreamChunk) -> bytes | None:
        return encoder.encode(chunk) + b"\n"

    def end(self, reply: RouteReply) -> bytes:
        return encoder.encode(reply) + b"\n"

    def whole(self, reply: RouteReply) -> bytes:
        return encoder.encode(reply)

    def error(self, status: int, code: str, message: str) -> bytes:
        return error_body(code, message)

    def stream_error(self, code: str, message: str) -> bytes:
        return error_body(code, message) + b"\n"
