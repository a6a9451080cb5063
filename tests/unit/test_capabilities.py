"""Model capabilities and names: what a request needs, who may take it, how names resolve."""

from __future__ import annotations

import pytest

from schemas.events import TaskSubmitted
from schemas.models import (
    ModelFacts,
    can_serve,
    does_not_support,
    facts_in,
    has_tag,
    lacks,
    name_variants,
    needed_capabilities,
    needs_of,
    resolve_name,
)
from schemas.route import ChatMessage, RouteRequest
from schemas.workers import Capability, WorkerRecord
from services.errors import UnsupportedCapability, WorkerUnavailable
from services.fleet.policy import Estimates, choose, choose_sleeper


def worker(
    worker_id: str,
    model: str,
    *capabilities: str,
    gpu: bool = False,
    mac: str | None = None,
) -> WorkerRecord:
    supports: list[Capability] = ["gpu_inference"] if gpu else ["cpu_inference"]
    facts = [ModelFacts(name=model, capabilities=list(capabilities))] if capabilities else []
    return WorkerRecord(
        worker_id=worker_id,
        host=worker_id,
        instance_id="i",
        pid=1,
        version="t",
        supports=supports,
        models=[model],
        started_at=0.0,
        heartbeat_at=100.0,
        facts=facts,
        wol_mac=mac,
    )


@pytest.mark.parametrize(
    ("name", "variants"),
    [
        ("nomic-embed-text", ("nomic-embed-text", "nomic-embed-text:latest")),
        ("nomic-embed-text:latest", ("nomic-embed-text:latest", "nomic-embed-text")),
        ("qwen3:8b", ("qwen3:8b",)),
        (
            "hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M",
            ("hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M",),
        ),
        (
            "localhost:5000/library/llama3",
            ("localhost:5000/library/llama3", "localhost:5000/library/llama3:latest"),
        ),
    ],
)
def test_a_bare_name_means_latest_as_ollama_resolves_it(
    name: str, variants: tuple[str, ...]
) -> None:
    assert name_variants(name) == variants
    assert has_tag(name) == (len(variants) == 1 or name.endswith(":latest"))


def test_resolution_takes_the_first_variant_that_is_served() -> None:
    served = {"nomic-embed-text:latest", "smollm2"}
    assert resolve_name("nomic-embed-text", served.__contains__) == "nomic-embed-text:latest"
    assert resolve_name("smollm2:latest", served.__contains__) == "smollm2"
    assert resolve_name("unknown", served.__contains__) == "unknown"
    # Through aliases, both ways: an alias to a bare name that is served as :latest.
    aliases = {"embedder": "nomic-embed-text", "old:latest": "smollm2:latest"}

    def canonical(name: str) -> str:
        return aliases.get(name, name)

    assert resolve_name("embedder:latest", served.__contains__, canonical) == (
        "nomic-embed-text:latest"
    )
    assert resolve_name("old", served.__contains__, canonical) == "smollm2"
    assert resolve_name("gone", served.__contains__, canonical) == "gone"


def test_what_a_request_needs() -> None:
    assert needed_capabilities(task_type="inference") == ("completion",)
    assert needed_capabilities(task_type="embedding", tools=True) == ("embedding",)
    assert needed_capabilities(
        task_type="inference", tools=True, images=True, think="high", suffix=True
    ) == ("completion", "tools", "insert", "vision", "thinking")
    # think false or unset is the model's default, which every model can give.
    assert needed_capabilities(task_type="inference", think=False) == ("completion",)


def test_needs_are_read_from_requests_and_their_events_alike() -> None:
    picture = ChatMessage(role="user", content="what is this?", images=["aGk="])
    request = RouteRequest(prompt="p", model="m", messages=[picture], tools=[{"function": {}}])
    assert needs_of(request) == ("completion", "tools", "vision")
    submitted = TaskSubmitted(at=0, task_id="t", model="m", timeout_s=1, work=request.work)
    assert needs_of(submitted.work) == needs_of(request)


def test_refusals_use_ollamas_words() -> None:
    assert does_not_support("qwen2.5:0.5b", ["tools"]) == "qwen2.5:0.5b does not support tools"
    assert does_not_support("gemma3:1b", ["thinking"]) == '"gemma3:1b" does not support thinking'
    assert does_not_support("m", ["tools", "vision"]) == "m does not support tools\nvision"


def test_a_worker_without_facts_is_taken_to_generate_only() -> None:
    assert facts_in([], "m").capabilities == ["completion"]
    old = worker("old", "m")
    assert old.facts_of("m").capabilities == ["completion"]


def test_a_copy_lacks_what_its_facts_do_not_list_and_serves_only_its_models() -> None:
    copy = worker("cpu", "qwen3:8b", "completion", "tools")
    assert lacks(copy, "qwen3:8b", ("completion", "vision", "tools")) == ["vision"]
    assert can_serve(copy, "qwen3:8b", ("completion", "tools"))
    assert not can_serve(copy, "qwen3:8b", ("completion", "vision"))
    assert not can_serve(copy, "llama3.2:1b", ("completion",))  # not among its models


def test_a_tools_request_goes_only_to_a_copy_with_tools() -> None:
    fleet = [
        worker("gpu", "qwen3:8b", "completion", gpu=True),
        worker("cpu", "qwen3:8b", "completion", "tools"),
    ]
    assert choose("qwen3:8b", fleet).worker_id == "gpu"
    assert choose("qwen3:8b", fleet, needs=("completion", "tools")).worker_id == "cpu"


def test_a_need_no_live_copy_has_is_refused_naming_the_model_and_the_capability() -> None:
    fleet = [worker("a", "gemma3:1b", "completion"), worker("b", "gemma3:1b", "completion")]
    with pytest.raises(UnsupportedCapability, match="gemma3:1b does not support vision"):
        choose("gemma3:1b", fleet, needs=("completion", "vision"))
    embedder = [worker("e", "nomic-embed-text:latest", "embedding")]
    with pytest.raises(UnsupportedCapability, match="does not support completion"):
        choose("nomic-embed-text:latest", embedder)
    assert choose("nomic-embed-text:latest", embedder, needs=("embedding",)).worker_id == "e"


def test_a_designated_worker_without_the_capability_is_an_error_naming_it() -> None:
    fleet = [worker("a", "m", "completion"), worker("b", "m", "completion", "tools")]
    with pytest.raises(WorkerUnavailable, match="worker 'a': m does not support tools"):
        choose("m", fleet, designated="a", needs=("completion", "tools"))


def test_the_shared_queue_is_used_only_when_every_cpu_worker_can_take_the_task() -> None:
    fleet = [worker("a", "m", "completion", "tools"), worker("b", "m", "completion", "tools")]
    busy = Estimates(queued_ms={"a": [1_000.0], "b": [1_000.0]})
    needs = ("completion", "tools")
    assert choose("m", fleet, estimates=busy, needs=needs).queue == "tasks.cpu.shared"
    mixed = [*fleet, worker("c", "m", "completion")]
    busy = Estimates(queued_ms={"a": [1_000.0], "b": [1_000.0], "c": [1_000.0]})
    decision = choose("m", mixed, estimates=busy, needs=needs)
    assert decision.queue in ("tasks.cpu.a", "tasks.cpu.b")


def test_a_sleeper_is_woken_only_for_what_its_model_can_do() -> None:
    sleepers = [worker("pc", "llava:7b", "completion", "vision", gpu=True, mac="aa:bb:cc:dd:ee:ff")]
    assert choose_sleeper("llava:7b", sleepers, needs=("completion", "vision")) is not None
    assert choose_sleeper("llava:7b", sleepers, needs=("completion", "tools")) is None
