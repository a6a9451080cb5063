"""The error catalogue: every code defined once, and a (code, message) maps back to its class;
replies and views carry a failure as data, and old-shape JSON still decodes."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from schemas.queries import TaskView
from schemas.route import ErrorDetail, RouteReply, failure_of
from services import errors
from services.errors import (
    BadRequest,
    CoordinatorError,
    NoWorker,
    RemoteError,
    WorkerUnavailable,
    catalogue,
    from_code,
)
from services.runtime.endpoints import error_body
from services.runtime.request import raise_if_error

ROOT = Path(__file__).resolve().parents[2]


def defined_codes() -> list[tuple[str, str]]:
    """(code, where) of every class in ``services`` and ``schemas`` whose body says
    ``code = "..."``, read from the source (no service imported), so a code defined in two
    modules that no single process imports together is found too."""
    found: list[tuple[str, str]] = []
    paths = [p for d in ("services", "schemas") for p in (ROOT / d).rglob("*.py")]
    for path in sorted(paths):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            for statement in node.body:
                if (
                    isinstance(statement, ast.Assign)
                    and [getattr(t, "id", None) for t in statement.targets] == ["code"]
                    and isinstance(statement.value, ast.Constant)
                    and isinstance(statement.value.value, str)
                ):
                    where = f"{path.relative_to(ROOT)}:{node.name}"
                    found.append((statement.value.value, where))
    return found


def test_each_code_is_defined_once_in_the_tree() -> None:
    codes = defined_codes()
    assert len(codes) > 30
    where: dict[str, list[str]] = {}
    for code, place in codes:
        where.setdefault(code, []).append(place)
    assert {code: places for code, places in where.items() if len(places) > 1} == {}


def test_every_registered_code_maps_back_to_its_class() -> None:
    assert catalogue()["stopped"] is errors.StopRequested
    assert len(catalogue()) >= 28
    for code, cls in catalogue().items():
        error = from_code(code, "why")
        assert type(error) is cls, code
        assert (error.code, error.message) == (code, "why")


def test_every_error_class_of_the_module_is_catalogued_by_its_code() -> None:
    classes = [
        value
        for value in vars(errors).values()
        if isinstance(value, type) and issubclass(value, CoordinatorError)
    ]
    for cls in classes:
        if cls is RemoteError:
            continue  # it has no code of its own: it keeps the one it was given
        assert catalogue()[cls.code] is cls, cls


def test_an_unknown_code_keeps_its_code() -> None:
    error = from_code("something_new", "a newer service's error")
    assert isinstance(error, RemoteError) and isinstance(error, CoordinatorError)
    assert (error.code, error.message) == ("something_new", "a newer service's error")
    assert "something_new" not in catalogue()


def test_a_catalogued_code_is_its_class_and_its_parents() -> None:
    error = from_code("worker_unavailable", "worker 'mac' is not live")
    assert isinstance(error, WorkerUnavailable) and isinstance(error, NoWorker)
    assert isinstance(from_code("no_worker", "nobody"), NoWorker)


def test_a_code_cannot_be_defined_twice() -> None:
    with pytest.raises(TypeError, match="'no_worker' is defined twice"):

        class AnotherNoWorker(CoordinatorError):
            code = "no_worker"

    assert catalogue()["no_worker"] is NoWorker


def test_a_subclass_without_a_code_of_its_own_shares_its_parents() -> None:
    class Narrower(NoWorker):
        pass

    assert Narrower("x").code == "no_worker"
    assert catalogue()["no_worker"] is NoWorker


# -- failures as data on the wire -------------------------------------------------------------


def test_a_failed_reply_carries_code_and_message_apart() -> None:
    failure = ErrorDetail(code="backend_error", message="Ollama said: boom")
    reply = RouteReply(
        task_id="t", status="failed", queue="q", worker="w", error=failure.summary, failure=failure
    )
    decoded = msgspec.json.decode(msgspec.json.encode(reply), type=RouteReply)
    assert failure_of(decoded) == failure  # the ": " in the message is not a separator
    assert decoded.error == "backend_error: Ollama said: boom"


def test_an_old_shape_reply_without_failure_still_decodes() -> None:
    old = b'{"task_id": "t", "status": "failed", "queue": "q", "worker": "w", "error": "x: y"}'
    reply = msgspec.json.decode(old, type=RouteReply)
    assert (reply.failure, reply.error) == (None, "x: y")
    # Not parsed: the text was for people.
    assert failure_of(reply) == ErrorDetail(code="failed", message="x: y")


def test_an_old_shape_task_view_without_failure_still_decodes() -> None:
    old = (
        b'{"task_id": "t", "status": "failed", "model": "m", "created_at": 1.0, '
        b'"error": "backend_error: boom"}'
    )
    view = msgspec.json.decode(old, type=TaskView)
    assert (view.failure, view.error) == (None, "backend_error: boom")
    assert failure_of(view).message == "backend_error: boom"


def test_an_old_reader_ignores_the_new_field() -> None:
    class OldRouteReply(msgspec.Struct, kw_only=True):
        task_id: str
        status: str
        error: str | None = None

    failure = ErrorDetail(code="cancelled", message="client left")
    reply = RouteReply(
        task_id="t", status="failed", queue="q", worker="w", error=failure.summary, failure=failure
    )
    old = msgspec.json.decode(msgspec.json.encode(reply), type=OldRouteReply)
    assert old.error == "cancelled: client left"


def test_a_failure_without_a_message_is_its_code() -> None:
    assert ErrorDetail(code="failed", message="").summary == "failed"


# -- error replies raised as their class ------------------------------------------------------


def test_an_error_reply_is_raised_as_the_class_of_its_code() -> None:
    headers = {"Nats-Service-Error-Code": "no_worker", "Nats-Service-Error": "nobody"}
    with pytest.raises(NoWorker, match="no live worker serves model 'm'") as raised:
        raise_if_error(error_body("no_worker", "no live worker serves model 'm'"), headers)
    assert raised.value.code == "no_worker"


def test_an_error_reply_without_its_body_is_read_from_its_headers() -> None:
    headers = {"Nats-Service-Error-Code": "bad_request", "Nats-Service-Error": "no prompt"}
    with pytest.raises(BadRequest, match="no prompt"):
        raise_if_error(b"not json", headers)


def test_an_error_reply_of_an_unknown_code_keeps_it() -> None:
    headers = {"Nats-Service-Error-Code": "brand_new", "Nats-Service-Error": "hm"}
    with pytest.raises(RemoteError) as raised:
        raise_if_error(error_body("brand_new", "hm"), headers)
    assert (raised.value.code, raised.value.message) == ("brand_new", "hm")


def test_a_reply_that_is_no_error_passes() -> None:
    raise_if_error(b"{}", {})


def test_every_code_is_named_in_the_interface_pages() -> None:
    """A client or an operator meets each code somewhere (a reply, a task's failure, a
    service's last line, an HTTP answer): the pages that describe those, docs/interfaces.md
    and docs/gateway.md, name every one the catalogue defines."""

    def catalogue(cls: type[errors.CoordinatorError]) -> set[str]:
        own = {cls.__dict__["code"]} if "code" in cls.__dict__ else set()
        return own.union(*(catalogue(sub) for sub in cls.__subclasses__()))

    docs = Path(__file__).parents[2] / "docs"
    pages = (docs / "interfaces.md").read_text() + (docs / "gateway.md").read_text()
    missing = sorted(
        code for code in catalogue(errors.CoordinatorError) if f"`{code}`" not in pages
    )
    assert not missing, missing


def test_every_code_carries_its_http_statuses() -> None:
    """The gateway answers each code with its class's statuses, for every API it serves."""
    for code, cls in errors.catalogue().items():
        assert 400 <= cls.http_status < 600, code
        assert 500 <= cls.failed_http_status < 600, code
    assert errors.error_class("no_alternative_worker").http_status == 503
    assert errors.error_class("backend_timeout").failed_http_status == 504
    assert errors.error_class("a_code_from_a_newer_service") is errors.RemoteError
