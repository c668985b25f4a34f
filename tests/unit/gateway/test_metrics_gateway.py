"""The gateway's Prometheus metrics: exact updates from a request's events, and the
/metrics endpoint after real requests (the registry is per process: deltas)."""

from bus_schemas.requests import Accepted, Finished, Tokens
from services.common import metrics as m
from services.gateway import telemetry
from services.gateway.responses import RequestOutcome
from tests.unit.gateway.test_gateway_http import env, serve_reject  # noqa: F401 - fixture

MODEL = "unit-model"


def snapshot() -> dict[str, float]:
    lab = {"model_name": MODEL}
    return {
        "ttft_n": m.sample(m.TTFT, "perigee:time_to_first_token_seconds_count", **lab),
        "ttft_sum": m.sample(m.TTFT, "perigee:time_to_first_token_seconds_sum", **lab),
        "itl_n": m.sample(m.ITL, "perigee:inter_token_latency_seconds_count", **lab),
        "itl_sum": m.sample(m.ITL, "perigee:inter_token_latency_seconds_sum", **lab),
        "e2e_n": m.sample(m.E2E, "perigee:e2e_request_latency_seconds_count", **lab),
        "e2e_sum": m.sample(m.E2E, "perigee:e2e_request_latency_seconds_sum", **lab),
        "tpot_sum": m.sample(m.TPOT, "perigee:request_time_per_output_token_seconds_sum", **lab),
        "prompt": m.sample(m.PROMPT_TOKENS, **lab),
        "gen": m.sample(m.GENERATION_TOKENS, **lab),
        "ok_length": m.sample(m.REQUEST_SUCCESS, model_name=MODEL, finished_reason="length"),
        "err_429": m.sample(m.REQUEST_ERRORS, model_name=MODEL, status="429"),
        "max_tokens_sum": m.sample(
            m.REQUEST_MAX_TOKENS, "perigee:request_params_max_tokens_sum", **lab
        ),
    }


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if after[k] != before[k]}


def test_outcome_times_first_token_and_inter_token_gaps():
    out = RequestOutcome(prompt_tokens=10, max_tokens=8)
    out.note(
        Accepted(request_id="r", prefill_instance="p", decode_instance="d", cached_tokens=4),
        t0=100.0,
        now=100.5,
    )
    out.note(Tokens(request_id="r", token_ids=[1], index=0), t0=100.0, now=101.0)
    out.note(Tokens(request_id="r", token_ids=[2, 3], index=1), t0=100.0, now=101.5)
    out.note(Tokens(request_id="r", token_ids=[4], index=3), t0=100.0, now=101.75)
    assert (out.ttft_s, out.itl, out.cached_tokens) == (1.0, [(0.25, 2), (0.25, 1)], 4)


def test_observe_a_finished_request_exactly():
    out = RequestOutcome(prompt_tokens=10, max_tokens=8)
    out.note(Tokens(request_id="r", token_ids=[1], index=0), t0=0.0, now=0.5)
    out.note(Tokens(request_id="r", token_ids=[2, 3, 4], index=1), t0=0.0, now=1.25)
    out.finish, out.completion_tokens = "length", 4
    before = snapshot()
    telemetry.observe(out, e2e_s=2.0, model=MODEL)
    assert delta(before, snapshot()) == {
        "ttft_n": 1,
        "ttft_sum": 0.5,
        "itl_n": 3,
        "itl_sum": 0.75,
        "e2e_n": 1,
        "e2e_sum": 2.0,
        "tpot_sum": 0.5,
        "prompt": 10,
        "gen": 4,
        "ok_length": 1,
        "max_tokens_sum": 8,
    }


def test_observe_a_rejected_request():
    out = RequestOutcome(prompt_tokens=10, max_tokens=8, status=429, error="overloaded")
    before = snapshot()
    telemetry.observe(out, e2e_s=0.01, model=MODEL)
    assert delta(before, snapshot()) == {"err_429": 1, "max_tokens_sum": 8}


def test_finished_after_tokens_counts_once():
    out = RequestOutcome(prompt_tokens=3)
    out.note(Tokens(request_id="r", token_ids=[1], index=0), t0=0.0, now=0.1)
    out.finished(
        Finished(
            request_id="r",
            finish_reason="stop",
            prompt_tokens=3,
            completion_tokens=1,
            cached_tokens=0,
        ),
        text=_Text(1),
    )
    assert (out.finish, out.completion_tokens, out.itl) == ("stop", 1, [])


class _Text:
    def __init__(self, n: int) -> None:
        self.completion_tokens = n


def parse(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            out[k] = float(v)
    return out


async def test_metrics_endpoint_counts_requests(env):  # noqa: F811 - fixture
    async def scrape() -> dict[str, float]:
        async with env.http.get(env.base + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            return parse(await r.text())

    lab = '{model_name="tiny-llama"}'
    ttft = "perigee:time_to_first_token_seconds_count" + lab
    before = await scrape()
    for stream in (False, True):
        async with env.post("/v1/completions", {"prompt": "hi", "stream": stream}) as r:
            assert r.status == 200
            await r.read()
    env.set_behaviour(serve_reject)
    async with env.post("/v1/completions", {"prompt": "hi"}) as r:
        assert r.status == 429
    async with env.post("/v1/completions", {"prompt": "hi", "n": 17}) as r:
        assert r.status == 400
    after = await scrape()
    assert after[ttft] - before.get(ttft, 0) == 2
    ok = 'perigee:request_success_total{finished_reason="stop",model_name="tiny-llama"}'
    assert after[ok] - before.get(ok, 0) == 2
    for status in ("429", "400"):
        k = f'perigee:request_errors_total{{model_name="tiny-llama",status="{status}"}}'
        assert after[k] - before.get(k, 0) == 1
    assert after["perigee:gateway_requests_in_flight"] == 0
