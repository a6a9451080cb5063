"""The routing policy, case by case (lesson 1: the tier is decided from who is live)."""

from __future__ import annotations

import pytest

from schemas.workers import Capability, WorkerRecord
from services.fleet.liveness import live
from services.fleet.policy import choose, choose_web
from services.runtime.errors import NoWorker, WorkerUnavailable


def worker(
    worker_id: str, *models: str, gpu: bool = False, heartbeat_at: float = 100.0
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
    )


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
    decision = choose("gemma3:1b", fleet, gpu_models=["qwen3:8b"], depth={"mac": 2})
    assert decision.worker_id == "cpu-a"


def test_among_equals_the_least_loaded_wins_and_ties_go_to_the_smallest_id() -> None:
    fleet = [worker("b", "m", gpu=True), worker("a", "m", gpu=True), worker("c", "m", gpu=True)]
    assert choose("m", fleet).worker_id == "a"
    assert choose("m", fleet, depth={"a": 1}).worker_id == "b"
    assert choose("m", fleet, depth={"a": 1, "b": 1, "c": 1}).worker_id == "a"


def test_a_slower_worker_gets_the_task_when_the_faster_one_is_loaded_enough() -> None:
    fleet = [worker("fast", "m", gpu=True), worker("slow", "m", gpu=True)]
    typical = {"fast": 1_000.0, "slow": 2_500.0}
    assert choose("m", fleet, typical_ms=typical, depth={"fast": 1}).worker_id == "fast"
    assert choose("m", fleet, typical_ms=typical, depth={"fast": 2}).worker_id == "slow"


def test_a_worker_that_fails_often_is_avoided_but_not_banished() -> None:
    fleet = [worker("flaky", "m", gpu=True), worker("steady", "m", gpu=True)]
    rates = {"flaky": 0.5}
    assert choose("m", fleet, failure_rate=rates).worker_id == "steady"
    assert choose("m", fleet, failure_rate={"flaky": 1.0}, depth={"steady": 12}).worker_id == (
        "flaky"
    )


def test_when_every_cpu_worker_is_busy_the_task_goes_to_the_shared_cpu_queue() -> None:
    fleet = [worker("a", "m"), worker("b", "m")]
    decision = choose("m", fleet, depth={"a": 1, "b": 2})
    assert (decision.worker_id, decision.queue) == ("shared", "tasks.cpu.shared")
    assert choose("m", fleet, depth={"a": 1}).worker_id == "b"


def test_the_shared_queue_is_not_used_when_some_cpu_worker_lacks_the_model() -> None:
    fleet = [worker("a", "m"), worker("b", "m"), worker("c", "other")]
    assert choose("m", fleet, depth={"a": 1, "b": 1}).worker_id == "a"


def test_a_lone_busy_cpu_worker_keeps_its_own_queue() -> None:
    assert choose("m", [worker("a", "m")], depth={"a": 3}).queue == "tasks.cpu.a"


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
