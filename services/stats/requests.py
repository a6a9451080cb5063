"""The stats endpoints' request bodies, read and checked. Pure.

Every refusal is a `BadRequest` naming what is wrong, so the endpoint replies with it as is.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import TypeVar

import msgspec

from schemas.queries import TaskQuery
from schemas.stats import ExcludeRequest
from schemas.subjects import InvalidId, check_token
from services.runtime.errors import BadRequest

W = TypeVar("W", bound=msgspec.Struct)


def decode_request(body: bytes, kind: type[W], what: str) -> W:
    """Decode a request body (empty means ``{}``); every refusal is a `BadRequest`."""
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"invalid {what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"{what} is not valid JSON: {exc}") from None


def parse_task_query(body: bytes) -> TaskQuery:
    """Decode a ``coordinator.task`` request; every refusal is a `BadRequest`."""
    try:
        query = msgspec.json.decode(body, type=TaskQuery)
    except msgspec.ValidationError as exc:
        raise BadRequest(f'invalid task query (expected {{"task_id": "..."}}): {exc}') from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"task query is not valid JSON: {exc}") from None
    if not query.task_id.strip():
        raise BadRequest("task_id must not be empty")
    return query


def check_exclusion(request: ExcludeRequest) -> None:
    """Raise `BadRequest` unless ``request`` describes a usable exclusion."""
    try:
        check_token("worker", request.worker)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if request.model is not None and not request.model.strip():
        raise BadRequest("model must not be empty (leave it out to exclude every model)")
    if not math.isfinite(request.since):
        raise BadRequest("since must be a time (epoch seconds)")
    if request.until is not None and not (
        math.isfinite(request.until) and request.until > request.since
    ):
        raise BadRequest("until must be later than since")
    if not request.reason.strip():
        raise BadRequest("give a reason: it is what the next operator will read")


def new_id(prefix: str) -> str:
    """Time-ordered, unique and safe as a subject token and a message id."""
    return f"{prefix}-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
