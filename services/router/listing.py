"""``coordinator.workers``: the live workers as the router sees them, with what the reaper
reported about them lately. Pure: no I/O, no clock (``now`` is given)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from schemas.queries import WorkersReply, WorkerView
from services.fleet import liveness, policy
from services.router.view import FleetView

# A problem the reaper reported is shown this long; it reports one that persists every 30 s.
PROBLEM_SHOWN_S: Final = 90.0


@dataclass
class Problems:
    """What the reaper reported about each worker (a duplicate process), and when."""

    _seen: dict[str, tuple[float, str]] = field(default_factory=dict)

    def report(self, worker_id: str, problem: str, at: float) -> None:
        self._seen[worker_id] = (at, problem)

    def of(self, worker_id: str, now: float) -> list[str]:
        """What the reaper reported about the worker within `PROBLEM_SHOWN_S`."""
        seen = self._seen.get(worker_id)
        return [seen[1]] if seen is not None and now - seen[0] < PROBLEM_SHOWN_S else []


def workers_reply(
    view: FleetView,
    problems: Problems,
    aliases: Iterable[str],
    canonical: Callable[[str], str],
    *,
    now: float,
    ttl_s: float,
    settling: bool = False,
    shown: Callable[[str], bool] = lambda _: True,
) -> WorkersReply:
    """The live workers by id, each with its queue depth and problems, and every alias with
    the name it stands for. A running task's id only where ``shown`` (its owner's, the
    operator's)."""
    depth = view.depth()
    workers = [
        WorkerView(
            worker_id=r.worker_id,
            host=r.host,
            tier=policy.tier_label(r),
            models=r.models,
            state=r.state,
            current_task=r.current_task if r.current_task and shown(r.current_task) else None,
            current_model=r.current_model,
            last_heartbeat=r.heartbeat_at,
            queue_depth=depth.get(r.worker_id, 0),
            problems=problems.of(r.worker_id, now),
            facts=r.facts,
            health=r.health,
            health_reason=r.health_reason,
            health_since=r.health_since,
            resident=r.resident,
            memory_bytes=r.memory_bytes,
            max_resident=r.max_resident,
        )
        for r in sorted(liveness.live(view.workers.values(), now, ttl_s), key=lambda r: r.worker_id)
    ]
    return WorkersReply(
        workers=workers,
        aliases={alias: canonical(alias) for alias in aliases},
        settling=settling,
    )
