"""The ``workers`` KV bucket: one entry per live worker, refreshed by its heartbeat."""

from __future__ import annotations

from typing import Literal

import msgspec

from schemas.base import Wire

Capability = Literal["cpu_inference", "gpu_inference", "web_search"]
INFERENCE_CAPABILITIES = frozenset({"cpu_inference", "gpu_inference"})


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


worker_record_decoder = msgspec.json.Decoder(WorkerRecord)
