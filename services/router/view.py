"""The router's in-memory view of the fleet, fed by the KV watch and the task events. Pure."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.workers import WorkerRecord


@dataclass(frozen=True, slots=True)
class Figure:
    """What routing uses of one (model, domain, worker) from the ``stats`` bucket."""

    typical_ms: float | None
    recent_failure_rate: float


@dataclass
class FleetView:
    """Registered workers and the tasks routed to each that have not ended yet.

    Change it through its methods only: they keep the indexes that make a decision cost
    about the same with a thousand workers as with ten.
    """

    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    # Workers whose machine sleeps, with the address to wake them by.
    sleepers: dict[str, WorkerRecord] = field(default_factory=dict)
    # task id -> (worker id, time routed); entries of lost events expire after a timeout
    inflight: dict[str, tuple[str, float]] = field(default_factory=dict)
    # (model, domain, worker) -> figure, from the stats service
    figures: dict[tuple[str, str, str], Figure] = field(default_factory=dict)
    # `figures` indexed so that a decision reads only its candidates' figures (a scan of all
    # of them per candidate made a decision quadratic in the fleet's size):
    # (model, domain) -> worker -> figure, and (model, worker) -> domain -> figure.
    _by_domain: dict[tuple[str, str], dict[str, Figure]] = field(default_factory=dict, repr=False)
    _by_worker: dict[tuple[str, str], dict[str, Figure]] = field(default_factory=dict, repr=False)
    # worker id -> its tasks in `inflight`, kept by `routed`, `ended` and `expire`.
    _depth: dict[str, int] = field(default_factory=dict, repr=False)

    def put_figure(self, model: str, domain: str, worker_id: str, figure: Figure) -> None:
        self.figures[(model, domain, worker_id)] = figure
        self._by_domain.setdefault((model, domain), {})[worker_id] = figure
        self._by_worker.setdefault((model, worker_id), {})[domain] = figure

    def typical_ms(self, model: str, domain: str, worker_ids: Iterable[str]) -> dict[str, float]:
        """Each worker's typical duration for the model and domain, as well as it is known.

        In order: the worker's own figure for this domain; the median of its figures for the
        model in other domains; the median of the other workers' figures for this model and
        domain (so a new worker is neither favoured nor shunned). Workers with none of these
        are left out, and the policy gives them its prior.
        """
        ids = list(worker_ids)
        in_domain = self._by_domain.get((model, domain), {})
        own: dict[str, float] = {}
        for worker_id in ids:
            exact = in_domain.get(worker_id)
            if exact is not None and exact.typical_ms is not None:
                own[worker_id] = exact.typical_ms
                continue
            others = [
                f.typical_ms
                for f in self._by_worker.get((model, worker_id), {}).values()
                if f.typical_ms is not None
            ]
            if others:
                own[worker_id] = statistics.median(others)
        peers = [f.typical_ms for f in in_domain.values() if f.typical_ms is not None]
        if peers:
            fallback = statistics.median(peers)
            for worker_id in ids:
                own.setdefault(worker_id, fallback)
        return own

    def failure_rate(self, model: str, domain: str, worker_ids: Iterable[str]) -> dict[str, float]:
        """Each worker's recent failure rate for the model and domain (absent: unknown)."""
        rates: dict[str, float] = {}
        in_domain = self._by_domain.get((model, domain), {})
        for worker_id in worker_ids:
            figure = in_domain.get(worker_id)
            if figure is not None:
                rates[worker_id] = figure.recent_failure_rate
        return rates

    def put_worker(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def put_sleeper(self, record: WorkerRecord) -> None:
        self.sleepers[record.worker_id] = record

    def remove_sleeper(self, worker_id: str) -> None:
        self.sleepers.pop(worker_id, None)

    def routed(self, task_id: str, worker_id: str, at: float) -> None:
        previous = self.inflight.get(task_id)
        if previous is not None:  # routed again (moved to another worker)
            self._uncount(previous[0])
        self.inflight[task_id] = (worker_id, at)
        self._depth[worker_id] = self._depth.get(worker_id, 0) + 1

    def ended(self, task_id: str) -> None:
        entry = self.inflight.pop(task_id, None)
        if entry is not None:
            self._uncount(entry[0])

    def expire(self, now: float, max_age_s: float) -> None:
        """Forget in-flight tasks older than ``max_age_s`` (their end event was missed)."""
        stale = [t for t, (_, at) in self.inflight.items() if now - at > max_age_s]
        for task_id in stale:
            self._uncount(self.inflight.pop(task_id)[0])

    def depth(self) -> dict[str, int]:
        """Tasks queued or running per worker."""
        return dict(self._depth)

    def _uncount(self, worker_id: str) -> None:
        left = self._depth.get(worker_id, 0) - 1
        if left > 0:
            self._depth[worker_id] = left
        else:
            self._depth.pop(worker_id, None)
