"""What a worker's backend holds in memory, as routing plays the loads ahead of a task and
its own (`services.fleet.policy.outlook`). Pure: no I/O.

The worker says which models its backend holds (`schemas.workers.WorkerRecord.resident`,
and the one it runs, ``current_model``), what each took when last loaded there
(``model_memory``; else the file size in ``facts``), and the limits it knows of: how many
bytes (``memory_bytes``) and how many models (``max_resident``) the backend holds before a
load pushes one out. Which model goes first is the backend's choice, and Ollama's (the
shortest ``keep_alive``, then by the path of its file) is not visible from here, so the
models go in the order the worker lists them, then the one it runs, then those loaded since,
each used model moving to the back; ``benchmarks/fleet_sim`` measures routing against
Ollama's order and against the least recently used first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from schemas.workers import WorkerRecord


class HeldModels:
    """The models one worker's backend holds, first those a load would push out first."""

    __slots__ = ("_bytes", "_held", "_limit_bytes", "_limit_models", "_record", "loaded_ms")

    def __init__(self, record: WorkerRecord, resident: Iterable[str]) -> None:
        running = record.current_model
        held = [m for m in resident if m != running]
        if running is not None:
            held.append(running)
        self._record = record
        self._held = held
        self._bytes: int | None = None  # summed when a load first needs it
        limit = record.memory_bytes
        self._limit_bytes = math.inf if limit is None else limit
        most = record.max_resident
        self._limit_models = math.inf if most is None else most
        self.loaded_ms = 0.0
        """What the loads `use` made cost."""

    def holds(self, model: str) -> bool:
        return model in self._held

    def use(self, model: str, load_ms: float) -> None:
        """A task of ``model`` runs: a model in memory moves to the back, one that is not is
        loaded (at ``load_ms``, added to `loaded_ms`)."""
        held = self._held
        if model in held:
            if held[-1] != model:
                held.remove(model)
                held.append(model)
        else:
            self.load(model)
            self.loaded_ms += load_ms

    def load(self, model: str) -> list[str]:
        """Load ``model`` (not in memory): the models that pushes out, first to go first."""
        held = self._held
        pushed_out: list[str] = []
        limit_bytes, limit_models = self._limit_bytes, self._limit_models
        if limit_bytes != math.inf or limit_models != math.inf:
            size = self._size
            total = self._bytes
            if total is None:
                total = sum(size(m) for m in held)
            need = size(model)
            while held and (total + need > limit_bytes or len(held) >= limit_models):
                gone = held.pop(0)
                total -= size(gone)
                pushed_out.append(gone)
            self._bytes = total + need
        held.append(model)
        return pushed_out

    def _size(self, model: str) -> int:
        size = self._record.model_memory.get(model)
        return size if size is not None else self._record.facts_of(model).size
