"""The gateway's pure conversions shared by every API: conversations as text, images, output
formats, tool-call helpers, ``keep_alive``, error statuses, the task API."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.route import ChatMessage, ErrorDetail, RouteReply, ToolCall, failure_of
from services.errors import ConfigError, CoordinatorError, catalogue
from services.gateway import common, conversation
from services.gateway.common import ApiError
from services.gateway.settings import GatewaySettings
from services.gateway.task_api import TaskShape, task_route

DONE = RouteReply(task_id="t-1", status="done", queue="q", worker="cpu-1", response="42")


def body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


# -- conversations ------------------------------------------------------------------------------


def test_chat_prompt_is_pure_and_puts_system_first() -> None:
    lone = [ChatMessage(role="user", content="what is 2+2")]
    turns = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="assistant", content="hello"),
        ChatMessage(role="user", content="2+2?"),
    ]
    assert conversation.chat_prompt(lone) == "what is 2+2"
    assert conversation.chat_prompt(turns) == (
        "System: be brief\n\nUser: hi\n\nAssistant: hello\n\nUser: 2+2?\n\nAssistant:"
    )


def test_chat_prompt_shows_images_tool_calls_and_tool_results() -> None:
    call = ToolCall(name="weather", arguments={"city": "Paris"})
    turns = [
        ChatMessage(role="user", content="look", images=["aGk=", "aGk="]),
        ChatMessage(role="assistant", tool_calls=[call]),
        ChatMessage(role="tool", content="sunny", tool_name="weather"),
    ]
    assert conversation.chat_prompt(turns) == (
        "User: look [2 images]\n\n"
        'Assistant: [calls weather({"city":"Paris"})]\n\n'
        "Tool (weather): sunny\n\nAssistant:"
    )
    assert conversation.chat_prompt([ChatMessage(role="user", images=["aGk="])]) == "[1 image]"


def test_a_conversation_needs_something_said() -> None:
    image_only = [ChatMessage(role="user", images=["aGk="])]
    assert conversation.conversation(image_only)[1] == image_only
    with pytest.raises(ApiError) as refused:
        conversation.conversation([ChatMessage(role="user", content="  ")])
    assert refused.value.code == "bad_request"


def test_roles_are_read_as_ollama_reads_them() -> None:
    assert conversation.message("Developer", "x").role == "system"
    assert conversation.message("USER", "x").role == "user"
    with pytest.raises(ApiError):
        conversation.message("robot", "x")


def test_images_must_be_base64() -> None:
    assert conversation.check_images(["aGk="]) == ["aGk="]
    assert conversation.check_images([]) is None
    with pytest.raises(ApiError) as refused:
        conversation.check_images(["aGk=", "not base64!"], "messages[2].")
    assert refused.value.status == 400
    assert "messages[2].images[1] is not base64" in refused.value.message


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("", None), ("json", "json"), ({"type": "object"}, {"type": "object"})],
)
def test_output_formats(value: Any, expected: Any) -> None:
    assert conversation.output_format(value) == expected


@pytest.mark.parametrize("value", ["xml", 3, ["json"], True])
def test_other_formats_are_refused_in_ollamas_words(value: Any) -> None:
    with pytest.raises(ApiError) as refused:
        conversation.output_format(value)
    assert refused.value.status == 400
    assert refused.value.message.startswith("invalid format: ")
    assert refused.value.message.endswith('expected "json" or a valid JSON Schema object')


def test_tool_call_arguments_and_ids() -> None:
    assert conversation.arguments_of('{"a": 1}') == {"a": 1}
    assert conversation.arguments_of("[1, 2]") == "[1, 2]"  # not an object: the text stays
    assert conversation.arguments_of("not json") == "not json"
    call = ToolCall(name="f", arguments={"b": [1, "x"], "a": None})
    assert conversation.arguments_text(call) == '{"b":[1,"x"],"a":null}'  # the model's order
    assert conversation.arguments_text(ToolCall(name="f", arguments="raw")) == "raw"
    assert conversation.call_id(call, "t-1", 2) == "call_t-1_2"
    assert conversation.call_id(ToolCall(name="f", id="call_x"), "t-1", 2) == "call_x"


def test_an_embedding_route_is_one_waiting_task() -> None:
    route = conversation.embedding_route("m", ["a", "b"], timeout_s=9, truncate=False)
    assert (route.task_type, route.input, route.prompt) == ("embedding", ["a", "b"], "a\nb")
    assert (route.wait, route.stream, route.truncate, route.timeout_s) == (True, False, False, 9)
    with pytest.raises(ApiError):
        conversation.embedding_route(" ", ["a"], timeout_s=None)


# -- keep_alive ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "ns"),
    [
        (None, None),
        (0, 0),
        (0.0, 0),
        (1.5, 1_500_000_000),
        (-1, common.FOREVER_NS),
        ("0", 0),
        ("-0", 0),
        ("0s", 0),
        ("5m", 300_000_000_000),
        ("1h30m", 5_400_000_000_000),
        ("1.5s", 1_500_000_000),
        ("250ms", 250_000_000),
        ("-5m", common.FOREVER_NS),
    ],
)
def test_keep_alive_is_read_as_ollama_reads_it(value: Any, ns: int | None) -> None:
    assert common.keep_alive_ns(value) == ns
    assert common.keep_alive(value) == value  # passed on as the client gave it


@pytest.mark.parametrize("value", ["", "5", "5 m", "m", ".s", "5x", True, [1], {"s": 1}])
def test_a_bad_keep_alive_is_400(value: Any) -> None:
    with pytest.raises(ApiError) as refused:
        common.keep_alive(value)
    assert (refused.value.status, refused.value.code) == (400, "bad_request")


# -- statuses, limits, the log line's model -----------------------------------------------------


@pytest.mark.parametrize(
    ("code", "has_workers", "status"),
    [
        ("no_worker", True, 404),
        ("no_worker", False, 503),
        ("worker_unavailable", True, 503),
        ("no_alternative_worker", True, 503),
        ("invalid_id", True, 400),
        ("busy", True, 503),
        ("unavailable", True, 503),
        ("no_responder", True, 503),
        ("bad_request", True, 400),
        ("prompt_too_large", True, 400),
        ("unsupported_capability", True, 400),
        ("too_large", True, 413),
        ("not_found", True, 404),
        ("timeout", True, 504),
        ("something_new", True, 500),
    ],
)
def test_refusal_statuses(code: str, has_workers: bool, status: int) -> None:
    assert common.refusal_status(code, fleet_has_workers=has_workers) == status


def test_failed_tasks_are_upstream_errors() -> None:
    failure = ErrorDetail(code="backend_timeout", message="took 9 s")
    failed = RouteReply(
        task_id="t", status="failed", queue="q", worker="w", error=failure.summary, failure=failure
    )
    assert failure_of(failed) == failure
    assert common.failure_status("backend_timeout") == 504
    assert common.failure_status("backend_error") == 502
    assert common.failure_status("wake_timeout") == 503


def test_a_failed_reply_from_an_older_router_is_not_parsed() -> None:
    old = RouteReply(
        task_id="t", status="failed", queue="q", worker="w", error="backend_timeout: took 9 s"
    )
    assert failure_of(old) == ErrorDetail(code="failed", message="backend_timeout: took 9 s")
    assert common.failure_status(failure_of(old).code) == 502


def test_api_errors_belong_to_the_hierarchy_and_keep_their_code() -> None:
    error = ApiError(404, "no_worker", "model 'x' not found")
    assert isinstance(error, CoordinatorError)
    assert (error.status, error.code, error.message) == (404, "no_worker", "model 'x' not found")
    assert ApiError not in catalogue().values()  # it names no code of its own


def test_too_large_names_the_limit_and_its_variable() -> None:
    message = common.too_large(4 * 2**20, 5_000_000)
    assert "5000000 bytes" in message and "4194304 bytes" in message
    assert "4 MiB" in message and "GATEWAY_MAX_BODY_BYTES" in message


def test_the_body_limit_is_a_setting() -> None:
    assert GatewaySettings.from_env({}).gateway_max_body_bytes == 4 * 2**20
    small = GatewaySettings.from_env({"GATEWAY_MAX_BODY_BYTES": "1024"})
    assert small.gateway_max_body_bytes == 1024
    for bad in ("0", "lots"):
        with pytest.raises(ConfigError) as error:
            GatewaySettings.from_env({"GATEWAY_MAX_BODY_BYTES": bad})
        assert "GATEWAY_MAX_BODY_BYTES" in error.value.message


@pytest.mark.parametrize(
    ("raw", "model"),
    [(body(model="m"), "m"), (body(name="n"), "n"), (b"{oops", ""), (body(model=3), ""), (b"", "")],
)
def test_the_model_a_body_names(raw: bytes, model: str) -> None:
    assert common.model_named(raw) == model


def test_a_reply_without_vectors_is_the_workers_failure() -> None:
    with pytest.raises(ApiError) as failed:
        common.vectors(DONE)
    assert (failed.value.status, failed.value.code) == (502, "backend_error")


# -- the task API -------------------------------------------------------------------------------


def test_the_task_api_takes_the_bus_body_and_refuses_typos() -> None:
    assert task_route(body(prompt="p", model="m", wait=True)).wait
    with pytest.raises(ApiError):
        task_route(body(prompt="p", model="m", wiat=True))


def test_the_task_shape_is_the_bus_shape() -> None:
    shape = TaskShape()
    assert decode(shape.whole(DONE))["task_id"] == "t-1"
    assert decode(shape.error(400, "bad_request", "no")) == {
        "error": {"code": "bad_request", "message": "no"}
    }
