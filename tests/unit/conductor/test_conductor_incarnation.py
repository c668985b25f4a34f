"""The conductor's books follow incarnations (services.common.incarnation): a late
report of a dead process is ignored, a new incarnation holds nothing booked on the old
one, and a migration away from a dead process may go to its restarted successor."""

import asyncio

import msgspec

from services.common.clock import ManualClock
from services.common.incarnation import RESTARTED, SAME, STALE
from services.conductor.migrated_placement import placement_for
from services.conductor.placement_policy import Placement
from tests.unit.conductor.test_conductor_policy import COST, N, dload, make_policy, pload, req
from tests.unit.gateway.test_gateway_migration import mig

OLD, NEW = 1_000, 2_000


def inc(load, incarnation):
    return msgspec.structs.replace(load, incarnation=incarnation)


def test_a_late_report_of_a_dead_incarnation_is_ignored():
    pol = make_policy(prefills=(), decodes=())
    assert pol.loads.observe_prefill(inc(pload("p0", "n0", work=1.0), OLD)) == SAME
    assert pol.loads.observe_prefill(inc(pload("p0", "n0", work=0.0), NEW)) == RESTARTED
    assert pol.loads.observe_prefill(inc(pload("p0", "n0", work=9.0), OLD)) == STALE
    assert pol.loads.prefill["p0"].queued_work_s == 0.0
    assert pol.loads.incarnation("prefill", "p0") == NEW


def test_a_new_incarnation_holds_none_of_the_work_booked_on_the_old():
    clock = ManualClock(10.0)
    pol = make_policy(clock, prefills=(), decodes=())
    pol.observe_prefill(inc(pload("p0", "n0", ts=10.0), OLD))
    pol.observe_decode(inc(dload("d0", "m0", ts=10.0), OLD))
    a = pol.place(req("a"), {})
    assert isinstance(a, Placement) and pol.queue_s("p0") == COST.prefill_time(N, 0)
    # A report of the same incarnation made before the dispatch does not cover it...
    pol.observe_prefill(inc(pload("p0", "n0", ts=9.0), OLD))
    assert pol.queue_s("p0") == COST.prefill_time(N, 0)
    # ...but the first report of a new one does: that process never got the task.
    pol.observe_prefill(inc(pload("p0", "n0", ts=9.0), NEW))
    assert pol.queue_s("p0") == 0.0


def test_a_migration_may_go_to_the_restarted_instance_of_the_dead_ones_name():
    pol = make_policy(prefills=(), decodes=())
    pol.observe_prefill(inc(pload("p0", "n0"), NEW))  # the only prefill instance
    pol.observe_decode(inc(dload("d0", "m0"), OLD))
    dead = msgspec.structs.replace(mig("prefill_died", "p0"), dead_incarnation=OLD)
    preq, exclude = placement_for(req("r-m1"), dead, pol.loads.incarnation)
    assert exclude == {}
    assert pol.place(preq, {}, **exclude).prefill_instance == "p0"
    # The incarnation that died still reporting (a wedged one) keeps it excluded.
    same = msgspec.structs.replace(dead, dead_incarnation=NEW)
    assert placement_for(req("r-m1"), same, pol.loads.incarnation)[1] == {
        "exclude_prefill": ("p0",)
    }


def test_a_message_is_believed_only_from_the_subject_that_names_its_sender():
    from bus_schemas import subjects

    assert subjects.named_by(subjects.load_report("decode", "d0"), "d0")
    assert not subjects.named_by(subjects.load_report("decode", "d1"), "d0")
    assert subjects.named_by(subjects.kv_events("p0"), "p0")
    assert not subjects.named_by(subjects.kv_events("p1"), "p0")


async def test_the_conductor_drops_a_load_report_claiming_another_instance(nats_url):
    """decode-1's login (allowed only its own subject) reports as decode-0: ignored."""
    import nats as nats_py

    from bus_schemas import subjects
    from bus_schemas.codec import encode
    from tests.unit.conductor.test_conductor_service import Harness

    h = Harness(nats_url)
    await h.start([], prefills=[("prefill-0", "n0", 0.0)], decodes=[("decode-9", "m9")])
    try:
        nc = await nats_py.connect(nats_url)
        fake = dload("decode-0", "m0")
        await nc.publish(subjects.load_report("decode", "decode-1"), encode(fake))
        real = dload("decode-7", "m7")
        await nc.publish(subjects.load_report("decode", "decode-7"), encode(real))
        await nc.flush()

        async def heard() -> None:
            while "decode-7" not in h.svc.policy.loads.decode:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(heard(), 5)  # in order: the impostor's came first
        assert "decode-0" not in h.svc.policy.loads.decode
        assert "decode-1" not in h.svc.policy.loads.decode
        await nc.close()
    finally:
        await h.close()


def test_a_wedged_instance_is_avoided_unless_it_is_the_only_one_of_its_role():
    """The watchdog's wedge verdict names a live instance (Migration.wedged): the
    migration goes elsewhere while another of its role is live, and back to it when it
    is the only one, rather than waiting for another that never comes. A death is
    still excluded with no fallback."""
    from services.conductor import placement_round
    from services.conductor.placement_policy import Rejection

    pol = make_policy(prefills=(), decodes=())
    pol.observe_prefill(inc(pload("p0", "n0"), OLD))  # the only prefill instance
    pol.observe_decode(inc(dload("d0", "m0"), OLD))
    died = msgspec.structs.replace(mig("prefill_died", "p0"), dead_incarnation=OLD)
    wedged = msgspec.structs.replace(died, wedged=True)
    got = placement_round.place(pol, req("r-m1"), lambda h: {}, migration=died)
    assert isinstance(got, Rejection) and "no live prefill instance" in got.reason
    got = placement_round.place(pol, req("r-m1"), lambda h: {}, migration=wedged)
    assert isinstance(got, placement_round.Placed)
    assert got.placement.prefill_instance == "p0"
    # Another prefill instance live: the wedged one is avoided.
    pol.observe_prefill(inc(pload("p1", "n1"), OLD))
    for _ in range(3):
        got = placement_round.place(pol, req("r-m1"), lambda h: {"n0": 3}, migration=wedged)
        assert isinstance(got, placement_round.Placed)
        assert got.placement.prefill_instance == "p1"
    # A wedged decode instance, the only one, gets its request back too.
    dw = msgspec.structs.replace(mig("decode_died", "d0"), dead_incarnation=OLD, wedged=True)
    got = placement_round.place(pol, req("r-m2"), lambda h: {}, migration=dw)
    assert isinstance(got, placement_round.Placed) and got.placement.decode_instance == "d0"
