"""Thousands of generated bad inputs against the router's and the stats service's NATS endpoints
and the gateway's HTTP APIs, through a real nats-server, PostgreSQL, the router, the stats
service, a worker and the gateway.

Every answer is a coded error in the API's own shape or a success: never ``internal``, never
an HTTP 500, always JSON (Ollama's ``{"error": "..."}`` under ``/api``, OpenAI's
``{"error": {"message", "type", "param", "code"}}`` under ``/v1``, the project's
``{"error": {"code", "message"}}`` elsewhere). Nothing is written to ``EVENTS`` or ``TASKS``
for a refused request, and the services serve a normal request afterwards.

The inputs come from a seeded generator (``FUZZ_SEED`` in the environment replays another
run): valid request bodies naming a model nobody serves, mutated (a field of another type,
dropped, unknown, nested deep, counted over its cap, a string that is not UTF-8, the JSON cut
short or its bytes flipped), the attacks that found the holes, and plain garbage. The model
nobody serves keeps every input that happens to be valid a refusal too (``no_worker``), so
nothing is routed and the streams must not move.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import os
import random
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Final

import httpx
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from nats.aio.client import Client
from nats.micro import add_service

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer
from schemas.route import MAX_IMAGES, MAX_MESSAGES, MAX_OPTIONS, MAX_STOP, MAX_TOOLS
from schemas.stats import RebuildRequest
from schemas.subjects import (
    ALIAS_ADD,
    ALIAS_REMOVE,
    ALIASES,
    CANCEL,
    EVENTS_STREAM,
    ROUTE,
    STATS,
    STATS_BASELINES,
    STATS_EXCLUDE,
    STATS_EXCLUSIONS,
    STATS_INCLUDE,
    STATS_PARKED,
    STATS_REBUILD,
    TASK,
    TASKS_STREAM,
    WORKERS,
    InvalidId,
)
from services.errors import catalogue
from services.gateway.responses import json_errors, read_body
from services.runtime.endpoints import add_endpoint
from services.runtime.lifecycle import TaskSet
from tests.harness import ServiceRunner, eventually, request, workers_live
from tests.integration.test_gateway import start_gateway

SEED: Final = int(os.environ.get("FUZZ_SEED", "20250501"))
SERVED: Final = "qwen2.5:0.5b"
NOBODY: Final = "fuzz-nobody:1b"
"""The model every generated request names: no worker serves it."""
IMAGE: Final = base64.b64encode(b"\x89PNG\r\n\x1a\n fuzz").decode()
MARK: Final = "\u2603"
"""A string the generator replaces, in the encoded body, with bytes that are not UTF-8."""
NOT_UTF8: Final = (b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80")
DEPTHS: Final = (65, 100, 900, 5_000, 200_000)
CODES: Final = frozenset(catalogue()) | {InvalidId.code}


# -- the generator ---------------------------------------------------------------------------


class Fuzz:
    """Seeded inputs: JSON values, and request bodies mutated from a template."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def text(self) -> str:
        rng = self.rng
        kind = rng.randrange(8)
        if kind == 0:
            return ""
        if kind == 1:
            return "".join(rng.choice("\x00\x01\n\r\t\x7f\u2028\ufeff") for _ in range(4))
        if kind == 2:
            return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
        if kind == 3:
            return rng.choice(("a.b", "*", ">", "code\n", " ", "..", "tasks.cpu.x", "../../etc"))
        if kind == 4:
            return "x" * rng.choice((129, 1000, 20_000))
        if kind == 5:
            return rng.choice(("json", "high", "function", "user", "tool", "5m", "-1", "0s"))
        return "".join(rng.choice("abcdefghij-_:/0123456789") for _ in range(rng.randrange(1, 20)))

    def number(self) -> Any:
        return self.rng.choice(
            (0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**40, 0.5, -0.0, 1e308, -1e308, 1e-320)
        )

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(9 if depth < 3 else 6)
        if kind == 0:
            return None
        if kind == 1:
            return rng.choice((True, False))
        if kind in (2, 3):
            return self.number()
        if kind in (4, 5):
            return self.text()
        if kind in (6, 7):
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        return {self.text(): self.value(depth + 1) for _ in range(rng.randrange(4))}

    def nested(self, depth: int) -> Any:
        """``depth`` arrays (or objects) within each other."""
        inner: Any = 1
        for _ in range(depth):
            inner = [inner] if self.rng.random() < 0.5 else {"a": inner}
        return inner

    def over_cap(self, name: str) -> Any:
        """A value one over the cap of a counted field (or far over it)."""
        many = self.rng.choice((1, 1, 50))
        if name == "options":
            return {f"k{i}": i for i in range(MAX_OPTIONS * many + 1)}
        if name == "messages":
            return [{"role": "user", "content": "hi"}] * (MAX_MESSAGES * many + 1)
        if name == "tools":
            tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
            return [tool] * (MAX_TOOLS * many + 1)
        if name == "images":
            return [IMAGE] * (MAX_IMAGES + 1)
        if name == "stop":
            return {"stop": ["x"] * (MAX_STOP * many + 1)}
        return [self.text() for _ in range(3000)]

    def body(self, template: dict[str, Any]) -> bytes:
        """One mutation of ``template``."""
        rng = self.rng
        body = dict(template)
        keys = list(body) or ["x"]
        kind = rng.randrange(16)
        if kind == 0:
            body[rng.choice(keys)] = self.value()
        elif kind == 1:
            body.pop(rng.choice(keys), None)
        elif kind == 2:
            body[self.text() or "x"] = self.value()
        elif kind == 3:
            return msgspec.json.encode(self.value())
        elif kind == 4:
            encoded = msgspec.json.encode(body)
            return encoded[: rng.randrange(len(encoded))]
        elif kind == 5:
            flipped = bytearray(msgspec.json.encode(body))
            for _ in range(rng.randrange(1, 4)):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            return bytes(flipped)
        elif kind == 6:
            body[rng.choice(keys)] = MARK
            return msgspec.json.encode(body).replace(MARK.encode(), rng.choice(NOT_UTF8))
        elif kind == 7:
            body[rng.choice(keys)] = self.nested(rng.choice(DEPTHS[:3]))
        elif kind == 8:
            # Deeper than any encoder goes: written out by hand.
            depth = rng.choice(DEPTHS)
            key = rng.choice(keys)
            head = msgspec.json.encode({**body, key: 0})[:-1]
            return head + b', "' + key.encode() + b'": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 9:
            name = rng.choice(("options", "messages", "tools", "images", "stop", "input"))
            value = self.over_cap(name)
            if name == "stop":
                body["options"] = value
            else:
                body[name] = value
        elif kind == 10:
            return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 64)))
        elif kind == 11:
            return rng.choice(
                (b"", b"null", b"[]", b"{}", b'"x"', b"1", b"\xef\xbb\xbf{}", b"NaN", b"{" * 10)
            )
        elif kind == 12:
            key = rng.choice(keys)
            encoded = msgspec.json.encode({k: v for k, v in body.items() if k != key})
            number = rng.choice((b"1e400", b"-1e400", b"1" * 400, b"0x10", b"01", b"1.", b"-"))
            return encoded[:-1] + b', "' + key.encode() + b'": ' + number + b"}"
        elif kind == 13:
            encoded = msgspec.json.encode(body)
            return encoded[:-1] + b"," + encoded[1:]  # every key twice
        elif kind == 14:
            for key in rng.sample(keys, min(len(keys), 3)):
                body[key] = self.value()
        else:
            body[rng.choice(keys)] = self.text()
        return msgspec.json.encode(body)


# -- templates: valid requests naming a model nobody serves ------------------------------------

ROUTE_TEMPLATES: Final[list[dict[str, Any]]] = [
    {"prompt": "hi", "model": NOBODY, "options": {"temperature": 0.1, "stop": ["\n"]}},
    {
        "prompt": "hi",
        "model": NOBODY,
        "wait": True,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi", "images": [IMAGE]},
            {"role": "assistant", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]},
            {"role": "tool", "content": "1", "tool_name": "f"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "format": {"type": "object", "properties": {"a": {"type": "string"}}},
        "think": "low",
        "keep_alive": "5m",
    },
    {"prompt": "", "model": NOBODY, "task_type": "embedding", "input": ["a", "b"], "dimensions": 8},
    {"prompt": "find", "model": "default", "task_type": "web_search", "domain": "news"},
    {"prompt": "x", "model": NOBODY, "stream": True, "timeout_s": 5, "worker": "nobody"},
]

NATS_TEMPLATES: Final[dict[str, list[dict[str, Any]]]] = {
    ROUTE: ROUTE_TEMPLATES,
    CANCEL: [{"task_id": "t-1", "reason": "x"}, {"reply_to": "_INBOX.x"}],
    TASK: [{"task_id": "t-1"}],
    WORKERS: [{}],
    STATS: [{"model": NOBODY, "worker": "w", "domain": "d"}],
    STATS_EXCLUSIONS: [{"withdrawn": True}],
    STATS_BASELINES: [{"models": [NOBODY], "exclude_run": "r"}],
    STATS_PARKED: [{}],
    ALIASES: [{}],
}
# Endpoints that write an event when they succeed: asked one at a time, the streams compared
# around every refusal.
WRITING_TEMPLATES: Final[dict[str, list[dict[str, Any]]]] = {
    STATS_EXCLUDE: [{"worker": "w", "model": NOBODY, "since": 0, "until": 10, "reason": "r"}],
    STATS_INCLUDE: [{"exclusion_id": "x-1", "reason": "r"}],
    ALIAS_ADD: [{"alias": "fuzz-a", "canonical": "fuzz-b"}],
    ALIAS_REMOVE: [{"alias": "fuzz-a"}],
    STATS_REBUILD: [{}],
}

HTTP_TEMPLATES: Final[dict[str, list[dict[str, Any]]]] = {
    "/api/chat": [
        {
            "model": NOBODY,
            "messages": [{"role": "user", "content": "hi", "images": [IMAGE]}],
            "options": {"num_predict": 3},
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "format": "json",
            "stream": False,
        }
    ],
    "/api/generate": [
        {"model": NOBODY, "prompt": "hi", "system": "s", "options": {"seed": 1}, "stream": False},
        {"model": NOBODY, "prompt": "hi", "images": [IMAGE], "keep_alive": 0, "think": True},
    ],
    "/api/embed": [{"model": NOBODY, "input": ["a", "b"], "dimensions": 4}],
    "/api/show": [{"model": NOBODY}],
    "/v1/chat/completions": [
        {
            "model": NOBODY,
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c", "content": "1"},
            ],
            "stop": ["a"],
            "response_format": {"type": "json_object"},
            "tool_choice": "auto",
            "reasoning_effort": "low",
        }
    ],
    "/v1/completions": [{"model": NOBODY, "prompt": "hi", "suffix": "s", "max_tokens": 3}],
    "/v1/embeddings": [{"model": NOBODY, "input": ["a"], "encoding_format": "base64"}],
    "/route": [*ROUTE_TEMPLATES[:3], {"prompt": "hi", "model": NOBODY, "wait": False}],
}

# How the HTTP fuzz encodes a body: as it is, or under a header that is (or is not) true.
ENCODINGS: Final = ("", "", "", "gzip", "gzip-plain", "deflate", "deflate-raw", "foo", "GZIP")


def encoded_as(body: bytes, how: str) -> tuple[bytes, dict[str, str]]:
    if how == "gzip":
        return gzip.compress(body), {"Content-Encoding": "gzip"}
    if how == "gzip-plain":
        return body, {"Content-Encoding": "gzip"}  # the header says gzip; the body is not
    if how == "deflate":
        return zlib.compress(body), {"Content-Encoding": "deflate"}
    if how == "deflate-raw":
        packer = zlib.compressobj(wbits=-15)
        return packer.compress(body) + packer.flush(), {"Content-Encoding": "deflate"}
    if how:
        return body, {"Content-Encoding": how}
    return body, {}


# -- what a reply must be ----------------------------------------------------------------------


@dataclass
class Findings:
    """What broke the rules: each as ``(where, the input's start, what came back)``."""

    seen: int = 0
    refused: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    wrong: list[tuple[str, bytes, str]] = field(default_factory=list)

    def bad(self, where: str, body: bytes, what: str) -> None:
        self.wrong.append((where, body[:160], what[:300]))

    def report(self) -> str:
        lines = [
            f"seed {SEED}: {len(self.wrong)} of {self.seen} inputs answered wrongly",
            f"  codes: {dict(self.codes.most_common())}",
        ]
        lines += [f"  {where}: {body!r} -> {what}" for where, body, what in self.wrong[:25]]
        return "\n".join(lines)


def check_nats_reply(
    found: Findings, subject: str, body: bytes, data: bytes, headers: dict[str, str]
) -> bool:
    """Is the reply a coded error or a success? Returns whether it was a refusal."""
    found.seen += 1
    if headers.get("Status") == "503":
        found.bad(subject, body, "no responders: the service is down")
        return True
    try:
        decoded = msgspec.json.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        found.bad(subject, body, f"reply is not JSON: {data[:100]!r}")
        return True
    code = headers.get("Nats-Service-Error-Code")
    if code is None:
        return False
    found.refused += 1
    found.codes[f"{subject} {code}"] += 1
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if not isinstance(error, dict) or error.get("code") != code or "message" not in error:
        found.bad(subject, body, f"error body not in the project's shape: {data[:200]!r}")
    elif code == "internal" or code not in CODES:
        found.bad(subject, body, f"code {code}: {error.get('message')}")
    return True


def check_http_reply(found: Findings, path: str, body: bytes, reply: httpx.Response) -> None:
    found.seen += 1
    where = f"{path} {reply.status_code}"
    if reply.status_code >= 500:
        found.bad(where, body, f"server error: {reply.text[:200]}")
        return
    if not reply.headers.get("content-type", "").startswith("application/json"):
        found.bad(
            where, body, f"not JSON ({reply.headers.get('content-type')}): {reply.text[:200]}"
        )
        return
    try:
        decoded = msgspec.json.decode(reply.content)
    except msgspec.DecodeError:
        found.bad(where, body, f"body is not JSON: {reply.content[:200]!r}")
        return
    if reply.status_code < 400:
        return
    found.refused += 1
    found.codes[f"{where}"] += 1
    error = decoded.get("error") if isinstance(decoded, dict) else None
    if path.startswith("/api/"):
        if not isinstance(error, str) or set(decoded) != {"error"}:
            found.bad(where, body, f"not Ollama's error shape: {decoded!r}")
    elif path.startswith("/v1/"):
        if not (
            isinstance(error, dict)
            and set(error) == {"message", "type", "param", "code"}
            and error["type"] == "invalid_request_error"
            and error["code"] in CODES - {"internal"}
        ):
            found.bad(where, body, f"not OpenAI's error shape: {decoded!r}")
    elif not (isinstance(error, dict) and error.get("code") in CODES - {"internal"}):
        found.bad(where, body, f"not the project's error shape: {decoded!r}")


# -- the stack ---------------------------------------------------------------------------------


@dataclass
class Stack:
    nc: Client
    gateway: str
    tasks: list[asyncio.Task[None]]


@pytest.fixture
async def stack(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, pg_dsn: str
) -> AsyncIterator[Stack]:
    with FakeOllama(models=[SERVED]) as fake:
        tasks = [
            runner.router(nats_server.url),
            runner.stats(nats_server.url, pg_dsn),
            runner.worker(nats_server.url, fake.url, "cpu-1"),
        ]
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)
        await _stats_ready(nc)
        yield Stack(nc=nc, gateway=url, tasks=tasks)
        await runner.stop_all()


async def _stats_ready(nc: Client) -> None:
    for _ in range(100):
        try:
            await nc.request(STATS, b"{}", timeout=1)
            return
        except Exception:
            await asyncio.sleep(0.1)
    raise AssertionError("the stats service did not answer")


async def last_seqs(nc: Client) -> tuple[int, int]:
    js = nc.jetstream()
    events = await js.stream_info(EVENTS_STREAM)
    tasks = await js.stream_info(TASKS_STREAM)
    return events.state.last_seq, tasks.state.last_seq


async def in_batches(
    ask: Callable[..., Awaitable[None]], inputs: Sequence[tuple[Any, ...]], width: int
) -> None:
    """``ask(*each)`` for every input, ``width`` at a time."""
    for start in range(0, len(inputs), width):
        await asyncio.gather(*(ask(*each) for each in inputs[start : start + width]))


def generated(
    fuzz: Fuzz, templates: dict[str, list[dict[str, Any]]], count: int
) -> Iterator[tuple[str, bytes]]:
    for _ in range(count):
        where = fuzz.rng.choice(list(templates))
        yield where, fuzz.body(fuzz.rng.choice(templates[where]))


# Attacks that found the holes, sent to every endpoint as well as the generated inputs.
def attacks() -> list[bytes]:
    route = {"prompt": "hi", "model": NOBODY}
    deep = b"[" * 100_000 + b"]" * 100_000
    return [
        b'{"prompt": "\xff\xfe", "model": "m"}',
        b'{"model": "' + b"\xed\xa0\x80" + b'", "prompt": "x"}',
        b'{"prompt": "hi", "model": "m", "options": ' + deep + b"}",
        deep,
        b'{"a":' * 5_000 + b"1" + b"}" * 5_000,
        msgspec.json.encode({**route, "options": {f"k{i}": 0 for i in range(100_000)}}),
        msgspec.json.encode({**route, "domain": "code\n"}),
        msgspec.json.encode({"models": [NOBODY] * 100_000}),
        msgspec.json.encode({"task_id": "t\x00", "model": "\x00", "alias": "\x00"}),
        # Grows fourfold once decoded and encoded again: over max_payload as a task.
        b'{"prompt": "hi", "model": "m", "options": {"a": ['
        + b",".join([b"1e9"] * 700_000)
        + b"]}}",
    ]


# -- the tests ---------------------------------------------------------------------------------


async def test_generated_inputs_get_coded_answers_and_write_nothing(stack: Stack) -> None:
    nc, fuzz, found = stack.nc, Fuzz(SEED), Findings()
    before = await last_seqs(nc)

    async def ask_nats(subject: str, body: bytes) -> None:
        try:
            reply = await nc.request(subject, body, timeout=10)
        except Exception as exc:
            found.seen += 1
            found.bad(subject, body, f"no answer: {exc!r}")
            return
        check_nats_reply(found, subject, body, reply.data, dict(reply.headers or {}))

    # The router's and the stats service's read endpoints, many at a time.
    inputs = [*generated(fuzz, NATS_TEMPLATES, 1500)]
    inputs += [(subject, attack) for subject in NATS_TEMPLATES for attack in attacks()]
    await in_batches(ask_nats, inputs, width=16)

    async with httpx.AsyncClient(base_url=stack.gateway, timeout=30) as http:

        async def ask_http(path: str, body: bytes, how: str) -> None:
            content, headers = encoded_as(body, how)
            try:
                reply = await http.post(path, content=content, headers=headers)
            except httpx.HTTPError as exc:
                found.seen += 1
                found.bad(path, body, f"no answer: {exc!r}")
                return
            check_http_reply(found, path, body, reply)

        requests = [
            (path, body, fuzz.rng.choice(ENCODINGS))
            for path, body in generated(fuzz, HTTP_TEMPLATES, 1500)
        ]
        requests += [(path, attack, "") for path in HTTP_TEMPLATES for attack in attacks()[:-1]]
        requests += [(path, b'{"model": "m"}', "gzip-plain") for path in HTTP_TEMPLATES]
        await in_batches(ask_http, requests, width=8)

    # Refused, every one: nothing was recorded, nothing queued.
    assert await last_seqs(nc) == before

    # The endpoints that write when they succeed, one request at a time.
    for subject, body in generated(fuzz, WRITING_TEMPLATES, 300):
        if subject == STATS_REBUILD and _decodes(body, RebuildRequest):
            continue  # a rebuild that would run: a success, and a slow one
        seqs = await last_seqs(nc)
        reply = await nc.request(subject, body, timeout=10)
        if check_nats_reply(found, subject, body, reply.data, dict(reply.headers or {})):
            assert await last_seqs(nc) == seqs, (subject, body[:200])

    assert not found.wrong, found.report()
    assert found.refused > found.seen / 2, found.report()

    # Still up, and still serving.
    assert not any(task.done() for task in stack.tasks)
    answer, _ = await request(nc, ROUTE, {"prompt": "1+1", "model": SERVED, "wait": True})
    assert answer["status"] == "done" and answer["response"] == "2"
    async with httpx.AsyncClient(base_url=stack.gateway, timeout=30) as http:
        generate = await http.post(
            "/api/generate", json={"model": SERVED, "prompt": "2+3", "stream": False}
        )
        chat = await http.post(
            "/v1/chat/completions",
            json={"model": SERVED, "messages": [{"role": "user", "content": "6*7"}]},
        )
    assert generate.status_code == 200 and generate.json()["response"] == "5"
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"] == "42"

    # The services run in this test's event loop, which the fuzzing starves for seconds at a
    # time: the stats service may have stood by for want of a stored renewal (its answer is
    # then `unavailable`, "ask again") and takes its role again at once.
    async def stats_answer() -> bool:
        stats, headers = await request(nc, STATS, {})
        if headers.get("Nats-Service-Error-Code") == "unavailable":
            return False
        assert "Nats-Service-Error-Code" not in headers and "figures" in stats
        return True

    await eventually(stats_answer, timeout_s=15, interval_s=0.5)


def _decodes(body: bytes, kind: type[Any]) -> bool:
    try:
        msgspec.json.decode(body or b"{}", type=kind)
    except Exception:
        return False
    return True


# -- the edge's own pieces, on a bare server ---------------------------------------------------


async def test_a_reply_over_max_payload_is_too_large_and_an_id_error_keeps_its_code(
    nats_server: NatsServer, nc: Client
) -> None:
    tasks = TaskSet()
    service = await add_service(nc, name="fuzz-edge", version="0.0.1")

    async def huge(body: bytes) -> bytes:
        return b"x" * (nc.max_payload + 1)

    async def bad_id(body: bytes) -> bytes:
        raise InvalidId("task id", "a.b" * 5000)

    async def broken(body: bytes) -> bytes:
        raise KeyError("x" * 10_000)

    await add_endpoint(service, "huge", "fuzz.huge", huge, tasks)
    await add_endpoint(service, "bad-id", "fuzz.bad-id", bad_id, tasks)
    await add_endpoint(service, "broken", "fuzz.broken", broken, tasks)
    try:
        replies = [
            await nc.request(s, b"{}", timeout=5)
            for s in ("fuzz.huge", "fuzz.bad-id", "fuzz.broken")
        ]
    finally:
        await service.stop()
        await tasks.wait(timeout_s=1)
    codes = [(r.headers or {}).get("Nats-Service-Error-Code") for r in replies]
    assert codes == ["too_large", "invalid_id", "internal"]
    for reply in replies:
        assert len(reply.data) < 3000  # the message quoting the input is cut
        assert len((reply.headers or {})["Nats-Service-Error"]) <= 256


@asynccontextmanager
async def bare_gateway(*, server_decompresses: bool) -> AsyncIterator[TestClient[Any, Any]]:
    """An aiohttp server with the gateway's body reading and error middleware, no services."""

    async def echo(request: web.Request) -> web.Response:
        body = await read_body(request, 1000, server_decompresses=server_decompresses)
        return web.json_response({"length": len(body)})

    async def fail(request: web.Request) -> web.Response:
        raise RuntimeError("boom")

    app = web.Application(client_max_size=1000, middlewares=[json_errors(retry_after_s=1)])
    for path in ("/api/chat", "/v1/chat/completions", "/route"):
        app.router.add_post(path, echo)
    app.router.add_post("/api/fail", fail)
    app.router.add_post("/v1/fail", fail)
    server = TestServer(app)
    # As `services.gateway.service.serve` would (TestServer's own arguments do not reach it).
    await server.start_server(auto_decompress=server_decompresses)
    async with TestClient(server) as client:
        yield client


@pytest.mark.parametrize("server_decompresses", [True, False])
async def test_content_encodings_are_inflated_or_refused_in_the_apis_shape(
    server_decompresses: bool,
) -> None:
    async with bare_gateway(server_decompresses=server_decompresses) as client:
        body = b'{"model": "m"}'
        cases = [
            ("/api/chat", gzip.compress(body), "gzip", 200),
            ("/api/chat", zlib.compress(body), "deflate", 200),
            ("/api/chat", body, "identity", 200),
            ("/api/chat", body, "gzip", 400),
            ("/v1/chat/completions", body, "deflate", 400),
            ("/route", body, "foo", 415),
            ("/v1/chat/completions", body, "gzip, gzip", 415),
            ("/api/chat", gzip.compress(b" " * 5000), "gzip", 413),
        ]
        if not server_decompresses:
            cases.append(("/api/chat", body, "br", 415))
            cases.append(("/api/chat", gzip.compress(body)[:-6], "gzip", 400))
        for path, content, coding, status in cases:
            reply = await client.post(path, data=content, headers={"Content-Encoding": coding})
            assert (reply.status, reply.content_type) == (status, "application/json"), (
                path,
                coding,
                await reply.text(),
            )
            answer = await reply.json()
            if status == 200:
                assert answer == {"length": len(body)}
            elif path.startswith("/api/"):
                assert isinstance(answer["error"], str)
            elif path.startswith("/v1/"):
                assert answer["error"]["type"] == "invalid_request_error"
            else:
                assert answer["error"]["code"] == "unsupported"


async def test_the_middleware_answers_a_failure_in_the_apis_shape() -> None:
    async with bare_gateway(server_decompresses=True) as client:
        ollama = await client.post("/api/fail", data=b"{}")
        openai = await client.post("/v1/fail", data=b"{}")
        unknown = await client.post("/api/nowhere", data=b"{}")
        assert (ollama.status, await ollama.json()) == (
            500,
            {"error": "the gateway failed on this request (see its log)"},
        )
        assert (await openai.json())["error"]["type"] == "api_error"
        assert unknown.status == 404 and "error" in await unknown.json()


async def test_an_encoding_the_gateway_cannot_inflate_is_a_415_in_the_apis_shape(
    nats_server: NatsServer, runner: ServiceRunner
) -> None:
    url = await start_gateway(runner, nats_server.url)
    async with httpx.AsyncClient(base_url=url) as http:
        reply = await http.post(
            "/api/chat", content=b'{"model": "m"}', headers={"Content-Encoding": "br"}
        )
    assert reply.status_code == 415 and "error" in reply.json()
