"""Backend health as a fact (lesson 13): the worker's probe rules, and what routing, the reaper
and the doctor make of a degraded worker. Pure: no servers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from schemas.workers import WorkerRecord
from services.cli.doctor_checks import check_backends
from services.errors import (
    BackendError,
    BackendServerError,
    BackendTimeout,
    BackendUnavailable,
    NoWorker,
    WorkerUnavailable,
)
from services.fleet import health
from services.fleet.health import Failure, HealthPolicy, MemorySeen, memory_seen
from services.fleet.policy import Estimates, choose
from services.reaper.decisions import Fail, Move, decide
from services.reaper.detectors import Snapshot, Thresholds, detect
from services.reaper.view import TaskTrack
from services.worker.probe import BackendProbe, failure_of, runs_elsewhere, watched

NOW = 1_000.0
POLICY = HealthPolicy(interval_s=30.0, idle_probe_s=600.0)
TH = Thresholds(dead_after_s=3.0, stuck_grace_s=30.0, ghost_after_s=10.0, duplicate_samples=2)
HUNG = "backend_timeout: no first token from m on http://x within 120 s"


def worker(worker_id: str, *models: str, **fields: Any) -> WorkerRecord:
    values: dict[str, Any] = {
        "worker_id": worker_id,
        "host": f"host-{worker_id}",
        "instance_id": "i",
        "pid": 1,
        "version": "t",
        "supports": ["cpu_inference"],
        "models": list(models) or ["m"],
        "started_at": NOW - 100,
        "heartbeat_at": NOW - 0.5,
        "health_since": NOW - 50,
        **fields,
    }
    return WorkerRecord(**values)


def degraded(worker_id: str, *models: str, **fields: Any) -> WorkerRecord:
    return worker(worker_id, *models, health="degraded", health_reason=HUNG, **fields)


# -- the state machine


def test_a_healthy_idle_worker_lists_models_every_interval_and_nothing_in_between() -> None:
    state = health.start(NOW)
    assert health.due(state, POLICY, NOW + 29) is None
    assert health.due(state, POLICY, NOW + 30) == "list"
    listed = health.probed(state, "list", None, NOW + 30)
    assert health.due(listed, POLICY, NOW + 59) is None
    assert (listed.status, listed.since) == ("healthy", NOW)


def test_idle_long_it_runs_a_generation_and_a_task_that_worked_counts_as_one() -> None:
    state = health.start(NOW)
    assert health.due(state, POLICY, NOW + 600) == "generate"
    worked = health.task_ended(state, None, NOW + 500)
    assert health.due(worked, POLICY, NOW + 600) == "list"
    assert health.due(worked, POLICY, NOW + 1100) == "generate"
    never = HealthPolicy(interval_s=30.0, idle_probe_s=None)
    assert health.due(state, never, NOW + 10_000) == "list"


def test_a_failed_list_degrades_and_only_a_passed_generation_heals() -> None:
    down = health.probed(health.start(NOW), "list", "backend_unavailable: refused", NOW + 30)
    assert (down.status, down.reason, down.since) == (
        "degraded",
        "backend_unavailable: refused",
        NOW + 30,
    )
    assert health.due(down, POLICY, NOW + 40) is None
    assert health.due(down, POLICY, NOW + 60) == "generate"
    listed = health.probed(down, "list", None, NOW + 60)
    assert listed.status == "degraded"  # a list that answers is not the work
    still = health.probed(down, "generate", "probe of m: backend_error: HTTP 500", NOW + 60)
    assert (still.status, still.since) == ("degraded", NOW + 30)
    assert still.reason == "probe of m: backend_error: HTTP 500"
    healed = health.probed(still, "generate", None, NOW + 90)
    assert (healed.status, healed.reason, healed.since) == ("healthy", None, NOW + 90)


def test_a_hung_task_degrades_at_once_and_a_probe_follows_right_after() -> None:
    state = health.task_ended(health.start(NOW), Failure(HUNG, degrades=True), NOW + 5)
    assert (state.status, state.reason) == ("degraded", HUNG)
    assert health.due(state, POLICY, NOW + 5) == "generate"
    after = health.probed(state, "generate", "still hung", NOW + 130)
    assert not after.recheck
    assert health.due(after, POLICY, NOW + 131) is None


def test_an_error_answer_does_not_degrade_but_asks_for_a_generation_probe() -> None:
    state = health.task_ended(
        health.start(NOW), Failure("backend_error: HTTP 400", degrades=False), NOW + 5
    )
    assert state.status == "healthy"
    assert health.due(state, POLICY, NOW + 5) == "generate"
    assert health.probed(state, "generate", None, NOW + 6).recheck is False


def test_which_task_failures_degrade() -> None:
    assert failure_of(BackendTimeout("no first token", stalled=True)).degrades
    assert not failure_of(BackendTimeout("did not finish m within 300 s")).degrades
    assert not failure_of(BackendError("Ollama answered HTTP 400: bad format")).degrades
    unreachable = failure_of(BackendUnavailable("refused"))
    assert unreachable.degrades and unreachable.reason == "backend_unavailable: refused"
    failing = failure_of(BackendServerError("Ollama answered HTTP 500: runner terminated"))
    assert failing.degrades and failing.reason.startswith("backend_server_error: ")


def test_which_task_failures_another_worker_runs_again() -> None:
    """The backend's own failures are retried elsewhere, unless output already reached the
    client; a refusal of the request is not (no worker would do better)."""
    for own in (
        BackendServerError("Ollama answered HTTP 500: llama runner process has terminated"),
        BackendUnavailable("Ollama at http://h:11434 cannot be reached: connection reset"),
        BackendTimeout("no first token within 30 s", stalled=True),
    ):
        assert runs_elsewhere(own, streamed=False), own
        assert not runs_elsewhere(own, streamed=True), own
    refusal = BackendError("Ollama answered HTTP 400: input exceeds maximum context length")
    assert not runs_elsewhere(refusal, streamed=False)


# -- what the backend holds in memory


def test_a_model_that_ran_stays_in_memory_unless_its_keep_alive_unloads_it() -> None:
    before = frozenset({"a"})
    assert health.resident_after_task(before, "a", None) == (before, False)
    assert health.resident_after_task(before, "a", "0s") == (frozenset(), False)
    # A load may have pushed others out: read the list again before the next task.
    assert health.resident_after_task(before, "b", "10m") == (frozenset({"a", "b"}), True)
    assert health.resident_after_task(before, "b", 0) == (before, True)
    assert health.resident_after_task(None, "a", None) == (None, True)


@pytest.mark.parametrize(
    ("keep_alive", "unloads"),
    [
        *[(None, False), (0, True), (0.0, True), (300, False), (-1, False), ("0", True)],
        *[("0s", True), ("0m0.0s", True), ("5m", False), ("-1m", False), ("10", False)],
    ],
)
def test_which_keep_alive_unloads_at_once(keep_alive: float | str | None, unloads: bool) -> None:
    assert health.unloads_at_once(keep_alive) is unloads


class MemoryBackend:
    """A backend whose ``/api/ps`` says ``loaded`` (None: it cannot say; an error: down),
    each model taking 1 GB unless ``sizes`` says otherwise."""

    address = "memory://test"

    def __init__(
        self, loaded: list[str] | BackendError | None, sizes: dict[str, int] | None = None
    ) -> None:
        self.loaded = loaded
        self.sizes = sizes or {}
        self.asked = 0

    async def list_models(self) -> list[str]:
        return ["qwen:latest", "b"]

    async def resident_models(self) -> dict[str, int] | None:
        self.asked += 1
        if isinstance(self.loaded, BackendError):
            raise self.loaded
        if self.loaded is None:
            return None
        return {name: self.sizes.get(name, GB) for name in self.loaded}


GB = 1_000_000_000


def memory_probe(backend: MemoryBackend, memory_bytes: int | None = None) -> BackendProbe:
    return BackendProbe(
        backend,  # type: ignore[arg-type]  # only what the probe calls between tasks
        POLICY,
        served=lambda: [("qwen:latest", False), ("b", False)],
        first_token_s=1.0,
        progress_s=1.0,
        canonical=lambda name: "qwen" if name == "qwen:latest" else name,
        memory_bytes=memory_bytes,
    )


async def test_the_probe_reports_the_served_models_in_memory_by_their_routing_names() -> None:
    backend = MemoryBackend(["qwen:latest", "not-served:1b"])
    probe = memory_probe(backend)
    assert [probe.resident] == [None]  # not asked yet
    await probe.read_resident()
    assert probe.resident == ["qwen"]
    assert not probe.due()

    probe.task_ended(None, "b", None)  # b was loaded for the task
    assert probe.resident == ["b", "qwen"]
    assert probe.due()  # the load may have pushed qwen out: asked again between tasks
    backend.loaded = ["b"]
    await probe.check()
    assert (probe.resident, probe.due(), backend.asked) == (["b"], False, 2)

    probe.task_ended(None, "b", None)  # already in memory: nothing to ask
    probe.task_ended(Failure("backend_error: HTTP 400", degrades=False), "qwen:latest")
    assert probe.resident == ["b"]


async def test_the_probe_reports_the_most_it_has_seen_the_backend_hold() -> None:
    backend = MemoryBackend(["qwen:latest"], sizes={"qwen:latest": 5 * GB, "not-served:1b": GB})
    probe = memory_probe(backend)
    assert (probe.model_memory, probe.memory_bytes, probe.max_resident) == ({}, None, None)
    await probe.read_resident()
    assert (probe.model_memory, probe.memory_bytes, probe.max_resident) == (
        {"qwen": 5 * GB},
        5 * GB,
        1,
    )
    # Two at once, one of them not served: it takes memory all the same.
    backend.loaded = ["b", "not-served:1b"]
    await probe.read_resident()
    assert probe.model_memory == {"qwen": 5 * GB, "b": GB}  # qwen's size is remembered
    assert (probe.memory_bytes, probe.max_resident) == (5 * GB, 2)
    backend.loaded = ["qwen:latest", "b"]
    await probe.read_resident()
    assert (probe.memory_bytes, probe.max_resident) == (6 * GB, 2)
    # Less in memory later lowers nothing; a backend that cannot say forgets nothing.
    backend.loaded = []
    await probe.read_resident()
    backend.loaded = BackendError("Ollama answered /api/ps with HTTP 500")
    await probe.read_resident()
    assert (probe.resident, probe.memory_bytes, probe.max_resident) == (None, 6 * GB, 2)


async def test_the_operators_memory_limit_is_reported_as_given() -> None:
    probe = memory_probe(MemoryBackend(["qwen:latest", "b"]), memory_bytes=16 * GB)
    assert probe.memory_bytes == 16 * GB  # before anything was seen
    await probe.read_resident()
    assert (probe.memory_bytes, probe.max_resident) == (16 * GB, 2)


def test_what_was_seen_in_memory_keeps_each_models_size_and_the_most_at_once() -> None:
    seen = memory_seen(MemorySeen(), {"a": 3 * GB, "b": 0})  # b: the backend gave no size
    assert seen == MemorySeen(sizes={"a": 3 * GB}, most_bytes=3 * GB, most_models=2)
    seen = memory_seen(seen, {"c": 8 * GB})
    assert (seen.sizes, seen.most_bytes, seen.most_models) == (
        {"a": 3 * GB, "c": 8 * GB},
        8 * GB,
        2,
    )


async def test_a_backend_that_cannot_say_or_fails_to_leaves_it_unknown() -> None:
    silent = memory_probe(MemoryBackend(None))
    await silent.read_resident()
    assert (silent.resident, silent.memory_bytes, silent.max_resident) == (None, None, None)
    backend = MemoryBackend(["b"])
    down = memory_probe(backend)
    await down.read_resident()
    assert down.resident == ["b"]
    backend.loaded = BackendError("Ollama answered /api/ps with HTTP 500")
    await down.read_resident()
    assert down.resident is None


# -- the first-token and progress timeouts


async def streaming(progress: Any, gaps: list[float]) -> str:
    for gap in gaps:
        await asyncio.sleep(gap)
        await progress()
    return "done"


async def test_a_stream_within_both_timeouts_is_left_alone() -> None:
    calls: list[int] = []

    async def counted() -> None:
        calls.append(1)

    result = await watched(
        lambda p: streaming(p, [0.05, 0.05, 0.05]),
        counted,
        first_token_s=0.2,
        progress_s=0.2,
        what="m",
    )
    assert result == "done" and len(calls) == 3


async def test_no_first_token_in_time_is_a_stalled_backend_timeout() -> None:
    started = time.monotonic()
    with pytest.raises(BackendTimeout) as caught:
        await watched(
            lambda p: streaming(p, [5.0]), None, first_token_s=0.1, progress_s=1.0, what="m on x"
        )
    assert time.monotonic() - started < 1.0
    assert caught.value.stalled
    assert caught.value.message == "no first token from m on x within 0.1 s"


async def test_silence_mid_stream_past_the_progress_timeout_is_a_stall() -> None:
    with pytest.raises(BackendTimeout) as caught:
        await watched(
            lambda p: streaming(p, [0.01, 0.01, 5.0]),
            None,
            first_token_s=1.0,
            progress_s=0.1,
            what="m",
        )
    assert caught.value.message == "m stalled: nothing streamed for 0.1 s"


# -- routing


def test_a_degraded_worker_gets_nothing_and_another_healthy_one_does() -> None:
    fleet = [degraded("a"), worker("b")]
    assert choose("m", fleet).worker_id == "b"


def test_when_only_degraded_workers_serve_the_model_the_error_names_the_reason() -> None:
    with pytest.raises(NoWorker) as caught:
        choose("m", [degraded("a"), worker("b", "other")])
    assert caught.value.code == "no_worker"
    assert caught.value.message == (
        f"no healthy worker serves model 'm': worker 'a' is degraded: {HUNG}"
    )


def test_a_request_naming_a_degraded_worker_is_refused_with_the_reason() -> None:
    with pytest.raises(WorkerUnavailable) as caught:
        choose("m", [degraded("a"), worker("b")], designated="a")
    assert caught.value.message == f"worker 'a' is degraded: {HUNG}"


def test_the_shared_queue_does_not_count_on_a_degraded_cpu_worker() -> None:
    # b and c busy; a degraded (pulls nothing) lacks nothing, yet the shared queue is fine.
    fleet = [degraded("a", "n"), worker("b", "m"), worker("c", "m")]
    decision = choose("m", fleet, estimates=Estimates(queued_ms={"b": [1e3], "c": [1e3]}))
    assert decision.worker_id == "shared"


# -- the reaper


def queued(**fields: Any) -> TaskTrack:
    values: dict[str, Any] = {
        "task_id": "t-1",
        "model": "m",
        "timeout_s": 60.0,
        "attempt": 1,
        "status": "queued",
        "since": NOW - 1,
        "worker": "a",
        "queue": "tasks.cpu.a",
        **fields,
    }
    return TaskTrack(**values)


def snap(tasks: list[TaskTrack], workers: list[WorkerRecord]) -> Snapshot:
    return Snapshot(
        now=NOW,
        tasks={t.task_id: t for t in tasks},
        workers={w.worker_id: w for w in workers},
    )


def test_a_task_queued_on_a_degraded_worker_is_found_at_once_and_moved() -> None:
    workers = [degraded("a"), worker("b")]
    (finding,) = detect(snap([queued()], workers), TH).tasks
    assert (finding.reason, finding.worker) == ("degraded_worker", "a")
    assert finding.detail == f"queued on tasks.cpu.a; worker 'a' is degraded: {HUNG}"
    plan = decide(finding, queued(), workers, now=NOW, ttl_s=3.0, max_attempts=5)
    assert isinstance(plan, Move)
    assert (plan.attempt, plan.decision.worker_id) == (2, "b")


def test_a_degraded_workers_running_task_and_a_healthy_workers_queue_are_left_alone() -> None:
    running = queued(status="running", runner="a")
    busy = degraded("a", state="busy", current_task="t-1")
    assert detect(snap([running], [busy]), TH).tasks == []
    assert detect(snap([queued()], [worker("a")]), TH).tasks == []


def test_a_task_asked_of_a_degraded_worker_by_name_fails_naming_the_reason() -> None:
    task = queued(designated="a")
    workers = [degraded("a"), worker("b")]
    (finding,) = detect(snap([task], workers), TH).tasks
    plan = decide(finding, task, workers, now=NOW, ttl_s=3.0, max_attempts=5)
    assert isinstance(plan, Fail)
    assert plan.code == "worker_unavailable"
    assert HUNG in plan.reason and "reason=degraded_worker" in plan.reason


def test_with_no_healthy_alternative_it_fails_as_a_single_point_of_failure() -> None:
    workers = [degraded("a"), degraded("b")]
    (finding,) = detect(snap([queued()], workers), TH).tasks
    plan = decide(finding, queued(), workers, now=NOW, ttl_s=3.0, max_attempts=5)
    assert isinstance(plan, Fail)
    assert plan.code == "no_alternative_worker"
    assert "reason=degraded_worker" in plan.reason


# -- the doctor


def test_the_doctor_reports_each_workers_own_probe() -> None:
    fine = check_backends([worker("a"), worker("old", health_since=None)], NOW, 3.0)
    assert fine.status == "ok"
    assert fine.detail == (
        "1 healthy by their own probes; old do not probe their backend (older version)"
    )
    bad = check_backends(
        [worker("a"), degraded("b", backend_url="http://b:11434", health_since=NOW - 12)],
        NOW,
        3.0,
    )
    assert bad.status == "problem"
    assert bad.detail == f"b (ollama at http://b:11434): degraded for 12 s: {HUNG}"
    gone = degraded("c", heartbeat_at=NOW - 60)
    assert check_backends([gone], NOW, 3.0).status == "ok"  # stale: not this check's
