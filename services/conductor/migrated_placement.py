"""How the conductor places a migrated request (``GenerateRequest.migration``: the
gateway resent an accepted request whose prefill or decode instance died). Pure.

Placement is the usual one, cache-aware, so the prompt's KV is loaded or pulled from
a store that holds it; two things differ. The request was accepted already and its
client has waited since, so no SLO rejects it (infinite TTFT/TBT SLOs: only "no live
instance" can refuse it). And the instance that died is excluded even while its last
load report still counts as fresh here: the gateway's watchdog and this conductor
judge liveness from the same reports but not at the same instant.

A store that died (issue 13 item 2) takes its node's instances out of placement, for
every request, migrated or not (:func:`away_from_stores`): a prefill instance whose
store is down can reserve nothing, a decode instance's KV cannot arrive. The request
goes to instances on other nodes (its prefix, if no live store holds it, computed
again), or gets 503 "no live ... instance" when there are none, rather than a
placement that fails once the worker reaches the dead store.
"""

import dataclasses
import math
from collections.abc import Callable, Collection, Mapping

from bus_schemas.requests import Migration
from bus_schemas.roles import Role
from services.conductor.placement_policy import PlacementRequest


def placement_for(
    preq: PlacementRequest, m: Migration, incarnation: Callable[[str, str], int] | None = None
) -> tuple[PlacementRequest, dict[str, tuple[str, ...]]]:
    """(the request without SLOs, ``place``'s exclusion keyword for the dead instance).

    ``incarnation(role, instance)``: the incarnation each instance reports now. The dead
    instance's name is excluded unless a newer incarnation of it reports: that process
    is a new instance, alive, and may serve the request (a restart of the only one)."""
    preq = dataclasses.replace(preq, ttft_slo_s=math.inf, tbt_slo_s=math.inf, arrival_ts=0.0)
    role = Role.PREFILL if m.reason == "prefill_died" else Role.DECODE
    now = incarnation(role, m.dead_instance) if incarnation is not None else 0
    if m.dead_incarnation and now > m.dead_incarnation:
        return preq, {}
    return preq, {f"exclude_{role}": (m.dead_instance,)}


def away_from_stores(
    exclude: Mapping[str, tuple[str, ...]],
    down: Collection[str],
    prefill_nodes: Mapping[str, str],
    decode_nodes: Mapping[str, str],
) -> dict[str, tuple[str, ...]]:
    """``exclude`` (``place``'s keywords) plus every prefill and decode instance whose node
    (instance -> node maps, from the load reports) is in ``down``, and those nodes as
    prefix sources."""
    out = dict(exclude)
    if not down:
        return out
    for key, nodes in (("exclude_prefill", prefill_nodes), ("exclude_decode", decode_nodes)):
        dead = tuple(sorted(i for i, n in nodes.items() if n in down))
        if dead:
            out[key] = (*out.get(key, ()), *dead)
    out["exclude_sources"] = (*out.get("exclude_sources", ()), *sorted(down))
    return out
