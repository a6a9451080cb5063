"""OpenAI's Responses API through the gateway, stateless as Ollama serves it, driven by the
official ``openai`` client's ``responses``: text and items, instructions, function tools and
their outputs, reasoning, a JSON schema, images, streaming, and what needs stored state
refused by name; and by the Codex CLI itself, run non-interactively. A real nats-server, the
router, a worker and the Ollama stand-in."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from nats.aio.client import Client

from devtools.servers import NatsServer
from tests.harness import ServiceRunner
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

# The Codex CLI, as scripts/bootstrap --test-model installs it (devtools/agents, pinned by npm).
CODEX = Path(__file__).parents[2] / "devtools" / "agents" / "node_modules" / ".bin" / "codex"
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
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
async def ai(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    client = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    async with client:
        yield client


async def test_a_response_whole_and_streamed_with_instructions(
    stack: Stack, ai: openai.AsyncOpenAI
) -> None:
    whole = await ai.responses.create(
        model=CHAT, input="what is 6*7", instructions="Answer briefly.", max_output_tokens=64
    )
    sent = last(stack.ollama, "last_chat")
    async with ai.responses.stream(model=CHAT, input="what is 6*7") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()

    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "completed" and whole.output_text == "42"
    assert whole.instructions == "Answer briefly." and whole.max_output_tokens == 64
    assert whole.usage is not None and whole.usage.output_tokens > 0
    assert sent["messages"] == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "what is 6*7"},
    ]
    assert sent["options"]["num_predict"] == 64
    assert final.output_text == "42" and final.status == "completed"
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds


async def test_function_tools_whole_streamed_and_their_outputs(
    stack: Stack, ai: openai.AsyncOpenAI
) -> None:
    whole = await ai.responses.create(model=CHAT, input=ASK_WEATHER, tools=[WEATHER])
    async with ai.responses.stream(model=CHAT, input=ASK_WEATHER, tools=[WEATHER]) as stream:
        streamed = await stream.get_final_response()

    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert last(stack.ollama, "last_chat")["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": WEATHER["parameters"],
                "description": "The weather in a city",
            },
        }
    ]
    (streamed_call,) = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(streamed_call.arguments) == {"city": "Paris"}

    turn: Any = [
        {"role": "user", "content": ASK_WEATHER},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    answer = await ai.responses.create(model=CHAT, input=turn, tools=[WEATHER])

    assert answer.output_text == "Based on the tool result: get_weather returned sunny"
    sent = last(stack.ollama, "last_chat")["messages"]
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert (sent[2]["role"], sent[2]["tool_name"]) == ("tool", "get_weather")


async def test_reasoning_comes_back_as_a_reasoning_item(
    stack: Stack, ai: openai.AsyncOpenAI
) -> None:
    # A thinking model thinks unless told not to (Ollama's default); an effort is a think
    # level, which only some models take (the stand-in's qwen3 refuses one, as Ollama does).
    whole = await ai.responses.create(model=THINKER, input="1+1")
    async with ai.responses.stream(model=THINKER, input="2+2") as stream:
        final = await stream.get_final_response()
    unthinking = await ai.responses.create(model=THINKER, input="3+3", reasoning={"effort": "none"})

    assert last(stack.ollama, "last_chat")["think"] is False
    assert [item.type for item in unthinking.output] == ["message"]
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    reasoning = whole.output[0]
    assert reasoning.type == "reasoning" and reasoning.summary[0].text.startswith("Let me think")
    assert whole.output_text == "2"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "4"


async def test_a_json_schema_and_an_image(stack: Stack, ai: openai.AsyncOpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    shaped = await ai.responses.create(
        model=CHAT,
        input="what is 6*7",
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    sent_format = last(stack.ollama, "last_chat")["format"]
    url = f"data:image/png;base64,{base64.b64encode(PIXEL).decode()}"
    seen = await ai.responses.create(
        model=VISION,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "describe"},
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                ],
            }
        ],
    )

    assert sent_format == schema and json.loads(shaped.output_text) == {"answer": 42}
    assert last(stack.ollama, "last_chat")["messages"][0]["images"] == [
        base64.b64encode(PIXEL).decode()
    ]
    assert "1 image" in seen.output_text


async def test_what_needs_stored_state_is_refused_by_name(ai: openai.AsyncOpenAI) -> None:
    refusals = []
    for fields in (
        {"previous_response_id": "resp_1"},
        {"store": True},
        {"tools": [{"type": "web_search"}]},
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await ai.responses.create(model=CHAT, input="hi", **fields)
        refusals.append(refused.value)
    with pytest.raises(openai.NotFoundError) as unknown:
        await ai.responses.create(model="nope:1b", input="hi")

    for error, name in zip(refusals, ("previous_response_id", "store", "web_search"), strict=True):
        assert error.code == "unsupported" and name in error.message
    assert unknown.value.code == "no_worker"


async def test_the_codex_cli_runs_a_command_on_the_fleets_model(
    stack: Stack, tmp_path: Path
) -> None:
    """``codex exec`` with a provider whose base URL is the gateway's ``/v1`` (the Responses
    wire API): Codex sends its instructions, its tools (a namespace among them), streamed. The
    model (the stand-in, which calls a tool its prompt names) calls exec_command; Codex runs
    it in its sandbox, sends the output back as a function_call_output, and the model's
    answer rests on it. Codex's built-in web search is turned off: the gateway refuses it."""
    assert CODEX.exists(), "the Codex CLI is missing: ./scripts/bootstrap --test-model installs it"
    home = tmp_path / "codex"
    home.mkdir()
    (home / "config.toml").write_text(
        f"""web_search = "disabled"
model = "{CHAT}"
model_provider = "fleet"

[model_providers.fleet]
name = "Coordinator"
base_url = "{stack.url}/v1"
wire_api = "responses"
"""
    )
    work = tmp_path / "project"
    work.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "CODEX_HOME": str(home)}
    agent = await asyncio.create_subprocess_exec(
        str(CODEX),
        "exec",
        "--skip-git-repo-check",
        "--sandbox",
        "workspace-write",
        "--json",
        'use exec_command to run "echo hello > out.txt"',
        cwd=work,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(agent.communicate(), timeout=120)

    events = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert agent.returncode == 0, (out, err)
    assert events[-1]["type"] == "turn.completed", events
    ran = [e["item"] for e in events if e.get("item", {}).get("type") == "command_execution"]
    assert ran and ran[-1]["exit_code"] == 0 and "echo hello > out.txt" in ran[-1]["command"]
    assert (work / "out.txt").read_text() == "hello\n"
    said = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
    assert said and said[-1].startswith("Based on the tool result: exec_command returned")
    sent = last(stack.ollama, "last_chat")
    assert "exec_command" in [tool["function"]["name"] for tool in sent["tools"]]
    assert sent["messages"][-1]["role"] == "tool"
    assert sent["messages"][-1]["tool_name"] == "exec_command"
