"""Every deduplication id the fleet's writes carry (``Nats-Msg-Id``), in one place.

JetStream stores a message whose id it has seen within the stream's duplicate window once, so
a write asked again after a lost answer (an outage, a restart, a second router) is stored
once. Each id names what is written and for which task and attempt; two writers whose writes
must both be kept use ids of their own.
"""

from __future__ import annotations


def submitted(task_id: str) -> str:
    """The router's ``submitted`` event of a task."""
    return f"{task_id}:submitted"


def routed(task_id: str, attempt: int) -> str:
    """The ``routed`` event of an attempt: the router's for attempt 1, the reaper's after."""
    return f"{task_id}:routed:{attempt}"


def routed_again_as_failed(task_id: str, attempt: int) -> str:
    """The reaper's copy of an attempt's ``routed`` event, written again to move its fence
    when it fails the attempt."""
    return f"{task_id}:routed:failed:{attempt}"


def task_message(task_id: str, attempt: int) -> str:
    """The task message of an attempt on its worker's queue."""
    return f"{task_id}:{attempt}"


def outcome(task_id: str, attempt: int, by: str | None = None) -> str:
    """One id for the outcomes one recorder (a worker ``by``, or the router and reaper) gives
    one attempt: JetStream keeps the first, drops the others. Per recorder, so that nobody's
    outcome can take the place of another's (readers keep an attempt's first accepted one)."""
    return f"{task_id}:{attempt}:outcome" if by is None else f"{task_id}:{attempt}:outcome:{by}"


def failed_before_routing(task_id: str, by: str) -> str:
    """A task failed before any attempt ran: by the ``router`` or on a ``wake`` timeout."""
    return f"{task_id}:failed:{by}"


def refused(task_id: str) -> str:
    """A router's refusal of a request that named its task (`services.router.submit.
    record_refusal`): another router's refusal of the same request, asked again, is not
    stored a second time."""
    return f"{task_id}:refused"


def model_changed(task_id: str, attempt: int) -> str:
    """The ``model_changed`` event a worker records after a change to its models."""
    return f"{task_id}:{attempt}:model_changed"


def registered(instance_id: str) -> str:
    """A worker process's ``registered`` event (asked again while JetStream is silent)."""
    return f"registered.{instance_id}"


def quality(task_id: str) -> str:
    """The judge's verdict on a task's answer: one per task."""
    return f"quality:{task_id}"


def exclusion_withdrawn(exclusion_id: str) -> str:
    """An exclusion's withdrawal (the exclusion itself is written under its own id)."""
    return f"{exclusion_id}:withdrawn"


def bench_event(run_id: str, kind: str, index: object) -> str:
    """One event of a benchmark run: its kind and its index in the run."""
    return f"{run_id}:{kind}:{index}"
