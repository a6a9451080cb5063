"""The Ollama stand-in's model features: capabilities, tools, structured output, images,
embeddings, options and keep_alive, and their OpenAI-compatible forms."""

from __future__ import annotations

import base64
import calendar
import hashlib
import json
import math
import re
import struct
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from devtools.fakes.ollama import (
    DEFAULT_EMBEDDING_MODELS,
    DEFAULT_INSERT_MODELS,
    DEFAULT_MODELS,
    DEFAULT_THINKING_MODELS,
    DEFAULT_TOOL_MODELS,
    DEFAULT_VISION_MODELS,
    FakeOllama,
    _go_b64decode,
    _go_duration,
)

EMBEDDER = "nomic-embed-text:latest"
VISION = "gemma3:4b"
THINKER = "qwen3:0.6b"
CODER = "qwen2.5-coder:1.5b"
FLEET = [*DEFAULT_MODELS, THINKER, VISION, EMBEDDER, "all-minilm:latest", CODER]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "required": ["city", "days"],
            "properties": {
                "city": {"type": "string", "description": "The city"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}, "utc": {"type": "boolean"}},
        },
    },
}


@pytest.fixture
def fake() -> Iterator[FakeOllama]:
    with FakeOllama(models=FLEET) as server:
        yield server


@pytest.fixture
def client(fake: FakeOllama) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, timeout=10) as http:
        yield http


def post(client: httpx.Client, path: str, **body: Any) -> httpx.Response:
    return client.post(path, json=body)


def chat(client: httpx.Client, model: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "stream": False}
    return client.post("/api/chat", json={**body, **extra})


def lines(client: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/x-ndjson"
        return [json.loads(line) for line in reply.iter_lines() if line.strip()]


def sse(client: httpx.Client, path: str, **body: Any) -> list[Any]:
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream"
        text = reply.read().decode()
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def error(reply: httpx.Response, status: int) -> str:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert body.keys() == {"error"}
    assert isinstance(body["error"], str)
    return body["error"]


def openai_error(reply: httpx.Response, status: int, kind: str) -> str:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()["error"]
    assert body["type"] == kind and body["param"] is None and body["code"] is None
    assert isinstance(body["message"], str)
    return body["message"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unix(stamp: str) -> float:
    seconds = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
    return seconds + float("0." + stamp[20:-1])


def f32(value: float) -> float:
    result: float = struct.unpack("<f", struct.pack("<f", value))[0]
    return result


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(value * value for value in vector))


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / (norm(a) * norm(b))


# --------------------------------------------------------------------------- capabilities


def test_defaults_and_capabilities_in_show(fake: FakeOllama, client: httpx.Client) -> None:
    assert DEFAULT_MODELS == ("qwen2.5:0.5b", "gemma3:1b")
    assert DEFAULT_THINKING_MODELS == (THINKER,)
    assert DEFAULT_TOOL_MODELS == ("qwen2.5:0.5b", THINKER, CODER)
    assert DEFAULT_VISION_MODELS == (VISION,)
    assert DEFAULT_EMBEDDING_MODELS == (EMBEDDER, "all-minilm:latest")
    assert DEFAULT_INSERT_MODELS == (CODER,)

    def capabilities(model: str) -> list[str]:
        reply = post(client, "/api/show", model=model)
        assert reply.status_code == 200
        caps: list[str] = reply.json()["capabilities"]
        return caps

    assert capabilities("qwen2.5:0.5b") == ["completion", "tools"]
    assert capabilities("gemma3:1b") == ["completion"]
    assert capabilities(THINKER) == ["completion", "tools", "thinking"]
    assert capabilities(VISION) == ["completion", "vision"]
    assert capabilities("nomic-embed-text") == ["embedding"]
    assert capabilities(CODER) == ["completion", "tools", "insert"]

    shown = post(client, "/api/show", model="nomic-embed-text").json()
    assert shown["details"]["format"] == "gguf"
    family = shown["details"]["family"]
    assert shown["model_info"][f"{family}.embedding_length"] == 768
    assert shown["model_info"][f"{family}.context_length"] == 512
    chat_model = post(client, "/api/show", model="qwen2.5:0.5b").json()
    assert chat_model["model_info"]["qwen2.context_length"] == 32768
    assert chat_model["model_info"]["qwen2.embedding_length"] == 896
    assert ".Tools" in chat_model["template"]
    assert "projector_info" in post(client, "/api/show", model=VISION).json()
    assert "projector_info" not in chat_model


def test_capability_knobs_configure_and_reset(fake: FakeOllama, client: httpx.Client) -> None:
    config = client.get("/_fake/config").json()
    assert config["tool_models"] == list(DEFAULT_TOOL_MODELS)
    assert config["vision_models"] == list(DEFAULT_VISION_MODELS)
    assert config["embedding_models"] == list(DEFAULT_EMBEDDING_MODELS)
    assert config["insert_models"] == list(DEFAULT_INSERT_MODELS)

    changed = post(
        client,
        "/_fake/config",
        tool_models=["gemma3:1b"],
        vision_models=["gemma3:1b"],
        insert_models=["gemma3:1b"],
        embedding_models=[],
    )
    assert changed.status_code == 200 and changed.json()["tool_models"] == ["gemma3:1b"]
    shown = post(client, "/api/show", model="gemma3:1b").json()
    assert shown["capabilities"] == ["completion", "vision", "tools", "insert"]
    assert post(client, "/api/show", model=EMBEDDER).json()["capabilities"] == ["completion"]
    assert post(client, "/_fake/config", tool_models="gemma3:1b").status_code == 400
    assert post(client, "/_fake/config", vision_models=[""]).status_code == 400

    post(client, "/_fake/reset")
    assert fake.tool_models == list(DEFAULT_TOOL_MODELS)
    with FakeOllama(models=["m:1b"], tool_models=["m:1b"], embedding_models=["m:1b"]) as own:
        own.tool_models.append("other")  # the fake's own copy
        own.reset()
        assert own.tool_models == ["m:1b"]
        assert own.config()["embedding_models"] == ["m:1b"]


def test_tags_and_ps_digests_are_distinct(client: httpx.Client) -> None:
    models = client.get("/api/tags").json()["models"]
    assert [m["name"] for m in models] == FLEET
    digests = [m["digest"] for m in models]
    assert len(set(digests)) == len(FLEET)
    assert all(len(d) == 64 and int(d, 16) >= 0 for d in digests)
    for name in FLEET:
        if name in (EMBEDDER, "all-minilm:latest"):
            post(client, "/api/embed", model=name, input="hi")
        else:
            post(client, "/api/generate", model=name, prompt="hi", stream=False)
    running = client.get("/api/ps").json()["models"]
    assert {m["name"] for m in running} == set(FLEET)
    assert len({m["digest"] for m in running}) == len(FLEET)
    for entry in running:
        assert {"size", "size_vram", "details", "expires_at", "context_length"} <= entry.keys()


def test_capability_refusals(client: httpx.Client) -> None:
    refused = chat(client, "gemma3:1b", "hi", tools=[WEATHER])
    assert error(refused, 400) == "registry.ollama.ai/library/gemma3:1b does not support tools"
    assert error(chat(client, "GEMMA3:1B", "hi", tools=[WEATHER]), 400) == (
        "registry.ollama.ai/library/gemma3:1b does not support tools"
    )  # the name as served
    assert error(chat(client, "gemma3:1b", "hi", think=True), 400) == (
        '"gemma3:1b" does not support thinking'
    )
    assert (
        error(chat(client, EMBEDDER, "hi"), 400)
        == '"nomic-embed-text:latest" does not support chat'
    )
    as_generate = post(client, "/api/generate", model="nomic-embed-text", prompt="hi")
    assert error(as_generate, 400) == '"nomic-embed-text" does not support generate'
    # Even with nothing to say: Ollama checks before loading.
    assert error(post(client, "/api/chat", model=EMBEDDER, messages=[]), 400).endswith("chat")
    infill = post(client, "/api/generate", model="gemma3:1b", prompt="def f(", suffix="):")
    assert error(infill, 400) == "registry.ollama.ai/library/gemma3:1b does not support insert"
    accepted = post(client, "/api/generate", model=CODER, prompt="1+1", suffix=" # x", stream=False)
    assert accepted.status_code == 200 and accepted.json()["response"] == "2"
    # tools on a tools model without a suffix, an empty tools list anywhere: fine.
    assert chat(client, "gemma3:1b", "hi", tools=[]).status_code == 200

    openai = post(
        client,
        "/v1/chat/completions",
        model="gemma3:1b",
        tools=[WEATHER],
        messages=[{"role": "user", "content": "get_weather"}],
    )
    assert openai_error(openai, 400, "api_error") == (
        "registry.ollama.ai/library/gemma3:1b does not support tools"
    )
    legacy = post(client, "/v1/completions", model="gemma3:1b", prompt="x", suffix="y")
    assert openai_error(legacy, 400, "api_error").endswith("does not support insert")


def test_think_values_are_checked_as_ollama_does(client: httpx.Client) -> None:
    assert error(chat(client, THINKER, "hi", think=1), 400) == (
        'think must be a boolean or string ("high", "medium", "low")'
    )
    assert error(chat(client, THINKER, "hi", think="max"), 400) == (
        'invalid think value: "max" (must be "high", "medium", "low", true, or false)'
    )
    assert error(chat(client, THINKER, "hi", think="high"), 400) == (
        'think value "high" is not supported for this model'
    )


# --------------------------------------------------------------------------- tools


def test_tool_call_not_streamed(fake: FakeOllama, client: httpx.Client) -> None:
    reply = chat(client, "qwen2.5:0.5b", 'Use get_weather for "Paris" over 3 days', tools=[WEATHER])
    assert reply.status_code == 200
    body = reply.json()
    assert body["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
        ],
    }
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["eval_count"] > 0

    # name=value wins; several tools mentioned: each called, the second with its index.
    both = chat(
        client,
        "qwen2.5:0.5b",
        "get_time zone=UTC utc=false, then GET_WEATHER city='New York' days=2",
        tools=[WEATHER, CLOCK],
    ).json()["message"]["tool_calls"]
    assert both == [
        {"function": {"name": "get_weather", "arguments": {"city": "New York", "days": 2}}},
        {"function": {"index": 1, "name": "get_time", "arguments": {"utc": False, "zone": "UTC"}}},
    ]
    # No tool named: a plain answer.
    plain = chat(client, "qwen2.5:0.5b", "what is 6*7", tools=[WEATHER]).json()["message"]
    assert plain == {"role": "assistant", "content": "42"}
    # A replies answer naming a tool calls it.
    fake.replies = {"umbrella": "get_weather"}
    steered = chat(client, "qwen2.5:0.5b", "Do I need an umbrella in Oslo?", tools=[WEATHER])
    call = steered.json()["message"]["tool_calls"][0]["function"]
    assert call == {
        "name": "get_weather",
        "arguments": {"city": "Do I need an umbrella in Oslo?", "days": 0},
    }


def test_tool_call_streamed_in_its_own_chunk(client: httpx.Client) -> None:
    got = lines(
        client,
        "/api/chat",
        model="qwen2.5:0.5b",
        tools=[WEATHER, CLOCK],
        messages=[{"role": "user", "content": "get_weather city=Rome days=1 and get_time"}],
    )
    *calls, last = got
    assert [c["message"] for c in calls] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Rome", "days": 1}}}
            ],
        },
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "function": {
                        "index": 1,
                        "name": "get_time",
                        "arguments": {
                            "utc": True,
                            "zone": "get_weather city=Rome days=1 and get_time",
                        },
                    }
                }
            ],
        },
    ]
    assert all(c["done"] is False for c in calls)
    assert last["done"] is True and last["done_reason"] == "stop"
    assert last["message"] == {"role": "assistant", "content": ""}


def test_tool_results_reach_the_model(fake: FakeOllama, client: httpx.Client) -> None:
    history = [
        {"role": "user", "content": "weather in Paris? use get_weather"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    body = {"model": "qwen2.5:0.5b", "messages": history, "tools": [WEATHER], "stream": False}
    answer = client.post("/api/chat", json=body).json()["message"]
    assert answer == {
        "role": "assistant",
        "content": "Based on the tool result: get_weather returned 18 degrees and sunny",
    }
    two = [*history, {"role": "TOOL", "content": "12:00"}]
    text = client.post("/api/chat", json={**body, "messages": two}).json()["message"]["content"]
    assert text == "Based on the tool results: get_weather returned 18 degrees and sunny; 12:00"
    fake.replies = {"sunny": "Take sunglasses."}
    steered = client.post("/api/chat", json=body).json()["message"]["content"]
    assert steered == "Take sunglasses."


def test_bad_tools_and_tool_calls_bodies(client: httpx.Client) -> None:
    def refused(**body: Any) -> str:
        return error(client.post("/api/chat", json={"model": "qwen2.5:0.5b", **body}), 400)

    user = [{"role": "user", "content": "hi"}]
    assert refused(messages=user, tools="get_weather") == (
        "json: cannot unmarshal string into Go struct field ChatRequest.tools of type api.Tools"
    )
    assert refused(messages=user, tools=[{"function": {"name": 3}}]) == (
        "json: cannot unmarshal number into Go struct field ToolFunction.tools.function.name"
        " of type string"
    )
    bad_call = [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    assert refused(messages=bad_call) == (
        "json: cannot unmarshal string into Go struct field "
        "ChatRequest.messages.tool_calls.function.arguments of type api.ToolCallFunctionArguments"
    )
    assert refused(messages=[{"role": "user", "content": ["x"]}]) == (
        "json: cannot unmarshal array into Go struct field ChatRequest.messages.content"
        " of type string"
    )


# --------------------------------------------------------------------------- structured output


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "integer", "minimum": 0},
        "why": {"type": "string", "maxLength": 12},
        "sure": {"type": "boolean"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "minItems": 2},
        "when": {"type": "string", "format": "date-time"},
        "detail": {
            "anyOf": [{"type": "null"}, {"$ref": "#/$defs/Detail"}],
        },
        "score": {"type": "number", "maximum": 1},
    },
    "required": ["why", "answer"],
    "$defs": {
        "Tag": {"type": "string", "enum": ["math", "other"]},
        "Detail": {"type": "object", "properties": {"steps": {"type": ["integer", "null"]}}},
    },
}
EXPECTED = {
    "answer": 42,
    "why": "42",
    "sure": True,
    "tags": ["math", "math"],
    "when": "2025-06-01T12:00:00Z",
    "detail": {"steps": 42},
    "score": 1,
}


def test_format_json_and_schema(client: httpx.Client) -> None:
    as_json = post(
        client, "/api/generate", model="gemma3:1b", prompt="1+1", format="json", stream=False
    )
    assert json.loads(as_json.json()["response"]) == {"response": "2"}
    generated = post(
        client, "/api/generate", model="gemma3:1b", prompt="6*7", format=SCHEMA, stream=False
    )
    text = generated.json()["response"]
    # Required properties first, in the schema's order (as llama.cpp's grammar has them).
    assert list(json.loads(text)) == ["answer", "why", "sure", "tags", "when", "detail", "score"]
    assert json.loads(text) == EXPECTED
    streamed = lines(client, "/api/generate", model="gemma3:1b", prompt="6*7", format=SCHEMA)
    assert "".join(line["response"] for line in streamed) == text
    assert len(streamed) > 2

    chatted = chat(client, "gemma3:1b", "what is 6*7", format=SCHEMA).json()["message"]["content"]
    assert json.loads(chatted) == EXPECTED
    echoed = chat(client, "gemma3:1b", "hi", format={"type": "object", "properties": {"s": {}}})
    assert json.loads(echoed.json()["message"]["content"]) == {"s": "Echo from gemma3:1b: hi"}
    assert json.loads(chat(client, "gemma3:1b", "hi", format={}).json()["message"]["content"]) == {
        "response": "Echo from gemma3:1b: hi"
    }
    # "" and null mean no format.
    assert chat(client, "gemma3:1b", "1+1", format="").json()["message"]["content"] == "2"
    assert chat(client, "gemma3:1b", "1+1", format=None).json()["message"]["content"] == "2"
    explicit = chat(client, "gemma3:1b", "answer=7 why=because", format=SCHEMA).json()
    assert json.loads(explicit["message"]["content"])["answer"] == 7
    assert json.loads(explicit["message"]["content"])["why"] == "because"


def test_invalid_format_fails_like_the_runner(client: httpx.Client) -> None:
    whole = post(
        client, "/api/generate", model="gemma3:1b", prompt="hi", format="yaml", stream=False
    )
    assert error(whole, 500) == (
        'invalid format: "\\"yaml\\""; expected "json" or a valid JSON Schema object'
    )
    assert error(chat(client, "gemma3:1b", "hi", format=3), 500) == (
        'invalid format: "3"; expected "json" or a valid JSON Schema object'
    )
    streamed = lines(
        client,
        "/api/chat",
        model="gemma3:1b",
        format=["a"],
        messages=[{"role": "user", "content": "x"}],
    )
    assert streamed == [
        {"error": 'invalid format: "[\\"a\\"]"; expected "json" or a valid JSON Schema object'}
    ]
    # With nothing to say the model just loads: the format is never looked at.
    loaded = post(client, "/api/generate", model="gemma3:1b", format="yaml", stream=False)
    assert loaded.json()["done_reason"] == "load"


def test_openai_response_format(client: httpx.Client) -> None:
    def ask(response_format: Any, stream: bool = False) -> httpx.Response:
        return post(
            client,
            "/v1/chat/completions",
            model="gemma3:1b",
            messages=[{"role": "user", "content": "what is 6*7"}],
            response_format=response_format,
            stream=stream,
        )

    content = ask({"type": "json_object"}).json()["choices"][0]["message"]["content"]
    assert json.loads(content) == {"response": "42"}
    spec = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    whole = ask(spec).json()["choices"][0]
    assert json.loads(whole["message"]["content"]) == EXPECTED
    assert whole["finish_reason"] == "stop"
    body = {"model": "gemma3:1b", "messages": [{"role": "user", "content": "6*7"}], "stream": True}
    events = sse(client, "/v1/chat/completions", **body, response_format=spec)
    text = "".join(e["choices"][0]["delta"]["content"] for e in events[:-2])
    assert json.loads(text) == EXPECTED and events[-1] == "[DONE]"
    assert ask({"type": "text"}).json()["choices"][0]["message"]["content"] == "42"

    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}
    assert openai_error(ask(bad), 500, "api_error") == (
        'invalid format: "\\"nope\\""; expected "json" or a valid JSON Schema object'
    )
    broken = sse(client, "/v1/chat/completions", **body, response_format=bad)
    assert len(broken) == 1 and broken[0]["model"] == ""
    assert broken[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    ]


# --------------------------------------------------------------------------- images


PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))
GIF = b"GIF89a" + b"\x00" * 30


def note(*images: bytes) -> str:
    seen = "; ".join(f"{len(i)} bytes sha256:{hashlib.sha256(i).hexdigest()[:12]}" for i in images)
    return f"[{len(images)} image{'' if len(images) == 1 else 's'}: {seen}]"


def test_images_on_generate_and_chat(fake: FakeOllama, client: httpx.Client) -> None:
    seen = post(
        client, "/api/generate", model=VISION, prompt="describe", images=[b64(PNG)], stream=False
    )
    assert seen.json()["response"] == f"Echo from {VISION}: describe {note(PNG)}"
    assert fake.stats()["last_images"] == 1
    messages = [
        {"role": "user", "content": "first", "images": [b64(GIF)]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "and these?", "images": [b64(PNG), b64(GIF)]},
    ]
    body = {"model": VISION, "messages": messages, "stream": False}
    said = client.post("/api/chat", json=body).json()["message"]["content"]
    assert said == f"Echo from {VISION}: and these? {note(GIF, PNG, GIF)}"
    assert fake.stats()["last_images"] == 3
    assert fake.last()["last_chat"]["messages"][2]["images"] == [b64(PNG), b64(GIF)]
    # A model without vision takes the images and ignores them.
    blind = client.post("/api/chat", json={**body, "model": "gemma3:1b"}).json()
    assert blind["message"]["content"] == "Echo from gemma3:1b: and these?"
    fake.replies = {"these": "Two charts."}
    assert client.post("/api/chat", json=body).json()["message"]["content"] == "Two charts."


def test_bad_images_are_refused(fake: FakeOllama, client: httpx.Client) -> None:
    for image, at in (("abc", 0), ("YQ=", 3), ("Y===", 1), ("YQ==YQ==", 4), ("YW*j", 2), ("é", 0)):
        reply = post(client, "/api/generate", model="gemma3:1b", prompt="x", images=[image])
        assert error(reply, 400) == f"illegal base64 data at input byte {at}", image
        in_chat = chat(client, "gemma3:1b", "x")  # a good request in between
        assert in_chat.status_code == 200
    messages = [{"role": "user", "content": "x", "images": ["!!"]}]
    bad = client.post("/api/chat", json={"model": VISION, "messages": messages})
    assert error(bad, 400) == "illegal base64 data at input byte 0"
    wrong = post(client, "/api/generate", model="gemma3:1b", prompt="x", images=[1])
    assert error(wrong, 400) == (
        "json: cannot unmarshal number into Go struct field GenerateRequest.images"
        " of type api.ImageData"
    )
    assert _go_b64decode("YWJj\r\nZGVm") == b"abcdef"
    assert _go_b64decode("") == b""


def test_openai_image_parts(fake: FakeOllama, client: httpx.Client) -> None:
    def ask(*parts: Any, model: str = VISION) -> httpx.Response:
        return post(
            client,
            "/v1/chat/completions",
            model=model,
            messages=[{"role": "user", "content": list(parts)}],
        )

    text = {"type": "text", "text": "what is this?"}
    png = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(PNG)}"}}
    jpeg = {"type": "image_url", "image_url": f"data:image/jpeg;base64,{b64(GIF)}"}
    said = ask(text, png, jpeg).json()["choices"][0]["message"]["content"]
    assert said == f"Echo from {VISION}: what is this? {note(PNG, GIF)}"
    assert fake.stats()["last_images"] == 2
    assert (
        ask(png, text)
        .json()["choices"][0]["message"]["content"]
        .startswith(f"Echo from {VISION}: what is this? [")
    )
    remote = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert openai_error(ask(text, remote), 400, "invalid_request_error") == "invalid image input"
    gif = {"type": "image_url", "image_url": {"url": f"data:image/gif;base64,{b64(GIF)}"}}
    assert openai_error(ask(gif), 400, "invalid_request_error") == "invalid image input"
    broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,abc"}}
    assert openai_error(ask(broken), 400, "invalid_request_error") == "invalid message format"


# --------------------------------------------------------------------------- embeddings


def test_embed_shapes_and_vectors(fake: FakeOllama, client: httpx.Client) -> None:
    reply = post(client, "/api/embed", model="nomic-embed-text", input=["the cat sat", "the cat"])
    assert reply.status_code == 200
    body = reply.json()
    assert list(body) == [
        "model",
        "embeddings",
        "total_duration",
        "load_duration",
        "prompt_eval_count",
    ]
    assert body["model"] == "nomic-embed-text"
    assert body["prompt_eval_count"] == 5
    first, second = body["embeddings"]
    assert len(first) == len(second) == 768
    assert abs(norm(first) - 1) < 1e-5
    for value in first:  # float32 values, written with the fewest digits that read back
        exact = f32(value)
        digits = next(d for d in range(1, 10) if f32(float(f"{exact:.{d}g}")) == exact)
        assert value == float(f"{exact:.{digits}g}")
    again = post(client, "/api/embed", model="nomic-embed-text", input="the cat sat").json()
    assert again["embeddings"] == [first]  # deterministic; a string works as a list of one
    other = post(client, "/api/embed", model="nomic-embed-text", input="stock market news").json()
    assert cosine(first, second) > cosine(first, other["embeddings"][0])

    short = post(client, "/api/embed", model="nomic-embed-text", input="the cat sat", dimensions=4)
    vector = short.json()["embeddings"][0]
    assert len(vector) == 4 and abs(norm(vector) - 1) < 1e-6
    expected = [v / norm(first[:4]) for v in first[:4]]
    assert all(abs(a - b) < 1e-6 for a, b in zip(vector, expected, strict=True))
    wide = post(client, "/api/embed", model="nomic-embed-text", input="x", dimensions=5000).json()
    assert len(wide["embeddings"][0]) == 768  # a dimensions too large is ignored

    sizes = {
        name: len(post(client, "/api/embed", model=name, input="x").json()["embeddings"][0])
        for name in ("all-minilm", "qwen2.5:0.5b", "gemma3:1b", "qwen3:0.6b")
    }
    assert sizes == {"all-minilm": 384, "qwen2.5:0.5b": 896, "gemma3:1b": 1152, "qwen3:0.6b": 1024}
    assert fake.stats()["embed_calls"] == 9


def test_embed_edge_cases_and_errors(fake: FakeOllama, client: httpx.Client) -> None:
    empties: list[Any] = ["", [], None]
    for empty in empties:
        reply = post(client, "/api/embed", model="nomic-embed-text", input=empty)
        assert reply.json() == {"model": "nomic-embed-text", "embeddings": []}
    assert {m["name"] for m in client.get("/api/ps").json()["models"]} == {EMBEDDER}

    long_text = "word " * 600
    refused = post(client, "/api/embed", model="nomic-embed-text", input=long_text, truncate=False)
    assert error(refused, 400) == "input exceeds maximum context length"
    cut = post(client, "/api/embed", model="nomic-embed-text", input=long_text).json()
    assert cut["prompt_eval_count"] == 512
    limited = post(
        client, "/api/embed", model="nomic-embed-text", input=["a b c d e"], options={"num_ctx": 3}
    )
    assert limited.json()["prompt_eval_count"] == 3
    assert (
        post(client, "/api/embed", model="nomic-embed-text", input="word " * 512, truncate=False)
    ).status_code == 200

    assert error(post(client, "/api/embed", model="nomic-embed-text", input=[1, 2]), 400) == (
        "invalid input type"
    )
    assert error(post(client, "/api/embed", model="nomic-embed-text", input={"a": 1}), 400) == (
        "invalid input type"
    )
    assert error(post(client, "/api/embed", model="nope", input="x"), 404) == (
        'model "nope" not found, try pulling it first'
    )
    assert error(post(client, "/api/embed", input="x"), 404) == (
        'model "" not found, try pulling it first'
    )
    assert error(
        post(client, "/api/embed", model="nomic-embed-text", input="x", dimensions=1.5), 400
    ) == (
        "json: cannot unmarshal number 1.5 into Go struct field EmbedRequest.dimensions of type int"
    )
    assert error(
        post(client, "/api/embed", model="nomic-embed-text", input="x", truncate="no"), 400
    ) == ("json: cannot unmarshal string into Go struct field EmbedRequest.truncate of type bool")
    fake.fail_status = 503
    assert error(post(client, "/api/embed", model="nomic-embed-text", input="x"), 503)


def test_legacy_embeddings(fake: FakeOllama, client: httpx.Client) -> None:
    reply = post(client, "/api/embeddings", model="nomic-embed-text", prompt="the cat sat")
    sent = {"model": "nomic-embed-text", "prompt": "the cat sat"}
    assert fake.last("embeddings") == fake.last("embed") == sent
    assert reply.status_code == 200
    assert list(reply.json()) == ["embedding"]
    raw = reply.json()["embedding"]
    assert len(raw) == 768 and norm(raw) > 1.5  # not normalised
    modern = post(client, "/api/embed", model="nomic-embed-text", input="the cat sat").json()
    assert all(
        abs(a / norm(raw) - b) < 1e-6 for a, b in zip(raw, modern["embeddings"][0], strict=True)
    )
    assert post(client, "/api/embeddings", model="nomic-embed-text", prompt="").json() == {
        "embedding": []
    }
    assert error(post(client, "/api/embeddings", prompt="x"), 400) == "model is required"
    assert error(post(client, "/api/embeddings", model="nope:1b", prompt="x"), 404) == (
        'model "nope:1b" not found, try pulling it first'
    )


def test_openai_embeddings(fake: FakeOllama, client: httpx.Client) -> None:
    reply = post(client, "/v1/embeddings", model="nomic-embed-text", input=["the cat", "a dog"])
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "nomic-embed-text"
    assert body["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    assert [(d["object"], d["index"], len(d["embedding"])) for d in body["data"]] == [
        ("embedding", 0, 768),
        ("embedding", 1, 768),
    ]
    native = post(client, "/api/embed", model="nomic-embed-text", input=["the cat", "a dog"])
    assert [d["embedding"] for d in body["data"]] == native.json()["embeddings"]

    packed = post(
        client,
        "/v1/embeddings",
        model="nomic-embed-text",
        input="the cat",
        encoding_format="base64",
        dimensions=8,
    ).json()["data"][0]["embedding"]
    assert isinstance(packed, str)
    decoded = list(struct.unpack("<8f", base64.b64decode(packed)))
    floats = post(client, "/v1/embeddings", model="nomic-embed-text", input="the cat", dimensions=8)
    assert decoded == [f32(value) for value in floats.json()["data"][0]["embedding"]]
    one = post(client, "/v1/embeddings", model="nomic-embed-text", input="").json()
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == 0

    def refused(status: int, kind: str, **body: Any) -> str:
        return openai_error(client.post("/v1/embeddings", json=body), status, kind)

    assert refused(400, "invalid_request_error", model="nomic-embed-text") == "invalid input"
    assert (
        refused(400, "invalid_request_error", model="nomic-embed-text", input=[]) == "invalid input"
    )
    assert (
        refused(
            400,
            "invalid_request_error",
            model="nomic-embed-text",
            input="x",
            encoding_format="int8",
        )
        == "Invalid value for 'encoding_format' = int8. Supported values: ['float', 'base64']."
    )
    assert refused(400, "api_error", model="nomic-embed-text", input=[[1, 2, 3]]) == (
        "invalid input type"
    )
    assert refused(404, "api_error", model="nope", input="x") == (
        'model "nope" not found, try pulling it first'
    )
    assert fake.last()["last_openai"]["model"] == "nope"
    assert fake.stats()["embed_calls"] == 10


# --------------------------------------------------------------------------- options, keep_alive


def test_last_bodies_keep_options_unchanged(fake: FakeOllama, client: httpx.Client) -> None:
    assert client.get("/_fake/last").json() == dict.fromkeys(
        ("last_chat", "last_generate", "last_embed", "last_embeddings", "last_openai")
    )
    options = {
        "num_ctx": 8192,
        "top_k": 20,
        "top_p": 0.9,
        "repeat_penalty": 1.1,
        "mirostat": 2,  # gone from Ollama's options: ignored, not refused
        "stop": ["\n\n"],
        "seed": 7,
    }
    body = {
        "model": "qwen2.5:0.5b",
        "messages": [{"role": "user", "content": "hi", "images": [b64(PNG)]}],
        "options": options,
        "keep_alive": "10m",
        "tools": [WEATHER],
        "format": SCHEMA,
        "stream": False,
    }
    assert client.post("/api/chat", json=body).status_code == 200
    generate = {
        "model": "gemma3:1b",
        "prompt": "x",
        "options": {"num_predict": 3},
        "keep_alive": -1,
    }
    assert client.post("/api/generate", json=generate).status_code == 200
    embed = {"model": EMBEDDER, "input": ["a"], "truncate": False, "keep_alive": 0}
    assert client.post("/api/embed", json=embed).status_code == 200
    openai = {"model": "gemma3:1b", "messages": [{"role": "user", "content": "x"}], "top_p": 0.5}
    assert client.post("/v1/chat/completions", json=openai).status_code == 200
    last = client.get("/_fake/last").json()
    assert last == {
        "last_chat": body,
        "last_generate": generate,
        "last_embed": embed,
        "last_embeddings": None,
        "last_openai": openai,
    }
    assert fake.last() == last
    assert fake.last("chat") == fake.last("last_chat") == body
    with pytest.raises(KeyError):
        fake.last("nothing")
    fake.reset()
    assert fake.last()["last_chat"] is None


def test_option_types_are_checked(client: httpx.Client) -> None:
    assert error(chat(client, "gemma3:1b", "hi", options={"top_k": "20"}), 500) == (
        'option "top_k" must be of type integer'
    )
    assert error(chat(client, "gemma3:1b", "hi", options={"temperature": "hot"}), 500) == (
        'option "temperature" must be of type float32'
    )
    assert error(chat(client, "gemma3:1b", "hi", options={"stop": "x"}), 500) == (
        'option "stop" must be of type array'
    )
    assert error(chat(client, "gemma3:1b", "hi", options={"stop": [1]}), 500) == (
        'option "stop" must be of an array of strings'
    )
    assert error(
        post(client, "/api/embed", model=EMBEDDER, input="x", options={"use_mmap": 1}), 500
    ) == ('option "use_mmap" must be of type boolean')
    fine = chat(
        client, "gemma3:1b", "hi", options={"num_ctx": 2048.0, "whatever": [1], "seed": None}
    )
    assert fine.status_code == 200
    # num_predict 0 (or less) does not limit, as in Ollama's runner.
    unlimited = post(
        client,
        "/api/generate",
        model="gemma3:1b",
        prompt="a b c d",
        options={"num_predict": 0},
        stream=False,
    )
    assert unlimited.json()["done_reason"] == "stop"


def test_keep_alive_and_num_ctx_show_in_ps(fake: FakeOllama, client: httpx.Client) -> None:
    now = time.time()
    chat(client, "gemma3:1b", "hi", keep_alive="1h30m", options={"num_ctx": 2048})
    post(client, "/api/generate", model="qwen2.5:0.5b", prompt="hi", keep_alive=60, stream=False)
    chat(client, THINKER, "hi", keep_alive=-1)
    running = client.get("/api/ps").json()["models"]
    assert [m["name"] for m in running] == [THINKER, "gemma3:1b", "qwen2.5:0.5b"]
    forever, long, short = (unix(m["expires_at"]) for m in running)
    # As Go's encoder writes a time.Time: nanoseconds with trailing zeros trimmed.
    for entry in running:
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d*[1-9])?Z", entry["expires_at"])
        assert list(entry) == [
            "name", "model", "size", "digest", "details", "expires_at", "size_vram",
            "context_length",
        ]  # fmt: skip
    assert forever > now + 200 * 365 * 86400
    assert abs(long - (now + 5400)) < 30 and abs(short - (now + 60)) < 30
    assert [m["context_length"] for m in running] == [4096, 2048, 4096]

    fake.load_ms = 250
    again = chat(client, "gemma3:1b", "hi", options={"num_ctx": 2048}).json()
    assert again["load_duration"] == 0  # still loaded with that context
    resized = chat(client, "gemma3:1b", "hi", options={"num_ctx": 1024}).json()
    assert resized["load_duration"] == 250_000_000  # a new context size reloads it

    once = chat(client, "gemma3:1b", "hi", keep_alive=0)
    assert once.status_code == 200
    assert "gemma3:1b" not in {m["name"] for m in client.get("/api/ps").json()["models"]}
    unload = post(client, "/api/generate", model="qwen2.5:0.5b", keep_alive="0s")
    assert unload.json()["done_reason"] == "unload" and unload.json()["response"] == ""
    unload_chat = post(client, "/api/chat", model=THINKER, messages=[], keep_alive=0).json()
    assert unload_chat["message"] == {"role": "assistant", "content": ""}
    assert unload_chat["done_reason"] == "unload"
    assert client.get("/api/ps").json() == {"models": []}

    assert error(chat(client, "gemma3:1b", "hi", keep_alive="5d"), 400) == (
        'time: unknown unit "d" in duration "5d"'
    )
    assert error(chat(client, "gemma3:1b", "hi", keep_alive="10"), 400) == (
        'time: missing unit in duration "10"'
    )
    assert error(chat(client, "gemma3:1b", "hi", keep_alive=True), 400) == (
        "Unsupported type: 'bool'"
    )
    assert _go_duration("1.5h") == 5_400_000_000_000
    assert _go_duration("-1m") == -60_000_000_000
    with pytest.raises(ValueError, match=r'^time: invalid duration "abc"$'):
        _go_duration("abc")


# --------------------------------------------------------------------------- OpenAI tools


def test_openai_tool_calls(client: httpx.Client) -> None:
    body = {
        "model": "qwen2.5:0.5b",
        "tools": [WEATHER, CLOCK],
        "messages": [{"role": "user", "content": "get_weather city=<Lyon> & get_time zone=CET"}],
    }
    whole = client.post("/v1/chat/completions", json=body).json()
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] == ""
    calls = message["tool_calls"]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in calls] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    for call in calls:
        assert call["id"].startswith("call_") and len(call["id"]) == 13
    # Go's json.Marshal: keys sorted, HTML characters escaped.
    assert calls[0]["function"]["arguments"] == '{"city":"\\u003cLyon\\u003e","days":0}'
    assert json.loads(calls[1]["function"]["arguments"]) == {"utc": True, "zone": "CET"}
    assert whole["usage"]["completion_tokens"] > 0

    events = sse(
        client, "/v1/chat/completions", **body, stream=True, stream_options={"include_usage": True}
    )
    *chunks, finish, usage, done = events
    assert done == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather", "get_time"]
    assert all(d["role"] == "assistant" and d["content"] == "" for d in deltas)
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert finish["choices"][0]["finish_reason"] == "tool_calls"
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]


def test_openai_tool_results_and_bad_tool_calls(client: httpx.Client) -> None:
    history: list[dict[str, Any]] = [
        {"role": "user", "content": "use get_weather"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "rain"},
    ]
    body = {"model": "qwen2.5:0.5b", "tools": [WEATHER], "messages": history}
    reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert reply["message"] == {
        "role": "assistant",
        "content": "Based on the tool result: get_weather returned rain",
    }
    assert reply["finish_reason"] == "stop"
    named = [*history[:2], {"role": "tool", "name": "forecast", "content": "sun"}]
    said = client.post("/v1/chat/completions", json={**body, "messages": named}).json()
    assert (
        said["choices"][0]["message"]["content"]
        == "Based on the tool result: forecast returned sun"
    )

    def refused(messages: list[dict[str, Any]]) -> str:
        reply = client.post("/v1/chat/completions", json={**body, "messages": messages})
        return openai_error(reply, 400, "invalid_request_error")

    bad_args = {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}
    assert refused([bad_args]) == "invalid tool call arguments"
    not_string = {**history[1], "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    assert refused([not_string]) == (
        "json: cannot unmarshal object into Go struct field .messages.tool_calls.function.arguments"
        " of type string"
    )
    assert (
        refused([{"role": "assistant", "content": None}]) == "invalid message content type: <nil>"
    )
    assert refused([{"role": 1, "content": "x"}]) == (
        "json: cannot unmarshal number into Go struct field Message.messages.role of type string"
    )
