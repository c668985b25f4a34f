"""How Algorithm 1 prices a request with n sequences (OpenAI's ``n``): one prefill (TTFT
as for n = 1), n decode sequences of the prompt's length (TBT and the load book)."""

import pytest

from bus_schemas.requests import GenerateRequest, SamplingParams
from services.conductor.placement_policy import PlacementRequest, Rejection
from tests.unit.conductor.test_conductor_policy import (
    BS,
    COST,
    N,
    make_policy,
    placed,
    req,
)


@pytest.mark.parametrize("pruned", [True, False])
def test_n_sequences_price_decode_n_times_and_prefill_once(pruned):
    one = make_policy()
    one.pruned = pruned
    many = make_policy()
    many.pruned = pruned
    a = placed(one.place(req("a"), {}))
    b = placed(many.place(req("b", seqs=3), {}))
    assert b.est_ttft_s == a.est_ttft_s  # one prefill either way
    assert a.est_tbt_s == COST.decode_step_time(1, N)
    assert b.est_tbt_s == COST.decode_step_time(3, 3 * N)  # the prompt's KV per sequence
    # Until the decode instance reports it, the placed request counts as 3 sequences.
    c = placed(many.place(req("c"), {}))
    assert c.est_tbt_s == COST.decode_step_time(4, 4 * N)


def test_a_tbt_slo_one_sequence_meets_rejects_many():
    n = 4000
    slo = (COST.decode_step_time(1, n) + COST.decode_step_time(8, 8 * n)) / 2
    pol = make_policy(tbt_slo_s=slo)
    placed(pol.place(req("one", n=n), {}))
    pol.release("one")
    r = pol.place(req("eight", n=n, seqs=8), {})
    assert isinstance(r, Rejection) and "TBT" in r.reason


def test_placement_request_takes_n_from_the_sampling_parameters():
    g = GenerateRequest(
        request_id="r", prompt_token_ids=list(range(N)), sampling=SamplingParams(n=3)
    )
    p = PlacementRequest.from_request(g, BS)
    assert p.seqs == 3


def test_the_decode_side_check_counts_n_sequences():
    from types import SimpleNamespace

    from services.policy.decode_side_check import DecodeSideCheck

    n = 4000
    slo = (COST.decode_step_time(1, n) + COST.decode_step_time(8, 8 * n)) / 2
    admit = DecodeSideCheck(COST, slo).as_admit_hook()
    stats = SimpleNamespace(batch_size=1, waiting=0, kv_tokens=0, max_batch=64)

    def task(k: int) -> SimpleNamespace:
        g = GenerateRequest(request_id="r", prompt_token_ids=[1] * n, sampling=SamplingParams(n=k))
        return SimpleNamespace(request=g)

    assert admit(task(1), stats, 0) is None
    assert "TBT SLO" in (admit(task(8), stats, 0) or "")
