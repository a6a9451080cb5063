"""Completion times over a simulated fleet of dissimilar hosts, routed by the routing policy
before and after it counted cold loads, the work queued ahead in time, the GPU preference and
the models a load pushes out of memory.

    .venv/bin/python -m benchmarks.fleet_sim [--seeds 1,2,3,4,5] [--requests 3000]
                                            [--busy-rates 1,1.4,1.8] [--preference 2]
                                            [--eviction ollama|lru]

A seeded trace of requests (Poisson arrivals, ten minutes busy then ten quiet at
`QUIET_RATE`, five models from 0.5B to 12B of unequal popularity, each request's length
drawn once) is replayed, per busy rate (requests per second) and seed, over `HOSTS`: a Mac
and a gaming PC with GPUs, three CPU boxes, each with its own speed and cold-load time per
model and its own memory. A host runs one generation at a time, loads a model that is not in
memory, pushing others out as ``--eviction`` says (`Eviction`: by default as Ollama's
scheduler does), and unloads a model unused for `KEEP_ALIVE_S`. Its worker starts with a
sanity run of each model, as a real one does (those loads are not counted). It pulls its own
queue first, then the shared CPU queue. Nothing here is random but the trace: the same seed
gives the same figures.

Each request is routed, at its arrival, by the real pure code:

- **before**: the rule as it was: a live GPU worker always, and among candidates
  (tasks queued or running + 1) × the typical duration (`policy.choose` with an infinite
  `gpu_preference`, the work ahead as depth × the task's typical duration, and no worker
  saying what it holds in memory);
- **after**: what the router does now (`services.router.decide.decide` over a
  `services.router.view.FleetView`): the work ahead in time, a cold load where the model is
  not in memory, what that load pushes out, and ``--preference`` (``GPU_PREFERENCE``), with
  the workers' memory limits as they learn them (no ``WORKER_MEMORY_GB``);
- **after+mem**: the same with each worker's ``WORKER_MEMORY_GB`` set to its host's memory.

The router's view is fed as the services feed it: figures as the stats service computes them
(p50 of the total and of the total less the load, p50 of the loads of 100 ms or more, per
model and worker) after every completion; the tasks routed and ended; and, after, each
host's models in memory as its worker reports them (`services.worker.probe`): what
``/api/ps`` lists after each sanity run, at a task end that loaded its model, and on the idle
probe every `PROBE_S`, with the memory each model takes and the most seen held at once
(`services.fleet.health.memory_seen`); after any other task, the model that ran
(`services.fleet.health.resident_after_task`); with the model each is running, as its
heartbeat says. Prints, per busy rate and rule, the medians over the seeds of the mean, p50
and p95 completion time (arrival to end), cold loads and the share run on CPU hosts, and
writes every run to ``benchmarks/results/fleet_sim-<time>.json``.
"""

from __future__ import annotations

import argparse
import hashlib
import heapq
import math
import random
import statistics
from bisect import insort
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec

from benchmarks.routing import worker_record
from schemas.models import ModelFacts
from schemas.route import RouteRequest
from schemas.stats import COLD_LOAD_MIN_MS
from schemas.subjects import SHARED_CPU
from schemas.workers import WorkerRecord
from services.fleet import health, policy
from services.fleet.figures import Figure
from services.router import decide as router_decide
from services.router.view import FleetView

DOMAIN: Final = "general"
# Ollama's default keep_alive, and the worker's idle probe (HEALTH_INTERVAL_S).
KEEP_ALIVE_S: Final = 300.0
PROBE_S: Final = 30.0
# Ollama's default OLLAMA_MAX_LOADED_MODELS: 3 per GPU, 3 for a CPU.
MAX_LOADED_MODELS: Final = 3

RULES: Final = ("before", "after", "after+mem")

Eviction = Literal["ollama", "lru"]
"""What a load pushes out of a host's memory. ``ollama``: as Ollama's scheduler does
(``server/sched.go``: at most `MAX_LOADED_MODELS` models, and while the new one does not fit
or one too many would be loaded, the idle model with the shortest ``keep_alive`` goes first,
then by the path of its file). ``lru``: the least recently used first, as many as fit (the
model of the figures before this one)."""
# Arrivals: requests per second in the busy stretches (light, moderate, heavy: the two GPU
# hosts alone run about 2 a second when nothing needs loading), the quiet ones, each this long.
BUSY_RATES: Final = (1.0, 1.4, 1.8)
QUIET_RATE: Final = 0.4
STRETCH_S: Final = 600.0

# Model -> (memory in GB, share of the requests).
MODELS: Final = {
    "qwen2.5:0.5b": (0.5, 0.30),
    "gemma3:1b": (1.0, 0.25),
    "qwen3:4b": (3.0, 0.20),
    "qwen2.5:7b": (5.0, 0.15),
    "gemma3:12b": (8.5, 0.10),
}


@dataclass(frozen=True, slots=True)
class Host:
    """One machine: GPU or not, memory for models, and per model (typical run ms, load ms)."""

    name: str
    gpu: bool
    memory_gb: float
    speeds: dict[str, tuple[float, float]]


HOSTS: Final = (
    Host(
        "mac",
        gpu=True,
        memory_gb=16.0,
        speeds={
            "qwen2.5:0.5b": (350, 800),
            "gemma3:1b": (500, 1_200),
            "qwen3:4b": (1_400, 2_500),
            "qwen2.5:7b": (2_400, 4_000),
            "gemma3:12b": (4_200, 7_000),
        },
    ),
    Host(
        "pc",
        gpu=True,
        memory_gb=12.0,
        speeds={
            "qwen2.5:0.5b": (200, 600),
            "gemma3:1b": (300, 900),
            "qwen3:4b": (700, 2_000),
            "qwen2.5:7b": (1_200, 3_000),
            "gemma3:12b": (2_200, 5_500),
        },
    ),
    Host(
        "cpu-a",
        gpu=False,
        memory_gb=32.0,
        speeds={
            "qwen2.5:0.5b": (1_200, 1_500),
            "gemma3:1b": (2_000, 2_500),
            "qwen3:4b": (6_500, 6_000),
            "qwen2.5:7b": (11_000, 9_000),
        },
    ),
    Host(
        "cpu-b",
        gpu=False,
        memory_gb=16.0,
        speeds={
            "qwen2.5:0.5b": (1_400, 2_000),
            "gemma3:1b": (2_400, 3_000),
            "qwen3:4b": (7_500, 7_000),
        },
    ),
    Host(
        "nuc",
        gpu=False,
        memory_gb=6.0,
        speeds={"qwen2.5:0.5b": (2_200, 2_500), "gemma3:1b": (3_500, 3_500)},
    ),
)


@dataclass(frozen=True, slots=True)
class Request:
    arrival: float
    model: str
    length: float
    """The request's run time as a multiple of the model's typical one on any host."""


def trace(seed: int, count: int, busy_rate: float) -> list[Request]:
    """``count`` requests: Poisson arrivals, busy and quiet stretches in turn."""
    rng = random.Random(seed)
    names = list(MODELS)
    weights = [share for _, share in MODELS.values()]
    requests: list[Request] = []
    now = 0.0
    for _ in range(count):
        busy = int(now // STRETCH_S) % 2 == 0
        now += rng.expovariate(busy_rate if busy else QUIET_RATE)
        model = rng.choices(names, weights)[0]
        requests.append(Request(now, model, rng.lognormvariate(0.0, 0.3)))
    return requests


def blob(model: str) -> str:
    """A stand-in for the path of the model's file in Ollama's store (``blobs/sha256-…``,
    named by its digest): Ollama unloads in the order of these paths."""
    return "sha256-" + hashlib.sha256(model.encode()).hexdigest()


@dataclass
class Machine:
    """A host as it runs: its queue, what it runs, what it holds in memory."""

    host: Host
    eviction: Eviction = "ollama"
    queue: deque[int] = field(default_factory=deque)
    running: int | None = None
    idle_since: float = 0.0
    # model -> when it was last used, least recently used first
    memory: OrderedDict[str, float] = field(default_factory=OrderedDict)
    # What its worker last said it holds (services.worker.probe), by model name, and what
    # it has seen its backend hold (services.fleet.health.memory_seen).
    reported: frozenset[str] = frozenset()
    seen: health.MemorySeen = field(default_factory=health.MemorySeen)
    loads: int = 0

    def in_memory(self, now: float) -> dict[str, int]:
        """What the backend's /api/ps lists at ``now`` (keep-alive not run out), with the
        bytes each model takes."""
        return {m: size_of(m) for m, used in self.memory.items() if now - used < KEEP_ALIVE_S}

    def start(self, model: str, now: float) -> float:
        """Begin a task of ``model``: the load time it needs first (0 when in memory)."""
        for name in [m for m, used in self.memory.items() if now - used >= KEEP_ALIVE_S]:
            del self.memory[name]
        if model in self.memory:
            self.memory.move_to_end(model)
            self.memory[model] = now
            return 0.0
        need = MODELS[model][0]
        limit = MAX_LOADED_MODELS if self.eviction == "ollama" else math.inf
        while self.memory and (
            sum(MODELS[m][0] for m in self.memory) + need > self.host.memory_gb
            or len(self.memory) >= limit
        ):
            if self.eviction == "ollama":
                # Every model has the default keep_alive, so the order is the file's path.
                del self.memory[min(self.memory, key=blob)]
            else:
                self.memory.popitem(last=False)
        self.memory[model] = now
        self.loads += 1
        return self.host.speeds[model][1]


def size_of(model: str) -> int:
    """The bytes ``model`` takes loaded, as /api/ps says (and its file, as /api/tags says)."""
    return round(MODELS[model][0] * 1e9)


@dataclass
class Figures:
    """What the stats service would publish per (model, worker): p50s over done tasks."""

    totals: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    warms: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    colds: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def done(self, model: str, worker: str, total_ms: float, load_ms: float) -> Figure:
        key = (model, worker)
        insort(self.totals.setdefault(key, []), total_ms)
        insort(self.warms.setdefault(key, []), total_ms - load_ms)
        if load_ms >= COLD_LOAD_MIN_MS:
            insort(self.colds.setdefault(key, []), load_ms)
        cold = self.colds.get(key)
        return Figure(
            typical_ms=statistics.median(self.totals[key]),
            recent_failure_rate=0.0,
            warm_ms=statistics.median(self.warms[key]),
            cold_load_ms=statistics.median(cold) if cold else None,
        )


Route = Callable[[Request, int, float], policy.Decision]


class Simulation:
    """One replay of the trace under one rule (``after``: the router's code as it is now)."""

    def __init__(
        self,
        requests: list[Request],
        *,
        after: bool,
        preference: float,
        eviction: Eviction = "ollama",
        memory_set: bool = False,
    ) -> None:
        self.requests = requests
        self.after = after
        # Each worker's WORKER_MEMORY_GB is its host's memory (else it reports what it saw).
        self.memory_set = memory_set
        self.preference = preference
        self.machines = {h.name: Machine(h, eviction) for h in HOSTS}
        self.shared: deque[int] = deque()
        self.view = FleetView()
        self.stats = Figures()
        self.records: dict[str, WorkerRecord] = {}
        for host in HOSTS:
            self._register(host.name)
        self.ended: dict[int, float] = {}
        self.where: dict[int, str] = {}
        self.load_ms: dict[int, float] = {}  # of the tasks running
        self._events: list[tuple[float, int, str, int]] = []
        self._seq = 0

    def run(self) -> dict[str, Any]:
        for index, request in enumerate(self.requests):
            self._at(request.arrival, "arrive", index)
        while self._events:
            now, _, kind, index = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(index, now)
            else:
                self._finish(self.where[index], index, now)
        return self._figures()

    # -- routing -------------------------------------------------------------------------

    def _arrive(self, index: int, now: float) -> None:
        request = self.requests[index]
        decision = self._route(request, now)
        self.view.routed(str(index), decision.worker_id, now, request.model, DOMAIN)
        if decision.worker_id == SHARED_CPU.name:
            self.shared.append(index)
            for name in sorted(self.machines):
                self._next(name, now)
        else:
            self.machines[decision.worker_id].queue.append(index)
            self._next(decision.worker_id, now)

    def _route(self, request: Request, now: float) -> policy.Decision:
        live = [self._as_reported(name, now) for name in sorted(self.records)]
        if self.after:
            asked = RouteRequest(prompt="…", model=request.model, domain=DOMAIN)
            plan = router_decide.decide(
                asked, live, (), self.view, gpu_models=(), gpu_preference=self.preference
            )
            return plan.decision
        # The rule before: (depth + 1) × typical, a GPU worker whenever one is live.
        candidates = [r.worker_id for r in live if request.model in r.models]
        known = self.view.figures.estimates(request.model, DOMAIN, candidates, {})
        depth = self.view.depth()
        old = policy.Estimates(
            queued_ms={
                w: [known.typical_ms.get(w, policy.PRIOR_TYPICAL_MS)] * depth.get(w, 0)
                for w in candidates
            },
            typical_ms=known.typical_ms,
            failure_rate=known.failure_rate,
        )
        return policy.choose(request.model, live, gpu_preference=math.inf, estimates=old)

    def _as_reported(self, name: str, now: float) -> WorkerRecord:
        """The registry entry as the router sees it: after an idle probe, what the backend
        held at that probe."""
        record = self.records[name]
        if not self.after:
            return record
        machine = self.machines[name]
        if machine.running is None and not machine.queue and now - machine.idle_since >= PROBE_S:
            probed = machine.idle_since + PROBE_S * ((now - machine.idle_since) // PROBE_S)
            self._read(name, probed)
        return self.records[name]

    def _read(self, name: str, now: float) -> None:
        """The worker reads /api/ps: what is in memory, and what that says of the memory."""
        machine = self.machines[name]
        loaded = machine.in_memory(now)
        machine.seen = health.memory_seen(machine.seen, loaded)
        self._report(name, frozenset(loaded))

    def _report(self, name: str, resident: frozenset[str]) -> None:
        """The worker's heartbeat says what it holds, as `services.worker.probe` reports it."""
        machine = self.machines[name]
        seen = machine.seen
        record = self.records[name]
        limit = round(machine.host.memory_gb * 1e9) if self.memory_set else None
        memory_bytes = limit or seen.most_bytes or None
        max_resident = seen.most_models or None
        if (
            resident != machine.reported
            or record.resident is None
            or (record.memory_bytes, record.max_resident) != (memory_bytes, max_resident)
        ):
            machine.reported = resident
            self.records[name] = msgspec.structs.replace(
                record,
                resident=sorted(resident),
                model_memory=dict(seen.sizes),
                memory_bytes=memory_bytes,
                max_resident=max_resident,
            )

    def _heartbeat(self, name: str, running: str | None) -> None:
        """The registry entry says what the worker runs now."""
        state = "busy" if running is not None else "idle"
        self.records[name] = msgspec.structs.replace(
            self.records[name], state=state, current_model=running
        )

    def _register(self, name: str) -> None:
        """The worker starts: a sanity run of each model (which leaves what fits in memory,
        not counted among the trace's loads), then it registers."""
        machine = self.machines[name]
        host = machine.host
        self.records[name] = msgspec.structs.replace(
            worker_record(name, list(host.speeds), gpu=host.gpu, heartbeat_at=0.0),
            facts=[ModelFacts(name=m, size=size_of(m)) for m in host.speeds],
        )
        for model in host.speeds:
            machine.start(model, 0.0)
            if self.after:
                self._read(name, 0.0)
        machine.loads = 0

    # -- the hosts -----------------------------------------------------------------------

    def _next(self, name: str, now: float) -> None:
        """Start the host's next task if it is free: its own queue first, then the shared
        CPU queue."""
        machine = self.machines[name]
        if machine.running is not None:
            return
        if machine.queue:
            index = machine.queue.popleft()
        elif not machine.host.gpu and self.shared:
            index = self.shared.popleft()
        else:
            return
        request = self.requests[index]
        load_ms = machine.start(request.model, now)
        run_ms = machine.host.speeds[request.model][0] * request.length
        machine.running = index
        self.where[index] = name
        self.load_ms[index] = load_ms
        self._heartbeat(name, request.model)
        self._at(now + (load_ms + run_ms) / 1000, "finish", index)

    def _finish(self, name: str, index: int, now: float) -> None:
        machine = self.machines[name]
        request = self.requests[index]
        load_ms = self.load_ms.pop(index)
        total_ms = load_ms + machine.host.speeds[request.model][0] * request.length
        machine.running = None
        machine.idle_since = now
        self._heartbeat(name, None)
        self.ended[index] = now
        self.view.ended(str(index))
        figure = self.stats.done(request.model, name, total_ms, load_ms)
        self.view.figures.put(request.model, DOMAIN, name, figure)
        if self.after:
            # As the worker says it: the model that ran, and after a load /api/ps read again.
            after, reread = health.resident_after_task(machine.reported, request.model, None)
            if reread or after is None:
                self._read(name, now)
            else:
                self._report(name, after)
        self._next(name, now)

    def _at(self, when: float, kind: str, index: int) -> None:
        self._seq += 1
        heapq.heappush(self._events, (when, self._seq, kind, index))

    # -- figures -------------------------------------------------------------------------

    def _figures(self) -> dict[str, Any]:
        from benchmarks.stack import percentile

        took = [self.ended[i] - r.arrival for i, r in enumerate(self.requests)]
        on = Counter(self.where.values())
        cpu = sum(n for name, n in on.items() if not self.machines[name].host.gpu)
        return {
            "mean_s": round(statistics.fmean(took), 2),
            "p50_s": round(percentile(took, 50), 2),
            "p95_s": round(percentile(took, 95), 2),
            "cold_loads": sum(m.loads for m in self.machines.values()),
            "on_cpu": round(cpu / len(self.requests), 3),
            "tasks_per_host": dict(sorted(on.items())),
        }


def simulate(
    seeds: list[int],
    count: int,
    preference: float,
    busy_rates: list[float],
    eviction: Eviction = "ollama",
) -> dict[str, Any]:
    """Both rules over the same traces, for each busy rate and seed; per rate and rule the
    median over the seeds of each figure (one trace's figures swing with a few bursts)."""
    figures: dict[str, Any] = {
        "seeds": seeds,
        "requests": count,
        "gpu_preference": preference,
        "eviction_weight": policy.EVICTION_WEIGHT,
        "eviction": eviction,
        "quiet_rate": QUIET_RATE,
        "rates": [],
    }
    for busy_rate in busy_rates:
        rate: dict[str, Any] = {"busy_rate": busy_rate, "runs": []}
        for seed in seeds:
            requests = trace(seed, count, busy_rate)
            run: dict[str, Any] = {"seed": seed, "trace_s": round(requests[-1].arrival)}
            for rule in RULES:
                simulation = Simulation(
                    requests,
                    after=rule != "before",
                    preference=preference,
                    eviction=eviction,
                    memory_set=rule == "after+mem",
                )
                run[rule] = simulation.run()
            rate["runs"].append(run)
        for rule in RULES:
            rate[rule] = {
                name: statistics.median(run[rule][name] for run in rate["runs"])
                for name in ("mean_s", "p50_s", "p95_s", "cold_loads", "on_cpu")
            }
        figures["rates"].append(rate)
    return figures


def print_table(figures: dict[str, Any]) -> None:
    from benchmarks.stack import table

    print(
        f"{figures['requests']} requests per trace, seeds {figures['seeds']} (medians), "
        f"{len(HOSTS)} hosts, eviction {figures['eviction']}; after: GPU_PREFERENCE "
        f"{figures['gpu_preference']:g}, eviction weight {figures['eviction_weight']:g}"
    )
    headers = ["busy req/s", "rule", "mean s", "p50 s", "p95 s", "cold loads", "on cpu"]
    rows = [
        [
            f"{rate['busy_rate']:g}",
            rule,
            f["mean_s"],
            f["p50_s"],
            f["p95_s"],
            f["cold_loads"],
            f"{f['on_cpu']:.1%}",
        ]
        for rate in figures["rates"]
        for rule in RULES
        for f in [rate[rule]]
    ]
    print(table(headers, rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_sim", description=__doc__)
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--preference", type=float, default=policy.DEFAULT_GPU_PREFERENCE)
    parser.add_argument("--busy-rates", default=",".join(f"{r:g}" for r in BUSY_RATES))
    parser.add_argument("--eviction", choices=["ollama", "lru"], default="ollama")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.busy_rates.split(",")]
    seeds = [int(seed) for seed in args.seeds.split(",")]
    figures = simulate(seeds, args.requests, args.preference, rates, args.eviction)
    print_table(figures)
    from benchmarks.stack import write_result

    print(f"written to {write_result('fleet_sim', figures)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
