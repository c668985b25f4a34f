"""perigee settings -> vLLM's EngineArgs: the decode cache counted out on CPU only, and
synchronous scheduling on every platform."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

from services.engine.vllm import args  # noqa: E402
from services.engine.vllm.args import engine_args  # noqa: E402
from services.engine.vllm.options import VllmOptions  # noqa: E402


def _args(monkeypatch, tmp_path, *, cpu: bool, role: str, **opts):
    monkeypatch.setattr(args, "on_cpu", lambda: cpu)
    return engine_args(
        VllmOptions(model_dir=str(tmp_path), **opts),
        role=role,
        dtype="float32",
        block_size=32,
        max_model_len=8192,
        max_batch=64,
        registry_key="k",
    )


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_scheduling_is_synchronous_on_every_platform(monkeypatch, tmp_path, cpu, role):
    assert _args(monkeypatch, tmp_path, cpu=cpu, role=role).async_scheduling is False


def test_the_decode_cache_is_counted_out_on_cpu_and_sized_by_memory_on_a_gpu(monkeypatch, tmp_path):
    per_seq = 8192 // 32 + 1
    cpu = _args(monkeypatch, tmp_path, cpu=True, role="decode")
    assert cpu.num_gpu_blocks_override == max(2 * per_seq, 1024)
    gpu = _args(monkeypatch, tmp_path, cpu=False, role="decode", gpu_memory_utilization=0.4)
    assert gpu.num_gpu_blocks_override is None and gpu.gpu_memory_utilization == 0.4
    # A count the operator set holds on both.
    assert (
        _args(monkeypatch, tmp_path, cpu=False, role="decode", kv_blocks=77).num_gpu_blocks_override
        == 77
    )
    # Prefill holds two prompts at most, on either.
    for on_cpu in (True, False):
        pf = _args(monkeypatch, tmp_path, cpu=on_cpu, role="prefill")
        assert pf.num_gpu_blocks_override == 2 * per_seq and pf.max_num_seqs == 2
