"""The gateway's HTTP edge: request bodies read within the limit, error answers in the API's
shape, and the one ``request`` log line of a request refused before (or without) routing."""

from __future__ import annotations

from typing import Final

import structlog
from aiohttp import web

from services.gateway.common import ApiError, Shape, too_large
from services.runtime.errors import TooLarge

log = structlog.get_logger("gateway")

JSON: Final = "application/json"
NDJSON: Final = "application/x-ndjson"


async def read_body(request: web.Request, limit: int) -> bytes:
    """The body, refused at once when its ``Content-Length`` is over ``limit`` (and when a
    chunked one grows over it)."""
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, TooLarge.code, too_large(limit, length))
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, TooLarge.code, too_large(limit)) from None


def error_response(shape: Shape, exc: ApiError, *, retry_after_s: int) -> web.Response:
    """``exc`` as ``shape`` writes errors, with ``Retry-After`` on a 503."""
    headers = {}
    if exc.status == 503:
        headers["Retry-After"] = str(retry_after_s)
    return web.Response(
        status=exc.status,
        body=shape.error(exc.status, exc.code, exc.message),
        content_type=JSON,
        headers=headers,
    )


def refused(
    request: web.Request, shape: Shape, exc: ApiError, *, retry_after_s: int, model: str = ""
) -> web.Response:
    """The error answer to a request refused before (or without) routing, with its log line."""
    log.info("request", path=request.path, model=model, status=exc.status, code=exc.code)
    return error_response(shape, exc, retry_after_s=retry_after_s)
