"""The gateway in front of a real model: llama.cpp's server with SmolLM2-135M behind a worker's
OpenAI-compatible backend, asked through the official ``openai`` and ``ollama`` clients."""

from __future__ import annotations

from typing import Any

import ollama
import openai
from nats.aio.client import Client

from tests.harness import ServiceRunner, workers_live
from tests.integration import test_real_model
from tests.integration.test_gateway import start_gateway
from tests.servers import NatsServer

# The same module-scoped fixture: llama.cpp's server on a free port, its OpenAI base URL.
llama_server = test_real_model.llama_server
MODEL = test_real_model.MODEL
CONVERSATION: list[Any] = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]


async def test_a_real_model_chats_through_the_gateway(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, llama_server: str
) -> None:
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
