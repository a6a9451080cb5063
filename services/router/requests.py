"""What the router accepts: route and cancel requests decoded and checked. Pure: no I/O.

Every refusal is a `BadRequest` (or one of its kinds) with a message that says what to send
instead; nothing here reads the fleet.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from schemas.models import EMBEDDING
from schemas.queries import WorkersQuery
from schemas.route import (
    MAX_TIMEOUT_S,
    CancelRequest,
    RouteRequest,
    image_problem,
    request_problem,
)
from schemas.subjects import InvalidId, check_token
from services.errors import BadRequest, PromptTooLarge, TooLarge
from services.runtime.endpoints import decode_body

# What a task message and the ``submitted`` event add to the request itself (ids, times,
# subjects, headers), so the size check leaves room for them.
TASK_OVERHEAD_BYTES: Final = 4096

_encoder = msgspec.json.Encoder()

# A client's own task id: a subject token (`new_task_id`'s ids are 30 characters).
_TASK_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def conversation_chars(request: RouteRequest) -> int:
    """The characters ``MAX_PROMPT_CHARS`` counts: the whole conversation (its text, or every
    message's), the suffix and every embedding input, not only ``prompt``."""
    messages = sum(len(m.content) for m in request.messages or ())
    inputs = sum(len(text) for text in request.input or ())
    return max(len(request.prompt), messages, inputs) + len(request.suffix or "")


def _check_images(images: list[str] | None, where: str) -> None:
    problem = image_problem(images, where)
    if problem is not None:
        raise BadRequest(problem)


def _check_tools(tools: list[dict[str, Any]] | None) -> None:
    for index, tool in enumerate(tools or ()):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f'tools[{index}] must be {{"type": "function", "function": {{...}}}}')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"tools[{index}].function.name must be a non-empty string")


def parse_route_request(body: bytes, max_prompt_chars: int) -> RouteRequest:
    """Decode and check a route request; every refusal is a `BadRequest` with a clear message
    (undecodable bodies: `decode_body`; counts over their caps: `request_problem`)."""
    request = decode_body(body, RouteRequest, "route request")
    problem = request_problem(request)
    if problem is not None:
        raise BadRequest(problem)
    if request.task_type == "model_change" or request.change is not None:
        request = _model_change(request)
    elif request.task_type == "embedding":
        if not request.input:
            raise BadRequest("an embedding request needs input: a non-empty list of texts")
        if not request.prompt:
            # The inputs as one text: what statistics and `coordinator task` show.
            request = msgspec.structs.replace(request, prompt="\n".join(request.input))
    elif request.input is not None:
        raise BadRequest("input is for embedding requests (task_type 'embedding') only")
    elif not request.prompt.strip():
        raise BadRequest("prompt must not be empty")
    chars = conversation_chars(request)
    if chars > max_prompt_chars:
        raise PromptTooLarge(
            f"the request holds {chars} characters of text, over the limit of "
            f"{max_prompt_chars} (MAX_PROMPT_CHARS, counted over the whole conversation)"
        )
    if not request.model.strip():
        raise BadRequest("model must not be empty")
    if request.messages is not None and not request.messages:
        raise BadRequest("messages, when given, must hold at least one message")
    if request.timeout_s is not None and not (0 < request.timeout_s <= MAX_TIMEOUT_S):
        raise BadRequest(
            f"timeout_s must be a positive number of seconds up to {MAX_TIMEOUT_S:g} (a day), "
            f"got {request.timeout_s}"
        )
    if request.dimensions is not None and request.dimensions <= 0:
        raise BadRequest(f"dimensions must be a positive number, got {request.dimensions}")
    _check_images(request.images, "")
    for index, message in enumerate(request.messages or ()):
        _check_images(message.images, f"messages[{index}].")
    _check_tools(request.tools)
    try:
        if request.worker is not None:
            check_token("worker", request.worker)
        if request.domain is not None:
            check_token("domain", request.domain)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if request.task_id is not None and not _TASK_ID.fullmatch(request.task_id):
        raise BadRequest(
            "task_id must be 1 to 64 letters, digits, '-' or '_' (a client's own id for its "
            f"task), got {request.task_id[:80]!r}"
        )
    return request


def _model_change(request: RouteRequest) -> RouteRequest:
    """A change to one machine's models: the change, on the worker named, with its prompt
    saying what it is when the client gave none (statistics and `coordinator task` show it)."""
    change = request.change
    if request.task_type != "model_change" or change is None:
        raise BadRequest("a change to models is task_type 'model_change' with its change")
    if request.worker is None:
        raise BadRequest("a change to models names the machine it is for (worker)")
    if change.op in ("copy", "create") and not change.source:
        raise BadRequest(
            f"a {change.op} names the model it starts from (change.source: "
            f"{'the model copied' if change.op == 'copy' else 'FROM'})"
        )
    if change.size is not None and change.size < 0:
        raise BadRequest(f"change.size must not be negative, got {change.size}")
    if request.prompt.strip():
        return request
    source = f" from {change.source}" if change.source else ""
    return msgspec.structs.replace(request, prompt=f"{change.op} {request.model}{source}")


def as_routed(request: RouteRequest, model: str) -> RouteRequest:
    """The request as it is routed: under the canonical name of its model (requests,
    registrations and statistics all use it, lesson 6), and an embedding's in the embedding
    domain unless it names one (embeddings have figures of their own)."""
    routed = msgspec.structs.replace(request, model=model)
    if routed.task_type == "embedding" and routed.domain is None:
        routed = msgspec.structs.replace(routed, domain=EMBEDDING)
    return routed


def check_size(request_bytes: int, max_payload: int) -> None:
    """Refuse a request whose task message would not fit in one NATS message, instead of
    failing on publish: images and long conversations are megabytes. The task is the
    request as it is routed (``request_bytes`` encoded, which may be more than the body
    was: ``1e9`` is ``1000000000.0`` once decoded) plus ids and times, which
    `TASK_OVERHEAD_BYTES` bounds."""
    size = request_bytes + TASK_OVERHEAD_BYTES
    if size > max_payload:
        raise TooLarge(
            f"the request is {size} bytes as a task, over the NATS server's max_payload of "
            f"{max_payload} bytes; send fewer or smaller images, or raise max_payload on every "
            "server (the shipped configuration has 8MB)"
        )


@dataclass(frozen=True, slots=True)
class Admitted:
    """A route request accepted: as the client named its model, and as it is routed."""

    asked_model: str
    routed: RouteRequest


def admit(
    body: bytes, *, max_prompt_chars: int, max_payload: int, resolve: Callable[[str], str]
) -> Admitted:
    """The request checked (`parse_route_request`), under the canonical name ``resolve``
    gives its model (`as_routed`), and small enough for one NATS message (`check_size`)."""
    asked = parse_route_request(body, max_prompt_chars)
    # A change to models names a model as the machine has it, or will: never an alias's.
    model = asked.model if asked.task_type == "model_change" else resolve(asked.model)
    routed = as_routed(asked, model)
    check_size(max(len(body), len(_encoder.encode(routed))), max_payload)
    return Admitted(asked_model=asked.model, routed=routed)


def parse_workers_query(body: bytes) -> WorkersQuery:
    """Decode a workers query (an empty body is ``{}``)."""
    return decode_body(body.strip() or b"{}", WorkersQuery, "workers query")


def parse_cancel_request(body: bytes) -> CancelRequest:
    """Decode a cancel request, which names either a task or a waiting reply subject."""
    request = decode_body(body, CancelRequest, "cancel request")
    if (request.task_id is None) == (request.reply_to is None):
        raise BadRequest("a cancel request names either task_id or reply_to")
    return request
