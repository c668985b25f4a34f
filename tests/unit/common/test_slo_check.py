"""One TBT rule (issue 26 item 1): admission's decode load, the conductor's TBT
rejection and the decode side's check (the baseline) answer as services.common.slo_check
does, on the same instance state."""

from hypothesis import given, settings
from hypothesis import strategies as st

from bus_schemas.load import DecodeLoad, PrefillLoad
from services.admission.admission_policy import AdmissionRequest, EarlyRejectionPolicy
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.common.rejection import Rejection
from services.common.slo_check import TbtCheck
from services.conductor.placement_policy import Placement, PlacementPolicy, PlacementRequest
from services.policy.decode_side_check import DecodeSideCheck

COST = CostModel()


def test_exact_cases():
    rule = TbtCheck(max_load=1.0, serve_when_idle=True)
    assert rule.share(0.05, 0.1) == 0.5 and not rule.over(0.05, 0.1)
    assert rule.over(0.2, 0.1) and not rule.over(0.2, 0.1, idle=True)
    assert TbtCheck(serve_when_idle=False).over(0.2, 0.1, idle=True)
    assert TbtCheck(max_load=2.5).share(0.2, 0.1) == 2.0
    assert not TbtCheck(max_load=2.5).over(0.2, 0.1)
    assert TbtCheck().over(0.001, 0.0) and not TbtCheck().over(0.0, 0.0)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.integers(0, 200),
    waiting=st.integers(0, 20),
    kv=st.integers(0, 3_000_000),
    n=st.integers(1, 100_000),
    max_batch=st.sampled_from([0, 16, 128]),
    slo=st.sampled_from([0.01, 0.03, 0.05, 0.1]),
    idle_ok=st.booleans(),
)
def test_admission_conductor_and_decode_side_follow_the_rule(
    batch, waiting, kv, n, max_batch, slo, idle_ok
):
    rule = TbtCheck(1.0, idle_ok)
    tbt = rule.tbt(COST, batch, waiting, kv, n, max_batch)
    idle = batch + waiting == 0
    over = rule.over(tbt, slo, idle)
    # decode side (the paper's baseline)
    side = DecodeSideCheck(COST, slo, max_batch=max_batch, serve_when_idle=idle_ok)
    assert (side.check(batch, waiting, kv, n) is not None) == over
    # conductor: one idle prefill instance, this decode instance
    clock = ManualClock(0.0)
    pol = PlacementPolicy(clock, COST, tbt_slo_s=slo, ttft_slo_s=1e9, serve_when_idle=idle_ok)
    pol.observe_prefill(PrefillLoad("p", "n", 0, 0, 0.0, 0.0))
    pol.observe_decode(DecodeLoad("d", "m", batch, waiting, max_batch, kv, 0.0, 0.0))
    d = pol.place(PlacementRequest("r", n, (), 512), {})
    assert isinstance(d, Placement) == (not over)
    assert pol.stats["rejected_tbt"] == int(over)
    # admission (Early Rejection: an idle instance always counts at most max_load)
    adm = EarlyRejectionPolicy(clock, COST, tbt_slo_s=slo, ttft_slo_s=1e9)
    adm.observe_prefill(PrefillLoad("p", "n", 0, 0, 0.0, 0.0))
    adm.observe_decode(DecodeLoad("d", "m", batch, waiting, max_batch, kv, 0.0, 0.0))
    dl = adm.decode_load(AdmissionRequest("r", n))
    assert dl == TbtCheck(1.0, True).share(tbt, slo, idle)
    assert isinstance(adm.decide(AdmissionRequest("r", n)), Rejection) == TbtCheck(1.0, True).over(
        tbt, slo, idle
    )
