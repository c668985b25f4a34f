"""Early Rejection based on Prediction (paper §4.3.4, system level, uniform t_d) and the
baseline's decode-side check, on a ManualClock with exact expectations."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode, SamplingParams
from services.admission.admission_policy import (
    Accept,
    AdmissionRequest,
    EarlyRejectionPolicy,
    PredictiveRejectionPolicy,
    make_admission_policy,
)
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.rejection import Rejection
from services.policy.decode_side_check import DecodeSideCheck

COST = CostModel()
N = 500
TD = 10.0
OWN = COST.prefill_time(N)


def pload(instance: str, work: float) -> PrefillLoad:
    return PrefillLoad(
        instance=instance,
        node="n-" + instance,
        queue_len=1,
        queued_tokens=0,
        queued_work_s=work,
        ts=0.0,
    )


def dload(instance: str, batch: int = 0, kv: int = 0, waiting: int = 0) -> DecodeLoad:
    return DecodeLoad(
        instance=instance,
        node="n-" + instance,
        batch_size=batch,
        waiting=waiting,
        max_batch=64,
        kv_tokens=kv,
        step_time_s=0.0,
        ts=0.0,
    )


def req(rid: str = "r", n: int = N, **kw) -> AdmissionRequest:
    return AdmissionRequest(request_id=rid, num_tokens=n, **kw)


def predict(clock, **kw) -> PredictiveRejectionPolicy:
    kw.setdefault("ttft_slo_s", 30.0)
    kw.setdefault("tbt_slo_s", 0.1)
    kw.setdefault("dead_after_s", 100.0)
    return PredictiveRejectionPolicy(clock, COST, decode_time_s=TD, **kw)


def cluster(pol) -> None:
    pol.observe_prefill(pload("p0", 1.0))
    pol.observe_prefill(pload("p1", 3.0))
    pol.observe_decode(dload("d0", batch=4, kv=8000))
    pol.observe_decode(dload("d1", batch=2, waiting=2, kv=4000))


def test_decode_load_is_predicted_at_prefill_completion():
    clock = ManualClock()
    pol = predict(clock)
    cluster(pol)
    f = 1.0 + OWN  # least queue, then the request's own prefill
    assert pol.prefill_done_at(req()) == f
    s = 1.0 - f / TD  # share of the 8 residents of unknown age still decoding at f
    want_tbt = COST.decode_step_time((8 * s + 1) / 2, (12000.0 * s + N) / 2)
    assert pol.decide(req()) == Accept(prefill_load=1.0 / 30.0, decode_load=want_tbt / 0.1)


def test_admitted_requests_join_at_their_prefill_completion_and_queue_prefill_work():
    clock = ManualClock()
    pol = predict(clock)
    cluster(pol)
    clock.set(0.5)  # accepted after the reports: no report covers them
    fa = 0.5 + 1.0 + OWN
    assert isinstance(pol.decide(req("a")), Accept)
    pol.on_accepted(req("a"))
    assert pol.admitted["a"].prefill_done_at == fa and pol.admitted["a"].work_s == OWN
    # b waits behind a's work, shared over the two prefill instances
    wait_b = min(1.0 + OWN * 0.5, 3.0 + OWN * 0.5)
    fb = 0.5 + wait_b + OWN
    assert pol.prefill_wait() == wait_b
    assert pol.prefill_done_at(req("b")) == fb
    s = 1.0 - (fb - 0.5) / TD
    # at fb: 8 unknown-age residents (scaled), a (joined at fa <= fb), and b itself
    assert pol.predicted_decode(fb, N) == (8 * s + 1 + 1, 12000.0 * s + N + N)
    d = pol.decide(req("b"))
    assert d == Accept(
        prefill_load=wait_b / 30.0,
        decode_load=COST.decode_step_time((8 * s + 2) / 2, (12000.0 * s + 2 * N) / 2) / 0.1,
    )
    # a fresh report from p0 covers a's work there (p1 has not reported since)
    clock.set(0.6)
    pol.observe_prefill(pload("p0", 1.0 + OWN))
    assert pol.prefill_wait() == min(1.0 + OWN, 3.0 + OWN * 0.5)


def test_prediction_counts_n_sequences_as_the_rest_of_admission():
    # A request with n choices joins the predicted pool as n sequences of its prompt,
    # and is counted so while it decodes there (issue 25: as placement prices it).
    clock = ManualClock()
    pol = predict(clock)
    cluster(pol)
    f = 1.0 + OWN
    s = 1.0 - f / TD
    assert pol.predicted_decode(f, N, 3) == (8 * s + 3, 12000.0 * s + 3 * N)
    want_tbt = COST.decode_step_time((8 * s + 3) / 2, (12000.0 * s + 3 * N) / 2)
    assert pol.decide(req(seqs=3)) == Accept(prefill_load=1.0 / 30.0, decode_load=want_tbt / 0.1)
    pol.on_accepted(req("a", seqs=3))
    fa = pol.admitted["a"].prefill_done_at
    assert pol._in_decode(fa) == (3, 3 * N)
    # b (one sequence) sees a's three beside it once both have prefilled
    fb = pol.prefill_done_at(req("b"))
    s = 1.0 - fb / TD
    assert pol.predicted_decode(fb, N) == (8 * s + 3 + 1, 12000.0 * s + 3 * N + N)


def test_requests_older_than_td_leave_and_already_decoding_ones_are_not_counted_twice():
    clock = ManualClock()
    pol = predict(clock)
    cluster(pol)
    clock.set(0.5)
    pol.on_accepted(req("a"))
    fa = pol.admitted["a"].prefill_done_at
    clock.set(fa + 1.0)  # a is decoding now; the reports (8 residents) include it
    pol.observe_prefill(pload("p0", 0.0))
    pol.observe_prefill(pload("p1", 0.0))
    now = clock.now()
    fb = now + OWN
    s = max(0.0, 1.0 - (fb - now) / TD)
    # 8 reported - 1 admitted already in decode = 7 of unknown age, + a, + the newcomer
    assert pol.predicted_decode(fb, N) == (7 * s + 1 + 1, 12000.0 * 7 / 8 * s + N + N)
    # far enough ahead everything old has left, a included: only the newcomer remains
    assert pol.predicted_decode(now + TD, N) == (1.0, float(N))
    clock.set(fa + TD)
    pol.decide(req("c"))
    assert "a" not in pol.admitted  # forgotten once f + t_d has passed


def test_prediction_accepts_what_early_rejection_refuses_when_decode_will_have_drained():
    # Decode is over its TBT SLO right now, but the prefill queue is 8 s long: by the
    # time this request reaches decode, 80% of today's residents (t_d = 10 s) are gone.
    clock = ManualClock()
    slo = 0.02
    early = EarlyRejectionPolicy(clock, COST, ttft_slo_s=30.0, tbt_slo_s=slo)
    pred = predict(clock, tbt_slo_s=slo)
    for pol in (early, pred):
        pol.observe_prefill(pload("p0", 8.0))
        pol.observe_decode(dload("d0", batch=40, kv=800_000))
    assert COST.decode_step_time(41, 800_000 + N) > slo
    e = early.decide(req())
    assert isinstance(e, Rejection) and e.code == ErrorCode.REJECTED
    s = 1.0 - (8.0 + OWN) / TD
    p = pred.decide(req())
    assert p == Accept(
        prefill_load=8.0 / 30.0,
        decode_load=COST.decode_step_time(40 * s + 1, 800_000.0 * s + N) / slo,
    )
    assert p.decode_load < 1.0


def test_prediction_refuses_what_early_rejection_accepts_when_admitted_work_will_land():
    # Decode is idle now, but 30 admitted requests finish their prefill before this one.
    clock = ManualClock()
    slo = 0.0087
    early = EarlyRejectionPolicy(clock, COST, ttft_slo_s=300.0, tbt_slo_s=slo)
    pred = predict(clock, ttft_slo_s=300.0, tbt_slo_s=slo)
    for pol in (early, pred):
        pol.observe_prefill(pload("p0", 0.0))
        pol.observe_decode(dload("d0"))
    clock.set(0.1)
    for i in range(30):
        pred.on_accepted(req(f"a{i}", n=4000))
    assert isinstance(early.decide(req()), Accept)
    d = pred.decide(req())
    assert isinstance(d, Rejection) and "decode pool overloaded" in d.reason


def test_predict_needs_live_instances_and_a_positive_td():
    pol = predict(ManualClock())
    assert pol.decide(req()) == Rejection(ErrorCode.UNAVAILABLE, "no live prefill instance", 1.0)
    pol.observe_prefill(pload("p0", 0.0))
    assert pol.decide(req()) == Rejection(ErrorCode.UNAVAILABLE, "no live decode instance", 1.0)
    with pytest.raises(ValueError):
        PredictiveRejectionPolicy(ManualClock(), COST, decode_time_s=0.0)


def test_selector_builds_predict_with_its_parameters():
    pol = make_admission_policy("predict", ManualClock(), COST, decode_time_s=3.0, tbt_slo_s=0.05)
    assert isinstance(pol, PredictiveRejectionPolicy)
    assert (pol.decode_time_s, pol.tbt_slo_s) == (3.0, 0.05)
    pol.on_accepted(req("x"))  # no instance: nothing to predict, nothing recorded
    assert pol.admitted == {}
    pol.forget("x")


def test_decode_side_check_rejects_over_the_tbt_slo():
    slo = COST.decode_step_time(3, 1000 + N)
    gate = DecodeSideCheck(COST, tbt_slo_s=slo)
    assert (
        gate.check(batch_size=1, waiting=1, kv_tokens=1000, num_tokens=N) is None
    )  # exactly at the SLO
    r = gate.check(batch_size=1, waiting=1, kv_tokens=1001, num_tokens=N)
    assert isinstance(r, Rejection) and r.code == ErrorCode.REJECTED and r.retry_after_s == 1.0
    assert "over its TBT SLO" in r.reason
    assert gate.check(1, 1, 1001, N, tbt_slo_s=1.0) is None  # the request's own SLO
    assert gate.rejected == 1


def test_report_grace_keeps_recent_admissions_unseen_and_forget_takes_them_back():
    clock = ManualClock()
    pol = predict(clock, report_grace_s=0.5)
    pol.observe_prefill(pload("p0", 0.0))
    pol.observe_prefill(pload("p1", 0.0))
    pol.observe_decode(dload("d0"))
    clock.set(1.0)
    pol.on_accepted(req("a", n=1000))
    clock.set(1.2)
    pol.on_accepted(req("b", n=2000))
    wa, wb = COST.prefill_time(1000), COST.prefill_time(2000)
    assert pol.prefill_wait() == (wa + wb) * 0.5  # neither reported: shared over two
    clock.set(1.6)  # p0 reports: a (1.0 + 0.5 <= 1.6) is in it, b (1.7 > 1.6) maybe not
    pol.observe_prefill(pload("p0", 0.25))
    assert pol._unseen == {"p0": wb, "p1": wa + wb}
    assert pol.prefill_wait() == min(0.25 + wb * 0.5, (wa + wb) * 0.5)
    pol.forget("b")  # running sums: wa + wb - wb, exact to an ulp
    assert pol._unseen == {"p0": 0.0, "p1": pytest.approx(wa, rel=1e-12)}
    pol.forget("b")  # twice: nothing
    clock.set(1.8)
    pol.observe_prefill(pload("p1", 0.0))  # a is past its grace: covered
    assert pol._unseen == {"p0": 0.0, "p1": 0.0}
    assert list(pol.admitted) == ["a"]


def test_decode_prediction_counts_turns_past_max_batch():
    # 10 admitted requests land together with the newcomer on one instance capped at 4:
    # 11 sequences take turns in 3 rounds of 11/3
    clock = ManualClock()
    pol = predict(clock)
    pol.observe_prefill(pload("p0", 0.0))
    pol.observe_decode(
        DecodeLoad(
            instance="d0",
            node="n-d0",
            batch_size=0,
            waiting=0,
            max_batch=4,
            kv_tokens=0,
            step_time_s=0.0,
            ts=0.0,
        )
    )
    for i in range(10):
        pol.on_accepted(req(f"a{i}", n=100))
    f = pol.prefill_done_at(req(n=100))
    assert pol.predicted_decode(f, 100) == (11.0, 1100.0)
    want = COST.decode_tbt(11.0, 1100.0, 4)
    assert want == 3 * COST.decode_step_time(11 / 3, 1100 / 3) > COST.decode_step_time(11, 1100)
    assert pol.decode_load(req(n=100)) == want / 0.1


def test_decode_side_check_counts_turns_past_max_batch():
    slo = COST.decode_tbt(9, 9000 + N, 4)
    gate = DecodeSideCheck(COST, tbt_slo_s=slo, max_batch=4)
    assert gate.check(batch_size=4, waiting=4, kv_tokens=9000, num_tokens=N) is None  # at the SLO
    assert isinstance(gate.check(4, 4, 9001, N), Rejection)
    # the plain step time of 9 sequences would have let it through
    assert COST.decode_step_time(9, 9001 + N) < slo
    assert gate.check(4, 4, 9001, N, max_batch=0) is None  # uncapped, per call


class _Stats:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Task:
    class request:  # noqa: N801 - stands in for a DecodeTask's request
        prompt_token_ids = [0] * N
        tbt_slo_s = None
        sampling = SamplingParams()


def test_decode_side_hook_uses_the_engines_max_batch_when_it_reports_one():
    slo = COST.decode_tbt(9, 9001 + N, 4) - 1e-9  # only the capped estimate exceeds it
    admit = DecodeSideCheck(COST, tbt_slo_s=slo).as_admit_hook()
    no_cap = _Stats(batch_size=4, waiting=3, kv_tokens=9001)
    assert admit(_Task, no_cap, 1) is None
    capped = _Stats(batch_size=4, waiting=3, kv_tokens=9001, max_batch=4)
    assert "over its TBT SLO" in admit(_Task, capped, 1)


# Brute force: the pre-running-sums formulas over ``admitted`` (O(admitted x instances)).
def _ref_wait(pol):
    live = pol.live_prefill()
    share = 1.0 / len(live)
    return min(
        p.queued_work_s
        + sum(
            a.work_s
            for a in pol.admitted.values()
            if a.accepted_at + pol.report_grace_s > pol._seen_at[p.instance]
        )
        * share
        for p in live
    )


def _ref_in_decode(pol, at):
    td = pol.decode_time_s
    inside = [a for a in pol.admitted.values() if a.prefill_done_at <= at < a.prefill_done_at + td]
    return sum(a.seqs for a in inside), sum(a.tokens for a in inside)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(
                st.just("accept"),
                st.integers(0, 12),
                st.tuples(st.integers(1, 4000), st.integers(1, 4)),
            ),
            st.tuples(st.just("report"), st.sampled_from(["p0", "p1", "p2"]), st.floats(0, 5)),
            st.tuples(st.just("forget"), st.integers(0, 12), st.just(0)),
            st.tuples(st.just("tick"), st.floats(0, 3), st.just(0)),
            st.tuples(st.just("decide"), st.integers(1, 4000), st.just(0)),
        ),
        max_size=40,
    ),
    st.sampled_from([0.0, 0.05, 1.0]),
)
def test_running_sums_match_the_brute_force(ops, grace):
    clock = ManualClock(1000.0)
    pol = PredictiveRejectionPolicy(
        clock, COST, decode_time_s=2.0, report_grace_s=grace, dead_after_s=1e9
    )
    for p in ("p0", "p1", "p2"):
        pol.observe_prefill(pload(p, 0.0))
    pol.observe_decode(dload("d0", batch=3, kv=3000))
    for op, x, y in ops:
        if op == "accept":
            pol.on_accepted(req(f"r{x}", n=y[0], seqs=y[1]))
        elif op == "report":
            pol.observe_prefill(pload(x, y))
        elif op == "forget":
            pol.forget(f"r{x}")
        elif op == "tick":
            clock.set(clock.now() + x)
        else:
            pol.decide(req("new", n=x))
        assert pol.prefill_wait() == pytest.approx(_ref_wait(pol), rel=1e-9, abs=1e-12)
        now = clock.now()
        for at in (now, now + 0.5, now + 2.0, now + 7.0):
            assert pol._in_decode(at) == _ref_in_decode(pol, at)


def test_role_switch_forgets_the_instance_and_its_unseen_work():
    clock = ManualClock()
    pol = predict(clock)
    cluster(pol)
    clock.advance(0.01)
    pol.on_accepted(req("a"))  # after both prefill reports: unseen by them
    share = pol.admitted["a"].work_s / 2
    assert pol.prefill_wait() == pytest.approx(1.0 + share)
    pol.forget_instance("prefill", "p0")  # p0 became a decode instance
    assert [p.instance for p in pol.live_prefill()] == ["p1"]
    assert pol.prefill_wait() == pytest.approx(3.0 + 2 * share)
    pol.on_accepted(req("b"))  # bookkeeping goes on without p0
    assert pol.prefill_wait() == pytest.approx(3.0 + 2 * share + pol.admitted["b"].work_s)
    clock.advance(1.0)
    pol.observe_prefill(pload("p1", 0.5))  # a fresh report has seen both
    assert pol.prefill_wait() == pytest.approx(0.5)


def test_decode_side_check_lets_an_idle_instance_take_any_request():
    slo = COST.decode_step_time(1, 1000 + N) / 2  # the request alone misses it
    assert isinstance(DecodeSideCheck(COST, tbt_slo_s=slo).check(0, 0, 0, 1000 + N), Rejection)
    gate = DecodeSideCheck(COST, tbt_slo_s=slo, serve_when_idle=True)  # the live worker's
    assert gate.check(batch_size=0, waiting=0, kv_tokens=0, num_tokens=1000 + N) is None
    assert isinstance(
        gate.check(batch_size=0, waiting=1, kv_tokens=0, num_tokens=1000 + N), Rejection
    )


def test_predict_lets_a_request_alone_in_the_predicted_pool_in():
    clock = ManualClock()
    pol = predict(clock, tbt_slo_s=COST.decode_step_time(1, N) / 2)  # alone it misses
    pol.observe_prefill(pload("p0", 0.0))
    pol.observe_decode(dload("d0"))
    d = pol.decide(req())
    assert isinstance(d, Accept) and d.decode_load == 1.0
    pol.on_accepted(req())
    # A second one would share the pool with the first at its prefill's end: 429.
    r = pol.decide(req("r2"))
    assert isinstance(r, Rejection) and r.code == ErrorCode.REJECTED
