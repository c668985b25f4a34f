"""The prefill walk where instances have fitted models of their own (issue 27 item 1):
the threshold walk over the queue order and the orders by each fitted coefficient
(services.conductor.search._threshold_walk) chooses what the full scan chooses, and
reads the few instances near the least queue and the least fit, not every instance
whose queue is within the fits' spread."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_schemas.load import CostFit
from services.common.calibration import model_from
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    TtftFeedback,
)
from services.conductor.prefix_index import Matches
from tests.unit.conductor.test_pruned_search import BS, _decode, _policy, _prefill


def _fit(c0: float, c1: float = 0.0, c2: float = 0.0) -> CostFit:
    return CostFit(prefill=[c0, c1, c2], decode=None)


class _Counted:
    """Counts the policy's candidate evaluations (one per instance looked at)."""

    def __init__(self, policy: PlacementPolicy) -> None:
        self.n = 0
        inner = policy._candidate

        def counted(*a, **kw):
            self.n += 1
            return inner(*a, **kw)

        policy._candidate = counted  # type: ignore[method-assign]


def test_a_fast_instance_behind_a_long_queue_is_found_in_two_reads():
    """200 instances, queues 0, 0.01, ... 1.99 s. p150 (queue 1.5 s) computes in 0.5 s,
    every other one in 2.2 s: p150's TTFT of 2.0 s is the least. The floor of the fits
    is 0.5 s, so a walk by queue alone reads every instance queued under 1.5 s (151).
    The threshold walk reads p0 (least queue) and p150 (least c0); after them the next
    queue (0.01) plus the next c0 (2.2) is above 2.0: two evaluations."""
    clock = ManualClock(0.0)
    chosen = []
    for pruned in (True, False):
        p = _policy(pruned, clock)
        for i in range(200):
            fit = _fit(0.5 if i == 150 else 2.2)
            p.observe_prefill(_prefill(i, 0.01 * i, f"n{i}", 0.0, fit))
        p.observe_decode(_decode(0, 0, 0))
        counted = _Counted(p)
        d = p.place(PlacementRequest("r", 4 * BS, tuple(range(4)), BS), Matches.of({}))
        assert isinstance(d, Placement)
        chosen.append(d)
        if pruned:
            assert counted.n == 2
        else:
            assert counted.n == 200
    assert chosen[0] == chosen[1] and chosen[0].prefill_instance == "p150"


def test_the_walk_goes_on_while_the_bound_at_the_cursors_is_below_the_best():
    """p0..p9 queue 0, 0.1, ... 0.9 s; p5 computes in 1.0 s (TTFT 1.5 s, the least),
    the others in 1.6 s; p10..p19 compute in 0.9 s behind 5 s queues. The first round
    finds p0 (1.6 s); the bound, the next queue plus the next c0 (0.9 s of p10..p19),
    stays below it until p5 is read from the queue order in the sixth round. A bound
    above the cursors' polynomial (by 30 %) stops a round before and keeps p0."""
    clock = ManualClock(0.0)
    chosen = []
    for pruned in (True, False):
        p = _policy(pruned, clock)
        for i in range(10):
            p.observe_prefill(_prefill(i, 0.1 * i, f"n{i}", 0.0, _fit(1.0 if i == 5 else 1.6)))
        for i in range(10, 20):
            p.observe_prefill(_prefill(i, 5.0, f"n{i}", 0.0, _fit(0.9)))
        p.observe_decode(_decode(0, 0, 0))
        d = p.place(PlacementRequest("r", 4 * BS, tuple(range(4)), BS), Matches.of({}))
        assert isinstance(d, Placement)
        chosen.append(d)
    assert chosen[0] == chosen[1] and chosen[0].prefill_instance == "p5"


def test_an_instance_on_the_prior_is_bounded_by_the_prior():
    """p0..p9 fitted at 2 s, p10 on the prior (CostModel(): far slower for 64k tokens)
    and p11 with a fit of 0.1 s behind a queue of 5 s. The unfitted floor keeps the walk
    going past the coefficient orders' end only while the prior could still win."""
    clock = ManualClock(0.0)
    for pruned in (True, False):
        p = _policy(pruned, clock)
        for i in range(10):
            p.observe_prefill(_prefill(i, 0.1 * i, f"n{i}", 0.0, _fit(2.0)))
        p.observe_prefill(_prefill(10, 0.0, "n10", 0.0, None))
        p.observe_prefill(_prefill(11, 5.0, "n11", 0.0, _fit(0.1)))
        p.observe_decode(_decode(0, 0, 0))
        req = PlacementRequest("r", 128 * BS, tuple(range(128)), BS)
        d = p.place(req, Matches.of({}))
        assert isinstance(d, Placement) and d.prefill_instance == "p0"
        assert p._book.cost("p10").prefill_time(128 * BS) > 2.0  # the prior loses


def test_a_changed_fit_and_a_forgotten_instance_are_followed():
    """The coefficient orders follow a refit (p1 becomes the fastest), an instance
    forgotten (role switch: p1 leaves) and one that comes back on the prior."""
    clock = ManualClock(0.0)
    pair = [_policy(pruned, clock) for pruned in (True, False)]
    req = iter(PlacementRequest(f"r{k}", 4 * BS, tuple(range(4)), BS) for k in range(10))

    def place() -> str:
        r = next(req)
        a, b = (p.place(r, Matches.of({})) for p in pair)
        assert isinstance(a, Placement) and a == b
        for p in pair:
            p.release(r.request_id)
        return a.prefill_instance

    for p in pair:
        for i in range(3):
            p.observe_prefill(_prefill(i, 0.0, f"n{i}", 0.0, _fit(1.0 + i)))
        p.observe_decode(_decode(0, 0, 0))
    assert place() == "p0"
    for p in pair:
        p.observe_prefill(_prefill(1, 0.0, "n1", 0.0, _fit(0.5)))
    assert place() == "p1"
    for p in pair:
        p.forget_instance("prefill", "p1")
    assert place() == "p0"
    for p in pair:
        p.observe_prefill(_prefill(0, 3.0, "n0", 0.0, None))  # p0 now queues 3 s
    assert place() == "p2"


coef = st.sampled_from([0.0, 1e-3, 0.01, 0.5]) | st.floats(0, 0.6)
prefill_fit = st.one_of(
    st.builds(
        lambda s, b: _fit(b[0] * s, b[1] * s, b[2] * s),
        st.floats(1, 1.5),
        st.just((0.01, 5e-5, 2e-9)),
    ),
    st.builds(_fit, coef, st.floats(0, 2e-4), st.floats(0, 1e-8)),
)
instance = st.tuples(
    st.sampled_from([0.0, 0.0, 0.5, 1.0]) | st.floats(0, 5),  # queue
    st.integers(0, 7),  # node
    st.one_of(prefill_fit, prefill_fit, prefill_fit, st.none()),  # a few on the prior
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(instance, min_size=1, max_size=40),
    st.lists(
        st.tuples(
            st.sampled_from([1, 4, 32, 64]),  # blocks
            st.dictionaries(st.integers(0, 7), st.integers(0, 64), max_size=4),  # prefixes
            st.lists(st.integers(0, 39), max_size=2),  # excluded
            st.none() | st.tuples(st.integers(0, 39), prefill_fit),  # a refit after it
        ),
        min_size=1,
        max_size=6,
    ),
    st.dictionaries(st.integers(0, 39), st.sampled_from([0.5, 1.0, 2.0])),
    st.sampled_from(["global", "local"]),
)
def test_the_threshold_walk_chooses_as_the_full_scan(instances, requests, factors, strategy):
    clock = ManualClock(0.0)
    pair = []
    for pruned in (True, False):
        fb = TtftFeedback(factors={f"p{i}": f for i, f in factors.items()}) if factors else None
        p = _policy(pruned, clock, strategy=strategy, feedback=fb)
        for i, (q, node, fit) in enumerate(instances):
            p.observe_prefill(_prefill(i, q, f"n{node}", 0.0, fit))
        p.observe_decode(_decode(0, 0, 0))
        pair.append(p)
    for k, (blocks, prefixes, excl, refit) in enumerate(requests):
        req = PlacementRequest(f"r{k}", blocks * BS - 3, tuple(range(blocks)), BS)
        m = {f"n{n}": min(v, blocks) for n, v in prefixes.items() if v > 0}
        ex = tuple(f"p{i}" for i in excl)
        a = pair[0].place(req, Matches.of(m), exclude_prefill=ex)
        b = pair[1].place(req, m, exclude_prefill=ex)
        assert a == b
        if refit is not None and refit[0] < len(instances):
            i, fit = refit
            q, node, _ = instances[i]
            clock.advance(0.01)
            for p in pair:
                p.observe_prefill(_prefill(i, q, f"n{node}", clock.now(), fit))
    assert math.isfinite(clock.now())


# ------------------------------------------------------------------ decode: equal inputs


def _decode_pair(models: dict[str, CostModel], later: dict[str, CostModel] | None = None):
    """d0 and d1 with equal inputs (batch 10, 100k tokens) under ``models``, then
    ``later`` set without a report; the pruned and the scanning choice."""
    clock = ManualClock(0.0)
    out = []
    for pruned in (True, False):
        p = _policy(pruned, clock, tbt_slo_s=10.0)
        p.observe_prefill(_prefill(0, 0.0, "n0", 0.0, None))
        for name, model in models.items():
            p._book.set_model(name, model)
        for i in range(2):
            p.observe_decode(_decode(i, 10, 100_000))
        for name, model in (later or {}).items():
            p._book.set_model(name, model)
        d = p.place(PlacementRequest("r", 4 * BS, tuple(range(4)), BS), Matches.of({}))
        assert isinstance(d, Placement)
        out.append(d.decode_instance)
    return out


def test_a_decode_model_set_after_the_report_is_followed():
    """d1's model becomes twice as fast after its last report: its key's last term (the
    TBT before anything joins) follows, so the walk does not pass it over as slower than
    d0's TBT; it wins, as in the scan."""
    prior = CostModel()
    # Fits of the reported form (the decode bound stays on): 0.02 s and 0.001 s a step.
    slow = model_from(prior, None, [0.02, 0.0, 0.0])
    fast = model_from(prior, None, [0.001, 0.0, 0.0])
    at = (11, 100_000 + 4 * BS, 128)
    assert slow.decode_tbt(10, 100_000, 128) > prior.decode_tbt(*at) > fast.decode_tbt(*at)
    assert _decode_pair({"d1": slow}, {"d1": fast}) == ["d1", "d1"]


class _Falls(CostModel):
    """A model whose TBT falls once a request joins: its TBT before joining bounds
    nothing."""

    def decode_tbt(self, batch_size, context_tokens, max_batch=0):
        joined = CostModel().decode_tbt(11, 100_000 + 4 * BS, 128)
        return joined * (1.5 if batch_size <= 10 else 0.5)


def test_a_model_of_unknown_shape_turns_the_decode_bound_off():
    """d1's TBT before joining is above d0's once joined, and below it after joining:
    with a model of unknown shape in the book the walk evaluates the whole group."""
    assert _decode_pair({"d1": _Falls()}) == ["d1", "d1"]
