"""Open WebUI 0.12 (open-webui 0.12.4 on PyPI) pointed at the gateway as its Ollama server.

Each request body below is built the way Open WebUI builds it (the file and function are named
at each), sent over real HTTP with aiohttp (the client Open WebUI uses) and with the headers it
sends, and each answer is read the way Open WebUI reads it. A real nats-server, the router, a
worker and the Ollama stand-in behind the gateway."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import aiohttp
import pytest
from nats.aio.client import Client

from devtools.servers import NatsServer
from tests.harness import ServiceRunner, eventually
from tests.integration.test_gateway import Stack, gateway_stack

CHAT = "qwen2.5:0.5b"
EMBEDDER = "nomic-embed-text:latest"
# What Open WebUI sends to every Ollama endpoint (routers/ollama.py, send_request and
# send_get_request through get_headers_and_cookies: JSON, and a bearer key when one is set).
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer unused"}
# A tool as the chat middleware passes it for native function calling (utils/middleware.py,
# the tools_dict loop: {"type": "function", "function": <the tool's spec>}).
WEATHER_SPEC = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city"}},
        "required": ["city"],
    },
}


@pytest.fixture
async def stack(nats_server: NatsServer, nc: Client, runner: ServiceRunner) -> AsyncIterator[Stack]:
    async with gateway_stack(nats_server, nc, runner, [CHAT, EMBEDDER]) as running:
        yield running


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(base_url=stack.url, headers=HEADERS) as session:
        yield session


def ollama_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped chat messages as Open WebUI hands them to Ollama (utils/payload.py,
    convert_messages_openai_to_ollama): text as is; an assistant turn's tool calls with
    ``index``, ``id`` and the arguments parsed, content ""; a tool result with its
    ``tool_call_id`` (and no ``tool_name``)."""
    converted = []
    for m in messages:
        out: dict[str, Any] = {"role": m["role"]}
        if m.get("tool_calls"):
            out["tool_calls"] = [
                {
                    "index": call.get("index", 0),
                    "id": call.get("id"),
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": json.loads(call["function"]["arguments"]),
                    },
                }
                for call in m["tool_calls"]
            ]
            out["content"] = ""
        else:
            out["content"] = m["content"]
            if m.get("tool_call_id"):
                out["tool_call_id"] = m["tool_call_id"]
        converted.append(out)
    return converted


def chat_payload(messages: list[dict[str, Any]], **openai_fields: Any) -> dict[str, Any]:
    """The /api/chat body of an OpenAI-shaped chat request to an Ollama model: utils/chat.py
    generate_chat_completion calls utils/payload.py convert_payload_openai_to_ollama (model,
    converted messages, stream, tools, options with max_tokens as num_predict, response_format
    as format), then routers/ollama.py generate_chat_completion drops ``metadata`` and sends
    the rest with None fields left out (model_dump(exclude_none=True))."""
    payload: dict[str, Any] = {
        "model": openai_fields["model"],
        "messages": ollama_messages(messages),
        "stream": openai_fields.get("stream", False),
    }
    if "tools" in openai_fields:
        payload["tools"] = openai_fields["tools"]
    options = dict(openai_fields.get("options") or {})
    if "max_tokens" in options:
        options["num_predict"] = options.pop("max_tokens")
    if options:
        payload["options"] = options
    return payload


def ollama_to_openai_chunk(line: dict[str, Any]) -> dict[str, Any]:
    """What utils/response.py convert_streaming_response_ollama_to_openai reads of each NDJSON
    line: message content, thinking and tool calls (convert_ollama_tool_call_to_openai: index,
    id, name, arguments dumped), done, done_reason, and the counts on the last line."""
    message = line.get("message") or {}
    calls = [
        {
            "index": call.get("index", call.get("function", {}).get("index", 0)),
            "id": call.get("id"),
            "name": call["function"]["name"],
            "arguments": json.dumps(call["function"].get("arguments", {})),
        }
        for call in message.get("tool_calls") or []
    ]
    return {
        "content": message.get("content"),
        "reasoning": message.get("thinking"),
        "tool_calls": calls,
        "done": line.get("done", False),
        "done_reason": line.get("done_reason"),
        "usage": (line.get("prompt_eval_count", 0), line.get("eval_count", 0))
        if line.get("done")
        else None,
    }


async def stream_chat(http: aiohttp.ClientSession, payload: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post("/api/chat", data=json.dumps(payload)) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("application/x-ndjson")
        # Open WebUI reads the stream a line at a time (utils/session_pool.py stream_wrapper).
        return [
            ollama_to_openai_chunk(json.loads(line))
            async for line in response.content
            if line.strip()
        ]


# -- the connection and the model list -----------------------------------------------------------


async def test_connection_check_model_list_and_loaded_models(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    # routers/ollama.py get_ollama_versions: the lowest version, compared as integers.
    async with http.get("/api/version") as response:
        version = (await response.json())["version"]
    assert tuple(map(int, re.sub(r"^v|-.*", "", version).split("."))) >= (0, 12, 0)

    # routers/ollama.py get_all_models / merge_models_lists: models keyed by "model".
    async with http.get("/api/tags") as response:
        models = {m["model"]: m for m in (await response.json())["models"]}
    assert set(models) == {CHAT, EMBEDDER}
    assert all(m["name"] and m["details"]["family"] and m["size"] > 0 for m in models.values())

    # get_all_models then reads /api/ps: expires_at per "model", read with fromisoformat.
    stack.ollama.delay_s = 2.0
    body = chat_payload([{"role": "user", "content": "slow"}], model=CHAT)
    running = asyncio.create_task(http.post("/api/chat", data=json.dumps(body)))

    async def loaded() -> dict[str, Any] | None:
        async with http.get("/api/ps") as response:
            found = {m["model"]: m["expires_at"] for m in (await response.json())["models"]}
        return found or None

    expires = await eventually(loaded, timeout_s=5)
    assert int(datetime.fromisoformat(expires[CHAT]).timestamp()) > 0
    (await running).release()


# -- chat: native function calling ---------------------------------------------------------------


async def test_native_function_calling_streams_tool_calls_and_takes_the_result(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    tools = [{"type": "function", "function": WEATHER_SPEC}]
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": 'What is the weather? Use get_weather with city="Paris".'},
    ]
    first = await stream_chat(
        http,
        chat_payload(history, model=CHAT, stream=True, tools=tools, options={"temperature": 0.7}),
    )

    calls = [call for chunk in first for call in chunk["tool_calls"]]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0]["id"]  # Open WebUI keeps the server's id for the result it sends back
    assert first[-1]["done"] and first[-1]["done_reason"] == "stop"
    assert first[-1]["usage"] is not None and first[-1]["usage"][0] > 0
    sent = stack.ollama.last()["last_chat"]
    assert sent["tools"] == tools and sent["options"] == {"temperature": 0.7}

    # The middleware appends the assistant's calls and each tool's result, OpenAI-shaped.
    history += [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "index": c["index"],
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 °C and sunny"},
    ]
    second = await stream_chat(http, chat_payload(history, model=CHAT, stream=True, tools=tools))

    text = "".join(chunk["content"] or "" for chunk in second)
    assert text == "Based on the tool result: get_weather returned 18 °C and sunny"
    assert not any(chunk["tool_calls"] for chunk in second)
    sent = stack.ollama.last()["last_chat"]["messages"]
    # The gateway names the tool whose result it is, from the call the result answers.
    assert sent[-1]["tool_name"] == "get_weather"
    assert sent[-2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


# -- background tasks: title and tags -------------------------------------------------------------


@pytest.mark.parametrize(
    ("task_prompt", "answer"),
    [
        # config.py DEFAULT_TITLE_GENERATION_PROMPT_TEMPLATE's opening lines.
        (
            "### Task:\nGenerate a concise title summarizing the chat history.",
            '{"title": "Weather in Paris"}',
        ),
        # config.py DEFAULT_TAGS_GENERATION_PROMPT_TEMPLATE's opening lines.
        (
            "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history",
            '{"tags": ["General", "Weather"]}',
        ),
    ],
)
async def test_title_and_tag_generation(
    stack: Stack, http: aiohttp.ClientSession, task_prompt: str, answer: str
) -> None:
    """routers/tasks.py generate_title and generate_chat_tags: one user message with the
    task's prompt, not streamed; apply_task_model_params puts the task model's max_tokens
    (1000 by default) in ``options``, which convert_payload_openai_to_ollama makes
    ``num_predict``."""
    stack.ollama.configure(replies={task_prompt[:40]: answer})
    history = "<chat_history>\nUSER: weather in Paris?\n</chat_history>"
    prompt = f"{task_prompt}\n### Chat History:\n{history}"
    payload = chat_payload(
        [{"role": "user", "content": prompt}], model=CHAT, options={"max_tokens": 1000}
    )
    async with http.post("/api/chat", data=json.dumps(payload)) as response:
        assert response.status == 200
        reply = await response.json()

    # utils/response.py convert_response_ollama_to_openai reads these.
    assert reply["message"]["content"] == answer
    assert reply["done_reason"] == "stop" and reply["model"] == CHAT
    assert reply["prompt_eval_count"] > 0 and reply["eval_count"] > 0
    assert stack.ollama.last()["last_chat"]["options"] == {"num_predict": 1000}


# -- embeddings for retrieval ---------------------------------------------------------------------


async def test_retrieval_embeds_batches_through_api_embed(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """retrieval/utils.py agenerate_ollama_batch_embeddings: ``{"input", "model",
    "truncate": true}`` to /api/embed, reading ``embeddings``; utils/embeddings.py (the
    /api/v1/embeddings proxy) sends convert_embed_payload_openai_to_ollama's body through
    routers/ollama.py embed (model_dump_json(exclude_none=True))."""
    texts = ["Paris is the capital of France.", "The weather in Paris is mild.", "Tokyo"]
    async with http.post(
        "/api/embed", data=json.dumps({"input": texts, "model": EMBEDDER, "truncate": True})
    ) as response:
        assert response.status == 200
        batch = await response.json()
    assert stack.ollama.last()["last_embed"]["truncate"] is True
    async with http.post(
        "/api/embed", data=json.dumps({"model": EMBEDDER, "input": "Tokyo"})
    ) as response:
        single = await response.json()

    assert len(batch["embeddings"]) == 3 and all(len(v) == 768 for v in batch["embeddings"])
    assert single["embeddings"] == [batch["embeddings"][2]]
