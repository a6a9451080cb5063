"""structlog set up once per process: JSON in production, readable on a terminal."""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from services.runtime.settings import LogFormat


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
