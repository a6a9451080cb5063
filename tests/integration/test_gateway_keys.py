"""The gateway's API keys and its limits on slow clients, through a real nats-server: keys
made and revoked with ``coordinator keys``, checked by the official ``ollama`` and ``openai``
clients, and raw sockets that stall in the header or the body."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx
import msgspec
import ollama
import openai
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsServer, free_port
from schemas.route import RouteRequest
from schemas.subjects import GATEWAY_KEYS_BUCKET, ROUTE, TASK
from services.errors import ConfigError
from services.gateway.keys import Priority, make_record, new_key, record_encoder
from services.gateway.service import run as run_gateway
from services.gateway.settings import GatewaySettings
from services.runtime.bus import ensure_bucket
from tests.harness import ServiceRunner, clean_env, eventually, request, run_cli, workers_live
from tests.integration.test_gateway import PLAIN, start_gateway

# Short limits, so that a slow client is seen off within a test's patience.
QUICK = {
    "gateway_header_timeout_s": 1.0,
    "gateway_body_timeout_s": 1.0,
    "gateway_keepalive_timeout_s": 1.5,
}


async def cli(*args: str, env: dict[str, str]) -> Any:
    return await asyncio.to_thread(run_cli, *args, env=env)


async def add_key(
    nc: Client, name: str, priority: Priority = "interactive", *, operator: bool = False
) -> str:
    """A key put straight into the bucket, as ``coordinator keys add`` puts it."""
    kv = await ensure_bucket(nc.jetstream(), GATEWAY_KEYS_BUCKET, ttl_s=None)
    key = new_key()
    record = make_record(name, key, priority, time.time(), operator=operator)
    await kv.create(name, record_encoder.encode(record))
    return key


async def revoke_key(nc: Client, name: str) -> None:
    kv = await nc.jetstream().key_value(GATEWAY_KEYS_BUCKET)
    await kv.delete(name)


@asynccontextmanager
async def fleet(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, **settings: Any
) -> AsyncIterator[str]:
    """Router, one worker on a stand-in, the gateway (its URL)."""
    with FakeOllama(models=[PLAIN]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url, **settings)
        await workers_live(nc, 1)
        yield url
        await runner.stop_all()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def ollama_client(
    stack: AsyncExitStack, url: str, key: str | None = None
) -> ollama.AsyncClient:
    """The official Ollama client, with ``key`` if given; closed with ``stack``."""
    client = ollama.AsyncClient(host=url, headers=bearer(key) if key else None)
    return await stack.enter_async_context(client)


async def openai_client(stack: AsyncExitStack, url: str, key: str) -> openai.AsyncOpenAI:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    return await stack.enter_async_context(client)


async def refused(check: Any) -> bool:
    """Does ``check()`` raise a 401 (as either client raises it)?"""
    try:
        await check()
    except ollama.ResponseError as exc:
        return exc.status_code == 401
    except openai.AuthenticationError:
        return True
    return False


# -- keys ---------------------------------------------------------------------------------------


async def test_keys_add_list_revoke_with_the_cli_and_the_gateway_follows(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner, tmp_path: Path
) -> None:
    env = clean_env(NATS_URL=nats_server.url, COORDINATOR_HOME=str(tmp_path))
    async with fleet(nats_server, nc, runner) as url, AsyncExitStack() as clients:
        empty = await cli("keys", "list", env=env)
        added = await cli("keys", "add", "alice", "--priority", "batch", env=env)
        key = added.stdout.strip()
        again = await cli("keys", "add", "alice", env=env)
        bad = await cli("keys", "add", "al.ice", env=env)
        other = await cli("keys", "add", "bob", env=env)
        listed = await cli("keys", "list", env=env)
        as_json = await cli("keys", "list", "--json", env=env)

        fleet_client = await ollama_client(clients, url, key)
        answer = await fleet_client.generate(model=PLAIN, prompt="2+5")
        no_key = await ollama_client(clients, url)
        assert await refused(lambda: no_key.generate(model=PLAIN, prompt="2+5"))

        revoked = await cli("keys", "revoke", "alice", env=env)
        started = time.monotonic()
        await eventually(
            lambda: refused(lambda: fleet_client.generate(model=PLAIN, prompt="2+5")),
            timeout_s=2.0,
        )
        took = time.monotonic() - started
        unknown = await cli("keys", "revoke", "alice", env=env)
        # A revoked key's delete marker is in the bucket: it is not listed.
        without = await cli("keys", "list", "--json", env=env)
        readded = await cli("keys", "add", "alice", env=env)
        after = await cli("keys", "list", "--json", env=env)

    assert empty.returncode == 0 and "no gateway keys" in empty.stdout
    assert added.returncode == 0, added.stderr
    assert key.startswith("coord_") and len(key.splitlines()) == 1
    assert "shown only this once" in added.stderr
    assert again.returncode == 2 and "error conflict" in again.stderr and "alice" in again.stderr
    assert bad.returncode == 2 and "error invalid_id" in bad.stderr
    assert other.returncode == 0
    assert key not in listed.stdout and key not in as_json.stdout
    assert "alice" in listed.stdout and "batch" in listed.stdout and "bob" in listed.stdout
    rows = json.loads(as_json.stdout)
    listed_rows = [(r["name"], r["priority"]) for r in rows]
    assert listed_rows == [("alice", "batch"), ("bob", "interactive")]
    assert all(time.time() - r["created_at"] < 120 for r in rows)
    assert answer.response == "7"
    assert revoked.returncode == 0 and "revoked" in revoked.stdout
    assert took < 2.0
    assert unknown.returncode == 1 and "error not_found" in unknown.stderr
    assert [r["name"] for r in json.loads(without.stdout)] == ["bob"]
    assert readded.returncode == 0 and readded.stdout.strip() != key
    assert [r["name"] for r in json.loads(after.stdout)] == ["alice", "bob"]


async def test_the_official_clients_without_a_wrong_and_the_right_key(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    key = await add_key(nc, "alice")
    async with fleet(nats_server, nc, runner) as url, AsyncExitStack() as clients:
        right = await ollama_client(clients, url, key)
        wrong = await ollama_client(clients, url, new_key())
        anonymous = await ollama_client(clients, url)
        good = await right.chat(model=PLAIN, messages=[{"role": "user", "content": "1+1"}])
        tags = await right.list()
        with pytest.raises(ollama.ResponseError) as missing:
            await anonymous.chat(model=PLAIN, messages=[{"role": "user", "content": "1+1"}])
        with pytest.raises(ollama.ResponseError) as bad:
            await wrong.list()

        ai = await openai_client(clients, url, key)
        ai_wrong = await openai_client(clients, url, new_key())
        completion = await ai.chat.completions.create(
            model=PLAIN, messages=[{"role": "user", "content": "2+5"}]
        )
        with pytest.raises(openai.AuthenticationError) as ai_bad:
            await ai_wrong.models.list()

        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            v1 = await http.post("/v1/chat/completions", json={"model": PLAIN, "messages": []})
            task_api = await http.post("/route", json={"prompt": "p", "model": PLAIN})
            task_view = await http.get("/task/t-1")
            unknown_path = await http.get("/api/nothing-here")
            root = await http.get("/")
            version = await http.get("/api/version")

    assert good.message.content == "2" and [m.model for m in tags.models] == [PLAIN]
    assert missing.value.status_code == 401 and "missing API key" in missing.value.error
    assert bad.value.status_code == 401 and "invalid API key" in bad.value.error
    assert completion.choices[0].message.content == "7"
    assert ai_bad.value.status_code == 401
    assert (ai_bad.value.code, ai_bad.value.type) == ("invalid_api_key", "invalid_request_error")
    # OpenAI's own 401 body: {"error": {"message", "type", "param", "code"}}.
    assert v1.status_code == 401 and set(v1.json()["error"]) == {"message", "type", "param", "code"}
    assert v1.headers["WWW-Authenticate"].startswith("Bearer")
    assert task_api.status_code == 401 and task_api.json()["error"]["code"] == "invalid_api_key"
    assert task_view.status_code == 401 and unknown_path.status_code == 401
    assert set(unknown_path.json()) == {"error"}  # Ollama's shape
    # The health probes stay open: they tell the API version, nothing about the fleet.
    assert root.status_code == 200 and version.status_code == 200


async def test_a_key_added_to_an_open_gateway_closes_it_at_once(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    async with fleet(nats_server, nc, runner) as url, AsyncExitStack() as clients:
        anonymous = await ollama_client(clients, url)
        before = await anonymous.generate(model=PLAIN, prompt="2+5")
        key = await add_key(nc, "alice")
        await eventually(lambda: refused(anonymous.list), timeout_s=2.0)
        keyed = await (await ollama_client(clients, url, key)).list()
        await revoke_key(nc, "alice")

        async def open_again() -> bool:
            return not await refused(anonymous.list)

        await eventually(open_again, timeout_s=2.0)  # on loopback, no key means no check
    assert before.response == "7" and keyed.models


async def test_the_task_records_the_keys_name(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    key = await add_key(nc, "alice", "batch")
    seen: list[RouteRequest] = []

    async def record(msg: Msg) -> None:
        seen.append(msgspec.json.decode(msg.data, type=RouteRequest))

    await nc.subscribe(ROUTE, cb=record)  # a copy of every route request the gateway sends
    async with fleet(nats_server, nc, runner) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(key)) as http:
            generated = await http.post(
                "/api/generate", json={"model": PLAIN, "prompt": "2+5", "stream": False}
            )
            # A client cannot claim another key's name through the task API.
            claimed = await http.post(
                "/route", json={"prompt": "1+1", "model": PLAIN, "wait": True, "client": "bob"}
            )
        task_id = generated.headers["X-Coordinator-Task"]
        submitted = await nc.jetstream().get_last_msg("EVENTS", f"events.task.{task_id}.submitted")
    assert generated.status_code == 200 and claimed.status_code == 200
    assert [r.client for r in seen] == ["alice", "alice"]
    event = msgspec.json.decode(submitted.data or b"")
    assert event["client"] == "alice"


async def test_an_open_gateway_overwrites_a_claimed_client(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    seen: list[RouteRequest] = []

    async def record(msg: Msg) -> None:
        seen.append(msgspec.json.decode(msg.data, type=RouteRequest))

    await nc.subscribe(ROUTE, cb=record)
    async with (
        fleet(nats_server, nc, runner) as url,
        httpx.AsyncClient(base_url=url, timeout=10) as http,
    ):
        reply = await http.post("/route", json={"prompt": "p", "model": PLAIN, "client": "bob"})
    assert reply.status_code == 200 and [r.client for r in seen] == [None]


# -- listening open -----------------------------------------------------------------------------


async def test_a_network_address_without_keys_refuses_to_start(nats_server: NatsServer) -> None:
    settings = GatewaySettings(
        nats_url=nats_server.url, gateway_host="0.0.0.0", gateway_port=free_port()
    )
    with pytest.raises(ConfigError) as error:
        await asyncio.wait_for(run_gateway(settings, asyncio.Event()), timeout=15)
    assert "GATEWAY_ALLOW_OPEN" in error.value.message
    assert "coordinator keys add" in error.value.message


async def test_a_network_address_opens_on_purpose_or_with_a_key_and_fails_closed(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    with capture_logs() as logs:
        open_url = await start_gateway(
            runner, nats_server.url, gateway_host="0.0.0.0", gateway_allow_open=True
        )
        async with httpx.AsyncClient(base_url=open_url, timeout=10) as http:
            open_tags = await http.get("/api/tags")
        await runner.stop_all()
        key = await add_key(nc, "alice")
        url = await start_gateway(runner, nats_server.url, gateway_host="0.0.0.0")
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            keyed = await http.get("/api/tags", headers=bearer(key))
            await revoke_key(nc, "alice")

            async def closed() -> httpx.Response | None:
                reply = await http.get("/api/tags", headers=bearer(key))
                return reply if reply.status_code == 401 else None

            last_gone = await eventually(closed, timeout_s=2.0)
            anonymous = await http.get("/api/tags")
        await runner.stop_all()
    ready = [entry for entry in logs if entry["event"] == "gateway ready"]
    assert [entry["keys_required"] for entry in ready] == [False, True]
    assert any("GATEWAY_ALLOW_OPEN" in entry["event"] for entry in logs)
    assert open_tags.status_code != 401 and keyed.status_code != 401
    assert "none exists" in last_gone.json()["error"] and anonymous.status_code == 401


# -- slow clients -------------------------------------------------------------------------------


@pytest.fixture
async def quick(nats_server: NatsServer, runner: ServiceRunner) -> AsyncIterator[int]:
    """A gateway with short limits (no worker: nothing here is routed); its port."""
    url = await start_gateway(runner, nats_server.url, **QUICK)
    yield int(url.rsplit(":", 1)[1])


async def until_closed(reader: asyncio.StreamReader, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    received = b""
    async with asyncio.timeout(limit_s):
        while chunk := await reader.read(65536):
            received += chunk
    return received, time.monotonic() - started


async def response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status_line, *lines = head.strip().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split()[1]), headers, body


async def test_a_header_that_stalls_is_cut_off(quick: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", quick)
    writer.write(b"POST /api/chat HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n")
    received, took = await until_closed(reader, limit_s=5)
    writer.close()
    assert received == b"" and 0.8 < took < 1.5 + 0.5


async def test_a_header_that_trickles_is_cut_off_too(quick: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", quick)

    async def trickle() -> None:
        with suppress(ConnectionError):
            for byte in b"GET /api/tags HTTP/1.1\r\nHost: gateway\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaa":
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.1)

    sender = asyncio.create_task(trickle())
    received, took = await until_closed(reader, limit_s=5)
    sender.cancel()
    writer.close()
    # Each byte comes well within any idle limit: the header's own deadline closes it.
    assert received == b"" and took < 1.0 + 0.8


async def test_an_idle_keep_alive_connection_is_closed(quick: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", quick)
    writer.write(b"GET /api/version HTTP/1.1\r\nHost: gateway\r\n\r\n")
    status, headers, _ = await response(reader)
    received, took = await until_closed(reader, limit_s=5)
    writer.close()
    assert status == 200 and headers.get("connection", "").lower() != "close"
    assert received == b"" and 1.0 < took < 1.5 + 0.8


async def test_a_content_length_over_the_limit_is_413_at_once(quick: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", quick)
    started = time.monotonic()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json"
        b"\r\nContent-Length: 1000000000\r\n\r\n{"
    )
    status, headers, body = await response(reader)
    took = time.monotonic() - started
    writer.close()
    assert status == 413 and took < 1.0  # the body limit, not the 1 s body timeout
    assert headers["connection"].lower() == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "too_large" and "GATEWAY_MAX_BODY_BYTES" in error["message"]


async def test_a_body_shorter_than_its_content_length_times_out(quick: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", quick)
    started = time.monotonic()
    writer.write(
        b"POST /api/chat HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": "m"'
    )
    status, headers, body = await response(reader)
    took = time.monotonic() - started
    writer.close()
    assert status == 408 and 0.9 < took < 2.0
    assert headers["connection"].lower() == "close"
    assert "GATEWAY_BODY_TIMEOUT_S" in json.loads(body)["error"]


async def test_a_keyed_gateway_bounds_slow_clients_before_the_key_is_checked(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    await add_key(nc, "alice")
    url = await start_gateway(runner, nats_server.url, **QUICK)
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(b"POST /api/chat HTTP/1.1\r\nHost: gateway\r\n")
    received, took = await until_closed(reader, limit_s=5)
    writer.close()
    assert received == b"" and took < 2.0


async def test_a_keys_task_is_read_and_followed_with_that_key_only(
    nats_server: NatsServer, nc: Client, pg_dsn: str, runner: ServiceRunner
) -> None:
    alice, bob = await add_key(nc, "alice"), await add_key(nc, "bob")
    runner.stats(nats_server.url, pg_dsn)
    async with (
        fleet(nats_server, nc, runner) as url,
        httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(alice)) as as_alice,
        httpx.AsyncClient(base_url=url, timeout=10, headers=bearer(bob)) as as_bob,
    ):
        asked = await as_alice.post("/route", json={"prompt": "p", "model": PLAIN, "wait": True})
        assert asked.status_code == 200, asked.text
        task_id = asked.json()["task_id"]

        async def projected() -> httpx.Response | None:
            reply = await as_alice.get(f"/task/{task_id}")
            return reply if reply.status_code == 200 else None

        assert (await eventually(projected, timeout_s=20.0)).json()["status"] == "done"
        # Another key is told what a task nobody has gets.
        read = await as_bob.get(f"/task/{task_id}")
        unknown = await as_bob.get("/task/no-such-task")
        assert (read.status_code, read.json()["error"]["code"]) == (404, "not_found")
        assert read.json()["error"]["message"].replace(task_id, "X") == unknown.json()["error"][
            "message"
        ].replace("no-such-task", "X")
        follow = {"prompt": "p", "model": PLAIN, "wait": True, "task_id": task_id}
        followed = await as_bob.post("/route", json=follow)
        assert (followed.status_code, followed.json()["error"]["code"]) == (404, "not_found")
        mine = await as_alice.post("/route", json=follow)
        assert mine.status_code == 200 and mine.json()["task_id"] == task_id
        # Nor through the bus, where nothing proves who asks but a key a request names.
        body, headers = await request(nc, TASK, {"task_id": task_id})
        assert headers.get("Nats-Service-Error-Code") == "not_found", body


async def test_the_dashboard_shows_a_key_its_own_tasks_ids_and_the_operators_key_all(
    nats_server: NatsServer, nc: Client, runner: ServiceRunner
) -> None:
    alice, bob = await add_key(nc, "alice"), await add_key(nc, "bob")
    ops = await add_key(nc, "ops", operator=True)
    with FakeOllama(models=[PLAIN]) as fake:
        runner.router(nats_server.url)
        runner.worker(nats_server.url, fake.url, "cpu-1")
        url = await start_gateway(runner, nats_server.url)
        await workers_live(nc, 1)
        fake.configure(chunk_delay_s=0.3)
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            asked = await http.post(
                "/route",
                json={"prompt": "a long one", "model": PLAIN},
                headers=bearer(alice),
            )
            task_id = asked.json()["task_id"]

            async def seen_by(key: str) -> dict[str, Any]:
                state = await http.get("/dashboard/state", headers=bearer(key))
                assert state.status_code == 200, state.text
                body: dict[str, Any] = state.json()
                return body

            async def running() -> dict[str, Any] | None:
                state = await seen_by(ops)
                busy = [w for w in state["workers"] if w["current_task"] == task_id]
                return state if busy and state["tasks"]["open"] else None

            as_ops = await eventually(running, timeout_s=20)
            as_alice, as_bob = await seen_by(alice), await seen_by(bob)
            streamed = await first_frames(http, bob, {"workers", "tasks"})
            fake.configure(chunk_delay_s=0.0)

            async def done() -> dict[str, Any] | None:
                state = await seen_by(bob)
                return state if state["tasks"]["done"] else None

            bob_after = await eventually(done, timeout_s=30)
            alice_after = await seen_by(alice)

    def open_ids(state: dict[str, Any]) -> list[str]:
        return [t["task_id"] for t in state["tasks"]["open"]]

    assert as_ops["workers"][0]["current_task"] == task_id
    assert as_alice["workers"][0]["current_task"] == task_id
    assert as_bob["workers"][0]["current_task"] == ""  # busy, with whose task not said
    assert open_ids(as_ops) == open_ids(as_alice) == [task_id]
    assert open_ids(as_bob) == [""]
    assert task_id not in json.dumps(streamed)  # the page's stream blanks it too
    assert streamed["workers"][0]["current_task"] == ""
    assert as_bob["tasks"]["open"][0].get("client") is None
    assert as_ops["tasks"]["open"][0]["client"] == "alice"
    assert [e["task_id"] for e in alice_after["tasks"]["done"]] == [task_id]
    assert [e["task_id"] for e in bob_after["tasks"]["done"]] == [""]
    # Nothing but the blanked ids differs: the counts are the fleet's.
    assert bob_after["summary"]["workers"] == alice_after["summary"]["workers"] == 1


async def first_frames(http: httpx.AsyncClient, key: str, names: set[str]) -> dict[str, Any]:
    """The first frame of each of ``names`` that ``/dashboard/stream`` sends ``key``."""
    found: dict[str, Any] = {}
    event = ""
    async with http.stream("GET", "/dashboard/stream", headers=bearer(key)) as stream:
        async for line in stream.aiter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in names:
                found[event] = json.loads(line.removeprefix("data: "))
                if set(found) == names:
                    return found
    raise AssertionError(f"the stream ended before {names - set(found)}")
