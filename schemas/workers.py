"""The ``workers`` KV bucket: one entry per live worker, refreshed by its heartbeat."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.base import Wire
from schemas.models import ModelFacts, facts_in

Capability = Literal["cpu_inference", "gpu_inference", "web_search"]
INFERENCE_CAPABILITIES = frozenset({"cpu_inference", "gpu_inference"})
HealthStatus = Literal["healthy", "degraded"]
"""What a worker's own probes of its backend say (`services.fleet.health`; lesson 13)."""


class WorkerRecord(Wire, frozen=True, kw_only=True):
    worker_id: str
    host: str
    instance_id: str
    pid: int
    version: str
    supports: list[Capability]
    models: list[str]
    started_at: float
    heartbeat_at: float
    state: Literal["idle", "busy", "stopping", "asleep"] = "idle"
    current_task: str | None = None
    current_model: str | None = None
    """The model of ``current_task`` (as of the last heartbeat)."""
    backend: str = "ollama"
    backend_url: str | None = None
    """Where the worker's model server answers (``coordinator doctor`` checks it)."""
    wol_mac: str | None = None
    """Wake-on-LAN address, for a machine that sleeps when idle."""
    facts: list[ModelFacts] = msgspec.field(default_factory=list)
    """What the backend says of each model in ``models`` (capabilities, digest, size,
    details). A model without an entry (a worker that predates this) is `ModelFacts`'s
    defaults: ``completion`` only."""
    health: HealthStatus = "healthy"
    """``degraded``: the worker's own probe (or a task) found its backend not working; nothing
    is routed to it until a probe passes. A worker that predates this says ``healthy``."""
    health_reason: str | None = None
    """Why it is degraded (always set then): the failed probe's or task's error."""
    health_since: float | None = None
    """When ``health`` last changed (the start, for a worker never degraded); None from a
    worker that does not probe its backend (a web-search worker, or one that predates this)."""
    resident: list[str] | None = None
    """The models its backend holds in memory now (of ``models``, by the same names), as
    of its last probe or task end (Ollama's ``/api/ps``): routing counts a cold load for any
    other model. None: the worker does not say (an OpenAI-compatible backend has no such
    list, a web-search worker runs no model, a worker that predates this), and routing
    counts no cold load for it."""
    model_memory: dict[str, int] = msgspec.field(default_factory=dict)
    """The memory (bytes) each of ``models`` took in the backend the last time the worker
    saw it loaded (Ollama's ``/api/ps`` ``size``); a model never seen loaded is left out
    (routing takes the file size in ``facts`` for it)."""
    memory_bytes: int | None = None
    """How much the backend holds of models before a load pushes one out: the worker's
    ``WORKER_MEMORY_GB``, else the largest total of ``model_memory`` seen in memory at once
    since it started. None: not known (routing counts no eviction)."""
    max_resident: int | None = None
    """The most models seen in memory at once since the worker started (Ollama also caps
    their number: ``OLLAMA_MAX_LOADED_MODELS``, 3 per GPU by default). None: not known."""

    def facts_of(self, model: str) -> ModelFacts:
        """The facts of one of ``models`` (defaults when the worker gave none)."""
        return facts_in(self.facts, model)


worker_record_decoder = msgspec.json.Decoder(WorkerRecord)
