"""A worker process that changes role live (paper §5.1, dynamic P/D ratio): what
``python -m services.prefill --switchable`` and ``python -m services.decode
--switchable`` run instead of a fixed worker.

Lifecycle (one NATS connection, one store client and one engine throughout; the mock
engine serves both roles)::

    SERVING(role)  a PrefillWorker or DecodeWorker under the process's instance id
      --RoleSwitch{instance: this one, role: the other} on perigee.ctl.role-->
    DRAINING       worker.drain(): no more load reports (conductors forget the
                   instance on the same RoleSwitch), what is queued or running and
                   tasks still arriving are served; done once idle and quiet
      --> the old worker closes; a worker of the other role starts --> SERVING(other)
    any --stop signal or engine dead--> the worker closes, the process exits

RoleSwitch messages for other instances, for the role already served, or malformed
ones are ignored. The instance id does not change with the role. ``on_role`` hears each
role as it starts serving (services.worker.pod_role tells Kubernetes), in the
background: serving never waits for it.
"""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode
from bus_schemas.control import RoleSwitch
from bus_schemas.roles import ROLES
from services.common.tasks import cancel_and_wait
from services.worker.settings import WorkerSettings, make_worker

log = structlog.get_logger()


class RoleHost:
    """Runs a worker in one role and drains and rebuilds it in the other on a RoleSwitch."""

    def __init__(
        self,
        nc: NATS,
        store: Any,
        engine: Any,
        role: str,
        settings: WorkerSettings,
        on_role: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        self.nc, self.store, self.engine = nc, store, engine
        self.role = role
        self.settings = settings
        self.worker: Any = None
        self.switches = 0
        self.serving = asyncio.Event()  # set while a worker is started and serving
        self._target: str | None = None
        self._switch = asyncio.Event()
        self.on_role = on_role
        self._told: set[asyncio.Task[None]] = set()

    async def _on_ctl(self, m: NatsMsg) -> None:
        try:
            rs: RoleSwitch = decode(m.data, RoleSwitch)
        except BadMessage as e:
            log.warning("bad_role_switch", error=str(e))
            return
        if rs.instance != self.settings.instance or rs.role not in ROLES:
            return
        if rs.role == (self._target or self.role):
            return
        log.info("role_switch_requested", role=self.role, to=rs.role)
        self._target = rs.role
        self._switch.set()

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` (0) or the engine dies (1), switching roles on request."""
        sub = await self.nc.subscribe(subjects.CTL_ROLE, cb=self._on_ctl)
        try:
            while True:
                self.worker = make_worker(
                    self.role, self.nc, self.store, self.engine, self.settings
                )
                await self.worker.start()
                self.serving.set()
                log.info("role_serving", role=self.role, switches=self.switches)
                if self.on_role is not None:
                    told = asyncio.ensure_future(self.on_role(self.role))
                    self._told.add(told)
                    told.add_done_callback(self._told.discard)
                ended = await _first(stop.wait(), self.worker.dead.wait(), self._switch.wait())
                if ended != 2:
                    self.serving.clear()
                    await self.worker.close()
                    return 1 if self.worker.dead.is_set() else 0
                log.info("role_draining", role=self.role, to=self._target)
                drained = await _first(self.worker.drain(self.settings.drain_quiet_s), stop.wait())
                self.serving.clear()
                await self.worker.close()
                if drained != 0 or self.worker.dead.is_set():
                    return 1 if self.worker.dead.is_set() else 0
                self.role, self._target = self._target or self.role, None
                self._switch.clear()
                self.switches += 1
        finally:
            await cancel_and_wait(list(self._told))
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass


async def _first(*aws: Awaitable[Any]) -> int:
    """Index of the first awaitable to finish; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    await cancel_and_wait(pending)
    return min(tasks.index(t) for t in done)
