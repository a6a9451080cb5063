"""The gateway in front of a real model: llama.cpp's server with SmolLM2-135M behind a worker's
OpenAI-compatible backend, asked through the official ``openai``, ``ollama`` and ``anthropic``
clients (chat, the Responses API and the Messages API)."""

from __future__ import annotations

import json
import math
from typing import Any

import anthropic
import ollama
import openai
import pydantic
import pytest
from nats.aio.client import Client

from devtools.servers import NatsServer
from tests.harness import ServiceRunner, workers_live
from tests.integration import test_real_model
from tests.integration.test_gateway import start_gateway

# The same module-scoped fixture: llama.cpp's server on a free port, its OpenAI base URL.
llama_server = test_real_model.llama_server
MODEL = test_real_model.MODEL
CONVERSATION: list[Any] = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


async def llama_gateway(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, llama_server: str
) -> str:
    """The router, a worker whose OpenAI-compatible backend is ``llama_server``, and the
    gateway (its URL), the worker live."""
    runner.router(nats_server.url)
    runner.worker(
        nats_server.url,
        "http://unused",
        "llama",
        worker_backend="openai",
        openai_base_url=llama_server,
    )
    url = await start_gateway(runner, nats_server.url)
    await workers_live(nc, 1)
    return url


async def test_a_real_model_chats_through_the_gateway(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, llama_server: str
) -> None:
    url = await llama_gateway(nats_server, nc, runner, llama_server)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as ai:
        whole = await ai.chat.completions.create(
            model=MODEL,
            messages=CONVERSATION,
            max_tokens=16,
            temperature=0,
        )
        stream = await ai.chat.completions.create(
            model=MODEL,
            messages=CONVERSATION,
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    async with ollama.AsyncClient(host=url) as client:
        chatted = await client.chat(
            model=MODEL, messages=CONVERSATION, options={"num_predict": 16, "temperature": 0}
        )

    text = whole.choices[0].message.content or ""
    assert text.strip()
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == text  # temperature 0: the same answer, streamed
    assert (chatted.message.content or "").strip()
    assert chatted.eval_count and chatted.eval_count > 0


async def test_a_real_model_answers_the_responses_and_messages_apis_whole_and_streamed(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, llama_server: str
) -> None:
    url = await llama_gateway(nats_server, nc, runner, llama_server)
    question = CONVERSATION[1]["content"]
    instructions = CONVERSATION[0]["content"]

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as ai:
        response = await ai.responses.create(
            model=MODEL,
            input=question,
            instructions=instructions,
            max_output_tokens=16,
            temperature=0,
        )
        async with ai.responses.stream(
            model=MODEL,
            input=question,
            instructions=instructions,
            max_output_tokens=16,
            temperature=0,
        ) as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
    claude = anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)
    async with claude:
        message = await claude.messages.create(
            model=MODEL,
            max_tokens=16,
            system=instructions,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},
        )
        async with claude.messages.stream(
            model=MODEL,
            max_tokens=16,
            system=instructions,
            messages=[{"role": "user", "content": question}],
            extra_body={"temperature": 0},
        ) as streamed:
            pieces = [piece async for piece in streamed.text_stream]
            final = await streamed.get_final_message()

    text = response.output_text
    assert text.strip() and response.usage is not None and response.usage.output_tokens > 0
    assert len(deltas) > 1 and "".join(deltas) == text  # temperature 0: the same answer
    said = message.content[0]
    assert isinstance(said, anthropic.types.TextBlock) and said.text == text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    assert len(pieces) > 1 and "".join(pieces) == text
    assert final.usage.output_tokens == message.usage.output_tokens


# llama.cpp's server with vectors and a tools-aware chat template (module-scoped as well).
llama_tools_server = test_real_model.llama_tools_server


WEATHER_TOOLS: Any = [test_real_model.WEATHER_TOOL]


class Person(pydantic.BaseModel):
    name: str
    age: int
    retired: bool


async def test_a_real_model_embeds_follows_a_schema_and_calls_a_tool_through_the_gateway(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, llama_tools_server: str
) -> None:
    """What the issue of a front door is judged by, with the official clients and a real
    model: vectors (Ollama's and OpenAI's endpoints), structured output that validates, and
    a tool call in the shape llama.cpp produces, all routed as tasks."""
    runner.router(nats_server.url)
    runner.worker(
        nats_server.url,
        "http://unused",
        "llama",
        worker_backend="openai",
        openai_base_url=llama_tools_server,
    )
    url = await start_gateway(runner, nats_server.url)
    await workers_live(nc, 1, timeout_s=120)

    async with ollama.AsyncClient(host=url) as client:
        shown = await client.show(MODEL)
        embedded = await client.embed(model=MODEL, input=["the cat sat", "stock prices fell"])
    assert shown.capabilities is not None
    assert {"completion", "tools", "embedding"} <= set(shown.capabilities)
    assert [len(v) for v in embedded.embeddings] == [576, 576]
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-3) for v in embedded.embeddings)

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused") as ai:
        # The client asks for base64 and decodes it itself.
        vectors = await ai.embeddings.create(model=MODEL, input=["the cat sat"])
        parsed = await ai.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=Person,
            max_tokens=96,
            temperature=0,
        )
        called = await ai.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": "What is the weather in Paris? Use the tool."},
                # SmolLM2-135M does not start a call by itself: its turn is begun for it.
                {"role": "assistant", "content": "<tool_call>\n"},
            ],
            tools=WEATHER_TOOLS,
            tool_choice="required",
            stop=["</tool_call>"],
            max_tokens=48,
            temperature=0,
        )

    assert vectors.data[0].embedding == pytest.approx(embedded.embeddings[0], abs=1e-6)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    assert call.id
