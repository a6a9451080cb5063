"""The HTTP gateway, driven by the official ``ollama`` and ``openai`` clients, through a real
nats-server, the router, workers and the Ollama stand-in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec
import ollama
import openai
import pytest
from nats.aio.client import Client

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, free_port, wait_for_port
from schemas.events import AliasSet
from services.gateway.service import run as run_gateway
from services.gateway.settings import GatewaySettings
from services.runtime.bus import publish_event
from tests.harness import ServiceRunner, eventually, last_task_event, request, workers_live

THINKER = "qwen3:0.6b"
PLAIN = "qwen2.5:0.5b"


@dataclass
class Stack:
    url: str
    """The gateway's base URL."""
    nats_url: str
    ollama: FakeOllama


async def start_gateway(runner: ServiceRunner, nats_url: str, **settings: Any) -> str:
    port = free_port()
    runner.start(run_gateway, GatewaySettings(nats_url=nats_url, gateway_port=port, **settings))
    await asyncio.to_thread(wait_for_port, port)
    return f"http://127.0.0.1:{port}"


@asynccontextmanager
async def gateway_stack(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, models: list[str]
) -> AsyncIterator[Stack]:
    """Router, one worker on a stand-in serving ``models``, the gateway."""
    with FakeOllama(models=models) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)
        yield Stack(url=url, nats_url=nats_server.url, ollama=fake)
        await runner.stop_all()


@pytest.fixture
async def stack(nats_server: NatsServer, nc: Client, runner: ServiceRunner) -> AsyncIterator[Stack]:
    """A plain and a thinking model behind the gateway."""
    async with gateway_stack(nats_server, nc, runner, [PLAIN, THINKER]) as running:
        yield running


@pytest.fixture
async def oc(stack: Stack) -> AsyncIterator[ollama.AsyncClient]:
    """The official Ollama client, pointed at the gateway."""
    async with ollama.AsyncClient(host=stack.url) as client:
        yield client


@pytest.fixture
async def ai(stack: Stack) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official OpenAI client, pointed at the gateway's /v1."""
    async with openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused") as client:
        yield client


async def stored_failure(nc: Client, task_id: str) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        try:
            msg = await last_task_event(nc.jetstream(), task_id, "failed")
        except Exception:
            return None
        decoded: dict[str, Any] = msgspec.json.decode(msg.data or b"")
        return decoded

    found: dict[str, Any] = await eventually(check, timeout_s=10)
    return found


# -- the Ollama API ------------------------------------------------------------------------------


async def test_ollama_generate_whole_and_streamed(oc: ollama.AsyncClient) -> None:
    whole = await oc.generate(model=PLAIN, prompt="1+1は？")
    assert whole.response == "2"
    assert whole.done and whole.done_reason == "stop"
    assert whole.eval_count and whole.total_duration

    parts = [p async for p in await oc.generate(model=PLAIN, prompt="tell me", stream=True)]
    assert len(parts) > 2
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.response or "" for p in parts) == f"Echo from {PLAIN}: tell me"


async def test_ollama_chat_goes_to_the_backends_chat_api(
    stack: Stack, oc: ollama.AsyncClient
) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "what is 2+3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 6*7?"},
    ]

    reply = await oc.chat(model=PLAIN, messages=messages)
    parts = [p async for p in await oc.chat(model=PLAIN, messages=messages, stream=True)]

    assert reply.message.role == "assistant"
    assert reply.message.content == "42"  # the stand-in answers the last user message
    assert "".join(p.message.content or "" for p in parts) == "42"
    assert stack.ollama.stats()["chat_calls"] == 2


async def test_thinking_comes_back_in_ollamas_fields(oc: ollama.AsyncClient) -> None:
    generated = await oc.generate(model=THINKER, prompt="1+1は？")
    chatted = await oc.chat(model=THINKER, messages=[{"role": "user", "content": "2*3"}])
    streamed = [p async for p in await oc.generate(model=THINKER, prompt="2+2", stream=True)]
    quiet = await oc.generate(model=THINKER, prompt="3+3", think=False)

    assert generated.response == "2" and generated.thinking and "1+1" in generated.thinking
    assert chatted.message.content == "6" and chatted.message.thinking
    assert "".join(p.thinking or "" for p in streamed).startswith("Let me think")
    assert "".join(p.response or "" for p in streamed) == "4"
    assert quiet.response == "6" and not quiet.thinking


async def test_tags_version_and_ps(stack: Stack, oc: ollama.AsyncClient) -> None:
    assert sorted(m.model or "" for m in (await oc.list()).models) == [PLAIN, THINKER]
    async with httpx.AsyncClient(base_url=stack.url) as http:
        assert (await http.get("/api/version")).json()["version"]
        assert (await http.get("/")).text == "Ollama is running"
        assert (await http.head("/")).status_code == 200  # Ollama's CLI probes it

    stack.ollama.delay_s = 2.0  # long enough for a heartbeat to report the worker busy
    running = asyncio.create_task(oc.generate(model=THINKER, prompt="slow"))

    async def busy() -> list[str] | None:
        models = [m.model or "" for m in (await oc.ps()).models]
        return models or None

    assert await eventually(busy, timeout_s=5) == [THINKER]
    await running


# -- Ollama's model management: show, pull, preloads -------------------------------------------


async def test_show_describes_a_served_model_and_404s_others(
    stack: Stack, oc: ollama.AsyncClient
) -> None:
    shown = await oc.show(PLAIN)
    with pytest.raises(ollama.ResponseError) as unknown:
        await oc.show("nope:1b")
    async with httpx.AsyncClient(base_url=stack.url) as http:
        legacy = await http.post("/api/show", json={"name": THINKER})
        nameless = await http.post("/api/show", json={})

    # The facts the worker read from its backend (the stand-in's /api/show).
    assert shown.capabilities == ["completion", "tools"]
    assert shown.details is not None and shown.details.family == "qwen2"
    assert shown.modelinfo == {"general.architecture": "qwen2", "qwen2.context_length": 32768}
    assert shown.modified_at is not None
    assert shown.modelfile and f"FROM {PLAIN}" in shown.modelfile
    assert (unknown.value.status_code, unknown.value.error) == (404, "model 'nope:1b' not found")
    assert legacy.status_code == 200 and legacy.json()["workers"] == ["cpu-1"]
    assert nameless.status_code == 400 and nameless.json() == {"error": "model is required"}


async def test_show_pull_and_preload_follow_an_alias_as_the_router_does(
    stack: Stack, nc: Client, oc: ollama.AsyncClient
) -> None:
    """``ollama run <alias>`` shows, preloads and chats with the alias's name."""
    await publish_event(nc.jetstream(), AliasSet(at=time.time(), alias="house:1b", canonical=PLAIN))

    async def known() -> bool:
        reply, _ = await request(nc, "coordinator.workers", {})
        return bool(reply.get("aliases", {}).get("house:1b") == PLAIN)

    await eventually(known, timeout_s=5)
    shown = await oc.show("house:1b")
    pulled = await oc.pull("house:1b")
    loaded = await oc.generate(model="house:1b", prompt="")
    answer = await oc.generate(model="house:1b", prompt="1+1")

    assert shown.modelfile and "FROM house:1b" in shown.modelfile
    assert pulled.status == "success"
    assert loaded.done_reason == "load"
    assert answer.response == "2"


async def test_pull_of_a_served_model_pulls_it_again_where_it_is_and_of_others_says_where_to(
    stack: Stack, oc: ollama.AsyncClient
) -> None:
    """Through an open gateway (the operator's, as an Ollama without keys): a pull is one on
    the machines (tests/integration/test_gateway_models.py has the rest)."""
    streamed = [p.status async for p in await oc.pull(PLAIN, stream=True)]
    whole = await oc.pull(THINKER)
    with pytest.raises(ollama.ResponseError) as unknown:
        await oc.pull("nope:1b")
    with pytest.raises(ollama.ResponseError) as unknown_streamed:
        [p async for p in await oc.pull("nope:1b", stream=True)]

    assert streamed[0] == "pulling manifest" and streamed[-1] == "success"
    assert whole.status == "success"
    assert sum(call["api"] == "pull" for call in stack.ollama.calls()) == 2
    for error in (unknown.value, unknown_streamed.value):
        assert error.status_code == 404
        assert "'nope:1b' not found" in error.error and "X-Coordinator-Machines" in error.error


async def test_preloads_answer_at_once_and_route_no_task(
    stack: Stack, nc: Client, oc: ollama.AsyncClient
) -> None:
    routed = await nc.subscribe("coordinator.route")
    task_events = await nc.subscribe("events.task.>")
    backend_before = stack.ollama.stats()

    generated = await oc.generate(model=PLAIN, prompt="")
    chatted = await oc.chat(model=THINKER, messages=[])
    streamed = [p async for p in await oc.generate(model=PLAIN, prompt="", stream=True)]
    unloaded = await oc.generate(model=PLAIN, prompt="", keep_alive=0)
    chat_unloaded = await oc.chat(model=PLAIN, messages=[], keep_alive="0s")
    with pytest.raises(ollama.ResponseError) as unknown:
        await oc.chat(model="nope:1b", messages=[])
    await nc.flush()
    await asyncio.sleep(0.2)
    no_route, no_events = routed.pending_msgs, task_events.pending_msgs
    backend_after = stack.ollama.stats()
    # The same subscriptions do see a task when one is routed.
    assert (await oc.generate(model=PLAIN, prompt="1+1")).response == "2"
    await nc.flush()

    assert (generated.model, generated.response, generated.done) == (PLAIN, "", True)
    assert generated.done_reason == "load" and generated.created_at
    assert chatted.done_reason == "load"
    assert (chatted.message.role, chatted.message.content) == ("assistant", "")
    assert [(p.done, p.done_reason) for p in streamed] == [(True, "load")]
    assert unloaded.done_reason == "unload" and chat_unloaded.done_reason == "unload"
    assert (unknown.value.status_code, unknown.value.error) == (404, "model 'nope:1b' not found")
    assert (no_route, no_events) == (0, 0)
    assert backend_after == backend_before
    assert routed.pending_msgs == 1


async def test_the_ollama_cli_run_and_stop_flow(stack: Stack) -> None:
    """The requests ``ollama run``, ``ollama pull`` and ``ollama stop`` (0.12) send, with the
    bodies Go's client encodes (empty strings and nulls for what is not set)."""
    unset = {"suffix": "", "system": "", "template": "", "options": None}
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as http:
        heartbeat = await http.head("/")
        shown = await http.post(
            "/api/show",
            json={"model": "", "system": "", "template": "", "verbose": False, "options": None}
            | {"name": PLAIN},
        )
        loaded = await http.post("/api/generate", json={"model": PLAIN, "prompt": ""} | unset)
        chatted = await http.post(
            "/api/chat",
            json={
                "model": PLAIN,
                "messages": [{"role": "user", "content": "2+2"}],
                "options": {},
                "stream": False,
            },
        )
        stopped = await http.post(
            "/api/generate", json={"model": PLAIN, "prompt": "", "keep_alive": "0s"} | unset
        )
        chat_loaded = await http.post("/api/chat", json={"model": PLAIN, "messages": None})
        # An unknown model: show says 404, so the CLI pulls, and the pull says where to.
        missing = await http.post("/api/show", json={"model": "", "name": "nope:1b"})
        pulled = await http.post(
            "/api/pull", json={"model": "nope:1b", "username": "", "password": "", "name": ""}
        )

    assert heartbeat.status_code == 200
    assert shown.status_code == 200 and shown.json()["capabilities"] == ["completion", "tools"]
    assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"
    assert chatted.json()["message"]["content"] == "4"
    assert stopped.json()["done_reason"] == "unload"
    assert chat_loaded.json()["done_reason"] == "load"
    assert missing.status_code == 404 and pulled.status_code == 404
    assert "X-Coordinator-Machines" in pulled.json()["error"]


# -- the OpenAI API ------------------------------------------------------------------------------


async def test_openai_chat_completions_whole_and_streamed(ai: openai.AsyncOpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "what is 6*7"}]

    whole = await ai.chat.completions.create(model=PLAIN, messages=messages)
    stream = await ai.chat.completions.create(
        model=PLAIN, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]

    assert whole.choices[0].message.content == "42"
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    assert whole.id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "42"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0


async def test_openai_reasoning_and_legacy_completions(ai: openai.AsyncOpenAI) -> None:
    chat = await ai.chat.completions.create(
        model=THINKER, messages=[{"role": "user", "content": "1+1"}]
    )
    stream = await ai.chat.completions.create(
        model=THINKER, messages=[{"role": "user", "content": "2+2"}], stream=True
    )
    deltas = [c.choices[0].delta async for c in stream if c.choices]
    completion = await ai.completions.create(model=PLAIN, prompt="hello", max_tokens=50)
    streamed = [
        c.choices[0].text
        async for c in await ai.completions.create(model=PLAIN, prompt="3*3", stream=True)
    ]
    models = [m.id async for m in ai.models.list()]

    # Ollama's own /v1 names the thinking `reasoning`.
    assert chat.choices[0].message.content == "2"
    assert (chat.choices[0].message.model_extra or {})["reasoning"].startswith("Let me think")
    assert "".join((d.model_extra or {}).get("reasoning", "") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == "4"
    assert completion.choices[0].text == f"Echo from {PLAIN}: hello"
    assert "".join(streamed) == "9"
    assert sorted(models) == [PLAIN, THINKER]


# -- errors ----------------------------------------------------------------------------------------


async def test_an_unknown_model_is_404_in_each_apis_shape(
    oc: ollama.AsyncClient, ai: openai.AsyncOpenAI
) -> None:
    with pytest.raises(ollama.ResponseError) as ollama_error:
        await oc.generate(model="nope:1b", prompt="hi")
    with pytest.raises(openai.NotFoundError) as openai_error:
        await ai.chat.completions.create(
            model="nope:1b", messages=[{"role": "user", "content": "hi"}], stream=True
        )

    assert ollama_error.value.status_code == 404
    assert "nope:1b" in ollama_error.value.error
    body = openai_error.value.body
    assert isinstance(body, dict) and body["code"] == "no_worker"
    assert "nope:1b" in body["message"]


async def test_a_bad_body_is_400(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url) as http:
        not_json = await http.post("/api/generate", content=b"{oops")
        no_model = await http.post("/api/chat", json={"messages": []})
        tools = await http.post(
            "/v1/chat/completions",
            json={
                "model": PLAIN,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{}],
            },
        )
        route = await http.post("/route", json={"prompt": "x", "model": PLAIN, "typo": 1})

    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]
    assert no_model.status_code == 400
    assert tools.status_code == 400 and tools.json()["error"]["code"] == "bad_request"
    assert "tools[0]" in tools.json()["error"]["message"]
    assert route.status_code == 400 and route.json()["error"]["code"] == "bad_request"


async def test_no_live_worker_is_503_with_retry_after(
    nats_server: NatsServer, runner: ServiceRunner
) -> None:
    runner.router(nats_server.url)
    url = await start_gateway(runner, nats_server.url, gateway_retry_after_s=7)
    await asyncio.sleep(0.3)  # the router's endpoints
    async with httpx.AsyncClient(base_url=url) as http:
        reply = await http.post("/api/generate", json={"model": PLAIN, "prompt": "hi"})
        tags = await http.get("/api/tags")
        shown = await http.post("/api/show", json={"model": PLAIN})
        preload = await http.post("/api/generate", json={"model": PLAIN})

    assert reply.status_code == 503
    assert reply.headers["Retry-After"] == "7"
    assert "no worker is registered" in reply.json()["error"]
    assert tags.json() == {"models": []}
    for refused in (shown, preload):
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "7"
        assert "no inference worker is live" in refused.json()["error"]


async def test_no_router_is_503(nats_server: NatsServer, runner: ServiceRunner) -> None:
    url = await start_gateway(runner, nats_server.url)
    async with httpx.AsyncClient(base_url=url) as http:
        reply = await http.post("/v1/completions", json={"model": PLAIN, "prompt": "hi"})
    assert reply.status_code == 503
    assert reply.json()["error"]["code"] == "no_responder"


async def test_a_task_that_times_out_is_504(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with FakeOllama(models=[PLAIN]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url, gateway_task_timeout_s=0.5)
        await workers_live(nc, 1)
        fake.delay_s = 3.0

        async with ollama.AsyncClient(host=url) as client:
            with pytest.raises(ollama.ResponseError) as error:
                await client.generate(model=PLAIN, prompt="slow")
        await runner.stop_all()

    assert error.value.status_code == 504
    assert "backend_timeout" not in error.value.error  # the code is the status; text the reason
    assert "did not finish" in error.value.error


# -- a client that goes away -----------------------------------------------------------------------


async def hang_up_mid_stream(url: str, body: dict[str, Any]) -> str:
    """Stream ``/api/generate`` with ``body`` through the gateway at ``url``, hang up after
    the first piece, and return the task's id (its ``X-Coordinator-Task`` header)."""
    data = msgspec.json.encode(body)
    host, port = url.removeprefix("http://").split(":")
    # A plain socket, so hanging up is exactly that: no client library tidying up.
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /api/generate HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    await reader.readuntil(b"}\n")  # the first piece
    writer.close()
    await writer.wait_closed()
    return next(
        line.split(":", 1)[1].strip()
        for line in head.split("\r\n")
        if line.lower().startswith("x-coordinator-task:")
    )


async def test_a_client_that_disconnects_mid_stream_cancels_its_task(
    stack: Stack, nc: Client
) -> None:
    stack.ollama.chunk_delay_s = 0.2
    long_prompt = "please write about " + " ".join(f"topic{n}" for n in range(40))
    task_id = await hang_up_mid_stream(stack.url, {"model": PLAIN, "prompt": long_prompt})

    failed = await stored_failure(nc, task_id)
    assert failed["code"] == "cancelled"
    assert "disconnected" in failed["reason"]
    assert await eventually(lambda: _cancelled(stack.ollama))
    # The worker is free again at once.
    stack.ollama.chunk_delay_s = 0.0
    async with ollama.AsyncClient(host=stack.url) as client:
        assert (await client.generate(model=PLAIN, prompt="1+2")).response == "3"


async def _cancelled(fake: FakeOllama) -> bool:
    return fake.stats()["cancelled"] >= 1


async def test_a_client_that_gives_up_waiting_cancels_its_task(stack: Stack, nc: Client) -> None:
    stack.ollama.delay_s = 5.0
    subscription = await nc.subscribe("events.task.*.*.failed")
    async with httpx.AsyncClient(base_url=stack.url, timeout=0.5) as http:
        with pytest.raises(httpx.TimeoutException):
            await http.post(
                "/api/chat",
                json={
                    "model": PLAIN,
                    "stream": False,
                    "messages": [{"role": "user", "content": "slow"}],
                },
            )

    event = msgspec.json.decode((await subscription.next_msg(timeout=4)).data)
    assert event["code"] == "cancelled"  # long before the stand-in's 5 s were up


# -- the task API ----------------------------------------------------------------------------------


async def test_the_task_api_routes_and_shows_tasks(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, pg_dsn: str
) -> None:
    with FakeOllama(models=[PLAIN]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        runner.stats(nats_server.url, pg_dsn)
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            waited = await http.post("/route", json={"prompt": "2+5", "model": PLAIN, "wait": True})
            queued = await http.post("/route", json={"prompt": "hello", "model": PLAIN})
            lines = []
            async with http.stream(
                "POST", "/route", json={"prompt": "1+1", "model": PLAIN, "stream": True}
            ) as streamed:
                lines = [msgspec.json.decode(line) async for line in streamed.aiter_lines()]
            task_id = queued.json()["task_id"]

            async def done() -> dict[str, Any] | None:
                reply = await http.get(f"/task/{task_id}")
                body: dict[str, Any] = reply.json()
                return body if reply.status_code == 200 and body["status"] == "done" else None

            view = await eventually(done, timeout_s=15)
            missing = await http.get("/task/nope")
        await runner.stop_all()

    assert waited.status_code == 200 and waited.json()["response"] == "7"
    assert queued.json()["status"] == "queued"
    assert lines[0]["seq"] == 0  # the task id, before any output
    assert lines[-1]["status"] == "done" and lines[-1]["response"] == "2"
    assert view["response"] == f"Echo from {PLAIN}: hello"
    assert missing.status_code == 404


async def test_a_cancel_for_an_ended_task_is_refused(stack: Stack, nc: Client) -> None:
    body, headers = await request(nc, "coordinator.cancel", {"task_id": "ended-long-ago"})
    assert headers["Nats-Service-Error-Code"] == "not_found", body
