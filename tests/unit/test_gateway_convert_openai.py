"""OpenAI's API through the gateway: bodies to route requests, replies to OpenAI's answers."""

from __future__ import annotations

import base64
from typing import Any

import msgspec
import pytest

from schemas.measures import Durations, Tokens
from schemas.route import ChatMessage, RouteReply, StreamChunk, ToolCall
from schemas.vectors import pack
from services.gateway.common import ApiError
from services.gateway.openai_answers import OpenAIEmbedShape, OpenAIShape
from services.gateway.openai_api import openai_chat, openai_completion, openai_embeddings

IMAGE = base64.b64encode(b"\x89PNG fake").decode()
DONE = RouteReply(
    task_id="t-1",
    status="done",
    queue="tasks.cpu.cpu-1",
    worker="cpu-1",
    response="42",
    thinking="six sevens",
    durations=Durations(total_ms=12.5),
    tokens=Tokens(prompt=5, eval=3),
)
CALL = ToolCall(name="weather", arguments={"city": "Paris"})
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def body(**fields: Any) -> bytes:
    return msgspec.json.encode(fields)


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


def chat(**fields: Any) -> Any:
    fields.setdefault("messages", [{"role": "user", "content": "x"}])
    return openai_chat(body(model="m", **fields), timeout_s=None).route


# -- requests -----------------------------------------------------------------------------------


def test_openai_chat_maps_sampling_and_roles() -> None:
    ask = openai_chat(
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
            top_p=0.9,
            seed=7,
            presence_penalty=0.1,
            frequency_penalty=0.2,
            stop="END",
            stream=True,
            stream_options={"include_usage": True},
            reasoning_effort="low",
            user="someone",  # ignored
        ),
        timeout_s=None,
    )
    assert ask.stream and ask.include_usage
    assert ask.route.messages == [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="ab"),
    ]
    assert ask.route.options == {
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "stop": ["END"],
        "num_predict": 10,
    }
    assert ask.route.think == "low"


def test_max_completion_tokens_wins_and_nothing_else_is_assumed() -> None:
    route = chat(max_tokens=5, max_completion_tokens=9)
    assert route.options == {"num_predict": 9}
    assert chat().options is None  # no temperature or top_p of OpenAI's defaults


@pytest.mark.parametrize(
    ("fields", "think"),
    [
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "minimal"}, "low"),
        ({"reasoning_effort": "high"}, "high"),
        ({"reasoning_effort": "xhigh"}, "max"),
        ({"reasoning": {"effort": "medium"}, "reasoning_effort": "low"}, "medium"),
        ({}, None),
    ],
)
def test_reasoning_effort_is_think_as_ollamas_layer_clamps_it(
    fields: dict[str, Any], think: Any
) -> None:
    assert chat(**fields).think == think


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, "json"),
        # openai's .parse(): {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
        (
            {
                "type": "json_schema",
                "json_schema": {"name": "Answer", "schema": {"type": "object"}, "strict": True},
            },
            {"type": "object"},
        ),
    ],
)
def test_response_format_is_ollamas_format(response_format: Any, expected: Any) -> None:
    assert chat(response_format=response_format).format == expected


@pytest.mark.parametrize(("choice", "sent"), [(None, TOOLS), ("auto", TOOLS), ("none", None)])
def test_tools_and_tool_choice(choice: Any, sent: Any) -> None:
    fields: dict[str, Any] = {"tools": TOOLS}
    if choice is not None:
        fields["tool_choice"] = choice
    assert chat(**fields).tools == sent


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "weather"}}]
)
def test_a_forcing_tool_choice_travels_as_an_option(choice: Any) -> None:
    """OpenAI-compatible backends hold the model to it; Ollama ignores it, as its own /v1."""
    asked = chat(tools=TOOLS, tool_choice=choice)
    assert asked.tools == TOOLS
    assert (asked.options or {})["tool_choice"] == choice


def test_images_come_as_data_urls() -> None:
    content = [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{IMAGE}"}},
        {"type": "image_url", "image_url": f"data:;base64,{IMAGE}"},  # Ollama takes both
    ]
    route = chat(messages=[{"role": "user", "content": content}])
    assert route.messages == [
        ChatMessage(role="user", content="what is it?", images=[IMAGE, IMAGE])
    ]


def test_tool_turns_are_carried() -> None:
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "call_10",
                    "type": "function",
                    "function": {"name": "raw", "arguments": "x"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_10", "name": "named", "content": "ok"},
    ]
    route = chat(messages=messages, tools=TOOLS)
    assert route.messages[1] == ChatMessage(
        role="assistant",
        tool_calls=[
            ToolCall(name="weather", arguments={"city": "Paris"}, id="call_9", index=0),
            ToolCall(name="raw", arguments="x", id="call_10", index=1),  # not JSON: kept
        ],
    )
    # The tool's name is found from the call it answers, as Ollama's layer finds it.
    assert route.messages[2] == ChatMessage(
        role="tool", content="sunny", tool_name="weather", tool_call_id="call_9"
    )
    assert route.messages[3].tool_name == "named"


def test_completions_take_one_prompt_and_a_suffix() -> None:
    ask = openai_completion(body(model="m", prompt=["only"], suffix="end"), timeout_s=None)
    assert ask.route.prompt == "only" and ask.route.suffix == "end" and not ask.stream
    with pytest.raises(ApiError) as refused:
        openai_completion(body(model="m", prompt=["a", "b"]), timeout_s=None)
    assert refused.value.status == 400


def test_embeddings_are_one_task() -> None:
    ask = openai_embeddings(
        body(model="m", input=["a", "b"], dimensions=32, user="u"), timeout_s=None
    )
    assert (ask.route.task_type, ask.route.input, ask.route.dimensions) == (
        "embedding",
        ["a", "b"],
        32,
    )
    assert not ask.base64_vectors and ask.route.normalize
    one = openai_embeddings(body(model="m", input="", encoding_format="BASE64"), timeout_s=None)
    assert one.route.input == [""] and one.base64_vectors  # as Ollama's layer: "" is [""]


@pytest.mark.parametrize(
    ("parse", "fields", "code", "words"),
    [
        (openai_chat, {"messages": "hi"}, "bad_request", ""),
        (openai_chat, {"n": 2}, "unsupported", "'n'"),
        (openai_chat, {"logprobs": True}, "unsupported", "logprobs"),
        (openai_chat, {"tools": TOOLS, "tool_choice": "always"}, "bad_request", "tool_choice"),
        (openai_chat, {"response_format": {"type": "json_schema"}}, "bad_request", "schema"),
        (openai_chat, {"response_format": {"type": "grammar"}}, "unsupported", "grammar"),
        (openai_chat, {"reasoning_effort": "huge"}, "bad_request", "invalid reasoning value"),
        (
            openai_chat,
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "bad_request",
            "data: URL",
        ),
        (
            openai_chat,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
                        ],
                    }
                ]
            },
            "unsupported",
            "remote images are not fetched",
        ),
        (
            openai_chat,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%"}}
                        ],
                    }
                ]
            },
            "bad_request",
            "base64",
        ),
        (
            openai_chat,
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "unsupported",
            "input_audio",
        ),
        (openai_completion, {"prompt": [1, 2, 3]}, "unsupported", "token"),
        (openai_embeddings, {"input": [[1, 2], [3]]}, "unsupported", "token"),
        (openai_embeddings, {"input": []}, "bad_request", "invalid input"),
        (openai_embeddings, {}, "bad_request", "invalid input"),
        (openai_embeddings, {"input": "x", "encoding_format": "int8"}, "bad_request", "int8"),
    ],
)
def test_bad_or_unsupported_bodies_are_400(
    parse: Any, fields: dict[str, Any], code: str, words: str
) -> None:
    if parse is openai_chat:
        fields.setdefault("messages", [{"role": "user", "content": "x"}])
    with pytest.raises(ApiError) as refused:
        parse(body(model="m", **fields), timeout_s=None)
    assert (refused.value.status, refused.value.code) == (400, code)
    assert words in refused.value.message


# -- answers ------------------------------------------------------------------------------------


def test_openai_shapes_use_reasoning_and_the_task_id() -> None:
    shape = OpenAIShape(model="asked", chat=True, include_usage=True, created=7)
    whole = decode(shape.whole(DONE))
    assert whole["id"] == "chatcmpl-t-1" and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"]["reasoning"] == "six sevens"
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}

    piece = shape.piece(StreamChunk(task_id="t-1", seq=1, response="4"))
    assert piece is not None and piece.startswith(b"data: ")
    assert decode(piece[6:])["choices"][0]["delta"]["content"] == "4"
    ending = shape.end(DONE).split(b"\n\n")
    assert ending[-2] == b"data: [DONE]"
    assert decode(ending[1][6:])["usage"]["total_tokens"] == 8

    legacy = OpenAIShape(model="asked", chat=False)
    assert legacy.piece(StreamChunk(task_id="t", seq=1, thinking="x")) is None  # dropped
    assert decode(legacy.whole(DONE))["choices"][0]["text"] == "42"
    assert decode(shape.error(503, "no_worker", "busy"))["error"] == {
        "message": "busy",
        "type": "api_error",
        "param": None,
        "code": "no_worker",
    }


@pytest.mark.parametrize(
    ("reason", "calls", "chat_finish", "legacy_finish"),
    [
        (None, None, "stop", "stop"),
        ("length", None, "length", "length"),
        ("stop", [CALL], "tool_calls", "stop"),
        ("tool_calls", [CALL], "tool_calls", "stop"),
    ],
)
def test_finish_reasons(reason: Any, calls: Any, chat_finish: str, legacy_finish: str) -> None:
    reply = msgspec.structs.replace(DONE, done_reason=reason, tool_calls=calls)
    assert decode(OpenAIShape("m", chat=True).whole(reply))["choices"][0]["finish_reason"] == (
        chat_finish
    )
    legacy = decode(OpenAIShape("m", chat=False).whole(reply))
    assert legacy["choices"][0]["finish_reason"] == legacy_finish


def test_tool_calls_whole_and_streamed() -> None:
    reply = msgspec.structs.replace(
        DONE, response="", thinking=None, tool_calls=[CALL, ToolCall(name="f", id="own", index=1)]
    )
    message = decode(OpenAIShape("m", chat=True).whole(reply))["choices"][0]["message"]
    assert message["tool_calls"] == [
        {
            "index": 0,
            "id": "call_t-1_0",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
        },
        {"index": 1, "id": "own", "type": "function", "function": {"name": "f", "arguments": "{}"}},
    ]

    shape = OpenAIShape("m", chat=True)
    piece = shape.piece(StreamChunk(task_id="t-1", seq=1, tool_calls=[CALL]))
    assert piece is not None
    delta = decode(piece[6:])["choices"][0]["delta"]
    assert delta["tool_calls"][0]["index"] == 0 and delta["tool_calls"][0]["id"] == "call_t-1_0"
    events = [decode(e[6:]) for e in shape.end(reply).split(b"\n\n") if e and e != b"data: [DONE]"]
    # The call not streamed yet, then the finish.
    assert [c["index"] for c in events[0]["choices"][0]["delta"]["tool_calls"]] == [1]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_embeddings_in_openais_list_shape() -> None:
    vector = pack([0.25, -1.0])
    reply = RouteReply(
        task_id="t",
        status="done",
        queue="q",
        worker="w",
        embeddings=[vector],
        tokens=Tokens(prompt=3),
    )
    floats = decode(OpenAIEmbedShape("m").whole(reply))
    assert floats == {
        "object": "list",
        "data": [{"object": "embedding", "embedding": [0.25, -1.0], "index": 0}],
        "model": "m",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    encoded = decode(OpenAIEmbedShape("m", base64=True).whole(reply))
    assert base64.b64decode(encoded["data"][0]["embedding"]) == vector  # exactly the bytes
