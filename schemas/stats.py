"""The statistics: the ``stats`` KV bucket's values and the stats service's request bodies.

Figures are kept per (model, domain, worker); ``model`` is always the canonical name (aliases
applied, lesson 6) and outcomes covered by an active exclusion are left out (lesson 3).
"""

from __future__ import annotations

import math
from typing import Final

import msgspec

from schemas.base import Wire


class RoutingFigure(Wire, frozen=True, kw_only=True):
    """One value of the ``stats`` KV bucket: what routing needs about a model on a worker.

    ``recent_*`` cover the key's last `RECENT_WINDOW` outcomes (done or failed, exclusions
    left out), so an old bad spell does not weigh forever and a new one shows at once.
    """

    model: str
    domain: str
    worker: str
    count: int
    """Outcomes counted (done + failed)."""
    failures: int
    recent_count: int
    recent_failure_rate: float
    """0–1: failures among the last ``recent_count`` outcomes."""
    typical_ms: float | None = None
    """p50 of the total duration of done tasks; None when none is done."""
    p95_ms: float | None = None
    load_ms_p50: float | None = None
    """p50 of the model load time of done tasks (cold starts, lesson 10)."""
    tokens_per_s: float | None = None
    quality_mean: float | None = None
    quality_count: int = 0
    last_at: float
    """When the latest counted outcome ended."""
    updated_at: float
    """When this value was published."""
    warm_ms: float | None = None
    """p50 of the total duration less the load time of done tasks: a run on a model already
    in memory. None from a stats service that predates this."""
    cold_load_ms: float | None = None
    """p50 of the load time of done tasks that loaded the model (load at least
    `COLD_LOAD_MIN_MS`): what a cold start costs on this worker. None: none seen yet."""


# How many of a key's latest outcomes the ``recent_*`` figures cover.
RECENT_WINDOW = 20

# A load time from this many milliseconds on is a cold load: the model was read into memory.
# Ollama reports a few milliseconds for a model already loaded, and a second or more for a
# cold one (it starts a runner process and reads the weights).
COLD_LOAD_MIN_MS = 100.0

routing_figure_decoder = msgspec.json.Decoder(RoutingFigure)


class FigureView(Wire, frozen=True, kw_only=True):
    """One row of ``coordinator stats``: every figure of a model, domain and worker.

    Durations are milliseconds over done tasks; ``warm_p50_ms`` is the p50 of total minus
    load time, so cold starts do not hide the generation speed.
    """

    model: str
    domain: str
    worker: str
    count: int
    failures: int
    mean_ms: float | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None
    load_ms_mean: float | None = None
    load_ms_p50: float | None = None
    cold_load_ms_p50: float | None = None
    """p50 of the load time of done tasks that loaded the model (`COLD_LOAD_MIN_MS` or more)."""
    warm_p50_ms: float | None = None
    tokens_per_s: float | None = None
    first_token_ms_p50: float | None = None
    """Only from tasks whose backend streamed (time to first token reported)."""
    quality_mean: float | None = None
    quality_count: int = 0
    recent_count: int = 0
    recent_failures: int = 0
    last_at: float


class StatsQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats``: every figure, or those of one model, worker or domain."""

    model: str | None = None
    worker: str | None = None
    domain: str | None = None


class StatsReply(Wire, frozen=True, kw_only=True):
    figures: list[FigureView]
    active_exclusions: int = 0


# The times a request may name, in epoch seconds: from 1970-01-01 to 9999-12-31 (UTC), the
# last second PostgreSQL and Python's datetime both hold. Anything else is not a time an
# operator meant: a time in milliseconds is the usual slip.
EARLIEST_S: Final = 0.0
LATEST_S: Final = 253_402_300_799.0
_FINER_UNITS: Final = (("milliseconds", 1e3), ("microseconds", 1e6), ("nanoseconds", 1e9))


def time_problem(field: str, value: float) -> str | None:
    """Why ``value`` is not a time ``field`` may hold (naming the field and the accepted
    range, with a hint when it looks like milliseconds), or None when it is one."""
    if math.isfinite(value) and EARLIEST_S <= value <= LATEST_S:
        return None
    problem = (
        f"{field} must be a time from 1970-01-01 to 9999-12-31 (epoch seconds "
        f"{EARLIEST_S:.0f} to {LATEST_S:.0f}), not {value:.15g}"
    )
    if math.isfinite(value) and value > LATEST_S:
        for unit, per_second in _FINER_UNITS:
            if value / per_second <= LATEST_S:
                return (
                    f"{problem} (that looks like {unit}: times are epoch seconds, "
                    f"divide by {per_second:.0f})"
                )
    return problem


class ExcludeRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.exclude``: times are epoch seconds (`time_problem` says which);
    ``until`` None is open-ended."""

    worker: str
    model: str | None = None
    since: float
    until: float | None = None
    reason: str


class ExclusionView(Wire, frozen=True, kw_only=True):
    exclusion_id: str
    worker: str
    model: str | None = None
    since: float
    until: float | None = None
    reason: str
    added_at: float
    withdrawn_at: float | None = None
    withdraw_reason: str | None = None


class IncludeRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.include``: withdraw an exclusion."""

    exclusion_id: str
    reason: str = ""


class ExclusionsQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.exclusions``; ``withdrawn`` lists withdrawn ones too."""

    withdrawn: bool = False


class ExclusionsReply(Wire, frozen=True, kw_only=True):
    exclusions: list[ExclusionView]


class AliasRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.alias.add``: ``alias`` names the model ``canonical`` from now on."""

    alias: str
    canonical: str


class AliasRemoveRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    alias: str


class AliasView(Wire, frozen=True, kw_only=True):
    alias: str
    canonical: str
    """Where the alias leads in the end (chains followed)."""
    set_at: float


class AliasesReply(Wire, frozen=True, kw_only=True):
    aliases: list[AliasView]


class RebuildRequest(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class RebuildReply(Wire, frozen=True, kw_only=True):
    """What ``coordinator.stats.rebuild`` did."""

    events: int
    """Events replayed (applied to the fresh tables)."""
    last_seq: int
    """The ``EVENTS`` sequence the rebuilt tables reach."""
    seconds: float
    events_per_s: float
    figures: int
    parked: int = 0
    """Events replayed that cannot be projected, recorded as parked (`ParkedView`)."""


class ParkedQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.parked``: the events the projection could not apply."""


class ParkedView(Wire, frozen=True, kw_only=True):
    """An event that decodes but cannot be projected (a time no table can hold, say): recorded
    instead of applied, so it neither comes back for ever nor holds up the events after it. A
    rebuild, after the cause is fixed, tries it again."""

    stream: str
    stream_seq: int
    subject: str
    kind: str
    error: str
    parked_at: float


# How many parked events a `ParkedReply` lists (the newest); ``total`` counts them all.
PARKED_LISTED: Final = 100


class ParkedReply(Wire, frozen=True, kw_only=True):
    parked: list[ParkedView]
    """The newest first, at most `PARKED_LISTED`."""
    total: int


class BaselinesQuery(Wire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``coordinator.stats.baselines``: earlier clean benchmark results of these models."""

    models: list[str]
    exclude_run: str | None = None


class Baseline(Wire, frozen=True, kw_only=True):
    """The median total duration of a prompt on a worker over earlier clean bench runs."""

    model: str
    """As asked for in the query (the figures behind it are the canonical name's)."""
    worker: str
    prompt_key: str
    median_ms: float
    runs: int


class BaselinesReply(Wire, frozen=True, kw_only=True):
    baselines: list[Baseline]
