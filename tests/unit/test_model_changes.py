"""A change to one machine's models, the pure parts: the Modelfile read as ``ollama create
-f`` reads it, the route request checked, the machine it goes to, Ollama's requests and
progress lines, what the CLI aims at and prints, who may ask, and that its time counts in no
figure."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import Durations, TaskCompleted, TaskSubmitted
from schemas.models import ModelFacts
from schemas.queries import WorkerView
from schemas.route import ModelProgress
from schemas.work import ChatMessage, ModelChange, Work
from schemas.workers import WorkerRecord
from services.backends.ollama_models import change_request, progress_line, succeeded
from services.backends.openai import OpenAIBackend
from services.cli.model_changes import machines_for, progress_text
from services.cli.modelfile import parse_modelfile
from services.errors import BackendError, BadRequest, WorkerUnavailable
from services.fleet.identity import may_change_models
from services.fleet.model_matrix import known_size
from services.gateway import model_change_api as gateway_changes
from services.gateway.common import ApiError
from services.router.decide import decide
from services.router.requests import parse_route_request
from services.router.view import FleetView
from services.stats.projection import evolve, outcome_of

# --------------------------------------------------------------------------- the Modelfile


def test_a_modelfile_becomes_the_fields_of_ollamas_create() -> None:
    change = parse_modelfile(
        "# the Japanese assistant\n"
        "FROM hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M\n"
        'SYSTEM """あなたは誠実な日本語のアシスタントです。\n必ず日本語で答えてください。"""\n'
        "parameter temperature 0.6\n"
        "PARAMETER num_ctx 8192\n"
        'PARAMETER stop "<|eot_id|>"\n'
        "PARAMETER stop <|end|>\n"
        "MESSAGE user こんにちは\n"
        'MESSAGE assistant "こんにちは！"\n'
        "TEMPLATE {{ .Prompt }}\n"
        "LICENSE MIT\n"
    )

    assert change == ModelChange(
        op="create",
        source="hf.co/elyza/Llama-3-ELYZA-JP-8B-GGUF:Q4_K_M",
        system="あなたは誠実な日本語のアシスタントです。\n必ず日本語で答えてください。",
        template="{{ .Prompt }}",
        parameters={"temperature": 0.6, "num_ctx": 8192, "stop": ["<|eot_id|>", "<|end|>"]},
        messages=[
            ChatMessage(role="user", content="こんにちは"),
            ChatMessage(role="assistant", content="こんにちは！"),
        ],
        license=["MIT"],
    )


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("SYSTEM hi\n", "has no FROM"),
        ("FROM ./model.gguf\n", "is a file"),
        ("FROM qwen3:8b\nADAPTER ./lora.gguf\n", "line 2: ADAPTER"),
        ("FROM qwen3:8b\nQUANTIZE q4\n", "line 2: unknown instruction QUANTIZE"),
        ('FROM qwen3:8b\nSYSTEM """never closed\n', 'line 2: unterminated """'),
        ("FROM qwen3:8b\nPARAMETER temperature\n", "PARAMETER needs a name and a value"),
        ("FROM qwen3:8b\nMESSAGE narrator hello\n", "MESSAGE role must be one of"),
        ("FROM qwen3:8b\n= nonsense\n", "line 2: expected an instruction"),
    ],
)
def test_a_modelfile_it_cannot_carry_out_is_refused_naming_the_line(text: str, said: str) -> None:
    with pytest.raises(BadRequest, match=said):
        parse_modelfile(text)


# --------------------------------------------------------------------------- the request


def change_request_body(**overrides: object) -> bytes:
    body = {
        "prompt": "",
        "model": "qwen3:8b",
        "task_type": "model_change",
        "worker": "moon",
        "change": {"op": "pull"},
        **overrides,
    }
    return msgspec.json.encode(body)


def test_a_change_request_names_what_it_is_for_statistics_when_its_prompt_is_empty() -> None:
    request = parse_route_request(change_request_body(), max_prompt_chars=1000)
    assert request.prompt == "pull qwen3:8b"
    copied = parse_route_request(
        change_request_body(change={"op": "copy", "source": "qwen3"}), max_prompt_chars=1000
    )
    assert copied.prompt == "copy qwen3:8b from qwen3"


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        ({"worker": None}, "names the machine"),
        ({"change": None}, "task_type 'model_change' with its change"),
        ({"task_type": "inference", "prompt": "hi"}, "task_type 'model_change'"),
        ({"change": {"op": "copy"}}, "change.source"),
        ({"change": {"op": "create"}}, "change.source: FROM"),
        ({"change": {"op": "pull", "size": -1}}, "size must not be negative"),
        ({"change": {"op": "burn"}}, "op"),
        ({"change": {"op": "pull", "files": {}}}, "files"),
    ],
)
def test_a_change_request_missing_what_it_needs_is_refused(
    overrides: dict[str, object], said: str
) -> None:
    with pytest.raises(BadRequest, match=said):
        parse_route_request(change_request_body(**overrides), max_prompt_chars=1000)


def record(worker_id: str, *models: str) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        host=worker_id,
        instance_id="i",
        pid=1,
        version="t",
        supports=["gpu_inference"],
        models=list(models),
        started_at=0.0,
        heartbeat_at=100.0,
    )


def test_a_change_goes_to_its_machine_whatever_it_serves_and_a_sleeping_one_is_woken() -> None:
    request = parse_route_request(change_request_body(), max_prompt_chars=1000)
    live = [record("moon", "gemma3:4b"), record("sun", "qwen3:8b")]

    plan = decide(request, live, [], FleetView(), gpu_models=())
    assert (plan.decision.worker_id, plan.decision.queue, plan.waking) == (
        "moon",
        "tasks.gpu.moon",
        None,
    )
    asleep = record("moon")
    woken = decide(request, live[1:], [asleep], FleetView(), gpu_models=())
    assert woken.waking == asleep and woken.decision.worker_id == "moon"
    with pytest.raises(WorkerUnavailable, match="'moon' is not registered"):
        decide(request, live[1:], [], FleetView(), gpu_models=())
    web = msgspec.structs.replace(record("moon"), supports=["web_search"])
    with pytest.raises(WorkerUnavailable, match="runs no models to change"):
        decide(request, [web], [], FleetView(), gpu_models=())


async def test_an_openai_compatible_server_says_it_cannot_change_its_models() -> None:
    backend = OpenAIBackend("http://127.0.0.1:9/v1")
    try:
        with pytest.raises(BackendError, match="has no API to change its models"):
            await backend.change_model(
                "qwen3:8b", ModelChange(op="pull"), timeout_s=1.0, on_progress=_ignored
            )
    finally:
        await backend.aclose()


async def _ignored(step: ModelProgress) -> None:
    del step


def test_only_the_operator_may_change_models_where_identities_prove_who_asks() -> None:
    assert may_change_models("operator-ann") and may_change_models("admin")
    assert may_change_models(None)  # a bus without identities: nothing proves who asks
    assert not may_change_models("client-bob")
    assert may_change_models("gateway")  # it passes on its operator keys' only
    assert not may_change_models("worker-moon")


# --------------------------------------------------------------------------- Ollama's API


def test_each_change_is_ollamas_own_request() -> None:
    pull = change_request("qwen3:8b", ModelChange(op="pull", insecure=True))
    assert (pull.method, pull.path, pull.streams) == ("POST", "/api/pull", True)
    assert pull.body == {"model": "qwen3:8b", "stream": True, "insecure": True}
    made = change_request(
        "jp", ModelChange(op="create", source="qwen3:8b", system="日本語で", parameters={"a": 1})
    )
    assert made.path == "/api/create"
    assert made.body == {
        "model": "jp",
        "stream": True,
        "from": "qwen3:8b",
        "system": "日本語で",
        "parameters": {"a": 1},
    }
    copy = change_request("jp2", ModelChange(op="copy", source="jp"))
    assert (copy.path, copy.body, copy.streams) == (
        "/api/copy",
        {"source": "jp", "destination": "jp2"},
        False,
    )
    gone = change_request("jp2", ModelChange(op="delete"))
    assert (gone.method, gone.path, gone.body) == ("DELETE", "/api/delete", {"model": "jp2"})


def test_progress_lines_are_read_and_an_error_line_is_the_changes_failure() -> None:
    step = progress_line(
        b'{"status":"pulling 3f2a","digest":"sha256:3f2a","total":10,"completed":4}'
    )
    assert step == ModelProgress(status="pulling 3f2a", digest="sha256:3f2a", total=10, completed=4)
    assert succeeded(progress_line(b'{"status":"success"}'))
    assert not succeeded(step)
    with pytest.raises(BackendError, match="file does not exist"):
        progress_line(b'{"error":"pull model manifest: file does not exist"}')
    with pytest.raises(BackendError, match="malformed progress line"):
        progress_line(b"<html>")


# --------------------------------------------------------------------------- the CLI


def view(worker_id: str, *models: str, size: int = 0, tier: str = "gpu") -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        host=worker_id,
        tier=tier,
        models=list(models),
        state="idle",
        last_heartbeat=0.0,
        facts=[ModelFacts(name=m, size=size) for m in models],
    )


def test_all_means_the_machines_the_change_makes_sense_on() -> None:
    fleet = [
        view("moon", "qwen3:8b", "jp:latest"),
        view("sun", "gemma3:4b"),
        view("web-1", tier="web"),
    ]
    pull, delete = ModelChange(op="pull"), ModelChange(op="delete")
    assert machines_for(pull, "qwen3:8b", fleet, None) == ["sun"]
    assert machines_for(delete, "jp", fleet, None) == ["moon"]  # jp is jp:latest
    copy = ModelChange(op="copy", source="gemma3:4b")
    assert machines_for(copy, "g", fleet, None) == ["sun"]
    assert machines_for(pull, "qwen3:8b", fleet, ["moon", "moon", "sun"]) == ["moon", "sun"]
    # Named: a sleeping machine is not among the live ones; the router wakes it.
    assert machines_for(pull, "qwen3:8b", fleet, ["pc"]) == ["pc"]
    with pytest.raises(BadRequest, match="no registered machine to delete nothing:1b"):
        machines_for(delete, "nothing:1b", fleet, None)


def test_a_pulls_size_is_its_size_where_the_fleet_has_it() -> None:
    fleet = [view("moon", "qwen3:8b", size=5_200_000_000), view("sun", "gemma3:4b")]
    assert known_size("qwen3:8b", fleet) == 5_200_000_000
    assert known_size("llama3.2:1b", fleet) is None


def test_a_step_prints_its_share_and_bytes() -> None:
    step = ModelProgress(status="pulling 3f2a", total=2_500_000_000, completed=1_000_000_000)
    assert progress_text(step) == "pulling 3f2a: 40% (1.0 of 2.5 GB)"
    assert progress_text(ModelProgress(status="writing manifest")) == "writing manifest"


# --------------------------------------------------------------------------- statistics


def test_a_changes_time_counts_in_no_figure() -> None:
    submitted = TaskSubmitted(
        at=1.0,
        task_id="t",
        model="qwen3:8b",
        timeout_s=60.0,
        work=Work(prompt="pull qwen3:8b", task_type="model_change", change=ModelChange(op="pull")),
    )
    before = evolve(None, submitted)
    after = evolve(
        before,
        TaskCompleted(
            at=9.0,
            task_id="t",
            attempt=1,
            worker="moon",
            model="qwen3:8b",
            response="",
            durations=Durations(total_ms=8000.0),
        ),
    )
    assert after.status == "done"
    assert outcome_of(before, after) is None
    plain = evolve(None, msgspec.structs.replace(submitted, work=Work(prompt="hi")))
    done = evolve(
        plain,
        TaskCompleted(
            at=9.0,
            task_id="t",
            attempt=1,
            worker="moon",
            model="qwen3:8b",
            response="",
            durations=Durations(total_ms=8000.0),
        ),
    )
    assert outcome_of(plain, done) is not None


# --------------------------------------------------------------------------- the gateway


def test_the_gateway_reads_ollamas_change_bodies() -> None:
    pulled = gateway_changes.pull_request(b'{"name": "qwen3:8b", "insecure": true, "model": ""}')
    assert (pulled.model, pulled.change, pulled.stream) == (
        "qwen3:8b",
        ModelChange(op="pull", insecure=True),
        True,
    )
    made = gateway_changes.create_request(
        b'{"model": "jp", "from": "qwen3:8b", "system": "x", "stream": false}'
    )
    assert made.change == ModelChange(op="create", source="qwen3:8b", system="x")
    assert not made.stream
    copied = gateway_changes.copy_request(b'{"source": "jp", "destination": "jp2"}')
    assert (copied.model, copied.change.source) == ("jp2", "jp")
    assert gateway_changes.delete_request(b'{"model": "jp2"}').change.op == "delete"
    with pytest.raises(ApiError, match='source "" is invalid'):
        gateway_changes.copy_request(b'{"destination": "jp2"}')


def test_the_gateway_chooses_the_machines_a_change_makes_sense_on() -> None:
    fleet = [
        view("moon", "qwen3:8b", tier="gpu"),
        view("mac", "gemma3:4b", tier="gpu"),
        view("box", "qwen3:8b", tier="cpu"),
        view("pi", tier="cpu"),
        view("web-1", tier="web"),
    ]
    pull = gateway_changes.Asked("qwen3:8b", ModelChange(op="pull"))
    # Every machine of the tiers that serve it: both here.
    assert gateway_changes.machines_for(pull, None, fleet, {}) == (
        "qwen3:8b",
        ["box", "mac", "moon", "pi"],
    )
    gemma = gateway_changes.Asked("house", ModelChange(op="pull"))
    assert gateway_changes.machines_for(gemma, None, fleet, {"house": "gemma3:4b"}) == (
        "gemma3:4b",
        ["mac", "moon"],
    )
    removal = gateway_changes.Asked("qwen3:8b", ModelChange(op="delete"))
    assert gateway_changes.machines_for(removal, None, fleet, {})[1] == ["box", "moon"]
    named = gateway_changes.named_machines(" pi, moon ,pi")
    assert gateway_changes.machines_for(removal, named, fleet, {})[1] == ["pi", "moon"]
    with pytest.raises(ApiError, match="X-Coordinator-Machines") as nowhere:
        gateway_changes.machines_for(
            gateway_changes.Asked("nope:1b", ModelChange(op="pull")), None, fleet, {}
        )
    assert nowhere.value.status == 404
    with pytest.raises(ApiError, match="names no worker"):
        gateway_changes.named_machines(" , ")


def test_several_machines_progress_is_one_bar_per_layer_and_success_once() -> None:
    merged = gateway_changes.MergedProgress()
    manifest = ModelProgress(status="pulling manifest")
    assert merged.add("moon", manifest) == {"status": "pulling manifest"}
    assert merged.add("sun", manifest) is None
    layer = "sha256:abc"

    def step(done: int) -> ModelProgress:
        return ModelProgress(status="pulling abc", digest=layer, total=100, completed=done)

    assert merged.add("moon", step(0)) == {"status": "pulling abc", "digest": layer, "total": 100}
    assert merged.add("sun", step(40)) == {
        "status": "pulling abc",
        "digest": layer,
        "total": 200,
        "completed": 40,
    }
    latest = merged.add("moon", step(100))
    assert latest is not None and latest["completed"] == 140
    assert merged.add("moon", ModelProgress(status="success")) is None
    failures = {"sun": ApiError(502, "backend_error", "no space left on device")}
    assert gateway_changes.failed_line(failures) == {"error": "sun: no space left on device"}
