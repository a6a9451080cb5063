"""The dashboard's and the metrics' pure parts: the task board folded from events, the metric
updates of each change, the bench history, the sections the page renders (while the registry
settles, and once it has), and the registry view the feed keeps."""

from __future__ import annotations

from collections.abc import Collection

import msgspec
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from schemas.events import (
    AnyEvent,
    BenchFinished,
    BenchResult,
    BenchStarted,
    Durations,
    TaskCompleted,
    TaskFailed,
    TaskRouted,
    TaskStarted,
    TaskSubmitted,
    Tokens,
    WorkerDuplicate,
    subject_for,
)
from schemas.queries import WorkerView
from schemas.stats import Baseline
from schemas.work import Work
from schemas.workers import WorkerRecord
from services.gateway.bench_history import BenchHistory
from services.gateway.board import Ended, ReaperAction, Submitted, TaskBoard, percentile
from services.gateway.dashboard_view import Known, forget_departed, gauges, sections
from services.gateway.feed import KnownWorkers
from services.gateway.metrics import FleetMetrics, Gauges, WorkerGauge
from services.runtime.registry import WorkersView

SUPPORTS: dict[str, list[str]] = {"cpu-1": ["cpu_inference"], "cpu-2": ["cpu_inference"]}


def supports(worker_id: str) -> Collection[str] | None:
    return SUPPORTS.get(worker_id)


def board() -> TaskBoard:
    return TaskBoard(supports=supports)


def fold(b: TaskBoard, *events: AnyEvent, by: str | None = None) -> list[object]:
    changes: list[object] = []
    for event in events:
        changes += b.apply(event, subject_for(event, by))
    return changes


def submitted(task: str = "t1", model: str = "m", at: float = 1.0) -> TaskSubmitted:
    return TaskSubmitted(
        at=at, task_id=task, model=model, timeout_s=60, work=Work(prompt="secret prompt")
    )


def routed(
    task: str = "t1", worker: str = "cpu-1", attempt: int = 1, at: float = 1.1
) -> TaskRouted:
    queue = "tasks.cpu.shared" if worker == "shared" else f"tasks.cpu.{worker}"
    return TaskRouted(at=at, task_id=task, attempt=attempt, worker=worker, queue=queue, reason="r")


def started(task: str = "t1", worker: str = "cpu-1", attempt: int = 1) -> TaskStarted:
    return TaskStarted(at=2.0, task_id=task, attempt=attempt, worker=worker, host="h")


def completed(
    task: str = "t1", worker: str = "cpu-1", attempt: int = 1, total_ms: float = 1000.0, **d: float
) -> TaskCompleted:
    return TaskCompleted(
        at=3.0,
        task_id=task,
        attempt=attempt,
        worker=worker,
        model="m",
        response="secret answer",
        durations=Durations(total_ms=total_ms, **d),
        tokens=Tokens(prompt=5, eval=40),
    )


def failed(
    task: str = "t1", worker: str | None = "cpu-1", code: str = "backend_error", attempt: int = 1
) -> TaskFailed:
    return TaskFailed(at=4.0, task_id=task, attempt=attempt, worker=worker, code=code, reason="why")


def test_a_task_is_queued_then_running_then_done() -> None:
    b = board()
    assert fold(b, submitted()) == [Submitted("t1", "m", "inference")]
    fold(b, routed())
    assert [(t.status, t.routed_to) for t in b.open_lines()] == [("queued", "cpu-1")]
    fold(b, started(), by="cpu-1")
    line = b.line("t1")
    assert line is not None and (line.status, line.worker, line.started_at) == (
        "running",
        "cpu-1",
        2.0,
    )
    [ended] = fold(b, completed(load_ms=1500.0, eval_ms=500.0, first_token_ms=1600.0))
    assert isinstance(ended, Ended)
    assert (ended.outcome, ended.model, ended.worker, ended.kind) == (
        "done",
        "m",
        "cpu-1",
        "inference",
    )
    assert not b.open and [d.task_id for d in b.done] == ["t1"]
    [sample] = b.samples
    assert (sample.total_ms, sample.p50_ms, sample.p95_ms, sample.tokens_per_s) == (
        1000,
        1000,
        1000,
        80,
    )
    assert b.cold_loads == {("m", "cpu-1"): 1}


def test_a_failure_is_kept_with_its_code_and_message_and_a_second_outcome_is_ignored() -> None:
    b = board()
    fold(b, submitted(), routed(), started())
    [ended] = fold(b, failed(), by="cpu-1")
    assert isinstance(ended, Ended) and (ended.outcome, ended.message) == ("backend_error", "why")
    assert fold(b, completed()) == []  # the attempt has ended
    assert [f.outcome for f in b.failures] == ["backend_error"] and not b.done


def test_a_worker_may_not_record_an_attempt_routed_elsewhere() -> None:
    b = board()
    fold(b, submitted(), routed(worker="cpu-1"))
    assert fold(b, completed(worker="cpu-2")) == []  # on cpu-2's own subject
    assert b.refused == 1 and b.open


def test_a_pool_member_may_record_a_shared_queues_attempt() -> None:
    b = board()
    fold(b, submitted(), routed(worker="shared"), started(worker="cpu-2"))
    [ended] = fold(b, completed(worker="cpu-2"))
    assert isinstance(ended, Ended) and ended.worker == "cpu-2"


def test_the_reapers_moves_and_failures_are_actions_and_stale_outcomes_change_nothing() -> None:
    b = board()
    fold(b, submitted(), routed(), started())
    [move] = fold(b, routed(worker="cpu-2", attempt=2, at=5.0))
    assert move == ReaperAction("moved", "r", 5.0, task_id="t1", attempt=2, worker="cpu-2")
    assert fold(b, completed(worker="cpu-1", attempt=1)) == []  # the old attempt: stale
    assert [t.status for t in b.open_lines()] == ["queued"]
    ended, action = fold(b, failed(worker="cpu-2", code="stuck_task", attempt=2), by=None)
    assert isinstance(ended, Ended) and isinstance(action, ReaperAction)
    assert (action.action, action.reason) == ("failed", "stuck_task")
    # The router's own failures are not the reaper's.
    fold(b, submitted("t2"), routed("t2"))
    changes = fold(b, failed("t2", code="wake_timeout"), by=None)
    assert [type(c) for c in changes] == [Ended]
    [dup] = fold(b, WorkerDuplicate(at=6.0, worker_id="cpu-1", reason="two instances"))
    assert isinstance(dup, ReaperAction) and dup.action == "duplicate"
    assert [a.action for a in b.actions] == ["moved", "failed", "duplicate"]


def test_a_task_routed_before_the_log_was_read_takes_its_model_from_the_routed_event() -> None:
    b = board()
    event = msgspec.structs.replace(routed(), model="qwen")
    fold(b, event)
    [line] = b.open_lines()
    assert (line.model, line.kind) == ("qwen", "unknown")


def test_open_tasks_whose_end_was_never_read_are_forgotten() -> None:
    b = board()
    fold(b, submitted("old", at=1.0), submitted("new", at=100.0))
    assert b.prune(before=50.0) == 1
    assert [t.task_id for t in b.open_lines()] == ["new"]


def test_the_window_percentiles_interpolate_as_postgres_does() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([10.0], 0.95) == 10.0
    assert round(percentile([float(i) for i in range(1, 21)], 0.95), 2) == 19.05


def metric(metrics: FleetMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_changes_update_the_counters_and_histograms() -> None:
    metrics = FleetMetrics(Gauges)
    b = board()
    for event, by in (
        (submitted(), None),
        (routed(), None),
        (started(), "cpu-1"),
        (completed(load_ms=2000.0, eval_ms=400.0, first_token_ms=2100.0), "cpu-1"),
        (submitted("t2"), None),
        (routed("t2"), None),
        (failed("t2", code="backend_timeout"), "cpu-1"),
        (routed("t2", worker="cpu-2", attempt=2), None),
    ):
        metrics.read(subject_for(event, by))
        for change in b.apply(event, subject_for(event, by)):
            metrics.count(change)
    labels = {"model": "m", "worker": "cpu-1"}
    assert metric(metrics, "coordinator_tasks_submitted_total", model="m", kind="inference") == 2
    done = {**labels, "kind": "inference", "outcome": "done"}
    assert metric(metrics, "coordinator_task_outcomes_total", **done) == 1
    timeout = {**labels, "kind": "inference", "outcome": "backend_timeout"}
    assert metric(metrics, "coordinator_task_outcomes_total", **timeout) == 1
    histogram = {**labels, "kind": "inference"}
    assert metric(metrics, "coordinator_task_duration_seconds_count", **histogram) == 1
    assert metric(metrics, "coordinator_task_duration_seconds_sum", **histogram) == 1.0
    assert metric(metrics, "coordinator_time_to_first_token_seconds_sum", **labels) == 2.1
    assert metric(metrics, "coordinator_cold_loads_total", **labels) == 1
    assert metric(metrics, "coordinator_generated_tokens_total", **labels) == 40
    assert metric(metrics, "coordinator_generation_seconds_total", **labels) == 0.4
    assert metric(metrics, "coordinator_reaper_actions_total", action="moved", reason="r") == 1
    assert metric(metrics, "coordinator_events_read_total", family="task") == 8


def test_a_warm_run_is_no_cold_load() -> None:
    metrics = FleetMetrics(Gauges)
    b = board()
    for event in (submitted(), routed(), completed(load_ms=12.0)):
        for change in b.apply(event, subject_for(event)):
            metrics.count(change)
    labels = {"model": "m", "worker": "cpu-1"}
    assert metric(metrics, "coordinator_cold_loads_total", **labels) is None
    assert metric(metrics, "coordinator_model_load_seconds_count", **labels) == 1


def test_the_gauges_come_from_the_snapshot_of_each_scrape() -> None:
    snapshot = Gauges(
        workers=[
            WorkerGauge(
                worker="a", up=True, healthy=False, in_flight=1, heartbeat_age_s=0.5, queue_depth=3
            ),
            WorkerGauge(worker="b", up=False, healthy=True, in_flight=0, heartbeat_age_s=9.0),
        ],
        open_tasks={"queued": 2, "running": 1},
        event_log_messages=120,
        event_log_bytes=4096,
        event_log_last_seq=130,
        stats_lag=4,
        projected_seq=129,
    )
    metrics = FleetMetrics(lambda: snapshot)
    text = generate_latest(metrics.registry).decode()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert values[("coordinator_worker_up", (("worker", "a"),))] == 1
    assert values[("coordinator_worker_up", (("worker", "b"),))] == 0
    assert values[("coordinator_worker_healthy", (("worker", "a"),))] == 0
    assert values[("coordinator_worker_in_flight", (("worker", "a"),))] == 1
    assert values[("coordinator_worker_queue_depth", (("worker", "a"),))] == 3
    assert ("coordinator_worker_queue_depth", (("worker", "b"),)) not in values
    assert values[("coordinator_tasks_open", (("status", "queued"),))] == 2
    assert values[("coordinator_event_log_messages", ())] == 120
    assert values[("coordinator_event_log_bytes", ())] == 4096
    assert values[("coordinator_stats_lag_events", ())] == 4
    assert values[("coordinator_gateway_projected_sequence", ())] == 129
    # Unknown state leaves its gauge out rather than report a zero.
    bare = generate_latest(FleetMetrics(Gauges).registry).decode()
    assert "coordinator_event_log_messages" not in bare


def bench_events(run: str, at: float, totals: list[float], slow: bool) -> list[AnyEvent]:
    results: list[AnyEvent] = [
        BenchResult(
            at=at,
            run_id=run,
            index=i,
            model="m",
            worker="cpu-1",
            domain="math",
            prompt_key=f"p{i}",
            prompt_name=f"p{i}",
            ok=True,
            total_ms=total,
        )
        for i, total in enumerate(totals)
    ]
    failure = BenchResult(
        at=at,
        run_id=run,
        index=9,
        model="m",
        worker="cpu-1",
        domain="code",
        prompt_key="px",
        prompt_name="px",
        ok=False,
        error="timed out",
    )
    return [
        BenchStarted(at=at, run_id=run, models=["m"], workers=["cpu-1"], prompts=3),
        *results,
        failure,
        BenchFinished(at=at, run_id=run, ok=2, failed=1, slow=["m (cpu-1)"] if slow else []),
    ]


def test_the_bench_history_per_worker_with_its_baseline_and_slow_runs() -> None:
    history = BenchHistory()
    for event in [
        *bench_events("r1", 10.0, [100.0, 300.0], slow=False),
        *bench_events("r2", 20.0, [500.0, 700.0], slow=True),
    ]:
        assert history.apply(event)
    assert not history.apply(submitted())
    assert history.models() == ["m"]
    baselines = [
        Baseline(model="m", worker="cpu-1", prompt_key="p0", median_ms=100.0, runs=3),
        Baseline(model="m", worker="cpu-1", prompt_key="p1", median_ms=300.0, runs=3),
    ]
    [series] = history.series(baselines)
    assert (series.model, series.worker, series.baseline_ms) == ("m", "cpu-1", 200.0)
    assert [(p.run_id, p.median_ms, p.done, p.failed, p.slow) for p in series.points] == [
        ("r1", 200.0, 2, 1, False),
        ("r2", 600.0, 2, 1, True),
    ]
    assert history.series([])[0].baseline_ms is None


def record(worker_id: str, heartbeat_at: float, **fields: object) -> WorkerRecord:
    return msgspec.convert(
        {
            "worker_id": worker_id,
            "host": f"host-{worker_id}",
            "instance_id": "i",
            "pid": 1,
            "version": "0.1.0",
            "supports": ["cpu_inference"],
            "models": ["m", "n"],
            "started_at": 0.0,
            "heartbeat_at": heartbeat_at,
            **fields,
        },
        WorkerRecord,
    )


def test_the_sections_show_live_lost_and_gone_workers_with_their_task_and_queue() -> None:
    b = board()
    fold(b, submitted(), routed(), started())
    known = Known(board=b, bench=BenchHistory())
    known.records = {
        "cpu-1": record(
            "cpu-1",
            99.5,
            state="busy",
            current_task="t1",
            current_model="m",
            resident=["m"],
            health="degraded",
            health_reason="hung",
        ),
        "cpu-2": record("cpu-2", 90.0),
        "cpu-3": record("cpu-3", 99.0),
    }
    known.gone = {"cpu-3": 99.2}
    known.views = {
        "cpu-1": WorkerView(
            worker_id="cpu-1",
            host="h",
            tier="cpu",
            models=["m"],
            state="busy",
            last_heartbeat=99.5,
            queue_depth=2,
            problems=["duplicate"],
        )
    }
    doc = msgspec.json.decode(msgspec.json.encode(sections(known, now=100.0, ttl_s=3.0)))
    rows = {w["worker_id"]: w for w in doc["workers"]}
    one = rows["cpu-1"]
    assert (one["state"], one["tier"], one["health"], one["health_reason"]) == (
        "busy",
        "cpu",
        "degraded",
        "hung",
    )
    assert (one["current_task"], one["task_started_at"], one["queue_depth"]) == ("t1", 2.0, 2)
    assert (one["resident"], one["problems"]) == (["m"], ["duplicate"])
    assert rows["cpu-2"]["state"] == "lost" and rows["cpu-2"]["queue_depth"] is None
    assert rows["cpu-3"]["state"] == "gone"
    assert doc["summary"]["live"] == 1 and doc["summary"]["running"] == 1
    assert [t["status"] for t in doc["tasks"]["open"]] == ["running"]
    # Neither prompts nor answers go to the page.
    fold(b, completed())
    text = msgspec.json.encode(sections(known, now=100.0, ttl_s=3.0))
    assert b"secret" not in text
    snapshot = gauges(known, now=100.0, ttl_s=3.0)
    assert [(w.worker, w.up, w.healthy, w.queue_depth) for w in snapshot.workers] == [
        ("cpu-1", True, False, 2),
        ("cpu-2", False, True, None),
    ]
    forget_departed(known, now=100.0 + 700.0, ttl_s=3.0)
    assert known.records == {} and known.gone == {}


def test_no_worker_is_lost_while_the_registry_settles_and_a_stale_one_is_once_settled() -> None:
    """After a reconnect the records are those from before the outage, their heartbeats stale:
    until the view has settled each worker shows its last recorded state, up in the gauges;
    a stopping worker is still not up, a gone one still gone."""
    b = board()
    fold(b, submitted(), routed(), started())
    known = Known(board=b, bench=BenchHistory(), settled=False)
    known.records = {
        "cpu-1": record("cpu-1", 90.0, state="busy", current_task="t1", current_model="m"),
        "cpu-2": record("cpu-2", 90.0),
        "cpu-3": record("cpu-3", 90.0, state="stopping"),
        "cpu-4": record("cpu-4", 90.0),
    }
    known.gone = {"cpu-4": 90.5}

    def shown() -> tuple[dict[str, tuple[str, str | None]], int]:
        doc = msgspec.json.decode(msgspec.json.encode(sections(known, now=100.0, ttl_s=3.0)))
        rows = {w["worker_id"]: (w["state"], w["current_task"]) for w in doc["workers"]}
        return rows, doc["summary"]["live"]

    def up() -> list[tuple[str, bool, int]]:
        return [(w.worker, w.up, w.in_flight) for w in gauges(known, 100.0, 3.0).workers]

    assert shown() == (
        {
            "cpu-1": ("busy", "t1"),
            "cpu-2": ("idle", None),
            "cpu-3": ("stopping", None),
            "cpu-4": ("gone", None),
        },
        3,
    )
    assert up() == [("cpu-1", True, 1), ("cpu-2", True, 0), ("cpu-3", False, 0)]

    known.settled = True
    assert shown() == (
        {
            "cpu-1": ("lost", None),
            "cpu-2": ("lost", None),
            "cpu-3": ("stopping", None),
            "cpu-4": ("gone", None),
        },
        1,
    )
    assert up() == [("cpu-1", False, 0), ("cpu-2", False, 0), ("cpu-3", False, 0)]


def test_a_silent_worker_is_forgotten_only_once_the_registry_has_settled() -> None:
    known = Known(board=board(), bench=BenchHistory(), settled=False)
    known.records = {"cpu-1": record("cpu-1", 90.0), "cpu-2": record("cpu-2", 90.0)}
    known.gone = {"cpu-2": 90.0}
    forget_departed(known, now=90.0 + 700.0, ttl_s=3.0)
    assert list(known.records) == ["cpu-1"] and known.gone == {}
    known.settled = True
    forget_departed(known, now=90.0 + 700.0, ttl_s=3.0)
    assert known.records == {}


def test_the_dashboards_registry_keeps_a_worker_that_left_as_gone() -> None:
    """The view `RegistryFeed` keeps for the dashboard: a removed worker stays listed, gone
    since its removal, and out of the registry's records; every change marks the feed."""
    known = Known(board=board(), bench=BenchHistory())
    changes: list[None] = []
    view: WorkersView = KnownWorkers(known, lambda: changes.append(None))
    view.put_worker(record("cpu-1", 10.0))
    view.put_worker(record("cpu-2", 10.0))
    view.remove_worker("cpu-2")
    view.remove_worker("cpu-9")  # never known: nothing to list
    assert set(known.records) == {"cpu-1", "cpu-2"} and set(known.gone) == {"cpu-2"}
    assert [r.worker_id for r in view.records()] == ["cpu-1"]
    view.put_worker(record("cpu-2", 11.0))  # back
    assert known.gone == {} and [r.worker_id for r in view.records()] == ["cpu-1", "cpu-2"]
    assert len(changes) == 5
