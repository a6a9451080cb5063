"""One identity per person and per machine: nats-server runs the configuration
``coordinator deploy render nats --jwt`` prints, and every service, person and machine connects
with its own identity from ``coordinator invite``. None is added to the server, which is never
restarted nor reloaded to let one in; a revoked one is cut off at once and refused after, a
restart included; nobody reads another's inbox; a machine joins with its token alone, from a
network namespace of its own."""

from __future__ import annotations

import asyncio
import json
import plistlib
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from structlog.testing import capture_logs

from benchmarks.up_stop import up_env
from devtools.fakes.ollama import FakeOllama
from devtools.machines import systemd_machine, systemd_unavailable
from devtools.servers import NatsCluster, NatsServer
from schemas.events import AliasSet
from schemas.subjects import (
    CANCEL,
    OWN_CONSUMER,
    ROUTE,
    TASK,
    TASKS_STREAM,
    WORKERS,
    cancel_from,
    worker_consumer,
)
from services.cli.health import setup_streams
from services.cli.identities import Store
from services.fleet.identity import decode_token
from services.runtime.bus import publish_event
from services.runtime.settings import NatsAuth
from services.stats.service import run as run_stats
from services.stats.settings import StatsSettings
from tests.harness import (
    COORDINATOR,
    Processes,
    ServiceRunner,
    clean_env,
    eventually,
    last_task_event,
    request,
    run_cli,
    workers_live,
)
from tests.hosts import NetnsHost, netns_hosts, netns_unavailable
from tests.integration.test_gateway import hang_up_mid_stream, start_gateway
from tests.integration.test_processes import wait_until_ready

MODEL = "qwen2.5:0.5b"


class Fleet:
    """A nats-server with decentralised authentication, and the operator's identity store."""

    def __init__(self, tmp: Path, server: NatsServer, store: Store) -> None:
        self.tmp = tmp
        self.server = server
        self.store = store

    def creds(self, role: str, name: str) -> Path:
        """A new identity's .creds file, as `coordinator invite` makes it."""
        identity, creds = self.store.invite(role, name)
        path = self.tmp / f"{identity}.creds"
        path.write_text(creds)
        return path

    def cli_env(self, **extra: str) -> dict[str, str]:
        return clean_env(
            NATS_URL=self.server.url, COORDINATOR_IDENTITIES=str(self.store.path), **extra
        )


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="coord-ids-") as name:
        tmp = Path(name)
        store = Store(tmp / "identities")
        rendered = run_cli(
            *("deploy", "render", "nats", "--jwt", "--store-dir", str(tmp / "data")),
            env=clean_env(COORDINATOR_IDENTITIES=str(store.path)),
        )
        assert rendered.returncode == 0, rendered.stderr
        conf = rendered.stdout
        assert "/var/lib/nats" not in conf
        assert f'dir: "{tmp}/data/jwt"' in conf  # the resolver keeps what is pushed
        conf = conf.replace("http: 127.0.0.1:8222", "http: 127.0.0.1:0")
        (tmp / "nats-server.conf").write_text(conf)
        # No password anywhere: the server's environment adds nothing.
        server = NatsServer(
            str(tmp / "data" / "jetstream"),
            config=str(tmp / "nats-server.conf"),
            listen="0.0.0.0",
        ).start()
        try:
            yield Fleet(tmp, server, store)
        finally:
            server.stop()


class Errors:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def record(self, exc: Exception) -> None:
        self.seen.append(str(exc).lower())


async def connect_as(fleet: Fleet, creds: Path, errors: Errors | None = None) -> Client:
    """Connect as an identity, with the inbox the services use (`services.runtime.bus`)."""
    from schemas.subjects import inbox_prefix
    from services.fleet.identity import identity_of_creds

    options: dict[str, Any] = {
        "user_credentials": str(creds),
        "inbox_prefix": inbox_prefix(identity_of_creds(await asyncio.to_thread(creds.read_text))),
        "allow_reconnect": False,
    }
    if errors is not None:
        options["error_cb"] = errors.record
    return await nats.connect(fleet.server.url, **options)


@pytest.fixture
async def ready(fleet: Fleet) -> Fleet:
    """Streams and buckets made by an operator's identity (`coordinator setup`)."""
    operator = fleet.creds("operator", "ops")
    await setup_streams(
        fleet.server.url,
        worker_ttl_s=3.0,
        events_max_age_s=0.0,
        auth=NatsAuth(creds=str(operator)),
    )
    return fleet


def run_services(fleet: Fleet, runner: ServiceRunner, ollama_url: str, worker: str) -> None:
    """The router and one worker, each as its own identity, invited after the server started."""
    runner.router(fleet.server.url, nats_creds=str(fleet.creds("router", "r1")))
    runner.worker(
        fleet.server.url, ollama_url, worker, nats_creds=str(fleet.creds("worker", worker))
    )


async def ask(nc: Client, prompt: str, **extra: Any) -> dict[str, Any]:
    async def answered() -> dict[str, Any] | None:
        try:
            body, _ = await request(
                nc, ROUTE, {"prompt": prompt, "model": MODEL, "wait": True, **extra}, 10.0
            )
        except nats.errors.Error:
            return None  # the router is still starting
        return body if body.get("status") == "done" else None

    reply: dict[str, Any] = await eventually(answered, timeout_s=30.0, interval_s=0.3)
    return reply


async def test_every_service_and_person_works_under_an_identity_added_without_a_restart(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    pid = ready.server.proc.pid if ready.server.proc else None
    conf_before = (ready.tmp / "nats-server.conf").read_bytes()
    run_services(ready, runner, ollama.url, "cpu1")
    alice = await connect_as(ready, ready.creds("client", "alice"))
    try:
        reply = await ask(alice, "1+1?")
        assert reply["worker"] == "cpu1"
        assert reply["response"]
    finally:
        await alice.close()
    # The server took three new identities as it was: same process, same file, no reload.
    assert ready.server.proc is not None and ready.server.proc.pid == pid
    assert ready.server.proc.poll() is None
    assert (ready.tmp / "nats-server.conf").read_bytes() == conf_before


async def test_nobody_reads_another_identitys_inbox(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    run_services(ready, runner, ollama.url, "cpu1")
    bob = await connect_as(ready, ready.creds("client", "bob"))
    errors = Errors()
    spy = await connect_as(ready, ready.creds("client", "mallory"), errors)
    seen: list[bytes] = []

    async def keep(msg: Any) -> None:
        seen.append(msg.data)

    try:
        # Bob's inbox, and the inbox every client shared under the password configuration.
        for subject in ("_INBOX_bob.>", "_INBOX_client.>", "_INBOX.>", ">"):
            await spy.subscribe(subject, cb=keep)
        await spy.flush()
        reply = await ask(bob, "a secret of bob's")
        assert reply["response"]
        body, _ = await request(bob, WORKERS, {}, 5.0)
        assert body["workers"]
        await asyncio.sleep(0.5)
        assert seen == []
        for subject in ("_INBOX_bob.>", "_INBOX_client.>", "_INBOX.>", ">"):
            assert any(
                "permissions violation" in e and subject.lower() in e for e in errors.seen
            ), (subject, errors.seen)
    finally:
        await bob.close()
        await spy.close()


async def test_a_worker_identity_cannot_use_another_workers_queue(ready: Fleet) -> None:
    admin = await connect_as(ready, ready.creds("operator", "admin2"))
    await admin.jetstream().add_consumer(
        TASKS_STREAM, durable_name=worker_consumer("gpu1"), filter_subject="tasks.*.gpu1"
    )
    await admin.close()
    errors = Errors()
    nc = await connect_as(ready, ready.creds("worker", "cpu1"), errors)
    try:
        js = nc.jetstream()
        with pytest.raises(nats.errors.Error):
            sub = await js.pull_subscribe_bind(worker_consumer("gpu1"), stream=TASKS_STREAM)
            await sub.fetch(1, timeout=1)
        await nc.flush()
        assert any("permissions violation" in e for e in errors.seen), errors.seen
    finally:
        await nc.close()


async def test_a_revoked_identity_is_cut_off_within_seconds_and_refused_after_a_restart(
    ready: Fleet,
) -> None:
    creds = ready.creds("client", "carol")
    other = await connect_as(ready, ready.creds("client", "dave"))
    closed = asyncio.Event()

    async def on_closed() -> None:
        closed.set()

    carol = await nats.connect(
        ready.server.url,
        user_credentials=str(creds),
        inbox_prefix="_INBOX_carol",
        allow_reconnect=False,
        closed_cb=on_closed,
    )
    started = time.monotonic()
    revoked = await asyncio.to_thread(run_cli, "revoke", "carol", env=ready.cli_env())
    assert revoked.returncode == 0, revoked.stderr
    await asyncio.wait_for(closed.wait(), timeout=5.0)
    assert carol.is_closed
    cut_after_s = time.monotonic() - started
    print(f"carol cut off {cut_after_s:.2f} s after `coordinator revoke` began")
    assert other.is_connected  # only carol

    async def refused() -> None:
        nc = Client()  # kept, to close its socket: a refused connect leaves it open
        try:
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nc.connect(
                    ready.server.url,
                    user_credentials=str(creds),
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                )
        finally:
            await nc.close()

    await refused()
    await other.close()
    ready.server.stop()
    ready.server.start()
    await refused()  # the resolver kept the revocation
    # A new identity by the same name is a new key: it gets in.
    again = ready.tmp / "carol-again.creds"
    invited = run_cli("invite", "client", "carol", env=ready.cli_env())
    assert invited.returncode == 0, invited.stderr
    again.write_text(decode_token(invited.stdout.strip()).creds)
    nc = await connect_as(ready, again)
    await nc.close()


def test_revoking_an_unknown_identity_and_inviting_one_twice_say_so(ready: Fleet) -> None:
    unknown = run_cli("revoke", "nobody", env=ready.cli_env())
    assert unknown.returncode == 1
    assert "not_found" in unknown.stderr and "nobody" in unknown.stderr
    assert run_cli("invite", "worker", "gpu9", env=ready.cli_env()).returncode == 0
    twice = run_cli("invite", "worker", "gpu9", env=ready.cli_env())
    assert twice.returncode == 1
    assert "coordinator revoke worker-gpu9" in twice.stderr
    bad = run_cli("invite", "client", "worker-x", env=ready.cli_env())
    assert bad.returncode == 2 and "reads as a role" in bad.stderr


def test_join_refuses_what_is_not_a_token_and_a_revoked_one(
    ready: Fleet, tmp_path: Path, ollama: FakeOllama
) -> None:
    garbage = run_cli("join", "hello", "--dir", str(tmp_path), env=clean_env())
    assert garbage.returncode == 2 and "not a join token" in garbage.stderr
    token = run_cli(
        "invite", "worker", "old", "--server", ready.server.url, env=ready.cli_env()
    ).stdout.strip()
    tampered = token[:-8] + ("A" * 8 if not token.endswith("A" * 8) else "B" * 8)
    broken = run_cli("join", tampered, "--dir", str(tmp_path), env=clean_env())
    assert broken.returncode == 2, broken.stderr
    assert run_cli("revoke", "worker-old", env=ready.cli_env()).returncode == 0
    refused = run_cli(
        "join", token, "--dir", str(tmp_path), "--backend", ollama.url, env=clean_env()
    )
    assert refused.returncode == 1
    assert "does not take worker-old" in refused.stderr


def test_a_worker_joining_with_a_backend_that_does_not_answer_is_told(
    ready: Fleet, tmp_path: Path
) -> None:
    token = run_cli(
        "invite", "worker", "lonely", "--server", ready.server.url, env=ready.cli_env()
    ).stdout.strip()
    joined = run_cli(
        "join", token, "--dir", str(tmp_path), "--backend", "http://127.0.0.1:9", env=clean_env()
    )
    assert joined.returncode == 1
    assert "model server at http://127.0.0.1:9 does not answer" in joined.stderr


@pytest.fixture
def host() -> Iterator[NetnsHost]:
    why = netns_unavailable()
    if why is not None:
        pytest.skip(f"no test hosts: {why}")
    with netns_hosts(1) as hosts:
        yield hosts[0]


HOST_OLLAMA_PORT = 11441
CHECKOUT = Path(__file__).resolve().parents[2]


def invite_machine(ready: Fleet, host: NetnsHost, name: str, *flags: str) -> str:
    """The operator's token for worker ``name``, naming the fleet as ``host`` reaches it."""
    invited = run_cli(
        *("invite", "worker", name, *flags),
        *("--server", f"nats://{host.gateway_ip}:{ready.server.port}"),
        env=ready.cli_env(),
    )
    assert invited.returncode == 0, invited.stderr
    token = invited.stdout.strip()
    assert "\n" not in token
    return token


def start_host_backend(host: NetnsHost, processes: Processes) -> str:
    """The new machine's own model server (an Ollama stand-in inside ``host``); its URL as
    the machine reaches it."""
    processes.start(
        host.command(
            sys.executable,
            *("-m", "devtools.fakes.ollama", "--host", "127.0.0.1"),
            *("--port", str(HOST_OLLAMA_PORT), "--models", MODEL),
        ),
        clean_env(),
    )
    return f"http://127.0.0.1:{HOST_OLLAMA_PORT}"


async def test_a_machine_joins_with_its_token_alone_and_runs_a_task(
    ready: Fleet, host: NetnsHost, runner: ServiceRunner, processes: Processes
) -> None:
    runner.router(ready.server.url, nats_creds=str(ready.creds("router", "r1")))
    token = invite_machine(ready, host, "far", "--gpu")
    # On the new machine: its model server, then `coordinator join` with the token alone.
    backend = start_host_backend(host, processes)
    settings = ready.tmp / "far-machine"

    async def joined() -> Any:
        done = await asyncio.to_thread(
            lambda: subprocess.run(
                host.command(
                    COORDINATOR, "join", token, "--dir", str(settings), "--backend", backend
                ),
                env=clean_env(),
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
        )
        return done if "model server" not in done.stderr else None  # its backend starting

    done = await eventually(joined, timeout_s=20.0, interval_s=0.5)
    assert done.returncode == 0, done.stderr
    # Not root-with-systemd here: the unit is printed, with how to start it.
    assert "coordinator-worker@.service" in done.stdout
    assert "systemctl enable --now coordinator-worker@far.service" in done.stdout
    env_file = settings / "worker-far.env"
    for path in (env_file, settings / "worker-far.creds"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE(settings.stat().st_mode) == 0o700
    written = env_file.read_text()
    assert f"NATS_URL=nats://{host.gateway_ip}:{ready.server.port}" in written
    assert "WORKER_SUPPORTS=gpu_inference" in written
    assert "PASSWORD" not in written

    # What a Mac's LaunchAgent for it runs (its ProgramArguments, as launchd would start
    # them): the settings file, the label's WORKER_ID, `coordinator worker`.
    agent = run_cli(
        *("deploy", "render", "launchd", "--role", "worker", "--worker-id", "far"),
        *("--env-file", str(env_file), "--coordinator", COORDINATOR),
        env=clean_env(),
    )
    assert agent.returncode == 0, agent.stderr
    program = plistlib.loads(agent.stdout.encode())
    assert program["Label"] == "org.coordinator.worker.far"
    processes.start(host.command(*program["ProgramArguments"]), clean_env())
    alice = await connect_as(ready, ready.creds("client", "alice"))
    try:
        await workers_live(alice, 1, timeout_s=30)
        reply = await ask(alice, "from far away", worker="far")
        assert reply["worker"] == "far"
    finally:
        await alice.close()


@pytest.fixture
def systemd_host(host: NetnsHost) -> NetnsHost:
    why = systemd_unavailable()
    if why is not None:
        pytest.skip(f"no systemd machine: {why}")
    return host


async def test_a_machine_with_systemd_joins_as_root_and_its_unit_runs_the_worker(
    ready: Fleet, systemd_host: NetnsHost, runner: ServiceRunner, processes: Processes
) -> None:
    """`join` as root on a machine where systemd runs: the unit is installed, enabled and
    started by systemd itself, runs a task, and stops cleanly."""
    host = systemd_host
    runner.router(ready.server.url, nats_creds=str(ready.creds("router", "r1")))
    token = invite_machine(ready, host, "unit")
    backend = start_host_backend(host, processes)
    # Inside the machine: this checkout (its venv's `coordinator`) and the Python it runs on.
    binds = [CHECKOUT] + ([Path(sys.base_prefix)] if not sys.base_prefix.startswith("/usr") else [])
    unit = "coordinator-worker@unit.service"
    with systemd_machine(host, binds=binds, log=ready.tmp / "machine.log") as machine:

        async def joined() -> subprocess.CompletedProcess[str] | None:
            done = await asyncio.to_thread(
                machine.run, COORDINATOR, "join", token, "--backend", backend
            )
            return done if "model server" not in done.stderr else None  # its backend starting

        def journal() -> str:
            return machine.run("journalctl", "--unit", unit, "--no-pager").stdout

        done = await eventually(joined, timeout_s=20.0, interval_s=0.5)
        assert done.returncode == 0, done.stderr
        assert f"worker-unit joined: {unit} is enabled and started." in done.stdout
        assert machine.systemctl("is-enabled", unit) == "enabled"
        assert machine.systemctl("is-active", unit) == "active", journal()
        # As root: the settings in /etc/coordinator, readable by root alone.
        listed = machine.run("stat", "-c", "%a %U %n", "/etc/coordinator/worker-unit.env")
        assert listed.stdout.split() == ["600", "root", "/etc/coordinator/worker-unit.env"]
        unit_file = machine.run("cat", "/etc/systemd/system/coordinator-worker@.service")
        assert "EnvironmentFile=/etc/coordinator/worker-unit.env" in unit_file.stdout

        alice = await connect_as(ready, ready.creds("client", "alice"))
        try:
            await workers_live(alice, 1, timeout_s=30)
            reply = await ask(alice, "from a unit", worker="unit")
            assert reply["worker"] == "unit", journal()

            # `systemctl stop`: SIGTERM, the worker leaves the fleet and exits 0 (not failed).
            await asyncio.to_thread(machine.systemctl, "stop", unit)
            assert machine.systemctl("is-active", unit) == "inactive", journal()

            async def gone() -> bool:
                body, _ = await request(alice, "coordinator.workers", {}, timeout_s=5.0)
                return all(w["worker_id"] != "unit" for w in body["workers"])

            await eventually(gone, timeout_s=10.0)
        finally:
            await alice.close()


async def code_of(nc: Client, subject: str, body: dict[str, Any]) -> str | None:
    """The error code a request was refused with; None when it was answered."""
    _, headers = await request(nc, subject, body, 10.0)
    return headers.get("Nats-Service-Error-Code")


async def bob_cannot_cancel_as_alice(
    bob: Client, errors: Errors, alice: Client, task_id: str
) -> bool:
    """Bob, knowing the id of Alice's task, sends its cancel with Alice's inbox as the reply
    subject (a reply subject is not checked by the server): on the plain subject and on the
    one naming Alice, the server refuses his publish; on the one naming him, the router takes
    him for himself and answers Alice's inbox ``not_found``. True when all three failed."""
    answered: asyncio.Queue[Any] = asyncio.Queue()
    inbox = "_INBOX_alice.forged"
    await alice.subscribe(inbox, cb=answered.put)
    await alice.flush()
    body = json.dumps({"task_id": task_id, "reason": "forged"}).encode()
    for subject in (CANCEL, cancel_from("alice"), cancel_from("bob")):
        await bob.publish(subject, body, reply=inbox)
    await bob.flush()
    reply = await asyncio.wait_for(answered.get(), 10.0)
    refused = [e for e in errors.seen if "permissions violation" in e]
    # The server refused the first two (they reach nobody); the router refused the third.
    return (
        reply.headers.get("Nats-Service-Error-Code") == "not_found"
        and any(CANCEL + '"' in e for e in refused)
        and any(cancel_from("alice") in e for e in refused)
    )


async def test_a_task_is_read_followed_cancelled_and_listed_only_by_who_asked_and_the_operator(
    ready: Fleet, ollama: FakeOllama, pg_dsn: str, runner: ServiceRunner
) -> None:
    url = ready.server.url
    run_services(ready, runner, ollama.url, "cpu1")
    stats = str(ready.creds("stats", "s1"))
    runner.start(run_stats, StatsSettings(nats_url=url, pg_dsn=pg_dsn, nats_creds=stats))
    alice = await connect_as(ready, ready.creds("client", "alice"))
    bob_errors = Errors()
    bob = await connect_as(ready, ready.creds("client", "bob"), bob_errors)
    ops = await connect_as(ready, ready.creds("operator", "ann"))
    try:
        task_id = (await ask(alice, "mine"))["task_id"]

        async def projected() -> dict[str, Any] | None:
            body, _ = await request(alice, TASK, {"task_id": task_id}, 10.0)
            return body if body.get("status") == "done" else None

        assert (await eventually(projected, timeout_s=20.0))["task_id"] == task_id
        # Another person is told what a task nobody has gets: not_found.
        assert await code_of(bob, TASK, {"task_id": task_id}) == "not_found"
        assert await code_of(bob, TASK, {"task_id": task_id, "client": "x"}) == "not_found"
        assert await code_of(ops, TASK, {"task_id": task_id}) is None
        follow = {"prompt": "mine", "model": MODEL, "task_id": task_id, "wait": True}
        assert await code_of(bob, ROUTE, follow) == "not_found"
        followed, _ = await request(alice, ROUTE, follow, 10.0)
        assert followed["status"] == "done" and followed["task_id"] == task_id

        # A running task: its id shows to its owner and the operator only, and only they
        # may cancel it.
        ollama.configure(chunk_delay_s=0.3)
        queued, _ = await request(
            alice, ROUTE, {"prompt": "a long one", "model": MODEL, "wait": False}, 10.0
        )
        running = queued["task_id"]

        async def listed(nc: Client) -> str | None:
            body, _ = await request(nc, WORKERS, {}, 10.0)
            current: str | None = body["workers"][0].get("current_task")
            return current

        async def shown_to_alice() -> str | None:
            return await listed(alice)

        assert await eventually(shown_to_alice, timeout_s=10.0) == running
        assert await listed(ops) == running
        assert await listed(bob) is None
        assert await code_of(bob, cancel_from("bob"), {"task_id": running}) == "not_found"
        assert await bob_cannot_cancel_as_alice(bob, bob_errors, alice, running)
        assert await listed(alice) == running  # none of it stopped the task
        assert await code_of(alice, cancel_from("alice"), {"task_id": running}) is None
        again = {"prompt": "a long one", "model": MODEL, "task_id": running, "wait": True}
        ended, _ = await request(alice, ROUTE, again, 20.0)
        assert (ended["task_id"], ended["status"]) == (running, "failed"), ended
        assert ended["failure"]["code"] == "cancelled", ended
    finally:
        for nc in (alice, bob, ops):
            await nc.close()


async def test_a_gateway_cancels_the_task_of_a_client_that_went_away_as_itself(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """The gateway, under its own identity, cancels the task of an HTTP client that hung up
    mid-stream: on the cancel subject naming it, the only one it may publish, from which the
    router knows it speaks for the task's key."""
    run_services(ready, runner, ollama.url, "cpu1")
    gateway = str(ready.creds("gateway", "gw"))
    url = await start_gateway(runner, ready.server.url, nats_creds=gateway)
    ops = await connect_as(ready, ready.creds("operator", "ann"))
    try:
        await workers_live(ops, 1, timeout_s=30)
        ollama.configure(chunk_delay_s=0.3)
        task_id = await hang_up_mid_stream(url, {"model": MODEL, "prompt": "a long one"})

        async def failed() -> dict[str, Any] | None:
            try:
                msg = await last_task_event(ops.jetstream(), task_id, "failed")
            except nats.js.errors.NotFoundError:
                return None
            decoded: dict[str, Any] = json.loads(msg.data or b"")
            return decoded

        ended = await eventually(failed, timeout_s=20.0)
        assert ended["code"] == "cancelled", ended
        assert "disconnected" in ended["reason"], ended
    finally:
        await ops.close()


async def test_coordinator_up_gives_each_service_its_own_identity_and_keeps_it(
    fleet: Fleet, ollama: FakeOllama, pg_dsn: str, processes: Processes
) -> None:
    home = fleet.tmp / "home"
    env = {
        **up_env(home, ollama.url, pg_dsn),
        "NATS_URL": fleet.server.url,
        "COORDINATOR_IDENTITIES": str(fleet.store.path),
        "WORKER_ID": "hub",
    }
    alice = await connect_as(fleet, fleet.creds("client", "alice"))
    try:
        for run in range(2):  # the second run keeps the identities the first one made
            up = processes.start([COORDINATOR, "up", "--identities"], env)
            banner = await wait_until_ready(up)
            assert (
                "identities  gateway-up, operator-up, reaper-up, router-up, stats-up, "
                "worker-hub" in banner
            ), banner
            reply = await ask(alice, f"run {run}")
            assert reply["worker"] == "hub"
            up.send_signal(signal.SIGINT)
            await asyncio.to_thread(up.communicate, timeout=30)
            assert up.returncode == 0
    finally:
        await alice.close()
    listed = run_cli("identities", "--json", env=fleet.cli_env())
    identities = json.loads(listed.stdout)
    assert {"router-up", "worker-hub", "operator-up"} <= set(identities)
    assert all(i.get("revoked_at") is None for i in identities.values())
    for creds in (home / "identities").iterdir():
        assert stat.S_IMODE(creds.stat().st_mode) == 0o600, creds
    # Without NATS_URL there is no server with identities to give: refused, with why.
    alone = run_cli("up", "--identities", env={**env, "NATS_URL": ""})
    assert alone.returncode == 2 and "--identities needs NATS_URL" in alone.stderr


async def test_a_worker_with_an_identity_judges_its_redelivered_task_through_the_router(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """Stopped mid-task, the worker returns the task to its queue; started again, it is
    handed it again and asks the router what the task ended with (nothing: it runs it) before
    it runs it. Its identity reads nothing of the event log itself."""
    url = ready.server.url
    runner.router(url, nats_creds=str(ready.creds("router", "r1")))
    worker_creds = str(ready.creds("worker", "cpu1"))
    ollama.configure(chunk_delay_s=0.2)
    first = runner.worker(url, ollama.url, "cpu1", nats_creds=worker_creds, stop_grace_s=0.2)
    alice = await connect_as(ready, ready.creds("client", "alice"))
    try:
        queued = await ask_queued(alice, "a long one")

        async def running() -> bool:
            return ollama.stats()["in_flight"] > 0

        await eventually(running, timeout_s=20.0)
        with capture_logs() as logs:
            await runner.stop(first)  # the task goes back to its queue
            ollama.configure(chunk_delay_s=0.0)
            runner.worker(url, ollama.url, "cpu1", nats_creds=worker_creds)
            again = {"prompt": "a long one", "model": MODEL, "task_id": queued, "wait": True}
            reply, _ = await request(alice, ROUTE, again, 30.0)
        assert (reply["status"], reply["worker"]) == ("done", "cpu1"), reply
        # The redelivery was judged by what the router read for the worker.
        ops = await connect_as(ready, ready.creds("operator", "ann"))
        try:
            stats, _ = await request(ops, "$SRV.STATS.coordinator-router", b"", 5.0)
        finally:
            await ops.close()
    finally:
        await alice.close()
    [endpoint] = [e for e in stats["endpoints"] if e["name"] == "last-event"]
    assert endpoint["num_requests"] >= 1 and endpoint["num_errors"] == 0, endpoint
    assert not [e for e in logs if "not settled" in str(e.get("event"))], logs
    assert not [e for e in logs if "permissions violation" in str(e).lower()]


async def ask_queued(nc: Client, prompt: str) -> str:
    """Route a prompt without waiting; its task id."""

    async def queued() -> str | None:
        try:
            body, _ = await request(
                nc, ROUTE, {"prompt": prompt, "model": MODEL, "wait": False}, 10.0
            )
        except nats.errors.Error:
            return None  # the router is still starting
        task_id: str | None = body.get("task_id")
        return task_id

    task_id: str = await eventually(queued, timeout_s=30.0, interval_s=0.3)
    return task_id


async def test_a_worker_cannot_lift_its_own_limit_and_the_router_sets_it_back(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """One task at a time is the fleet's: a worker's identity may not make or change its own
    consumer; the router makes it as fixed, for that worker only, and sets it back when the
    worker starts."""
    url = ready.server.url
    runner.router(url, nats_creds=str(ready.creds("router", "r1")))
    admin = await connect_as(ready, ready.creds("operator", "ann"))
    ajs = admin.jetstream()
    # Lifted behind the fleet's back (a consumer as an older worker made it, say).
    await ajs.add_consumer(TASKS_STREAM, own_queue_config("cpu1", max_ack_pending=50))
    errors = Errors()
    creds = ready.creds("worker", "cpu1")
    worker = await connect_as(ready, creds, errors)
    try:
        js = worker.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.add_consumer(TASKS_STREAM, own_queue_config("cpu1", max_ack_pending=99))
        assert any("permissions violation" in e for e in errors.seen), errors.seen
        body = {"worker_id": "gpu1", "ack_wait_s": 30.0}
        assert await code_of(worker, OWN_CONSUMER, body) == "forbidden"
        assert await code_of(worker, OWN_CONSUMER, {**body, "worker_id": "a.b"}) == "bad_request"
        assert await code_of(worker, OWN_CONSUMER, {**body, "ack_wait_s": 0}) == "bad_request"
    finally:
        await worker.close()
    runner.worker(url, ollama.url, "cpu1", nats_creds=str(creds))
    alice = await connect_as(ready, ready.creds("client", "alice"))
    try:
        assert (await ask(alice, "one at a time"))["worker"] == "cpu1"
    finally:
        await alice.close()
    try:
        info = await ajs.consumer_info(TASKS_STREAM, "worker-cpu1")
        assert info.config.max_ack_pending == 1
        with pytest.raises(nats.js.errors.NotFoundError):
            await ajs.consumer_info(TASKS_STREAM, "worker-gpu1")  # never made for another
    finally:
        await admin.close()


def own_queue_config(worker_id: str, *, max_ack_pending: int) -> Any:
    from nats.js.api import AckPolicy, ConsumerConfig

    return ConsumerConfig(
        name=f"worker-{worker_id}",
        durable_name=f"worker-{worker_id}",
        filter_subject=f"tasks.*.{worker_id}",
        ack_policy=AckPolicy.EXPLICIT,
        max_ack_pending=max_ack_pending,
    )


async def test_a_worker_with_an_identity_takes_the_alias_map_from_the_router(
    ready: Fleet, ollama: FakeOllama, runner: ServiceRunner
) -> None:
    """It makes no consumer on EVENTS to follow the alias events: the router, which follows
    them, hands it the map; it registers the canonical name and runs the one it serves."""
    url = ready.server.url
    stats = await connect_as(ready, ready.creds("stats", "s1"))  # as `alias add` records it
    await publish_event(stats.jetstream(), AliasSet(at=time.time(), alias=MODEL, canonical="tiny"))
    await stats.close()
    runner.router(url, nats_creds=str(ready.creds("router", "r1")))
    runner.worker(url, ollama.url, "cpu1", nats_creds=str(ready.creds("worker", "cpu1")))
    alice = await connect_as(ready, ready.creds("client", "alice"))
    try:
        [worker] = await workers_live(alice, 1, timeout_s=30)
        assert "tiny" in worker["models"] and MODEL not in worker["models"], worker
        reply = await ask(alice, "by its canonical name", model="tiny")
        assert (reply["status"], reply["worker"]) == ("done", "cpu1")
    finally:
        await alice.close()


async def test_on_a_cluster_a_revocation_pushed_to_one_node_cuts_the_identity_off_at_another(
    tmp_path: Path,
) -> None:
    """Every node runs the same configuration with identities; `coordinator revoke` hands the
    fleet's account to one of them, and the others learn it from that one."""
    store = Store(tmp_path / "identities")
    store.create()
    with tempfile.TemporaryDirectory(prefix="coord-ids-cluster-") as root:
        cluster = NatsCluster(root, {}, auth=store.auth()).start()
        try:
            # The fleet's account keeps its streams on every node (what `setup --replicas 3`
            # does with the operator's identity).
            _, operator = store.invite("operator", "ann")
            (tmp_path / "ann.creds").write_text(operator)
            at_each = [
                await nats.connect(
                    node.url,
                    user_credentials=str(tmp_path / "ann.creds"),
                    inbox_prefix="_INBOX_operator-ann",
                )
                for node in cluster.nodes
            ]

            async def jetstream_on() -> bool:
                # Each node turns JetStream on for the fleet's account once it has resolved
                # it, a moment after the node is healthy ("JetStream not enabled for account").
                try:
                    for nc in at_each:
                        await nc.jetstream().account_info()
                except nats.errors.Error:
                    return False
                return True

            try:
                await eventually(jetstream_on, timeout_s=30)
            finally:
                for nc in at_each:
                    await nc.close()
            copies = await setup_streams(
                cluster.url,
                worker_ttl_s=3.0,
                events_max_age_s=0.0,
                auth=NatsAuth(creds=str(tmp_path / "ann.creds")),
                replicas=3,
            )
            assert copies and all(c.replicas == 3 for c in copies), copies
            # The doctor reads the cluster's peers as the system account's user the keys hold.
            doctor = await asyncio.to_thread(
                run_cli,
                *("doctor", "--unit-dir", str(tmp_path)),
                env=clean_env(
                    NATS_URL=cluster.url,
                    NATS_CREDS=str(tmp_path / "ann.creds"),
                    NATS_SYSTEM_CREDS=str(store.admin_creds),
                ),
                timeout=60,
            )
            lines = {line[9:31].strip(): line for line in doctor.stdout.splitlines()}
            assert lines["cluster peers"].startswith("ok"), doctor.stdout
            assert lines["meta leader"].startswith("ok"), doctor.stdout
            identity, text = store.invite("client", "carol")
            creds = tmp_path / f"{identity}.creds"
            creds.write_text(text)
            closed = asyncio.Event()

            async def on_closed() -> None:
                closed.set()

            far = cluster.nodes[2]
            carol = await nats.connect(
                far.url,
                user_credentials=str(creds),
                inbox_prefix="_INBOX_carol",
                allow_reconnect=False,
                closed_cb=on_closed,
            )
            env = clean_env(NATS_URL=cluster.nodes[0].url, COORDINATOR_IDENTITIES=str(store.path))
            revoked = await asyncio.to_thread(run_cli, "revoke", "carol", env=env)
            assert revoked.returncode == 0, revoked.stderr
            await asyncio.wait_for(closed.wait(), timeout=10.0)
            assert carol.is_closed
            for node in cluster.nodes:  # refused at every node
                nc = Client()
                try:
                    with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                        await nc.connect(
                            node.url,
                            user_credentials=str(creds),
                            allow_reconnect=False,
                            max_reconnect_attempts=0,
                        )
                finally:
                    await nc.close()
        finally:
            cluster.stop()


def make_certificates(where: Path) -> tuple[Path, Path, Path]:
    """A CA of the fleet's own, and a certificate it signed for 127.0.0.1: (ca, cert, key)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    openssl(
        *("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
        *("-keyout", "ca-key.pem", "-out", "ca.pem", "-subj", "/CN=fleet CA"),
    )
    openssl(
        *("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server-key.pem"),
        *("-out", "server.csr", "-subj", "/CN=127.0.0.1"),
    )
    (where / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl(
        *("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem"),
        *("-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "san.ext"),
    )
    return where / "ca.pem", where / "server.pem", where / "server-key.pem"


async def test_a_machine_joins_a_fleet_on_tls_with_the_ca_its_token_carries(
    tmp_path: Path, ollama: FakeOllama
) -> None:
    ca, cert, key = make_certificates(tmp_path)
    store = Store(tmp_path / "identities")
    rendered = run_cli(
        *("deploy", "render", "nats", "--jwt", "--store-dir", str(tmp_path / "data")),
        env=clean_env(COORDINATOR_IDENTITIES=str(store.path)),
    )
    assert rendered.returncode == 0, rendered.stderr
    conf = rendered.stdout.replace("http: 127.0.0.1:8222", "http: 127.0.0.1:0")
    conf += f"tls {{\n  cert_file: {cert}\n  key_file: {key}\n}}\n"
    (tmp_path / "nats-server.conf").write_text(conf)
    server = NatsServer(
        str(tmp_path / "data" / "jetstream"), config=str(tmp_path / "nats-server.conf")
    ).start()
    try:
        url = f"tls://127.0.0.1:{server.port}"
        _, operator = store.invite("operator", "ann")
        (tmp_path / "ann.creds").write_text(operator)
        await setup_streams(
            url,
            worker_ttl_s=3.0,
            events_max_age_s=0.0,
            auth=NatsAuth(creds=str(tmp_path / "ann.creds"), tls_ca=str(ca)),
        )
        env = clean_env(COORDINATOR_IDENTITIES=str(store.path), NATS_URL=url)
        with_ca = run_cli("invite", "worker", "tls1", "--ca", str(ca), env=env).stdout.strip()
        assert decode_token(with_ca).ca == ca.read_text()
        settings = tmp_path / "tls1"
        joined = run_cli(
            *("join", with_ca, "--dir", str(settings), "--backend", ollama.url, "--no-start"),
            env=clean_env(),
        )
        assert joined.returncode == 0, joined.stderr
        written = (settings / "worker-tls1.env").read_text()
        assert f"NATS_TLS_CA={settings / 'worker-tls1-ca.pem'}" in written
        assert f"NATS_URL={url}" in written
        assert stat.S_IMODE((settings / "worker-tls1-ca.pem").stat().st_mode) == 0o600
        # Without the CA, the machine cannot tell the fleet's server from another: refused.
        without = run_cli("invite", "worker", "tls2", env=env).stdout.strip()
        refused = run_cli(
            *("join", without, "--dir", str(tmp_path / "tls2"), "--backend", ollama.url),
            env=clean_env(),
        )
        assert refused.returncode == 1
        assert "does not take worker-tls2" in refused.stderr
    finally:
        server.stop()
