"""The routing policy, case by case (lesson 1: the tier is decided from who is live)."""

from __future__ import annotations

import pytest

from schemas.models import ModelFacts
from schemas.workers import Capability, WorkerRecord
from services.errors import NoWorker, WorkerUnavailable
from services.fleet.liveness import live
from services.fleet.policy import (
    EVICTION_WEIGHT,
    PRIOR_COLD_LOAD_MS,
    Estimates,
    Outlook,
    choose,
    choose_web,
    outlook,
)


def worker(
    worker_id: str,
    *models: str,
    gpu: bool = False,
    heartbeat_at: float = 100.0,
    resident: list[str] | None = None,
) -> WorkerRecord:
    supports: list[Capability] = ["gpu_inference"] if gpu else ["cpu_inference"]
    return WorkerRecord(
        worker_id=worker_id,
        host=worker_id,
        instance_id="i",
        pid=1,
        version="t",
        supports=supports,
        models=list(models),
        started_at=0.0,
        heartbeat_at=heartbeat_at,
        resident=resident,
    )


def busy(**tasks: int) -> Estimates:
    """``tasks`` queued per worker, each of the prior typical duration (1 s)."""
    return Estimates(queued_ms={w: [1_000.0] * n for w, n in tasks.items()})


def test_a_model_goes_to_a_gpu_worker_when_one_is_live_with_it() -> None:
    fleet = [worker("cpu-a", "qwen3:8b"), worker("mac", "qwen3:8b", gpu=True)]
    decision = choose("qwen3:8b", fleet)
    assert (decision.worker_id, decision.queue) == ("mac", "tasks.gpu.mac")


def test_the_same_model_falls_back_to_a_cpu_worker_when_no_gpu_worker_has_it() -> None:
    fleet = [worker("cpu-a", "qwen3:8b"), worker("mac", "gemma3:12b", gpu=True)]
    decision = choose("qwen3:8b", fleet)
    assert (decision.worker_id, decision.queue) == ("cpu-a", "tasks.cpu.cpu-a")
    assert "cpu fallback" in decision.reason


def test_models_outside_gpu_models_go_to_the_least_loaded_worker_of_any_tier() -> None:
    fleet = [worker("cpu-a", "gemma3:1b"), worker("mac", "gemma3:1b", gpu=True)]
    decision = choose("gemma3:1b", fleet, gpu_models=["qwen3:8b"], estimates=busy(mac=2))
    assert decision.worker_id == "cpu-a"


def test_among_equals_the_least_loaded_wins_and_ties_go_to_the_smallest_id() -> None:
    fleet = [worker("b", "m", gpu=True), worker("a", "m", gpu=True), worker("c", "m", gpu=True)]
    assert choose("m", fleet).worker_id == "a"
    assert choose("m", fleet, estimates=busy(a=1)).worker_id == "b"
    assert choose("m", fleet, estimates=busy(a=1, b=1, c=1)).worker_id == "a"


def test_a_slower_worker_gets_the_task_when_the_faster_one_is_loaded_enough() -> None:
    fleet = [worker("fast", "m", gpu=True), worker("slow", "m", gpu=True)]
    typical = {"fast": 1_000.0, "slow": 2_500.0}
    once = Estimates(typical_ms=typical, queued_ms={"fast": [1_000.0]})
    twice = Estimates(typical_ms=typical, queued_ms={"fast": [1_000.0, 1_000.0]})
    assert choose("m", fleet, estimates=once).worker_id == "fast"
    assert choose("m", fleet, estimates=twice).worker_id == "slow"


def test_a_worker_that_fails_often_is_avoided_but_not_banished() -> None:
    fleet = [worker("flaky", "m", gpu=True), worker("steady", "m", gpu=True)]
    assert choose("m", fleet, estimates=Estimates(failure_rate={"flaky": 0.5})).worker_id == (
        "steady"
    )
    banished = Estimates(failure_rate={"flaky": 1.0}, queued_ms={"steady": [1_000.0] * 12})
    assert choose("m", fleet, estimates=banished).worker_id == "flaky"


# -- the work queued ahead, in time


def test_the_work_ahead_counts_in_time_not_in_tasks() -> None:
    fleet = [worker("a", "m", gpu=True), worker("b", "m", gpu=True)]
    # a has one long task ahead (a 12b model's 30 s), b three short ones (1 s each).
    ahead = Estimates(queued_ms={"a": [30_000.0], "b": [1_000.0, 1_000.0, 1_000.0]})
    decision = choose("m", fleet, estimates=ahead)
    assert decision.worker_id == "b"
    assert outlook(fleet[0], "m", ahead).completion_ms == 31_000.0
    assert outlook(fleet[1], "m", ahead).completion_ms == 4_000.0


# -- a cold load counted where the model is not in memory


def test_a_worker_without_the_model_in_memory_counts_its_cold_load() -> None:
    warm = worker("b", "m", gpu=True, resident=["m"])
    cold = worker("a", "m", gpu=True, resident=["other"])
    known = Estimates(
        typical_ms={"a": 3_000.0, "b": 3_000.0},
        warm_ms={"a": 1_000.0, "b": 1_000.0},
        cold_load_ms={"a": 4_000.0},
        queued_ms={"b": [2_000.0]},
    )
    assert outlook(cold, "m", known).completion_ms == 5_000.0  # warm run + its cold load
    assert outlook(warm, "m", known).completion_ms == 3_000.0  # its queue + a warm run
    assert choose("m", [cold, warm], estimates=known).worker_id == "b"
    # Without a figure the prior applies, and a short queue beats it too.
    assert outlook(cold, "m", Estimates()).completion_ms == 1_000.0 + PRIOR_COLD_LOAD_MS


def test_the_models_loaded_for_the_tasks_ahead_count_and_may_push_the_model_out() -> None:
    w = worker("a", "m", "big", "small", gpu=True, resident=["m", "small"])
    known = Estimates(
        warm_ms={"a": 1_000.0},
        cold_load_ms={"a": 4_000.0},
        queued_ms={"a": [10_000.0, 10_000.0, 500.0]},
        queued_loads={"a": {"big": 6_000.0, "small": 2_000.0}},
    )
    # Two tasks of big ahead load it once (6 s); small is in memory. With no limit known,
    # m stays in memory.
    assert outlook(w, "m", known).completion_ms == 20_500.0 + 6_000.0 + 1_000.0
    # Room for two models: big's load pushes m out (listed first, and small was used since).
    two = w.__replace__(max_resident=2)
    assert outlook(two, "m", known).completion_ms == 20_500.0 + 6_000.0 + 1_000.0 + 4_000.0
    # Room for three: m stays.
    assert outlook(w.__replace__(max_resident=3), "m", known).completion_ms == 27_500.0
    # Nothing to load ahead: m stays in memory, whatever the room.
    light = Estimates(
        warm_ms={"a": 1_000.0}, queued_ms={"a": [500.0]}, queued_loads={"a": {"small": 2e3}}
    )
    assert outlook(two, "m", light).completion_ms == 1_500.0


# -- what a load pushes out of memory


GB = 1_000_000_000


def test_a_load_that_pushes_models_out_costs_their_reloads() -> None:
    # 12 GB; 7b (5 GB) and 4b (3 GB) in memory; loading 12b (8.5 GB) pushes both out.
    full = worker("pc", "7b", "4b", "12b", gpu=True, resident=["4b", "7b"]).__replace__(
        model_memory={"7b": 5 * GB, "4b": 3 * GB, "12b": 8_500_000_000},
        memory_bytes=12 * GB,
    )
    reloads = {"4b": 2_000.0, "7b": 3_000.0}
    known = Estimates(
        warm_ms={"pc": 2_000.0},
        cold_load_ms={"pc": 5_500.0},
        cold_load_of=lambda model, worker_id: reloads[model],
    )
    seen = outlook(full, "12b", known)
    assert (seen.completion_ms, seen.eviction_ms) == (7_500.0, EVICTION_WEIGHT * 5_000.0)
    assert seen.cost_ms == 7_500.0 + EVICTION_WEIGHT * 5_000.0
    # A model that is in memory pushes nothing out; nor does one that fits beside them.
    assert outlook(full, "7b", known).eviction_ms == 0.0
    roomy = full.__replace__(memory_bytes=17 * GB)
    assert outlook(roomy, "12b", known) == Outlook(7_500.0, 0.0)
    # 14 GB: pushing out the first listed (4b) makes room.
    assert outlook(full.__replace__(memory_bytes=14 * GB), "12b", known).eviction_ms == (
        EVICTION_WEIGHT * 2_000.0
    )


def test_the_models_go_in_the_order_listed_the_running_one_and_those_used_last() -> None:
    # Room for two models; a and b in memory, the worker runs a: b goes first.
    w = worker("w", "a", "b", "c", gpu=True, resident=["a", "b"]).__replace__(
        state="busy", current_model="a", max_resident=2
    )
    reloads = {"a": 1_000.0, "b": 2_000.0}
    known = Estimates(cold_load_of=lambda model, worker_id: reloads[model])
    assert outlook(w, "c", known).eviction_ms == EVICTION_WEIGHT * 2_000.0
    # A task of b ahead uses b after a: now a goes first.
    ahead = Estimates(
        queued_ms={"w": [1_000.0, 1_000.0]},
        queued_loads={"w": {"b": 2_000.0}},
        cold_load_of=lambda model, worker_id: reloads[model],
    )
    assert outlook(w, "c", ahead).eviction_ms == EVICTION_WEIGHT * 1_000.0


def test_a_model_without_a_size_seen_in_memory_takes_its_file_size() -> None:
    w = worker("w", "a", "b", gpu=True, resident=["a"]).__replace__(
        facts=[ModelFacts(name="b", size=4 * GB)], model_memory={"a": 2 * GB}
    )
    known = Estimates()
    assert outlook(w.__replace__(memory_bytes=6 * GB), "b", known).eviction_ms == 0.0
    assert outlook(w.__replace__(memory_bytes=5 * GB), "b", known).eviction_ms == (
        EVICTION_WEIGHT * PRIOR_COLD_LOAD_MS  # a pushed out, with no figure: the prior
    )


def test_a_worker_that_knows_no_limit_counts_no_eviction() -> None:
    w = worker("w", "a", "b", gpu=True, resident=["a"]).__replace__(model_memory={"a": 9 * GB})
    assert outlook(w, "b", Estimates()) == Outlook(1_000.0 + PRIOR_COLD_LOAD_MS, 0.0)


def test_a_completion_past_the_bound_leaves_the_eviction_out() -> None:
    w = worker("w", "a", "b", gpu=True, resident=["a"]).__replace__(max_resident=1)
    completion = 1_000.0 + PRIOR_COLD_LOAD_MS
    assert outlook(w, "b", Estimates(), bound_ms=completion).eviction_ms > 0.0
    assert outlook(w, "b", Estimates(), bound_ms=completion - 1) == Outlook(completion, 0.0)


def test_routing_keeps_a_model_where_it_is_rather_than_push_out_another() -> None:
    # The pc (smallest id: it wins ties) would finish as soon, by pushing out its 7b.
    mac = worker("mac", "7b", "12b", gpu=True, resident=["12b"]).__replace__(max_resident=3)
    pc = worker("a-pc", "7b", "12b", gpu=True, resident=["7b"]).__replace__(max_resident=1)
    known = Estimates(
        queued_ms={"mac": [3_000.0]},
        warm_ms={"mac": 4_000.0, "a-pc": 2_000.0},
        cold_load_ms={"mac": 7_000.0, "a-pc": 5_000.0},
        cold_load_of=lambda model, worker_id: 3_000.0,
    )
    # mac: 3 s ahead + 4 s = 7 s; pc: 5 s load + 2 s = 7 s, and 7b's reload on top.
    assert outlook(pc, "12b", known).completion_ms == outlook(mac, "12b", known).completion_ms
    assert choose("12b", [mac, pc], estimates=known).worker_id == "mac"
    # With room for both models on the pc, the tie goes to the smallest id.
    roomy = pc.__replace__(max_resident=2)
    assert choose("12b", [mac, roomy], estimates=known).worker_id == "a-pc"


def test_a_task_of_the_same_model_ahead_loads_it_for_this_one() -> None:
    w = worker("a", "m", gpu=True, resident=[])
    known = Estimates(
        warm_ms={"a": 1_000.0},
        cold_load_ms={"a": 4_000.0},
        queued_ms={"a": [1_000.0]},
        queued_loads={"a": {"m": 4_000.0}},
    )
    assert outlook(w, "m", known).completion_ms == 1_000.0 + 4_000.0 + 1_000.0


def test_the_model_a_worker_is_running_counts_as_in_memory() -> None:
    # Its heartbeat says what it runs: loaded, though its last /api/ps predates it.
    w = worker("a", "m", gpu=True, resident=[]).__replace__(state="busy", current_model="m")
    known = Estimates(
        warm_ms={"a": 1_000.0},
        cold_load_ms={"a": 4_000.0},
        queued_ms={"a": [1_000.0]},
        queued_loads={"a": {"m": 4_000.0}},
    )
    assert outlook(w, "m", known).completion_ms == 2_000.0


def test_a_worker_that_does_not_say_what_is_in_memory_counts_no_cold_load() -> None:
    silent = worker("a", "m", gpu=True)  # resident None: an OpenAI-compatible backend
    known = Estimates(typical_ms={"a": 3_000.0}, warm_ms={"a": 1_000.0}, cold_load_ms={"a": 9e3})
    assert outlook(silent, "m", known).completion_ms == 3_000.0  # its typical: loads included


# -- the GPU preference factor


def test_a_gpu_preferred_model_stays_on_the_gpu_while_it_finishes_within_the_factor() -> None:
    fleet = [worker("cpu-a", "m"), worker("mac", "m", gpu=True)]
    # The GPU worker finishes in 4 s (three tasks ahead), the idle CPU one in 2 s.
    loaded = Estimates(
        typical_ms={"cpu-a": 2_000.0, "mac": 1_000.0}, queued_ms={"mac": [1_000.0] * 3}
    )
    decision = choose("m", fleet, estimates=loaded, gpu_preference=2.0)
    assert (decision.worker_id, decision.reason) == ("mac", "gpu worker live with the model")


def test_a_gpu_preferred_model_goes_to_a_cpu_worker_past_the_factor() -> None:
    fleet = [worker("cpu-a", "m"), worker("mac", "m", gpu=True)]
    # The GPU worker finishes in 5 s (four tasks ahead): over twice the CPU worker's 2 s.
    loaded = Estimates(
        typical_ms={"cpu-a": 2_000.0, "mac": 1_000.0}, queued_ms={"mac": [1_000.0] * 4}
    )
    decision = choose("m", fleet, estimates=loaded, gpu_preference=2.0)
    assert (decision.worker_id, decision.queue) == ("cpu-a", "tasks.cpu.cpu-a")
    assert decision.reason == (
        "gpu workers busy: the best would cost 5000 ms, over 2x the best cpu worker's 2000 ms"
    )
    # A larger factor keeps it on the GPU; an infinite one always does (the old rule).
    assert choose("m", fleet, estimates=loaded, gpu_preference=3.0).worker_id == "mac"
    assert choose("m", fleet, estimates=loaded, gpu_preference=float("inf")).worker_id == "mac"


def test_the_factor_compares_the_best_of_each_tier() -> None:
    fleet = [
        worker("cpu-a", "m"),
        worker("cpu-b", "m"),
        worker("mac", "m", gpu=True),
        worker("pc", "m", gpu=True),
    ]
    # Best GPU: pc, 3 s; best CPU: cpu-b, 1 s; 3 s is over 2 × 1 s.
    loaded = Estimates(
        typical_ms={"cpu-a": 5_000.0, "cpu-b": 1_000.0, "mac": 1_000.0, "pc": 1_000.0},
        queued_ms={"mac": [4_000.0], "pc": [2_000.0]},
    )
    assert choose("m", fleet, estimates=loaded).worker_id == "cpu-b"
    assert choose("m", fleet, estimates=loaded, gpu_preference=3.0).worker_id == "pc"


def test_models_outside_gpu_models_take_no_factor() -> None:
    fleet = [worker("cpu-a", "m"), worker("mac", "m", gpu=True)]
    loaded = Estimates(typical_ms={"cpu-a": 1_500.0, "mac": 1_000.0})
    assert choose("m", fleet, gpu_models=["other"], estimates=loaded).worker_id == "mac"
    assert choose("m", fleet, estimates=loaded).worker_id == "mac"


# -- the shared CPU queue


def test_when_every_cpu_worker_is_busy_the_task_goes_to_the_shared_cpu_queue() -> None:
    fleet = [worker("a", "m"), worker("b", "m")]
    decision = choose("m", fleet, estimates=busy(a=1, b=2))
    assert (decision.worker_id, decision.queue) == ("shared", "tasks.cpu.shared")
    assert choose("m", fleet, estimates=busy(a=1)).worker_id == "b"


def test_a_gpu_preferred_task_sent_to_busy_cpu_workers_goes_to_the_shared_queue() -> None:
    fleet = [worker("a", "m"), worker("b", "m"), worker("mac", "m", gpu=True)]
    decision = choose("m", fleet, estimates=busy(a=1, b=1, mac=9))
    assert decision.queue == "tasks.cpu.shared"


def test_the_shared_queue_is_not_used_when_some_cpu_worker_lacks_the_model() -> None:
    fleet = [worker("a", "m"), worker("b", "m"), worker("c", "other")]
    assert choose("m", fleet, estimates=busy(a=1, b=1)).worker_id == "a"


def test_the_shared_queues_tasks_count_as_work_ahead_of_every_cpu_worker() -> None:
    fleet = [worker("cpu-a", "m"), worker("cpu-b", "other"), worker("mac", "m", gpu=True)]
    # The GPU worker finishes in 4 s, the idle CPU one in 1 s: over twice as late.
    idle = Estimates(queued_ms={"mac": [1_000.0] * 3})
    assert choose("m", fleet, estimates=idle).worker_id == "cpu-a"
    # 10 s on the shared queue, shared by the two CPU workers: cpu-a's share makes it 6 s.
    backlog = Estimates(queued_ms={"mac": [1_000.0] * 3, "shared": [5_000.0, 5_000.0]})
    assert outlook(fleet[0], "m", backlog, shared_ms=5_000.0).completion_ms == 6_000.0
    assert choose("m", fleet, estimates=backlog).worker_id == "mac"


def test_a_lone_busy_cpu_worker_keeps_its_own_queue() -> None:
    assert choose("m", [worker("a", "m")], estimates=busy(a=3)).queue == "tasks.cpu.a"


def test_no_live_worker_with_the_model_is_an_error_naming_the_model() -> None:
    with pytest.raises(NoWorker, match=r"'llama3:70b'.*models they serve: gemma3:1b"):
        choose("llama3:70b", [worker("cpu-a", "gemma3:1b")])


def test_an_empty_fleet_says_so() -> None:
    with pytest.raises(NoWorker, match="no worker is registered"):
        choose("gemma3:1b", [])


def test_a_designated_worker_is_honoured_even_when_another_is_preferred() -> None:
    fleet = [worker("cpu-a", "qwen3:8b"), worker("mac", "qwen3:8b", gpu=True)]
    assert choose("qwen3:8b", fleet, designated="cpu-a").queue == "tasks.cpu.cpu-a"


def test_a_designated_worker_that_is_not_live_is_an_error_not_a_reroute() -> None:
    with pytest.raises(WorkerUnavailable, match="'mac' is not live"):
        choose("qwen3:8b", [worker("cpu-a", "qwen3:8b")], designated="mac")


def test_a_designated_worker_without_the_model_is_an_error_listing_what_it_serves() -> None:
    with pytest.raises(WorkerUnavailable, match=r"does not serve model 'qwen3:8b'.*gemma3:1b"):
        choose("qwen3:8b", [worker("cpu-a", "gemma3:1b")], designated="cpu-a")


def test_workers_with_a_stale_heartbeat_are_not_live() -> None:
    fresh, stale = worker("a", heartbeat_at=95.0), worker("b", heartbeat_at=80.0)
    assert live([fresh, stale], now=100.0, ttl_s=15.0) == [fresh]


def test_web_search_goes_to_the_shared_web_queue_while_a_web_worker_is_live() -> None:
    web = worker("searcher", "gemma3:1b").__replace__(supports=["web_search"])
    decision = choose_web([worker("cpu-a", "gemma3:1b"), web])
    assert (decision.worker_id, decision.queue) == ("web", "tasks.web")


def test_web_search_without_a_live_web_worker_is_an_error() -> None:
    with pytest.raises(NoWorker, match="no live web-search worker"):
        choose_web([worker("cpu-a", "gemma3:1b")])


def test_a_web_only_worker_never_gets_inference_tasks() -> None:
    web = worker("searcher", "gemma3:1b").__replace__(supports=["web_search"])
    with pytest.raises(NoWorker):
        choose("gemma3:1b", [web])
    with pytest.raises(WorkerUnavailable):
        choose("gemma3:1b", [web], designated="searcher")
