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
from schemas.route import MAX_QUERY_ITEMS, count_problem
from schemas.stats import ExcludeRequest, time_problem
from schemas.subjects import InvalidId, check_token
from services.errors import BadRequest
from services.runtime.endpoints import decode_body

W = TypeVar("W", bound=msgspec.Struct)


def decode_request(body: bytes, kind: type[W], what: str) -> W:
    """Decode a request body (empty means ``{}``); every refusal is a `BadRequest`
    (`decode_body`, `check_fields`)."""
    request = decode_body(body or b"{}", kind, what)
    check_fields(request)
    return request


def check_fields(request: msgspec.Struct) -> None:
    """Raise `BadRequest` for a field PostgreSQL would refuse or that would cost a query per
    entry beyond reason: a text holding NUL (PostgreSQL's text cannot), a number that is not
    finite, a list of more than `MAX_QUERY_ITEMS` entries. What a number means is each
    request's own check (`check_exclusion`)."""
    for name in request.__struct_fields__:
        value = getattr(request, name)
        values = value if isinstance(value, list) else [value]
        problem = count_problem(name, len(values), MAX_QUERY_ITEMS)
        if problem is not None:
            raise BadRequest(problem)
        if any(isinstance(text, str) and "\x00" in text for text in values):
            raise BadRequest(f"{name} must not hold NUL characters (PostgreSQL cannot store them)")
        if any(isinstance(number, float) and not math.isfinite(number) for number in values):
            raise BadRequest(f"{name} must be a finite number")


def parse_task_query(body: bytes) -> TaskQuery:
    """Decode a ``coordinator.task`` request; every refusal is a `BadRequest`. A task id is
    a subject token (`schemas.subjects.task_event`), so anything else names no task."""
    try:
        query = decode_body(body, TaskQuery, "task query")
    except BadRequest as exc:
        raise BadRequest(f'{exc.message} (expected {{"task_id": "..."}})') from None
    if not query.task_id.strip():
        raise BadRequest("task_id must not be empty")
    try:
        check_token("task_id", query.task_id)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    return query


def check_exclusion(request: ExcludeRequest) -> None:
    """Raise `BadRequest` unless ``request`` describes a usable exclusion."""
    try:
        check_token("worker", request.worker)
    except InvalidId as exc:
        raise BadRequest(str(exc)) from None
    if request.model is not None and not request.model.strip():
        raise BadRequest("model must not be empty (leave it out to exclude every model)")
    for name, at in (("since", request.since), ("until", request.until)):
        problem = None if at is None else time_problem(name, at)
        if problem is not None:
            raise BadRequest(problem)
    if request.until is not None and request.until <= request.since:
        raise BadRequest("until must be later than since")
    if not request.reason.strip():
        raise BadRequest("give a reason: it is what the next operator will read")


def new_id(prefix: str) -> str:
    """Time-ordered, unique and safe as a subject token and a message id."""
    return f"{prefix}-{time.time_ns():x}-{uuid.uuid4().hex[:8]}"
