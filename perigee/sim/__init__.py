"""Discrete-event simulator: traces replayed through the live policy objects
(``perigee sim``). Entry points: :class:`Simulator`, :func:`simulate`,
:func:`simulate_slice`."""

from perigee.sim.simulator import SimConfig, Simulator, simulate, simulate_slice

__all__ = ["SimConfig", "Simulator", "simulate", "simulate_slice"]
