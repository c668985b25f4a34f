"""The vLLM backend's plain-Python pieces (no vLLM import): options, environment, the
engine <-> connector bridge, the seeded checkpoint, make_engine's wiring."""

import argparse
import importlib.util
import os

import pytest

from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.engine import make_engine
from services.engine.vllm import bridge, options


def test_prepare_env_forces_in_process_and_keeps_user_choices(monkeypatch):
    for k in (*options.FORCED_ENV, *options.DEFAULT_ENV):  # undone after the test
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    options.prepare_env()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"  # set by the user: kept
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_load_format_follows_the_model_directory(tmp_path):
    assert options.VllmOptions(str(DEFAULT_MODEL_DIR)).resolved_load_format() == "dummy"
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert options.VllmOptions(str(tmp_path)).resolved_load_format() == "auto"
    assert options.VllmOptions(str(tmp_path), load_format="dummy").resolved_load_format() == "dummy"


def test_vllm_block_size_defaults_to_32_when_it_divides():
    o = options.VllmOptions("m")
    assert o.vllm_block_size(32) == 32
    assert o.vllm_block_size(64) == 32
    assert o.vllm_block_size(16) == 16
    assert options.VllmOptions("m", block_size=16).vllm_block_size(64) == 16


def test_service_flags_build_the_options():
    p = argparse.ArgumentParser()
    options.add_arguments(p)
    a = p.parse_args(
        [
            "--load-format",
            "dummy",
            "--kv-blocks",
            "300",
            "--vllm-block-size",
            "16",
            "--max-model-len",
            "4096",
        ]
    )
    o = options.from_args(a, "/models/x")
    assert o == options.VllmOptions(
        "/models/x", load_format="dummy", kv_blocks=300, block_size=16, max_model_len=4096
    )


def test_make_engine_vllm_checks_block_sizes_without_starting_vllm():
    spec = ModelSpec.from_dir(DEFAULT_MODEL_DIR)
    cost = CostModel.llama3_70b_a800()
    eng = make_engine(
        "vllm",
        spec,
        cost,
        role="prefill",
        layout=KVLayout(spec, 64),
        vllm=options.VllmOptions(str(DEFAULT_MODEL_DIR)),
    )
    assert eng.vllm_block_size == 32 and eng.hash_block_size == 64
    assert eng.bridge.block_bytes == spec.block_bytes(64)
    with pytest.raises(ValueError, match="must divide"):
        make_engine(
            "vllm",
            spec,
            cost,
            layout=KVLayout(spec, 48),
            vllm=options.VllmOptions(str(DEFAULT_MODEL_DIR), block_size=32),
        )
    with pytest.raises(ValueError, match="role"):
        make_engine("vllm", spec, cost, role="both")


def test_bridge_registry_and_plans():
    b = bridge.Bridge(block_bytes=1024, hash_block_size=32)
    key = bridge.register(b)
    try:
        assert bridge.lookup(key) is b
        b.add(bridge.Plan(key="r1", slots=[]))
        with pytest.raises(ValueError, match="exists"):
            b.add(bridge.Plan(key="r1", slots=[]))
        assert b.get("r1") is not None and b.get(None) is None
        assert b.drop("r1") is not None and b.get("r1") is None
    finally:
        bridge.unregister(key)
    with pytest.raises(ValueError, match="registry_key"):
        bridge.lookup(key)
    assert bridge.request_key({"perigee": {"key": "k"}}) == "k"
    assert bridge.request_key(None) is None
    assert bridge.request_key({"other": 1}) is None


@pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None, reason="safetensors comes with vLLM"
)
def test_random_checkpoint_is_byte_identical_for_a_seed(tmp_path):
    from services.engine.vllm.weights import write_random_checkpoint

    a = write_random_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "a", seed=3)
    b = write_random_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "b", seed=3)
    c = write_random_checkpoint(DEFAULT_MODEL_DIR, tmp_path / "c", seed=4)
    wa, wb, wc = ((d / "model.safetensors").read_bytes() for d in (a, b, c))
    assert wa == wb and wa != wc
    assert (a / "config.json").read_text() == (DEFAULT_MODEL_DIR / "config.json").read_text()
    assert options.has_weights(a)
