"""One placement round, the conductor's and the simulator's alike. Pure: no I/O.

    the request's block hashes as admission checked them (:func:`request_for`; the
    simulator's trace requests come hashed) -> PlacementRequest -> a migrated request's
    exclusions
    (services.conductor.migrated_placement.placement_for) -> store exclusions
    (:func:`~services.conductor.migrated_placement.away_from_stores`: instances on a node whose
    store is down) -> ``PlacementPolicy.place`` over the prefix index's match ->
    :class:`TaskFields` (what the PrefillTask carries; the simulator reads the same)

``ConductorService.schedule`` wraps it with the bus (errors, claim, publish); the
simulator's ``_place`` with its event loop. Neither builds a PlacementRequest or
applies an exclusion of its own, so the simulator runs what serves.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from bus_schemas.placement import PrefixSource
from bus_schemas.requests import GenerateRequest, Migration
from bus_schemas.roles import Role
from services.common.rejection import Rejection
from services.conductor.migrated_placement import away_from_stores, placement_for
from services.conductor.placement_policy import Placement, PlacementPolicy, PlacementRequest

NO_STORE_DOWN: frozenset[str] = frozenset()


@dataclass(frozen=True)
class TaskFields:
    """What a placement hands its prefill instance (PrefillTask's placement fields)."""

    prefill_instance: str
    prefill_node: str
    decode_instance: str
    decode_node: str
    expected_hit_blocks: int  # leading blocks the prefill node itself holds
    source: PrefixSource | None  # a remote prefix to pull (hot-spot migration)
    est_ttft_s: float
    cpp_stages: tuple[str, ...]
    cpp_chunk_tokens: int
    prefill_incarnation: int
    decode_incarnation: int


@dataclass(frozen=True)
class Placed:
    """A placement and the task fields made of it."""

    placement: Placement
    task: TaskFields


def request_for(req: GenerateRequest, block_size: int) -> PlacementRequest:
    """The request as placement sees it. Its block hashes are trusted as admission
    checked them (the one check: services.admission.service.AdmissionService.fill;
    :meth:`PlacementRequest.from_request` says why), computed only for another block
    size."""
    return PlacementRequest.from_request(req, block_size)


def place(
    policy: PlacementPolicy,
    preq: PlacementRequest,
    match: Callable[[Sequence[int]], Mapping[str, int]],
    *,
    down: Collection[str] = NO_STORE_DOWN,
    migration: Migration | None = None,
) -> Placed | Rejection:
    """One round: ``match`` is the prefix index's (node -> prefix blocks), ``down`` the
    nodes whose store is down, ``migration`` a dead attempt's (its instance excluded,
    no SLO rejection). The policy records the dispatch of what it places."""
    avoid: Mapping[str, tuple[str, ...]] = {}
    if migration is not None:
        preq, avoid = placement_for(preq, migration, policy.loads.incarnation)
    hits = match(preq.block_hashes)
    decision = policy.place(preq, hits, **_away(policy, avoid, down))
    if isinstance(decision, Rejection) and avoid and migration is not None and migration.wedged:
        # A wedged instance is alive: avoided while another of its role is live, and
        # placed on again when it is the only one (Migration.wedged).
        decision = policy.place(preq, hits, **_away(policy, {}, down))
    if isinstance(decision, Rejection):
        return decision
    return Placed(decision, task_fields(policy, decision))


def _away(
    policy: PlacementPolicy, exclude: Mapping[str, tuple[str, ...]], down: Collection[str]
) -> Mapping[str, tuple[str, ...]]:
    """``exclude`` plus, where stores are down, the instances on their nodes (from the
    policy's node maps)."""
    if not down:
        return exclude
    return away_from_stores(
        exclude, down, policy.on_nodes(Role.PREFILL, down), policy.on_nodes(Role.DECODE, down)
    )


def task_fields(policy: PlacementPolicy, p: Placement) -> TaskFields:
    """The fields of the PrefillTask for ``p`` (incarnations as reported now)."""
    inc = policy.loads.incarnation
    return TaskFields(
        prefill_instance=p.prefill_instance,
        prefill_node=p.prefill_node,
        decode_instance=p.decode_instance,
        decode_node=p.decode_node,
        expected_hit_blocks=p.expected_hit_blocks,
        source=p.source,
        est_ttft_s=p.est_ttft_s,
        cpp_stages=tuple(p.cpp_stages),
        cpp_chunk_tokens=p.cpp_chunk_tokens,
        prefill_incarnation=inc(Role.PREFILL, p.prefill_instance),
        decode_incarnation=inc(Role.DECODE, p.decode_instance),
    )
