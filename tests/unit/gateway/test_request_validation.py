"""Bad input stops at the first service that reads it: the sampling bounds
(:meth:`SamplingParams.problem`, shared by the gateway, admission and the vLLM engine
wrapper), the gateway's OpenAI parsing (served fields within vLLM's bounds, known but
unserved fields refused by name), the gateway's in-flight cap, and the engine wrapper
failing one request, never itself."""

import asyncio
import importlib.util
import json

import pytest

from bus_schemas.requests import INT32_MAX, INT64_MAX, INT64_MIN, MAX_N, SamplingParams
from services.common import metrics
from services.gateway.protocol import (
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    UNSUPPORTED_CHAT,
    UNSUPPORTED_COMPLETION,
    ApiError,
    parse_chat,
    parse_completion,
)
from tests.unit.gateway.test_gateway_http import env, serve_nothing, until  # noqa: F401 - fixture

V = 1024
MSG = [{"role": "user", "content": "x"}]


def _problem(**kw) -> str | None:
    p = SamplingParams(**kw).problem()
    return None if p is None else p[0]


# ------------------------------------------------------------------ SamplingParams.problem


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({}, None),
        ({"max_tokens": 1}, None),
        ({"max_tokens": INT32_MAX}, None),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": INT32_MAX + 1}, "max_tokens"),
        ({"temperature": 0.0}, None),
        ({"temperature": 2.0}, None),
        ({"temperature": -0.01}, "temperature"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 1.0}, None),
        ({"top_p": 1e-9}, None),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.0001}, "top_p"),
        ({"top_p": float("nan")}, "top_p"),
        ({"seed": INT64_MAX}, None),
        ({"seed": INT64_MIN}, None),
        ({"seed": None}, None),
        ({"seed": 2**70}, "seed"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": INT64_MIN - 1}, "seed"),
        ({"stop_token_ids": [0, INT32_MAX]}, None),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"top_k": -1}, None),
        ({"top_k": 0}, None),
        ({"top_k": INT32_MAX}, None),
        ({"top_k": -2}, "top_k"),
        ({"top_k": INT32_MAX + 1}, "top_k"),
        ({"min_p": 0.0}, None),
        ({"min_p": 1.0}, None),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"repetition_penalty": 1e-6}, None),
        ({"repetition_penalty": 50.0}, None),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ],
)
def test_sampling_bounds(kw, field):
    assert _problem(**kw) == field


def test_admission_refuses_out_of_bounds_sampling_on_the_bus():
    from bus_schemas.requests import GenerateRequest
    from services.admission.service import AdmissionConfig, AdmissionService

    svc = AdmissionService(None, AdmissionConfig(block_size=4))
    req = GenerateRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(seed=2**70)
    )
    _, problem = svc.fill(req, "reply")
    assert problem == f"seed must be a 64-bit signed integer, got {2**70}"
    _, problem = svc.fill(GenerateRequest(request_id="r", prompt_token_ids=[1, 2, 3]), "reply")
    assert problem == ""


# ------------------------------------------------------------------ the OpenAI bodies


def _parse(body: dict, chat: bool = False):
    body = {**body, **({"messages": MSG} if chat else {"prompt": body.get("prompt", "x")})}
    return (parse_chat if chat else parse_completion)(json.dumps(body).encode(), V)


def _err(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as ei:
        _parse(body, chat)
    assert ei.value.status == 400
    return ei.value


@pytest.mark.parametrize("chat", [False, True])
def test_served_sampling_fields_pass_through(chat):
    p = _parse(
        {
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "seed": INT64_MIN,
            "presence_penalty": 0,
            "frequency_penalty": 0.0,
            "stop": ["a", "b"],
            "stop_token_ids": [5],
        },
        chat,
    )
    s = p.sampling(7)
    assert s == SamplingParams(
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=INT64_MIN,
        stop_token_ids=[5],
    )
    assert p.stop == ["a", "b"]
    assert _parse({"seed": -1}, chat).seed is None  # vLLM: -1 means no seed


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"seed": 2**70}, "seed"),
        ({"seed": INT64_MAX + 1}, "seed"),
        ({"seed": "1"}, "seed"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 2}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [V]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
        ({"n": MAX_N + 1}, "n"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": 2, "seed": INT64_MAX}, "seed"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_out_of_bounds_is_a_400_naming_the_field(body, param, chat):
    assert _err(body, chat).param == param


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"best_of": 2}, "best_of"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"suffix": "s"}, "suffix"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"priority": 1}, "priority"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens"),
    ],
)
def test_known_but_unserved_fields_are_refused_by_name(body, param, chat):
    e = _err(body, chat)
    assert (e.param, e.code) == (param, "unsupported_parameter")
    assert f"`{param}` is not supported" in e.message or "not supported" in e.message


def test_unserved_fields_at_their_neutral_values_pass():
    neutral = {
        "logprobs": None,
        "top_logprobs": 0,
        "logit_bias": {},
        "echo": False,
        "best_of": 1,
        "suffix": None,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "min_tokens": 0,
        "response_format": {"type": "text"},
        "priority": 0,
        "skip_special_tokens": True,
        "length_penalty": 1.0,
        "bad_words": [],
    }
    _parse(neutral)
    _parse(
        {
            **neutral,
            "logprobs": False,
            "tools": [],
            "tool_choice": "none",
            "add_generation_prompt": True,
            "modalities": ["text"],
        },
        chat=True,
    )
    # tools are checked by the server (services.gateway.tools): "auto", their default,
    # needs --tool-call-parser
    from services.gateway.tools import parse_tools

    fields = _parse({"tools": [{"type": "function", "function": {"name": "f"}}]}, chat=True)
    with pytest.raises(ApiError) as ei:
        parse_tools(*fields.tool_fields, None)
    assert ei.value.param == "tool_choice"
    assert set(UNSUPPORTED_COMPLETION) - {"top_logprobs"} < set(UNSUPPORTED_CHAT)
    # what one endpoint serves, the other refuses by name
    assert _err({"echo": True}, chat=True).code == "unsupported_parameter"
    assert _err({"top_logprobs": 2}).code == "unsupported_parameter"


def test_raw_json_vllm_would_not_take():
    for raw, param in [
        (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
        (b'{"prompt": "x", "temperature": NaN}', None),
        (b'{"prompt": "x", "seed": 1180591620717411303424}', "seed"),
        (b'{"prompt": "x", "max_tokens": 4', None),
        (b"", None),
        (b"[]", None),
    ]:
        with pytest.raises(ApiError) as ei:
            parse_completion(raw, V)
        assert (ei.value.status, ei.value.param) == (400, param), raw


def test_prompts_vllm_refuses():
    assert _err({"prompt": ""}).param == "prompt"
    assert _err({"prompt": [""]}).param == "prompt"
    assert _err({"prompt": {"a": 1}}).param == "prompt"
    assert _err({"prompt": [-1]}).param == "prompt"
    assert _err({"prompt": [2**70]}).param == "prompt"


def test_unknown_fields_are_ignored_as_vllm_does():
    assert _parse({"frobnicate": {"deep": [1, None]}, "metadata": {"k": "v"}}).prompt_text == "x"


# ------------------------------------------------------------------ the gateway's cap


async def test_inflight_cap_answers_429_with_retry_after_before_acceptance(env):  # noqa: F811
    env.set_behaviour(serve_nothing)  # the first request stays in flight
    env.gw.cfg.max_inflight = 1
    before = metrics.sample(metrics.INFLIGHT_REJECTIONS)
    first = asyncio.ensure_future(env.post("/v1/completions", {"prompt": "hi"}).__aenter__())
    req, _ = await asyncio.wait_for(env.backend.requests.get(), 5)
    async with env.post("/v1/completions", {"prompt": "hi", "stream": True}) as r:
        assert r.status == 429 and r.headers["Retry-After"] == "1"
        err = (await r.json())["error"]
    assert err["type"] == "rate_limit_exceeded" and err["code"] == "rate_limit_exceeded"
    assert env.backend.requests.empty()  # refused before it reached the bus
    assert metrics.sample(metrics.INFLIGHT_REJECTIONS) == before + 1
    async with env.http.get(env.base + "/metrics") as r:
        text = await r.text()
    assert "perigee:gateway_requests_in_flight 1.0" in text
    first.cancel()
    await until(lambda: env.gw.inflight == 0)
    env.set_behaviour(
        __import__("tests.unit.gateway.test_gateway_http", fromlist=["serve_ok"]).serve_ok
    )
    async with env.post("/v1/completions", {"prompt": "hi"}) as r:
        assert r.status == 200


# ------------------------------------------------------------------ the vLLM engine wrapper


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_engine_fails_the_request_not_itself():
    from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
    from services.engine.base import EngineError
    from services.engine.vllm.engine import VllmEngine
    from services.engine.vllm.options import VllmOptions

    spec = ModelSpec.from_dir(DEFAULT_MODEL_DIR)
    eng = VllmEngine(
        spec,
        VllmOptions(str(DEFAULT_MODEL_DIR)),
        role="prefill",
        hash_block_size=32,
        block_bytes=spec.block_bytes(32),
    )
    ok = eng._request_params(
        [1, 2, 3], SamplingParams(seed=INT64_MAX, top_k=10**6, temperature=0.5), 1, "k"
    )
    assert ok.seed == INT64_MAX and ok.top_k == spec.vocab_size
    for prompt, s, words in [
        ([1, spec.vocab_size], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(seed=2**70), "seed must be a 64-bit"),
        ([1, 2], SamplingParams(temperature=float("nan")), "temperature"),
    ]:
        with pytest.raises(EngineError, match=words):
            eng._request_params(prompt, s, 1, "k")
    assert eng._dead is None


# ------------------------------------------------------------------ the gateway's own lag


def test_a_stale_sweep_gives_no_death_verdicts_but_still_times_out():
    from services.common.clock import ManualClock
    from services.gateway.watchdog import Watchdog

    clock = ManualClock()
    wd = Watchdog(clock, dead_after_s=2.0, request_timeout_s=10.0)
    wd.track("a")
    wd.accepted("a", "p0", "d0")
    wd.seen("p0")
    wd.seen("d0")
    clock.advance(3.0)  # every instance silent: the gateway may be the one lagging
    assert wd.sweep(judge_liveness=False) == []
    clock.advance(8.0)
    assert [v.code for v in wd.sweep(judge_liveness=False)] == [504]
    wd.track("b")
    wd.accepted("b", "p0", "d0")
    assert [v.message.split()[:3] for v in wd.sweep()] == [["prefill", "instance", "p0"]]


async def test_router_input_is_fresh_only_while_its_echoes_come_back(env):  # noqa: F811
    import time

    router = env.gw.router
    now = time.monotonic()
    router._echo_rx, router._echo_lag = now, 0.01
    assert router.input_fresh(now + 0.9)
    assert not router.input_fresh(now + 1.1)  # dead_after 2 s: half of it passed
    router._echo_lag = 1.5
    assert not router.input_fresh(now)
    # A live echo loop (the env's sweeper is off): published and read back on the bus.
    router._echo_lag = 5.0
    await env.gw.nc.publish(router._echo_subject, repr(time.monotonic()).encode())
    await until(lambda: router._echo_lag < 5.0)
    assert router.input_fresh()


@pytest.mark.parametrize("chat", [False, True])
def test_n_reaches_the_bus_and_best_of_equal_to_n_passes(chat):
    p = _parse({"n": 3, "seed": 5, "best_of": 3}, chat)
    s = p.sampling(8)
    assert (p.n, s.n) == (3, 3)
    assert [s.seq_seed(i) for i in range(3)] == [5, 6, 7]  # vLLM's children: seed + i
    assert _parse({"n": MAX_N, "best_of": None}, chat).sampling(8).n == MAX_N
    assert _parse({}, chat).sampling(8).n == 1


def test_best_of_names_vllms_dropped_field():
    e = _err({"best_of": 4, "n": 2})
    assert (e.param, e.code) == ("best_of", "unsupported_parameter")
    assert "vLLM 0.32 dropped it" in e.message


def test_echo_with_n_is_refused_by_name():
    e = _err({"echo": True, "n": 2})
    assert (e.param, e.code) == ("echo", "unsupported_parameter")
