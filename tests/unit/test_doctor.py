"""``coordinator doctor``'s checks, on what was gathered (no servers), and its unit scan."""

from __future__ import annotations

import datetime
from pathlib import Path

from nats.js.api import ConsumerConfig, ConsumerInfo, StreamConfig, StreamInfo, StreamState

from schemas.workers import WorkerRecord
from services.cli.doctor_checks import (
    REBUILD_ADVICE,
    ReadModel,
    check_duplicates,
    check_ghost_queues,
    check_read_model,
    check_registrations,
    check_units,
    check_versions,
    subject_matches,
)
from services.cli.doctor_line import Check
from services.cli.unit_scan import scan_unit_dirs

NOW = 1_000_000.0


def record(worker_id: str, *, age_s: float = 1.0, version: str = "1.0") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id,
        host=f"host-{worker_id}",
        instance_id="i",
        pid=1,
        version=version,
        supports=["cpu_inference"],
        models=["m"],
        started_at=NOW - 100,
        heartbeat_at=NOW - age_s,
    )


def consumer(name: str, filter_subject: str, *, pending: int = 0, waiting: int = 0) -> ConsumerInfo:
    return ConsumerInfo(
        name=name,
        stream_name="TASKS",
        config=ConsumerConfig(durable_name=name, filter_subject=filter_subject, max_ack_pending=1),
        created=datetime.datetime.now(datetime.UTC),
        num_pending=pending,
        num_ack_pending=0,
        num_waiting=waiting,
    )


def test_subject_matching_follows_nats_wildcards() -> None:
    assert subject_matches("tasks.*.cpu1", "tasks.gpu.cpu1")
    assert not subject_matches("tasks.*.cpu1", "tasks.gpu.cpu2")
    assert subject_matches("tasks.>", "tasks.cpu.shared")
    assert not subject_matches("tasks.cpu.shared", "tasks.cpu")
    assert not subject_matches("tasks.>", "tasks")


def test_a_queue_with_tasks_and_no_live_worker_is_a_ghost() -> None:
    consumers = {
        "TASKS": [
            consumer("worker-cpu1", "tasks.*.cpu1", pending=2),
            consumer("worker-moon", "tasks.*.moon", pending=1),
        ]
    }
    subjects = {"tasks.cpu.cpu1": 2, "tasks.cpu.moon": 1, "tasks.gpu.moon": 3}
    check = check_ghost_queues(consumers, subjects, [record("cpu1")], NOW, 15.0)
    assert check.status == "problem"
    assert "worker-moon: 1 task(s) waiting, worker moon is not live" in check.detail
    assert "cpu1" not in check.detail  # busy, but alive
    # A subject no consumer takes (routed to a queue nobody pulls) is a ghost too.
    only_cpu = {"TASKS": [consumer("worker-moon", "tasks.cpu.moon")]}
    check = check_ghost_queues(only_cpu, subjects, [record("moon")], NOW, 15.0)
    assert "tasks.gpu.moon: 3 task(s) waiting, no consumer takes them" in check.detail


def test_two_pulls_waiting_on_a_worker_consumer_is_a_duplicate() -> None:
    consumers = {
        "TASKS": [
            consumer("worker-esxi", "tasks.*.esxi", waiting=2),
            consumer("cpu-shared", "tasks.cpu.shared", waiting=5),
            consumer("worker-moon", "tasks.*.moon", waiting=1),
        ]
    }
    check = check_duplicates(consumers)
    assert check.status == "problem"
    assert "worker-esxi has 2 pulls waiting" in check.detail
    assert "shared" not in check.detail and "moon" not in check.detail


def test_stale_registrations_and_version_skew_are_named() -> None:
    records = [record("cpu1"), record("old1", age_s=400.0, version="0.9")]
    check = check_registrations(records, NOW, 15.0)
    assert check.status == "problem" and "old1 on host-old1" in check.detail
    assert "cpu1" not in check.detail
    skew = check_versions(records, [("coordinator-router", "x", "1.0")])
    assert skew.status == "problem"
    assert "0.9: worker old1" in skew.detail
    assert check_versions([record("a")], [("coordinator-router", "x", "1.0")]).status == "ok"


def unit(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def test_two_units_running_the_same_worker_are_found(tmp_path: Path) -> None:
    system = tmp_path / "system"
    system.mkdir()
    # The incident: an old unit left enabled beside the new one, both without a WORKER_ID.
    unit(
        system, "ollama-worker.service", "[Service]\nExecStart=/home/u/venv/bin/python worker.py\n"
    )
    unit(
        system,
        "coordinator-worker.service",
        "[Service]\nExecStart=/home/u/venv/bin/python /home/u/worker.py\nRestart=always\n",
    )
    # A template and an enabled instance of it, plus a unit that names the same id by hand.
    template = unit(
        system,
        "coordinator-worker@.service",
        "[Service]\nExecStart=/usr/bin/env WORKER_ID=%i /opt/c/bin/coordinator worker\n",
    )
    wants = system / "multi-user.target.wants"
    wants.mkdir()
    (wants / "coordinator-worker@cpu1.service").symlink_to(template)
    env = unit(tmp_path, "cpu1.env", "NATS_URL=nats://bus:4222\nWORKER_ID=cpu1\n")
    unit(
        system,
        "old-cpu1.service",
        f"[Service]\nEnvironmentFile={env}\nExecStart=/opt/c/bin/coordinator worker\n",
    )
    unit(system, "nginx.service", "[Service]\nExecStart=/usr/sbin/nginx\n")
    found = scan_unit_dirs([system, tmp_path / "missing"], default_id="esxi")
    assert found == {
        "esxi": ["coordinator-worker.service", "ollama-worker.service"],
        "cpu1": ["coordinator-worker@cpu1.service", "old-cpu1.service"],
    }
    check = check_units(found)
    assert check.status == "problem"
    assert "worker esxi is started by 2 units" in check.detail


def test_one_unit_per_worker_is_fine(tmp_path: Path) -> None:
    unit(
        tmp_path,
        "coordinator-worker@.service",
        "[Service]\nExecStart=/usr/bin/env WORKER_ID=%i /opt/c/bin/coordinator worker\n",
    )
    wants = tmp_path / "multi-user.target.wants"
    wants.mkdir()
    for worker in ("cpu1", "cpu2"):
        (wants / f"coordinator-worker@{worker}.service").symlink_to(
            tmp_path / "coordinator-worker@.service"
        )
    unit(
        tmp_path,
        "coordinator-router.service",
        "[Service]\nExecStart=/opt/c/bin/coordinator router\n",
    )
    found = scan_unit_dirs([tmp_path], default_id="box")
    assert found == {
        "cpu1": ["coordinator-worker@cpu1.service"],
        "cpu2": ["coordinator-worker@cpu2.service"],
    }
    assert check_units(found).status == "ok"
    assert check_units(None).status == "skipped"


def events_ending_at(last_seq: int) -> StreamInfo:
    return StreamInfo(
        config=StreamConfig(name="EVENTS", subjects=["events.>"]),
        state=StreamState(
            messages=last_seq, bytes=0, first_seq=1, last_seq=last_seq, consumer_count=1
        ),
    )


def test_a_read_model_that_holds_what_events_holds_is_fine() -> None:
    model = ReadModel(handled=40, last_seq=40, last_matches=True)

    assert check_read_model(model, events_ending_at(42)) == [
        Check("read model", "ok", "40 events of EVENTS handled, up to #40 of #42")
    ]


def test_a_read_model_beyond_the_end_of_events_says_the_log_was_restored_or_replaced() -> None:
    [check] = check_read_model(
        ReadModel(handled=16, last_seq=16, last_matches=None), events_ending_at(8)
    )

    assert check.status == "problem"
    assert check.detail == (
        "it has applied EVENTS up to #16, but EVENTS ends at #8: EVENTS was recreated or "
        "restored from an older copy, and the events it applied at #9–#16 are no longer in it; "
        f"{REBUILD_ADVICE}"
    )


def test_another_event_where_the_read_model_applied_its_last_says_events_was_recreated() -> None:
    [check] = check_read_model(
        ReadModel(handled=12, last_seq=12, last_matches=False), events_ending_at(30)
    )

    assert check.status == "problem"
    assert "the event it applied at #12 is not the one EVENTS holds there" in check.detail
    assert check.detail.endswith(REBUILD_ADVICE)


def test_events_of_a_log_events_no_longer_holds_are_named_until_a_rebuild() -> None:
    model = ReadModel(
        handled=24,
        last_seq=24,
        last_matches=True,
        replaced=12,
        replaced_from=1,
        replaced_at=NOW,
    )

    [check] = check_read_model(model, events_ending_at(24))

    assert check.status == "problem"
    assert "it still counts 12 event(s) of an event log EVENTS no longer holds" in check.detail
    assert "(EVENTS held others from #1 on, seen " in check.detail


def test_parked_events_are_a_warning_with_the_newest_error() -> None:
    model = ReadModel(
        handled=10,
        last_seq=10,
        last_matches=True,
        parked=2,
        newest_parked="#7 exclusion_added: time 1e+308 is out of range",
    )

    checks = check_read_model(model, events_ending_at(10))

    assert [(c.name, c.status) for c in checks] == [
        ("read model", "ok"),
        ("parked events", "warning"),
    ]
    assert checks[1].detail.startswith(
        "2 event(s) cannot be projected and count in no figure; the newest: #7 exclusion_added: "
        "time 1e+308 is out of range (`coordinator stats parked` lists them"
    )
    assert checks[1].line().startswith("warning  parked events")


def test_without_the_events_stream_only_parked_events_are_told() -> None:
    model = ReadModel(handled=0, last_seq=0, last_matches=None, parked=1, newest_parked="#1 x: y")

    assert [c.name for c in check_read_model(model, None)] == ["parked events"]
