"""An admission or conductor process's heartbeat on the bus (bus_schemas.control.Presence).

On the core path a request that admission or a conductor holds before it is placed
lives in that process only; the gateway, which sent it, resends what a dead one may
have held (services.gateway.control_presence). These beats are how it knows: a name
silent for ``dead_after_s``, or beating under a newer incarnation, is a death. A beat
is a few dozen bytes every quarter of ``dead_after_s``: nothing beside the requests."""

import asyncio

import nats.errors
import structlog
from nats.aio.client import Client as NATS

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.control import Presence
from services.common.incarnation import process_incarnation

log = structlog.get_logger()

KINDS = ("admission", "conductor")


def interval_for(dead_after_s: float) -> float:
    """Four beats within a dead-after window: one late or lost beat is no death."""
    return max(0.05, dead_after_s / 4)


async def beat(nc: NATS, kind: str, name: str, dead_after_s: float) -> None:
    """Publish this process's Presence, four times within ``dead_after_s``, until
    cancelled."""
    interval_s = interval_for(dead_after_s)
    subject = subjects.presence(kind, name)
    data = encode(
        Presence(kind=kind, name=name, incarnation=process_incarnation(), interval_s=interval_s)
    )
    while True:
        try:
            await nc.publish(subject, data)
        except (nats.errors.ConnectionClosedError, nats.errors.OutboundBufferLimitError) as e:
            log.warning("presence_beat_failed", kind=kind, error=f"{type(e).__name__}: {e}")
        await asyncio.sleep(interval_s)
