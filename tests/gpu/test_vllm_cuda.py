"""vLLM on CUDA through the whole stack: SmolLM2-135M-Instruct, 1 prefill + 1 decode on
one GPU (the two engines split its memory: perigee.gpus), asked through the gateway
with the ``openai`` client, against one monolithic vLLM engine on the same GPU.

- greedy answers equal the monolithic engine's, token for token (the KV crossed from
  the prefill engine's CUDA pages into the store's arena and into the decode engine's);
- prefix reuse through the store: the second request on a long shared system message
  loads its full blocks from the store (``cached_tokens``) and still answers exactly;
- the engines got their card and share, and the connector page-locked the arena;
- where there are two GPUs, prefill on one and decode on the other.

Migration with the KV on CUDA is tests/e2e/test_real_model_migration.py, which
``make test-gpu`` runs on the CUDA build too (as test_real_model.py)."""

import pytest

from tests.gpu.helpers import gpus, vllm_cuda_missing

if vllm_cuda_missing() is not None:  # before the imports that need vLLM's and openai's packages
    pytest.skip(vllm_cuda_missing() or "", allow_module_level=True)

import os  # noqa: E402

from perigee import models  # noqa: E402
from services.engine.vllm.options import has_weights  # noqa: E402
from services.engine.vllm.reference import Reference  # noqa: E402
from tests.e2e import test_real_model as real_model  # noqa: E402
from tests.e2e.conftest import make_stack  # noqa: E402
from tests.e2e.helpers import chat_ids, worker_stats  # noqa: E402
from tests.e2e.test_real_model import CHATS, EOS, LONG, MAX_TOKENS, check, client  # noqa: E402

BS = 32
pytestmark = [pytest.mark.gpu, pytest.mark.e2e, pytest.mark.timeout(900)]
# PERIGEE_GPU_TEST_MODEL: another model for these tests, as perigee up's --model takes it,
# where the default one cannot be prepared (scripts/gpu_run.sh then writes a seeded
# random checkpoint of tiny-llama: scripts/make_random_weights.py).
try:
    _model = models.resolve(os.environ.get("PERIGEE_GPU_TEST_MODEL") or None)
except models.ModelNotReady as e:
    pytest.skip(str(e), allow_module_level=True)
MODEL_DIR, NAME = _model.path, _model.name
# Weights of its own (the default model, a seeded random checkpoint): prompt-dependent
# answers. vLLM's dummy weights (tiny-llama as shipped) answer alike whatever the prompt.
WEIGHTS = has_weights(MODEL_DIR)


@pytest.fixture(scope="module")
def tokenized():
    """transformers' tokenizer of the model, and each chat's prompt ids by it."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    return hf, chat_ids(hf, {**CHATS, **LONG})


async def ask(c, messages: list[dict], stream: bool = False):
    """One greedy chat request to this module's model (test_real_model's)."""
    return await real_model.ask(c, messages, stream, model=NAME)


def expected_of(ref: Reference, names: list[str]) -> dict[str, list[int]]:
    out = {}
    for k, r in zip(names, ref.result()["results"], strict=True):
        toks = r["tokens"]
        out[k] = toks[: toks.index(EOS) + 1] if EOS in toks else toks
    return out


def reference(prompts: dict, names: list[str], workdir) -> Reference:
    return Reference(
        {
            "model_dir": str(MODEL_DIR),
            "prefix_caching": False,
            "max_model_len": 8192,
            "requests": [{"prompt": prompts[k], "max_tokens": MAX_TOKENS} for k in names],
        },
        workdir,
    ).start()


def cuda_stack(tmp_path_factory, name: str, cards: str):
    return make_stack(
        tmp_path_factory,
        name,
        engine="vllm",
        prefill=1,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        store_capacity_blocks=512,
        extra_env={
            "CUDA_VISIBLE_DEVICES": cards,
            "PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp(f"cache-{name}")),
        },
    )


@pytest.fixture(scope="module")
def one_gpu(tokenized, tmp_path_factory):
    prompts = tokenized[1]
    names = list(prompts)
    ref = reference(prompts, names, tmp_path_factory.mktemp("reference"))
    s = cuda_stack(tmp_path_factory, "cuda1", "0")
    try:
        s.start()
        yield s, expected_of(ref, names)
    finally:
        ref.kill()
        s.stop()


async def test_greedy_answers_equal_monolithic_vllm_on_cuda(one_gpu, tokenized):
    (s, expected), (hf, prompts) = one_gpu, tokenized
    async with client(s.url) as c:
        got = {name: await ask(c, m, stream=name != "france") for name, m in CHATS.items()}
    if WEIGHTS:
        assert len({tuple(expected[k]) for k in CHATS}) == len(CHATS)
    for name, g in got.items():
        check(hf, name, g, expected[name], prompts[name])
    decode = await worker_stats(s.nats_url, "decode", "decode-0")
    assert decode["connector_tokens_loaded"] > 0  # the prompt's KV came through the store


async def test_prefix_reuse_through_the_store_on_cuda(one_gpu, tokenized):
    (s, expected), (hf, prompts) = one_gpu, tokenized
    first, local = prompts["first"], prompts["local"]
    shared = next(i for i, (a, b) in enumerate(zip(first, local, strict=False)) if a != b)
    shared = shared // BS * BS
    assert shared >= 30 * BS
    async with client(s.url) as c:
        r_first = await ask(c, LONG["first"])
        r_local = await ask(c, LONG["local"], stream=True)
    check(hf, "first", r_first, expected["first"], first)
    check(hf, "local", r_local, expected["local"], local)
    assert r_local[2].prompt_tokens_details.cached_tokens == shared
    prefill = await worker_stats(s.nats_url, "prefill", "prefill-0")
    assert prefill["connector_tokens_loaded"] >= shared


async def test_engines_share_the_card_and_the_arena_is_pinned(one_gpu):
    s, _ = one_gpu
    workers = [c for c in s.children.values() if c.name.startswith(("prefill", "decode"))]
    assert len(workers) == 2
    for c in workers:
        assert c.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert c.argv[c.argv.index("--gpu-memory-utilization") + 1] == "0.4"
    log = (s.cfg.log_dir + "/prefill-0.log", s.cfg.log_dir + "/decode-0.log")
    for path in log:
        with open(path) as f:
            assert "arena_pinned" in f.read(), path


async def test_prefill_and_decode_on_two_gpus(tokenized, tmp_path_factory):
    hf, prompts = tokenized
    if gpus() < 2:
        pytest.skip("one GPU: prefill and decode on two need two")
    ref = reference(prompts, ["france"], tmp_path_factory.mktemp("reference2"))
    s = cuda_stack(tmp_path_factory, "cuda2", "0,1")
    try:
        s.start()
        expected = expected_of(ref, ["france"])
        cards = {c.name: c.env["CUDA_VISIBLE_DEVICES"] for c in s.children.values()}
        assert (cards["prefill-0"], cards["decode-0"]) == ("0", "1")
        async with client(s.url) as c:
            got = await ask(c, CHATS["france"], stream=True)
        check(hf, "france", got, expected["france"], prompts["france"])
    finally:
        ref.kill()
        s.stop()
