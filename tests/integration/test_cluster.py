"""A JetStream cluster of three real nats-servers on loopback ports, each running the
configuration `coordinator deploy render nats --cluster` makes for its node: only a node that
knows the cluster's password joins; `coordinator setup --replicas 3` moves a fleet's streams
and buckets from one copy to three with every message kept; services and clients given every
node in NATS_URL keep working when the node they are connected to is killed; and
`coordinator doctor` names a stopped node."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError, ServiceUnavailableError

from devtools.fakes.ollama import FakeOllama
from devtools.servers import NatsCluster, NatsServer, free_port
from schemas.subjects import EVENTS_STREAM, ROUTE, STATS_CONSUMER, TASKS_STREAM
from services.cli.health import setup_streams
from services.cli.permissions import (
    EXAMPLE_WEB_WORKERS,
    EXAMPLE_WORKERS,
    NATS_ROLES,
    nats_user,
    password_variable,
)
from services.cli.replication import FLEET_BUCKETS, FLEET_STREAMS
from services.errors import NoWorker
from services.router.submit import AlreadySubmitted, record_refusal, submit
from services.runtime.bus import connect
from services.runtime.settings import NatsAuth
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    logged,
    request,
    run_cli,
    workers_live,
)
from tests.integration.test_follow import count_events
from tests.integration.test_submit import task

WORKER = EXAMPLE_WORKERS[0]
USERS = [
    "admin",
    *NATS_ROLES,
    *(nats_user("worker", w) for w in EXAMPLE_WORKERS),
    *(nats_user("web-search", w) for w in EXAMPLE_WEB_WORKERS),
]
MODEL = "qwen2.5:0.5b"


def password(user: str) -> str:
    return f"pw-{user}"


def auth(user: str) -> NatsAuth:
    return NatsAuth(user=user, password=password(user))


def user_env(url: str, user: str, **extra: str) -> dict[str, str]:
    return clean_env(NATS_URL=url, NATS_USER=user, NATS_PASSWORD=password(user), **extra)


@pytest.fixture
def cluster() -> Iterator[NatsCluster]:
    with tempfile.TemporaryDirectory(prefix="coord-cluster-") as root:
        nodes = NatsCluster(
            root,
            {password_variable(user): password(user) for user in USERS},
            workers=EXAMPLE_WORKERS,
            web_workers=EXAMPLE_WEB_WORKERS,
        )
        try:
            yield nodes.start()
        finally:
            nodes.stop()


def route_names(cluster: NatsCluster, i: int) -> set[str]:
    _, body = cluster.monitor(i, "/routez")
    return {str(r.get("remote_name")) for r in json.loads(body).get("routes") or []}


async def test_only_a_node_that_knows_the_cluster_password_joins(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    others = {f"127.0.0.1-{port}" for port in cluster.cluster_ports[1:]}
    await eventually(lambda: asyncio.to_thread(lambda: others <= route_names(cluster, 0)))
    # A server that reaches the cluster port, with a wrong password and with none.
    target = cluster.cluster_ports[0]
    rogues = []
    # And, to show the rogues did try, one that knows it (a server without JetStream).
    known = f"cluster:{cluster.CLUSTER_PASSWORD}@"
    tries = (("rogue-wrong", "cluster:wrong@"), ("rogue-none", ""), ("friend", known))
    for name, userinfo in tries:
        conf = tmp_path / f"{name}.conf"
        conf.write_text(
            f"server_name: {name}\n"
            f"cluster {{ name: coordinator, listen: 127.0.0.1:{free_port()}, "
            f'routes: ["nats-route://{userinfo}127.0.0.1:{target}"] }}\n'
        )
        rogues.append(NatsServer(str(tmp_path / name), config=str(conf)).start())
    try:
        # Each tries its route at once and again every second.
        await eventually(lambda: asyncio.to_thread(lambda: "friend" in route_names(cluster, 0)))
        await asyncio.sleep(2)
        assert route_names(cluster, 0) & {"rogue-wrong", "rogue-none"} == set()
        assert others <= route_names(cluster, 0)
    finally:
        for rogue in rogues:
            rogue.stop()


async def _pulled(sub: JetStreamContext.PullSubscription, batch: int) -> list[Msg]:
    """The next messages of a pull consumer. One just made may live on another node: until
    its leader has subscribed and the routes carry that interest to this client's server, a
    pull is answered 503 (no responders). That wait is waited out, within 10 s."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            return await sub.fetch(batch, timeout=5)
        except ServiceUnavailableError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


async def put_fleet_data(url: str) -> dict[str, Any]:
    """Events, queued tasks, a value in every bucket and a consumer half way through the
    events, as the admin user; returns what each stream held."""
    nc = await connect(url, "test-admin", auth=auth("admin"))
    try:
        js = nc.jetstream()
        for i in range(200):
            await js.publish(f"events.task.t{i}.submitted", f"event-{i}".encode())
        for i in range(20):
            await js.publish(f"tasks.cpu.{WORKER}", f"task-{i}".encode())
        for bucket in FLEET_BUCKETS:
            kv = await js.key_value(bucket)
            await kv.put("kept", f"value-of-{bucket}".encode())
        await js.add_consumer(
            EVENTS_STREAM,
            ConsumerConfig(durable_name=STATS_CONSUMER, ack_policy=AckPolicy.EXPLICIT),
        )
        sub = await js.pull_subscribe_bind(STATS_CONSUMER, EVENTS_STREAM)
        acked = 0
        while acked < 50:
            for msg in await _pulled(sub, 50 - acked):
                await msg.ack_sync()
                acked += 1
        infos = {name: await js.stream_info(name) for name in FLEET_STREAMS}
        consumer = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
        return {
            "streams": {n: (i.state.messages, i.state.last_seq) for n, i in infos.items()},
            "ack_floor": consumer.ack_floor.stream_seq if consumer.ack_floor else None,
            "pending": consumer.num_pending,
        }
    finally:
        await nc.close()


async def test_setup_moves_every_stream_and_bucket_from_one_replica_to_three_keeping_all(
    cluster: NatsCluster,
) -> None:
    # Today's setup: one replica of everything, wherever the cluster put it.
    await setup_streams(
        cluster.url, worker_ttl_s=3600.0, events_max_age_s=0.0, auth=auth("operator")
    )
    before = await put_fleet_data(cluster.url)

    # The registry's TTL as the fleet's was set (a shorter one would expire the entry).
    env = user_env(cluster.url, "operator", WORKER_TTL_S="3600")
    result = await asyncio.to_thread(run_cli, "setup", "--replicas", "3", env=env, timeout=200)

    assert result.returncode == 0, result.stderr
    for name in FLEET_STREAMS:
        assert f"{name}: 3 replica(s), 3 current" in result.stdout
    nc = await connect(cluster.url, "test-admin", auth=auth("admin"))
    try:
        js = nc.jetstream()
        for name in FLEET_STREAMS:
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert (info.state.messages, info.state.last_seq) == tuple(before["streams"][name])
            assert info.cluster is not None and info.cluster.leader, name
            followers = info.cluster.replicas or []
            assert len(followers) == 2, name
            assert all(p.current and not p.offline for p in followers), (name, followers)
        # Every message as it was written, in order.
        for seq in range(1, 201):
            msg = await js.get_msg(EVENTS_STREAM, seq)
            assert msg.data == f"event-{seq - 1}".encode()
        tasks = await js.stream_info(TASKS_STREAM)
        assert tasks.state.messages == 20
        for bucket in FLEET_BUCKETS:
            entry = await (await js.key_value(bucket)).get("kept")
            assert entry.value == f"value-of-{bucket}".encode()
        # The durable consumer followed its stream, where it was.
        consumer = await js.consumer_info(EVENTS_STREAM, STATS_CONSUMER)
        assert consumer.ack_floor is not None
        assert consumer.ack_floor.stream_seq == before["ack_floor"] == 50
        assert consumer.num_pending == before["pending"] == 150
        assert consumer.cluster is not None and len(consumer.cluster.replicas or []) == 2
    finally:
        await nc.close()

    # Run again without --replicas (as compose's setup job does on every start): kept at 3.
    again = await asyncio.to_thread(run_cli, "setup", env=env)
    assert again.returncode == 0, again.stderr
    nc = await connect(cluster.url, "test-admin", auth=auth("admin"))
    try:
        for name in FLEET_STREAMS:
            assert (await nc.jetstream().stream_info(name)).config.num_replicas == 3
    finally:
        await nc.close()


async def test_more_replicas_than_servers_is_refused_before_anything_changes(
    cluster: NatsCluster, nats_server: NatsServer
) -> None:
    result = await asyncio.to_thread(
        run_cli, "setup", "--replicas", "5", env=user_env(cluster.url, "operator")
    )
    assert result.returncode == 2
    assert "has 3 server(s) up" in result.stderr
    assert "cannot keep 5 replicas" in result.stderr
    nc = await connect(cluster.url, "test-admin", auth=auth("admin"))
    try:
        with pytest.raises(NotFoundError):
            await nc.jetstream().stream_info(TASKS_STREAM)
    finally:
        await nc.close()

    single = await asyncio.to_thread(
        run_cli, "setup", "--replicas", "3", env=clean_env(NATS_URL=nats_server.url)
    )
    assert single.returncode == 2
    assert "is a single server, not a JetStream cluster" in single.stderr
    for bad in (["--replicas", "0"], ["--replicas", "6"]):
        refused = await asyncio.to_thread(
            run_cli, "setup", *bad, env=clean_env(NATS_URL=nats_server.url)
        )
        assert refused.returncode == 2
        assert "--replicas must be 1 to 5" in refused.stderr
    from_env = await asyncio.to_thread(
        run_cli, "setup", env=clean_env(NATS_URL=nats_server.url, NATS_REPLICAS="7")
    )
    assert from_env.returncode == 2
    assert "NATS_REPLICAS must be 1 to 5" in from_env.stderr


async def route(nc: Client) -> dict[str, Any]:
    body, _ = await request(
        nc, ROUTE, {"prompt": "1+1?", "model": MODEL, "wait": True}, timeout_s=10.0
    )
    return body


async def client_beside(cluster: NatsCluster, service: str) -> Client:
    """A client given every node (`connect` with NATS_URL as a fleet sets it) that happens to
    be connected to the node ``service`` is on, so that killing that node tests both."""

    def serving() -> list[int]:
        try:
            return [cluster.node_serving(service)]
        except LookupError:  # not connected yet
            return []

    [target] = await eventually(lambda: asyncio.to_thread(serving), timeout_s=20)
    for attempt in range(60):
        nc = await connect(cluster.url, f"test-client-{attempt}", auth=auth("client"))
        await nc.flush()
        if await asyncio.to_thread(cluster.node_serving, f"test-client-{attempt}") == target:
            return nc
        await nc.close()
    raise AssertionError("the client never landed beside the service")


async def test_services_and_clients_fail_over_when_their_node_is_killed(
    cluster: NatsCluster, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    await setup_streams(
        cluster.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=auth("operator"), replicas=3
    )
    runner.router(cluster.url, nats_user="router", nats_password=password("router"))
    worker_user = nats_user("worker", WORKER)
    runner.worker(
        cluster.url, ollama.url, WORKER, nats_user=worker_user, nats_password=password(worker_user)
    )
    nc = await client_beside(cluster, "coordinator-router")
    operator = await connect(cluster.url, "test-operator", auth=auth("operator"))
    try:
        await workers_live(nc, 1)
        assert (await route(nc))["status"] == "done"
        victim = await asyncio.to_thread(cluster.node_serving, "coordinator-router")

        cluster.kill(victim)

        async def routed() -> dict[str, Any] | None:
            try:
                body = await route(nc)
            except Exception:
                return None
            return body if body.get("status") == "done" else None

        body = await eventually(routed, timeout_s=45, interval_s=0.5)
        assert body["worker"] == WORKER
        assert await asyncio.to_thread(cluster.node_serving, "coordinator-router") != victim
        assert nc.connected_url is not None
        assert nc.connected_url.port != cluster.nodes[victim].port
        # A bucket, through whichever node the operator's connection is on now.
        keys = await operator.jetstream().key_value("gateway_keys")
        await keys.put("failover-check", b"still-here")
        assert (await keys.get("failover-check")).value == b"still-here"
    finally:
        await operator.close()
        await nc.close()


async def test_a_service_started_while_jetstream_cannot_answer_waits_for_it(
    cluster: NatsCluster, ollama: FakeOllama, processes: Processes
) -> None:
    """Two of three nodes down: the last one has no quorum, and JetStream answers nothing. A
    worker and a router started then (as after a machine's reboot while its peers come back)
    wait, saying why, instead of exiting for a supervisor to retry, and are ready once the
    nodes are back; a stop then ends them as usual."""
    await setup_streams(
        cluster.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=auth("operator"), replicas=3
    )
    cluster.kill(1)
    cluster.kill(2)
    worker_user = nats_user("worker", WORKER)
    env = user_env(cluster.nodes[0].url, worker_user, OLLAMA_HOST=ollama.url, WORKER_ID=WORKER)
    worker = processes.start([COORDINATOR, "worker"], env)
    router = processes.start([COORDINATOR, "router"], user_env(cluster.nodes[0].url, "router"))
    for service in (worker, router):
        await logged(service, "JetStream does not answer; asking again", timeout_s=30)
        await logged(service, "JetStream does not answer; asking again", timeout_s=30)  # still
    assert worker.poll() is None and router.poll() is None

    for i in (1, 2):
        cluster.nodes[i].start()
    for i in (1, 2):
        await asyncio.to_thread(cluster.wait_healthy, i, 60.0)
    await logged(worker, "worker ready", timeout_s=60)
    await logged(router, "router ready", timeout_s=60)

    for service in (worker, router):
        service.send_signal(signal.SIGTERM)
    for service in (worker, router):
        assert await asyncio.to_thread(service.wait, 30) == 0


def doctor_lines(result: subprocess.CompletedProcess[str]) -> dict[str, str]:
    return {line[9:31].strip(): line for line in result.stdout.splitlines()}


async def test_the_doctor_names_a_stopped_node_and_the_replicas_it_held(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    await setup_streams(
        cluster.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=auth("operator"), replicas=3
    )
    await put_fleet_data(cluster.url)
    system = {"NATS_SYSTEM_USER": "system", "NATS_SYSTEM_PASSWORD": cluster.SYSTEM_PASSWORD}
    env = user_env(cluster.url, "operator", **system)

    def doctor(environment: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return run_cli("doctor", "--unit-dir", str(tmp_path), env=environment, timeout=60)

    healthy = doctor_lines(await asyncio.to_thread(doctor, env))
    assert healthy["cluster peers"].startswith("ok"), healthy
    assert "3 of cluster coordinator" in healthy["cluster peers"]
    assert healthy["meta leader"].startswith("ok")
    assert healthy["stream replicas"].startswith("ok")
    expected = f"{len(FLEET_STREAMS)} streams, 3 replicas each, all current"
    assert expected in healthy["stream replicas"]
    without = doctor_lines(await asyncio.to_thread(doctor, user_env(cluster.url, "operator")))
    assert without["cluster peers"].startswith("skipped")
    assert "NATS_SYSTEM_USER" in without["cluster peers"]

    stopped = len(cluster.nodes) - 1
    name = f"127.0.0.1-{cluster.cluster_ports[stopped]}"
    cluster.nodes[stopped].stop()

    async def names_it() -> subprocess.CompletedProcess[str] | None:
        """Once the meta leader is back and every stream whose leader the node held has
        elected another (until then the doctor says that stream does not answer)."""
        result = await asyncio.to_thread(doctor, env)
        lines = doctor_lines(result)
        replicas = lines.get("stream replicas", "")
        if (
            f"{name} is offline" in lines.get("cluster peers", "")
            and lines.get("meta leader", "").startswith("ok")
            and all(f"{stream}: replica on {name} is" in replicas for stream in FLEET_STREAMS)
        ):
            return result
        return None

    result = await eventually(names_it, timeout_s=60, interval_s=1.0)
    assert result.returncode == 1
    lines = doctor_lines(result)
    assert lines["cluster peers"].startswith("problem")
    assert lines["stream replicas"].startswith("problem")
    for stream in FLEET_STREAMS:
        assert f"{stream}: replica on {name} is" in lines["stream replicas"]
    # A majority is still up: every stream still answers.
    assert lines["streams"].startswith("ok"), lines["streams"]


async def test_a_cluster_url_is_one_comma_separated_list(cluster: NatsCluster) -> None:
    nc = await nats.connect(
        servers=[node.url for node in cluster.nodes],
        user="admin",
        password=password("admin"),
    )
    try:
        assert nc._server_info.get("cluster") == "coordinator"
        advertised = {str(url) for url in nc._server_info.get("connect_urls") or []}
        assert advertised == {f"127.0.0.1:{node.port}" for node in cluster.nodes}
    finally:
        await nc.close()


async def test_a_refusal_and_the_routing_of_one_task_exclude_each_other_when_replicated(
    cluster: NatsCluster,
) -> None:
    """A router storing a task while another stores its refusal, at once, on a stream with
    three replicas: the stream's leader checks each fence against the writes it is still
    proposing on that subject, so exactly one of the two is stored, every time."""
    await setup_streams(
        cluster.url, worker_ttl_s=3.0, events_max_age_s=0.0, auth=auth("operator"), replicas=3
    )
    nc = await connect(cluster.url, "test-router", auth=auth("router"))
    js = nc.jetstream(timeout=10.0)
    refused = NoWorker("no worker is registered and alive")

    async def routed(task_id: str) -> bool:
        try:
            await submit(js, task(task_id), fences=True)
        except AlreadySubmitted:
            return False
        return True

    try:
        for i in range(100):
            task_id = f"t-both-{i}"
            # The refusal sent a little later each time: from before the routing's write
            # reaches the leader to after it is stored, through the span it is proposed.
            later = asyncio.sleep(0.0005 * (i % 20))
            stored, refusal = await asyncio.gather(
                routed(task_id), _after(later, record_refusal(js, task_id, refused))
            )
            routings = await count_events(nc, task_id, "routed")
            refusals = await count_events(nc, task_id, "failed")
            assert (routings, refusals) in ((1, 0), (0, 1)), (task_id, routings, refusals)
            assert (stored, refusal) == (routings == 1, refusals == 1), task_id
    finally:
        await nc.close()


async def _after(first: Awaitable[None], then: Awaitable[bool]) -> bool:
    await first
    return await then
