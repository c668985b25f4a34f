"""Stopping background tasks for sure.

One ``Task.cancel()`` is not always the end of a task on Python 3.11:
``asyncio.wait_for`` (which nats.py uses inside ``publish`` and ``request``) returns its
inner future's result, and drops the cancellation, when both land in the same loop
step (CPython bpo-42130, fixed in 3.12). The task then runs on and blocks at its next
await (a queue's ``get``), and a ``gather`` over it never returns: a store's ``stop``
hung this way on a loaded CI box. :func:`cancel_and_wait` cancels again whatever is
still running until it has ended. It is for long-lived loops (a service's
background tasks, its subscriptions' handlers): a task whose cancellation starts a
clean-up longer than ``retry_s`` has that clean-up cut short.
"""

import asyncio
from collections.abc import Iterable
from typing import Any

import structlog

log = structlog.get_logger(__name__)

# How long a task gets after one cancellation before the next: its own clean-up (a
# ``finally`` that awaits) runs in this window, so it is not short.
RETRY_S = 1.0
BOUND_S = 10.0  # a task still running after this is left behind, with a warning


async def cancel_and_wait(
    tasks: Iterable["asyncio.Future[Any]"],
    *,
    retry_s: float = RETRY_S,
    bound_s: float = BOUND_S,
) -> set["asyncio.Future[Any]"]:
    """Cancel ``tasks`` and wait for each to end (their exceptions are retrieved, so
    none is reported as never retrieved). Returns what still runs after ``bound_s``:
    empty unless a task ignores every cancellation."""
    pending = set(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while True:
        done = {t for t in pending if t.done()}
        for t in done:
            if not t.cancelled():
                t.exception()
        pending -= done
        if not pending:
            return pending
        if loop.time() >= deadline:
            log.warning("tasks_not_cancelled", tasks=sorted(_name(t) for t in pending))
            return pending
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=retry_s)


def _name(t: "asyncio.Future[Any]") -> str:
    return t.get_name() if isinstance(t, asyncio.Task) else repr(t)
