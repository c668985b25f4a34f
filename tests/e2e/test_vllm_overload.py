"""The default vLLM stack (what ``perigee up`` runs: the default model, its SLOs for
this machine) under a trace slice
replayed faster than it can serve: every request ends either refused before
acceptance (HTTP 429 with Retry-After, no token) or complete with every token it asked
for. No 5xx, no stream cut short, no request left hanging."""

import asyncio
import dataclasses
import math

import pytest

from perigee import models, up
from perigee.natsd import free_port
from perigee.replay import replay
from perigee.stack import Stack, default_slos
from perigee.trace import DEFAULT_TRACE, PromptBuilder, load_trace, spread_ties
from services.common.model_spec import ModelSpec

pytestmark = pytest.mark.e2e

REQUESTS = 40
SPEEDUP = 4.0  # ~12 requests/s of 100-5000-token prompts: far above what 2 cores serve
MAX_OUTPUT = 8


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    try:
        cfg = up.parse(
            [
                "--engine",
                "vllm",
                "--port",
                str(free_port()),
                "--log-dir",
                str(tmp_path_factory.mktemp("logs-vllm-overload")),
            ]
        )
    except SystemExit:
        pytest.skip(f"the default model is not prepared: {models.FIX}")
    s = Stack(
        dataclasses.replace(
            cfg, extra_env={"PERIGEE_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}
        )
    )
    s.start()
    yield s
    s.stop()


async def test_overload_is_refused_before_acceptance_and_the_rest_is_served(vllm_stack):
    s = vllm_stack
    spec = ModelSpec.from_dir(s.cfg.model_dir)
    assert s.cfg.served_model_name == models.DEFAULT_MODEL_NAME
    assert (s.cfg.ttft_slo, s.cfg.tbt_slo) == default_slos("vllm")
    reqs = spread_ties(load_trace(DEFAULT_TRACE, REQUESTS))
    outs, _ = await asyncio.wait_for(
        replay(
            reqs,
            s.url,
            speedup=SPEEDUP,
            builder=PromptBuilder(32, spec.vocab_size),
            model=s.cfg.served_model_name,
            output_scale=1.0,
            max_output=MAX_OUTPUT,
            api_key=None,
            progress=False,
        ),
        600,
    )
    refused = [o for o in outs if o.status == 429]
    served = [o for o in outs if o.status == 200]
    assert len(refused) + len(served) == REQUESTS, [(o.status, o.error) for o in outs]
    # refused before acceptance: no token ever streamed
    assert all(o.tokens_seen == 0 and math.isnan(o.ttft_s) for o in refused)
    # accepted: complete, with every token asked for
    assert not [o for o in served if o.cut], [(o.error, o.completion_tokens) for o in served]
    assert all(o.ok and o.completion_tokens == o.expected_tokens for o in served)
    assert served, "nothing was served"
    assert not s.exited()
