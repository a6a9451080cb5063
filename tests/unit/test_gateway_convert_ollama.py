"""Ollama's API through the gateway: bodies to route requests, replies to Ollama's answers."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from schemas.measures import Durations, Tokens
from schemas.route import ChatMessage, RouteReply, StreamChunk, ToolCall
from schemas.vectors import pack
from services.gateway.common import ApiError, Ask, Instant
from services.gateway.ollama_answers import OllamaEmbedShape, OllamaShape, ollama_pull
from services.gateway.ollama_api import (
    EmptyEmbed,
    ModelAsk,
    Preload,
    ollama_chat,
    ollama_embed,
    ollama_embeddings,
    ollama_generate,
    ollama_model_request,
)

IMAGE = base64.b64encode(b"\x89PNG fake").decode()
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
CALL = ToolCall(name="weather", arguments={"city": "Paris"})


def body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


def routed(ask: Ask | Instant) -> Ask:
    """A request that becomes a task (not answered at once)."""
    assert isinstance(ask, Ask)
    return ask


# -- generate and chat --------------------------------------------------------------------------


def test_generate_carries_every_field_unchanged() -> None:
    options = {"temperature": 0, "num_ctx": 8192, "mirostat": 2, "stop": ["\n"]}
    ask = routed(
        ollama_generate(
            body(
                model="m",
                prompt="hi",
                options=options,
                think="high",
                images=[IMAGE],
                format={"type": "object"},
                keep_alive="10m",
                suffix="end",
                template="",  # what Go's client sends when unset
                raw=False,
            ),
            timeout_s=30,
        )
    )
    route = ask.route
    assert ask.stream  # Ollama streams unless told not to
    assert (route.prompt, route.model, route.wait, route.timeout_s) == ("hi", "m", True, 30)
    assert route.options == options
    assert (route.think, route.images, route.format) == ("high", [IMAGE], {"type": "object"})
    assert (route.keep_alive, route.suffix, route.messages) == ("10m", "end", None)


def test_a_system_prompt_makes_generate_a_conversation() -> None:
    route = routed(
        ollama_generate(
            body(model="m", prompt="hi", system="be brief", stream=False, images=[IMAGE]),
            timeout_s=None,
        )
    ).route
    assert route.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi", images=[IMAGE]),
    ]
    assert route.prompt == "System: be brief\n\nUser: hi [1 image]\n\nAssistant:"
    assert route.images is None


def test_chat_carries_tools_images_and_tool_turns() -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    messages = [
        {"role": "user", "content": "weather?", "images": [IMAGE]},
        {
            "role": "assistant",
            "content": "",
            "thinking": "I should call it",  # accepted, not carried
            "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "weather"},
    ]
    route = routed(
        ollama_chat(
            body(model="m", messages=messages, tools=tools, format="json", keep_alive=60),
            timeout_s=None,
        )
    ).route
    assert route.tools == tools and route.format == "json" and route.keep_alive == 60
    assert route.messages == [
        ChatMessage(role="user", content="weather?", images=[IMAGE]),
        ChatMessage(role="assistant", tool_calls=[CALL]),
        ChatMessage(role="tool", content="sunny", tool_name="weather"),
    ]


def test_open_webuis_tool_calls_carry_their_ids() -> None:
    """Open WebUI (utils/payload.py, convert_messages_openai_to_ollama) puts ``index`` and
    ``id`` beside ``function`` and answers with ``tool_call_id``."""
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"index": 0, "id": "call_1", "function": {"name": "weather", "arguments": {}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    route = routed(ollama_chat(body(model="m", messages=messages), timeout_s=None)).route
    assert route.messages is not None
    assert route.messages[1].tool_calls == [ToolCall(name="weather", id="call_1")]
    assert route.messages[2].tool_call_id == "call_1"
    assert route.messages[2].tool_name == "weather"  # the name of the call it answers


@pytest.mark.parametrize(
    ("parse", "raw", "code", "words"),
    [
        (ollama_generate, b"{nope", "bad_request", "not valid JSON"),
        (ollama_generate, body(prompt="no model"), "bad_request", "model is required"),
        (ollama_generate, body(model="m", prompt="  "), "bad_request", "empty"),
        (ollama_generate, body(model="m", prompt="x", images=["%%"]), "bad_request", "base64"),
        (ollama_generate, body(model="m", prompt="x", format="xml"), "bad_request", "format"),
        (ollama_generate, body(model="m", prompt="x", template="{{ .Prompt }}"), "unsupported", ""),
        (ollama_generate, body(model="m", prompt="x", raw=True), "unsupported", "template"),
        (ollama_generate, body(model="m", prompt="x", context=[1, 2]), "unsupported", "context"),
        (ollama_generate, body(model="m", prompt="x", logprobs=True), "unsupported", "logprobs"),
        (ollama_generate, body(model="m", prompt="x", think="loud"), "bad_request", "think"),
        (ollama_generate, body(prompt=""), "bad_request", "model"),  # a preload needs a model
        (ollama_generate, body(model="m", prompt="", keep_alive="5"), "bad_request", "keep"),
        (
            ollama_chat,
            body(model="m", messages=[{"role": "user", "content": " "}]),
            "bad_request",
            "",
        ),
        (ollama_chat, body(messages=None), "bad_request", ""),
        (
            ollama_chat,
            body(model="m", messages=[{"role": "robot", "content": "x"}]),
            "bad_request",
            "",
        ),
        (
            ollama_chat,
            body(model="m", messages=[{"role": "user", "content": "x", "images": ["%"]}]),
            "bad_request",
            "messages[0].images[0]",
        ),
        (ollama_chat, body(model="m", messages=[], tools={"x": 1}), "bad_request", "tools"),
        (ollama_embed, body(model="m", input=[1, 2]), "bad_request", "invalid input type"),
        (ollama_embed, body(input="x"), "bad_request", "model"),
        (ollama_embeddings, body(model="m", prompt=["x"]), "bad_request", "prompt"),
    ],
)
def test_bad_or_unsupported_bodies_are_400(parse: Any, raw: bytes, code: str, words: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse(raw, timeout_s=None)
    assert (refused.value.status, refused.value.code) == (400, code)
    assert words in refused.value.message


# -- preloads and empty embeddings --------------------------------------------------------------


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
    assert ollama_generate(raw, timeout_s=None) == expected


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
    assert ollama_chat(raw, timeout_s=None) == expected


def test_a_preload_is_answered_in_ollamas_shape() -> None:
    loaded = decode(Preload(model="m", chat=False, unload=False).answer(at=0))
    assert loaded == {
        "model": "m",
        "created_at": "1970-01-01T00:00:00.000000Z",
        "response": "",
        "done": True,
        "done_reason": "load",
    }
    unloaded = decode(Preload(model="m", chat=True, unload=True).answer())
    assert unloaded["message"] == {"role": "assistant", "content": ""}
    assert unloaded["done_reason"] == "unload" and "response" not in unloaded


# -- embeddings ---------------------------------------------------------------------------------


def test_embed_is_one_task_for_the_whole_batch() -> None:
    ask = routed(
        ollama_embed(
            body(
                model="m",
                input=["a", "b"],
                truncate=False,
                dimensions=64,
                keep_alive="1m",
                options={"num_ctx": 512},
                prompt="Open WebUI sends this too",  # ignored, as Ollama ignores it
            ),
            timeout_s=20,
        )
    )
    route = ask.route
    assert (route.task_type, route.input, route.prompt) == ("embedding", ["a", "b"], "a\nb")
    assert (route.truncate, route.dimensions, route.keep_alive) == (False, 64, "1m")
    assert route.options == {"num_ctx": 512} and route.normalize
    assert not ask.stream and route.wait
    one = routed(ollama_embed(body(model="m", input="x", dimensions=0), timeout_s=None))
    assert one.route.input == ["x"] and one.route.dimensions is None


def test_legacy_embeddings_are_not_normalized() -> None:
    route = routed(ollama_embeddings(body(model="m", prompt="x"), timeout_s=None)).route
    assert (route.input, route.normalize, route.task_type) == (["x"], False, "embedding")


@pytest.mark.parametrize(
    "raw", [body(model="m"), body(model="m", input=""), body(model="m", input=[])]
)
def test_nothing_to_embed_is_answered_at_once(raw: bytes) -> None:
    empty = ollama_embed(raw, timeout_s=None)
    assert empty == EmptyEmbed(model="m", legacy=False)
    assert isinstance(empty, EmptyEmbed)
    assert decode(empty.answer()) == {"model": "m", "embeddings": []}
    legacy = ollama_embeddings(body(model="m", prompt=""), timeout_s=None)
    assert isinstance(legacy, EmptyEmbed)
    assert decode(legacy.answer()) == {"embedding": []}


def test_embed_answers_in_ollamas_shape() -> None:
    reply = RouteReply(
        task_id="t",
        status="done",
        queue="q",
        worker="w",
        embeddings=[pack([0.1, -0.5]), pack([1.0, 0.0])],
        durations=Durations(total_ms=3.0, load_ms=0.0),
        tokens=Tokens(prompt=4),
    )
    assert decode(OllamaEmbedShape("m").whole(reply)) == {
        "model": "m",
        "embeddings": [[0.1, -0.5], [1.0, 0.0]],
        "total_duration": 3_000_000,
        "prompt_eval_count": 4,
    }
    assert decode(OllamaEmbedShape("m", legacy=True).whole(reply)) == {"embedding": [0.1, -0.5]}


# -- answers ------------------------------------------------------------------------------------


def test_ollama_shapes_carry_thinking_and_figures() -> None:
    generate = OllamaShape(model="asked", chat=False)
    chat = OllamaShape(model="asked", chat=True)

    whole = decode(generate.whole(DONE))
    assert (whole["response"], whole["thinking"], whole["done"]) == ("42", "six sevens", True)
    assert whole["model"] == "asked" and whole["done_reason"] == "stop"
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


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(None, "stop"), ("stop", "stop"), ("length", "length"), ("tool_calls", "stop")],
)
def test_done_reasons(reason: Any, expected: str) -> None:
    reply = msgspec.structs.replace(DONE, done_reason=reason)
    assert decode(OllamaShape("m", chat=True).whole(reply))["done_reason"] == expected


def test_tool_calls_whole_and_streamed_as_ollama_streams_them() -> None:
    raw = ToolCall(name="echo", arguments='{"x": 1}', id="call_own", index=0)
    reply = msgspec.structs.replace(
        DONE, response="", tool_calls=[CALL, raw], done_reason="tool_calls"
    )
    whole = decode(OllamaShape("m", chat=True).whole(reply))
    assert whole["message"]["tool_calls"] == [
        {
            "id": "call_t-1_0",
            "function": {"index": 0, "name": "weather", "arguments": {"city": "Paris"}},
        },
        {"id": "call_own", "function": {"index": 1, "name": "echo", "arguments": {"x": 1}}},
    ]
    assert whole["done_reason"] == "stop"

    shape = OllamaShape("m", chat=True)
    piece = shape.piece(StreamChunk(task_id="t-1", seq=1, tool_calls=[CALL]))
    assert piece is not None
    line = decode(piece)
    assert line["done"] is False
    assert line["message"]["tool_calls"][0]["function"]["name"] == "weather"
    # The end adds only the call not streamed yet, on its own line, then the final line.
    ending = [decode(part) for part in shape.end(reply).splitlines()]
    assert [e["done"] for e in ending] == [False, True]
    assert [c["function"]["index"] for c in ending[0]["message"]["tool_calls"]] == [1]
    assert "tool_calls" not in ending[1]["message"]


def test_a_streamed_answer_without_calls_ends_with_one_line() -> None:
    shape = OllamaShape("m", chat=True)
    assert len(shape.end(DONE).splitlines()) == 1


# -- model management ---------------------------------------------------------------------------


def test_show_and_pull_name_the_model_by_model_or_name() -> None:
    assert ollama_model_request(body(model="m"), "show").model == "m"
    # Ollama's CLI sends both fields, one empty.
    cli = ollama_model_request(body(model="", name="m", options=None), "show")
    assert cli == ModelAsk(model="m", stream=True)
    assert not ollama_model_request(body(name="m", stream=False), "pull").stream
    assert ollama_model_request(body(model="m", stream=None), "pull").stream
    for raw in (body(), body(model="", name=""), b"", b"[]"):
        with pytest.raises(ApiError) as refused:
            ollama_model_request(raw, "show")
        assert refused.value.status == 400


def test_pull_succeeds_at_once() -> None:
    lines = ollama_pull(stream=True).splitlines()
    assert [decode(line) for line in lines] == [
        {"status": "pulling manifest"},
        {"status": "success"},
    ]
    assert decode(ollama_pull(stream=False)) == {"status": "success"}
