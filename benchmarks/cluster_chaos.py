"""Proof under faults: the clustered control plane on three test hosts, through one host killed
whole and another cut off.

    .venv/bin/python -m benchmarks.cluster_chaos [--rate 6] [--tasks 1200] [--workers-per-host 2]
        [--down 10] [--cut 30] [--victim leader|follower] [--throughput-seconds 15] [--no-single]
        [--worker-ttl S] [--throughput-only]

It makes three test hosts (network namespaces joined to this machine, which routes between
them: `devtools.hosts`) and runs on each, as a fleet would: a node of a JetStream cluster (the
configuration `coordinator deploy render nats --cluster --routes <the three addresses> --node
<its address>` renders, listening on the host's address), ``coordinator router``,
``coordinator reaper`` and ``--workers-per-host`` × ``coordinator worker``, each beside an
Ollama stand-in of its own on the host's loopback (``python -m devtools.fakes.ollama``). Every
one of them has ``NATS_URL`` naming the three nodes and its role's NATS user. PostgreSQL
listens on this machine's loopback only, so the three ``coordinator stats serve`` run here
(one database), with the same ``NATS_URL``. ``coordinator setup --replicas 3`` comes first.

Clients on this machine (several connections, each to a node of the client library's
choosing) name their tasks' ids and, when the router is silent for ``--reask`` seconds, ask
again by id (`services.runtime.request.stream_call`); a task counts once a router recorded
it. With ``--throughput-seconds`` a closed loop first measures tasks/s with instant
generations. Then ``--rate`` tasks/s (each generation streamed over about
``--generation`` seconds) while the faults come, one after the other:

1. After ``--warmup`` s, one host is killed whole: ``SIGKILL`` to its nats-server, router,
   reaper and workers at once, then (once their generation records are read) to its
   stand-ins: every process in it. With ``--victim leader`` (the default) it is the host whose
   node leads the most of a task's path (``EVENTS`` first, ``TASKS``, the ``workers``
   bucket): the loss that costs most, since the others wait 4-9 s before electing a new
   leader; with ``follower``, the one leading least of it.
2. It stays down ``--down`` s, then comes back (the node on its store first).
3. Once every stream is current on three nodes again, another host, chosen the same way
   among the other two, has its link cut for ``--cut`` s: packets dropped both ways, no
   reset; then mended.
4. ``--tail`` s more load, then the run waits up to ``--settle`` s for every client's answer.

The verdict comes from the event log alone, and from the stand-ins' records of their
generations (``GET /_fake/calls``: each one's wall-clock start and end and its prompt):

- **ended**: every task the clients asked for ended done or with an explicit failure (the log
  holds its final state), and every client got an answer;
- **never twice at once**: no two generations of one task overlapped on any stand-ins, no
  stand-in ran two at once, no worker's runs overlapped in the log, and every task done has
  its generation on record;
- **answered once**: no task has two ``completed`` events, and no client was told what the
  log contradicts (another task's answer, or a refusal or failure for a task that then ran).

It prints the seconds from the kill, and from the cut, to the first task asked for after it
being answered done (the goal after the kill: under 5 s; one generation's time included), the
longest time without any answer done from the fault to 30 s after it, and the throughput on
the cluster against the same harness with a single server (its shipped configuration on the
first host, ``--replicas 1``, no faults). Figures go to
``benchmarks/results/cluster-chaos-<time>.json``. Only 127.0.0.1 and the test hosts'
10.231.x.x addresses are ever sent anything.

Needs root and iproute2 (network namespaces). Exit status: 1 when a property failed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from contextlib import suppress
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from benchmarks.chaos import COORDINATOR, EARLY_EXIT_S, MODEL, EventLog, Service, judge
from benchmarks.cluster_verdict import (
    HOSTS,
    Ask,
    Generation,
    Report,
    expected_response,
    flowing_after,
    generations_overlapping,
    longest_silence,
    render,
)
from benchmarks.stack import load_average, percentile, write_result
from devtools.hosts import NetnsHost, netns_hosts
from devtools.servers import NatsCluster, NatsServer, Postgres, wait_for_port
from schemas.route import RouteReply, RouteRequest
from schemas.subjects import EVENTS_STREAM, ROUTE, TASKS_STREAM, WORKERS, WORKERS_BUCKET
from services.cli.cluster import CLIENT_PORT
from services.cli.permissions import NATS_ROLES, nats_user, password_variable, render_nats_conf
from services.cli.replication import FLEET_STREAMS, replication_of
from services.errors import CoordinatorError, NoResponder, Unavailable, WaitTimeout
from services.runtime.bus import connect
from services.runtime.request import new_task_id, stream_call
from services.runtime.settings import NatsAuth

CLUSTER: Final = "chaos"
# The first stand-in's port on each host (its own loopback); the next one's is one more.
STANDIN_PORT: Final = 11434
# A task's own timeout: longer than any fault lasts.
TASK_TIMEOUT_S: Final = 180.0
# The fake's answer to a prompt of PROMPT_WORDS words is "Echo from <model>: <prompt>", streamed
# a word at a time: this many pieces.
PROMPT_WORDS: Final = 12
PIECES: Final = PROMPT_WORDS + 3
# The streams every task writes to: losing the node that leads one stops those writes until
# the others elect a leader (nats-server waits 4-9 s for a lost leader before it campaigns).
TASK_PATH: Final = (EVENTS_STREAM, TASKS_STREAM, f"KV_{WORKERS_BUCKET}")
# The verdict waits for tasks still running until nothing has been stored for this long.
QUIET_S: Final = 10.0
# From a fault to this long after it, the longest time without an answer is reported.
FAULT_WINDOW_S: Final = 30.0

_reply_decoder = msgspec.json.Decoder(RouteReply)
_encoder = msgspec.json.Encoder()


def password(user: str) -> str:
    """Every NATS user's password in a run (nats-server reads them from its environment)."""
    return f"pw-{user}"


@dataclass(frozen=True)
class Config:
    """The shape of one run."""

    nodes: int = 3
    """NATS nodes: 3, one per host, or 1 (a single server on the first host; no faults)."""
    workers_per_host: int = 2
    rate: float = 6.0
    """Tasks asked for per second while the faults come."""
    tasks: int = 1200
    """At most this many tasks in the faults' load."""
    generation_s: float = 0.5
    warmup_s: float = 8.0
    down_s: float = 10.0
    cut_s: float = 30.0
    tail_s: float = 8.0
    settle_s: float = 90.0
    clients: int = 48
    """Requests in flight at most."""
    connections: int = 6
    reask_s: float = 2.0
    throughput_s: float = 0.0
    """A closed loop of ``throughput_clients`` measuring tasks/s first (0: none)."""
    throughput_clients: int = 32
    faults: bool = True
    worker_ttl_s: float | None = None
    """``WORKER_TTL_S`` for every service and the bucket (None: the default)."""
    victim: str = "leader"
    """Which hosts the faults hit: ``leader`` (the node leading most of a task's path,
    ``EVENTS`` first) or ``follower`` (the node leading least of it)."""
    log_level: str = "warning"


# -- the fleet on the test hosts ---------------------------------------------------------------


class Host:
    """One test host and what runs on it: the node (if any), services, stand-ins."""

    def __init__(self, net: NetnsHost, number: int) -> None:
        self.net = net
        self.name = f"host{number}"
        self.node: NatsServer | None = None
        self.standins: list[Service] = []
        self.services: list[Service] = []
        self.standin_ports: list[int] = []
        self.gone_generations: list[Generation] = []
        """What this host's stand-ins recorded before they were killed."""

    def standin_url(self, k: int) -> str:
        """Where this machine reaches the ``k``-th stand-in (the worker uses the loopback)."""
        return f"http://{self.net.ip}:{self.standin_ports[k]}"


class Fleet:
    """The whole run: hosts, NATS, services, clients, faults, and the verdict."""

    def __init__(self, config: Config, hosts: list[NetnsHost], logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.hosts = [Host(net, i + 1) for i, net in enumerate(hosts)]
        self.worker_ids = [
            f"{host.name}-w{k + 1}" for host in self.hosts for k in range(config.workers_per_host)
        ]
        self.cluster: NatsCluster | None = None
        self.single: NatsServer | None = None
        self.stats: list[Service] = []
        self.asks: dict[str, Ask] = {}
        self.clients: list[Client] = []
        self.obs: Client | None = None
        self.numbers = iter(range(10**9))
        self.give_up_at = float("inf")
        self.timeline: list[str] = []
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.kill_at: float | None = None
        self.cut_at: float | None = None
        self.killed: Host | None = None
        self.cut: Host | None = None
        self.stop_asking = asyncio.Event()
        self.generation_delay = 0.0
        """The stand-ins' ``chunk_delay_s`` now."""

    # -- NATS ----------------------------------------------------------------------------

    @property
    def users(self) -> list[str]:
        """Every NATS user the fleet needs: admin, each role, each worker."""
        return ["admin", *NATS_ROLES, *(nats_user("worker", w) for w in self.worker_ids)]

    @property
    def nats_url(self) -> str:
        """``NATS_URL`` for everyone: the three nodes, or the single server."""
        if self.cluster is not None:
            return self.cluster.url
        assert self.single is not None
        return self.single.url

    def start_nats(self, root: Path) -> None:
        """The cluster (a node on each host) or the single server (on the first host), with
        their stores under ``root``."""
        passwords = {password_variable(u): password(u) for u in self.users}
        if self.config.nodes == 1:
            host = self.hosts[0]
            store = root / "single" / "js"
            store.mkdir(parents=True)
            conf = render_nats_conf(self.worker_ids, []).replace(
                "  store_dir: /var/lib/nats\n", f"  store_dir: {store}\n"
            )
            path = root / "single" / "nats-server.conf"
            path.write_text(conf)
            self.single = NatsServer(
                str(store),
                CLIENT_PORT,
                config=str(path),
                env=passwords,
                listen=host.net.ip,
                wrap=host.net.command(),
            ).start()
            host.node = self.single
            return
        self.cluster = NatsCluster(
            str(root / "cluster"),
            passwords,
            workers=self.worker_ids,
            name=CLUSTER,
            hosts=[h.net.ip for h in self.hosts],
            wraps=[h.net.command() for h in self.hosts],
        ).start()
        for host, node in zip(self.hosts, self.cluster.nodes, strict=True):
            host.node = node

    def setup_streams(self) -> None:
        """``coordinator setup --replicas N`` as the operator, as an operator would."""
        env = self.env("operator")
        replicas = str(self.config.nodes)
        done = subprocess.run(
            [COORDINATOR, "setup", "--replicas", replicas],
            env=env,
            capture_output=True,
            text=True,
            timeout=200,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"coordinator setup failed: {done.stderr.strip()}")
        self.mark(f"setup --replicas {replicas}: {done.stdout.strip().splitlines()[-1]}")

    # -- services ------------------------------------------------------------------------

    def env(self, user: str, **extra: str) -> dict[str, str]:
        """A process's environment: this one's without Coordinator's settings, then ``NATS_URL``,
        ``user``'s credentials, JSON logs, and ``extra``."""
        names = ("NATS_URL", "PG_DSN", "OLLAMA_HOST", "WORKER_ID", "WORKER_MODELS", "NATS_USER")
        env = {k: v for k, v in os.environ.items() if k not in names}
        env.update(
            NATS_URL=self.nats_url,
            NATS_USER=user,
            NATS_PASSWORD=password(user),
            LOG_FORMAT="json",
            LOG_LEVEL=self.config.log_level,
        )
        if self.config.worker_ttl_s is not None:
            env["WORKER_TTL_S"] = f"{self.config.worker_ttl_s:g}"
        env.update(extra)
        return env

    def plan_host(self, host: Host) -> None:
        """The stand-ins and services of ``host`` (not started)."""
        net = host.net
        for k in range(self.config.workers_per_host):
            port = STANDIN_PORT + k
            host.standin_ports.append(port)
            standin = [sys.executable, "-m", "devtools.fakes.ollama", "--host", "0.0.0.0"]
            host.standins.append(
                Service(
                    f"{host.name}-ollama{k + 1}",
                    net.command(*standin, "--port", str(port), "--models", MODEL),
                    dict(os.environ),
                    self.logs,
                )
            )
            worker_id = f"{host.name}-w{k + 1}"
            env = self.env(
                nats_user("worker", worker_id),
                WORKER_ID=worker_id,
                WORKER_HOST=host.name,
                WORKER_MODELS=MODEL,
                OLLAMA_HOST=f"http://127.0.0.1:{port}",
                SANITY_CHECK="false",
            )
            host.services.append(
                Service(worker_id, net.command(COORDINATOR, "worker"), env, self.logs)
            )
        for role in ("router", "reaper"):
            host.services.append(
                Service(
                    f"{host.name}-{role}", net.command(COORDINATOR, role), self.env(role), self.logs
                )
            )

    async def start_host(self, host: Host) -> None:
        """The stand-ins, then the services; a worker refused because its old lease is still
        fresh is started again."""
        for standin in host.standins:
            standin.start()
        for port in host.standin_ports:
            await asyncio.to_thread(wait_for_port, port, 30.0, host.net.ip)
        await self.configure_standins([host], self.generation_delay)
        await asyncio.gather(*(self.start_until_up(s) for s in host.services))

    async def start_until_up(self, service: Service) -> None:
        """Start ``service``; again while it exits at once (a worker whose old lease is fresh)."""
        for _ in range(10):
            service.start()
            await asyncio.sleep(EARLY_EXIT_S)
            if service.alive:
                return
            self.mark(f"{service.name} exited at start; starting it again")
        raise RuntimeError(f"{service.name} does not stay up: see {service.log_path}")

    def start_stats(self, dsn: str) -> None:
        """One stats service per host, run here: PostgreSQL listens on this machine's loopback."""
        for n in range(HOSTS):
            stats = Service(
                f"stats{n + 1}",
                [COORDINATOR, "stats", "serve"],
                self.env("stats", PG_DSN=dsn),
                self.logs,
            )
            stats.start()
            self.stats.append(stats)

    async def configure_standins(self, hosts: Iterable[Host], chunk_delay_s: float) -> None:
        """Set the stand-ins' time between streamed pieces (``POST /_fake/config``)."""
        async with httpx.AsyncClient(timeout=5) as http:
            for host in hosts:
                for k in range(len(host.standins)):
                    reply = await http.post(
                        f"{host.standin_url(k)}/_fake/config",
                        json={"chunk_delay_s": chunk_delay_s},
                    )
                    reply.raise_for_status()

    async def generations(self, host: Host) -> list[Generation]:
        """What ``host``'s stand-ins recorded of their generations."""
        found: list[Generation] = []
        async with httpx.AsyncClient(timeout=5) as http:
            for k, standin in enumerate(host.standins):
                reply = await http.get(f"{host.standin_url(k)}/_fake/calls")
                for call in reply.json()["calls"]:
                    if call["api"] == "embed":
                        continue
                    found.append(
                        Generation(
                            standin.name, call["prompt"], call["started_at"], call["ended_at"]
                        )
                    )
        return found

    def stop_all(self) -> None:
        """SIGTERM to every service and stand-in, then SIGKILL to what is still there."""
        services = [s for h in self.hosts for s in (*h.services, *h.standins)] + self.stats
        for service in services:
            if service.proc is not None and service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
        for service in services:
            service.stop()

    # -- clients -------------------------------------------------------------------------

    async def connect_clients(self) -> None:
        """The judge's connection (admin) and the clients' (``client``), given every node."""
        auth = NatsAuth(user="admin", password=password("admin"))
        self.obs = await connect(self.nats_url, "cluster-chaos-judge", auth=auth)
        client = NatsAuth(user="client", password=password("client"))
        for n in range(self.config.connections):
            self.clients.append(await connect(self.nats_url, f"cluster-chaos-{n}", auth=client))

    async def close_clients(self) -> None:
        """Close every connection of this process."""
        for nc in [*self.clients, *([self.obs] if self.obs else [])]:
            with suppress(Exception):
                await nc.close()

    async def ask(self) -> Ask:
        """One task, asked for until a router answers it (or the run gives up)."""
        number = next(self.numbers)
        words = " ".join(f"w{i}" for i in range(PROMPT_WORDS - 2))
        prompt = f"task {number} {words}"
        ask = Ask(new_task_id(), prompt, time.time())
        self.asks[ask.task_id] = ask
        body = _encoder.encode(
            RouteRequest(
                prompt=prompt, model=MODEL, wait=True, timeout_s=TASK_TIMEOUT_S, task_id=ask.task_id
            )
        )
        nc = self.clients[number % len(self.clients)]
        silence_s = self.config.cut_s + 30.0
        while True:
            try:
                final = b""
                async for item in stream_call(
                    nc, ROUTE, body, silence_s, reask_s=self.config.reask_s
                ):
                    if isinstance(item, bytes):
                        final = item
                reply = _reply_decoder.decode(final)
            except (Unavailable, NoResponder, WaitTimeout) as exc:
                # Nobody there to answer just now, or not in time: ask again by its id.
                ask.retries += 1
                if time.monotonic() > self.give_up_at:
                    ask.error = f"{exc.code}: {exc.message}"
                    return ask
                await asyncio.sleep(0.5)
                continue
            except CoordinatorError as exc:
                ask.answered_at, ask.status, ask.code = time.time(), "refused", exc.code
                ask.error = exc.message
                return ask
            ask.answered_at, ask.status = time.time(), reply.status
            ask.response = reply.response
            ask.code = reply.failure.code if reply.failure is not None else None
            return ask

    async def open_loop(self) -> None:
        """``rate`` tasks a second until `stop_asking` or ``tasks`` asked for, at most
        ``clients`` in flight; then wait for their answers (up to ``settle_s``)."""
        limit = asyncio.Semaphore(self.config.clients)
        running: set[asyncio.Task[Ask]] = set()
        started = time.monotonic()
        for n in range(self.config.tasks):
            due = started + n / self.config.rate
            with suppress(TimeoutError):
                await asyncio.wait_for(self.stop_asking.wait(), max(0.0, due - time.monotonic()))
            await limit.acquire()
            if self.stop_asking.is_set():
                break
            task = asyncio.create_task(self.ask())
            running.add(task)
            task.add_done_callback(running.discard)
            task.add_done_callback(lambda _: limit.release())
        self.give_up_at = time.monotonic() + self.config.settle_s
        if running:
            await asyncio.gather(*running)

    async def closed_loop(self, seconds: float, clients: int) -> dict[str, float]:
        """``clients`` asking one task after another for 2 s of warm-up and ``seconds``:
        tasks answered done per second over ``seconds``, and their latency."""
        warm_until = time.time() + 2.0
        end = warm_until + seconds
        asks: list[Ask] = []

        async def client() -> None:
            while time.time() < end:
                asks.append(await self.ask())

        self.give_up_at = time.monotonic() + 2.0 + seconds + self.config.settle_s
        await asyncio.gather(*(client() for _ in range(clients)))
        self.give_up_at = float("inf")
        counted = [
            a
            for a in asks
            if a.status == "done"
            and a.answered_at is not None
            and warm_until <= a.answered_at
            and a.answered_at <= end
        ]
        latencies = [(a.answered_at or 0.0) - a.sent_at for a in counted]
        return {
            "tasks_per_s": round(len(counted) / seconds, 1),
            "p50_ms": round(percentile(latencies, 50) * 1000, 1),
            "p99_ms": round(percentile(latencies, 99) * 1000, 1),
            "clients": clients,
            "seconds": seconds,
        }

    # -- watching the fleet --------------------------------------------------------------

    @property
    def js(self) -> JetStreamContext:
        """JetStream through the judge's connection."""
        assert self.obs is not None
        return self.obs.jetstream(timeout=5.0)

    async def wait_workers(self, timeout_s: float = 90.0) -> None:
        """Until the routers list every worker as live."""
        assert self.obs is not None
        deadline = time.monotonic() + timeout_s
        wanted = set(self.worker_ids)
        seen: set[str] = set()
        while time.monotonic() < deadline:
            with suppress(Exception):
                reply = await self.obs.request(WORKERS, b"{}", timeout=2)
                seen = {
                    w["worker_id"]
                    for w in msgspec.json.decode(reply.data)["workers"]
                    if w.get("models")
                }
                if wanted <= seen:
                    return
            await asyncio.sleep(0.3)
        raise RuntimeError(f"workers not live after {timeout_s} s: {sorted(wanted - seen)}")

    async def wait_current(self, timeout_s: float = 90.0) -> None:
        """Until every stream's copies are all current (each node holds all of it)."""
        deadline = time.monotonic() + timeout_s
        behind: list[str] = list(FLEET_STREAMS)
        while time.monotonic() < deadline:
            behind = []
            for name in FLEET_STREAMS:
                try:
                    copies = replication_of(await self.js.stream_info(name))
                except Exception:
                    behind.append(name)
                    continue
                if copies.current < self.config.nodes:
                    behind.append(name)
            if not behind:
                return
            await asyncio.sleep(0.5)
        raise RuntimeError(f"streams not current after {timeout_s} s: {behind}")

    async def leads(self) -> dict[str, list[str]]:
        """Per node (its host's address): the streams of a task's path it leads."""
        found: dict[str, list[str]] = {}
        for stream in TASK_PATH:
            with suppress(Exception):
                cluster = (await self.js.stream_info(stream)).cluster
                if cluster is not None and cluster.leader:
                    found.setdefault(cluster.leader, []).append(stream)
        return found

    async def pick(self, among: list[Host], victim: str) -> tuple[Host, list[str]]:
        """``leader``: the host among ``among`` whose node leads the most of a task's path
        (``EVENTS`` first): the loss that costs most. ``follower``: the one leading least.
        With the streams that host's node leads."""
        leads = await self.leads()

        def weight(host: Host) -> tuple[int, int]:
            led = leads.get(host.net.ip, [])
            return (EVENTS_STREAM in led, len(led))

        ordered = sorted(among, key=weight, reverse=victim == "leader")
        return ordered[0], leads.get(ordered[0].net.ip, [])

    def mark(self, what: str) -> None:
        """Print and keep one line of the timeline."""
        line = f"{time.monotonic() - self.started:7.1f} s  {what}"
        self.timeline.append(line)
        print(line, flush=True)

    # -- faults --------------------------------------------------------------------------

    async def kill_host(self, host: Host) -> None:
        """SIGKILL every process of ``host``: its node and services at once, then its
        stand-ins, once their records are read (they die with the rest, a moment later)."""
        assert self.cluster is not None and host.node is not None
        doomed = [s.proc for s in host.services] + [host.node.proc]
        for proc in doomed:
            if proc is not None:
                with suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
        self.kill_at = time.time()
        await asyncio.sleep(0.3)  # the stand-ins see their workers hang up
        host.gone_generations += await self.generations(host)
        host.net.kill_all()
        for service in [*host.services, *host.standins]:
            service.kill()
        self.cluster.kill(self.hosts.index(host))

    async def revive_host(self, host: Host) -> None:
        """The node on its store, then the stand-ins and services."""
        assert self.cluster is not None and host.node is not None
        host.node.start()
        await asyncio.to_thread(self.cluster.wait_healthy, self.hosts.index(host), 60.0)
        self.mark(f"{host.name}: nats-server healthy again")
        await self.start_host(host)

    async def faults(self) -> None:
        """The kill, the return, the cut, the mend (see the module's docstring)."""
        await asyncio.sleep(self.config.warmup_s)
        victim, led = await self.pick(self.hosts, self.config.victim)
        self.killed = victim
        await self.kill_host(victim)
        self.mark(f"{victim.name} ({victim.net.ip}) killed whole; its node led {led or 'none'}")
        await asyncio.sleep(self.config.down_s)
        await self.revive_host(victim)
        await self.wait_workers()
        await self.wait_current()
        self.mark(f"{victim.name} back: every worker live, every stream current on 3 nodes")
        others = [h for h in self.hosts if h is not victim]
        target, led = await self.pick(others, self.config.victim)
        self.cut = target
        target.net.cut()
        self.cut_at = time.time()
        self.mark(f"{target.name} ({target.net.ip}) cut off; its node led {led or 'none'}")
        await asyncio.sleep(self.config.cut_s)
        target.net.mend()
        self.mark(f"{target.name} mended")
        await self.wait_current()
        self.mark("every stream current on 3 nodes again")

    # -- the run -------------------------------------------------------------------------

    async def run(self, root: Path) -> Report:
        """Set up, measure, fault, judge; everything this started is stopped at the end."""
        config = self.config
        self.start_nats(root)
        self.mark(f"NATS up: {self.nats_url}")
        self.setup_streams()
        for host in self.hosts:
            self.plan_host(host)
        postgres = await Postgres().start()
        dsn = await postgres.create_database()
        try:
            self.start_stats(dsn)
            await asyncio.gather(*(self.start_host(h) for h in self.hosts))
            await self.connect_clients()
            await self.wait_workers()
            self.mark(f"{len(self.worker_ids)} workers live")
            throughput: dict[str, float] = {}
            if config.throughput_s > 0:
                throughput = await self.closed_loop(config.throughput_s, config.throughput_clients)
                self.mark(f"throughput: {throughput}")
            if config.faults:
                self.generation_delay = config.generation_s / PIECES
                await self.configure_standins(self.hosts, self.generation_delay)
                await self.under_load(self.faults())
                self.mark("every client answered (or gave up)")
            return await self.verdict(throughput)
        finally:
            await self.close_clients()
            self.stop_all()
            with suppress(Exception):
                await postgres.drop_database(dsn)
            postgres.stop()

    async def under_load(self, faults: Coroutine[Any, Any, None]) -> None:
        """``faults`` while the open loop asks for tasks, then ``tail_s`` more of it; then
        no more tasks, and the clients of those asked for get their answers."""
        load = asyncio.create_task(self.open_loop())
        try:
            await faults
            await asyncio.sleep(self.config.tail_s)
        except BaseException:
            load.cancel()
            with suppress(BaseException):
                await load
            raise
        self.stop_asking.set()
        self.mark("no more tasks asked for")
        await load

    async def settled_events(self) -> EventLog:
        """The event log once every task a router recorded has its final state (a task whose
        client was refused may still be running), or nothing has been stored for
        `QUIET_S`, or after ``settle_s``."""
        deadline = time.monotonic() + self.config.settle_s
        seen, quiet_since = -1, time.monotonic()
        while True:
            events = await read_events(self.js)
            open_tasks = [
                t for t in self.asks if t in events.tasks and events.final(t, settled=False) is None
            ]
            stored = sum(len(task.kinds) for task in events.tasks.values())
            if stored != seen:
                seen, quiet_since = stored, time.monotonic()
            now = time.monotonic()
            if not open_tasks or now > deadline or now - quiet_since >= QUIET_S:
                return events
            await asyncio.sleep(2.0)

    async def verdict(self, throughput: dict[str, float]) -> Report:
        """The report: the log once settled, the stand-ins' records, the clients' answers."""
        events = await self.settled_events()
        generations = [g for h in self.hosts for g in h.gone_generations]
        for host in self.hosts:
            generations += await self.generations(host)
        asks = list(self.asks.values())
        recorded = [a.task_id for a in asks if a.task_id in events.tasks]
        verdict = judge(events, recorded)
        by_prompt = {a.prompt: a.task_id for a in asks}
        twice, two_at_once = generations_overlapping(generations, by_prompt, time.time())
        generated = {g.prompt for g in generations}
        done_unseen = [
            a.task_id
            for a in asks
            if verdict.finals.get(a.task_id) == "done" and a.prompt not in generated
        ]
        unanswered = [a.task_id for a in asks if a.status is None]
        wrong = []
        for a in asks:
            final = verdict.finals.get(a.task_id)
            if a.status == "done" and (
                final != "done" or a.response != expected_response(a.prompt)
            ):
                wrong.append(f"{a.task_id}: told done ({a.response!r}), the log says {final}")
            elif a.status in ("failed", "refused") and final == "done":
                wrong.append(f"{a.task_id}: told {a.status} ({a.code}), yet it ran: done")
            elif a.status == "failed" and final is None:
                wrong.append(f"{a.task_id}: told failed ({a.code}), the log has no end")
        report = Report(
            config=asdict(self.config),
            asked=len(asks),
            recorded=len(recorded),
            done=verdict.done,
            failed=verdict.failed,
            refused=dict(Counter(a.code or "?" for a in asks if a.status == "refused")),
            lost=verdict.lost,
            unanswered=unanswered,
            overlapping_generations=twice,
            standins_running_two=two_at_once,
            worker_runs_overlapping=verdict.concurrent_by_worker,
            done_unseen=done_unseen,
            answered_twice=verdict.answered_twice,
            wrong_answers=wrong,
            moved=verdict.moved,
            max_attempts=verdict.max_attempts,
            generations=len(generations),
            client_retries=sum(a.retries for a in asks),
            killed=self.killed.name if self.killed else "",
            cut=self.cut.name if self.cut else "",
            throughput=throughput,
            timeline=self.timeline,
            elapsed_s=round(time.monotonic() - self.started, 1),
            load=load_average(),
        )
        odd = [
            *report.lost,
            *report.unanswered,
            *(w.split(":", 1)[0] for w in wrong),
            *report.answered_twice,
            *(a.task_id for a in asks if a.status == "refused" or a.retries),
        ]
        for task_id in list(dict.fromkeys(odd))[:12]:
            a = self.asks[task_id]
            report.problems[task_id] = {
                "asked_at_s": round(a.sent_at - self.started_wall, 2),
                "answered_at_s": round(a.answered_at - self.started_wall, 2)
                if a.answered_at is not None
                else None,
                "told": f"{a.status} {a.code or ''} {a.error or ''}".strip(),
                "retries": a.retries,
                "history": events.tasks[task_id].kinds if task_id in events.tasks else [],
            }
        if self.kill_at is not None:
            report.kill_to_flowing_s = flowing_after(asks, self.kill_at)
            report.longest_silence_after_kill_s = longest_silence(
                asks, self.kill_at, self.kill_at + FAULT_WINDOW_S
            )
        if self.cut_at is not None:
            report.cut_to_flowing_s = flowing_after(asks, self.cut_at)
            report.longest_silence_after_cut_s = longest_silence(
                asks, self.cut_at, self.cut_at + FAULT_WINDOW_S
            )
        return report


async def read_events(js: JetStreamContext) -> EventLog:
    """Every task event in the log, folded (`benchmarks.chaos.EventLog`)."""
    events = EventLog()
    sub = await js.subscribe(
        "events.task.>",
        stream=EVENTS_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=5)
            except TimeoutError:
                break
            await events.on_msg(msg)
            if msg.metadata.num_pending == 0:
                break
    finally:
        with suppress(Exception):
            await sub.unsubscribe()
    return events


async def run(config: Config, logs: Path | None = None) -> Report:
    """One run on three fresh test hosts (removed at the end with everything in them); the
    processes' logs go to ``logs`` (a temporary directory by default, named in the report
    when a property failed)."""
    keep = logs or Path(tempfile.mkdtemp(prefix="coord-cluster-chaos-"))
    with (
        netns_hosts(HOSTS, routed=True) as nets,
        tempfile.TemporaryDirectory(prefix="coord-cluster-chaos-nats-") as root,
    ):
        fleet = Fleet(config, nets, keep)
        try:
            report = await fleet.run(Path(root))
        finally:
            if fleet.cluster is not None:
                fleet.cluster.stop()
            if fleet.single is not None:
                fleet.single.stop()
    if not report.ok:
        report.logs = str(keep)
    return report


def main(argv: list[str] | None = None) -> int:
    """The cluster run (throughput, then the faults), then the single-server run; the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_chaos", description=__doc__)
    defaults = Config()
    parser.add_argument("--rate", type=float, default=defaults.rate, help="tasks/s under faults")
    parser.add_argument("--tasks", type=int, default=defaults.tasks, help="at most, under faults")
    parser.add_argument("--workers-per-host", type=int, default=defaults.workers_per_host)
    parser.add_argument("--generation", type=float, default=defaults.generation_s, help="s")
    parser.add_argument("--warmup", type=float, default=defaults.warmup_s, help="s before the kill")
    parser.add_argument("--down", type=float, default=defaults.down_s, help="s the host is down")
    parser.add_argument("--cut", type=float, default=defaults.cut_s, help="s the link is cut")
    parser.add_argument("--tail", type=float, default=defaults.tail_s, help="s of load after")
    parser.add_argument("--settle", type=float, default=defaults.settle_s)
    parser.add_argument("--clients", type=int, default=defaults.clients, help="in flight at most")
    parser.add_argument("--reask", type=float, default=defaults.reask_s, help="s of silence")
    parser.add_argument("--throughput-seconds", type=float, default=15.0)
    parser.add_argument("--throughput-clients", type=int, default=defaults.throughput_clients)
    parser.add_argument(
        "--victim",
        choices=("leader", "follower"),
        default=defaults.victim,
        help="hit the node leading most of a task's path, or least",
    )
    parser.add_argument(
        "--worker-ttl", type=float, default=None, help="WORKER_TTL_S everywhere (default: 3)"
    )
    parser.add_argument("--no-single", action="store_true", help="skip the single-server run")
    parser.add_argument(
        "--throughput-only", action="store_true", help="no faults: the two throughputs alone"
    )
    parser.add_argument("--log-level", default=defaults.log_level, help="the services' LOG_LEVEL")
    args = parser.parse_args(argv)
    from devtools.hosts import netns_unavailable

    why = netns_unavailable()
    if why is not None:
        print(f"cannot make test hosts: {why}", file=sys.stderr)
        return 2
    config = Config(
        rate=args.rate,
        tasks=args.tasks,
        workers_per_host=args.workers_per_host,
        generation_s=args.generation,
        warmup_s=args.warmup,
        down_s=args.down,
        cut_s=args.cut,
        tail_s=args.tail,
        settle_s=args.settle,
        clients=args.clients,
        reask_s=args.reask,
        throughput_s=args.throughput_seconds,
        throughput_clients=args.throughput_clients,
        log_level=args.log_level,
        victim=args.victim,
        worker_ttl_s=args.worker_ttl,
        faults=not args.throughput_only,
    )
    report = asyncio.run(run(config))
    single = None
    if not args.no_single and args.throughput_seconds > 0:
        print("single server, same harness:", flush=True)
        single = asyncio.run(run(Config(**{**asdict(config), "nodes": 1, "faults": False})))
    print(render(report, single))
    path = write_result(
        "cluster-chaos",
        {
            "ok": report.ok,
            "cluster": asdict(report),
            "single": asdict(single) if single is not None else None,
            "load_average": load_average(),
        },
    )
    print(f"figures: {path}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
