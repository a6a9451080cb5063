"""Where models should live (`services.fleet.placement`): the rules on hand-made events and
workers, and the lines ``coordinator models advise`` prints. Pure."""

from __future__ import annotations

import pytest

from schemas.events import (
    AnyEvent,
    Durations,
    TaskCompleted,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerAsleep,
    WorkerRegistered,
)
from schemas.models import ModelFacts
from schemas.queries import WorkerView
from schemas.stats import FigureView
from schemas.work import Work
from schemas.workers import WorkerRecord
from services.cli.advise import lines
from services.fleet.placement import Advice, Measure, advise

NOW = 1_800_000_000.0
DAY = 86_400.0
SINCE = NOW - DAY
GB = 1_000_000_000
# Sizes as Ollama lists them (the stand-in's, too).
SIZES = {
    "qwen3:8b": 4_850_000_000,
    "gemma3:4b": 2_450_000_000,
    "qwen2.5:0.5b": 350_000_000,
    "llama3.2:3b": 1_850_000_000,
    "gemma3:1b": 650_000_000,
}


def facts(models: list[str]) -> list[ModelFacts]:
    return [ModelFacts(name=m, size=SIZES[m]) for m in models]


def worker(
    worker_id: str, models: list[str], memory_gb: float | None = 16, **fields: object
) -> WorkerView:
    return WorkerView(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        tier=str(fields.pop("tier", "gpu")),
        models=models,
        state=str(fields.pop("state", "idle")),
        last_heartbeat=NOW,
        facts=facts(models),
        memory_bytes=None if memory_gb is None else int(memory_gb * GB),
        **fields,  # type: ignore[arg-type]
    )


def sleeper(worker_id: str, models: list[str]) -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        instance_id="i-1",
        pid=1,
        version="1",
        supports=["gpu_inference"],
        models=models,
        started_at=SINCE,
        heartbeat_at=SINCE,
        state="asleep",
        wol_mac="aa:bb:cc:dd:ee:ff",
        facts=facts(models),
        memory_bytes=8 * GB,
    )


def task(
    task_id: str,
    model: str,
    on: str,
    at: float,
    *,
    wait_s: float = 1.0,
    total_s: float = 2.0,
    load_ms: float = 5.0,
    tokens_per_s: float = 20.0,
    task_type: str = "inference",
) -> list[AnyEvent]:
    """A task's events as the router and the worker record them: submitted and routed at
    ``at``, started ``wait_s`` later, done ``total_s`` after that (100 tokens generated)."""
    started = at + wait_s
    return [
        TaskSubmitted(
            at=at,
            task_id=task_id,
            model=model,
            work=Work(prompt="1+1", task_type=task_type),  # type: ignore[arg-type]
            timeout_s=60.0,
        ),
        TaskRouted(at=at, task_id=task_id, attempt=1, worker=on, queue=f"tasks.gpu.{on}"),
        TaskStarted(at=started, task_id=task_id, attempt=1, worker=on, host=f"host-{on}"),
        TaskCompleted(
            at=started + total_s,
            task_id=task_id,
            attempt=1,
            worker=on,
            model=model,
            response="2",
            durations=Durations(
                total_ms=total_s * 1000, load_ms=load_ms, eval_ms=100 / tokens_per_s * 1000
            ),
            tokens=Tokens(prompt=20, eval=100),
        ),
    ]


def thrashing_mac() -> list[AnyEvent]:
    """A day on a Mac too small for both of its models: qwen3:8b asked every two minutes
    for 76 minutes (38 tasks), gemma3:4b every four minutes 12 times, each loaded cold; moon runs
    a small model fast."""
    events: list[AnyEvent] = []
    start = SINCE + 3600
    for n in range(38):
        events += task(f"q{n}", "qwen3:8b", "mac", start + n * 120, wait_s=3.0, load_ms=4000)
    for n in range(12):
        events += task(f"g{n}", "gemma3:4b", "mac", start + n * 240 + 60, load_ms=2500)
    for n in range(4):
        events += task(
            f"s{n}", "qwen2.5:0.5b", "moon", start + n * 3600, wait_s=0.5, tokens_per_s=200
        )
    return events


def fleet() -> list[WorkerView]:
    return [
        worker("mac", ["qwen3:8b", "gemma3:4b"], memory_gb=6),
        worker("moon", ["qwen2.5:0.5b"], memory_gb=16),
    ]


def test_cold_loads_on_a_machine_too_small_propose_a_pull_onto_an_always_on_one() -> None:
    advice = advise(thrashing_mac(), fleet(), since=SINCE, until=NOW)

    (pull,) = [p for p in advice.proposals if p.action == "pull"]
    assert (pull.model, pull.worker, pull.rule, pull.sources) == (
        "qwen3:8b",
        "moon",
        "cold_loads",
        ["mac"],
    )
    # Every request came within two minutes of the last: kept in memory, none loads cold.
    assert pull.before == Measure(cold_loads_per_day=38.0, wait_p50_s=3.0)
    assert pull.after == Measure(cold_loads_per_day=0.0, wait_p50_s=0.5)
    assert "mac cannot keep it (4.8 GB) beside gemma3:4b (2.5 GB) in 6.0 GB" in pull.reason
    # moon reads 200 tok/s x 0.35 GB of weights a second: about 14 tok/s of qwen3:8b, over
    # half of mac's 20.
    assert "should run it at about 14 tok/s" in pull.reason
    # gemma3:4b's cold loads end too once qwen3:8b leaves mac: no second pull for them.
    assert [n for n in advice.notes if n.startswith("gemma3:4b")] == [
        "gemma3:4b: 12 cold loads a day on mac: mac cannot keep it (2.5 GB) beside qwen3:8b "
        "(4.8 GB) in 6.0 GB; pulling qwen3:8b off makes room for it"
    ]
    demand = {d.model: d for d in advice.demand}
    q = demand["qwen3:8b"]
    assert (q.requests_per_day, q.tokens_per_day, q.wait_p50_s) == (38.0, 38 * 120.0, 3.0)
    assert q.cold_loads_per_day == {"mac": 38.0}
    assert q.holders == ["mac"]
    assert demand["qwen2.5:0.5b"].cold_loads_per_day == {}
    assert advice.days == 1.0 and advice.figures is False

    printed = lines(advice)
    assert "  1. pull qwen3:8b onto moon: 38 cold loads a day on mac would become 0; " in (
        "\n".join(printed)
    )
    assert "     to do it: coordinator pull qwen3:8b --on moon" in printed
    assert printed[-1] == "(the stats service did not answer: speeds are the window's own)"


def test_requests_spread_beyond_the_keep_alive_leave_the_loads_a_pull_cannot_avoid() -> None:
    events: list[AnyEvent] = []
    for n in range(10):  # every ten minutes: each loads cold anyway
        events += task(f"q{n}", "qwen3:8b", "mac", SINCE + n * 600, load_ms=4000)
    for n in range(10):  # every two minutes
        events += task(f"r{n}", "qwen3:8b", "mac", SINCE + 7200 + n * 120, load_ms=4000)
    for n in range(5):
        events += task(f"g{n}", "gemma3:4b", "mac", SINCE + 9000 + n * 60, load_ms=2500)

    advice = advise(events, fleet(), since=SINCE, until=NOW)

    (pull,) = [p for p in advice.proposals if p.action == "pull"]
    assert pull.model == "qwen3:8b"
    # Kept in memory, it still loads after each of the 9 gaps of ten minutes (598 s from an
    # end to the next start) and after the half hour before the burst; the first run is not
    # counted.
    assert pull.before == Measure(cold_loads_per_day=20.0, wait_p50_s=1.0)
    assert pull.after == Measure(cold_loads_per_day=10.0)
    assert "20 cold loads a day on mac would become 10" in "\n".join(lines(advice))


def test_a_well_placed_fleet_gets_no_proposal() -> None:
    events: list[AnyEvent] = []
    for n in range(30):
        first = n == 0
        events += task(f"q{n}", "qwen3:8b", "mac", SINCE + n * 120, load_ms=4000 if first else 5)
        events += task(f"g{n}", "gemma3:4b", "mac", SINCE + n * 120 + 60, load_ms=4 if n else 900)
        events += task(f"s{n}", "qwen2.5:0.5b", "moon", SINCE + n * 600, load_ms=5)
    workers = [
        worker("mac", ["qwen3:8b", "gemma3:4b"], memory_gb=12),
        worker("moon", ["qwen2.5:0.5b"]),
    ]

    advice = advise(events, workers, since=SINCE, until=NOW)

    assert advice.proposals == []
    assert advice.notes == []
    assert lines(advice)[-2:] == [
        "no proposal: the models are where their demand wants them",
        "(the stats service did not answer: speeds are the window's own)",
    ]


def test_cold_loads_on_a_machine_with_room_are_idle_unloads_not_a_placement() -> None:
    events: list[AnyEvent] = []
    for n in range(20):  # an hour apart: unloaded after its keep-alive each time
        events += task(f"q{n}", "qwen3:8b", "mac", SINCE + n * 3600, load_ms=4000)
    advice = advise(
        events, [worker("mac", ["qwen3:8b"]), worker("moon", [])], since=SINCE, until=NOW
    )

    assert advice.proposals == []
    assert advice.demand[0].cold_loads_per_day == {"mac": 20.0}


def sleepy_day() -> list[AnyEvent]:
    """pc slept from 1 h to 5 h and from 6 h on; llama3.2:3b was asked for at 2, 3 and 4 h
    (each waited for pc to wake) and at 5.5 h (pc awake)."""
    events: list[AnyEvent] = [
        WorkerAsleep(at=SINCE + 3600, worker_id="pc", instance_id="i", models=[], idle_s=600),
        WorkerRegistered(
            at=SINCE + 5 * 3600,
            worker_id="pc",
            host="host-pc",
            instance_id="i2",
            models=["llama3.2:3b"],
            supports=["gpu_inference"],
            version="1",
        ),
        WorkerAsleep(at=SINCE + 6 * 3600, worker_id="pc", instance_id="i2", models=[], idle_s=600),
    ]
    for n, hour in enumerate((2, 3, 4)):
        events += task(f"l{n}", "llama3.2:3b", "pc", SINCE + hour * 3600, wait_s=40, load_ms=3000)
    events += task("l3", "llama3.2:3b", "pc", SINCE + 5.5 * 3600, wait_s=1, load_ms=3000)
    events += task("m0", "qwen2.5:0.5b", "moon", SINCE + 7200, wait_s=0.5, tokens_per_s=200)
    return events


def test_a_model_only_a_sleeping_machine_holds_asked_for_while_it_slept_is_pulled() -> None:
    advice = advise(
        sleepy_day(),
        [worker("moon", ["qwen2.5:0.5b"])],
        sleepers=[sleeper("pc", ["llama3.2:3b"])],
        since=SINCE,
        until=NOW,
    )

    (pull,) = advice.proposals
    assert (pull.action, pull.model, pull.worker, pull.rule) == (
        "pull",
        "llama3.2:3b",
        "moon",
        "asleep_when_asked",
    )
    # Four cold loads; kept in memory, the hours between them would unload it each time.
    assert pull.before == Measure(cold_loads_per_day=4.0, asked_asleep_per_day=3.0, wait_p50_s=40.0)
    assert pull.after == Measure(cold_loads_per_day=3.0, wait_p50_s=0.5)
    assert pull.reason.startswith("only pc holds it, and 3 requests a day found it asleep")
    assert (
        "pull llama3.2:3b onto moon: 3 requests a day that found pc asleep would find moon "
        "awake" in "\n".join(lines(advice))
    )


def test_a_model_an_always_on_machine_holds_too_is_not_pulled_for_a_sleeper() -> None:
    advice = advise(
        sleepy_day(),
        [worker("moon", ["qwen2.5:0.5b", "llama3.2:3b"])],
        sleepers=[sleeper("pc", ["llama3.2:3b"])],
        since=SINCE,
        until=NOW,
    )

    assert advice.proposals == []


def test_a_live_machine_that_slept_in_the_window_is_no_target_and_its_models_can_move() -> None:
    # pc is awake now (it registered at 5 h), but it slept in the window: not always on.
    events = sleepy_day()[:2] + sleepy_day()[3:]
    advice = advise(
        events,
        [worker("moon", ["qwen2.5:0.5b"]), worker("pc", ["llama3.2:3b"])],
        since=SINCE,
        until=NOW,
    )

    (pull,) = advice.proposals
    assert (pull.model, pull.worker, pull.sources) == ("llama3.2:3b", "moon", ["pc"])
    assert pull.before is not None and pull.before.asked_asleep_per_day == 3.0


def test_a_model_never_asked_for_is_proposed_for_removal_after_the_pulls() -> None:
    workers = [
        worker("mac", ["qwen3:8b", "gemma3:4b"], memory_gb=6),
        worker("moon", ["qwen2.5:0.5b", "gemma3:1b"]),
    ]
    events = thrashing_mac() + task("e0", "gemma3:1b", "moon", SINCE - 60)  # before the window

    advice = advise(
        events, workers, sleepers=[sleeper("pc", ["llama3.2:3b"])], since=SINCE, until=NOW
    )

    assert [(p.action, p.model, p.worker, p.frees_bytes) for p in advice.proposals] == [
        ("pull", "qwen3:8b", "moon", 0),
        ("remove", "llama3.2:3b", "pc", SIZES["llama3.2:3b"]),
        ("remove", "gemma3:1b", "moon", SIZES["gemma3:1b"]),
    ]
    remove = advice.proposals[-1]
    assert (
        remove.before is None
        and remove.reason == "no request in 1 day; it takes 0.7 GB of disk there"
    )
    assert "  3. remove gemma3:1b from moon (unused)" in lines(advice)


def test_a_window_without_requests_calls_nothing_unused() -> None:
    advice = advise([], fleet(), since=SINCE, until=NOW)

    assert advice.proposals == [] and advice.demand == []
    assert advice.notes == ["no request in the window: no model is called unused"]


def test_web_searches_and_model_changes_are_no_demand() -> None:
    events = task("w", "qwen2.5:0.5b", "moon", SINCE + 60, task_type="web_search") + task(
        "c", "gemma3:1b", "moon", SINCE + 120, task_type="model_change"
    )
    events += task("q", "qwen3:8b", "mac", SINCE + 180)
    workers = [worker("mac", ["qwen3:8b"]), worker("moon", ["qwen2.5:0.5b", "gemma3:1b"])]

    advice = advise(events, workers, since=SINCE, until=NOW)

    assert [d.model for d in advice.demand] == ["qwen3:8b"]
    assert sorted(p.model for p in advice.proposals) == ["gemma3:1b", "qwen2.5:0.5b"]


def slow(speed: float) -> list[FigureView]:
    return [
        FigureView(
            model="qwen2.5:0.5b",
            domain="chat",
            worker="moon",
            count=9,
            failures=0,
            tokens_per_s=speed,
            last_at=NOW,
        )
    ]


NO_TARGET = "no always-on machine can take it"


@pytest.mark.parametrize(
    ("moon", "figures", "why", "pulled"),
    [
        # Measured slow: 20 tok/s x 0.35 GB, about 1.4 tok/s of qwen3:8b (under half of 20)
        # and 2.9 of gemma3:4b.
        (worker("moon", ["qwen2.5:0.5b"]), slow(20.0), NO_TARGET, []),
        # No word on its memory: nothing is promised of it.
        (worker("moon", ["qwen2.5:0.5b"], memory_gb=None), None, NO_TARGET, []),
        # Degraded: routing sends it nothing.
        (worker("moon", ["qwen2.5:0.5b"], health="degraded"), None, NO_TARGET, []),
        # A CPU machine whose speed is not known is not taken for the Mac's GPU.
        (worker("moon", [], tier="cpu"), None, NO_TARGET, []),
        # 4.65 GB of room beside its own hot model: not qwen3:8b's 4.85, but gemma3:4b's 2.45,
        # whose pull leaves qwen3:8b room on the Mac.
        (
            worker("moon", ["qwen2.5:0.5b"], memory_gb=5),
            None,
            "pulling gemma3:4b off makes room for it",
            [("gemma3:4b", "moon")],
        ),
    ],
)
def test_without_a_target_a_model_gets_a_note_instead_of_a_pull(
    moon: WorkerView,
    figures: list[FigureView] | None,
    why: str,
    pulled: list[tuple[str, str]],
) -> None:
    events = [e for e in thrashing_mac() if not getattr(e, "task_id", "").startswith("s")]
    if moon.models:
        events += task("s", "qwen2.5:0.5b", "moon", SINCE + 60, tokens_per_s=200)
    workers = [worker("mac", ["qwen3:8b", "gemma3:4b"], memory_gb=6), moon]

    advice = advise(events, workers, figures, since=SINCE, until=NOW)

    assert [(p.model, p.worker) for p in advice.proposals if p.action == "pull"] == pulled
    note = next(n for n in advice.notes if n.startswith("qwen3:8b:"))
    assert note.startswith("qwen3:8b: 38 cold loads a day on mac:") and note.endswith(why)
    assert advice.figures is (figures is not None)


def test_the_figures_speeds_stand_over_the_windows() -> None:
    figures = [
        FigureView(
            model="qwen2.5:0.5b",
            domain=domain,
            worker="moon",
            count=count,
            failures=0,
            tokens_per_s=speed,
            last_at=NOW,
        )
        for domain, count, speed in (("chat", 3, 100.0), ("code", 1, 500.0))
    ]
    advice = advise(thrashing_mac(), fleet(), figures, since=SINCE, until=NOW)

    (pull,) = [p for p in advice.proposals if p.action == "pull"]
    # (3 x 100 + 500) / 4 = 200 tok/s, weighted by the counts: the same 14 tok/s of qwen3:8b.
    assert "at about 14 tok/s" in pull.reason
    assert advice.figures is True


def test_the_room_taken_by_one_pull_is_not_offered_to_the_next() -> None:
    events = thrashing_mac()
    for n in range(20):  # a second machine too small for its two models
        events += task(f"p{n}", "llama3.2:3b", "tv", SINCE + 7200 + n * 120, load_ms=3000)
        events += task(f"o{n}", "gemma3:1b", "tv", SINCE + 7260 + n * 120, load_ms=3000)
    workers = [
        worker("mac", ["qwen3:8b", "gemma3:4b"], memory_gb=6),
        worker("moon", ["qwen2.5:0.5b"], memory_gb=6),
        worker("tv", ["llama3.2:3b", "gemma3:1b"], memory_gb=2),
    ]

    advice = advise(events, workers, since=SINCE, until=NOW)

    # moon has 5.65 GB of room: qwen3:8b (38 a day) takes 4.85 of it; of tv's two (20 a day
    # each) the larger, llama3.2:3b, would need 1.85, and gemma3:1b's 0.65 fits.
    assert [(p.model, p.worker) for p in advice.proposals if p.action == "pull"] == [
        ("qwen3:8b", "moon"),
        ("gemma3:1b", "moon"),
    ]
    assert [n.split(";")[-1] for n in advice.notes if n.startswith("llama3.2:3b")] == [
        " pulling gemma3:1b off makes room for it"
    ]


def test_the_window_must_end_after_it_starts() -> None:
    with pytest.raises(ValueError, match="must end after it starts"):
        advise([], [], since=NOW, until=NOW)


def test_advice_encodes_every_field() -> None:
    import msgspec

    from services.fleet.placement import encode

    advice = advise(thrashing_mac(), fleet(), since=SINCE, until=NOW)
    again = msgspec.json.decode(encode(advice), type=Advice)

    assert again == advice
