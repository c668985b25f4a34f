"""The placement search in time independent of the cluster's size (issue 27 item 1):
the same choice as :class:`~services.conductor.placement_policy.PlacementPolicy` scanning every
instance, from a few candidates.

Prefill (strategies ``global`` and ``local``; ``load`` takes the order's first usable
instance)::

    holders  the instances on the nodes the prefix index matched share one (prefix,
             pull, transfer) option per prefix length: a length held by at most
             ``DIRECT`` instances is evaluated outright; one held by more (a system
             prompt every node holds) is walked with the others
    others   the instances holding nothing share one option; they and the walked
             holders go from the least queued (``orders.prefill``, keyed by each
             instance's queued work as ``queue_s`` sums it), each with its own option,
             until the least over the walked options of
             factor_floor * (transfer + queue + prefill_floor) exceeds the best TTFT

The bound holds for every instance not yet walked: its queue is at least the walked
key, its prefill time at least the cost floor's (services.common.cost_floor), its TTFT
feedback factor at least the floor of the factors. A tie (bound equal to the best) goes
on walking, so the tie-breaks decide as in the full scan. When no instance has a model
of its own (``CostFloor.uniform``: the simulator, the bench, a fixed cost model) every
instance left with an option computes what the first one walked with it does, so its
prefill time replaces the floor and the bound is exact: the walk stops at the first key
that cannot match the best TTFT, and in a group of equal keys each walked option costs
one evaluation (its first instance by name, when its factor is the least, settles it: the
rest with that option tie and lose by name); once every walked option is settled the
walk jumps past the group (an x10 cluster's idle instances, some holding a copy's system
prompt and some not, cost two evaluations, not one per idle instance).

The holders come grouped by length from the prefix index
(:class:`~services.conductor.prefix_index.Matches`): the instances on a length's nodes
are counted with ``map``/``sum`` over the node map, and the pull source (least bytes in
flight, then name) is the least name among the holders less the nodes with pulls in
flight, which alone are looked at one by one (``PlacementPolicy._least_inflight``). A
prefix that every node holds costs set operations over its holders, no Python step each.

CPP groups (:func:`best_group`, ``cpp.group_size`` > 1): a request computing fewer than
``cpp.min_tokens`` tokens is offered none (no group evaluated). A longer one walks the
groups (:class:`Groups`: every ``size`` live instances in name order, kept ordered by
their busiest member's key) until the floor of a pipeline's TTFT (the busiest
member's key plus a stage's share of the floor of the compute) exceeds the best.
The singles' walk settles a tied group only on an instance that is no stage of a
pipeline (the scan's tie-break after the TTFT prefers one that is none).

Decode: ``orders.decode`` keyed by (batch occupancy once one more joins, KV tokens,
then the TBT model's other inputs), the first keys of the full scan's choice among the
instances meeting the TBT SLO; equal keys tie under one model (one evaluation). The
walk takes the first level of occupancy holding an instance that meets it and, inside
it, stops once the TBT floor at the walked KV exceeds the best TBT. While none meets
the SLO (overload: the request is rejected unless the TBT check is off; the scan takes
the least TBT) an instance past its batch cap takes ``ceil(occupancy)`` steps per
token, so the floor of that many steps (``CostFloor.tbt``) bounds the rest of the
walk: it stops once that floor is above both the SLO and the least TBT seen, and
leaves an occupancy once the floor at its KV is. Instances reporting no cap count one
step (``Orders.decode_uncapped``).

Random (the ``random`` baseline): the full scan draws ``rng.choice`` over the live,
non-excluded prefill instances in name order; :class:`LivePool` is that list as a view
of the load book's ordered names less its silent and excluded ones, so the same draw
picks the same instance in O((silent + excluded) log n), and only it is evaluated.

What costs per instance here: dead or forgotten instances still in the orders are
skipped (and dropped from the orders when met); an instance excluded by the request
(migration, a store down) is skipped, and with CPP groups on it makes that request's
groups be formed and evaluated all (the groups after it in name order are not the kept
ones); the groups are built again, O(n log n), when a prefill name comes or goes or
the silent set changes; with fitted prefill models of their own, the instances read
from any order until the threshold passes the best (about the square root of the
cluster's size where queues and fits are spread independently, issue 27's bench);
overloaded decode instances at the same number of rounds, KV below the bound, are each
evaluated; with decode models of their own, the instances of a group of equal inputs
whose TBT before anything joins is at most the best.

Fitted models (``CostFloor.uniform`` false). Prefill: the threshold walk
(:func:`_threshold_walk`, Fagin's threshold algorithm) reads the queue order and the
orders by each fitted coefficient (:class:`FitOrders`) in turn; an instance not read in
any of them is bounded by the next entry of each. Decode: the key's last term is the
TBT the instance's own model predicts before anything joins, which bounds its TBT once
a request joins from below (every known model's TBT grows with what joins); inside a
group of equal inputs the walk passes over the rest from the first whose term is above
the best TBT (the fit at the level, or the least TBT over the SLO). A model of unknown
shape (``CostFloor.tbt`` is -inf) turns that off.
"""

import math
from collections.abc import Collection, Mapping
from typing import Any

from sortedcontainers import SortedList

from bus_schemas.roles import Role
from services.common.cost_floor import SHADE, prefill_coefs
from services.conductor.load_order import LoadOrder
from services.conductor.prefix_index import NodeGroup, NodeWeights
from services.policy.chunk_timing import chunk_bounds, form_groups

# Holders of one prefix length on at most this many instances are evaluated outright.
DIRECT = 16

# The policy, its requests and candidates are services.conductor.placement_policy's, which imports
# this module (typed Any here: no import back).
Policy = Any
Candidate = Any


class Orders:
    """The policy's ordered load structures and its node -> instances maps."""

    def __init__(self) -> None:
        self.prefill = LoadOrder()
        self.decode = LoadOrder()
        # Prefill instances by node: always a subset of ``prefill`` (drop removes from
        # both), so the search can count the instances that hold no prefix.
        self.on_node: dict[str, set[str]] = {}
        self.weights = NodeWeights()  # on_node in the prefix index's ids (NodeGroup.weigh)
        self.node_of: dict[str, str] = {}  # prefill instance -> its node in on_node
        self.decode_on_node: dict[str, set[str]] = {}
        # Decode instances reporting no batch cap (max_batch <= 0): their steps do not
        # take turns, so the decode walk's bound counts one step per token. A superset
        # (one forgotten may stay): it only weakens the bound.
        self.decode_uncapped: set[str] = set()
        self.groups = Groups(self.prefill)
        self.fits = FitOrders()

    def set_prefill(self, instance: str, key: Any) -> None:
        """Re-key ``instance`` in the prefill order (one joining has its fit looked up)."""
        if instance not in self.prefill:
            self.fits.dirty.add(instance)
        self.prefill.set(instance, key)

    def drop(self, instance: str) -> None:
        """``instance`` leaves the prefill order and its node's set."""
        self.prefill.discard(instance)
        self.fits.dirty.add(instance)
        self.weights.changed()
        node = self.node_of.pop(instance, None)
        held = self.on_node.get(node) if node is not None else None
        if held is not None:
            held.discard(instance)
            if not held:
                del self.on_node[node]  # type: ignore[arg-type]

    def moved(
        self, instance: str, old_node: str | None, node: str | None, role: str = Role.PREFILL
    ) -> None:
        if role == Role.PREFILL:
            # Where on_node holds it, even if the load book forgot it meanwhile.
            old_node = self.node_of.get(instance)
            if node is None:
                self.node_of.pop(instance, None)
            else:
                self.node_of[instance] = node
        if old_node == node:
            return
        if role == Role.PREFILL:
            self.weights.changed()
        by_node = self.on_node if role == Role.PREFILL else self.decode_on_node
        if old_node is not None:
            held = by_node.get(old_node)
            if held is not None:
                held.discard(instance)
                if not held:
                    del by_node[old_node]
        if node is not None:
            by_node.setdefault(node, set()).add(instance)


class FitOrders:
    """The prefill instances with a fitted prefill of the reported form (``e0 + e1 (n - p)
    + e2 (n^2 - p^2)``, :func:`~services.common.cost_floor.prefill_coefs`) ordered by each
    coefficient, and the ones with any other model: the threshold walk's sorted lists
    (:func:`best_prefill`). An instance not yet read from any list has each coefficient
    at least the list's next one, so its prefill time is at least that polynomial.

    Kept in step lazily: :meth:`sync` looks again at the instances whose model changed
    (``CostFloor.changed``) or that joined or left the prefill order (``dirty``), O(log n)
    each; a placement with nothing changed pays nothing."""

    def __init__(self) -> None:
        self.by_coef = [LoadOrder() for _ in range(3)]
        self.coefs: dict[str, tuple[float, float, float]] = {}
        self.unfitted: set[str] = set()  # in the prefill order, any other model
        self.dirty: set[str] = set()

    def sync(self, book: Any, prefill: LoadOrder) -> None:
        """Look again at the ``dirty`` instances (the policy adds those whose model
        changed, ``CostFloor.changed``)."""
        if not self.dirty:
            return
        for instance in self.dirty:
            placed = instance in prefill
            e = prefill_coefs(book.cost(instance)) if placed else None
            self.unfitted.discard(instance)
            if e is not None:
                self.coefs[instance] = e
                for order, v in zip(self.by_coef, e, strict=True):
                    order.set(instance, v)
                continue
            if self.coefs.pop(instance, None) is not None:
                for order in self.by_coef:
                    order.discard(instance)
            if placed:
                self.unfitted.add(instance)
        self.dirty.clear()


class Groups:
    """The CPP groups (``chunk_timing.form_groups``: every ``size`` live prefill
    instances in name order) ordered by their members' greatest key in ``order`` (the
    prefill order's key: at most what the member's queue is), O(size + log n) per
    re-key. Built over the load book's names less the silent ones; built again, in
    O(n log n), when a name comes or goes or the silent set changes (an event, not a
    request)."""

    def __init__(self, order: LoadOrder) -> None:
        self._order = order
        self.stamp: tuple[Any, ...] | None = None
        self.members: list[tuple[str, ...]] = []
        self._of: dict[str, int] = {}
        self._top: list[float] = []
        self.by_top: SortedList = SortedList()  # (greatest member key, group index)

    def build(self, stamp: tuple[Any, ...], pool: list[str], size: int) -> None:
        self.stamp = stamp
        self.members = form_groups(pool, size)
        self._of = {m: k for k, g in enumerate(self.members) for m in g}
        self._top = [self._top_of(g) for g in self.members]
        self.by_top = SortedList(zip(self._top, range(len(self.members)), strict=True))

    def _top_of(self, members: tuple[str, ...]) -> float:
        return max(self._order.key(m) or 0.0 for m in members)

    def touched(self, instance: str) -> None:
        """``instance``'s key changed: its group's place in ``by_top`` follows."""
        k = self._of.get(instance)
        if k is None:
            return
        top = self._top_of(self.members[k])
        if top != self._top[k]:
            self.by_top.remove((self._top[k], k))
            self._top[k] = top
            self.by_top.add((top, k))


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
    groups: Mapping[int, Collection[str]] | None = None,
) -> Candidate | None:
    """The candidate the full scan's ``min(cands, key=rank)`` picks; None when no live
    prefill instance is left. ``groups``: ``own``'s nodes by length (built from
    ``own`` when not given)."""
    orders, loads, prefill = policy.orders, policy.loads, policy.loads.prefill
    inflight = policy.inflight_bytes(best_node) if best_node is not None else 0.0
    threshold = policy.threshold()
    options: dict[int, tuple[int, Any, float]] = {}
    best: Candidate | None = None
    best_rank: tuple[Any, ...] | None = None

    def usable(instance: str) -> bool:
        return instance not in excluded and loads.alive(Role.PREFILL, instance)

    if policy.strategy == "load":  # least queued work, then name: the order's first
        # Exact with CPP groups on too: ``load`` never places a group, so no pipeline
        # adds to a queue (queue_s is the key).
        stale: list[str] = []
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
            orders.drop(instance)
        return best

    # Holders share an option per prefix length. A length held by few instances is
    # evaluated outright; the others (a prefix every node holds, and the instances
    # holding nothing) are walked from the least queued, each with its own option.
    by_len = groups
    if by_len is None:
        by_len = {}
        for node, own_len in own.items():
            by_len.setdefault(own_len, []).append(node)  # type: ignore[attr-defined]
    held = 0
    walked: dict[int, list[Any]] = {}  # own length -> [transfer_s, compute floor, option]
    floor = policy._book.floor
    on_node = orders.on_node
    for own_len, nodes in by_len.items():
        # The prefill instances on these nodes, counted without a Python step per node.
        if isinstance(nodes, NodeGroup):
            size = nodes.weigh(on_node, orders.weights)
        else:
            size = sum(map(len, filter(None, map(on_node.get, nodes))))
        held += size
        if size > DIRECT:
            walked[own_len] = []
            continue
        for node in nodes:
            for instance in orders.on_node.get(node, ()):
                ld = prefill.get(instance)
                if ld is None or ld.node != node or not usable(instance):
                    continue
                opt = policy._option(
                    req, own_len, best_len, best_node, inflight, threshold, options
                )
                c = policy._candidate(req, instance, node, own_len, opt)
                r = rank(c)
                if best_rank is None or r < best_rank:
                    best, best_rank = c, r
    if len(orders.prefill) > held:  # some instance holds nothing (on_node is a subset)
        walked[0] = []
    if not walked:
        return best
    for own_len, bound in walked.items():
        opt = policy._option(req, own_len, best_len, best_node, inflight, threshold, options)
        computed = computed_prefix(req.num_tokens, req.block_size, opt[0])
        bound += [opt[2], floor.prefill(req.num_tokens, computed), opt]
    factor_floor = policy.feedback.floor() if policy.feedback is not None else 1.0
    # With one model for all (none has its own) an option's first walked instance
    # computes exactly what every later one with that option does: its prefill time
    # replaces the floor and the bound is exact. Equal keys then tie (one option) and the
    # first usable one by name is the group's choice, when its factor is the least.
    # Under one model an option evaluated at a key, with the least factor, settles that
    # option for the rest of the key's group (same TTFT, later by name): those are
    # passed over unevaluated, and once every walked option is settled the walk jumps
    # past the group.
    same_model = floor.uniform
    if not same_model:
        orders.fits.sync(policy._book, orders.prefill)  # the models changed meanwhile
        if orders.fits.coefs:
            return _threshold_walk(policy, req, own, walked, best, usable, factor_floor)
    settled: dict[int, Any] = {}  # own length -> the key it was settled at
    stale = []
    it = iter(orders.prefill)
    entry = next(it, None)
    while entry is not None:
        key, instance = entry
        entry = next(it, None)  # read ahead: does this key have a group to skip?
        if (
            best is not None
            and factor_floor * min((t + key) + f for t, f, _ in walked.values()) > best.ttft_s
        ):
            break
        found = _walked(prefill, instance, own, walked, usable, stale)
        if found is None:
            continue
        ld, own_len, option = found
        if own_len in settled and settled[own_len] == key:
            continue  # ties the option's first instance of this key, later by name
        c = policy._candidate(req, instance, ld.node, own_len, option[2])
        r = rank(c)
        if best_rank is None or r < best_rank:
            best, best_rank = c, r
        if same_model:
            option[1] = c.prefill_s
            # Settled for the rest of the key's group when nothing later can beat it: the
            # least factor and no pipeline stage (the tie-break after the TTFT prefers an
            # instance that is none; only a stage's queue can exceed its key).
            if c.factor <= factor_floor and not c.in_pipeline:
                settled[own_len] = key
                if (
                    entry is not None
                    and entry[0] == key
                    and all(settled.get(n) == key for n in walked)
                ):
                    it = orders.prefill.after(key)  # every option of the group is settled
                    entry = next(it, None)
    for instance in stale:
        orders.drop(instance)
    return best


def _walked(
    prefill: Mapping[str, Any],
    instance: str,
    own: Mapping[str, int],
    walked: dict[int, list[Any]],
    usable: Any,
    stale: list[str],
) -> tuple[Any, int, list[Any]] | None:
    """(load, own prefix length, walked option) of ``instance`` for a walk to evaluate;
    None when it is stale (noted in ``stale``), evaluated outright (its length is not
    walked) or not to be placed on."""
    ld = prefill.get(instance)
    if ld is None:
        stale.append(instance)
        return None
    own_len = own.get(ld.node, 0)
    option = walked.get(own_len)
    if option is None or not usable(instance):
        return None
    return ld, own_len, option


def _threshold_walk(
    policy: Policy,
    req: Any,
    own: Mapping[str, int],
    walked: dict[int, list[Any]],
    best: Candidate | None,
    usable: Any,
    factor_floor: float,
) -> Candidate | None:
    """The walk of :func:`best_prefill` where instances have fitted models of their own
    (Fagin's threshold algorithm): the least queued order and the orders by each fitted
    coefficient (:class:`FitOrders`) are read one entry each in turn, and every instance
    read in any of them is evaluated, once. One not read yet queues at least the queue
    order's next key and, if fitted, has each coefficient at least that order's next
    one; with any other model, at least ``CostFloor.prefill_unfitted``. The walk stops
    once ``factor_floor * (transfer + that key + the least such prefill time)`` exceeds
    the best TTFT, over every walked option; an exhausted coefficient order means every
    fitted instance has been read. With fits that differ by a spread the walk reads the
    instances whose queues and fits are both near the least, not every instance whose
    queue is within the spread of the compute."""
    orders, prefill, floor = policy.orders, policy.loads.prefill, policy._book.floor
    fits = orders.fits
    n = req.num_tokens
    bounds = []  # per walked option: transfer, its monomials, the unfitted floor
    for bound in walked.values():
        opt = bound[2]
        p = computed_prefix(n, req.block_size, opt[0])
        m1, m2 = float(n - p), float(n * n - p * p)
        unfitted = floor.prefill_unfitted(n, p) if fits.unfitted else math.inf
        bounds.append((bound[0], m1, m2, unfitted))
    best_rank = rank(best) if best is not None else None
    lists = [iter(orders.prefill), *(iter(o) for o in fits.by_coef)]
    heads = [next(it, None) for it in lists]
    seen: set[str] = set()
    stale: list[str] = []
    while heads[0] is not None:
        if best is not None:
            q = heads[0][0]
            h0, h1, h2 = heads[1], heads[2], heads[3]
            least = math.inf
            for t, m1, m2, unfitted in bounds:
                f = unfitted
                if h0 is not None and h1 is not None and h2 is not None:
                    f = min(f, (h0[0] + h1[0] * m1 + h2[0] * m2) * SHADE)
                least = min(least, t + q + f)
            if factor_floor * least > best.ttft_s:
                break
        for k, it in enumerate(lists):
            entry = heads[k]
            if entry is None:
                continue
            heads[k] = next(it, None)
            instance = entry[1]
            if instance in seen:
                continue
            seen.add(instance)
            found = _walked(prefill, instance, own, walked, usable, stale)
            if found is None:
                continue
            ld, own_len, option = found
            c = policy._candidate(req, instance, ld.node, own_len, option[2])
            r = rank(c)
            if best_rank is None or r < best_rank:
                best, best_rank = c, r
    for instance in stale:
        orders.drop(instance)
    return best


def best_group(
    policy: Policy,
    req: Any,
    own: Mapping[str, int],
    excluded: Collection[str],
    best: Candidate,
    groups: Mapping[int, Collection[str]] | None = None,
) -> Candidate:
    """What the full scan's ``min(singles + groups, key=rank)`` picks given ``best``,
    the singles' choice (:func:`best_prefill`): the CPP groups (PlacementPolicy's
    ``_group_candidates``) walked from the least greatest member key until

        SHADE * factor_floor * (greatest member key + compute floor)

    exceeds the best TTFT. A pipeline's first token comes after every stage has
    started (at the member's queue, at least its key) and computed its share of the
    chunks (at least the cost floor's, ``CostFloor.prefill`` / size), whatever the
    group's prefix (the floor is taken at the least over no prefix and every length
    the request's holders hold). A request computing fewer than ``cpp.min_tokens``
    tokens is offered no group: none evaluated. Where the request excludes a live
    instance (a migration, a store down) the groups after it in name order are not the
    ones kept: they are formed and evaluated for it alone, every one (the scan)."""
    cpp = policy.cpp
    if req.num_tokens < cpp.min_tokens:  # computes at most num_tokens on any group
        return best
    loads = policy.loads
    if any(i in loads.prefill and loads.alive(Role.PREFILL, i) for i in excluded):
        pool = [i for i in policy.live_prefill() if i not in excluded]
        cands = [best, *policy._group_candidates(req, pool, own)]
        return min(cands, key=rank)
    silent = loads.silent(Role.PREFILL)
    cache = policy.orders.groups
    stamp = (loads.version, cpp.group_size, tuple(sorted(silent)))
    if cache.stamp != stamp:
        gone = set(silent)
        pool = [i for i in loads.names(Role.PREFILL) if i not in gone]
        cache.build(stamp, pool, cpp.group_size)
    floor = policy._book.floor
    lengths = {0, *(groups if groups is not None else own.values())}
    size = cpp.group_size
    compute = min(
        sum(
            floor.prefill(b, a)
            for a, b in chunk_bounds(
                req.num_tokens,
                computed_prefix(req.num_tokens, req.block_size, n),
                cpp.chunk_tokens,
            )
        )
        for n in lengths
    )
    compute /= size
    factor_floor = policy.feedback.floor() if policy.feedback is not None else 1.0
    best_rank = rank(best)
    for top, k in cache.by_top:
        if SHADE * factor_floor * (top + compute) > best_rank[0]:
            break
        c = policy._group_candidate(req, cache.members[k], own)
        if c is None:
            continue
        r = rank(c)
        if r < best_rank:
            best, best_rank = c, r
    return best


def _rounds(occupancy: float) -> int:
    """``ceil(occupancy)``: the steps per token of an instance whose batch, once one
    more joins, fills ``occupancy`` of its cap (a quotient of small integers: one above
    an integer is above it by at least 1/max_batch, far beyond the shading)."""
    return max(1, math.ceil(occupancy * (1 - 1e-12)))


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
    joining = seqs * num_tokens
    # Steps per token of every instance from here on (ascending occupancy): at least
    # ceil(occupancy) where each one has a batch cap (CostFloor.tbt).
    capped = not orders.decode_uncapped
    # Every model's TBT grows with what joins (known shapes): the keys' last term, the
    # TBT before anything joins, bounds it from below.
    monotone = floor.tbt(0) > -math.inf
    stale = []
    it = iter(orders.decode)
    entry = next(it, None)
    while entry is not None:
        key, instance = entry
        entry = next(it, None)
        occupancy, kv = key[0], key[1]
        if level is not None:
            if occupancy > level:
                break
            assert fit is not None
            if floor.tbt(kv + joining) > fit[0]:
                break  # the rest of the level holds more KV
        elif over is not None:
            # Nothing fits yet: the rest is over the SLO and loses to ``over`` once the
            # floor of its steps is above both (a tie walks on: the name decides).
            rounds = _rounds(occupancy) if capped else 1
            if floor.tbt(joining, rounds) > max(slo, over[0]):
                break
            if floor.tbt(kv + joining, rounds) > max(slo, over[0]):
                # The rest of this occupancy holds more KV: on to the next one.
                it = orders.decode.after((occupancy, math.inf))
                entry = next(it, None)
                continue
        least = fit[0] if fit is not None else over[0] if over is not None else None
        if monotone and least is not None and key[5] > least:
            # Its TBT is at least its key's last term, above the best: so is the rest of
            # its group of equal inputs (ordered by that term), under models of their own.
            it = orders.decode.after((*key[:5], math.inf))
            entry = next(it, None)
            continue
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
        if same_model and entry is not None and entry[0] == key:
            it = orders.decode.after(key)  # the rest of this key's group ties, later by name
            entry = next(it, None)
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
