"""How a service process stops on SIGTERM or SIGINT, bounded whatever state it is in.

    STARTING  connecting to NATS, waiting for its store, loading an engine
      --signal--> the main task is cancelled (nothing in start-up watches the stop
                  event, and a dead bus would hold it forever); the process exits 0
    SERVING   from the service's first ``stop.wait()``
      --signal--> ``stop`` is set: the service stops taking work, drains its NATS
                  connection (bounded, :func:`services.common.bus.drain`) and exits 0
    either    --second signal, or ``bound_s`` after the first--> ``os._exit(0)``

The hard bound is a watchdog thread, not a loop callback: it fires even when the
event loop is stuck (a drain on a dead bus that swallows its cancellation, the
interpreter joining an executor thread at exit). A stop asked for by a signal ends
in ``os._exit`` once the service's own clean-up has run (:func:`exit_now`), because
interpreter finalization joins non-daemon threads and runs library atexit hooks with
no bound of its own.

``perigee up`` starts every service in a session of its own, so a terminal's Ctrl-C
reaches only ``perigee up``, which stops the services in order with SIGTERM.
"""

import asyncio
import logging
import os
import signal
import sys
import threading
from typing import Any

import structlog

log = structlog.get_logger()

BOUND_S = 5.0  # from the first signal to a forced exit

_state = {"requested": False}


class StopEvent(asyncio.Event):
    """Set by the first SIGTERM/SIGINT. Waiting on it marks the service as serving."""

    serving = False

    def wait(self) -> Any:  # not ``async``: serving from the call, not from the first await
        self.serving = True
        return super().wait()


def install(stop: asyncio.Event, bound_s: float = BOUND_S) -> None:
    """Call from the service's main task, first thing: a signal before ``stop`` is
    waited on (a :class:`StopEvent`) cancels this task; a plain Event counts as
    serving from the start."""
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()

    def on_signal(sig: signal.Signals) -> None:
        if _state["requested"]:
            log.warning("stop_forced", signal=sig.name, reason="second signal")
            exit_now(0)
        _state["requested"] = True
        starting = isinstance(stop, StopEvent) and not stop.serving
        log.info("stop_requested", signal=sig.name, starting=starting, bound_s=bound_s)
        stop.set()
        _watchdog(bound_s)
        if starting and main is not None:
            main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass


def requested() -> bool:
    """Whether a signal asked this process to stop."""
    return _state["requested"]


def _watchdog(bound_s: float) -> None:
    def fire() -> None:
        log.warning("stop_forced", reason="bound exceeded", bound_s=bound_s)
        exit_now(0)

    t = threading.Timer(bound_s, fire)
    t.daemon = True
    t.start()


def exit_now(code: int) -> None:
    """Flush what is buffered and leave, skipping interpreter finalization."""
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)
