"""The vLLM engine thread's bookkeeping after a step: a slow step is logged and counted
(no vLLM needed: the step's outputs are stand-ins)."""

from types import SimpleNamespace

import pytest
from structlog.testing import capture_logs

from services.common.model_spec import ModelSpec
from services.engine.vllm import engine as vllm_engine
from services.engine.vllm.engine import SLOW_STEP_CPU_S, SLOW_STEP_S, VllmEngine
from services.engine.vllm.options import VllmOptions

SPEC = ModelSpec(
    name="t", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16,
    vocab_size=100, max_model_len=256,
)  # fmt: skip


@pytest.fixture
def engine(monkeypatch, tmp_path) -> VllmEngine:
    monkeypatch.setattr(vllm_engine, "prepare_env", lambda: None)
    e = VllmEngine(
        SPEC, VllmOptions(model_dir=str(tmp_path)), role="decode", hash_block_size=32,
        block_bytes=2 * 2 * 4 * 16 * 4 * 32,
    )  # fmt: skip
    posted: list = []
    monkeypatch.setattr(e, "_post", lambda fn, *args: posted.append((fn, args)))
    return e


def _out(rid: str) -> SimpleNamespace:
    comp = SimpleNamespace(token_ids=[7], logprobs=None, finish_reason=None)
    return SimpleNamespace(
        request_id=rid, outputs=[comp], prompt_logprobs=None, finished=False,
        num_cached_tokens=0,
    )  # fmt: skip


def test_a_slow_step_is_logged_with_its_requests_and_counted(engine):
    outs = [_out(f"req-{i}") for i in range(10)]
    with capture_logs() as logs:
        engine._after_step(None, outs, SLOW_STEP_S + 11.5)
    [slow] = [e for e in logs if e["event"] == "vllm_step_slow"]
    assert slow["role"] == "decode"
    assert slow["seconds"] == round(SLOW_STEP_S + 11.5, 3)
    assert slow["outputs"] == 10
    assert slow["request_ids"] == [f"req-{i}" for i in range(8)]  # at most 8 named
    assert engine.counters["vllm_slow_steps"] == 1
    assert engine.counters["vllm_steps"] == 1


def test_a_step_under_the_bound_is_not_logged(engine):
    with capture_logs() as logs:
        engine._after_step(None, [_out("a")], SLOW_STEP_S / 10)
    assert not [e for e in logs if e["event"] == "vllm_step_slow"]
    assert engine.counters["vllm_slow_steps"] == 0
    assert engine.counters["vllm_steps"] == 1


def test_on_cpu_the_bound_is_a_long_prompts_step_not_a_gpus(engine):
    engine.slow_step_s = SLOW_STEP_CPU_S  # what the engine thread sets on vLLM's CPU platform
    with capture_logs() as logs:
        engine._after_step(None, [_out("a")], SLOW_STEP_S * 5)  # a 2k-token prefill on CPU
        engine._after_step(None, [_out("a")], SLOW_STEP_CPU_S + 1)
    assert len([e for e in logs if e["event"] == "vllm_step_slow"]) == 1
    assert engine.counters["vllm_slow_steps"] == 1
