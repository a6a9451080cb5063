"""The Ollama stand-in itself: shapes, streaming, knobs, counters, and the command line."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.fakes.ollama import FakeOllama

REPO = Path(__file__).resolve().parents[2]
DURATIONS = ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration")


@pytest.fixture
def fake() -> Iterator[FakeOllama]:
    with FakeOllama() as server:
        yield server


@pytest.fixture
def client(fake: FakeOllama) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, timeout=10) as http:
        yield http


def generate(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/api/generate", json=body)


def stream_lines(client: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/x-ndjson"
        assert reply.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in reply.headers
        return [json.loads(line) for line in reply.iter_lines() if line.strip()]


def test_root_version_and_unknown_paths(client: httpx.Client) -> None:
    root = client.get("/")
    assert root.status_code == 200
    assert root.text == "Ollama is running"
    assert client.get("/api/version").json() == {"version": "0.12.0"}
    missing = client.get("/api/nothing")
    assert missing.status_code == 404
    assert missing.json() == {"error": "not found"}


def test_tags_shape(fake: FakeOllama, client: httpx.Client) -> None:
    reply = client.get("/api/tags")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("application/json")
    models = reply.json()["models"]
    assert [m["name"] for m in models] == ["qwen2.5:0.5b", "gemma3:1b"]
    for entry in models:
        assert {"name", "model", "modified_at", "size", "digest", "details"} <= entry.keys()
        assert entry["model"] == entry["name"]
        assert isinstance(entry["size"], int) and entry["size"] > 0
        assert len(entry["digest"]) == 64
        details = entry["details"]
        assert details["format"] == "gguf"
        assert {"family", "parameter_size", "quantization_level"} <= details.keys()

    fake.models = ["llama3.2:1b"]
    assert [m["name"] for m in client.get("/api/tags").json()["models"]] == ["llama3.2:1b"]


def test_generate_not_streamed_answers_arithmetic_with_ns_durations(
    client: httpx.Client,
) -> None:
    reply = generate(client, model="qwen2.5:0.5b", prompt="1+1は？", stream=False)
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json; charset=utf-8"
    assert int(reply.headers["content-length"]) == len(reply.content)
    body = reply.json()
    assert body["model"] == "qwen2.5:0.5b"
    assert body["response"] == "2"
    assert "thinking" not in body
    assert body["done"] is True
    assert body["done_reason"] == "stop"
    assert body["created_at"].endswith("Z")
    for key in (*DURATIONS, "prompt_eval_count", "eval_count"):
        assert isinstance(body[key], int), key
    assert body["eval_count"] >= 1 and body["prompt_eval_count"] >= 1
    # Nanoseconds: a token takes at least a microsecond.
    assert body["eval_duration"] >= 1_000 * body["eval_count"]
    assert body["total_duration"] >= (
        body["load_duration"] + body["prompt_eval_duration"] + body["eval_duration"]
    )
    product = generate(client, model="gemma3:1b", prompt="What is 6 * 7?", stream=False)
    assert product.json()["response"] == "42"
    echo = generate(client, model="gemma3:1b", prompt="hello", stream=False)
    assert echo.json()["response"] == "Echo from gemma3:1b: hello"


def test_delay_and_cold_start_show_in_durations(fake: FakeOllama, client: httpx.Client) -> None:
    fake.configure(delay_s=0.2, load_ms=300)
    first = generate(client, model="gemma3:1b", prompt="hi", stream=False).json()
    second = generate(client, model="gemma3:1b", prompt="hi", stream=False).json()
    assert first["load_duration"] == 300_000_000
    assert second["load_duration"] == 0
    assert first["total_duration"] >= 500_000_000
    assert second["total_duration"] >= 200_000_000


def test_streamed_generate_matches_the_whole_answer(client: httpx.Client) -> None:
    prompt = "Tell me a short story about a cat on a warm roof"
    lines = stream_lines(client, "/api/generate", model="gemma3:1b", prompt=prompt)
    assert len(lines) >= 3
    *pieces, last = lines
    assert all(line["done"] is False and line["model"] == "gemma3:1b" for line in pieces)
    assert last["done"] is True
    assert last["response"] == ""
    assert last["done_reason"] == "stop"
    assert last["context"] == []
    assert last["eval_count"] == len(pieces)
    for key in DURATIONS:
        assert isinstance(last[key], int)
    whole = generate(client, model="gemma3:1b", prompt=prompt, stream=False).json()
    assert "".join(line["response"] for line in pieces) == whole["response"]
    assert whole["response"] == f"Echo from gemma3:1b: {prompt}"

    short = stream_lines(client, "/api/generate", model="gemma3:1b", prompt="1+1は？")
    assert [line["response"] for line in short] == ["2", ""]


def test_thinking_model_keeps_thinking_apart(fake: FakeOllama, client: httpx.Client) -> None:
    fake.models = [*fake.models, "qwen3:0.6b"]
    whole = generate(client, model="qwen3:0.6b", prompt="1+1は？", stream=False).json()
    assert whole["response"] == "2"
    assert whole["thinking"].startswith("Let me think about: 1+1は？")
    assert "think" not in whole["response"]

    lines = stream_lines(client, "/api/generate", model="qwen3:0.6b", prompt="1+1は？")
    thinking = [line for line in lines if line.get("thinking")]
    answer = [line for line in lines if line["response"]]
    assert thinking and all(line["response"] == "" for line in thinking)
    assert lines.index(thinking[-1]) < lines.index(answer[0])  # thinking comes first
    assert "".join(line["thinking"] for line in thinking) == whole["thinking"]
    assert "".join(line["response"] for line in answer) == "2"
    assert "thinking" not in lines[-1]
    assert lines[-1]["eval_count"] == len(thinking) + len(answer)

    no_think = generate(client, model="qwen3:0.6b", prompt="1+1は？", stream=False, think=False)
    assert "thinking" not in no_think.json()
    refused = generate(client, model="gemma3:1b", prompt="hi", stream=False, think=True)
    assert refused.status_code == 400
    assert refused.json() == {"error": '"gemma3:1b" does not support thinking'}


def test_chat_uses_message_instead_of_response(fake: FakeOllama, client: httpx.Client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3?"}]
    whole = client.post(
        "/api/chat", json={"model": "gemma3:1b", "messages": messages, "stream": False}
    ).json()
    assert whole["message"] == {"role": "assistant", "content": "6"}
    assert "response" not in whole and "context" not in whole
    assert whole["done"] is True

    fake.models = ["qwen3:0.6b"]
    lines = stream_lines(client, "/api/chat", model="qwen3:0.6b", messages=messages)
    assert lines[0]["message"]["thinking"]
    assert "".join(line["message"]["content"] for line in lines) == "6"
    assert lines[-1]["done"] is True and lines[-1]["message"]["content"] == ""
    assert client.get("/_fake/stats").json()["chat_calls"] == 2


def test_unknown_model_and_bad_bodies(client: httpx.Client) -> None:
    unknown = generate(client, model="nope:1b", prompt="hi")
    assert unknown.status_code == 404
    assert unknown.json() == {"error": "model 'nope:1b' not found"}
    chat = client.post("/api/chat", json={"model": "nope:1b", "messages": []})
    assert chat.status_code == 404
    show = client.post("/api/show", json={"model": "nope:1b"})
    assert show.status_code == 404
    found = client.post("/api/show", json={"model": "gemma3:1b"}).json()
    assert found["details"]["format"] == "gguf" and "model_info" in found

    for raw in (b"", b"{not json", b"[1, 2]", b'{"model": "gemma3:1b", "prompt": 3}'):
        bad = client.post("/api/generate", content=raw)
        assert bad.status_code == 400, raw
        assert bad.json()["error"]
    loaded = generate(client, model="gemma3:1b").json()
    assert loaded["done"] is True and loaded["done_reason"] == "load"


def test_fail_status_over_http_and_reset(fake: FakeOllama, client: httpx.Client) -> None:
    config = client.post("/_fake/config", json={"fail_status": 500})
    assert config.status_code == 200
    assert config.json()["fail_status"] == 500
    assert fake.fail_status == 500
    failed = generate(client, model="gemma3:1b", prompt="hi", stream=False)
    assert failed.status_code == 500
    assert isinstance(failed.json()["error"], str) and failed.json()["error"]
    with client.stream("POST", "/api/generate", json={"model": "gemma3:1b", "prompt": "hi"}) as r:
        assert r.status_code == 500
        assert json.loads(r.read())["error"]

    assert client.post("/_fake/config", json={"fail_status": "x"}).status_code == 400
    assert client.post("/_fake/config", json={"no_such_knob": 1}).status_code == 400

    reset = client.post("/_fake/reset")
    assert reset.status_code == 200 and reset.json()["fail_status"] is None
    assert generate(client, model="gemma3:1b", prompt="hi", stream=False).status_code == 200
    assert client.get("/_fake/stats").json()["generate_calls"] == 1


def test_replies_answer_prompts_containing_a_substring(
    fake: FakeOllama, client: httpx.Client
) -> None:
    config = client.post(
        "/_fake/config", json={"replies": {"<answer>\nfour": "SCORE: 0.9\nCorrect."}}
    )
    assert config.status_code == 200
    assert config.json()["replies"] == {"<answer>\nfour": "SCORE: 0.9\nCorrect."}

    judged = generate(
        client, model="gemma3:1b", prompt="Judge this.\n<answer>\nfour\n</answer>", stream=False
    )
    streamed = stream_lines(client, "/api/generate", model="gemma3:1b", prompt="<answer>\nfour")
    other = generate(client, model="gemma3:1b", prompt="what is 6*7", stream=False)

    assert judged.json()["response"] == "SCORE: 0.9\nCorrect."
    assert "".join(line["response"] for line in streamed) == "SCORE: 0.9\nCorrect."
    assert other.json()["response"] == "42"  # no substring matched: the usual answer
    assert client.post("/_fake/config", json={"replies": ["x"]}).status_code == 400
    assert client.post("/_fake/config", json={"replies": {"": "x"}}).status_code == 400
    fake.reset()
    assert fake.replies == {}
    with FakeOllama(replies={"hi": "hello"}) as preset:
        preset.replies["hi"] = "changed"  # the attribute is the fake's own copy
        assert preset.config()["replies"] == {"hi": "changed"}
        preset.reset()
        assert preset.replies == {"hi": "hello"}


def test_mid_stream_error_and_dropped_connection(fake: FakeOllama, client: httpx.Client) -> None:
    prompt = "one two three four five six"
    fake.error_after_chunks = 2
    lines = stream_lines(client, "/api/generate", model="gemma3:1b", prompt=prompt)
    assert len(lines) == 3 and "error" in lines[-1]
    assert not any(line.get("done") for line in lines)

    fake.configure(error_after_chunks=None, drop_after_chunks=1)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/api/generate", json={"model": "gemma3:1b", "prompt": prompt}) as r,
    ):
        list(r.iter_lines())


def test_a_reset_connection_before_any_answer_and_mid_stream(
    fake: FakeOllama, client: httpx.Client
) -> None:
    """A reset, not a close: the client reads ``ECONNRESET``, not the end of the stream."""
    prompt = "one two three four five six"
    fake.reset_after_chunks = 0
    for path, body in (
        ("/api/generate", {"model": "gemma3:1b", "prompt": prompt}),
        ("/api/chat", {"model": "gemma3:1b", "messages": [{"role": "user", "content": "x"}]}),
        ("/api/embed", {"model": "gemma3:1b", "input": "x"}),
        (
            "/v1/chat/completions",
            {"model": "gemma3:1b", "messages": [{"role": "user", "content": "x"}]},
        ),
    ):
        with pytest.raises(httpx.ReadError, match="reset"):
            client.post(path, json=body)
    fake.reset_after_chunks = 2
    seen: list[str] = []
    with (
        pytest.raises(httpx.ReadError, match="reset"),
        client.stream("POST", "/api/generate", json={"model": "gemma3:1b", "prompt": prompt}) as r,
    ):
        seen.extend(r.iter_lines())
    assert len(seen) <= 2 and not any('"done":true' in line for line in seen)
    fake.reset_after_chunks = None
    answer = client.post(
        "/api/generate", json={"model": "gemma3:1b", "prompt": "1+1", "stream": False}
    )
    assert answer.json()["response"] == "2"  # the server itself is fine


async def test_concurrent_max_counts_overlapping_requests(fake: FakeOllama) -> None:
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as http:
        assert (await http.post("/_fake/config", json={"delay_s": 0.3})).status_code == 200
        body = {"model": "gemma3:1b", "prompt": "1+1は？", "stream": False}
        replies = await asyncio.gather(
            http.post("/api/generate", json=body), http.post("/api/generate", json=body)
        )
        assert [r.json()["response"] for r in replies] == ["2", "2"]
        stats = (await http.get("/_fake/stats")).json()
        assert stats["generate_calls"] == 2
        assert stats["concurrent_max"] == 2
        assert stats["in_flight"] == 0

        await http.post("/_fake/reset")
        await http.post("/_fake/config", json={"delay_s": 0.05})
        for _ in range(3):
            async with http.stream("POST", "/api/generate", json={**body, "stream": True}) as r:
                assert [json.loads(line) async for line in r.aiter_lines()][-1]["done"] is True
        stats = (await http.get("/_fake/stats")).json()
        assert stats["generate_calls"] == 3
        assert stats["concurrent_max"] == 1
        assert stats["connections"] == 0  # keep-alive: no new connection since the reset


def test_calls_say_when_each_generation_ran_and_what_it_answered(
    fake: FakeOllama, client: httpx.Client
) -> None:
    before = time.time()
    generate(client, model="gemma3:1b", prompt="first prompt", stream=False)
    client.post(
        "/api/chat",
        json={
            "model": "gemma3:1b",
            "messages": [{"role": "user", "content": "second"}],
            "stream": False,
        },
    )
    client.post("/v1/completions", json={"model": "gemma3:1b", "prompt": "third"})
    refused = client.post("/api/generate", content=b"{not json")
    assert refused.status_code == 400

    calls = client.get("/_fake/calls").json()["calls"]
    assert [(c["api"], c["prompt"]) for c in calls] == [
        ("generate", "first prompt"),
        ("chat", "second"),
        ("openai", "third"),
        ("generate", None),
    ]
    for call in calls:
        assert before <= call["started_at"] <= call["ended_at"] <= time.time()
    assert calls == fake.calls()


def test_client_hanging_up_cancels_the_generation(fake: FakeOllama) -> None:
    fake.delay_s = 5
    with (
        httpx.Client(base_url=fake.url, timeout=0.3) as http,
        pytest.raises(httpx.ReadTimeout),
    ):
        generate(http, model="gemma3:1b", prompt="hi", stream=False)
    deadline = time.monotonic() + 2
    while fake.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert fake.stats()["in_flight"] == 0
    assert fake.stats()["cancelled"] == 1


def test_raw_http_chunked_framing(fake: FakeOllama) -> None:
    body = json.dumps({"model": "gemma3:1b", "prompt": "1+1は？"}).encode()
    request = (
        b"POST /api/generate HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", fake.port), timeout=5) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"Transfer-Encoding: chunked" in head
    lines = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            assert rest == b"\r\n"
            break
        lines.append(json.loads(rest[:size]))
        assert rest[size : size + 2] == b"\r\n"
        rest = rest[size + 2 :]
    assert [line["response"] for line in lines] == ["2", ""]


def test_stop_closes_keep_alive_and_restart_keeps_the_port() -> None:
    fake = FakeOllama().start()
    url = fake.url
    with httpx.Client(base_url=url, timeout=5) as http:
        assert http.get("/api/tags").status_code == 200
        fake.stop()
        with pytest.raises(httpx.TransportError):
            http.get("/api/tags")
        fake.start()
        try:
            assert fake.url == url
            assert http.get("/api/version").status_code == 200
        finally:
            fake.stop()


def test_module_runs_as_a_process() -> None:
    command = [sys.executable, "-m", "devtools.fakes.ollama", "--port", "0", "--models", "a:1b,b"]
    with subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            line = process.stdout.readline().strip()
            assert line.startswith("fake ollama listening on http://127.0.0.1:")
            url = line.removeprefix("fake ollama listening on ")
            with httpx.Client(base_url=url, timeout=5) as http:
                names = [m["name"] for m in http.get("/api/tags").json()["models"]]
                assert names == ["a:1b", "b"]
                http.post("/_fake/config", json={"fail_status": 503})
                assert generate(http, model="b", prompt="hi").status_code == 503
        finally:
            process.send_signal(signal.SIGTERM)
            _, errors = process.communicate(timeout=10)
        assert process.returncode == 0
        assert errors == ""  # no per-request logging


# --------------------------------------------------------------------------- OpenAI-compatible /v1


def chat_body(model: str = "gemma3:1b", content: str = "1+1は？", **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def sse_events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[Any]:
    """The ``data:`` payloads of a streamed /v1 answer, ``"[DONE]"`` kept as a string."""
    with client.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream"
        assert reply.headers["transfer-encoding"] == "chunked"
        text = reply.read().decode()
    assert text.endswith("\n\n")
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(reply: httpx.Response, status: int, kind: str, message: str) -> None:
    assert reply.status_code == status
    assert reply.headers["content-type"] == "application/json"
    assert reply.json() == {
        "error": {"message": message, "type": kind, "param": None, "code": None}
    }


def test_openai_models_list_and_retrieve(fake: FakeOllama, client: httpx.Client) -> None:
    reply = client.get("/v1/models")
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    listing = reply.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["qwen2.5:0.5b", "gemma3:1b"]
    for entry in listing["data"]:
        assert entry.keys() == {"id", "object", "created", "owned_by"}
        assert entry["object"] == "model" and entry["owned_by"] == "library"
        assert isinstance(entry["created"], int) and entry["created"] > 1_600_000_000

    fake.models = ["someone/custom:7b"]
    assert client.get("/v1/models").json()["data"][0]["owned_by"] == "someone"
    fake.models = []
    assert client.get("/v1/models").json() == {"object": "list", "data": None}  # Go's nil slice

    fake.models = ["gemma3:1b"]
    one = client.get("/v1/models/gemma3:1b").json()
    assert one["id"] == "gemma3:1b" and one["object"] == "model"
    assert_openai_error(
        client.get("/v1/models/nope:1b"), 404, "api_error", "model 'nope:1b' not found"
    )


def test_openai_chat_not_streamed_answers_with_usage(
    fake: FakeOllama, client: httpx.Client
) -> None:
    reply = client.post("/v1/chat/completions", json=chat_body(temperature=0.2))
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["model"] == "gemma3:1b"
    assert body["system_fingerprint"] == "fp_ollama"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "2"}, "finish_reason": "stop"}
    ]
    usage = body["usage"]
    assert usage["completion_tokens"] == 1 and usage["prompt_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    parts = {"role": "user", "content": [{"type": "text", "text": "what is 6*7"}]}
    product = client.post("/v1/chat/completions", json={"model": "gemma3:1b", "messages": [parts]})
    assert product.json()["choices"][0]["message"]["content"] == "42"

    prompt = "one two three four five six seven"
    cut = client.post("/v1/chat/completions", json=chat_body(content=prompt, max_tokens=2)).json()
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["content"] == "Echo from "
    assert cut["usage"]["completion_tokens"] == 2

    # The /v1 call did the cold start: no load field to show it, but the model is loaded.
    fake.load_ms = 300
    client.post("/v1/chat/completions", json=chat_body("qwen2.5:0.5b"))
    loaded = {m["name"] for m in client.get("/api/ps").json()["models"]}
    assert loaded == {"gemma3:1b", "qwen2.5:0.5b"}
    native = client.post("/api/chat", json={**chat_body("qwen2.5:0.5b"), "stream": False})
    assert native.json()["load_duration"] == 0

    stats = fake.stats()
    assert stats["openai_calls"] == 4
    assert stats["chat_calls"] == 1 and stats["generate_calls"] == 0
    assert stats["in_flight"] == 0


def test_openai_chat_streamed_as_server_sent_events(client: httpx.Client) -> None:
    prompt = "Tell me a short story about a cat on a warm roof"
    whole = client.post("/v1/chat/completions", json=chat_body(content=prompt)).json()
    content = whole["choices"][0]["message"]["content"]
    assert content == f"Echo from gemma3:1b: {prompt}"

    events = sse_events(client, "/v1/chat/completions", chat_body(content=prompt, stream=True))
    *chunks, finish, done = events
    assert done == "[DONE]"
    assert len(chunks) >= 3
    assert len({event["id"] for event in [*chunks, finish]}) == 1
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        assert chunk["model"] == "gemma3:1b"
        assert "usage" not in chunk
        (choice,) = chunk["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] is None
        assert choice["delta"]["role"] == "assistant"
        assert "reasoning" not in choice["delta"]
    assert "".join(chunk["choices"][0]["delta"]["content"] for chunk in chunks) == content
    assert finish["choices"][0]["finish_reason"] == "stop"
    assert finish["choices"][0]["delta"].get("content", "") == ""

    asked = chat_body(content=prompt, stream=True, stream_options={"include_usage": True})
    *_, last_chunk, usage_chunk, done = sse_events(client, "/v1/chat/completions", asked)
    assert done == "[DONE]"
    assert last_chunk["choices"][0]["finish_reason"] == "stop"
    assert usage_chunk["choices"] == []
    assert usage_chunk["id"] == last_chunk["id"]
    assert usage_chunk["usage"] == whole["usage"]
    assert usage_chunk["usage"]["completion_tokens"] == len(chunks)


def test_openai_thinking_model_puts_thinking_in_reasoning(
    fake: FakeOllama, client: httpx.Client
) -> None:
    fake.models = [*fake.models, "qwen3:0.6b"]
    whole = client.post("/v1/chat/completions", json=chat_body("qwen3:0.6b")).json()
    message = whole["choices"][0]["message"]
    assert message["content"] == "2"
    assert message["reasoning"].startswith("Let me think about: 1+1は？")
    assert "reasoning_content" not in message and "thinking" not in message
    native = client.post("/api/chat", json={**chat_body("qwen3:0.6b"), "stream": False}).json()
    assert message["reasoning"] == native["message"]["thinking"]

    body = chat_body("qwen3:0.6b", stream=True, stream_options={"include_usage": True})
    *chunks, finish, usage_chunk, done = sse_events(client, "/v1/chat/completions", body)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks]
    thinking = [delta for delta in deltas if delta.get("reasoning")]
    answer = [delta for delta in deltas if delta["content"]]
    assert thinking and all(delta["content"] == "" for delta in thinking)
    assert deltas.index(thinking[-1]) < deltas.index(answer[0])  # thinking comes first
    assert "".join(delta["reasoning"] for delta in thinking) == message["reasoning"]
    assert "".join(delta["content"] for delta in answer) == "2"
    assert usage_chunk["usage"]["completion_tokens"] == len(thinking) + len(answer)
    assert finish["choices"][0]["finish_reason"] == "stop" and done == "[DONE]"

    refused = client.post("/v1/chat/completions", json=chat_body(reasoning_effort="high"))
    assert_openai_error(refused, 400, "api_error", '"gemma3:1b" does not support thinking')


def test_openai_unknown_model_and_bad_bodies(client: httpx.Client) -> None:
    for stream in (False, True):
        unknown = client.post("/v1/chat/completions", json=chat_body("nope:1b", stream=stream))
        assert_openai_error(unknown, 404, "api_error", "model 'nope:1b' not found")

    assert_openai_error(
        client.post("/v1/chat/completions", json=chat_body("")),
        400,
        "api_error",
        "model is required",
    )
    assert_openai_error(
        client.post("/v1/chat/completions", json={"model": "gemma3:1b", "messages": []}),
        400,
        "invalid_request_error",
        "[] is too short - 'messages'",
    )
    assert_openai_error(
        client.post("/v1/chat/completions", json=chat_body(stream="yes")),
        400,
        "invalid_request_error",
        "json: cannot unmarshal string into Go struct field "
        "ChatCompletionRequest.stream of type bool",
    )
    for raw in (b"", b"{not json", b"[1, 2]"):
        bad = client.post("/v1/chat/completions", content=raw)
        assert bad.status_code == 400, raw
        assert bad.json()["error"]["type"] == "invalid_request_error"
        assert bad.json()["error"]["message"]


def test_openai_fail_status_and_stream_knobs(fake: FakeOllama, client: httpx.Client) -> None:
    assert client.post("/_fake/config", json={"fail_status": 500}).status_code == 200
    message = "llama runner process has terminated: signal: killed"
    for stream in (False, True):
        failed = client.post("/v1/chat/completions", json=chat_body(stream=stream))
        assert_openai_error(failed, 500, "api_error", message)
    fake.fail_status = 503
    busy = client.post("/v1/chat/completions", json=chat_body())
    assert busy.status_code == 503 and busy.json()["error"]["type"] == "api_error"

    fake.configure(fail_status=None, error_after_chunks=2)
    prompt = "one two three four five six"
    events = sse_events(client, "/v1/chat/completions", chat_body(content=prompt, stream=True))
    assert len(events) == 3 and "[DONE]" not in events
    assert events[-1] == {
        "error": {"message": message, "type": "api_error", "param": None, "code": None}
    }
    assert all(event["choices"][0]["finish_reason"] is None for event in events[:2])

    fake.configure(error_after_chunks=None, drop_after_chunks=1)
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream(
            "POST", "/v1/chat/completions", json=chat_body(content=prompt, stream=True)
        ) as reply,
    ):
        list(reply.iter_lines())
    assert fake.stats()["openai_calls"] == 5


async def test_openai_calls_count_toward_concurrency(fake: FakeOllama) -> None:
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as http:
        fake.configure(delay_s=0.3)
        replies = await asyncio.gather(
            http.post("/v1/chat/completions", json=chat_body()),
            http.post("/api/chat", json={**chat_body(), "stream": False}),
        )
        assert replies[0].json()["choices"][0]["message"]["content"] == "2"
        assert replies[1].json()["message"]["content"] == "2"
        stats = (await http.get("/_fake/stats")).json()
        assert stats["openai_calls"] == 1 and stats["chat_calls"] == 1
        assert stats["concurrent_max"] == 2 and stats["in_flight"] == 0
        await http.post("/_fake/reset")
        assert (await http.get("/_fake/stats")).json()["openai_calls"] == 0


def test_openai_legacy_completions(client: httpx.Client) -> None:
    whole = client.post("/v1/completions", json={"model": "gemma3:1b", "prompt": "2*3"}).json()
    assert whole["id"].startswith("cmpl-") and whole["object"] == "text_completion"
    assert whole["choices"] == [{"text": "6", "index": 0, "finish_reason": "stop"}]
    assert whole["usage"]["completion_tokens"] == 1

    body = {"model": "gemma3:1b", "prompt": "a b c", "stream": True}
    *chunks, finish, done = sse_events(client, "/v1/completions", body)
    assert done == "[DONE]" and finish["choices"][0]["finish_reason"] == "stop"
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == "Echo from gemma3:1b: a b c"
    with_usage = {**body, "stream_options": {"include_usage": True}}
    *_, usage_chunk, done = sse_events(client, "/v1/completions", with_usage)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(chunks)
    unknown = client.post("/v1/completions", json={"model": "nope:1b", "prompt": "hi"})
    assert_openai_error(unknown, 404, "api_error", "model 'nope:1b' not found")
