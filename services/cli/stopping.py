"""How long each service's stop may take: its grace for the work in hand, and the margin every
stop has for its goodbyes and connections (`services.runtime.lifecycle.stop_budget_s`)."""

from __future__ import annotations

from services.reaper.settings import ReaperSettings
from services.runtime.lifecycle import stop_budget_s
from services.runtime.settings import Settings, WebSearchSettings, WorkerSettings
from services.stats.settings import StatsSettings


def budget_of(settings: Settings) -> float:
    """The stop budget of the service ``settings`` configure, in seconds."""
    match settings:
        case WorkerSettings():
            grace_s = settings.stop_grace_s  # the task in hand
        case WebSearchSettings():
            from services.web_search.service import WRAP_UP_S

            grace_s = settings.stop_grace_s + WRAP_UP_S  # the task in hand, then its wrap-up
        case StatsSettings():
            from services.stats.service import STOP_GRACE_S

            grace_s = STOP_GRACE_S  # the batch in hand
        case ReaperSettings():
            grace_s = settings.reaper_interval_s  # the look in hand
        case _:
            grace_s = 0.0
    return stop_budget_s(grace_s)
