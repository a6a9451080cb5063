"""Runtime pieces every task-running service shares, on a real nats-server."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import MutableMapping
from contextlib import suppress
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import ServiceUnavailableError
from nats.js.kv import KeyValue
from structlog.testing import capture_logs

from devtools.servers import NatsServer
from schemas.events import Durations, TaskCompleted, TaskFailed, TaskStarted
from schemas.subjects import EVENTS_STREAM, TASKS_STREAM, WORKERS_BUCKET
from services.fleet.settling import SettlingTracker
from services.runtime.bus import ensure_bucket, ensure_streams, publish_event, started
from services.runtime.lifecycle import install_stop_signals
from services.runtime.outcomes import (
    KeepAlive,
    Sourced,
    last_started,
    store_outcome,
    stored_outcome,
)
from services.runtime.stall import look_once
from services.runtime.watch import READ_WITHIN_S, BucketCursor, follow_bucket, reconnects
from tests.harness import eventually
from tests.integration.test_lease import record


def completed(attempt: int = 1, response: str = "2") -> TaskCompleted:
    return TaskCompleted(
        at=1.0,
        task_id="t1",
        attempt=attempt,
        worker="w",
        model="m",
        response=response,
        durations=Durations(total_ms=1.0),
    )


def anyone(sourced: Sourced) -> bool:
    return True


async def test_a_recorder_stores_one_outcome_per_attempt_the_first(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    assert await stored_outcome(js, "t1", 1, anyone) is None

    await store_outcome(js, completed(response="first"), by="w")
    await store_outcome(js, completed(response="second"), by="w")  # a redelivered copy's
    await store_outcome(
        js,
        TaskFailed(at=2.0, task_id="t1", attempt=1, worker="v", code="worker_lost", reason="x"),
        by="v",
    )  # another worker's, on its own subject: it cannot take the place of w's

    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 2
    stored = await stored_outcome(js, "t1", 1, lambda sourced: sourced[1] == "w")
    assert isinstance(stored, TaskCompleted) and stored.response == "first"
    assert await stored_outcome(js, "t1", 1, lambda sourced: False) is None
    assert await stored_outcome(js, "t1", 2, anyone) is None  # a later attempt has not ended


async def test_last_started_is_of_the_attempt_asked_about(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    assert await last_started(js, "t1", 1) is None
    await publish_event(js, TaskStarted(at=1.0, task_id="t1", attempt=1, worker="a", host="h"))
    found = await last_started(js, "t1", 1)
    assert found is not None
    started, source, _ = found
    assert isinstance(started, TaskStarted) and (started.worker, started.host) == ("a", "h")
    assert source == "a"  # the worker its subject names
    assert await last_started(js, "t1", 2) is None


async def test_keep_alive_holds_a_message_past_its_ack_wait(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_streams(js)
    config = ConsumerConfig(
        durable_name="k", filter_subject="tasks.k", ack_policy=AckPolicy.EXPLICIT, ack_wait=0.6
    )
    await js.add_consumer(TASKS_STREAM, config)
    sub = await js.pull_subscribe_bind(durable="k", stream=TASKS_STREAM)
    await js.publish("tasks.k", b"work")
    [msg] = await sub.fetch(1, timeout=2)

    async with KeepAlive(msg, ack_wait_s=0.6):
        await asyncio.sleep(1.5)  # silent work, longer than ack_wait
        info = await js.consumer_info(TASKS_STREAM, "k")
        assert info.num_redelivered == 0
    await msg.ack()


async def test_a_shorter_registry_ttl_is_applied_to_an_existing_bucket(nc: Client) -> None:
    js = nc.jetstream()
    await ensure_bucket(js, WORKERS_BUCKET, ttl_s=15)
    await ensure_bucket(js, WORKERS_BUCKET, ttl_s=2)  # was refused: duplicate window > max age
    info = await js.stream_info(f"KV_{WORKERS_BUCKET}")
    assert info.config.max_age == 2


async def test_a_watch_started_after_the_newest_entries_expired_is_not_behind(nc: Client) -> None:
    """A worker's last heartbeats can expire before a watch (started again after a reconnect
    or a lost consumer) reads them: nothing is missing, so the stall look must not start the
    watch again (it did, every look, for as long as the stale worker stayed in a view)."""
    kv = await ensure_bucket(nc.jetstream(), WORKERS_BUCKET, ttl_s=1.0)
    stale = record("gone")
    await kv.put("w1", msgspec.json.encode(stale))
    await kv.put("w1", msgspec.json.encode(stale))

    async def expired() -> bool:
        return (await kv.status()).stream_info.state.messages == 0

    await eventually(expired, timeout_s=10)
    cursor = BucketCursor(nc)
    watch = await _watch_read(nc, kv, cursor)
    try:
        assert cursor.revision == 2
        settling = SettlingTracker(generation=0, now=time.time())
        with capture_logs() as logs:
            stalled = await look_once(nc.jetstream(), settling, lambda: [stale], cursor, 1.0)
        assert not stalled
        assert not cursor.restart.is_set()
        assert logs == []
    finally:
        await _silenced(watch)


async def test_a_watch_is_judged_behind_only_once_it_has_read_on_the_current_connection(
    nats_server: NatsServer, nc: Client
) -> None:
    """Right after a reconnect the watch has not caught up yet (it is about to read the bucket
    again, as after any reconnect): taken for a watch that fell behind, its view was kept
    settling for another failover time, and a router answered ``unavailable`` that long. A
    watch that has read on the current connection and then falls silent is behind."""
    js = nc.jetstream()
    kv = await ensure_bucket(js, WORKERS_BUCKET, ttl_s=30)
    stale = record("gone")  # a worker that went quiet: the view looks at its bucket
    await kv.put("w1", msgspec.json.encode(stale))
    cursor = BucketCursor(nc)

    async def look() -> tuple[bool, list[MutableMapping[str, Any]]]:
        settling = SettlingTracker(generation=reconnects(nc), now=time.time())
        with capture_logs() as logs:
            await look_once(js, settling, lambda: [stale], cursor, 30.0)
        restarted = cursor.restart.is_set()
        cursor.restart.clear()
        return restarted, logs

    # Read on the first connection; then the bus restarts, and a heartbeat is stored before
    # the watch has started again.
    await _silenced(await _watch_read(nc, kv, cursor))
    before = reconnects(nc)
    await asyncio.to_thread(nats_server.stop)
    await asyncio.to_thread(nats_server.start)

    async def reconnected() -> bool:
        return reconnects(nc) > before and nc.is_connected

    await eventually(reconnected, timeout_s=15)
    await kv.put("w1", msgspec.json.encode(stale))
    assert await look() == (False, [])
    # (Unless a watch started on it has been reading for too long: its consumer was lost.)
    cursor.watching = (reconnects(nc), False, time.monotonic() - READ_WITHIN_S)
    assert (await look())[0]

    # Read again on this connection, and silent since: a new heartbeat is one it missed.
    await _silenced(await _watch_read(nc, kv, cursor))
    assert await look() == (False, [])
    await kv.put("w1", msgspec.json.encode(stale))
    restarted, logs = await look()
    assert restarted
    assert [entry["event"] for entry in logs] == [
        "the worker registry's watch fell behind (its consumer was lost?); reading the bucket again"
    ]


async def _watch_read(nc: Client, kv: KeyValue, cursor: BucketCursor) -> asyncio.Task[None]:
    """A watch of ``kv`` with ``cursor``, once it has fed the bucket's current values."""
    ready = asyncio.Event()
    watch = asyncio.create_task(follow_bucket(nc, kv, lambda _: None, ready, cursor=cursor))
    await asyncio.wait_for(ready.wait(), 10)
    return watch


async def _silenced(watch: asyncio.Task[None]) -> None:
    """The watch stopped, as one whose consumer was lost: it feeds nothing more."""
    watch.cancel()
    with suppress(asyncio.CancelledError):
        await watch


class _JetStreamStart:
    """A service whose start asks JetStream, as every service's does."""

    def __init__(self, nc: Client, made: list[_JetStreamStart]) -> None:
        self.js = nc.jetstream()
        self.stopped = False
        made.append(self)

    async def start(self) -> None:
        await self.js.account_info()

    async def stop(self) -> None:
        self.stopped = True


async def test_a_start_that_finds_jetstream_silent_is_made_afresh_until_it_answers(
    tmp_path: Path,
) -> None:
    """A server without JetStream has no responders for its API (as a node with no quorum has
    no answer): each try is stopped, and a fresh service is started once JetStream is up."""
    plain = tmp_path / "plain.conf"
    plain.write_text("max_payload: 1048576\n")  # no jetstream block
    without = NatsServer(str(tmp_path / "store"), config=str(plain)).start()
    stop = asyncio.Event()
    install_stop_signals(stop)  # a service, not a one-shot command: it waits
    nc = await nats.connect(without.url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    made: list[_JetStreamStart] = []
    try:
        starting = asyncio.create_task(started(lambda: _JetStreamStart(nc, made), "a start"))

        async def asked_again() -> bool:
            return len(made) >= 2

        await eventually(asked_again, timeout_s=10)
        assert not starting.done()
        without.stop()
        with_js = NatsServer(str(tmp_path / "store"), port=without.port).start()
        try:
            service = await asyncio.wait_for(starting, 30)
            assert service is made[-1] and not service.stopped
            assert all(earlier.stopped for earlier in made[:-1])
        finally:
            await nc.close()
            with_js.stop()
    finally:
        without.stop()
        # The loop is the session's: the signals are pytest's again.
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().remove_signal_handler(sig)


async def test_a_start_is_stopped_when_it_fails_and_a_one_shot_command_asks_once(
    tmp_path: Path,
) -> None:
    plain = tmp_path / "plain.conf"
    plain.write_text("max_payload: 1048576\n")
    without = NatsServer(str(tmp_path / "store"), config=str(plain)).start()
    nc = await nats.connect(without.url)
    made: list[_JetStreamStart] = []
    try:
        with pytest.raises(ServiceUnavailableError):
            await started(lambda: _JetStreamStart(nc, made), "a start")
        assert len(made) == 1 and made[0].stopped
    finally:
        await nc.close()
        without.stop()
