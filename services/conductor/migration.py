"""How the conductor places a migrated request (``GenerateRequest.migration``: the
gateway resent an accepted request whose prefill or decode instance died). Pure.

Placement is the usual one, cache-aware, so the prompt's KV is loaded or pulled from
a store that holds it; two things differ. The request was accepted already and its
client has waited since, so no SLO rejects it (infinite TTFT/TBT SLOs: only "no live
instance" can refuse it). And the instance that died is excluded even while its last
load report still counts as fresh here: the gateway's watchdog and this conductor
judge liveness from the same reports but not at the same instant.
"""

import dataclasses
import math

from bus_schemas.requests import Migration
from services.conductor.policy import PlacementRequest


def placement_for(
    preq: PlacementRequest, m: Migration
) -> tuple[PlacementRequest, dict[str, tuple[str, ...]]]:
    """(the request without SLOs, ``place``'s exclusion keyword for the dead instance)."""
    preq = dataclasses.replace(preq, ttft_slo_s=math.inf, tbt_slo_s=math.inf, arrival_ts=0.0)
    role = "prefill" if m.reason == "prefill_died" else "decode"
    return preq, {f"exclude_{role}": (m.dead_instance,)}
