"""The router's in-memory view of the fleet, fed by the KV watch and the task events. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.workers import WorkerRecord


@dataclass
class FleetView:
    """Registered workers and the tasks routed to each that have not ended yet."""

    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    # task id -> (worker id, time routed); entries of lost events expire after a timeout
    inflight: dict[str, tuple[str, float]] = field(default_factory=dict)

    def put_worker(self, record: WorkerRecord) -> None:
        self.workers[record.worker_id] = record

    def remove_worker(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def routed(self, task_id: str, worker_id: str, at: float) -> None:
        self.inflight[task_id] = (worker_id, at)

    def ended(self, task_id: str) -> None:
        self.inflight.pop(task_id, None)

    def expire(self, now: float, max_age_s: float) -> None:
        """Forget in-flight tasks older than ``max_age_s`` (their end event was missed)."""
        stale = [t for t, (_, at) in self.inflight.items() if now - at > max_age_s]
        for task_id in stale:
            del self.inflight[task_id]

    def depth(self) -> dict[str, int]:
        """Tasks queued or running per worker."""
        counts: dict[str, int] = {}
        for worker_id, _ in self.inflight.values():
            counts[worker_id] = counts.get(worker_id, 0) + 1
        return counts
