"""The Ollama stand-in's model management: ``/api/pull``, ``/api/create``, ``/api/copy`` and
``/api/delete``, through the official ``ollama`` client and, where the wire shape matters,
line by line over raw HTTP."""

from __future__ import annotations

import hashlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from devtools.fakes.ollama import DEFAULT_MODELS, FakeOllama

REPO = Path(__file__).resolve().parents[2]
BASE = "qwen2.5:0.5b"  # served by default, takes tools
NEW = "llama3.2:1b"  # in the registry, not served
SMALL = "smollm2:135m"  # likewise, and small
MISSING = "missing-model:7b"  # in no registry
NO_MANIFEST = "pull model manifest: file does not exist"
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@pytest.fixture
def fake() -> Iterator[FakeOllama]:
    with FakeOllama() as server:
        yield server


@pytest.fixture
def http(fake: FakeOllama) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fake.url, timeout=10) as client:
        yield client


@pytest.fixture
def client(fake: FakeOllama) -> Iterator[ollama.Client]:
    with ollama.Client(host=fake.url, timeout=10) as official:
        yield official


def streamed(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    """A streamed answer's NDJSON objects, its framing checked as Ollama sends it."""
    with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "application/x-ndjson"
        assert reply.headers["transfer-encoding"] == "chunked"
        return [json.loads(line) for line in reply.iter_lines() if line.strip()]


def tags(http: httpx.Client) -> dict[str, dict[str, Any]]:
    """``/api/tags`` by name, in its order."""
    return {entry["name"]: entry for entry in http.get("/api/tags").json()["models"]}


def show(http: httpx.Client, model: str) -> dict[str, Any]:
    reply = http.post("/api/show", json={"model": model})
    assert reply.status_code == 200, reply.text
    shown: dict[str, Any] = reply.json()
    return shown


def blobs(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """A pull's progress lines by blob digest, in order."""
    by_digest: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        if "digest" in line:
            by_digest.setdefault(line["digest"], []).append(line)
    return by_digest


def chat(client: ollama.Client, model: str, *messages: dict[str, str], **options: Any) -> Any:
    return client.chat(model=model, messages=list(messages), options=options or None)


# --------------------------------------------------------------------------- pull


def test_pull_streams_each_blobs_progress_then_serves_the_model(http: httpx.Client) -> None:
    assert NEW not in tags(http)

    lines = streamed(http, "/api/pull", model=NEW)

    assert lines[0] == {"status": "pulling manifest"}
    assert lines[-3:] == [
        {"status": "verifying sha256 digest"},
        {"status": "writing manifest"},
        {"status": "success"},
    ]
    progress = blobs(lines)
    assert len(progress) == 3  # weights, template, config
    assert len(lines) == 1 + sum(len(each) for each in progress.values()) + 3
    for digest, each in progress.items():
        assert DIGEST.fullmatch(digest)
        total = each[0]["total"]
        assert total > 0
        for line in each:
            assert line["status"] == f"pulling {digest[7:19]}"
            assert set(line) <= {"status", "digest", "total", "completed"}
            assert line["total"] == total
        done = [line.get("completed", 0) for line in each]
        assert done == sorted(done) and done[-1] == total
        percents = [100 * completed / total for completed in done]
        assert all(0 <= percent <= 100 for percent in percents)
    downloaded = [each for each in progress.values() if len(each) > 1]
    # A blob being downloaded starts with nothing done: Go's omitempty drops "completed": 0.
    assert downloaded and all("completed" not in each[0] for each in downloaded)
    assert any(0 < 100 * line.get("completed", 0) / line["total"] < 100 for line in lines[1:-3])
    # The stock template is on disk already (the served models have it): one line, complete.
    cached = [each for each in progress.values() if len(each) == 1]
    assert len(cached) == 1 and cached[0][0]["completed"] == cached[0][0]["total"]

    listed = tags(http)
    assert next(iter(listed)) == NEW  # the newest first, as Ollama sorts them
    pulled = listed[NEW]
    assert pulled["size"] == sum(each[0]["total"] for each in progress.values())
    assert len(pulled["digest"]) == 64
    assert pulled["details"]["family"] == "llama3"
    assert pulled["modified_at"] > listed[BASE]["modified_at"]
    weights = max(progress, key=lambda digest: progress[digest][0]["total"])
    modelfile = show(http, NEW)["modelfile"]
    assert f"FROM /root/.ollama/models/blobs/{weights.replace(':', '-')}\n" in modelfile
    answer = http.post(
        "/api/generate", json={"model": NEW, "prompt": "2*21", "stream": False}
    ).json()
    assert answer["response"] == "42"


def test_pull_with_the_official_client(
    fake: FakeOllama, http: httpx.Client, client: ollama.Client
) -> None:
    progress = list(client.pull(SMALL, stream=True))
    statuses = [part.status for part in progress]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    parts = [(part.status, part.digest or "", part.completed, part.total or 0) for part in progress]
    blob_parts = [part for part in parts if part[1]]
    assert blob_parts and all(
        total > 0 and status == f"pulling {digest[7:19]}" for status, digest, _, total in blob_parts
    )
    percents = [100 * (completed or 0) / total for _, _, completed, total in blob_parts]
    assert min(percents) == 0 and max(percents) == 100
    assert SMALL in [model.model for model in client.list().models]

    # Not streamed: one object, the last progress, as application/json.
    reply = http.post("/api/pull", json={"model": NEW, "stream": False})
    assert (reply.status_code, reply.text) == (200, '{"status":"success"}')
    assert reply.headers["content-type"] == "application/json"
    assert client.pull(BASE).status == "success"
    assert NEW in tags(http)
    legacy = http.post("/api/pull", json={"name": "llama3.2:3b", "stream": False})
    assert legacy.json() == {"status": "success"} and "llama3.2:3b" in tags(http)
    calls = [call["api"] for call in fake.calls()]
    assert calls == ["pull"] * 4
    assert fake.stats()["generate_calls"] == 0


def test_pulling_a_served_model_again_finds_its_blobs_and_keeps_its_digest(
    http: httpx.Client,
) -> None:
    before = tags(http)[BASE]

    lines = streamed(http, "/api/pull", model=BASE)

    progress = blobs(lines)
    assert all(len(each) == 1 for each in progress.values())
    assert all(each[0]["completed"] == each[0]["total"] for each in progress.values())
    after = tags(http)
    assert next(iter(after)) == BASE
    assert (after[BASE]["digest"], after[BASE]["size"]) == (before["digest"], before["size"])
    assert after[BASE]["modified_at"] != before["modified_at"]


def test_a_pull_in_flight_shows_in_calls_and_lists_its_model_only_once_written(
    fake: FakeOllama, http: httpx.Client
) -> None:
    fake.configure(pull_chunk_delay_s=0.05)
    started = time.monotonic()
    with (
        httpx.Client(base_url=fake.url, timeout=10) as puller,
        puller.stream("POST", "/api/pull", json={"model": NEW}) as reply,
    ):
        lines = reply.iter_lines()
        first = [json.loads(next(lines)) for _ in range(3)]
        assert first[0] == {"status": "pulling manifest"}
        assert first[1]["digest"] == first[2]["digest"]
        assert first[2]["completed"] > 0
        assert NEW not in tags(http)
        (call,) = http.get("/_fake/calls").json()["calls"]
        assert call["api"] == "pull" and call["ended_at"] is None
        assert http.get("/_fake/stats").json()["in_flight"] == 0  # no model at work
        rest = [json.loads(line) for line in lines if line.strip()]
    elapsed = time.monotonic() - started

    assert rest[-1] == {"status": "success"}
    assert elapsed >= 0.05 * (len(first) + len(rest) - 1) * 0.9
    assert NEW in tags(http)
    (call,) = fake.calls()
    assert call["ended_at"] is not None


def test_pull_of_a_model_the_registry_lacks(
    fake: FakeOllama, http: httpx.Client, client: ollama.Client
) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client.pull(MISSING)
    assert (refused.value.status_code, refused.value.error) == (500, NO_MANIFEST)

    with pytest.raises(ollama.ResponseError) as mid_stream:
        list(client.pull(MISSING, stream=True))
    assert mid_stream.value.error == NO_MANIFEST  # after a 200: no status to give

    lines = streamed(http, "/api/pull", model=MISSING)
    assert lines == [{"status": "pulling manifest"}, {"error": NO_MANIFEST}]
    whole = http.post("/api/pull", json={"model": MISSING, "stream": False})
    assert whole.status_code == 500
    assert whole.headers["content-type"] == "application/json"
    assert whole.json() == {"error": NO_MANIFEST}
    assert MISSING not in tags(http)

    fake.configure(registry=[*fake.registry, MISSING])
    assert client.pull(MISSING).status == "success"
    assert MISSING in tags(http)

    for body in ({"model": ""}, {"model": "bad name!"}, {"model": "a/b/c/d"}):
        invalid = http.post("/api/pull", json=body)
        assert (invalid.status_code, invalid.json()) == (400, {"error": "invalid model name"})
        assert invalid.headers["content-type"] == "application/json; charset=utf-8"
    typed = http.post("/api/pull", json={"model": 7})
    assert typed.status_code == 400
    assert typed.json() == {
        "error": "json: cannot unmarshal number into Go struct field PullRequest.model "
        "of type string"
    }
    empty = http.post("/api/pull", content=b"")
    assert (empty.status_code, empty.json()) == (400, {"error": "missing request body"})


def test_pull_onto_a_full_disk_fails_as_ollamas_write_does(
    fake: FakeOllama, http: httpx.Client, client: ollama.Client
) -> None:
    fake.configure(disk_free_bytes=100_000_000)

    lines = streamed(http, "/api/pull", model=NEW)

    *progress, failure = lines
    weights = progress[-1]["digest"]
    assert progress[-1]["completed"] == 100_000_000 < progress[-1]["total"]
    blob = f"/root/.ollama/models/blobs/{weights.replace(':', '-')}-partial"
    assert failure == {"error": f"write {blob}: no space left on device"}
    assert NEW not in tags(http)
    with pytest.raises(ollama.ResponseError) as whole:
        client.pull(NEW)
    assert (whole.value.status_code, whole.value.error) == (
        500,
        f"write {blob}: no space left on device",
    )
    assert fake.config()["disk_free_bytes"] == 100_000_000  # nothing was written whole

    # Room enough: the pull takes what it downloads; a delete gives it back.
    fake.configure(disk_free_bytes=1_000_000_000)
    pulled = blobs(streamed(http, "/api/pull", model=NEW))
    downloaded = sum(each[0]["total"] for each in pulled.values() if len(each) > 1)
    assert downloaded > 600_000_000
    assert fake.config()["disk_free_bytes"] == 1_000_000_000 - downloaded
    assert client.delete(NEW).status == "success"
    assert fake.config()["disk_free_bytes"] == 1_000_000_000


# --------------------------------------------------------------------------- create


def test_create_from_a_served_model_with_a_system_prompt_then_chat_with_it(
    http: httpx.Client, client: ollama.Client
) -> None:
    system = "You are a pirate. Answer as one."
    progress = list(
        client.create(
            "pirate",
            from_=BASE,
            system=system,
            parameters={"num_predict": 3, "temperature": 0.2},
            stream=True,
        )
    )

    statuses = [part.status or "" for part in progress]
    assert statuses[-2:] == ["writing manifest", "success"]
    existing = [s for s in statuses if s.startswith("using existing layer sha256:")]
    created = [s for s in statuses if s.startswith("creating new layer sha256:")]
    assert len(existing) == 2 and len(created) == 2  # weights, template; system, params
    system_digest = f"sha256:{hashlib.sha256(system.encode()).hexdigest()}"
    assert f"creating new layer {system_digest}" in created

    listed = tags(http)
    assert next(iter(listed)) == "pirate:latest"
    pirate, base = listed["pirate:latest"], listed[BASE]
    assert pirate["digest"] != base["digest"] and len(pirate["digest"]) == 64
    assert pirate["size"] > base["size"]
    assert pirate["details"] == base["details"]

    shown, base_shown = show(http, "pirate"), show(http, BASE)
    assert shown["system"] == system and "system" not in base_shown
    assert shown["details"]["parent_model"] == BASE
    assert base_shown["details"]["parent_model"] == ""
    assert shown["parameters"].splitlines() == [
        f"{'num_predict':<30} 3",
        f"{'temperature':<30} 0.2",
    ]
    modelfile = shown["modelfile"].splitlines()
    assert modelfile[:3] == [
        '# Modelfile generated by "ollama show"',
        "# To build a new Modelfile based on this, replace FROM with:",
        "# FROM pirate:latest",
    ]
    assert f"SYSTEM {system}" in modelfile
    assert {"PARAMETER num_predict 3", "PARAMETER temperature 0.2"} <= set(modelfile)
    base_from = [line for line in base_shown["modelfile"].splitlines() if line.startswith("FROM /")]
    assert base_from and base_from[0] in modelfile  # the same weights
    assert shown["capabilities"] == base_shown["capabilities"] == ["completion", "tools"]
    assert shown["model_info"] == base_shown["model_info"]

    # The system prompt is in the prompt the model reads; the parameters are its defaults.
    question = {"role": "user", "content": "what is the best ship in the harbour"}
    answered, plain = chat(client, "pirate", question), chat(client, BASE, question)
    assert answered.message.content == "Echo from pirate"  # three pieces: num_predict 3
    assert (answered.done_reason, answered.eval_count) == ("length", 3)
    assert plain.done_reason == "stop"
    assert (answered.prompt_eval_count or 0) > (plain.prompt_eval_count or 0) > 0
    own = {"role": "system", "content": "Be terse."}
    assert (
        chat(client, "pirate", own, question).prompt_eval_count
        == chat(client, BASE, own, question).prompt_eval_count
    )
    longer = chat(client, "pirate", question, num_predict=100)
    assert longer.message.content == f"Echo from pirate: {question['content']}"
    generated = client.generate(model="pirate", prompt="hello").prompt_eval_count or 0
    assert generated > (client.generate(model=BASE, prompt="hello").prompt_eval_count or 0) > 0


def test_create_not_streamed_answers_success_and_builds_on_a_created_model(
    http: httpx.Client, client: ollama.Client
) -> None:
    assert client.create("pirate", from_=BASE, system="Arr.").status == "success"
    reply = http.post(
        "/api/create",
        json={
            "model": "captain",
            "from": "pirate",
            "license": ["MIT", "Apache-2.0"],
            "messages": [{"role": "user", "content": "ahoy"}],
            "stream": False,
        },
    )
    assert (reply.status_code, reply.json()) == (200, {"status": "success"})
    assert reply.headers["content-type"] == "application/json"

    captain = show(http, "captain")
    assert captain["system"] == "Arr."  # kept from the model it was made from
    assert captain["license"] == "MIT\nApache-2.0"
    assert captain["messages"] == [{"role": "user", "content": "ahoy"}]
    assert captain["details"]["parent_model"] == "pirate:latest"
    assert "MESSAGE user ahoy" in captain["modelfile"].splitlines()
    assert list(tags(http))[:2] == ["captain:latest", "pirate:latest"]


def test_create_from_a_model_to_pull_and_from_a_missing_one(
    http: httpx.Client, client: ollama.Client
) -> None:
    lines = streamed(http, "/api/create", model="tiny", **{"from": SMALL, "system": "Short."})
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "pulling manifest"
    pulled_until = statuses.index("success")  # the pull's own end, then the create's layers
    assert statuses[pulled_until - 2 : pulled_until] == [
        "verifying sha256 digest",
        "writing manifest",
    ]
    assert statuses[-2:] == ["writing manifest", "success"]
    assert any(s.startswith("using existing layer") for s in statuses[pulled_until:])
    assert {"tiny:latest", SMALL} <= set(tags(http))

    with pytest.raises(ollama.ResponseError) as refused:
        client.create("ghost", from_=MISSING, system="Boo.")
    assert (refused.value.status_code, refused.value.error) == (500, NO_MANIFEST)
    lines = streamed(http, "/api/create", model="ghost", **{"from": MISSING})
    assert lines == [{"status": "pulling manifest"}, {"error": NO_MANIFEST}]
    assert "ghost:latest" not in tags(http)
    assert http.post("/api/show", json={"model": "ghost"}).status_code == 404


def test_create_refusals_as_ollama_words_them(http: httpx.Client, client: ollama.Client) -> None:
    # Ollama 0.12 no longer reads a Modelfile: its create needs "from" (or "files").
    old = http.post(
        "/api/create", json={"model": "x", "modelfile": f"FROM {BASE}", "stream": False}
    )
    neither = {"error": "neither 'from' or 'files' was specified"}
    assert (old.status_code, old.json()) == (400, neither)
    lines = streamed(http, "/api/create", model="x", modelfile=f"FROM {BASE}")
    assert lines == [neither | {"status": 400}]  # streamed: the status rides in the object

    with pytest.raises(ollama.ResponseError) as nameless:
        client.create("two words", from_=BASE)
    assert (nameless.value.status_code, nameless.value.error) == (400, "invalid model name")
    bad_from = http.post("/api/create", json={"model": "x", "from": "no good", "stream": False})
    assert (bad_from.status_code, bad_from.json()) == (400, {"error": "invalid model name"})
    with pytest.raises(ollama.ResponseError) as quantized:
        client.create("x", from_=BASE, quantize="q8_0")
    assert (quantized.value.status_code, quantized.value.error) == (
        500,
        "quantization is only supported for F16 and F32 models",
    )
    path = http.post(
        "/api/create", json={"model": "x", "files": {"../m.gguf": "sha256:00"}, "stream": False}
    )
    assert (path.status_code, path.json()) == (400, {"error": "file path must be relative"})
    digest = "sha256:" + "ab" * 32
    gguf = streamed(http, "/api/create", model="x", files={"m.gguf": digest})
    assert gguf == [
        {"status": "parsing GGUF"},
        {"error": f"open /root/.ollama/models/blobs/sha256-{'ab' * 32}: no such file or directory"},
    ]
    assert "x:latest" not in tags(http)


# --------------------------------------------------------------------------- copy and delete


def test_copy_serves_the_same_model_under_a_new_name(
    http: httpx.Client, client: ollama.Client
) -> None:
    assert client.copy(BASE, "mine").status == "success"
    raw = http.post("/api/copy", json={"source": BASE, "destination": "also-mine:v1"})
    assert (raw.status_code, raw.content) == (200, b"")
    assert "content-type" not in raw.headers and raw.headers["content-length"] == "0"

    listed = tags(http)
    assert list(listed)[:2] == ["also-mine:v1", "mine:latest"]
    for name in ("mine:latest", "also-mine:v1"):
        assert listed[name]["digest"] == listed[BASE]["digest"]  # one manifest, copied
        assert (listed[name]["size"], listed[name]["details"]) == (
            listed[BASE]["size"],
            listed[BASE]["details"],
        )
    assert show(http, "mine")["capabilities"] == show(http, BASE)["capabilities"]
    assert chat(client, "mine", {"role": "user", "content": "1+1"}).message.content == "2"
    assert client.copy(BASE, BASE).status == "success"  # onto itself: nothing to do
    assert list(tags(http)).count(BASE) == 1


def test_copy_of_an_unknown_model(http: httpx.Client, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.copy("nope:1b", "mine")
    assert (unknown.value.status_code, unknown.value.error) == (404, 'model "nope:1b" not found')
    raw = http.post("/api/copy", json={"source": "nope", "destination": "mine"})
    assert (raw.status_code, raw.json()) == (404, {"error": 'model "nope" not found'})
    nowhere = http.post("/api/copy", json={"source": BASE, "destination": ""})
    assert (nowhere.status_code, nowhere.json()) == (400, {"error": 'destination "" is invalid'})
    nothing = http.post("/api/copy", json={"source": "", "destination": "mine"})
    assert (nothing.status_code, nothing.json()) == (400, {"error": 'source "" is invalid'})
    assert list(tags(http)) == list(DEFAULT_MODELS)


def test_delete_and_pull_back(http: httpx.Client, client: ollama.Client) -> None:
    digest = tags(http)["gemma3:1b"]["digest"]
    raw = http.request("DELETE", "/api/delete", json={"model": "gemma3:1b"})
    assert (raw.status_code, raw.content) == (200, b"")
    assert "content-type" not in raw.headers

    assert list(tags(http)) == [BASE]
    gone = http.post("/api/show", json={"model": "gemma3:1b"})
    assert (gone.status_code, gone.json()) == (404, {"error": "model 'gemma3:1b' not found"})
    with pytest.raises(ollama.ResponseError) as unserved:
        chat(client, "gemma3:1b", {"role": "user", "content": "hi"})
    assert unserved.value.status_code == 404

    assert client.pull("gemma3:1b").status == "success"
    assert tags(http)["gemma3:1b"]["digest"] == digest
    assert client.delete("gemma3:1b").status == "success"  # the client sends {"model": ...}
    assert "gemma3:1b" not in tags(http)


def test_delete_of_an_unknown_model(http: httpx.Client, client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.delete("nope:1b")
    assert (unknown.value.status_code, unknown.value.error) == (404, "model 'nope:1b' not found")
    legacy = http.request("DELETE", "/api/delete", json={"name": "nope"})
    assert (legacy.status_code, legacy.json()) == (404, {"error": "model 'nope' not found"})
    invalid = http.request("DELETE", "/api/delete", json={"model": ""})
    assert (invalid.status_code, invalid.json()) == (400, {"error": 'name "" is invalid'})
    assert list(tags(http)) == list(DEFAULT_MODELS)


def test_a_deleted_created_model_takes_its_own_blobs_with_it(
    fake: FakeOllama, http: httpx.Client, client: ollama.Client
) -> None:
    system = "You are a lighthouse keeper."
    client.create("keeper", from_=BASE, system=system)
    listed = tags(http)
    # A pull of a served model names its blobs: weights, template, config (the last one).
    base_config = list(blobs(streamed(http, "/api/pull", model=BASE)).values())[-1][0]["total"]
    fake.configure(disk_free_bytes=1_000)

    assert client.delete("keeper").status == "success"

    # Its system and config blobs go; the weights and template stay: the base uses them.
    own = listed["keeper:latest"]["size"] - listed[BASE]["size"] + base_config
    assert own > len(system.encode())
    assert fake.config()["disk_free_bytes"] == 1_000 + own
    assert list(tags(http)) == [BASE, "gemma3:1b"]
    again = [
        part.status for part in client.create("keeper", from_=BASE, system=system, stream=True)
    ]
    assert f"creating new layer sha256:{hashlib.sha256(system.encode()).hexdigest()}" in again


# --------------------------------------------------------------------------- state


def test_concurrent_management_loses_no_model(fake: FakeOllama, http: httpx.Client) -> None:
    names = [f"copy-{n}:latest" for n in range(8)]
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            with httpx.Client(base_url=fake.url, timeout=10) as own:
                own.post("/api/copy", json={"source": BASE, "destination": name}).raise_for_status()
                made = own.post(
                    "/api/create",
                    json={"model": f"made-{name}", "from": name, "system": name, "stream": False},
                )
                assert made.json() == {"status": "success"}
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    listed = set(tags(http))
    assert set(names) <= listed
    assert {f"made-{name}" for name in names} <= listed
    assert len(listed) == len(DEFAULT_MODELS) + 2 * len(names)
    assert {show(http, f"made-{name}")["system"] for name in names} == set(names)


def test_knobs_and_reset(fake: FakeOllama, http: httpx.Client, client: ollama.Client) -> None:
    config = http.get("/_fake/config").json()
    assert config["registry"] == list(fake.registry) and NEW in config["registry"]
    assert (config["pull_chunk_delay_s"], config["disk_free_bytes"]) == (0.0, None)
    for knob, value in (("disk_free_bytes", -1), ("registry", "x"), ("pull_chunk_delay_s", -1)):
        refused = http.post("/_fake/config", json={knob: value})
        assert refused.status_code == 400 and knob in refused.json()["error"]
        with pytest.raises(ValueError, match=knob):
            fake.configure(**{knob: value})

    client.pull(NEW)
    client.create("pirate", from_=BASE, system="Arr.")
    client.delete("gemma3:1b")
    fake.reset()

    assert list(tags(http)) == list(DEFAULT_MODELS)
    assert "system" not in show(http, BASE)
    assert http.post("/api/show", json={"model": "pirate"}).status_code == 404
    assert FakeOllama(registry=[MISSING]).registry == [MISSING]


def test_model_management_in_a_stand_in_run_as_a_process() -> None:
    """Run as ``python -m``, the module's errors are still Ollama's answers."""
    command = [sys.executable, "-m", "devtools.fakes.ollama", "--port", "0"]
    with subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            assert process.stdout is not None
            url = process.stdout.readline().strip().removeprefix("fake ollama listening on ")
            with httpx.Client(base_url=url, timeout=5) as http:
                unknown = http.request("DELETE", "/api/delete", json={"model": "nope"})
                assert (unknown.status_code, unknown.json()) == (
                    404,
                    {"error": "model 'nope' not found"},
                )
                pulled = http.post("/api/pull", json={"model": SMALL, "stream": False})
                assert pulled.json() == {"status": "success"}
                assert SMALL in tags(http)
        finally:
            process.send_signal(signal.SIGTERM)
            _, errors = process.communicate(timeout=10)
        assert process.returncode == 0
        assert errors == ""
