"""The fleet's model matrix (`coordinator models`, the dashboard's models): which live worker
has which model, its copy there (size, quantisation, digest), whether its backend holds it
in memory now, when it last ran a task there and how fast, and the models whose copies differ
by digest under one name. Built from the router's workers reply and the stats service's
figures; and who holds a model, and its size there, for a change to the machines' models
(`holds`, `known_size`). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from schemas.models import facts_in, name_variants
from schemas.queries import WorkerView
from schemas.stats import FigureView


class Copy(msgspec.Struct, frozen=True, kw_only=True):
    """One model on one worker."""

    worker: str
    host: str
    size: int = 0
    """Bytes on disk, as the backend lists it (0: it did not say)."""
    quantization: str = ""
    parameter_size: str = ""
    digest: str = ""
    loaded: bool | None = None
    """In the backend's memory now (None: the worker does not say what its backend holds)."""
    last_used: float | None = None
    """When its last counted task there ended (None: none counted)."""
    tasks: int = 0
    tokens_per_s: float | None = None
    """Generation speed there, over its counted tasks (None: not measured)."""


class ModelRow(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    copies: list[Copy]
    digests_differ: bool = False
    """Two workers hold different copies under this name (a digest each, and not the same)."""


class Matrix(msgspec.Struct, frozen=True, kw_only=True):
    """What ``--json`` prints: every field, unknowns as null (scripts need not guess)."""

    models: list[ModelRow]
    figures: bool
    """Whether the stats service answered (else ``last_used`` and speeds are unknown)."""


def _speed(figures: Sequence[FigureView]) -> tuple[int, float | None, float | None]:
    """Tasks counted, tokens per second weighted by each domain's count, the last end."""
    counted = [f for f in figures if f.tokens_per_s is not None]
    weight = sum(f.count for f in counted)
    speed = sum((f.tokens_per_s or 0.0) * f.count for f in counted) / weight if weight else None
    last = max((f.last_at for f in figures), default=None)
    return sum(f.count for f in figures), speed, last


def matrix(workers: Sequence[WorkerView], figures: Sequence[FigureView] | None = None) -> Matrix:
    """Every model a live worker serves, its copies in worker order."""
    by_key: dict[tuple[str, str], list[FigureView]] = {}
    for figure in figures or ():
        by_key.setdefault((figure.model, figure.worker), []).append(figure)
    rows: dict[str, list[Copy]] = {}
    for worker in sorted(workers, key=lambda w: w.worker_id):
        if worker.tier == "web":
            continue
        resident = set(worker.resident) if worker.resident is not None else None
        for model in worker.models:
            facts = facts_in(worker.facts, model)
            tasks, speed, last = _speed(by_key.get((model, worker.worker_id), ()))
            rows.setdefault(model, []).append(
                Copy(
                    worker=worker.worker_id,
                    host=worker.host,
                    size=facts.size,
                    quantization=facts.details.quantization_level,
                    parameter_size=facts.details.parameter_size,
                    digest=facts.digest,
                    loaded=None if resident is None else model in resident,
                    last_used=last,
                    tasks=tasks,
                    tokens_per_s=speed,
                )
            )
    return Matrix(
        models=[
            ModelRow(
                model=model,
                copies=copies,
                digests_differ=len({c.digest for c in copies if c.digest}) > 1,
            )
            for model, copies in sorted(rows.items())
        ],
        figures=figures is not None,
    )


def encode(found: Matrix) -> bytes:
    """``found`` as ``coordinator models --json`` prints it."""
    return msgspec.json.encode(found)


def holds(worker: WorkerView, model: str) -> bool:
    """Does ``worker`` list ``model`` (under any name it may be listed by: ``jp`` is
    ``jp:latest``)?"""
    return any(name in worker.models for name in name_variants(model))


def known_size(model: str, workers: Sequence[WorkerView]) -> int | None:
    """The bytes ``model`` takes where the fleet has it already (None: nowhere)."""
    for worker in workers:
        for name in name_variants(model):
            if name in worker.models and (size := facts_in(worker.facts, name).size):
                return size
    return None
