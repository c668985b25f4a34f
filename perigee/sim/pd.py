"""Dynamic P/D ratio in the simulator (paper §5.1): the conductor's own
:class:`PDRatioController` decides, the simulator resizes its pools.

Every ``sample_s`` the controller observes every active instance's load report (as the
live conductor does with each report); every ``interval_s`` it is asked for a plan over
the current pools (fixed fleet, ``scale == 0``). A switch takes a node from one role to
the other, the way a worker obeys RoleSwitch::

    active --switch--> draining: out of the policies' view at once (forget_instance);
        a prefill instance finishes its queue, a decode instance its running and
        waiting requests and the ones already placed on it
    draining --empty--> the node serves the other role (same store: its cache stays)
"""

from bus_schemas.roles import Role
from services.conductor.pd_ratio import PDRatioController


class PoolResizer:
    """Feeds the P/D controller simulated loads and resizes the pools as it plans."""

    def __init__(
        self,
        sim,
        *,
        sample_s: float = 1.0,
        interval_s: float = 10.0,
        window_s: float = 60.0,
        cooldown_s: float = 30.0,
        min_samples: int = 10,
    ) -> None:
        self.sim = sim
        self.sample_s, self.interval_s = sample_s, interval_s
        self.controller = PDRatioController(
            sim.loop.clock, window_s=window_s, cooldown_s=cooldown_s, min_samples=min_samples
        )
        self.switches: list[tuple[float, str, str, str]] = []  # (t, node, from, to)
        self._next_plan = 0.0

    def start(self, t: float) -> None:
        self._next_plan = t + self.interval_s
        self.sim.loop.at(t, self._tick)

    def _tick(self) -> None:
        sim, now = self.sim, self.sim.loop.now()
        cfg = sim.cfg
        for inst in sim.prefills.values():
            if not inst.draining:
                self.controller.observe_prefill(inst.load(now), cfg.ttft_slo_s)
        for inst in sim.decodes.values():
            if not inst.draining:
                self.controller.observe_decode(inst.load(now), cfg.tbt_slo_s)
        if now >= self._next_plan:
            self._next_plan = now + self.interval_s
            self._plan()
        if sim.terminal < len(sim.requests):
            sim.loop.after(self.sample_s, self._tick)

    def _plan(self) -> None:
        sim = self.sim
        prefill = [n for n, i in sim.prefills.items() if not i.draining]
        decode = [n for n, i in sim.decodes.items() if not i.draining]
        plan = self.controller.plan(prefill, decode)
        for change in plan.switches:
            self.switch(change.instance, change.from_role)

    def switch(self, instance: str, from_role: str) -> None:
        """Start moving ``instance`` out of ``from_role``."""
        sim = self.sim
        pool = sim.prefills if from_role == Role.PREFILL else sim.decodes
        inst = pool[instance]
        inst.draining = True
        sim.placement.forget_instance(from_role, instance)
        sim.admission.forget_instance(from_role, instance)
        self.switches.append((sim.loop.now(), inst.node, from_role, Role(from_role).other))
        self.maybe_done(inst)

    def maybe_done(self, inst) -> None:
        """Called when a draining instance may have emptied."""
        sim = self.sim
        if not inst.draining or len(inst) or sim.inbound.get(inst.name, 0):
            return
        if inst.name in sim.prefills:
            del sim.prefills[inst.name]
            sim.add_instance(Role.DECODE, inst.node)
        else:
            del sim.decodes[inst.name]
            sim.add_instance(Role.PREFILL, inst.node)
