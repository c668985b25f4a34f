"""vLLM's sampling extensions and logprobs through perigee on the real model (issue 25),
asked with the official ``openai`` client, each compared with one monolithic vLLM engine
(:mod:`services.engine.vllm.reference`) given the same token ids and parameters:

- ``logprobs``/``top_logprobs`` (chat, streamed and not) and completions' ``logprobs``:
  the first token's (sampled on prefill) and every later one's (decode) equal vLLM's
  within float tolerance;
- completions ``echo`` + ``logprobs`` (what lm-eval's ``local-completions`` sends): the
  prompt's logprobs equal vLLM's ``prompt_logprobs``, even when the prompt's blocks
  are cached in the store (prefill then recomputes them);
- ``min_tokens`` with ``logit_bias`` pushing EOS: both roles hold EOS back until the
  count, then it comes (prefill samples the first token, decode the rest);
- ``allowed_token_ids`` and ``bad_words`` (tokenized by the gateway as vLLM's
  ``update_from_tokenizer`` does): the same tokens as vLLM;
- ``include_stop_str_in_output``, ``skip_special_tokens`` (the gateway's detokenizer);
- ``/tokenize`` equals transformers' tokenization; ``/v1/models`` its max length.

One stack (1 prefill + 1 decode, vLLM) and one reference for the module.
"""

import math

import aiohttp
import openai
import pytest

from perigee import models
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import real_model_marks

MODEL_DIR = models.default_model_dir()
pytestmark = real_model_marks()

NAME = models.DEFAULT_MODEL_NAME
EOS = 2  # <|im_end|>
TOL = 2e-3  # float32 on both sides; prefill/decode batch shapes differ from vLLM's
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
    "small lantern and a notebook in which he recorded the ships that passed the rocky "
    "point, the colour of the sky, and the direction of the wind over the grey water."
)
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(MODEL_DIR))


def _bad_words(hf, words: list[str]) -> list[list[int]]:
    """vLLM's own tokenization of bad words (SamplingParams.update_from_tokenizer)."""
    from vllm import SamplingParams

    class Tok:
        max_token_id = len(hf) - 1

        @staticmethod
        def encode(text: str, add_special_tokens: bool = False) -> list[int]:
            return hf.encode(text, add_special_tokens=add_special_tokens)

    p = SamplingParams(bad_words=words)
    p.update_from_tokenizer(Tok())  # type: ignore[arg-type]
    return p.bad_words_token_ids


@pytest.fixture(scope="module")
def cases(hf):
    france = hf.apply_chat_template(
        FRANCE, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    story = hf.encode(STORY)
    allowed = hf.encode(" the sea and sky", add_special_tokens=False)
    return {
        "chat_lp": (france, 8, {"logprobs": 3}),
        "story_lp": (story, 6, {"logprobs": 2}),
        "echo": (story, 1, {"logprobs": 1, "prompt_logprobs": 1}),
        "min_tokens": (
            france,
            10,
            {"min_tokens": 3, "logit_bias": {EOS: 30.0}, "stop_token_ids": [EOS]},
        ),
        "allowed": (story, 6, {"allowed_token_ids": allowed}),
        "plain": (france, 10, {"stop_token_ids": [EOS]}),
        "bad_words": (
            france,
            10,
            {"stop_token_ids": [EOS], "bad_words_token_ids": _bad_words(hf, ["Paris"])},
        ),
    }


@pytest.fixture(scope="module")
def real_env(cases, tmp_path_factory):
    from services.engine.vllm.reference import Reference

    names = list(cases)
    ref = Reference(
        {
            "model_dir": str(MODEL_DIR),
            "prefix_caching": False,
            "max_model_len": 8192,
            "requests": [
                {"prompt": cases[k][0], "max_tokens": cases[k][1], "sampling": cases[k][2]}
                for k in names
            ],
        },
        tmp_path_factory.mktemp("reference"),
    ).start()
    s = make_stack(
        tmp_path_factory,
        "api-real",
        engine="vllm",
        prefill=1,
        decode=1,
        model_dir=str(MODEL_DIR),
        served_model_name=NAME,
        speedup="0.1",
        tbt_slo=1.0,
        store_capacity_blocks=512,
        extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))},
    )
    try:
        s.start()
        results = dict(zip(names, ref.result()["results"], strict=True))
        yield s, results
    finally:
        ref.kill()
        s.stop()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=TOL)


def _top_values(position: list, k: int) -> list[float]:
    """The k largest logprobs vLLM reported at a position (ties in rank order)."""
    return sorted((lp for _, lp in position), reverse=True)[:k]


def _check_position(got_lp: float, got_top: list[float], ref_pos: list, token: int, k: int):
    ref = dict((t, lp) for t, lp in ref_pos)
    assert _close(got_lp, ref[token]), (got_lp, ref[token])
    want = _top_values(ref_pos, k)
    assert len(got_top) == len(want)
    assert all(_close(a, b) for a, b in zip(sorted(got_top, reverse=True), want, strict=True))


async def test_chat_logprobs_equal_vllm_streamed_and_not(real_env, hf):
    s, ref = real_env
    r = ref["chat_lp"]
    assert len(r["logprobs"]) == len(r["tokens"]) == 8
    async with client(s.url) as c:
        out = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            extra_body=NO_EOS,
        )
        content = out.choices[0].logprobs.content
        streamed = []
        async for ch in await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            extra_body=NO_EOS,
        ):
            if ch.choices and ch.choices[0].logprobs:
                streamed += ch.choices[0].logprobs.content
    assert out.choices[0].message.content == hf.decode(r["tokens"], skip_special_tokens=True)
    for got in (content, streamed):
        assert len(got) == 8  # the first token's (prefill) and the 7 decode made
        for i, e in enumerate(got):
            assert e.token == hf.decode([r["tokens"][i]])
            _check_position(
                e.logprob, [t.logprob for t in e.top_logprobs], r["logprobs"][i], r["tokens"][i], 3
            )


async def test_completion_logprobs_equal_vllm(real_env, hf):
    s, ref = real_env
    r = ref["story_lp"]
    async with client(s.url) as c:
        out = await c.completions.create(
            model=NAME,
            prompt=ref_prompt(hf),
            temperature=0,
            max_tokens=6,
            logprobs=2,
            extra_body=NO_EOS,
        )
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == 6
    for i in range(6):
        # completions: the token's own entry plus the 2 most likely (up to 3 strings)
        _check_position(lp.token_logprobs[i], [], r["logprobs"][i], r["tokens"][i], 0)
        assert len(lp.top_logprobs[i]) <= 3
        assert max(lp.top_logprobs[i].values()) == pytest.approx(
            _top_values(r["logprobs"][i], 1)[0], abs=TOL
        )


def ref_prompt(hf) -> list[int]:
    return hf.encode(STORY)


async def test_echo_prompt_logprobs_equal_vllm_also_when_cached(real_env, hf):
    """lm-eval's loglikelihood request; the second time the prompt's blocks are in the
    store, and prefill must still score every prompt position."""
    s, ref = real_env
    r = ref["echo"]
    prompt = ref_prompt(hf)
    assert len(prompt) >= 32  # at least one full block to cache
    async with client(s.url) as c:
        for attempt in range(2):
            out = await c.completions.create(
                model=NAME,
                prompt=prompt,
                temperature=0,
                max_tokens=1,
                logprobs=1,
                echo=True,
                extra_body=NO_EOS,
            )
            ch = out.choices[0]
            assert ch.text.startswith(hf.decode(prompt))
            lp = ch.logprobs
            assert len(lp.token_logprobs) == len(prompt) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for i in range(1, len(prompt)):
                _check_position(lp.token_logprobs[i], [], r["prompt_logprobs"][i], prompt[i], 0)
            _check_position(lp.token_logprobs[-1], [], r["logprobs"][0], r["tokens"][0], 0)
            if attempt == 1:
                assert out.usage.prompt_tokens_details.cached_tokens >= 32, attempt


async def test_min_tokens_and_logit_bias_on_both_roles(real_env, hf):
    s, ref = real_env
    want = ref["min_tokens"]["tokens"]
    # the bias makes EOS the greedy choice at once; min_tokens holds it back for 3 tokens
    # (the first sampled on prefill), then it ends the answer
    assert EOS not in want[:3] and want[3] == EOS and len(want) == 4
    async with client(s.url) as c:
        out = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=10,
            extra_body={"min_tokens": 3, "logit_bias": {str(EOS): 30.0}},
        )
    assert out.choices[0].message.content == hf.decode(want, skip_special_tokens=True)
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 4


async def test_allowed_token_ids_and_bad_words_equal_vllm(real_env, hf):
    s, ref = real_env
    allowed = hf.encode(" the sea and sky", add_special_tokens=False)
    async with client(s.url) as c:
        a = await c.completions.create(
            model=NAME,
            prompt=ref_prompt(hf),
            temperature=0,
            max_tokens=6,
            extra_body={"allowed_token_ids": allowed, **NO_EOS},
        )
        b = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=10,
            extra_body={"bad_words": ["Paris"]},
        )
    assert set(ref["allowed"]["tokens"]) <= set(allowed)
    assert a.choices[0].text == hf.decode(ref["allowed"]["tokens"])
    plain = hf.decode(ref["plain"]["tokens"], skip_special_tokens=True)
    banned = hf.decode(ref["bad_words"]["tokens"], skip_special_tokens=True)
    assert "Paris" in plain and banned != plain  # the ban changed vLLM's answer
    assert b.choices[0].message.content == banned


async def test_stop_string_kept_and_special_tokens_shown(real_env, hf):
    s, ref = real_env
    plain = ref["plain"]["tokens"]
    through = ref["chat_lp"]["tokens"]  # ignore_eos: <|im_end|> is text, not the end
    assert plain[-1] == EOS and EOS in through
    async with client(s.url) as c:
        kept = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=10,
            stop=["Paris"],
            extra_body={"include_stop_str_in_output": True},
        )
        ended = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=10,
            extra_body={"skip_special_tokens": False},
        )
        shown = await c.chat.completions.create(
            model=NAME,
            messages=FRANCE,
            temperature=0,
            max_tokens=8,
            extra_body={"skip_special_tokens": False, **NO_EOS},
        )
    text = hf.decode(plain, skip_special_tokens=True)
    assert kept.choices[0].message.content == text[: text.index("Paris") + len("Paris")]
    # as vLLM: the token that ended the answer is not text, special tokens inside it are
    assert ended.choices[0].message.content == hf.decode(plain[:-1], skip_special_tokens=False)
    assert shown.choices[0].message.content == hf.decode(through, skip_special_tokens=False)
    assert "<|im_end|>" in shown.choices[0].message.content


async def test_tokenize_detokenize_and_models(real_env, hf):
    s, _ = real_env
    async with aiohttp.ClientSession() as http:
        async with http.post(s.url + "/tokenize", json={"prompt": STORY}) as r:
            tok = await r.json()
        async with http.post(s.url + "/tokenize", json={"messages": FRANCE}) as r:
            chat = await r.json()
        async with http.post(s.url + "/detokenize", json={"tokens": tok["tokens"]}) as r:
            text = await r.json()
        async with http.get(s.url + "/v1/models") as r:
            card = (await r.json())["data"][0]
    assert tok["tokens"] == hf.encode(STORY) and tok["count"] == len(tok["tokens"])
    want = hf.apply_chat_template(
        FRANCE, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert chat["tokens"] == want
    assert text["prompt"] == hf.decode(tok["tokens"])
    assert card["max_model_len"] == tok["max_model_len"] > 0
