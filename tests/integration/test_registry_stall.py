"""A registry that stores no heartbeats while every connection stays up: a JetStream cluster
electing the ``workers`` bucket's leader. No worker may be judged dead for it: the router
answers ``unavailable`` (never ``no_worker``) and the reaper fails no running task."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from nats.aio.client import Client
from structlog.testing import capture_logs

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsCluster
from schemas.subjects import ROUTE, WORKERS_BUCKET
from services.cli.health import setup_streams
from services.cli.permissions import (
    EXAMPLE_WORKERS,
    nats_user,
)
from services.runtime.bus import connect
from services.runtime.request import new_task_id, stream_call
from tests.harness import ServiceRunner, eventually, request, workers_live
from tests.integration.test_cluster import MODEL, auth, cluster, password

__all__ = ["cluster"]  # the three-node cluster fixture, shared with test_cluster

WORKER = EXAMPLE_WORKERS[0]


async def registry_leader(nc: Client, cluster: NatsCluster) -> int:
    """The node that leads the ``workers`` bucket's stream."""
    info = await nc.jetstream().stream_info(f"KV_{WORKERS_BUCKET}")
    assert info.cluster is not None and info.cluster.leader
    [node] = [
        i
        for i, port in enumerate(cluster.cluster_ports)
        if info.cluster.leader.endswith(f"-{port}")
    ]
    return node


async def test_no_worker_is_judged_dead_while_the_registry_elects_its_leader(
    cluster: NatsCluster, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    await setup_streams(
        cluster.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=auth("operator"), replicas=3
    )
    worker_user = nats_user("worker", WORKER)
    with capture_logs() as logs:
        runner.router(cluster.url, nats_user="router", nats_password=password("router"))
        runner.reaper(cluster.url, nats_user="reaper", nats_password=password("reaper"))
        runner.worker(
            cluster.url,
            ollama.url,
            WORKER,
            nats_user=worker_user,
            nats_password=password(worker_user),
        )
        nc = await connect(cluster.url, "test-client", auth=auth("client"))
        try:
            await workers_live(nc, 1)
            ollama.delay_s = 6.0
            # As clients ask: naming the task, asking again after a silence (a reply may be
            # lost with the node a router or this client was connected to).
            ask = {"prompt": "2+2", "model": MODEL, "wait": True, "task_id": new_task_id()}
            running = asyncio.create_task(final_reply(nc, ask))
            await eventually(lambda: _busy(nc), timeout_s=10)

            admin = await connect(cluster.url, "test-admin", auth=auth("admin"))
            try:
                victim = await registry_leader(admin, cluster)
            finally:
                await admin.close()
            cluster.kill(victim)
            killed_at = time.monotonic()

            # While the bucket elects a leader (seconds), nobody is told the fleet is gone.
            answers: list[str] = []
            while time.monotonic() - killed_at < 12:
                try:
                    body, headers = await request(
                        nc, ROUTE, {"prompt": "1+1", "model": MODEL}, timeout_s=3.0
                    )
                except Exception:
                    await asyncio.sleep(0.2)  # the client's own node may be the one killed
                    continue
                code = headers.get("Nats-Service-Error-Code", body.get("status", ""))
                answers.append(f"{time.monotonic() - killed_at:.1f}:{code}")
                await asyncio.sleep(0.3)
            body = await asyncio.wait_for(running, 60)
        finally:
            await nc.close()

    assert answers, "no route request was answered in the election's window"
    assert not [a for a in answers if a.endswith(":no_worker")], answers
    # The running task ended where it ran, whatever the worker had to stop meanwhile.
    assert (body["status"], body["response"], body["worker"]) == ("done", "4", WORKER)
    events = [entry["event"] for entry in logs]
    assert "task failed by the reaper" not in events


async def final_reply(nc: Client, ask: dict[str, Any]) -> dict[str, Any]:
    final = b""
    async for item in stream_call(nc, ROUTE, msgspec.json.encode(ask), 60.0, reask_s=2.0):
        if isinstance(item, bytes):
            final = item
    reply: dict[str, Any] = msgspec.json.decode(final)
    return reply


async def _busy(nc: Client) -> bool:
    body: dict[str, Any]
    body, _ = await request(nc, "coordinator.workers", {}, timeout_s=2.0)
    return any(w.get("current_task") for w in body["workers"])
