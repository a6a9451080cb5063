"""Where a route request goes, and the task it becomes. Pure: no I/O, no clock.

`decide` applies the fleet's routing policy (`services.fleet.policy`) to the router's view: a
web search goes to the shared web queue; anything else to the live worker the policy
chooses, with the figures the stats service publishes for the model and the request's
domain; and when no live worker can take it, to a sleeping worker that can, to be woken.
`Submission` is the task that decision makes, as the router records and queues it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from schemas.models import needs_of
from schemas.route import RouteRequest
from schemas.work import Work
from schemas.workers import INFERENCE_CAPABILITIES, WorkerRecord
from services.errors import BadRequest, NoWorker, UnsupportedCapability, WorkerUnavailable
from services.fleet import policy
from services.fleet.domains import classify_domain
from services.fleet.identity import asker_of
from services.router.view import FleetView


@dataclass(frozen=True, slots=True)
class Plan:
    """Where the task goes, and the sleeping worker to wake for it (None: a live one)."""

    decision: policy.Decision
    waking: WorkerRecord | None = None
    domain: str | None = None
    """The domain the decision used (None for a web search), recorded with the routing."""


def decide(
    request: RouteRequest,
    live: Collection[WorkerRecord],
    sleepers: Collection[WorkerRecord],
    view: FleetView,
    *,
    gpu_models: Collection[str],
    gpu_preference: float = policy.DEFAULT_GPU_PREFERENCE,
) -> Plan:
    """The plan for ``request`` (its model canonical), given the ``live`` workers; raises
    `NoWorker` (or `UnsupportedCapability`) when neither a live nor a sleeping worker can
    take it."""
    if request.task_type == "web_search":
        return Plan(policy.choose_web(live))
    if request.task_type == "model_change":
        return _machine_of(request, live, sleepers)
    domain = request.domain or classify_domain(request.prompt)
    needs = needs_of(request)
    candidates = [w.worker_id for w in live if request.model in w.models]
    try:
        decision = policy.choose(
            request.model,
            live,
            designated=request.worker,
            gpu_models=gpu_models,
            gpu_preference=gpu_preference,
            estimates=view.figures.estimates(request.model, domain, candidates, view.queued()),
            needs=needs,
        )
    except (NoWorker, UnsupportedCapability):
        sleeper = policy.choose_sleeper(
            request.model, sleepers, designated=request.worker, needs=needs
        )
        if sleeper is None:
            raise
        woken = policy.decision_for(sleeper, "sleeping worker woken for the task")
        return Plan(woken, sleeper, domain)
    return Plan(decision, domain=domain)


def _machine_of(
    request: RouteRequest, live: Collection[WorkerRecord], sleepers: Collection[WorkerRecord]
) -> Plan:
    """A change to one machine's models goes to that machine's inference worker, whatever it
    serves (a pull brings a model it does not have): live, or asleep and woken for it."""
    for group, reason in ((live, "a change to its models"), (sleepers, "woken for a change")):
        for record in group:
            if record.worker_id != request.worker:
                continue
            if not INFERENCE_CAPABILITIES.intersection(record.supports):
                raise WorkerUnavailable(f"worker '{record.worker_id}' runs no models to change")
            plan = policy.decision_for(record, reason)
            return Plan(plan) if group is live else Plan(plan, record)
    raise WorkerUnavailable(f"worker '{request.worker}' is not registered and alive")


@dataclass(frozen=True, slots=True, kw_only=True)
class Submission:
    """One route request as the task it becomes: what is recorded, queued and waited on."""

    task_id: str
    request: RouteRequest
    """As routed: the model's canonical name (`services.router.requests.as_routed`)."""
    work: Work
    """What the client asked the backend for, taken from ``request`` once: the ``submitted``
    event and the task message nest this one value."""
    asked_model: str
    """The model as the client named it."""
    plan: Plan
    timeout_s: float
    submitted_at: float
    stream_subject: str | None
    """Where the chunks of a streamed answer go (the request's reply subject)."""
    asker: str | None = None
    """The identity that asked (`services.fleet.identity.asker_of` of the reply subject)."""

    @property
    def decision(self) -> policy.Decision:
        return self.plan.decision

    @property
    def waits(self) -> bool:
        """Does the client wait for the task's end (``wait``, or a stream's final reply)?"""
        return self.request.wait or self.request.stream

    @property
    def requested_model(self) -> str | None:
        """The name the client asked for, when routing resolved it to another."""
        return self.asked_model if self.asked_model != self.request.model else None


def submission(
    task_id: str,
    request: RouteRequest,
    plan: Plan,
    *,
    asked_model: str,
    now: float,
    default_timeout_s: float,
    reply_to: str,
) -> Submission:
    """The task ``request`` becomes under ``plan``; a stream needs a reply subject
    (``reply_to``) to send its chunks to."""
    stream_subject = reply_to if request.stream else None
    if request.stream and not stream_subject:
        raise BadRequest("stream=true needs a reply subject to send the chunks to")
    return Submission(
        task_id=task_id,
        request=request,
        work=request.work,
        asked_model=asked_model,
        plan=plan,
        timeout_s=request.timeout_s or default_timeout_s,
        submitted_at=now,
        stream_subject=stream_subject,
        asker=asker_of(reply_to),
    )
