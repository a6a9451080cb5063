"""The gateway's HTTP edge: request bodies read within the limit (and inflated, as their
``Content-Encoding`` says), error answers in the API's shape, the one ``request`` log line of
a request refused before (or without) routing, and the middleware that answers any other
failure in the API's shape too."""

from __future__ import annotations

import zlib
from typing import Final

import structlog
from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware

from services.errors import BadRequest, NotFound, TooLarge, Unsupported
from services.gateway.anthropic_answers import AnthropicShape
from services.gateway.common import ApiError, Shape, shown, too_large
from services.gateway.keys import api_of
from services.gateway.ollama_answers import OllamaShape
from services.gateway.openai_answers import OpenAIShape
from services.gateway.task_api import TaskShape

log = structlog.get_logger("gateway")

JSON: Final = "application/json"
NDJSON: Final = "application/x-ndjson"


# -- content encodings --------------------------------------------------------------------------

# The codings aiohttp's parser inflates itself when left to (its ``auto_decompress``, on by
# default): the header's value exactly. It refuses ``br`` and ``zstd`` itself, in plain text,
# unless their libraries are installed; any other value reaches the handler undecoded.
SERVER_DECODED: Final = frozenset({"gzip", "deflate", "br", "zstd"})
# The codings the gateway inflates itself when aiohttp does not (``auto_decompress=False``).
GATEWAY_DECODED: Final = frozenset({"gzip", "x-gzip", "deflate"})


def content_coding(header: str, decodable: frozenset[str]) -> str | None:
    """The content coding a ``Content-Encoding`` header names (None for none, or
    ``identity``); a 415 for one outside ``decodable``, or for more than one."""
    coding = header.strip().lower()
    if coding in ("", "identity"):
        return None
    if coding not in decodable:
        supported = ", ".join(sorted(decodable & GATEWAY_DECODED))
        raise ApiError(
            415,
            Unsupported.code,
            f"unsupported Content-Encoding {shown(header)}: send the body as it is, or "
            f"compressed with one of {supported}",
        )
    return coding


def decompress(body: bytes, coding: str, limit: int) -> bytes:
    """``body`` inflated from ``coding`` (`GATEWAY_DECODED`; deflate zlib-wrapped or raw, as
    clients send it): a 400 when it is not such data (a gzip header on a plain body), is cut
    short or has more after its end, a 413 when it inflates to more than ``limit`` bytes."""
    gzip = coding in ("gzip", "x-gzip")
    # A zlib stream's first byte names the deflate method (8) in its low four bits.
    wbits = 31 if gzip else 15 if body[:1] and body[0] & 0x0F == 8 else -15
    inflater = zlib.decompressobj(wbits)
    not_coded = f"the request body is not {coding} data, as its Content-Encoding header says"
    try:
        data = inflater.decompress(body, limit + 1)
    except zlib.error:
        raise ApiError(400, BadRequest.code, not_coded) from None
    if len(data) > limit:
        raise ApiError(413, TooLarge.code, f"{too_large(limit)} once decompressed")
    if not inflater.eof or inflater.unused_data:
        raise ApiError(400, BadRequest.code, f"{not_coded} (cut short, or more after its end)")
    return data


async def read_body(request: web.Request, limit: int, *, server_decompresses: bool = True) -> bytes:
    """The body, refused at once when its ``Content-Length`` is over ``limit`` (and when a
    chunked one grows over it), inflated as its ``Content-Encoding`` says.

    ``server_decompresses``: aiohttp inflated it already (its ``auto_decompress``, the
    default), and a body that is not what its header says is a payload error here; else the
    gateway inflates it (`decompress`), and refuses ``br`` and ``zstd`` in the API's shape
    (415) where aiohttp would have answered in plain text. Every refusal is an `ApiError`.
    """
    decodable = SERVER_DECODED if server_decompresses else GATEWAY_DECODED
    coding = content_coding(request.headers.get(hdrs.CONTENT_ENCODING, ""), decodable)
    length = request.content_length
    if length is not None and length > limit:
        raise ApiError(413, TooLarge.code, too_large(limit, length))
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        # aiohttp counts the inflated bytes: a compressed body is held to the same limit.
        raise ApiError(413, TooLarge.code, too_large(limit)) from None
    except web.RequestPayloadError:
        why = (
            f"the request body is not {coding} data, as its Content-Encoding header says"
            if coding is not None
            else "the request body could not be read whole"
        )
        # aiohttp drops the connection after a body it could not read: say so in the answer.
        raise ApiError(400, BadRequest.code, why, close=True) from None
    if coding is not None and not server_decompresses:
        body = decompress(body, coding, limit)
    return body


def error_response(shape: Shape, exc: ApiError, *, retry_after_s: int) -> web.Response:
    """``exc`` as ``shape`` writes errors, with ``Retry-After`` on a 503."""
    headers = {}
    if exc.status == 503:
        headers["Retry-After"] = str(retry_after_s)
    response = web.Response(
        status=exc.status,
        body=shape.error(exc.status, exc.code, exc.message),
        content_type=JSON,
        headers=headers,
    )
    if exc.close:
        response.force_close()
    return response


def refused(
    request: web.Request, shape: Shape, exc: ApiError, *, retry_after_s: int, model: str = ""
) -> web.Response:
    """The error answer to a request refused before (or without) routing, with its log line."""
    log.info("request", path=request.path, model=model, status=exc.status, code=exc.code)
    return error_response(shape, exc, retry_after_s=retry_after_s)


def shape_of(path: str) -> Shape:
    """The error shape of the API a path belongs to (`services.gateway.keys.api_of`)."""
    api = api_of(path)
    if api == "anthropic":
        return AnthropicShape(model="")
    if api == "openai":
        return OpenAIShape(model="", chat=True)
    if api == "task":
        return TaskShape()
    return OllamaShape(model="", chat=False)


def json_errors(*, retry_after_s: int) -> Middleware:
    """A middleware that answers what no handler answered in the API's shape: aiohttp's own
    errors (an unknown path, a wrong method) with their status, and an unexpected exception
    as a 500 with the code ``internal``, its traceback in the log and not in the answer."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = {404: NotFound.code, 413: TooLarge.code}.get(exc.status, BadRequest.code)
            error = ApiError(exc.status, code, exc.reason)
        except ApiError as exc:
            error = exc
        except Exception:
            log.exception("request failed", path=request.path)
            error = ApiError(500, "internal", "the gateway failed on this request (see its log)")
        log.info("request", path=request.path, status=error.status, code=error.code)
        return error_response(shape_of(request.path), error, retry_after_s=retry_after_s)

    return middleware
