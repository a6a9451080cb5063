"""The backends against the Ollama stand-in (`devtools.fakes.ollama`): what each sends, what it
makes of the answers, how it names the failures.

The Ollama backend speaks Ollama's own API, every call over one aiohttp session (kept-alive
connections; one given up midway is closed).
The OpenAI backend speaks to the stand-in's ``/v1``, Ollama's OpenAI-compatible layer, a
server with no llama.cpp ``/props``. What arrived is read back from the stand-in
(``FakeOllama.last``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import math
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from devtools.fakes.ollama import FakeOllama
from devtools.servers import free_port
from schemas.route import ChatMessage, ToolCall
from schemas.vectors import unpack
from schemas.work import Work
from services.backends import Generation
from services.backends.ollama import OllamaBackend
from services.backends.openai import OpenAIBackend
from services.errors import (
    BackendError,
    BackendServerError,
    BackendTimeout,
    BackendUnavailable,
)

CHAT = "qwen2.5:0.5b"  # takes tools
PLAIN = "gemma3:1b"  # takes no tools
VISION = "gemma3:4b"
CODER = "qwen2.5-coder:1.5b"  # fills in the middle
THINKER = "qwen3:0.6b"
EMBEDDER = "nomic-embed-text:latest"  # embeds only, 768 dimensions
SERVED = [CHAT, PLAIN, VISION, CODER, THINKER, EMBEDDER]

# A 1x1 PNG, and the first bytes of the other kinds the OpenAI backend tells apart.
PNG = (
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6"
    "kgAAAABJRU5ErkJggg=="
)
JPEG = base64.b64encode(b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(16)).decode()
GIF = base64.b64encode(b"GIF89a" + bytes(16)).decode()
WEBP = base64.b64encode(b"RIFF\x24\x00\x00\x00WEBPVP8 " + bytes(16)).decode()

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
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


@pytest.fixture
def fake() -> Iterator[FakeOllama]:
    with FakeOllama(models=SERVED) as served:
        yield served


@pytest.fixture
async def ollama_backend(
    fake: FakeOllama, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[OllamaBackend]:
    """The Ollama backend, straight to the stand-in (a proxy in the environment would be
    taken, as httpx takes it)."""
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    backend = OllamaBackend(fake.url)
    yield backend
    await backend.aclose()


@pytest.fixture
async def openai_backend(fake: FakeOllama) -> AsyncIterator[OpenAIBackend]:
    backend = OpenAIBackend(f"{fake.url}/v1")
    yield backend
    await backend.aclose()


class Pieces:
    """What ``on_chunk`` was given, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, list[ToolCall] | None]] = []

    async def __call__(
        self, response: str, thinking: str, tool_calls: list[ToolCall] | None = None
    ) -> None:
        self.seen.append((response, thinking, tool_calls))

    @property
    def calls(self) -> list[list[ToolCall]]:
        return [calls for _, _, calls in self.seen if calls]


# -- Ollama: generation ------------------------------------------------------------------------


async def test_a_prompt_goes_to_generate_with_everything_as_given(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    options = {"num_predict": 32, "temperature": 0, "top_k": 5, "num_ctx": 2048, "seed": 7}
    result = await ollama_backend.generate(
        CHAT,
        Work(prompt="what is 6*7", options=options, keep_alive="10m", think=False),
        timeout_s=10,
    )

    sent = fake.last()["last_generate"]
    assert sent["prompt"] == "what is 6*7"
    assert sent["options"] == options  # whole, Ollama's names
    assert sent["keep_alive"] == "10m"
    assert sent["think"] is False
    assert "images" not in sent and "suffix" not in sent and "format" not in sent
    assert result.response == "42"
    assert result.done_reason == "stop"
    assert result.tool_calls is None
    assert result.tokens.prompt and result.tokens.eval
    assert result.first_token_ms is not None


async def test_a_schema_format_reaches_ollama_and_its_answer_follows_it(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    result = await ollama_backend.generate(
        CHAT, Work(prompt="Ann is 30", format=PERSON), timeout_s=10
    )
    assert fake.last()["last_generate"]["format"] == PERSON
    json_result = await ollama_backend.generate(
        CHAT, Work(prompt="anything", format="json"), timeout_s=10
    )

    assert fake.last()["last_generate"]["format"] == "json"
    answer = json.loads(result.response)
    assert isinstance(answer["name"], str) and isinstance(answer["age"], int)
    assert isinstance(json.loads(json_result.response), dict)


async def test_images_go_with_the_prompt_and_a_suffix_to_generate(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    seen = await ollama_backend.generate(
        VISION, Work(prompt="what is this?", images=[PNG]), timeout_s=10
    )
    assert fake.last()["last_generate"]["images"] == [PNG]
    assert seen.response.endswith("]") and "1 image" in seen.response

    await ollama_backend.generate(
        CODER, Work(prompt="def add(a, b):", suffix="    return c"), timeout_s=10
    )
    assert fake.last()["last_generate"]["suffix"] == "    return c"


async def test_tools_without_a_conversation_go_to_chat_as_one_user_message(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    pieces = Pieces()
    result = await ollama_backend.generate(
        CHAT,
        Work(
            prompt='get_weather and get_time for "Paris"',
            options={"temperature": 0},
            tools=[WEATHER, TIME],
            images=[PNG],
        ),
        timeout_s=10,
        on_chunk=pieces,
    )

    sent = fake.last()["last_chat"]
    assert sent["messages"] == [
        {"role": "user", "content": 'get_weather and get_time for "Paris"', "images": [PNG]}
    ]
    assert sent["tools"] == [WEATHER, TIME]
    assert fake.stats()["generate_calls"] == 0
    assert result.tool_calls == [
        ToolCall(name="get_weather", arguments={"city": "Paris"}, index=0),
        ToolCall(name="get_time", arguments={"city": "Paris"}, index=1),
    ]
    assert pieces.calls == [[call] for call in result.tool_calls]  # each as it came, whole
    assert result.response == ""
    assert result.done_reason == "tool_calls"  # Ollama said "stop"
    assert result.first_token_ms is not None


async def test_a_conversation_with_tool_calls_and_results_goes_in_ollamas_shape(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    messages = [
        ChatMessage(role="user", content="weather in Paris?", images=[PNG]),
        ChatMessage(
            role="assistant",
            tool_calls=[
                ToolCall(name="get_weather", arguments={"city": "Paris"}),
                # as an OpenAI client gives them: text that is a JSON object
                ToolCall(name="get_time", arguments='{"city": "Paris"}', id="call_9", index=1),
            ],
        ),
        ChatMessage(role="tool", content="sunny", tool_name="get_weather"),
        ChatMessage(role="tool", content="noon", tool_name="get_time", tool_call_id="call_9"),
    ]
    result = await ollama_backend.generate(
        CHAT, Work(prompt="", messages=messages, tools=[WEATHER, TIME]), timeout_s=10
    )

    assert fake.last()["last_chat"]["messages"] == [
        {"role": "user", "content": "weather in Paris?", "images": [PNG]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                # A call id goes along when the client gave one (newer Ollamas read it).
                {"function": {"name": "get_time", "arguments": {"city": "Paris"}}, "id": "call_9"},
            ],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        {"role": "tool", "content": "noon", "tool_name": "get_time", "tool_call_id": "call_9"},
    ]
    assert result.response.startswith("Based on the tool result")
    assert result.tool_calls is None
    assert result.done_reason == "stop"


async def test_thinking_is_kept_apart(ollama_backend: OllamaBackend) -> None:
    result = await ollama_backend.generate(
        THINKER, Work(prompt="what is 2+2", think=True), timeout_s=10
    )

    assert result.response == "4"
    assert result.thinking


async def test_ollamas_refusals_are_backend_errors_in_its_words(
    ollama_backend: OllamaBackend,
) -> None:
    with pytest.raises(BackendError, match="does not support tools"):
        await ollama_backend.generate(PLAIN, Work(prompt="hi", tools=[WEATHER]), timeout_s=10)
    with pytest.raises(BackendError, match="does not support generate"):
        await ollama_backend.generate(EMBEDDER, Work(prompt="hi"), timeout_s=10)


@pytest.mark.parametrize("kind", ["ollama", "openai"])
async def test_the_servers_own_failures_are_told_from_refusals(
    kind: str, ollama_backend: OllamaBackend, openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    """A 5xx, an error mid-stream, a stream cut short: the server failed at its own work
    (another may do it); a reset connection: unreachable; a 4xx: the request's own fault."""
    backend = ollama_backend if kind == "ollama" else openai_backend
    plain = Work(prompt="one two three four five six")
    for status in (500, 503):
        fake.configure(fail_status=status)
        with pytest.raises(BackendServerError, match=f"HTTP {status}"):
            await backend.generate(CHAT, plain, timeout_s=10)
        with pytest.raises(BackendServerError, match=f"HTTP {status}"):
            await backend.embed(EMBEDDER, Work(prompt="", input=["hi"]), timeout_s=10)
    fake.configure(fail_status=400)
    with pytest.raises(BackendError, match="HTTP 400") as refused:
        await backend.generate(CHAT, plain, timeout_s=10)
    assert not isinstance(refused.value, BackendServerError) and not refused.value.retryable
    fake.configure(fail_status=None, error_after_chunks=2)
    with pytest.raises(BackendServerError, match="reported an error"):
        await backend.generate(CHAT, plain, timeout_s=10)
    fake.configure(error_after_chunks=None, reset_after_chunks=0)
    with pytest.raises(BackendUnavailable):
        await backend.generate(CHAT, plain, timeout_s=10)
    fake.configure(reset_after_chunks=2)
    with pytest.raises(BackendUnavailable):
        await backend.generate(CHAT, plain, timeout_s=10)
    fake.configure(reset_after_chunks=None)
    assert (await backend.generate(CHAT, plain, timeout_s=10)).response


async def test_a_generation_past_its_deadline_is_a_timeout(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    fake.configure(delay_s=2.0)
    with pytest.raises(BackendTimeout):
        await ollama_backend.generate(CHAT, Work(prompt="hi"), timeout_s=0.3)


async def test_a_server_that_is_not_there_is_unavailable() -> None:
    backend = OllamaBackend(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(BackendUnavailable):
            await backend.generate(CHAT, Work(prompt="hi"), timeout_s=5)
        with pytest.raises(BackendUnavailable):
            await backend.embed(
                EMBEDDER, Work(prompt="", task_type="embedding", input=["hi"]), timeout_s=5
            )
    finally:
        await backend.aclose()


async def test_every_call_keeps_one_connection(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    """Every call read to its end, generations, the model list and embeddings alike, keeps
    the one connection: a connection per task costs more than the rest of the request."""
    for _ in range(3):
        assert (await ollama_backend.generate(CHAT, Work(prompt="hi"), timeout_s=10)).response
    assert fake.stats()["connections"] == 1
    for _ in range(2):
        await ollama_backend.list_models()
        await ollama_backend.embed(
            EMBEDDER, Work(prompt="", task_type="embedding", input=["hi"]), timeout_s=10
        )
        await ollama_backend.generate(
            CHAT, Work(prompt="hi", messages=[ChatMessage(role="user", content="hi")]), timeout_s=10
        )
    assert fake.stats()["connections"] == 1


async def test_a_generation_given_up_midway_closes_its_connection(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    """A cancelled generation closes its connection, which is how Ollama learns to stop;
    the next call goes on a new one."""
    fake.configure(chunk_delay_s=0.5)
    first_piece = asyncio.Event()

    async def seen(response: str, thinking: str, tool_calls: list[ToolCall] | None = None) -> None:
        first_piece.set()

    call = asyncio.create_task(
        ollama_backend.generate(
            CHAT, Work(prompt="tell me a long story"), timeout_s=30, on_chunk=seen
        )
    )
    await asyncio.wait_for(first_piece.wait(), 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    for _ in range(100):
        if fake.stats()["cancelled"]:
            break
        await asyncio.sleep(0.05)
    assert fake.stats()["cancelled"] == 1
    fake.configure(chunk_delay_s=0.0)
    assert (await ollama_backend.generate(CHAT, Work(prompt="hi"), timeout_s=10)).response
    assert fake.stats()["connections"] == 2


async def test_a_proxy_in_the_environment_is_taken_unless_no_proxy_says_otherwise(
    fake: FakeOllama, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "all_proxy", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # nothing listens
    proxied = OllamaBackend(fake.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    direct = OllamaBackend(fake.url)
    try:
        with pytest.raises(BackendUnavailable):
            await proxied.generate(CHAT, Work(prompt="hi"), timeout_s=5)
        assert (await direct.generate(CHAT, Work(prompt="hi"), timeout_s=5)).response
    finally:
        await proxied.aclose()
        await direct.aclose()


async def test_a_kept_connection_closed_without_an_answer_is_replaced() -> None:
    """A server that closes a kept-alive connection instead of answering on it (closed while
    idle, as the request went out): the request goes once more, on a new connection."""
    done = b'{"response":"ok","done":false}\n{"response":"","done":true,"done_reason":"stop"}\n'
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(done), done)
    )
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            for answered in range(2):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                if answered:
                    break  # the second request on this connection: closed, no answer
                writer.write(answer)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    backend = OllamaBackend(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        for _ in range(2):
            result = await backend.generate(CHAT, Work(prompt="hi"), timeout_s=10)
            assert result.response == "ok" and result.done_reason == "stop"
        assert connections == 2
    finally:
        await backend.aclose()
        server.close()


# -- Ollama: embeddings ------------------------------------------------------------------------


async def test_embed_sends_every_input_at_once_and_packs_unit_vectors(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    result = await ollama_backend.embed(
        EMBEDDER,
        Work(
            prompt="",
            task_type="embedding",
            input=["the cat sat", "stock prices fell"],
            truncate=True,
            dimensions=256,
            keep_alive=0,
            options={"num_ctx": 256},
        ),
        timeout_s=10,
    )

    assert fake.last()["last_embed"] == {
        "model": EMBEDDER,
        "input": ["the cat sat", "stock prices fell"],
        "truncate": True,
        "dimensions": 256,
        "keep_alive": 0,
        "options": {"num_ctx": 256},
    }
    assert fake.stats()["embed_calls"] == 1
    vectors = [unpack(v) for v in result.vectors]
    assert [len(v) for v in vectors] == [256, 256]
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-5) for v in vectors)
    assert vectors[0] != vectors[1]
    assert result.tokens.prompt == 6
    assert result.durations.total_ms > 0


async def test_embed_without_normalizing_uses_the_older_api_once_per_input(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    own = await ollama_backend.embed(
        EMBEDDER,
        Work(
            prompt="",
            task_type="embedding",
            input=["the cat sat", "dogs bark"],
            normalize=False,
            keep_alive="1m",
        ),
        timeout_s=10,
    )
    unit = await ollama_backend.embed(
        EMBEDDER,
        Work(prompt="", task_type="embedding", input=["the cat sat", "dogs bark"]),
        timeout_s=10,
    )

    assert fake.stats()["embed_calls"] == 3
    vectors = [unpack(v) for v in own.vectors]
    assert [len(v) for v in vectors] == [768, 768]
    assert not math.isclose(math.hypot(*vectors[0]), 1.0, rel_tol=1e-3)  # the model's own
    # the same direction as the unit vector
    scale = math.hypot(*vectors[0])
    assert all(
        math.isclose(a / scale, b, abs_tol=1e-5)
        for a, b in zip(vectors[0], unpack(unit.vectors[0]), strict=True)
    )


async def test_embedding_refusals_carry_ollamas_message(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    long_text = " ".join(["word"] * 600)  # past the embedding model's 512-token context
    with pytest.raises(BackendError, match="input exceeds maximum context length"):
        await ollama_backend.embed(
            EMBEDDER,
            Work(prompt="", task_type="embedding", input=[long_text], truncate=False),
            timeout_s=10,
        )
    cut = await ollama_backend.embed(
        EMBEDDER, Work(prompt="", task_type="embedding", input=[long_text]), timeout_s=10
    )
    assert cut.tokens.prompt == 512  # Ollama's default: truncate
    with pytest.raises(BackendError, match="not found"):
        await ollama_backend.embed(
            "missing:latest", Work(prompt="", task_type="embedding", input=["hi"]), timeout_s=10
        )
    fake.configure(delay_s=2.0)
    with pytest.raises(BackendTimeout):
        await ollama_backend.embed(
            EMBEDDER, Work(prompt="", task_type="embedding", input=["hi"]), timeout_s=0.3
        )


# -- Ollama: model facts -----------------------------------------------------------------------


async def test_model_facts_come_from_tags_and_show(
    ollama_backend: OllamaBackend, fake: FakeOllama
) -> None:
    facts = await ollama_backend.model_facts([*SERVED, "gone:latest"])

    assert set(facts) == set(SERVED)  # a model whose show fails is left out
    assert facts[CHAT].capabilities == ["completion", "tools"]
    assert facts[PLAIN].capabilities == ["completion"]
    assert "vision" in facts[VISION].capabilities
    assert "insert" in facts[CODER].capabilities
    assert "thinking" in facts[THINKER].capabilities
    assert facts[EMBEDDER].capabilities == ["embedding"]
    assert facts[CHAT].context_length == 32768
    assert facts[EMBEDDER].context_length == 512
    tags = {t["name"]: t for t in _tags(fake)}
    for name in SERVED:
        assert facts[name].digest == tags[name]["digest"]
        assert facts[name].size == tags[name]["size"]
        assert facts[name].modified_at == tags[name]["modified_at"]
        assert facts[name].details.family == tags[name]["details"]["family"]


def _tags(fake: FakeOllama) -> list[dict[str, Any]]:
    models: list[dict[str, Any]] = httpx.get(f"{fake.url}/api/tags").json()["models"]
    return models


# -- OpenAI-compatible: Ollama's /v1 -----------------------------------------------------------


async def test_openai_requests_carry_the_conversation_in_openais_shape(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    messages = [
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="look", images=[PNG, JPEG, WEBP, "bm90IGFuIGltYWdl"]),
        ChatMessage(
            role="assistant",
            tool_calls=[
                ToolCall(name="get_weather", arguments={"city": "Paris"}),
                ToolCall(name="get_time", arguments={"city": "Paris"}, index=1),
            ],
        ),
        ChatMessage(role="tool", content="noon", tool_name="get_time"),
        ChatMessage(role="tool", content="sunny", tool_name="get_weather"),
    ]
    await openai_backend.generate(
        VISION,
        Work(
            prompt="",
            options={"num_predict": 8, "top_k": 3, "repeat_penalty": 1.1, "num_ctx": 99},
            messages=messages,
            format=PERSON,
            keep_alive="5m",
        ),
        timeout_s=10,
    )

    sent = fake.last()["last_openai"]
    urls = [part["image_url"]["url"] for part in sent["messages"][1]["content"][1:]]
    assert [url.split(";", 1)[0] for url in urls] == [
        "data:image/png",
        "data:image/jpeg",
        "data:image/webp",
        "data:image/png",  # not an image kind it knows: PNG
    ]
    assert urls[0] == f"data:image/png;base64,{PNG}"
    assert sent["messages"][1]["content"][0] == {"type": "text", "text": "look"}
    assert sent["messages"][2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"city": "Paris"}'},
            },
        ],
    }
    # Tool turns without call ids answer the calls of their tool
    assert sent["messages"][3] == {
        "role": "tool",
        "content": "noon",
        "tool_call_id": "call_1",
        "name": "get_time",
    }
    assert sent["messages"][4]["tool_call_id"] == "call_0"
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": PERSON, "strict": True},
    }
    assert sent["max_tokens"] == 8
    assert sent["top_k"] == 3
    assert sent["repeat_penalty"] == sent["repetition_penalty"] == 1.1
    assert "num_ctx" not in sent and "keep_alive" not in sent
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}


async def test_openai_gif_images_are_labelled_so_and_ollama_refuses_them(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    """Ollama's ``/v1`` takes JPEG, PNG and WebP data URLs only (llama.cpp decodes GIF)."""
    with pytest.raises(BackendError, match="invalid image input"):
        await openai_backend.generate(VISION, Work(prompt="look", images=[GIF]), timeout_s=10)

    [_, image] = fake.last()["last_openai"]["messages"][0]["content"]
    assert image["image_url"]["url"] == f"data:image/gif;base64,{GIF}"


async def test_openai_tool_calls_are_put_together_and_reported_once(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    pieces = Pieces()
    result = await openai_backend.generate(
        CHAT,
        Work(
            prompt='get_weather and get_time for "Paris"',
            options={"temperature": 0},
            tools=[WEATHER, TIME],
        ),
        timeout_s=10,
        on_chunk=pieces,
    )

    assert fake.last()["last_openai"]["tools"] == [WEATHER, TIME]
    assert result.tool_calls is not None
    assert [(c.name, c.arguments, c.index) for c in result.tool_calls] == [
        ("get_weather", {"city": "Paris"}, 0),
        ("get_time", {"city": "Paris"}, 1),
    ]
    assert all(c.id for c in result.tool_calls)  # the server's ids
    assert pieces.calls == [result.tool_calls]
    assert result.done_reason == "tool_calls"


async def test_openai_json_format_and_a_plain_answer(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    result: Generation = await openai_backend.generate(
        CHAT, Work(prompt="what is 1+1", format="json"), timeout_s=10
    )

    assert fake.last()["last_openai"]["response_format"] == {"type": "json_object"}
    assert json.loads(result.response) == {"response": "2"}
    assert result.done_reason == "stop"
    assert result.tool_calls is None


async def test_openai_suffix_is_refused(openai_backend: OpenAIBackend) -> None:
    with pytest.raises(BackendError, match="suffix"):
        await openai_backend.generate(CODER, Work(prompt="a", suffix="b"), timeout_s=10)


async def test_openai_embeddings_in_input_order(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    result = await openai_backend.embed(
        EMBEDDER,
        Work(
            prompt="",
            task_type="embedding",
            input=["the cat sat", "stock prices fell"],
            dimensions=128,
        ),
        timeout_s=10,
    )
    native = OllamaBackend(fake.url)
    try:
        same = await native.embed(
            EMBEDDER,
            Work(
                prompt="",
                task_type="embedding",
                input=["the cat sat", "stock prices fell"],
                dimensions=128,
            ),
            timeout_s=10,
        )
    finally:
        await native.aclose()

    sent = fake.last()["last_openai"]
    assert sent["input"] == ["the cat sat", "stock prices fell"]
    assert sent["encoding_format"] == "float" and sent["dimensions"] == 128
    assert result.vectors == same.vectors
    assert result.tokens.prompt == 6
    with pytest.raises(BackendError, match="not found"):
        await openai_backend.embed(
            "missing", Work(prompt="", task_type="embedding", input=["hi"]), timeout_s=10
        )


async def test_openai_model_facts_without_props_say_completion(
    openai_backend: OpenAIBackend, fake: FakeOllama
) -> None:
    facts = await openai_backend.model_facts([CHAT, EMBEDDER])

    assert facts[CHAT].capabilities == ["completion"]  # /v1 says nothing more
    assert facts[EMBEDDER].capabilities == ["completion"]
    assert fake.stats()["embed_calls"] == 0  # no probe: it could load a model
