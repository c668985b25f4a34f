"""Plan.skip_draws: a decode request going on from prefill's first token starts its
seeded generator one sampling step on, so its k-th token uses the seed's k-th draw as
in one engine. Checked against vLLM's own CPU sampler (TopKTopPSampler.forward_cpu)."""

import importlib.util

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch  # noqa: E402

from services.engine.vllm.bridge import Bridge, skip_draws  # noqa: E402

V = 64


def _sample(gen: torch.Generator, logits: torch.Tensor) -> int:
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    out, _ = TopKTopPSampler().forward(logits.clone(), {0: gen}, None, None)
    return int(out[0])


def test_a_skipped_draw_is_one_sampling_step_of_vllms_sampler():
    torch.manual_seed(0)
    steps = [torch.randn(1, V) for _ in range(6)]
    one = torch.Generator().manual_seed(1234)
    engine = [_sample(one, x) for x in steps]  # one engine samples all six
    gens = {"r": torch.Generator().manual_seed(1234)}
    b = Bridge(block_bytes=1, hash_block_size=1)
    b.generator_of, b.vocab_size = gens.get, V
    assert skip_draws(b, "r", 1)
    # decode's generator, one draw on, samples steps 1.. as the engine did
    assert [_sample(gens["r"], x) for x in steps[1:]] == engine[1:]
    fresh = torch.Generator().manual_seed(1234)
    assert [_sample(fresh, x) for x in steps[1:]] != engine[1:]  # without the skip


def test_no_generator_no_skip():
    b = Bridge(block_bytes=1, hash_block_size=1)
    assert not skip_draws(b, "r", 1)
    b.generator_of = {}.get
    assert not skip_draws(b, "r", 1)
