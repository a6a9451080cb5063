"""When an idle worker should put its machine to sleep. Pure."""

from __future__ import annotations


def should_sleep(
    *,
    now: float,
    started_at: float,
    last_activity: float,
    busy: bool,
    idle_shutdown_s: float,
    min_uptime_s: float,
) -> bool:
    """True once the worker has been idle for ``idle_shutdown_s`` and up for ``min_uptime_s``.

    ``last_activity`` is when the last task ended (or the worker started); a machine that was
    just woken for a task is thus given the full idle time after that task, and never sleeps
    in the middle of one.
    """
    if busy:
        return False
    return now - last_activity >= idle_shutdown_s and now - started_at >= min_uptime_s
