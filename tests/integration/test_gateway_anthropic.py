"""Anthropic's Messages API through the gateway, driven by the official ``anthropic`` client:
plain and streamed messages, a system prompt, tools and a tool-result turn, images, thinking,
token counts, errors in Anthropic's shape and the gateway's keys as ``x-api-key``; and by
Claude Code itself, run non-interactively. A real nats-server, the router, a worker and the
Ollama stand-in answering as Ollama does."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock
from nats.aio.client import Client

from devtools.servers import NatsServer
from services.gateway.keys import new_key
from tests.harness import ServiceRunner, last_task_event
from tests.integration.test_gateway import PLAIN as SERVED
from tests.integration.test_gateway import Stack, gateway_stack
from tests.integration.test_gateway_api import (
    ASK_WEATHER,
    CHAT,
    MODELS,
    PIXEL,
    THINKER,
    VISION,
    last,
)
from tests.integration.test_gateway_keys import add_key, fleet

# Claude Code, as scripts/bootstrap --test-model installs it (devtools/agents, pinned by npm).
CLAUDE = Path(__file__).parents[2] / "devtools" / "agents" / "node_modules" / ".bin" / "claude"
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture
async def stack(nats_server: NatsServer, nc: Client, runner: ServiceRunner) -> AsyncIterator[Stack]:
    async with gateway_stack(nats_server, nc, runner, MODELS) as running:
        yield running


@pytest.fixture
async def claude(stack: Stack) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """The official Anthropic client, its base URL the gateway's root (as Claude Code's
    ``ANTHROPIC_BASE_URL``)."""
    client = anthropic.AsyncAnthropic(base_url=stack.url, api_key="unused", max_retries=0)
    async with client:
        yield client


def user(content: Any) -> Any:
    return [{"role": "user", "content": content}]


async def test_a_message_whole_and_streamed_with_a_system_prompt(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    whole = await claude.messages.create(
        model=CHAT, max_tokens=64, system="Answer briefly.", messages=user("what is 6*7")
    )
    sent = last(stack.ollama, "last_chat")
    async with claude.messages.stream(
        model=CHAT, max_tokens=64, messages=user("what is 6*7")
    ) as stream:
        text = "".join([piece async for piece in stream.text_stream])
        final = await stream.get_final_message()

    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert [type(b) for b in whole.content] == [TextBlock]
    assert isinstance(whole.content[0], TextBlock) and whole.content[0].text == "42"
    assert whole.stop_reason == "end_turn" and whole.model == CHAT
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    # What reached Ollama's chat API: the system prompt first, max_tokens as num_predict.
    assert sent["messages"][0] == {"role": "system", "content": "Answer briefly."}
    assert sent["options"]["num_predict"] == 64
    assert text == "42"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0
    assert final.id.startswith("msg_")


async def test_a_message_is_a_task_like_any_other_in_the_event_log(
    nc: Client, claude: anthropic.AsyncAnthropic
) -> None:
    raw = await claude.messages.with_raw_response.create(
        model=CHAT, max_tokens=64, system="Answer briefly.", messages=user("what is 6*7")
    )
    task_id = raw.headers["X-Coordinator-Task"]
    js = nc.jetstream()
    submitted = msgspec.json.decode((await last_task_event(js, task_id, "submitted")).data or b"")
    completed = msgspec.json.decode((await last_task_event(js, task_id, "completed")).data or b"")

    assert (await raw.parse()).id == f"msg_{task_id}"
    assert [m["role"] for m in submitted["work"]["messages"]] == ["system", "user"]
    assert submitted["work"]["options"]["num_predict"] == 64
    assert (completed["response"], completed["model"]) == ("42", CHAT)


async def test_sampling_fields_reach_the_backend_as_ollamas_options(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    await claude.messages.create(
        model=CHAT,
        max_tokens=20,
        messages=user("hello"),
        stop_sequences=["\n\n"],
        # This SDK no longer offers them; older ones and other clients send them.
        extra_body={"temperature": 0.2, "top_p": 0.9, "top_k": 7},
    )

    options = last(stack.ollama, "last_chat")["options"]
    assert options == {
        "num_predict": 20,
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 7,
        "stop": ["\n\n"],
    }


async def test_tools_whole_streamed_and_the_tool_result_turn(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    whole = await claude.messages.create(
        model=CHAT, max_tokens=64, messages=user(ASK_WEATHER), tools=[WEATHER]
    )
    async with claude.messages.stream(
        model=CHAT, max_tokens=64, messages=user(ASK_WEATHER), tools=[WEATHER]
    ) as stream:
        streamed = await stream.get_final_message()

    assert whole.stop_reason == "tool_use"
    (call,) = [b for b in whole.content if isinstance(b, ToolUseBlock)]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert last(stack.ollama, "last_chat")["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["input_schema"],
                "description": "The weather in a city",
            },
        }
    ]
    (streamed_call,) = [b for b in streamed.content if isinstance(b, ToolUseBlock)]
    assert (streamed_call.name, streamed_call.input) == ("get_weather", {"city": "Paris"})
    assert streamed.stop_reason == "tool_use"

    turn: Any = [
        *user(ASK_WEATHER),
        {"role": "assistant", "content": [b.model_dump() for b in whole.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    answer = await claude.messages.create(model=CHAT, max_tokens=64, messages=turn, tools=[WEATHER])

    assert isinstance(answer.content[0], TextBlock)
    assert answer.content[0].text == "Based on the tool result: get_weather returned sunny"
    sent = last(stack.ollama, "last_chat")["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # The result's tool name came from the call it answers.
    assert (sent[2]["role"], sent[2]["tool_name"], sent[2]["content"]) == (
        "tool",
        "get_weather",
        "sunny",
    )


async def test_an_image_block_reaches_a_vision_model(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    data = base64.b64encode(PIXEL).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    answer = await claude.messages.create(
        model=VISION, max_tokens=64, messages=user([image, {"type": "text", "text": "describe"}])
    )

    sent = last(stack.ollama, "last_chat")["messages"][0]
    assert sent["images"] == [data] and sent["content"] == "describe"
    assert isinstance(answer.content[0], TextBlock) and "1 image" in answer.content[0].text


async def test_thinking_comes_back_as_thinking_blocks_whole_and_streamed(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    thinking: Any = {"type": "enabled", "budget_tokens": 1024}
    whole = await claude.messages.create(
        model=THINKER, max_tokens=256, messages=user("1+1"), thinking=thinking
    )
    think_sent = last(stack.ollama, "last_chat")["think"]
    async with claude.messages.stream(
        model=THINKER, max_tokens=256, messages=user("2+2"), thinking=thinking
    ) as stream:
        final = await stream.get_final_message()

    assert think_sent is True
    assert [type(b) for b in whole.content] == [ThinkingBlock, TextBlock]
    first, second = whole.content
    assert isinstance(first, ThinkingBlock) and first.thinking.startswith("Let me think")
    assert isinstance(second, TextBlock) and second.text == "2"
    assert [b.type for b in final.content] == ["thinking", "text"]
    streamed_thinking, streamed_text = final.content
    assert isinstance(streamed_thinking, ThinkingBlock) and streamed_thinking.thinking
    assert isinstance(streamed_text, TextBlock) and streamed_text.text == "4"


async def test_count_tokens_estimates_as_ollama_does(claude: anthropic.AsyncAnthropic) -> None:
    counted = await claude.messages.count_tokens(
        model=CHAT, system="Answer briefly.", messages=user("what is the weather in Paris")
    )
    more = await claude.messages.count_tokens(
        model=CHAT, messages=user("what is the weather in Paris " * 20), tools=[WEATHER]
    )

    assert 0 < counted.input_tokens < more.input_tokens


async def test_errors_come_in_anthropics_shape(
    stack: Stack, claude: anthropic.AsyncAnthropic
) -> None:
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await claude.messages.create(model="nope:1b", max_tokens=10, messages=user("hi"))
    with pytest.raises(anthropic.NotFoundError) as unknown_streamed:
        async with claude.messages.stream(
            model="nope:1b", max_tokens=10, messages=user("hi")
        ) as stream:
            await stream.get_final_message()
    async with httpx.AsyncClient(base_url=stack.url, timeout=10) as http:
        no_limit = await http.post(
            "/v1/messages", json={"model": CHAT, "messages": [{"role": "user", "content": "hi"}]}
        )
        server_tool = await http.post(
            "/v1/messages",
            json={
                "model": CHAT,
                "max_tokens": 10,
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
        )
        remote_image = await http.post(
            "/v1/messages",
            json={
                "model": VISION,
                "max_tokens": 10,
                "messages": user(
                    [{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]
                ),
            },
        )
        not_json = await http.post("/v1/messages", content=b"{")
        unknown_path = await http.post("/v1/messages/batches", json={})

    body = unknown.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error" and "nope:1b" in body["error"]["message"]
    assert body["error"]["code"] == "no_worker"
    assert unknown_streamed.value.status_code == 404
    for refused, needle in (
        (no_limit, "max_tokens"),
        (server_tool, "web_search_20250305"),
        (remote_image, "image source type 'url'"),
        (not_json, "messages request"),
    ):
        assert refused.status_code == 400, refused.text
        error = refused.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert needle in error["error"]["message"]
    assert unknown_path.status_code == 404
    assert unknown_path.json()["error"]["type"] == "not_found_error"


async def test_the_gateways_keys_are_taken_as_x_api_key_or_bearer(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    key = await add_key(nc, "alice")
    async with fleet(nats_server, nc, runner) as url, AsyncExitStack() as clients:

        def client(**auth: Any) -> anthropic.AsyncAnthropic:
            made = anthropic.AsyncAnthropic(base_url=url, max_retries=0, **auth)
            clients.push_async_callback(made.close)
            return made

        by_api_key = await client(api_key=key).messages.create(
            model=SERVED, max_tokens=10, messages=user("1+1")
        )
        by_token = await client(auth_token=key).messages.create(
            model=SERVED, max_tokens=10, messages=user("2+2")
        )
        with pytest.raises(anthropic.AuthenticationError) as wrong:
            await client(api_key=new_key()).messages.create(
                model=SERVED, max_tokens=10, messages=user("3+3")
            )

    assert isinstance(by_api_key.content[0], TextBlock) and by_api_key.content[0].text == "2"
    assert isinstance(by_token.content[0], TextBlock) and by_token.content[0].text == "4"
    body = wrong.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "authentication_error"
    assert "invalid API key" in body["error"]["message"]


async def test_claude_code_runs_a_tool_on_the_fleets_model_and_answers_from_its_result(
    stack: Stack, tmp_path: Path
) -> None:
    """``claude -p`` with ``ANTHROPIC_BASE_URL`` at the gateway: Claude Code sends its system
    prompt, its two dozen tools, adaptive thinking and an effort, streamed. The model (the
    stand-in, which calls a tool its prompt names) calls Bash; Claude Code runs the command,
    sends the result back as a tool_result, and the model's answer rests on it. The model has
    no thinking: it is asked without, as Ollama's Anthropic layer asks it."""
    assert CLAUDE.exists(), "Claude Code is missing: ./scripts/bootstrap --test-model installs it"
    work = tmp_path / "project"
    work.mkdir()
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp_path),
        "ANTHROPIC_BASE_URL": stack.url,
        "ANTHROPIC_API_KEY": "unused",
        "ANTHROPIC_MODEL": CHAT,
        "ANTHROPIC_SMALL_FAST_MODEL": CHAT,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    agent = await asyncio.create_subprocess_exec(
        str(CLAUDE),
        "-p",
        'use Bash to run "echo hello > out.txt"',
        "--output-format",
        "json",
        "--allowedTools",
        "Bash",
        cwd=work,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(agent.communicate(), timeout=120)

    result = json.loads(out)
    assert agent.returncode == 0 and not result["is_error"], (out, err)
    assert (work / "out.txt").read_text() == "hello\n"
    assert result["result"].startswith("Based on the tool result: Bash returned")
    sent = last(stack.ollama, "last_chat")
    assert "think" not in sent
    assert "Bash" in [tool["function"]["name"] for tool in sent["tools"]]
    call, answer = sent["messages"][-2:]
    assert call["tool_calls"][0]["function"]["arguments"]["command"] == "echo hello > out.txt"
    assert (answer["role"], answer["tool_name"]) == ("tool", "Bash")
