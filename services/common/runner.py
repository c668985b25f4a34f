"""Run a service's main coroutine on the fastest event loop available.

uvloop roughly halves the per-message cost of the asyncio machinery that every bus
hop pays (socket readiness, callbacks, task switches); the plain loop stays the
fallback where uvloop is not installed."""

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
