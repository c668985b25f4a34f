"""The placement search in time independent of the cluster's size (issue 27 item 1):
the same choice as :class:`~services.conductor.policy.PlacementPolicy` scanning every
instance, from a few candidates.

Prefill (strategies ``global`` and ``local``, no CPP groups; ``load`` takes the
order's first usable instance)::

    holders  the instances on the nodes the prefix index matched (their own prefix
             differs per node): each evaluated exactly
    others   every other instance has no prefix of its own, so one (prefix, pull,
             transfer) option: walked from the least queued (``orders.prefill``, keyed
             by each instance's queued work as ``queue_s`` sums it) until the bound
             factor_floor * (transfer + queue + prefill_floor) exceeds the best TTFT found

The bound holds for every instance not yet walked: its queue is at least the walked
key, its prefill time at least the cost floor's (services.common.cost_floor), its TTFT
feedback factor at least the floor of the factors. A tie (bound equal to the best) goes
on walking, so the tie-breaks decide as in the full scan. With the uniform cost model
and no feedback (the simulator, the bench) the walk stops after the first instance
whose queue exceeds the best TTFT less its compute.

Decode: ``orders.decode`` keyed by (batch occupancy once one more joins, KV tokens),
the first keys of the full scan's choice among the instances meeting the TBT SLO. The
walk takes the first level of occupancy holding an instance that meets it and, inside
it, stops once the TBT floor at the walked KV exceeds the best TBT. When no instance
meets the SLO (overload: the request is rejected unless the TBT check is off) the
walk sees every live decode instance, as the full scan does.

Random (the ``random`` baseline): the full scan draws ``rng.choice`` over the live,
non-excluded prefill instances in name order; :class:`LivePool` is that list as a view
of the load book's ordered names less its silent and excluded ones, so the same draw
picks the same instance in O((silent + excluded) log n), and only it is evaluated.

What costs per instance here: dead or forgotten instances still in the orders are
skipped (and dropped from the orders when met); an instance excluded by the request
(migration, a store down) is skipped.
"""

from collections.abc import Collection, Mapping
from typing import Any

from sortedcontainers import SortedList

from bus_schemas.roles import Role
from services.conductor.load_order import LoadOrder

# The policy, its requests and candidates are services.conductor.policy's, which imports
# this module (typed Any here: no import back).
Policy = Any
Candidate = Any


class Orders:
    """The policy's ordered load structures and its node -> instances maps."""

    def __init__(self) -> None:
        self.prefill = LoadOrder()
        self.decode = LoadOrder()
        self.on_node: dict[str, set[str]] = {}  # prefill instances by node
        self.decode_on_node: dict[str, set[str]] = {}

    def moved(
        self, instance: str, old_node: str | None, node: str | None, role: str = Role.PREFILL
    ) -> None:
        if old_node == node:
            return
        by_node = self.on_node if role == Role.PREFILL else self.decode_on_node
        if old_node is not None:
            held = by_node.get(old_node)
            if held is not None:
                held.discard(instance)
                if not held:
                    del by_node[old_node]
        if node is not None:
            by_node.setdefault(node, set()).add(instance)


def computed_prefix(num_tokens: int, block_size: int, prefix_blocks: int) -> int:
    """Tokens of the prompt whose KV is reused; at least the last token is always
    recomputed (its logits give the first token)."""
    return min(prefix_blocks * block_size, max(num_tokens - 1, 0))


def rank(c: Candidate) -> tuple[Any, ...]:
    """The full scan's order of candidates (PlacementPolicy.place)."""
    return (c.ttft_s, len(c.stages), c.in_pipeline, -c.prefix_blocks, c.instance)


def best_prefill(
    policy: Policy,
    req: Any,
    own: Mapping[str, int],
    best_len: int,
    best_node: str | None,
    excluded: Collection[str],
) -> Candidate | None:
    """The candidate the full scan's ``min(cands, key=rank)`` picks; None when no live
    prefill instance is left."""
    orders, loads, prefill = policy.orders, policy.loads, policy.loads.prefill
    inflight = policy.inflight_bytes(best_node) if best_node is not None else 0.0
    threshold = policy.threshold()
    options: dict[int, tuple[int, Any, float]] = {}
    best: Candidate | None = None
    best_rank: tuple[Any, ...] | None = None

    def usable(instance: str) -> bool:
        return instance not in excluded and loads.alive(Role.PREFILL, instance)

    if policy.strategy == "load":  # least queued work, then name: the order's first
        stale = []
        for _, instance in orders.prefill:
            ld = prefill.get(instance)
            if ld is None:
                stale.append(instance)
            elif usable(instance):
                own_len = own.get(ld.node, 0)
                opt = policy._option(req, own_len, best_len, best_node, inflight, threshold, {})
                best = policy._candidate(req, instance, ld.node, own_len, opt)
                break
        for instance in stale:
            orders.prefill.discard(instance)
        return best

    for node, own_len in own.items():
        for instance in orders.on_node.get(node, ()):
            ld = prefill.get(instance)
            if ld is None or ld.node != node or not usable(instance):
                continue
            opt = policy._option(req, own_len, best_len, best_node, inflight, threshold, options)
            c = policy._candidate(req, instance, node, own_len, opt)
            r = rank(c)
            if best_rank is None or r < best_rank:
                best, best_rank = c, r

    opt = policy._option(req, 0, best_len, best_node, inflight, threshold, options)
    prefix, _, transfer_s = opt
    computed = computed_prefix(req.num_tokens, req.block_size, prefix)
    prefill_floor = policy._book.floor.prefill(req.num_tokens, computed)
    factor_floor = policy.feedback.floor() if policy.feedback is not None else 1.0
    # Instances with equal keys tie exactly when they share a model and their factor is
    # the least there is: the first usable one by name is then the group's choice.
    same_model = policy._book.floor.uniform
    stale = []
    it = iter(orders.prefill)
    while (entry := next(it, None)) is not None:
        key, instance = entry
        if best is not None and factor_floor * (transfer_s + key + prefill_floor) > best.ttft_s:
            break
        ld = prefill.get(instance)
        if ld is None:
            stale.append(instance)
            continue
        if ld.node in own or not usable(instance):
            continue
        c = policy._candidate(req, instance, ld.node, 0, opt)
        r = rank(c)
        if best_rank is None or r < best_rank:
            best, best_rank = c, r
        if same_model and c.factor <= factor_floor:
            it = orders.prefill.after(key)  # the rest of this key's group ties, later by name
    for instance in stale:
        orders.prefill.discard(instance)
    return best


def best_decode(
    policy: Policy, num_tokens: int, slo: float, excluded: Collection[str], seqs: int = 1
) -> tuple[str, float] | None:
    """(instance, predicted TBT) as the full scan's ``_pick_decode`` chooses for a
    request of ``seqs`` sequences; None when no live decode instance is left."""
    orders, loads, decode = policy.orders, policy.loads, policy.loads.decode
    floor = policy._book.floor
    level = None
    fit: tuple[float, str] | None = None  # (tbt, instance) at the level
    over: tuple[float, str] | None = None  # the least (tbt, instance) over the SLO
    # Equal keys are equal inputs to the TBT model: with one model for all, the first
    # usable instance of a group by name is the group's choice.
    same_model = floor.uniform
    stale = []
    it = iter(orders.decode)
    while (entry := next(it, None)) is not None:
        key, instance = entry
        occupancy, kv = key[0], key[1]
        if level is not None:
            if occupancy > level:
                break
            assert fit is not None
            if floor.tbt(kv + seqs * num_tokens) > fit[0]:
                break  # the rest of the level holds more KV
        if instance not in decode:
            stale.append(instance)
            continue
        if instance in excluded or not loads.alive(Role.DECODE, instance):
            continue
        tbt = policy.predicted_tbt(instance, num_tokens, seqs)
        if tbt <= slo:
            level = occupancy
            if fit is None or (tbt, instance) < fit:
                fit = (tbt, instance)
        elif fit is None and (over is None or (tbt, instance) < over):
            over = (tbt, instance)
        if same_model:
            it = orders.decode.after(key)  # the rest of this key's group ties, later by name
    for instance in stale:
        orders.decode.discard(instance)
    pick = fit or over
    return None if pick is None else (pick[1], pick[0])


class LivePool:
    """The sorted ``names`` less ``gone`` (a few of them), as a sequence: what
    ``random.choice`` indexes, without building the list."""

    def __init__(self, names: SortedList, gone: Collection[str]) -> None:
        self._names = names
        self._holes = sorted(names.index(i) for i in gone)

    def __len__(self) -> int:
        return len(self._names) - len(self._holes)

    def __getitem__(self, k: int) -> str:
        if not 0 <= k < len(self):
            raise IndexError(k)
        for hole in self._holes:  # ascending: each one at or before k shifts it on
            if hole > k:
                break
            k += 1
        return str(self._names[k])


def live_pool(policy: Policy, excluded: Collection[str]) -> LivePool:
    """The live prefill instances not ``excluded``, in name order (the full scan's list
    for the ``random`` strategy)."""
    loads = policy.loads
    gone = set(loads.silent(Role.PREFILL))
    gone.update(i for i in excluded if i in loads.prefill)
    return LivePool(loads.names(Role.PREFILL), gone)
