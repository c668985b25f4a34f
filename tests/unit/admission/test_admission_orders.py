"""Early Rejection's pool minima from its load orders: exactly the scan over every live
instance, whatever the reports, deaths, role switches and request sizes; and a decision
on a large pool looks at a few instances, not the pool."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.load import CostFit, DecodeLoad, PrefillLoad
from services.admission.admission_policy import AdmissionRequest, EarlyRejectionPolicy
from services.common.clock import ManualClock
from services.common.cost_model import CostModel

COST = CostModel()


def pload(name: str, work: float) -> PrefillLoad:
    return PrefillLoad(
        instance=name, node=name, queue_len=1, queued_tokens=0, queued_work_s=work, ts=0.0
    )


def dload(name: str, batch: int, waiting: int, kv: int, max_batch: int = 64) -> DecodeLoad:
    return DecodeLoad(
        instance=name,
        node=name,
        batch_size=batch,
        waiting=waiting,
        max_batch=max_batch,
        kv_tokens=kv,
        step_time_s=0.0,
        ts=0.0,
    )


def twins() -> tuple[ManualClock, EarlyRejectionPolicy, EarlyRejectionPolicy]:
    clock = ManualClock(0.0)
    fast = EarlyRejectionPolicy(clock, COST, tbt_slo_s=0.03)
    ref = EarlyRejectionPolicy(clock, COST, tbt_slo_s=0.03)
    ref.pruned = False
    return clock, fast, ref


def same(fast, ref, req: AdmissionRequest) -> None:
    assert fast.prefill_load(req) == ref.prefill_load(req)
    assert fast.decode_load(req) == ref.decode_load(req)
    assert fast.decide(req) == ref.decide(req)


step = st.one_of(
    st.tuples(st.just("p"), st.integers(0, 9), st.floats(0, 40)),
    st.tuples(
        st.just("d"),
        st.integers(0, 9),
        st.integers(0, 3),  # running (0: idle unless waiting)
        st.integers(0, 2),  # waiting
        st.integers(0, 400_000),  # kv tokens
        st.sampled_from([1, 2, 64]),  # max batch: past it sequences take turns
    ),
    st.tuples(st.just("tick"), st.floats(0, 1.5)),
    st.tuples(st.just("forget"), st.sampled_from(["prefill", "decode"]), st.integers(0, 9)),
    st.tuples(st.just("ask"), st.integers(1, 200_000), st.sampled_from([None, 0.01, 0.2])),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, min_size=1, max_size=60))
def test_the_orders_give_the_scans_minima(steps):
    clock, fast, ref = twins()
    for s in steps:
        if s[0] == "p":
            for pol in (fast, ref):
                pol.observe_prefill(pload(f"p{s[1]}", s[2]))
        elif s[0] == "d":
            _, i, run, wait, kv, mb = s
            for pol in (fast, ref):
                pol.observe_decode(dload(f"d{i}", run, wait, kv if run else 0, mb))
        elif s[0] == "tick":  # instances silent past dead_after_s die
            clock.t += s[1]
        elif s[0] == "forget":
            for pol in (fast, ref):
                pol.forget_instance(s[1], f"{s[1][0]}{s[2]}")
        else:
            same(fast, ref, AdmissionRequest("r", s[1], tbt_slo_s=s[2]))
    same(fast, ref, AdmissionRequest("r", 1000))


def test_an_own_fit_falls_back_to_the_scan():
    clock, fast, ref = twins()
    fit = CostFit(decode=[0.05, 0.001, 1e-8], decode_samples=50)
    for pol in (fast, ref):
        pol.observe_prefill(pload("p0", 1.0))
        pol.observe_decode(dload("d0", 0, 0, 0))
        busy = dload("d1", 2, 0, 300_000)
        pol.observe_decode(DecodeLoad(**{**_fields(busy), "fit": fit}))
    assert fast._own_models == {"d1"}
    for n in (1, 50_000, 250_000):
        same(fast, ref, AdmissionRequest("r", n))


def _fields(load: DecodeLoad) -> dict:
    return {f: getattr(load, f) for f in load.__struct_fields__}


def test_a_decision_on_a_large_pool_evaluates_a_few_instances():
    _, fast, ref = twins()
    rng = random.Random(0)
    for i in range(2000):
        for pol in (fast, ref):
            pol.observe_prefill(pload(f"p{i}", rng.uniform(0.5, 30.0)))
            pol.observe_decode(dload(f"d{i}", rng.randint(1, 40), 0, rng.randint(2 * 10**5, 10**6)))
    for pol in (fast, ref):
        pol.observe_decode(dload("d-idle", 0, 0, 0))
    looked: list[str] = []
    alive = fast.loads.alive
    fast.loads.alive = lambda role, name: (looked.append(name), alive(role, name))[1]  # type: ignore[method-assign]
    for n in (1, 4000, 60_000):
        looked.clear()
        req = AdmissionRequest("r", n)
        assert fast.decode_load(req) == ref.decode_load(req)
        # the idle instance, then the busy ones whose bound is under its share
        assert 1 <= len(looked) <= 5
