"""The stats service's routing figures as routing reads them, and the estimates they give one
task. Pure: no I/O.

The router and the reaper each keep a `Figures` from the ``stats`` bucket (`decode_figure`
reads a value) and ask it for the `services.fleet.policy.Estimates` of a task, so a moved
task is judged by the numbers its first routing used.

A figure is per (model, domain, worker). Where a worker has none for the task's domain, its
figures for the model in other domains stand in (their median), then the median of the other
workers' figures for the model and domain, so a new worker is neither favoured nor shunned;
then the policy's prior. A cold-load time does not depend on the domain: the worker's own
(median over domains), else the median of every other worker's for the model, else the prior.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import msgspec

from schemas.subjects import SHARED_CPU
from services.fleet.policy import PRIOR_COLD_LOAD_MS, PRIOR_TYPICAL_MS, Estimates

Queued = Mapping[str, Mapping[tuple[str | None, str | None], int]]
"""The tasks queued or running per worker id, counted by (model, domain); None where the
event that routed the task did not say (one that predates it)."""


@dataclass(frozen=True, slots=True)
class Figure:
    """What routing uses of one (model, domain, worker) from the ``stats`` bucket."""

    typical_ms: float | None
    recent_failure_rate: float
    warm_ms: float | None = None
    cold_load_ms: float | None = None


class _FigureValue(msgspec.Struct, frozen=True):
    """The fields of a ``stats`` bucket value (`schemas.stats.RoutingFigure`) routing uses."""

    model: str
    domain: str
    worker: str
    recent_failure_rate: float = 0.0
    typical_ms: float | None = None
    warm_ms: float | None = None
    cold_load_ms: float | None = None


_figure_decoder = msgspec.json.Decoder(_FigureValue)


def decode_figure(data: bytes) -> tuple[str, str, str, Figure]:
    """A ``stats`` bucket value as (model, domain, worker, figure); raises
    `msgspec.DecodeError` for one that is not a figure."""
    value = _figure_decoder.decode(data)
    figure = Figure(
        typical_ms=value.typical_ms,
        recent_failure_rate=value.recent_failure_rate,
        warm_ms=value.warm_ms,
        cold_load_ms=value.cold_load_ms,
    )
    return value.model, value.domain, value.worker, figure


@dataclass(frozen=True, slots=True)
class _Summary:
    """The medians of several figures' values (None where none has one)."""

    typical_ms: float | None
    warm_ms: float | None
    cold_load_ms: float | None


def _summary(figures: Iterable[Figure]) -> _Summary:
    typical: list[float] = []
    warm: list[float] = []
    cold: list[float] = []
    for f in figures:
        if f.typical_ms is not None:
            typical.append(f.typical_ms)
        # A stats service that predates warm figures: its typical duration stands in.
        if (w := f.warm_ms if f.warm_ms is not None else f.typical_ms) is not None:
            warm.append(w)
        if f.cold_load_ms is not None:
            cold.append(f.cold_load_ms)
    return _Summary(
        statistics.median(typical) if typical else None,
        statistics.median(warm) if warm else None,
        statistics.median(cold) if cold else None,
    )


def _warm(figure: Figure) -> float | None:
    return figure.warm_ms if figure.warm_ms is not None else figure.typical_ms


@dataclass
class Figures:
    """Every figure the stats service published, indexed so that a decision reads only its
    candidates' figures (a scan of all of them per candidate made a decision quadratic in the
    fleet's size), with the medians the fallbacks use kept until a figure they cover changes.
    Change it through `put` only."""

    # (model, domain) -> worker -> figure
    _by_domain: dict[tuple[str, str], dict[str, Figure]] = field(default_factory=dict)
    # (model, worker) -> domain -> figure
    _by_worker: dict[tuple[str, str], dict[str, Figure]] = field(default_factory=dict)
    # model -> (worker, domain) -> figure
    _by_model: dict[str, dict[tuple[str, str], Figure]] = field(default_factory=dict)
    # Medians: a worker's over its domains, every worker's in a domain, every worker's.
    _own: dict[tuple[str, str], _Summary] = field(default_factory=dict, repr=False)
    _peers: dict[tuple[str, str], _Summary] = field(default_factory=dict, repr=False)
    _everyone: dict[str, _Summary] = field(default_factory=dict, repr=False)

    def put(self, model: str, domain: str, worker_id: str, figure: Figure) -> None:
        self._by_domain.setdefault((model, domain), {})[worker_id] = figure
        self._by_worker.setdefault((model, worker_id), {})[domain] = figure
        self._by_model.setdefault(model, {})[(worker_id, domain)] = figure
        self._own.pop((model, worker_id), None)
        self._peers.pop((model, domain), None)
        self._everyone.pop(model, None)

    def get(self, model: str, domain: str, worker_id: str) -> Figure | None:
        """The figure published for exactly this key, if any."""
        return self._by_domain.get((model, domain), {}).get(worker_id)

    def typical_of(self, model: str, domain: str | None, worker_id: str) -> float:
        """One task's typical duration on a worker: its figure, else its figures for the
        model in other domains (their median), else the other workers' for the model and
        domain, else the prior."""
        if domain is not None:
            exact = self._by_domain.get((model, domain), {}).get(worker_id)
            if exact is not None and exact.typical_ms is not None:
                return exact.typical_ms
        own = self._own_of(model, worker_id).typical_ms
        if own is not None:
            return own
        peers = self._peers_of(model, domain).typical_ms if domain is not None else None
        return peers if peers is not None else PRIOR_TYPICAL_MS

    def queued_ms(
        self, model: str, domain: str, worker_ids: Iterable[str], queued: Queued
    ) -> dict[str, list[float]]:
        """The typical duration of each task queued or running on each worker (the work
        ahead of a new task there), each by its own model and domain; a task whose model is
        not known counts as one of ``model`` in ``domain`` (the task being routed), as
        routing counted every task before it knew their models."""
        ahead: dict[str, list[float]] = {}
        for worker_id in worker_ids:
            tasks = queued.get(worker_id)
            if not tasks:
                continue
            durations: list[float] = []
            for (task_model, task_domain), count in tasks.items():
                if task_model is None:
                    typical = self.typical_of(model, domain, worker_id)
                else:
                    typical = self.typical_of(task_model, task_domain, worker_id)
                durations.extend([typical] * count)
            ahead[worker_id] = durations
        return ahead

    def estimates(
        self, model: str, domain: str, worker_ids: Iterable[str], queued: Queued
    ) -> Estimates:
        """What the policy needs of each of ``worker_ids`` to route a task of ``model`` in
        ``domain``, given the tasks ``queued`` on each (one pass, the fallbacks' medians
        kept: this is every route request's cost)."""
        ids = list(worker_ids)
        in_domain = self._by_domain.get((model, domain), {})
        peers = self._peers_of(model, domain)
        everyone = self._everyone_of(model).cold_load_ms
        typical: dict[str, float] = {}
        warm: dict[str, float] = {}
        cold: dict[str, float] = {}
        failures: dict[str, float] = {}
        for worker_id in ids:
            exact = in_domain.get(worker_id)
            own = self._own_of(model, worker_id)
            t = w = None
            if exact is not None:
                failures[worker_id] = exact.recent_failure_rate
                t, w = exact.typical_ms, _warm(exact)
            if t is None:
                t = own.typical_ms if own.typical_ms is not None else peers.typical_ms
            if w is None:
                w = own.warm_ms if own.warm_ms is not None else peers.warm_ms
            if t is not None:
                typical[worker_id] = t
            if w is not None:
                warm[worker_id] = w
            c = own.cold_load_ms if own.cold_load_ms is not None else everyone
            if c is not None:
                cold[worker_id] = c
        loads: dict[str, dict[str, float]] = {}
        for worker_id in ids:
            for task_model, _ in queued.get(worker_id, {}):
                if task_model is not None:
                    models = loads.setdefault(worker_id, {})
                    if task_model not in models:
                        models[task_model] = self.cold_load_of(task_model, worker_id)
        return Estimates(
            queued_loads=loads,
            # Asked only of a model a load would push out, which is rare.
            cold_load_of=self.cold_load_of,
            # The shared CPU queue's too: every CPU worker runs those between its own.
            queued_ms=self.queued_ms(model, domain, [*ids, SHARED_CPU.name], queued),
            typical_ms=typical,
            warm_ms=warm,
            cold_load_ms=cold,
            failure_rate=failures,
        )

    def cold_load_of(self, model: str, worker_id: str) -> float:
        """A model's cold-load time on a worker: its own, else every worker's, else the
        prior."""
        own = self._own_of(model, worker_id).cold_load_ms
        if own is None:
            own = self._everyone_of(model).cold_load_ms
        return own if own is not None else PRIOR_COLD_LOAD_MS

    def _own_of(self, model: str, worker_id: str) -> _Summary:
        summary = self._own.get((model, worker_id))
        if summary is None:
            figures = self._by_worker.get((model, worker_id), {}).values()
            summary = self._own[(model, worker_id)] = _summary(figures)
        return summary

    def _peers_of(self, model: str, domain: str) -> _Summary:
        summary = self._peers.get((model, domain))
        if summary is None:
            figures = self._by_domain.get((model, domain), {}).values()
            summary = self._peers[(model, domain)] = _summary(figures)
        return summary

    def _everyone_of(self, model: str) -> _Summary:
        summary = self._everyone.get(model)
        if summary is None:
            summary = self._everyone[model] = _summary(self._by_model.get(model, {}).values())
        return summary
