"""The gateway's pure conversions: API bodies to route requests, replies to API bodies,
error codes to statuses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.measures import Durations, Tokens
from schemas.queries import WorkerView
from schemas.route import ChatMessage, RouteReply, StreamChunk
from services.gateway import convert
from services.gateway.convert import ApiError, Ask, OllamaShape, OpenAIShape, Preload, TaskShape


def body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


def routed(ask: Ask | Preload) -> Ask:
    """A request that becomes a task (not a preload)."""
    assert isinstance(ask, Ask)
    return ask


DONE = RouteReply(
    task_id="t-1",
    status="done",
    queue="tasks.cpu.cpu-1",
    worker="cpu-1",
    response="42",
    thinking="six sevens",
    durations=Durations(total_ms=12.5, load_ms=1.0, prompt_eval_ms=2.0, eval_ms=8.0),
    tokens=Tokens(prompt=5, eval=3),
)


# -- requests ------------------------------------------------------------------------------------


def test_generate_becomes_a_waiting_streamed_route_request() -> None:
    ask = routed(
        convert.ollama_generate(
            body(model="m", prompt="hi", options={"temperature": 0}, think=False), timeout_s=30
        )
    )
    assert ask.stream  # Ollama streams unless told not to
    route = ask.route
    assert (route.prompt, route.model, route.wait, route.stream) == ("hi", "m", True, True)
    assert route.options == {"temperature": 0}
    assert route.think is False
    assert route.timeout_s == 30
    assert route.messages is None


def test_a_system_prompt_makes_generate_a_conversation() -> None:
    route = routed(
        convert.ollama_generate(
            body(model="m", prompt="hi", system="be brief", stream=False), timeout_s=None
        )
    ).route
    assert route.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]
    assert route.prompt == "System: be brief\n\nUser: hi\n\nAssistant:"


def test_chat_prompt_is_pure_and_puts_system_first() -> None:
    lone = [ChatMessage(role="user", content="what is 2+2")]
    turns = [
        ChatMessage(role="user", content="hi"),
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="assistant", content="hello"),
        ChatMessage(role="user", content="2+2?"),
    ]
    assert convert.chat_prompt(lone) == "what is 2+2"
    assert convert.chat_prompt(turns) == (
        "System: be brief\n\nUser: hi\n\nAssistant: hello\n\nUser: 2+2?\n\nAssistant:"
    )


def test_openai_chat_maps_sampling_and_roles() -> None:
    ask = convert.openai_chat(
        body(
            model="m",
            messages=[
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            max_tokens=10,
            temperature=0.5,
            stop="END",
            stream=True,
            stream_options={"include_usage": True},
            reasoning_effort="low",
        ),
        timeout_s=None,
    )
    assert ask.stream and ask.include_usage
    assert ask.route.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="ab"),
    ]
    assert ask.route.options == {"temperature": 0.5, "stop": ["END"], "num_predict": 10}
    assert ask.route.think == "low"


def test_openai_completion_takes_one_prompt() -> None:
    ask = convert.openai_completion(body(model="m", prompt=["only"]), timeout_s=None)
    assert ask.route.prompt == "only" and not ask.stream
    with pytest.raises(ApiError) as refused:
        convert.openai_completion(body(model="m", prompt=["a", "b"]), timeout_s=None)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("parse", "raw", "code"),
    [
        (convert.ollama_generate, b"{nope", "bad_request"),
        (convert.ollama_generate, body(prompt="no model"), "bad_request"),
        (convert.ollama_generate, body(model="m", prompt="  "), "bad_request"),
        (convert.ollama_generate, body(model="m", prompt="x", images=["aGk="]), "unsupported"),
        (convert.ollama_generate, body(model="m", prompt="x", format="json"), "unsupported"),
        (convert.ollama_generate, body(prompt=""), "bad_request"),  # a preload needs a model too
        (convert.ollama_generate, body(model="m", prompt="", keep_alive="5"), "bad_request"),
        (
            convert.ollama_chat,
            body(model="m", messages=[{"role": "user", "content": " "}]),
            "bad_request",
        ),
        (convert.ollama_chat, body(messages=None), "bad_request"),
        (
            convert.ollama_chat,
            body(model="m", messages=[{"role": "robot", "content": "x"}]),
            "bad_request",
        ),
        (
            convert.ollama_chat,
            body(model="m", messages=[{"role": "user"}], tools=[{}]),
            "unsupported",
        ),
        (convert.openai_chat, body(model="m", messages="hi"), "bad_request"),
        (
            convert.openai_chat,
            body(model="m", messages=[{"role": "user", "content": "x"}], n=2),
            "unsupported",
        ),
        (
            convert.openai_chat,
            body(model="m", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
            "unsupported",
        ),
    ],
)
def test_bad_or_unsupported_bodies_are_400(parse: Any, raw: bytes, code: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(raw, timeout_s=None)
    assert (refused.value.status, refused.value.code) == (400, code)


def test_the_task_api_takes_the_bus_body_and_refuses_typos() -> None:
    assert convert.task_route(body(prompt="p", model="m", wait=True)).wait
    with pytest.raises(ApiError):
        convert.task_route(body(prompt="p", model="m", wiat=True))


# -- statuses ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "has_workers", "status"),
    [
        ("no_worker", True, 404),
        ("no_worker", False, 503),
        ("worker_unavailable", True, 503),
        ("unavailable", True, 503),
        ("no_responder", True, 503),
        ("bad_request", True, 400),
        ("prompt_too_large", True, 400),
        ("not_found", True, 404),
        ("timeout", True, 504),
        ("something_new", True, 500),
    ],
)
def test_refusal_statuses(code: str, has_workers: bool, status: int) -> None:
    assert convert.refusal_status(code, fleet_has_workers=has_workers) == status


def test_failed_tasks_are_upstream_errors() -> None:
    failed = RouteReply(
        task_id="t", status="failed", queue="q", worker="w", error="backend_timeout: took 9 s"
    )
    assert convert.failure_of(failed) == ("backend_timeout", "took 9 s")
    assert convert.failure_status("backend_timeout") == 504
    assert convert.failure_status("backend_error") == 502
    assert convert.failure_status("wake_timeout") == 503


# -- shapes --------------------------------------------------------------------------------------


def test_ollama_shapes_carry_thinking_and_figures() -> None:
    generate = OllamaShape(model="asked", chat=False)
    chat = OllamaShape(model="asked", chat=True)

    whole = decode(generate.whole(DONE))
    assert (whole["response"], whole["thinking"], whole["done"]) == ("42", "six sevens", True)
    assert whole["model"] == "asked"
    assert whole["total_duration"] == 12_500_000 and whole["eval_count"] == 3
    assert decode(chat.whole(DONE))["message"] == {
        "role": "assistant",
        "content": "42",
        "thinking": "six sevens",
    }
    piece = chat.piece(StreamChunk(task_id="t-1", seq=2, thinking="hmm"))
    assert piece is not None and decode(piece)["message"]["thinking"] == "hmm"
    assert chat.piece(StreamChunk(task_id="t-1", seq=0)) is None  # the accept notice
    assert decode(generate.end(DONE))["response"] == ""
    assert decode(generate.error(404, "no_worker", "model 'x' not found")) == {
        "error": "model 'x' not found"
    }


def test_openai_shapes_use_reasoning_and_the_task_id() -> None:
    chat = OpenAIShape(model="asked", chat=True, include_usage=True, created=7)
    whole = decode(chat.whole(DONE))
    assert whole["id"] == "chatcmpl-t-1" and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["reasoning"] == "six sevens"
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}

    piece = chat.piece(StreamChunk(task_id="t-1", seq=1, response="4"))
    assert piece is not None and piece.startswith(b"data: ")
    assert decode(piece[6:])["choices"][0]["delta"]["content"] == "4"
    ending = chat.end(DONE).split(b"\n\n")
    assert ending[-2] == b"data: [DONE]"
    assert decode(ending[1][6:])["usage"]["total_tokens"] == 8

    legacy = OpenAIShape(model="asked", chat=False)
    assert legacy.piece(StreamChunk(task_id="t", seq=1, thinking="x")) is None  # dropped
    assert decode(legacy.whole(DONE))["choices"][0]["text"] == "42"
    assert decode(chat.error(503, "no_worker", "busy"))["error"] == {
        "message": "busy",
        "type": "api_error",
        "param": None,
        "code": "no_worker",
    }


def test_the_task_shape_is_the_bus_shape() -> None:
    shape = TaskShape()
    assert decode(shape.whole(DONE))["task_id"] == "t-1"
    assert decode(shape.error(400, "bad_request", "no")) == {
        "error": {"code": "bad_request", "message": "no"}
    }


# -- the fleet as model lists ----------------------------------------------------------------------


def worker(worker_id: str, models: list[str], **fields: Any) -> WorkerView:
    defaults: dict[str, Any] = {"host": "h", "tier": "cpu", "state": "idle", "last_heartbeat": 1e9}
    return WorkerView(worker_id=worker_id, models=models, **{**defaults, **fields})


def test_tags_and_models_are_the_union_of_live_inference_workers() -> None:
    fleet = [
        worker("a", ["m1", "m2"]),
        worker("b", ["m2", "m3"], tier="gpu"),
        worker("web-1", ["summary"], tier="web"),
    ]
    tags = decode(convert.ollama_tags(fleet))["models"]
    assert [t["name"] for t in tags] == ["m1", "m2", "m3"]
    assert tags[1]["workers"] == ["a", "b"]
    assert [m["id"] for m in decode(convert.openai_models(fleet))["data"]] == ["m1", "m2", "m3"]


def test_ps_lists_what_busy_workers_run() -> None:
    fleet = [
        worker("a", ["m1"], state="busy", current_task="t", current_model="m1"),
        worker("b", ["m1", "m2"], state="busy", current_task="u", current_model="m1"),
        worker("c", ["m2"]),
    ]
    running = decode(convert.ollama_ps(fleet))["models"]
    assert [(m["name"], m["workers"]) for m in running] == [("m1", ["a", "b"])]
    assert running[0]["expires_at"].endswith("Z")


# -- Ollama's model management ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (body(model="m", prompt=""), Preload(model="m", chat=False, unload=False)),
        (body(model="m"), Preload(model="m", chat=False, unload=False)),
        (body(model="m", system="be brief"), Preload(model="m", chat=False, unload=False)),
        (body(model="m", prompt="", keep_alive=0), Preload(model="m", chat=False, unload=True)),
        (body(model="m", keep_alive="0s"), Preload(model="m", chat=False, unload=True)),
        (body(model="m", keep_alive="500ms"), Preload(model="m", chat=False, unload=False)),
        (body(model="m", keep_alive=-1), Preload(model="m", chat=False, unload=False)),
    ],
)
def test_an_empty_prompt_is_a_preload(raw: bytes, expected: Preload) -> None:
    assert convert.ollama_generate(raw, timeout_s=None) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (body(model="m", messages=[]), Preload(model="m", chat=True, unload=False)),
        # Ollama's CLI: ``"messages": null`` and a Go duration.
        (body(model="m", messages=None), Preload(model="m", chat=True, unload=False)),
        (body(model="m", keep_alive="0s"), Preload(model="m", chat=True, unload=True)),
        # Ollama's chat compares whole seconds.
        (body(model="m", keep_alive="500ms"), Preload(model="m", chat=True, unload=True)),
        (body(model="m", keep_alive="5m"), Preload(model="m", chat=True, unload=False)),
    ],
)
def test_a_chat_without_messages_is_a_preload(raw: bytes, expected: Preload) -> None:
    assert convert.ollama_chat(raw, timeout_s=None) == expected


@pytest.mark.parametrize(
    ("value", "ns"),
    [
        (None, None),
        (0, 0),
        (0.0, 0),
        (1.5, 1_500_000_000),
        (-1, convert.FOREVER_NS),
        ("0", 0),
        ("-0", 0),
        ("0s", 0),
        ("5m", 300_000_000_000),
        ("1h30m", 5_400_000_000_000),
        ("1.5s", 1_500_000_000),
        ("250ms", 250_000_000),
        ("-5m", convert.FOREVER_NS),
    ],
)
def test_keep_alive_is_read_as_ollama_reads_it(value: Any, ns: int | None) -> None:
    assert convert.keep_alive_ns(value) == ns


@pytest.mark.parametrize("value", ["", "5", "5 m", "m", ".s", "5x", True, [1], {"s": 1}])
def test_a_bad_keep_alive_is_400(value: Any) -> None:
    with pytest.raises(ApiError) as refused:
        convert.keep_alive_ns(value)
    assert (refused.value.status, refused.value.code) == (400, "bad_request")


def test_show_and_pull_name_the_model_by_model_or_name() -> None:
    assert convert.ollama_model_request(body(model="m"), "show").model == "m"
    # Ollama's CLI sends both fields, one empty.
    cli = convert.ollama_model_request(body(model="", name="m", options=None), "show")
    assert cli == convert.ModelAsk(model="m", stream=True)
    assert not convert.ollama_model_request(body(name="m", stream=False), "pull").stream
    assert convert.ollama_model_request(body(model="m", stream=None), "pull").stream
    for raw in (body(), body(model="", name=""), b"", b"[]"):
        with pytest.raises(ApiError) as refused:
            convert.ollama_model_request(raw, "show")
        assert refused.value.status == 400


def test_the_workers_serving_a_model_or_why_none_does() -> None:
    fleet = [worker("a", ["m1"]), worker("b", ["m1", "m2"]), worker("web-1", ["s"], tier="web")]
    assert [w.worker_id for w in convert.workers_serving("m1", fleet)] == ["a", "b"]

    with pytest.raises(ApiError) as unknown:
        convert.workers_serving("nope", fleet)
    assert (unknown.value.status, unknown.value.message) == (404, "model 'nope' not found")
    with pytest.raises(ApiError) as web_only:
        convert.workers_serving("s", fleet)  # web-search workers take no inference tasks
    assert web_only.value.status == 404
    with pytest.raises(ApiError) as pulled:
        convert.workers_serving("nope", fleet, pull=True)
    assert pulled.value.status == 404
    assert "cannot pull" in pulled.value.message and "/api/tags" in pulled.value.message
    with pytest.raises(ApiError) as empty:
        convert.workers_serving("m1", [worker("web-1", ["s"], tier="web")])
    assert (empty.value.status, empty.value.code) == (503, "no_worker")


def test_show_is_in_ollamas_shape() -> None:
    shown = decode(convert.ollama_show("m1", [worker("a", ["m1"]), worker("b", ["m1"])]))
    assert shown["details"] == {
        "parent_model": "",
        "format": "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }
    assert shown["capabilities"] == ["completion"]
    assert shown["model_info"] == {"general.architecture": ""}
    assert (shown["template"], shown["parameters"]) == ("", "")
    assert shown["modelfile"].endswith("FROM m1\n") and "a, b" in shown["modelfile"]
    assert shown["modified_at"].endswith("Z")
    assert shown["workers"] == ["a", "b"]


def test_pull_succeeds_at_once() -> None:
    lines = convert.ollama_pull(stream=True).splitlines()
    assert [decode(line) for line in lines] == [
        {"status": "pulling manifest"},
        {"status": "success"},
    ]
    assert decode(convert.ollama_pull(stream=False)) == {"status": "success"}


def test_a_preload_is_answered_in_ollamas_shape() -> None:
    loaded = decode(convert.ollama_preload(Preload(model="m", chat=False, unload=False), at=0))
    assert loaded == {
        "model": "m",
        "created_at": "1970-01-01T00:00:00.000000Z",
        "response": "",
        "done": True,
        "done_reason": "load",
    }
    unloaded = decode(convert.ollama_preload(Preload(model="m", chat=True, unload=True)))
    assert unloaded["message"] == {"role": "assistant", "content": ""}
    assert unloaded["done_reason"] == "unload" and "response" not in unloaded
