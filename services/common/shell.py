"""The life of a service process, written once: logs, traces, signals, the bus, start,
metrics, serve until stopped (or until the service fails), stop, drain, flush traces.

Each service's ``__main__`` keeps what is its own (its flags, how its object is built
from them, what it logs at start) and hands the rest to :func:`serve`::

    return await shell.serve(
        "admission", args, lambda nc: AdmissionService(nc, config_from_args(args))
    )

The order matters and is the same everywhere: a signal before the service serves
cancels start-up (:mod:`services.common.shutdown`); the metrics server opens only once
the service has started, so a scrape never reads a half-built object; the service stops
before its NATS connection drains, so what it still publishes (a 503 to a client, a
released transaction) goes out; traces are flushed last.
"""

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import structlog
from nats.aio.client import Client as NATS
from prometheus_client.registry import Collector

from services.common import bus, metrics, shutdown
from services.common.logging import configure
from services.common.shutdown import StopEvent
from tracing import setup_tracing, shutdown_tracing


class Lifecycle(Protocol):
    """What :func:`serve` runs: a service object with a start and a stop."""

    async def start(self) -> Any: ...

    async def stop(self) -> Any: ...


S = TypeVar("S", bound=Lifecycle)


async def serve(
    name: str,
    args: argparse.Namespace,
    build: Callable[[NATS], S],
    *,
    connection: str | None = None,
    sender: str = "",
    collector: Callable[[S], Collector] | None = None,
    ready: Callable[[S], bool] | None = None,
    failed: Callable[[S], asyncio.Event] | None = None,
    stop: Callable[[S], Awaitable[Any]] | None = None,
    bound_s: float = shutdown.BOUND_S,
    before_connect: Callable[[], None] | None = None,
) -> int:
    """Run the service ``build`` makes on a bus connection until SIGTERM/SIGINT (exit
    0) or until its ``failed`` event is set (exit 1, so that a supervisor restarts it).

    ``connection`` names the NATS connection (default ``name``) and ``sender`` what its
    reconnect notices name (:func:`services.common.bus.connect`); ``collector`` and
    ``ready`` feed the metrics server (``--metrics-port``); ``stop`` replaces the
    service's own ``stop()`` (e.g. a gateway's close with its grace); ``bound_s`` is the
    hard bound after the first signal; ``before_connect`` runs once logging is set up
    (checks that must stop the process before it joins the bus)."""
    log = configure(name, args.log_level)
    setup_tracing(name)
    done = StopEvent()
    bus.install_signal_handlers(done, bound_s)
    if before_connect is not None:
        before_connect()
    nc = await bus.connect(args.nats, name=connection or name, kind=name, sender=sender)
    svc = build(nc)
    mserver = None
    broken = started = False
    try:
        await svc.start()
        started = True
        extra = () if collector is None else (collector(svc),)
        mserver = await metrics.start_from_args(
            args, name, *extra, ready=None if ready is None else (lambda: ready(svc))
        )
        broken = await _until_stopped(done, None if failed is None else failed(svc))
        log.info(f"{name}_stopping")
    finally:
        if mserver is not None:
            await mserver.close()
        try:
            await (svc.stop() if stop is None else stop(svc))
        except Exception:
            if started:
                raise
            # What failed in start-up is what the process reports, not this.
            log.exception(f"{name}_stop_after_failed_start")
        await bus.drain(nc)
        shutdown_tracing()
    if broken:
        log.error(f"{name}_exiting_after_failure")
        return 1
    structlog.get_logger().info(f"{name}_stopped")
    return 0


async def _until_stopped(stop: StopEvent, failed: asyncio.Event | None) -> bool:
    """Wait for a signal or the service's failure; True when the service failed."""
    if failed is None:
        await stop.wait()
        return False
    waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(failed.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for w in waiters:
        w.cancel()
    return failed.is_set()
