"""The router's in-memory view of the fleet, fed by the KV watch and the task events. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from schemas.workers import WorkerRecord
from services.fleet.figures import Figures

# What a task in flight is, for the work queued on its worker: (model, domain), None where
# the event that routed it did not say.
Work = tuple[str | None, str | None]


@dataclass
class FleetView:
    """Registered workers, the stats service's figures, and the tasks routed to each worker
    that have not ended yet.

    Change it through its methods only: they keep the indexes that make a decision cost
    about the same with a thousand workers as with ten.
    """

    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    # Workers whose machine sleeps, with the address to wake them by.
    sleepers: dict[str, WorkerRecord] = field(default_factory=dict)
    # task id -> (worker id, time routed); entries of lost events expire after a timeout
    inflight: dict[str, tuple[str, float]] = field(default_factory=dict)
    # (model, domain, worker) -> figure, from the stats service
    figures: Figures = field(default_factory=Figures)
    # task id -> its model and domain, for the tasks in `inflight`.
    _work: dict[str, Work] = field(default_factory=dict, repr=False)
    # worker id -> its tasks in `inflight` by model and domain, kept by `routed`, `ended` and
    # `expire`.
    _queued: dict[str, Counter[Work]] = field(default_factory=dict, repr=False)

    def put_worker(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def records(self) -> Iterable[WorkerRecord]:
        return self.workers.values()

    def put_sleeper(self, record: WorkerRecord) -> None:
        self.sleepers[record.worker_id] = record

    def remove_sleeper(self, worker_id: str) -> None:
        self.sleepers.pop(worker_id, None)

    def routed(
        self,
        task_id: str,
        worker_id: str,
        at: float,
        model: str | None = None,
        domain: str | None = None,
    ) -> None:
        """The task was routed (again, when it moved) to ``worker_id``."""
        previous = self.inflight.get(task_id)
        if previous is not None:  # routed again (moved to another worker)
            self._uncount(task_id, previous[0])
        self.inflight[task_id] = (worker_id, at)
        work = (model, domain)
        self._work[task_id] = work
        self._queued.setdefault(worker_id, Counter())[work] += 1

    def ended(self, task_id: str) -> None:
        entry = self.inflight.pop(task_id, None)
        if entry is not None:
            self._uncount(task_id, entry[0])

    def expire(self, now: float, max_age_s: float) -> None:
        """Forget in-flight tasks older than ``max_age_s`` (their end event was missed)."""
        stale = [t for t, (_, at) in self.inflight.items() if now - at > max_age_s]
        for task_id in stale:
            self._uncount(task_id, self.inflight.pop(task_id)[0])

    def queued(self) -> dict[str, Counter[Work]]:
        """The tasks queued or running per worker, by model and domain (not a copy: read it
        before the view changes)."""
        return self._queued

    def depth(self) -> dict[str, int]:
        """Tasks queued or running per worker."""
        return {worker: sum(work.values()) for worker, work in self._queued.items()}

    def _uncount(self, task_id: str, worker_id: str) -> None:
        work = self._work.pop(task_id, (None, None))
        counts = self._queued.get(worker_id)
        if counts is None:
            return
        counts[work] -= 1
        if counts[work] <= 0:
            del counts[work]
        if not counts:
            del self._queued[worker_id]
