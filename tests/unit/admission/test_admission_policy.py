"""Early Rejection (paper §4.3.2) with a hand-moved clock and hand-built load reports."""

import pytest

from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.requests import ErrorCode
from services.admission.admission_policy import (
    Accept,
    AdmissionRequest,
    BaselinePolicy,
    EarlyRejectionPolicy,
    make_admission_policy,
)
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.rejection import Rejection

COST = CostModel()
N = 500


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


def req(**kw) -> AdmissionRequest:
    return AdmissionRequest(request_id="r", num_tokens=N, **kw)


def early(clock=None, **kw) -> EarlyRejectionPolicy:
    return EarlyRejectionPolicy(clock or ManualClock(), COST, ttft_slo_s=30.0, tbt_slo_s=0.1, **kw)


def test_no_live_instance_is_503():
    pol = early()
    assert pol.decide(req()) == Rejection(ErrorCode.UNAVAILABLE, "no live prefill instance", 1.0)
    pol.observe_prefill(pload("p0", 0.0))
    assert pol.decide(req()) == Rejection(ErrorCode.UNAVAILABLE, "no live decode instance", 1.0)


def test_accepts_when_both_pools_are_under_their_slo_load():
    pol = early()
    pol.observe_prefill(pload("p0", 12.0))
    pol.observe_prefill(pload("p1", 6.0))
    pol.observe_decode(dload("d0", batch=3, kv=4000, waiting=1))
    d = pol.decide(req())
    assert d == Accept(
        prefill_load=6.0 / 30.0, decode_load=COST.decode_step_time(5, 4000 + N) / 0.1
    )


def test_prefill_pool_overloaded_is_429_with_the_excess_as_retry_after():
    pol = early()
    pol.observe_prefill(pload("p0", 45.0))
    pol.observe_prefill(pload("p1", 36.0))
    pol.observe_decode(dload("d0"))
    d = pol.decide(req())
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED
    assert "prefill" in d.reason
    assert d.retry_after_s == pytest.approx(6.0)
    # The least-loaded instance decides: one with room is enough.
    pol.observe_prefill(pload("p1", 3.0))
    assert isinstance(pol.decide(req()), Accept)


def test_decode_pool_overloaded_is_429():
    pol = early()
    pol.observe_prefill(pload("p0", 0.0))
    # Enough context that one step reads more than 0.1 s of HBM traffic.
    kv = int(0.1 * COST.hbm_bw / COST.kv_bytes(1))
    pol.observe_decode(dload("d0", batch=10, kv=kv))
    d = pol.decide(req())
    assert d == Rejection(
        ErrorCode.REJECTED,
        f"decode pool overloaded (load {COST.decode_step_time(11, kv + N) / 0.1:.2f} > 1)",
        1.0,
    )
    # A request that tolerates slower tokens gets in.
    assert isinstance(pol.decide(req(tbt_slo_s=1.0)), Accept)


def test_request_ttft_slo_overrides_the_default():
    pol = early()
    pol.observe_prefill(pload("p0", 45.0))
    pol.observe_decode(dload("d0"))
    assert isinstance(pol.decide(req()), Rejection)
    assert pol.decide(req(ttft_slo_s=90.0)) == Accept(
        prefill_load=0.5, decode_load=COST.decode_step_time(1, N) / 0.1
    )


def test_dead_instances_do_not_count():
    clock = ManualClock(0.0)
    pol = early(clock, dead_after_s=2.0)
    pol.observe_prefill(pload("p0", 0.0))
    pol.observe_decode(dload("d0"))
    clock.set(1.0)
    pol.observe_prefill(pload("p1", 60.0))
    clock.set(2.5)  # p0 and d0 silent for 2.5 s
    assert pol.decide(req()).code == ErrorCode.UNAVAILABLE
    pol.observe_decode(dload("d0"))
    d = pol.decide(req())
    assert d.code == ErrorCode.REJECTED  # only the overloaded p1 is left


def test_baseline_accepts_everything():
    pol = BaselinePolicy(ManualClock(), COST)
    assert pol.decide(req()) == Accept()
    pol.observe_prefill(pload("p0", 1e9))
    assert pol.decide(req()) == Accept()


def test_selector():
    clock = ManualClock()
    assert isinstance(
        make_admission_policy("early", clock, COST, ttft_slo_s=5.0), EarlyRejectionPolicy
    )
    assert make_admission_policy("early", clock, COST, ttft_slo_s=5.0).ttft_slo_s == 5.0
    assert isinstance(make_admission_policy("baseline", clock, COST), BaselinePolicy)
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_admission_policy("psychic", clock, COST)


def test_role_switch_drops_the_old_role_report_at_once():
    # x was the light prefill instance; once it switches to decode its last prefill
    # report must not keep the prefill pool looking free (it is alive for 2 s more).
    pol = early()
    pol.observe_prefill(pload("p0", 45.0))
    pol.observe_prefill(pload("x", 3.0))
    pol.observe_decode(dload("d0"))
    assert isinstance(pol.decide(req()), Accept)
    pol.forget_instance("prefill", "x")
    d = pol.decide(req())
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED and "prefill" in d.reason
    assert [p.instance for p in pol.live_prefill()] == ["p0"]
    pol.observe_decode(dload("x"))  # reports in its new role count as usual
    assert [d.instance for d in pol.live_decode()] == ["d0", "x"]


def test_an_idle_decode_instance_takes_a_request_its_model_predicts_over_the_slo():
    """A model that predicts too slow must not turn every request away from an idle
    engine (nothing would ever correct it): alone is the best TBT the request gets."""
    pol = early()
    pol.observe_prefill(pload("p0", 0.0))
    huge = 10 * int(0.1 * COST.hbm_bw / COST.kv_bytes(1))  # one step of it alone > 0.1 s
    pol.observe_decode(dload("d0"))
    assert COST.decode_step_time(1, huge) > 0.1
    d = pol.decide(AdmissionRequest(request_id="r", num_tokens=huge))
    assert isinstance(d, Accept) and d.decode_load == 1.0
    # The same request where one other sequence decodes is over the SLO: 429.
    pol.observe_decode(dload("d0", batch=1, kv=10))
    d = pol.decide(AdmissionRequest(request_id="r", num_tokens=huge))
    assert isinstance(d, Rejection) and d.code == ErrorCode.REJECTED


@pytest.mark.parametrize("pruned", [True, False])
def test_early_rejection_prices_n_sequences(pruned):
    # A request with n choices joins the decode pool as n sequences of its prompt.
    pol = early()
    pol.pruned = pruned
    pol.observe_prefill(pload("p0", 6.0))
    pol.observe_decode(dload("d0", batch=3, kv=4000, waiting=1))
    d = pol.decide(req(seqs=3))
    assert isinstance(d, Accept)
    assert d.decode_load == pytest.approx(COST.decode_step_time(7, 4000 + 3 * N) / 0.1)
