"""The whole of Ollama's and OpenAI's APIs through the gateway, driven by the official
``ollama`` and ``openai`` clients: tools and tool turns, structured output, images, options and
keep_alive, embeddings, capabilities, model listings from the workers' facts, bare names,
body limits and refusals. A real nats-server, the router, a worker and the Ollama stand-in."""

from __future__ import annotations

import base64
import hashlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import openai
import pydantic
import pytest
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.vectors import pack
from tests.harness import ServiceRunner
from tests.integration.test_gateway import Stack, gateway_stack, start_gateway

CHAT = "qwen2.5:0.5b"  # tools
THINKER = "qwen3:0.6b"  # tools, thinking
PLAIN = "gemma3:1b"  # completion only
VISION = "gemma3:4b"
EMBEDDER = "nomic-embed-text:latest"
MODELS = [CHAT, THINKER, PLAIN, VISION, EMBEDDER]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK_WEATHER = 'call get_weather for city="Paris"'
# A 1x1 transparent PNG.
PIXEL = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="
)


@pytest.fixture
async def stack(nats_server: NatsServer, nc: Client, runner: ServiceRunner) -> AsyncIterator[Stack]:
    async with gateway_stack(nats_server, nc, runner, MODELS) as running:
        yield running


@pytest.fixture
async def oc(stack: Stack) -> AsyncIterator[ollama.AsyncClient]:
    async with ollama.AsyncClient(host=stack.url) as client:
        yield client


@pytest.fixture
async def ai(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused") as client:
        yield client


def last(fake: FakeOllama, api: str) -> dict[str, Any]:
    """The last body the stand-in received on ``api`` (``last_chat``, ``last_embed``, ...)."""
    body: dict[str, Any] = fake.last()[api]
    return body


# -- tools --------------------------------------------------------------------------------------


async def test_ollama_tools_whole_streamed_and_the_tool_turn(
    stack: Stack, oc: ollama.AsyncClient
) -> None:
    asked = [{"role": "user", "content": ASK_WEATHER}]
    whole = await oc.chat(model=CHAT, messages=asked, tools=[WEATHER])
    parts = [
        p async for p in await oc.chat(model=CHAT, messages=asked, tools=[WEATHER], stream=True)
    ]

    (call,) = whole.message.tool_calls or []
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert whole.done_reason == "stop"
    assert last(stack.ollama, "last_chat")["tools"] == [WEATHER]  # unchanged
    streamed = [c for p in parts for c in p.message.tool_calls or []]
    assert [c.function.name for c in streamed] == ["get_weather"]
    assert not any(p.done for p in parts if p.message.tool_calls)  # done: false, as Ollama
    assert parts[-1].done

    turn: list[Any] = [
        *asked,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    answer = await oc.chat(model=CHAT, messages=turn, tools=[WEATHER])
    assert answer.message.content == "Based on the tool result: get_weather returned sunny"
    sent = last(stack.ollama, "last_chat")["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2]["tool_name"] == "get_weather"


async def test_openai_tools_whole_streamed_and_the_tool_turn(
    stack: Stack, ai: openai.AsyncOpenAI
) -> None:
    asked: list[Any] = [{"role": "user", "content": ASK_WEATHER}]
    tools: Any = [WEATHER]
    whole = await ai.chat.completions.create(model=CHAT, messages=asked, tools=tools)
    stream = await ai.chat.completions.create(model=CHAT, messages=asked, tools=tools, stream=True)
    chunks = [c async for c in stream]

    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function and d.function.name) for d in deltas] == [(0, "get_weather")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

    turn: list[Any] = [
        *asked,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = await ai.chat.completions.create(model=CHAT, messages=turn, tools=tools)
    # The tool's name came from the call its result answers.
    assert answer.choices[0].message.content == (
        "Based on the tool result: get_weather returned sunny"
    )
    sent = last(stack.ollama, "last_chat")["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2]["tool_name"] == "get_weather"


async def test_tools_to_a_model_without_them_are_refused_in_each_apis_shape(
    oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    messages: Any = [{"role": "user", "content": ASK_WEATHER}]
    with pytest.raises(ollama.ResponseError) as ollama_error:
        await oc.chat(model=PLAIN, messages=messages, tools=[WEATHER])
    with pytest.raises(openai.BadRequestError) as openai_error:
        await ai.chat.completions.create(model=PLAIN, messages=messages, tools=[WEATHER])  # type: ignore[list-item]
    with pytest.raises(ollama.ResponseError) as embedder:
        await oc.generate(model=EMBEDDER, prompt="hello")

    assert ollama_error.value.status_code == 400
    assert ollama_error.value.error == f"{PLAIN} does not support tools"
    body = openai_error.value.body
    assert isinstance(body, dict) and body["code"] == "unsupported_capability"
    assert body["message"] == f"{PLAIN} does not support tools"
    assert embedder.value.status_code == 400 and "does not support" in embedder.value.error


# -- structured output --------------------------------------------------------------------------


class Answer(pydantic.BaseModel):
    answer: str
    confidence: int


async def test_ollama_format_json_and_schema(stack: Stack, oc: ollama.AsyncClient) -> None:
    as_json = await oc.generate(model=CHAT, prompt="1+1", format="json")
    schema = Answer.model_json_schema()
    as_schema = await oc.chat(
        model=CHAT, messages=[{"role": "user", "content": "2+3"}], format=schema
    )

    assert json.loads(as_json.response or "") == {"response": "2"}
    assert last(stack.ollama, "last_generate")["format"] == "json"
    assert Answer.model_validate_json(as_schema.message.content or "").answer == "5"
    assert last(stack.ollama, "last_chat")["format"] == schema


async def test_openai_response_format_and_parse(stack: Stack, ai: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "6*7"}]
    as_json = await ai.chat.completions.create(
        model=CHAT, messages=messages, response_format={"type": "json_object"}
    )
    parsed = await ai.chat.completions.parse(model=CHAT, messages=messages, response_format=Answer)

    assert json.loads(as_json.choices[0].message.content or "") == {"response": "42"}
    answer = parsed.choices[0].message.parsed
    assert isinstance(answer, Answer) and answer.answer == "42"
    # .parse() sends {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}.
    sent = last(stack.ollama, "last_chat")["format"]
    assert sent["type"] == "object" and set(sent["properties"]) == {"answer", "confidence"}


# -- images -------------------------------------------------------------------------------------


async def test_images_reach_a_vision_model(
    stack: Stack, oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    generated = await oc.generate(model=VISION, prompt="what is this?", images=[PIXEL])
    chatted = await oc.chat(
        model=VISION, messages=[{"role": "user", "content": "and this?", "images": [PIXEL]}]
    )
    data_url = f"data:image/png;base64,{base64.b64encode(PIXEL).decode()}"
    content: Any = [
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]
    completed = await ai.chat.completions.create(
        model=VISION, messages=[{"role": "user", "content": content}]
    )
    sent = last(stack.ollama, "last_chat")["messages"][0]

    digest = hashlib.sha256(PIXEL).hexdigest()[:12]
    for text in (generated.response, chatted.message.content, completed.choices[0].message.content):
        assert text is not None and f"sha256:{digest}" in text
    assert sent["images"] == [base64.b64encode(PIXEL).decode()] and sent["content"] == "describe"


async def test_remote_and_broken_images_are_400(stack: Stack, ai: openai.AsyncOpenAI) -> None:
    remote: Any = [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        await ai.chat.completions.create(
            model=VISION, messages=[{"role": "user", "content": remote}]
        )
    async with httpx.AsyncClient(base_url=stack.url) as http:
        broken = await http.post(
            "/api/generate", json={"model": VISION, "prompt": "x", "images": ["not base64!"]}
        )

    body = refused.value.body
    assert isinstance(body, dict) and body["code"] == "unsupported"
    assert "remote images are not fetched" in body["message"] and "data:" in body["message"]
    assert broken.status_code == 400 and "images[0] is not base64" in broken.json()["error"]


# -- options and keep_alive ---------------------------------------------------------------------


async def test_options_and_keep_alive_reach_the_backend_unchanged(
    stack: Stack, oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    options = {"temperature": 0.1, "top_k": 5, "num_ctx": 2048, "seed": 3, "stop": ["END"]}
    await oc.chat(
        model=CHAT, messages=[{"role": "user", "content": "1+1"}], options=options, keep_alive="7m"
    )
    sent = last(stack.ollama, "last_chat")
    assert (sent["options"], sent["keep_alive"]) == (options, "7m")

    await oc.generate(model=CHAT, prompt="2+2", options={"num_predict": 4}, keep_alive=30)
    generated = last(stack.ollama, "last_generate")
    assert (generated["options"], generated["keep_alive"]) == ({"num_predict": 4}, 30)

    await ai.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "3+3"}],
        temperature=0.2,
        top_p=0.5,
        seed=9,
        stop=["X"],
        max_completion_tokens=12,
        presence_penalty=0.3,
        frequency_penalty=0.4,
    )
    assert last(stack.ollama, "last_chat")["options"] == {
        "temperature": 0.2,
        "top_p": 0.5,
        "seed": 9,
        "stop": ["X"],
        "num_predict": 12,
        "presence_penalty": 0.3,
        "frequency_penalty": 0.4,
    }

    # Ollama's own options on /v1 (num_ctx, which coding agents need long) are carried, where
    # Ollama's /v1 drops them; OpenAI's own fields win over the same option.
    await ai.chat.completions.create(
        model=CHAT,
        messages=[{"role": "user", "content": "4+4"}],
        temperature=0.7,
        extra_body={"options": {"num_ctx": 32768, "temperature": 0.0}},
    )
    assert last(stack.ollama, "last_chat")["options"] == {"num_ctx": 32768, "temperature": 0.7}
    await ai.responses.create(model=CHAT, input="5+5", extra_body={"options": {"num_ctx": 8192}})
    assert last(stack.ollama, "last_chat")["options"] == {"num_ctx": 8192}
    with pytest.raises(openai.BadRequestError) as wrong:
        await ai.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "6+6"}],
            extra_body={"options": ["num_ctx"]},
        )
    assert wrong.value.code == "bad_request" and "options" in wrong.value.message


# -- embeddings ---------------------------------------------------------------------------------


def norm(vector: Any) -> float:
    return math.sqrt(sum(v * v for v in vector))


async def test_embeddings_in_every_api(
    stack: Stack, oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    texts = ["the cat sat", "the cat ran", "stock prices fell"]
    embedded = await oc.embed(model=EMBEDDER, input=texts, truncate=True, keep_alive="2m")
    single = await oc.embed(model="nomic-embed-text", input="the cat sat")  # a bare name
    cut = await oc.embed(model=EMBEDDER, input="the cat sat", dimensions=64)
    legacy = await oc.embeddings(model=EMBEDDER, prompt="the cat sat")
    floats = await ai.embeddings.create(model=EMBEDDER, input=texts, encoding_format="float")
    packed = await ai.embeddings.create(model=EMBEDDER, input=texts, encoding_format="base64")
    defaulted = await ai.embeddings.create(model=EMBEDDER, input="the cat sat")  # base64 by default

    vectors = [list(v) for v in embedded.embeddings]
    assert [len(v) for v in vectors] == [768, 768, 768]
    assert all(abs(norm(v) - 1) < 1e-5 for v in vectors)
    assert list(single.embeddings[0]) == vectors[0]
    assert len(cut.embeddings[0]) == 64 and abs(norm(cut.embeddings[0]) - 1) < 1e-5
    assert len(legacy.embedding) == 768 and abs(norm(legacy.embedding) - 1) > 1e-3  # raw
    assert embedded.prompt_eval_count and embedded.total_duration
    assert [d.embedding for d in floats.data] == vectors
    # Asked for, base64 is the text as sent: the float32 bytes, exactly.
    assert [base64.b64decode(str(d.embedding)) for d in packed.data] == [pack(v) for v in vectors]
    # Not asked for, the client asks for base64 and decodes it itself.
    assert pack(defaulted.data[0].embedding) == pack(vectors[0])
    assert floats.usage.prompt_tokens > 0 and floats.model == EMBEDDER
    sent = last(stack.ollama, "last_embed")
    assert sent["input"] == ["the cat sat"]


async def test_nothing_to_embed_is_answered_without_a_task(
    stack: Stack, oc: ollama.AsyncClient
) -> None:
    before = stack.ollama.stats()["embed_calls"]
    empty = await oc.embed(model=EMBEDDER, input=[])
    async with httpx.AsyncClient(base_url=stack.url) as http:
        legacy = await http.post("/api/embeddings", json={"model": EMBEDDER, "prompt": ""})
        unknown = await http.post("/api/embed", json={"model": "nope:1b", "input": []})

    assert list(empty.embeddings) == []
    assert legacy.json() == {"embedding": []}
    assert unknown.status_code == 404
    assert stack.ollama.stats()["embed_calls"] == before


# -- model listings from facts, bare names ------------------------------------------------------


async def test_show_tags_and_models_carry_the_workers_facts(
    oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    shown = {model: await oc.show(model) for model in (CHAT, THINKER, PLAIN, VISION, EMBEDDER)}
    tags = {m.model: m for m in (await oc.list()).models}
    retrieved = await ai.models.retrieve(CHAT)
    bare = await ai.models.retrieve("nomic-embed-text")
    with pytest.raises(openai.NotFoundError) as missing:
        await ai.models.retrieve("nope:1b")

    assert shown[CHAT].capabilities == ["completion", "tools"]
    assert shown[THINKER].capabilities == ["completion", "tools", "thinking"]
    assert shown[PLAIN].capabilities == ["completion"]
    assert shown[VISION].capabilities == ["completion", "vision"]
    assert shown[EMBEDDER].capabilities == ["embedding"]
    info = shown[CHAT].modelinfo or {}
    assert info["general.architecture"] == "qwen2" and info["qwen2.context_length"] > 0
    digests = [t.digest for t in tags.values()]
    assert len(set(digests)) == len(MODELS) and all(len(d or "") == 64 for d in digests)
    assert all((t.size or 0) > 0 and t.details and t.details.family for t in tags.values())
    assert (retrieved.id, retrieved.object, retrieved.owned_by) == (CHAT, "model", "library")
    assert retrieved.created > 0 and bare.id == "nomic-embed-text"
    body = missing.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"


async def test_bare_names_resolve_to_latest(oc: ollama.AsyncClient) -> None:
    shown = await oc.show("nomic-embed-text")
    loaded = await oc.embed(model="nomic-embed-text", input=[])
    pulled = await oc.pull("nomic-embed-text")
    assert shown.capabilities == ["embedding"]
    assert list(loaded.embeddings) == [] and pulled.status == "success"


# -- limits and refusals ------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_413_in_each_apis_shape(
    stack: Stack, nats_server: NatsServer, runner: ServiceRunner
) -> None:
    url = await start_gateway(runner, nats_server.url, gateway_max_body_bytes=4096)
    big = {"model": CHAT, "prompt": "x" * 8000}

    async def chunked() -> AsyncIterator[bytes]:
        yield json.dumps(big).encode()

    async with httpx.AsyncClient(base_url=url) as http:
        ollama_413 = await http.post("/api/generate", json=big)
        openai_413 = await http.post(
            "/v1/chat/completions",
            json={"model": CHAT, "messages": [{"role": "user", "content": "x" * 8000}]},
        )
        streamed_413 = await http.post("/api/generate", content=chunked())
        fits = await http.post(
            "/api/generate", json={"model": CHAT, "prompt": "1+1", "stream": False}
        )

    assert ollama_413.status_code == 413 and "GATEWAY_MAX_BODY_BYTES" in ollama_413.json()["error"]
    assert openai_413.status_code == 413
    assert openai_413.json()["error"]["code"] == "too_large"
    assert "4096 bytes" in openai_413.json()["error"]["message"]
    assert streamed_413.status_code == 413 and "error" in streamed_413.json()
    assert fits.json()["response"] == "2"


async def test_every_refusal_gets_one_log_line(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        with capture_logs() as logs:
            await http.post("/api/chat", content=b"{oops")
            await http.post("/api/generate", json={"model": CHAT, "prompt": "x", "raw": True})
            await http.post(
                "/api/chat",
                json={
                    "model": PLAIN,
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": [WEATHER],
                },
            )

    lines = [
        (e["path"], e["model"], e["status"], e["code"]) for e in logs if e["event"] == "request"
    ]
    assert lines == [
        ("/api/chat", "", 400, "bad_request"),
        ("/api/generate", CHAT, 400, "unsupported"),
        ("/api/chat", PLAIN, 400, "unsupported_capability"),
    ]
