"""structlog set up once per process: JSON in production, readable on a terminal.

Each handled message gets one canonical line (the worker's ``task done``/``task failed``, the
router's ``routed``, the stats service's ``event projected``, at ``debug``: at ``info`` it
writes one ``batch projected`` line per batch) carrying ``task_id``, ``subject`` and
``stream_seq`` from structlog's context, and ``trace_id`` from the current span
(`add_trace_id`), so a line leads to the task's trace and the trace to its lines.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

from services.runtime.settings import LogFormat
from services.runtime.tracing import trace_id_of


def add_trace_id(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """Add the current span's trace id, unless the line has one already."""
    if "trace_id" not in event:
        trace_id = trace_id_of()
        if trace_id is not None:
            event["trace_id"] = trace_id
    return event


def setup_logging(
    level: str = "info", fmt: LogFormat = "auto", stream: TextIO | None = None
) -> None:
    """Configure structlog (and the stdlib loggers of libraries) for this process.

    Services log to stdout; client commands pass ``stream=sys.stderr`` so their output stays
    clean for pipes.
    """
    out = stream or sys.stdout
    use_json = fmt == "json" or (fmt == "auto" and not out.isatty())
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_trace_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    # nats-py and asyncio log through the stdlib: route them to the same stream, quietly.
    logging.basicConfig(stream=out, level=max(numeric, logging.WARNING), force=True)
