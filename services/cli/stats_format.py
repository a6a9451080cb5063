"""The statistics commands' output (pure): the stats service's replies as the lines people read.

Each function returns lines; `stats_commands` prints them (and decides stdout or stderr).
"""

from __future__ import annotations

import time

from schemas.stats import (
    AliasesReply,
    ExclusionsReply,
    ExclusionView,
    FigureView,
    ParkedReply,
    RebuildReply,
    StatsReply,
)


def local_time(at: float | None) -> str:
    """``2025-06-01 02:00:00`` in local time; ``-`` for no time."""
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def number(value: float | None, digits: int = 0) -> str:
    """A figure with ``digits`` decimals; ``-`` for a figure there is none of yet."""
    return "-" if value is None else f"{value:.{digits}f}"


def figures_table(figures: list[FigureView]) -> list[str]:
    """``coordinator stats`` as lines: durations in ms over done tasks."""
    header = (
        "MODEL",
        "DOMAIN",
        "WORKER",
        "N",
        "FAIL",
        "MEAN",
        "P50",
        "P95",
        "LOAD",
        "WARM",
        "TOK/S",
        "TTFT",
        "QUALITY",
    )
    rows = [
        (
            f.model,
            f.domain,
            f.worker or "-",
            str(f.count),
            str(f.failures),
            number(f.mean_ms),
            number(f.p50_ms),
            number(f.p95_ms),
            number(f.load_ms_p50),
            number(f.warm_p50_ms),
            number(f.tokens_per_s, 1),
            number(f.first_token_ms_p50),
            f"{f.quality_mean:.2f} ({f.quality_count})" if f.quality_mean is not None else "-",
        )
        for f in figures
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [
            cell.ljust(widths[i]) if i < 3 else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def figures_lines(reply: StatsReply) -> list[str]:
    """``coordinator stats``: the table and its legend, and how many exclusions apply."""
    if not reply.figures:
        lines = ["no figures yet"]
    else:
        lines = [
            *figures_table(reply.figures),
            "durations in ms over done tasks: LOAD = model load p50, WARM = p50 without load",
        ]
    if reply.active_exclusions:
        lines.append(
            f"{reply.active_exclusions} active exclusion(s) leave outcomes out: "
            "coordinator stats exclusions"
        )
    return lines


def exclusion_line(view: ExclusionView) -> str:
    """One exclusion: its id, what it leaves out, its window and reason, whether withdrawn."""
    window = f"{local_time(view.since)} .. {local_time(view.until) if view.until else 'open'}"
    state = f", withdrawn {local_time(view.withdrawn_at)}" if view.withdrawn_at else ""
    return (
        f"{view.exclusion_id}  worker {view.worker}  model {view.model or '*'}  {window}  "
        f"{view.reason!r}{state}"
    )


def exclusions_lines(reply: ExclusionsReply) -> list[str]:
    """``coordinator stats exclusions``: one line each, or ``no exclusions``."""
    return [exclusion_line(view) for view in reply.exclusions] or ["no exclusions"]


def rebuild_line(reply: RebuildReply) -> str:
    """``coordinator stats rebuild``: how much was replayed, how fast, into how many rows, and
    how many events it parked."""
    parked = f"; {reply.parked} event(s) parked (coordinator stats parked)" if reply.parked else ""
    return (
        f"rebuilt from {reply.events} events (up to #{reply.last_seq}) in {reply.seconds:.1f} s "
        f"({reply.events_per_s:.0f} events/s); {reply.figures} figure rows{parked}"
    )


def parked_lines(reply: ParkedReply) -> list[str]:
    """``coordinator stats parked``: one line per parked event (newest first), and how many
    are not listed; or ``no parked events``."""
    if not reply.total:
        return ["no parked events"]
    lines = [
        f"{view.stream} #{view.stream_seq}  {view.kind}  {view.subject}  "
        f"parked {local_time(view.parked_at)}: {view.error}"
        for view in reply.parked
    ]
    if reply.total > len(reply.parked):
        lines.append(f"… and {reply.total - len(reply.parked)} older")
    lines.append("a rebuild (coordinator stats rebuild) tries them again once the cause is fixed")
    return lines


def aliases_lines(reply: AliasesReply) -> list[str]:
    """``coordinator alias list``: each alias, where it leads and since when, or ``no aliases``."""
    lines = [
        f"{view.alias} -> {view.canonical}  (since {local_time(view.set_at)})"
        for view in reply.aliases
    ]
    return lines or ["no aliases"]
