"""The fleet as model listings: /api/tags, /api/ps, /api/show, /v1/models from the workers and
the facts their backends reported."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas.models import ModelDetails, ModelFacts
from schemas.queries import WorkerView
from services.gateway import fleet
from services.gateway.common import ApiError

LLAMA = ModelDetails(format="gguf", family="llama", families=["llama"], parameter_size="1B")


def decode(data: bytes) -> Any:
    return msgspec.json.decode(data)


def worker(worker_id: str, models: list[str], **fields: Any) -> WorkerView:
    defaults: dict[str, Any] = {"host": "h", "tier": "cpu", "state": "idle", "last_heartbeat": 1e9}
    return WorkerView(worker_id=worker_id, models=models, **{**defaults, **fields})


def facts(name: str, digest: str, *capabilities: str, **fields: Any) -> ModelFacts:
    return ModelFacts(
        name=name, digest=digest, capabilities=list(capabilities or ("completion",)), **fields
    )


def test_tags_and_models_are_the_union_of_live_inference_workers() -> None:
    workers = [
        worker("a", ["m1", "m2"]),
        worker("b", ["m2", "m3"], tier="gpu"),
        worker("web-1", ["summary"], tier="web"),
    ]
    tags = decode(fleet.ollama_tags(workers))["models"]
    assert [t["name"] for t in tags] == ["m1", "m2", "m3"]
    assert tags[1]["workers"] == ["a", "b"]
    # Workers without facts: what the fleet knew before facts.
    assert (tags[0]["digest"], tags[0]["size"], tags[0]["capabilities"]) == ("", 0, ["completion"])
    models = decode(fleet.openai_models(workers))["data"]
    assert [m["id"] for m in models] == ["m1", "m2", "m3"]
    assert models[0] == {
        "id": "m1",
        "object": "model",
        "created": 1_000_000_000,
        "owned_by": "library",
    }


def test_facts_merge_across_workers() -> None:
    modified = "2025-06-01T12:00:00Z"
    workers = [
        # c and a share a copy; b has another, with vision: the union has it.
        worker("c", ["m"], facts=[facts("m", "d1", "completion", "tools", size=7, details=LLAMA)]),
        worker("b", ["m"], facts=[facts("m", "d2", "completion", "vision", size=9)]),
        worker(
            "a",
            ["m"],
            facts=[
                facts(
                    "m",
                    "d1",
                    "tools",
                    "completion",
                    size=7,
                    details=LLAMA,
                    context_length=4096,
                    modified_at=modified,
                )
            ],
        ),
    ]
    (tag,) = decode(fleet.ollama_tags(workers))["models"]
    assert (tag["digest"], tag["size"], tag["modified_at"]) == ("d1", 7, modified)
    assert tag["details"]["family"] == "llama"
    assert tag["capabilities"] == ["completion", "tools", "vision"]  # Ollama's order
    assert tag["workers"] == ["a", "b", "c"]
    assert decode(fleet.openai_models(workers))["data"][0]["created"] == 1748779200

    shown = decode(fleet.ollama_show("m", fleet.serving("m", workers)))
    assert shown["capabilities"] == ["completion", "tools", "vision"]
    assert shown["model_info"] == {"general.architecture": "llama", "llama.context_length": 4096}
    assert shown["details"]["parameter_size"] == "1B"


def test_a_tie_goes_to_the_copy_of_the_first_worker() -> None:
    workers = [
        worker("b", ["m"], facts=[facts("m", "db")]),
        worker("a", ["m"], facts=[facts("m", "da")]),
    ]
    assert decode(fleet.ollama_tags(workers))["models"][0]["digest"] == "da"


def test_digests_of_distinct_models_stay_distinct() -> None:
    workers = [worker("a", ["m1", "m2"], facts=[facts("m1", "d1"), facts("m2", "d2")])]
    assert [t["digest"] for t in decode(fleet.ollama_tags(workers))["models"]] == ["d1", "d2"]


def test_ps_lists_what_busy_workers_run() -> None:
    workers = [
        worker(
            "a",
            ["m1"],
            state="busy",
            current_task="t",
            current_model="m1",
            facts=[facts("m1", "d1", size=5, context_length=2048)],
        ),
        worker("b", ["m1", "m2"], state="busy", current_task="u", current_model="m1"),
        worker("c", ["m2"]),
    ]
    running = decode(fleet.ollama_ps(workers))["models"]
    assert [(m["name"], m["workers"]) for m in running] == [("m1", ["a", "b"])]
    assert (running[0]["digest"], running[0]["size"], running[0]["context_length"]) == (
        "d1",
        5,
        2048,
    )
    assert running[0]["expires_at"].endswith("Z")


def test_show_of_a_model_without_facts() -> None:
    shown = decode(
        fleet.ollama_show("m1", fleet.serving("m1", [worker("a", ["m1"]), worker("b", ["m1"])]))
    )
    assert shown["details"] == {
        "parent_model": "",
        "format": "",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }
    assert shown["capabilities"] == ["completion"]
    assert shown["model_info"] == {"general.architecture": ""}
    assert (shown["template"], shown["parameters"]) == ("", "")
    assert shown["modelfile"].endswith("FROM m1\n") and "a, b" in shown["modelfile"]
    assert shown["modified_at"].endswith("Z")
    assert shown["workers"] == ["a", "b"]


@pytest.mark.parametrize(
    ("asked", "served", "aliases", "expected"),
    [
        ("nomic-embed-text", ["nomic-embed-text:latest"], {}, "nomic-embed-text:latest"),
        ("qwen:latest", ["qwen"], {}, "qwen"),  # a server that lists bare names
        ("house", ["m:1b"], {"house:latest": "m:1b"}, "m:1b"),
        ("house:1b", ["m:1b"], {"house:1b": "m:1b"}, "m:1b"),
        ("nope", ["m:1b"], {}, "nope"),
    ],
)
def test_names_resolve_as_the_router_resolves_them(
    asked: str, served: list[str], aliases: dict[str, str], expected: str
) -> None:
    assert fleet.resolve(asked, dict.fromkeys(served), aliases) == expected


def test_the_model_served_or_why_none_is() -> None:
    workers = [
        worker("a", ["m1:latest"]),
        worker("b", ["m1:latest", "m2"]),
        worker("web-1", ["s"], tier="web"),
    ]
    assert fleet.serving("m1", workers).worker_ids == ["a", "b"]

    with pytest.raises(ApiError) as unknown:
        fleet.serving("nope", workers)
    assert (unknown.value.status, unknown.value.message) == (404, "model 'nope' not found")
    with pytest.raises(ApiError) as web_only:
        fleet.serving("s", workers)  # web-search workers take no inference tasks
    assert web_only.value.status == 404
    with pytest.raises(ApiError) as empty:
        fleet.serving("m1", [worker("web-1", ["s"], tier="web")])
    assert (empty.value.status, empty.value.code) == (503, "no_worker")


def test_one_openai_model_by_id() -> None:
    workers = [worker("a", ["hf.co/org/m:q4"])]
    assert decode(fleet.openai_model("hf.co/org/m:q4", workers, {}))["owned_by"] == "org"
    with pytest.raises(ApiError) as missing:
        fleet.openai_model("nope", workers, {})
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")


def test_a_model_missing_while_the_routers_view_settles_is_a_retryable_503_not_a_404() -> None:
    workers = [worker("a", ["m1:latest"])]
    assert fleet.serving("m1", workers, settling=True).worker_ids == ["a"]
    for missing in ([], workers):
        with pytest.raises(ApiError) as settling:
            fleet.serving("m2", missing, settling=True)
        assert (settling.value.status, settling.value.code) == (503, "unavailable")
        assert "reading the worker registry again" in settling.value.message
    with pytest.raises(ApiError) as by_id:
        fleet.openai_model("m2", workers, {}, settling=True)
    assert (by_id.value.status, by_id.value.code) == (503, "unavailable")
