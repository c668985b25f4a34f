"""structlog set-up: JSON, one event per line, to stderr; request ids bound per task
with ``structlog.contextvars.bound_contextvars(request_id=...)``."""

import logging
import sys

import structlog


def configure(service: str, level: str = "INFO", json: bool = True) -> structlog.stdlib.BoundLogger:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    log: structlog.stdlib.BoundLogger = structlog.get_logger()
    return log
