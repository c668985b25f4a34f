"""The conductor's side of role switches (paper §5.1, dynamic P/D ratio): a thin adapter
around the pure :class:`~services.conductor.pd_ratio.PDRatioController`.

    perigee.ctl.role  RoleSwitch (from any conductor) -> the instance leaves its old
                      role's pool in the placement policy at once, and the controller
                      forgets its load
    load reports      -> controller samples (only with the controller on)
    every interval    -> controller.plan(live prefill, live decode); each switch is
                      published as RoleSwitch on perigee.ctl.role (workers started with
                      --switchable obey it)

Run the controller on one conductor of a group; every conductor follows the switches.
"""

import asyncio

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.control import RoleSwitch
from bus_schemas.load import DecodeLoad, PrefillLoad
from services.common import bus
from services.conductor.pd_ratio import PDRatioController
from services.conductor.placement_policy import PlacementPolicy

log = structlog.get_logger()


class RoleControl:
    """Applies role switches to the placement policy and publishes the P/D controller's."""

    def __init__(
        self,
        nc: NATS,
        policy: PlacementPolicy,
        pd: PDRatioController | None,
        *,
        ttft_slo_s: float,
        tbt_slo_s: float,
        interval_s: float = 10.0,
    ) -> None:
        self.nc, self.policy, self.pd = nc, policy, pd
        self.ttft_slo_s, self.tbt_slo_s = ttft_slo_s, tbt_slo_s
        self.interval_s = interval_s

    async def start(self, subs: bus.Subscriptions) -> None:
        await subs.serve(
            subjects.CTL_ROLE, RoleSwitch, self.on_role_switch, span_name="conductor.role"
        )
        if self.pd is not None:
            subs.spawn(self._loop(), name="conductor:pd-ratio")

    def observe_prefill(self, load: PrefillLoad) -> None:
        if self.pd is not None:
            self.pd.observe_prefill(load, self.ttft_slo_s)

    def observe_decode(self, load: DecodeLoad) -> None:
        if self.pd is not None:
            self.pd.observe_decode(load, self.tbt_slo_s)

    async def on_role_switch(self, rs: RoleSwitch, _m: NatsMsg | None = None) -> None:
        old = rs.previous_role()
        if old is None:
            log.warning("bad_role_switch", instance=rs.instance, role=rs.role)
            return
        self.policy.forget_instance(old, rs.instance)
        if self.pd is not None:
            self.pd.forget(rs.instance)
        log.info("role_switch_seen", instance=rs.instance, role=rs.role)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.step()

    async def step(self) -> list[RoleSwitch]:
        """Ask the controller once; publish its switches."""
        if self.pd is None:
            return []
        plan = self.pd.plan(self.policy.live_prefill(), self.policy.live_decode())
        out = [RoleSwitch(instance=c.instance, role=c.to_role) for c in plan.switches]
        if out:
            log.info(
                "pd_ratio_switch",
                f_im=plan.f_im,
                reason=plan.reason,
                switches=[f"{c.instance}->{c.to_role}" for c in plan.switches],
            )
        for msg in out:
            await bus.publish(self.nc, subjects.CTL_ROLE, msg)
        return out
