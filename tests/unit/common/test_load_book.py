"""services.common.load_book: the one book of per-instance load and liveness that
admission and placement both keep."""

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.admission.admission_policy import EarlyRejectionPolicy
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.load_book import LoadBook
from services.conductor.placement_policy import PlacementPolicy


def p(name: str, work: float, ts: float) -> PrefillLoad:
    return PrefillLoad(
        instance=name, node="n-" + name, queue_len=1, queued_tokens=10, queued_work_s=work, ts=ts
    )


def d(name: str, ts: float) -> DecodeLoad:
    return DecodeLoad(
        instance=name,
        node="n-" + name,
        batch_size=1,
        waiting=0,
        max_batch=8,
        kv_tokens=100,
        step_time_s=0.01,
        ts=ts,
    )


def test_latest_report_liveness_and_forgetting():
    clock = ManualClock()
    book = LoadBook(clock, CostModel(), dead_after_s=2.0)
    book.observe_prefill(p("p1", 1.0, 0.0))
    book.observe_prefill(p("p0", 2.0, 0.0))
    book.observe_decode(d("d0", 0.0))
    clock.advance(1.5)
    book.observe_prefill(p("p1", 3.0, 1.5))  # the latest report replaces the first
    assert [x.queued_work_s for x in book.live_prefill()] == [2.0, 3.0]  # by name
    clock.advance(1.0)  # p0 and d0 last seen 2.5 s ago: dead
    assert [x.instance for x in book.live_prefill()] == ["p1"]
    assert book.live_decode() == [] and "d0" in book.decode
    book.forget("prefill", "p1")  # switched to decode
    assert book.live_prefill() == [] and "p1" not in book.prefill
    book.observe_decode(d("p1", 2.5))
    assert [x.instance for x in book.live_decode()] == ["p1"]
    assert not book.alive("prefill", "p1") and book.alive("decode", "p1")


def test_a_report_late_from_the_role_an_instance_left_does_not_bring_it_back():
    """A worker's report sent just before it heard its role switch can reach a conductor
    after the switch: believed, it would put the instance back in the prefill pool for
    dead_after_s, and a prefill task placed there once the worker stopped serving prefill
    would be lost (a request hung in test_two_conductors' role switch, fresh-clone make
    test). For dead_after_s after the switch such reports are ignored; after that a
    worker that did not switch (it keeps reporting) is taken back."""
    clock = ManualClock()
    policy = PlacementPolicy(clock, CostModel(), dead_after_s=2.0)
    policy.observe_prefill(p("p0", 5.0, 0.0))
    policy.observe_prefill(p("x", 0.0, 0.0))
    policy.forget_instance("prefill", "x")  # RoleSwitch x -> decode
    clock.advance(0.01)
    policy.observe_prefill(p("x", 0.0, 0.01))  # late, sent before x switched
    assert policy.live_prefill() == ["p0"]
    policy.observe_decode(d("x", 0.01))  # its new role counts at once
    assert policy.live_decode() == ["x"]
    clock.advance(2.0)
    policy.observe_prefill(p("p0", 5.0, 2.01))
    policy.observe_prefill(p("x", 0.0, 2.01))  # still reporting prefill: did not switch
    assert policy.live_prefill() == ["p0", "x"]


def test_admission_and_placement_keep_their_loads_in_one_book():
    clock = ManualClock()
    cost = CostModel()
    adm = EarlyRejectionPolicy(clock, cost)
    pl = PlacementPolicy(clock, cost)
    for pol in (adm, pl):
        assert isinstance(pol.loads, LoadBook)
        assert pol.book is pol.loads.calibration
        pol.observe_prefill(p("p0", 1.0, 0.0))
        pol.observe_decode(d("d0", 0.0))
    assert adm.live_prefill() == adm.loads.live_prefill() == [p("p0", 1.0, 0.0)]
    assert pl.live_prefill() == ["p0"] and pl.live_decode() == ["d0"]
    clock.advance(2.5)
    assert adm.live_prefill() == [] and pl.live_prefill() == [] and pl.live_decode() == []


def test_instances_silent_for_long_leave_the_book():
    from services.common import load_book as lb

    clock = ManualClock(0.0)
    book = lb.LoadBook(clock, CostModel())
    book.observe_prefill(
        PrefillLoad(
            instance="gone", node="n", queue_len=0, queued_tokens=0, queued_work_s=0.0, ts=0.0
        )
    )
    clock.advance(lb.FORGET_AFTER_S + 1)
    for i in range(lb.PRUNE_EVERY):  # one live instance keeps reporting
        book.observe_decode(
            DecodeLoad(
                instance="live",
                node="n",
                batch_size=0,
                waiting=0,
                max_batch=8,
                kv_tokens=0,
                step_time_s=0.0,
                ts=float(i),
            )
        )
    assert "gone" not in book.prefill and "live" in book.decode
    assert book.incarnation("prefill", "gone") == 0


def test_ordered_names_and_silent_ones_follow_reports_forgets_and_prunes():
    """What the random placement draws from (issue 27): each role's names in order and
    the silent ones, as the live lists define them, without a walk."""
    clock = ManualClock()
    book = LoadBook(clock, CostModel(), dead_after_s=2.0)
    for name in ("p2", "p0", "p1"):
        book.observe_prefill(p(name, 1.0, 0.0))
    book.observe_decode(d("d0", 0.0))
    clock.advance(1.5)
    book.observe_prefill(p("p1", 1.0, 1.5))
    assert list(book.names("prefill")) == ["p0", "p1", "p2"]
    assert book.silent("prefill") == [] and list(book.names("decode")) == ["d0"]
    clock.advance(1.0)
    assert sorted(book.silent("prefill")) == ["p0", "p2"] and book.silent("decode") == ["d0"]
    live = {x.instance for x in book.live_prefill()}
    assert live == set(book.names("prefill")) - set(book.silent("prefill"))
    book.forget("prefill", "p2")
    assert list(book.names("prefill")) == ["p0", "p1"] and book.silent("prefill") == ["p0"]
    clock.advance(10.0)
    assert book.prune(5.0) == 3  # p0, p1, d0
    assert list(book.names("prefill")) == [] and list(book.names("decode")) == []
    assert book.silent("prefill") == []


def test_prune_forgets_only_the_long_silent_from_the_oldest_and_bumps_the_version():
    """Pruning walks the sightings from the oldest (OrderedLiveness.prune) and stops at
    the first recent one; each name that comes or goes bumps ``version`` (what the
    placement's CPP groups are built over)."""
    clock = ManualClock()
    book = LoadBook(clock, CostModel(), dead_after_s=2.0)
    v0 = book.version
    book.observe_prefill(p("p0", 1.0, 0.0))
    clock.advance(3.0)
    book.observe_prefill(p("p1", 1.0, 3.0))
    book.observe_decode(d("d0", 3.0))
    clock.advance(3.0)
    book.observe_prefill(p("p2", 1.0, 6.0))
    book.observe_prefill(p("p1", 1.0, 6.0))  # seen again: no new name
    assert book.version == v0 + 4
    assert book.prune(4.0) == 1  # p0, silent 6 s; d0 (3 s) stays
    assert book.prune(2.5) == 1  # d0; p1 and p2 were seen now
    assert list(book.names("prefill")) == ["p1", "p2"] and list(book.names("decode")) == []
    assert book.version == v0 + 6
