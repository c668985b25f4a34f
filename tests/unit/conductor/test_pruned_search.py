"""The pruned placement search (services.conductor.search) chooses what the full scan of
every instance chooses (issue 27 item 1): exact cases by hand, then random clusters
(hypothesis) where a pruned and a scanning PlacementPolicy, fed the same reports, fits,
feedback and requests, must make identical decisions, one after another."""

import itertools
import math
from unittest.mock import patch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import CostFit, DecodeLoad, PrefillLoad
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.rejection import Rejection
from services.conductor import prefix_index, search
from services.conductor.placement_policy import (
    Placement,
    PlacementPolicy,
    PlacementRequest,
    RemoteSource,
    TtftFeedback,
)
from services.conductor.prefix_index import Matches, NodeGroup, PrefixIndex
from services.policy.chunk_timing import CppConfig

BS = 512


def _policy(pruned: bool, clock: ManualClock, **kw) -> PlacementPolicy:
    p = PlacementPolicy(clock, CostModel(), **kw)
    p.pruned = pruned
    return p


def _prefill(i: int, q: float, node: str | None = None, ts: float = 0.0, fit=None) -> PrefillLoad:
    return PrefillLoad(
        instance=f"p{i}",
        node=node or f"n{i}",
        queue_len=int(q),
        queued_tokens=int(q * 1000),
        queued_work_s=q,
        ts=ts,
        fit=fit,
    )


def _decode(
    i: int, batch: int, kv: int, max_batch: int = 128, ts: float = 0.0, fit=None, waiting=0
):
    return DecodeLoad(
        instance=f"d{i}",
        node=f"m{i}",
        batch_size=batch,
        waiting=waiting,
        max_batch=max_batch,
        kv_tokens=kv,
        step_time_s=0.02,
        ts=ts,
        fit=fit,
    )


def _req(rid: str, blocks: int, tokens: int | None = None) -> PlacementRequest:
    return PlacementRequest(rid, tokens or blocks * BS, tuple(range(blocks)), BS)


# ------------------------------------------------------------------ exact cases


def test_walk_stops_after_the_least_queued_and_matches_the_scan():
    """1,000 prefill instances, queues 0.001 s apart, no prefix anywhere: the least
    queued wins, and the walk evaluates it alone, not the thousand."""
    clock = ManualClock(0.0)
    pruned, full = _policy(True, clock), _policy(False, clock)
    for p in (pruned, full):
        for i in range(1000):
            p.observe_prefill(_prefill(i, 5.0 + (i * 7919 % 1000) * 0.001))
        for i in range(50):
            p.observe_decode(_decode(i, 1 + i % 40, 1000 * (1 + i % 40)))
    evaluated = []
    orig = pruned._candidate

    def counting(*a, **k):
        evaluated.append(a[1])
        return orig(*a, **k)

    pruned._candidate = counting  # type: ignore[method-assign]
    a = pruned.place(_req("r1", 2), {})
    b = full.place(_req("r1", 2), {})
    assert isinstance(a, Placement) and a == b
    assert a.prefill_instance == "p0"  # queue 5.000 s, the least
    # One model for all: the first walked computes what every other would, so the bound
    # is exact and the next queue up already loses.
    assert evaluated == ["p0"]


def test_holder_beats_a_shorter_queue_and_decode_takes_least_occupied_that_fits():
    """local: the holder with the shorter queue computes 2 blocks; global: the idle
    instance pulls the 30 blocks instead (cheaper than queueing 0.5 s)."""
    clock = ManualClock(0.0)
    for pruned, strategy in itertools.product((True, False), ("local", "global")):
        p = _policy(pruned, clock, tbt_slo_s=0.1, strategy=strategy)
        p.observe_prefill(_prefill(0, 0.0))  # idle, holds nothing
        p.observe_prefill(_prefill(1, 0.5))  # node n1 holds the whole 30-block prefix
        p.observe_prefill(_prefill(2, 0.6, node="n1"))  # same node, longer queue
        p.observe_decode(_decode(0, 100, 3_000_000))  # over the TBT SLO
        p.observe_decode(_decode(1, 30, 10_000))
        p.observe_decode(_decode(2, 10, 900_000))  # least occupied and fits
        d = p.place(_req("r", 32), {"n1": 30})
        assert isinstance(d, Placement)
        if strategy == "local":
            assert (d.prefill_instance, d.prefix_blocks, d.remote) == ("p1", 30, None)
        else:
            assert (d.prefill_instance, d.prefix_blocks) == ("p0", 30)
            assert d.remote == RemoteSource("n1", 0, 30)
        assert d.decode_instance == "d2"


def test_no_decode_fits_takes_least_tbt_when_the_check_is_off():
    clock = ManualClock(0.0)
    for pruned in (True, False):
        p = _policy(pruned, clock, tbt_slo_s=0.001, tbt_check=False)
        p.observe_prefill(_prefill(0, 0.0))
        p.observe_decode(_decode(0, 5, 900_000))
        p.observe_decode(_decode(1, 50, 10_000))
        d = p.place(_req("r", 2), {})
        assert isinstance(d, Placement) and d.decode_instance == "d1"


def test_dead_and_excluded_instances_are_skipped_and_none_left_is_503():
    clock = ManualClock(0.0)
    p = _policy(True, clock, dead_after_s=1.0)
    p.observe_prefill(_prefill(0, 0.0))
    p.observe_decode(_decode(0, 1, 10))
    clock.advance(0.5)
    p.observe_prefill(_prefill(1, 3.0, ts=0.5))
    p.observe_decode(_decode(1, 1, 10, ts=0.5))
    clock.advance(0.8)  # p0 and d0 silent for 1.3 s: dead
    d = p.place(_req("a", 2), {})
    assert isinstance(d, Placement) and (d.prefill_instance, d.decode_instance) == ("p1", "d1")
    no = p.place(_req("b", 2), {}, exclude_prefill=("p1",))
    assert isinstance(no, Rejection) and no.reason == "no live prefill instance"
    no = p.place(_req("c", 2), {}, exclude_decode=("d1",))
    assert isinstance(no, Rejection) and no.reason == "no live decode instance"


# ------------------------------------------------------------------ against the scan

fits = st.one_of(
    st.none(),
    st.builds(
        CostFit,
        prefill=st.one_of(
            st.none(),
            st.tuples(st.floats(0, 0.05), st.floats(0, 2e-4), st.floats(0, 1e-8)).map(list),
        ),
        decode=st.one_of(
            st.none(),
            st.tuples(st.floats(0, 0.05), st.floats(0, 1e-3), st.floats(0, 1e-7)).map(list),
        ),
    ),
)

cluster = st.fixed_dictionaries(
    {
        "prefills": st.lists(
            st.tuples(
                st.integers(0, 5),  # node (shared nodes: several instances on one)
                st.sampled_from([0.0, 0.0, 0.0, 0.1, 0.5, 1.0, 2.0]) | st.floats(0, 20),
                st.floats(0, 3),  # last report's age
                fits,
            ),
            min_size=1,
            max_size=12,
        ),
        "decodes": st.lists(
            st.tuples(
                st.sampled_from([0, 1, 10, 63]) | st.integers(0, 130),  # equal occupancies
                st.sampled_from([0, 50_000, 400_000]) | st.integers(0, 2_000_000),
                st.sampled_from([4, 64, 128, 0]),  # 0: no cap (no rounds)
                st.floats(0, 3),
                fits,
                st.sampled_from([0, 0, 7, 200]),  # waiting: rounds past the cap
            ),
            min_size=1,
            max_size=10,
        ),
        "requests": st.lists(
            st.tuples(
                st.integers(1, 40) | st.sampled_from([96, 128]),  # blocks (long: CPP wins)
                # prefix lengths by node (often equal: groups of several nodes)
                st.dictionaries(
                    st.integers(0, 6), st.integers(0, 45) | st.sampled_from([4, 4, 12]), max_size=6
                ),
                # TBT SLO (1e-4: no decode instance meets it, an overloaded pool)
                st.sampled_from([1e-4, 0.02, 0.05, 0.1, math.inf]),
                st.booleans(),  # finish a placed one (prefill_done with a TTFT)
                st.lists(st.integers(0, 11), max_size=2),  # excluded prefill
                st.lists(st.integers(0, 9), max_size=2),  # excluded decode
                st.lists(st.integers(0, 6), max_size=2),  # excluded sources
            ),
            min_size=1,
            max_size=8,
        ),
        "strategy": st.sampled_from(["global", "local", "load", "random"]),
        "tbt_check": st.booleans(),
        "idle": st.booleans(),
        "feedback": st.booleans(),
        # Factors from the start (feedback on): equal queues with unequal factors.
        "factors": st.dictionaries(st.integers(0, 11), st.sampled_from([0.5, 1.0, 2.0])),
        # CPP groups (size 1: off); min_tokens low enough that the requests meet it.
        "cpp": st.sampled_from([1, 1, 2, 3]),
        "cpp_min": st.sampled_from([0, 4096, 65536]),
        "cpp_chunk": st.sampled_from([1024, 4096]),
        "cpp_interleave": st.sampled_from([0, 2048, 8192]),
        # The pruned policy reads a real prefix index's match (every holder set of two
        # or more nodes a _Many, so the groups are NodeGroups), else Matches.of.
        "index": st.booleans(),
    }
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster, st.sampled_from((0, 1, 2, search.DIRECT)))
def test_pruned_search_chooses_as_the_full_scan(c, direct):
    """``direct``: holders of one prefix length on more instances than this are walked
    with the rest instead of evaluated outright (low: as a prefix every node holds)."""
    with patch.object(search, "DIRECT", direct):
        check_against_the_scan(c)


def index_match(lengths: dict[str, int], blocks: int) -> Matches:
    """What a prefix index whose nodes hold ``lengths`` blocks of one chain matches for
    the chain's first ``blocks`` (holder sets of 2 or more nodes as _Many)."""
    idx = PrefixIndex()
    with patch.object(prefix_index, "SMALL", 1):
        for node, n in lengths.items():
            idx.apply(
                EventBatch(
                    node=node,
                    epoch=1,
                    seq=1,
                    ts=0.0,
                    events=[BlockStored(block_hashes=list(range(n)))],
                )
            )
        return idx.match(tuple(range(blocks)))


def check_against_the_scan(c):
    clock = ManualClock(10.0)
    kw = dict(
        strategy=c["strategy"],
        tbt_check=c["tbt_check"],
        serve_when_idle=c["idle"],
        dead_after_s=2.0,
        cpp=CppConfig(
            group_size=c["cpp"],
            min_tokens=c["cpp_min"],
            chunk_tokens=c["cpp_chunk"],
            interleave_tokens=c["cpp_interleave"],
        ),
    )
    pair = []
    for pruned in (True, False):
        factors = {f"p{i}": f for i, f in c["factors"].items()}
        fb = TtftFeedback(factors=factors) if c["feedback"] else None
        pair.append(_policy(pruned, clock, feedback=fb, **kw))
    # Instances whose report is older than 2.5 s are dead (dead_after 2 s): reported
    # before the clock moves on; the rest after. Ages in (2.0, 2.5] are forgotten (a
    # role switch) instead.
    for late in (False, True):
        if late:
            clock.advance(2.5)
        for p in pair:
            for i, (node, q, age, fit) in enumerate(c["prefills"]):
                if (age <= 2.5) == late:
                    p.observe_prefill(_prefill(i, q, node=f"n{node}", ts=clock.now(), fit=fit))
            for i, (batch, kv, mb, age, fit, waiting) in enumerate(c["decodes"]):
                if (age <= 2.5) == late:
                    p.observe_decode(
                        _decode(i, batch, kv, mb, ts=clock.now(), fit=fit, waiting=waiting)
                    )
    for p in pair:
        for i, (_, _, age, _) in enumerate(c["prefills"]):
            if 2.0 < age <= 2.5:
                p.forget_instance("prefill", f"p{i}")
        for i, (_, _, _, age, _, _) in enumerate(c["decodes"]):
            if 2.0 < age <= 2.5:
                p.forget_instance("decode", f"d{i}")
    placed = []
    for k, (blocks, matches, slo, finish, excl, excl_d, excl_s) in enumerate(c["requests"]):
        req = PlacementRequest(f"r{k}", blocks * BS - 7, tuple(range(blocks)), BS, tbt_slo_s=slo)
        m = {f"n{n}": v for n, v in matches.items() if v > 0}
        # The pruned policy reads the index's grouped matches where no length needs
        # capping at the request's blocks (the prefix index never gives one longer).
        grouped = index_match(m, blocks) if c["index"] else Matches.of(m)
        ex = tuple(f"p{i}" for i in excl)
        ex_d = tuple(f"d{i}" for i in excl_d)
        ex_s = tuple(f"n{i}" for i in excl_s)
        kw = dict(exclude_prefill=ex, exclude_decode=ex_d, exclude_sources=ex_s)
        a = pair[0].place(req, grouped, **kw)
        b = pair[1].place(req, m, **kw)
        assert a == b
        if isinstance(a, Placement):
            placed.append(a)
        if finish and placed:
            clock.advance(0.3)  # a pipeline's stages still to run shrink with time
            done = placed.pop(0)
            for p in pair:
                p.prefill_done(done.request_id, clock.now())
        elif k % 3 == 2:  # a report covers what was placed on the first prefill instance
            clock.advance(0.05)
            i, (node, q, age, fit) = 0, c["prefills"][0]
            if age <= 2.0:
                for p in pair:
                    p.observe_prefill(_prefill(i, q / 2, node=f"n{node}", ts=clock.now(), fit=fit))


def test_ties_among_idle_instances_cost_one_evaluation_per_group():
    """1,000 idle prefill and 1,000 idle decode instances, one cost model: every idle
    instance predicts the same TTFT (TBT), so the first by name wins, as in the scan,
    and the walk evaluates one instance of the tied group instead of all of them
    (issue 27: the walk through ties)."""
    clock = ManualClock(0.0)
    pruned, full = _policy(True, clock), _policy(False, clock)
    for p in (pruned, full):
        for i in range(1000):
            p.observe_prefill(_prefill(i, 0.0))
            p.observe_decode(_decode(i, 0, 0))
        p.observe_prefill(_prefill(1000, 0.5))
        p.observe_decode(_decode(1000, 3, 9_000))
    evaluated, tbts = [], []
    cand, tbt = pruned._candidate, pruned.predicted_tbt

    def counting(*a, **k):
        evaluated.append(a[1])
        return cand(*a, **k)

    def counting_tbt(*a, **k):
        tbts.append(a[0])
        return tbt(*a, **k)

    pruned._candidate = counting  # type: ignore[method-assign]
    pruned.predicted_tbt = counting_tbt  # type: ignore[method-assign]
    for k in range(3):
        a = pruned.place(_req(f"r{k}", 2), {})
        b = full.place(_req(f"r{k}", 2), {})
        assert isinstance(a, Placement) and a == b
    # Each placement books work on its choice, so the next goes to the next idle name.
    assert [evaluated[0], evaluated[-1]] == ["p0", "p10"]
    assert len(evaluated) <= 3 * 2 and len(tbts) <= 3 * 2


def test_ties_under_different_models_are_walked():
    """Instances with models of their own may differ at equal keys: the walk does not
    skip the group, and a faster instance later by name wins, as in the scan."""
    clock = ManualClock(0.0)
    slow = CostFit(prefill=[0.05, 2e-4, 1e-8], decode=None)
    fast = CostFit(prefill=[0.0, 1e-5, 0.0], decode=None)
    for pruned in (True, False):
        p = _policy(pruned, clock)
        for i in range(5):
            p.observe_prefill(_prefill(i, 0.0, fit=fast if i == 3 else slow))
        p.observe_decode(_decode(0, 0, 0))
        d = p.place(_req("r", 4), {})
        assert isinstance(d, Placement) and d.prefill_instance == "p3"


def test_a_tied_group_is_walked_past_an_instance_slower_by_its_feedback():
    """Equal queues and one model, but p0's TTFT feedback is 2x: p1 (factor 1) wins, as
    in the scan; the group skip applies only from an instance at the least factor."""
    clock = ManualClock(0.0)
    for pruned in (True, False):
        p = _policy(pruned, clock, feedback=TtftFeedback(factors={"p0": 2.0}))
        for i in range(3):
            p.observe_prefill(_prefill(i, 0.0))
        p.observe_decode(_decode(0, 0, 0))
        d = p.place(_req("r", 4), {})
        assert isinstance(d, Placement) and d.prefill_instance == "p1"


def test_equal_occupancy_and_kv_with_unequal_batches_are_not_one_group():
    """d0 runs 63 of 128, d1 1 of 4: the same occupancy once one joins (0.5) and the
    same KV, but d0 steps 63 sequences: d1's TBT is lower and it wins, as in the scan
    (the decode order's key holds every input of the TBT model, not just the first two)."""
    clock = ManualClock(0.0)
    for pruned in (True, False):
        p = PlacementPolicy(clock, CostModel(decode_seq_s=1e-4))  # a step grows with its batch
        p.pruned = pruned
        p.observe_prefill(_prefill(0, 0.0))
        p.observe_decode(_decode(0, 63, 10_000, max_batch=128))
        p.observe_decode(_decode(1, 1, 10_000, max_batch=4))
        assert p.predicted_tbt("d1", 2 * BS) < p.predicted_tbt("d0", 2 * BS)
        d = p.place(_req("r", 2), {})
        assert isinstance(d, Placement) and d.decode_instance == "d1"


def test_random_draws_what_the_scan_draws_and_evaluates_only_the_draw():
    """The random baseline: 300 prefill instances, 20 of them dead, 2 excluded per
    request; the pruned policy's rng picks what the scan's picks, request after
    request, and evaluates only the drawn instance."""
    clock = ManualClock(0.0)
    pruned, full = (_policy(p, clock, strategy="random", dead_after_s=1.0) for p in (True, False))
    for p in (pruned, full):
        for i in range(20):
            p.observe_prefill(_prefill(i, 0.1 * i))
        p.observe_decode(_decode(0, 0, 0))
    clock.advance(2.0)  # p0-p19 silent for 2 s: dead
    for p in (pruned, full):
        for i in range(20, 300):
            p.observe_prefill(_prefill(i, 0.01 * i, ts=2.0))
        p.observe_decode(_decode(0, 0, 0, ts=2.0))
    evaluated = []
    cand = pruned._candidate

    def counting(*a, **k):
        evaluated.append(a[1])
        return cand(*a, **k)

    pruned._candidate = counting  # type: ignore[method-assign]
    chosen = set()
    for k in range(60):
        ex = (f"p{20 + 7 * k % 280}", f"p{21 + 13 * k % 279}")
        a = pruned.place(_req(f"r{k}", 2), {}, exclude_prefill=ex)
        b = full.place(_req(f"r{k}", 2), {}, exclude_prefill=ex)
        assert isinstance(a, Placement) and a == b
        assert a.prefill_instance not in ex and int(a.prefill_instance[1:]) >= 20
        chosen.add(a.prefill_instance)
    assert len(evaluated) == 60 and len(chosen) > 30


def test_the_exact_bound_still_reaches_an_instance_with_a_lower_factor():
    """One model: after p0 (factor 1, idle) the bound is exact. p1 queues a little less
    than a prefill but its factor is 0.5, so its TTFT is just below p0's: the walk must
    reach it (the bound at its key is below p0's TTFT), as the scan does."""
    f = CostModel().prefill_time(4 * BS, 0)
    clock = ManualClock(0.0)
    for pruned in (True, False):
        fb = TtftFeedback(factors={"p1": 0.5})
        p = _policy(pruned, clock, feedback=fb)
        p.observe_prefill(_prefill(0, 0.0))
        p.observe_prefill(_prefill(1, f * 0.999))
        p.observe_prefill(_prefill(2, f * 1.001))  # 0.5 * (q + f) above f: loses
        p.observe_decode(_decode(0, 0, 0))
        d = p.place(_req("r", 4), {})
        assert isinstance(d, Placement) and d.prefill_instance == "p1"


def test_a_prefix_every_node_holds_is_walked_not_evaluated_per_instance():
    """200 instances, every node holding the request's first block (a system prompt)
    and one node its first 20: the long holder is evaluated outright, the 199 others
    are walked from the least queued and cut by the bound, and the choice is the
    scan's (issue 27: a hot prefix made every instance a holder)."""
    clock = ManualClock(0.0)
    pruned, full = _policy(True, clock), _policy(False, clock)
    for p in (pruned, full):
        for i in range(200):
            p.observe_prefill(_prefill(i, 1.0 + (i * 37 % 200) * 0.01))
        p.observe_decode(_decode(0, 0, 0))
    evaluated = []
    cand = pruned._candidate

    def counting(*a, **k):
        evaluated.append(a[1])
        return cand(*a, **k)

    pruned._candidate = counting  # type: ignore[method-assign]
    matches = {f"n{i}": 1 for i in range(200)} | {"n7": 20}
    a = pruned.place(_req("r", 24), matches)
    b = full.place(_req("r", 24), matches)
    assert isinstance(a, Placement) and a == b
    assert "p7" in evaluated and len(evaluated) <= 3


def test_idle_holders_and_idle_others_cost_one_evaluation_each():
    """300 idle instances, a prefix (walked: on more than DIRECT instances) on the odd
    nodes: two options tie among the idle, each settled by its first instance by name,
    and the walk jumps past the group, as one option's group does: the choice is the
    scan's with two evaluations, not 300 (issue 27 item 2: an x10 cluster's idle
    instances, half of them holding a copy's system prompt)."""
    clock = ManualClock(0.0)
    pruned, full = _policy(True, clock), _policy(False, clock)
    for p in (pruned, full):
        for i in range(300):
            p.observe_prefill(_prefill(i, 0.0))
        p.observe_prefill(_prefill(300, 0.5))
        p.observe_decode(_decode(0, 0, 0))
    evaluated = []
    cand = pruned._candidate

    def counting(*a, **k):
        evaluated.append(a[1])
        return cand(*a, **k)

    pruned._candidate = counting  # type: ignore[method-assign]
    matches = {f"n{i}": 1 for i in range(1, 300, 2)}
    for k, blocks in enumerate((2, 8)):  # own prefix 1 of 2 (pulled), of 8 (kept)
        a = pruned.place(_req(f"r{k}", blocks), Matches.of(matches))
        b = full.place(_req(f"r{k}", blocks), matches)
        assert isinstance(a, Placement) and a == b
    assert len(evaluated) <= 2 * 2


def test_least_inflight_source_by_bytes_then_name():
    """The pull source among 100 holders of the longest prefix: the least bytes in
    flight, then the first name, as the scan's min over (inflight_bytes, node); the
    sources excluded are skipped."""
    clock = ManualClock(0.0)
    p = _policy(True, clock)
    for i in range(100):
        p.observe_prefill(_prefill(i, 0.0))
    p.observe_decode(_decode(0, 0, 0))
    # Two pulls from n0 and one from n1 in flight: n10 is the first name with 0 bytes.
    for k, src in enumerate(("n0", "n0", "n1")):
        p.observe_prefill(_prefill(100 + k, 0.0, node=f"x{k}"))
        d = p.place(_req(f"pull{k}", 4), {src: 4}, exclude_prefill=[f"p{i}" for i in range(100)])
        assert isinstance(d, Placement) and d.remote is not None and d.remote.node == src
    assert p._least_inflight({f"n{i}" for i in range(100)}) == "n10"
    assert p._least_inflight(["n0", "n1"]) == "n1"
    # The same through the prefix index's NodeGroup (the 100 holders of one chain): the
    # walk over the names in order passes the loaded and the excluded sources.
    many = index_match({f"n{i}": 4 for i in range(100)}, 4).by_length[4]
    assert isinstance(many, NodeGroup)
    assert p._least_inflight_of(many, set()) == "n10"
    assert p._least_inflight_of(many, {"n10", "n11"}) == "n12"
    three = index_match({"n0": 4, "n1": 4, "n2": 4}, 4).by_length[4]
    assert isinstance(three, NodeGroup)
    assert p._least_inflight_of(three, set()) == "n2"
    assert p._least_inflight_of(three, {"n2"}) == "n1"  # the rest loaded: fewer bytes
    assert p._least_inflight_of(three, {"n0", "n1", "n2"}) is None
    d = p.place(_req("r", 4), Matches.of({f"n{i}": 4 for i in range(100)}))
    assert isinstance(d, Placement) and d.remote is None
    d = p.place(
        _req("s", 4),
        Matches.of({f"n{i}": 4 for i in range(3)}),
        exclude_prefill=("p0", "p1", "p2"),
        exclude_sources=("n2",),
    )
    assert isinstance(d, Placement) and d.remote is not None and d.remote.node == "n1"
    d = p.place(
        _req("u", 4),
        index_match({f"n{i}": 4 for i in range(100)}, 4),
        exclude_prefill=[f"p{i}" for i in range(100)],
    )
    assert isinstance(d, Placement) and d.remote is not None and d.remote.node == "n10"
    for rid in ("pull0", "pull1", "pull2", "s", "u"):
        p.release(rid)
    assert not p._by_source and not p._loaded  # only the nodes with pulls in flight


# ------------------------------------------------------------------ CPP, overload, fitted ties


def _counting(policy: PlacementPolicy, name: str) -> list:
    """Record the first argument of each call of ``policy.name``."""
    seen: list = []
    orig = getattr(policy, name)

    def counting(*a, **k):
        seen.append(a[0] if name in ("predicted_tbt", "_group_candidate") else a[1])
        return orig(*a, **k)

    setattr(policy, name, counting)
    return seen


def _cpp_pair(
    clock: ManualClock, n: int, idle: tuple[int, int] = (10, 11)
) -> tuple[PlacementPolicy, PlacementPolicy]:
    cpp = CppConfig(group_size=2, min_tokens=4096, chunk_tokens=4096, interleave_tokens=8192)
    pair = _policy(True, clock, cpp=cpp), _policy(False, clock, cpp=cpp)
    for p in pair:
        for i in range(n):  # busy, but for the idle pair (one group by name)
            q = 0.0 if i in idle else 2.0 + (i * 37 % n) * 0.01
            p.observe_prefill(_prefill(i, q))
        p.observe_decode(_decode(0, 0, 0))
    return pair


def test_cpp_group_of_the_idle_pair_is_found_without_evaluating_every_group():
    """200 prefill instances in groups of 2 by name (p0 p1, p10 p100, p101 p102, ...),
    all busy but p101 and p102: a 64k-token prompt goes to the group (p101, p102), as
    the scan chooses, and the walk over the groups ordered by their busiest member
    evaluates a few groups, not 100."""
    clock = ManualClock(0.0)
    pruned, full = _cpp_pair(clock, 200, idle=(101, 102))
    groups = _counting(pruned, "_group_candidate")
    singles = _counting(pruned, "_candidate")
    a = pruned.place(_req("long", 128), {})
    b = full.place(_req("long", 128), {})
    assert isinstance(a, Placement) and a == b
    assert a.cpp_stages == ("p101", "p102")
    assert len(groups) <= 2 and len(singles) <= 3
    # A short prompt is offered no group (under min_tokens): none evaluated.
    groups.clear()
    a = pruned.place(_req("short", 4), {})
    b = full.place(_req("short", 4), {})
    assert isinstance(a, Placement) and a == b and not a.cpp_stages and not groups
    # Reports move the idle pair to (p103, p104): the groups' order follows them.
    clock.advance(0.1)
    for p in (pruned, full):
        p.release("long")
        for i in (101, 102, 103, 104):
            p.observe_prefill(_prefill(i, 0.0 if i > 102 else 3.0, ts=clock.now()))
    groups.clear()
    a = pruned.place(_req("long2", 128), {})
    b = full.place(_req("long2", 128), {})
    assert isinstance(a, Placement) and a == b and a.cpp_stages == ("p103", "p104")
    assert len(groups) <= 2


def test_cpp_a_request_prefers_an_idle_instance_that_is_no_stage():
    """p0-p3 idle, one model: a long prompt is pipelined on (p0, p1); a short one then
    ties on its TTFT at every idle instance (it runs between two chunks) and goes to
    p2, the first that is no stage, as in the scan: the walk must not settle the tied
    group on p0 (a stage)."""
    clock = ManualClock(0.0)
    cpp = CppConfig(group_size=2, min_tokens=4096, chunk_tokens=4096, interleave_tokens=8192)
    pair = _policy(True, clock, cpp=cpp), _policy(False, clock, cpp=cpp)
    for p in pair:
        for i in range(4):
            p.observe_prefill(_prefill(i, 0.0))
        p.observe_prefill(_prefill(4, 0.5))
        p.observe_decode(_decode(0, 0, 0))
    for rid, blocks, want in (("long", 128, "p0"), ("short", 4, "p2")):
        a, b = (p.place(_req(rid, blocks), {}) for p in pair)
        assert isinstance(a, Placement) and a == b and a.prefill_instance == want
    assert pair[0].in_pipeline("p1") and not pair[0].in_pipeline("p2")


def test_cpp_groups_formed_again_when_an_instance_goes_silent_or_is_excluded():
    """Groups are every two live instances in name order: p10 silent shifts every
    group after it ((p11, p12) is one), and so does an excluded instance for its
    request alone; the choice is the scan's each time."""
    clock = ManualClock(0.0)
    pair = _cpp_pair(clock, 40)
    for p in pair:
        p.dead_after_s = p.loads._liveness.dead_after_s = 1.0
    a, b = (p.place(_req("r0", 128), {}) for p in pair)  # groups built with p10 alive
    assert isinstance(a, Placement) and a == b and a.cpp_stages == ("p10", "p11")
    for p in pair:
        p.release("r0")
    clock.advance(0.9)
    for p in pair:  # everyone reports again but p10; p12 idle now
        for i in range(40):
            if i != 10:
                q = 0.0 if i in (11, 12) else 2.0 + i * 0.01
                p.observe_prefill(_prefill(i, q, ts=clock.now()))
        p.observe_decode(_decode(0, 0, 0, ts=clock.now()))
    clock.advance(0.5)  # p10 silent for 1.4 s: dead
    a, b = (p.place(_req("r1", 128), {}) for p in pair)
    assert isinstance(a, Placement) and a == b and a.cpp_stages == ("p11", "p12")
    for p in pair:
        p.release("r1")
    ex = ("p5",)  # shifts the groups after p5 back: (p10 dead) ... (p12, p13)
    a, b = (p.place(_req("r2", 128), {}, exclude_prefill=ex) for p in pair)
    assert isinstance(a, Placement) and a == b


def test_overloaded_decode_pool_is_walked_by_rounds_not_whole():
    """1,000 decode instances capped at 8, every one over the TBT SLO (the check off:
    the least TBT is placed). TBT grows with the rounds a backlog takes (ceil of the
    occupancy) and the KV: dA at 2 rounds holds much KV, dB at 3 rounds little, and dB
    wins, as in the scan; the walk stops once the floor of the rounds is above the
    best TBT instead of evaluating the thousand. An uncapped instance (max_batch 0,
    no rounds) at a high occupancy is still reached."""
    clock = ManualClock(0.0)
    pair = (
        _policy(True, clock, tbt_slo_s=1e-4, tbt_check=False),
        _policy(False, clock, tbt_slo_s=1e-4, tbt_check=False),
    )
    for p in pair:
        p.observe_prefill(_prefill(0, 0.0))
        p.observe_decode(_decode(0, 8, 500_000, max_batch=8))  # dA: 2 rounds
        p.observe_decode(_decode(1, 8, 10_000, max_batch=8, waiting=8))  # dB: 3 rounds
        for i in range(2, 1000):
            p.observe_decode(_decode(i, 8, 1000 * i, max_batch=8, waiting=8 * (3 + i % 40)))
    pruned, full = pair
    assert pruned.predicted_tbt("d1", 2 * BS) < pruned.predicted_tbt("d0", 2 * BS)
    tbts = _counting(pruned, "predicted_tbt")
    a, b = pruned.place(_req("r", 2), {}), full.place(_req("r", 2), {})
    assert isinstance(a, Placement) and a == b and a.decode_instance == "d1"
    assert len(tbts) <= 5
    for p in pair:  # an uncapped instance: one step per token whatever its batch
        p.observe_decode(_decode(1000, 60, 0, max_batch=0))
    assert pruned.predicted_tbt("d1000", 2 * BS) < pruned.predicted_tbt("d1", 2 * BS)
    a, b = pruned.place(_req("s", 2), {}), full.place(_req("s", 2), {})
    assert isinstance(a, Placement) and a == b and a.decode_instance == "d1000"


def test_overloaded_decode_ties_under_fitted_models_are_walked():
    """Two overloaded instances with the same key (occupancy, KV, batch): with fitted
    models of their own they may differ, so the walk does not take the first by name
    for the group; d1's faster fit wins, as in the scan."""
    clock = ManualClock(0.0)
    slow = CostFit(prefill=None, decode=[0.05, 1e-3, 1e-7])
    fast = CostFit(prefill=None, decode=[0.01, 1e-4, 1e-8])
    for pruned in (True, False):
        p = _policy(pruned, clock, tbt_slo_s=1e-4, tbt_check=False)
        p.observe_prefill(_prefill(0, 0.0))
        for i in range(3):
            p.observe_decode(_decode(i, 8, 9_000, max_batch=8, fit=fast if i == 1 else slow))
        d = p.place(_req("r", 2), {})
        assert isinstance(d, Placement) and d.decode_instance == "d1"


def test_fitted_prefill_ties_are_walked_to_the_fastest():
    """Idle instances with fitted prefill models of their own tie on their key (0):
    the fastest fit wins wherever it is by name, as in the scan (each of the group is
    evaluated until the floor of the fits stops the walk: the cost of fitted ties)."""
    clock = ManualClock(0.0)
    fits = [CostFit(prefill=[0.01 + 0.001 * i, 1e-4, 1e-9], decode=None) for i in range(30)]
    fits[17] = CostFit(prefill=[0.001, 1e-5, 1e-10], decode=None)
    for pruned in (True, False):
        p = _policy(pruned, clock)
        for i in range(30):
            p.observe_prefill(_prefill(i, 0.0, fit=fits[i]))
        p.observe_prefill(_prefill(30, 9.0))
        p.observe_decode(_decode(0, 0, 0))
        d = p.place(_req("r", 4), {})
        assert isinstance(d, Placement) and d.prefill_instance == "p17"
