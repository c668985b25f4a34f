"""The whole request path on a real bus: gateway -> admission -> conductor -> prefill
-> store -> decode, all real processes."""

import aiohttp
import pytest

from services.common.hashing import block_hashes
from services.common.tokenizer import Tokenizer
from tests.e2e.helpers import KVEventWatcher, worker_stats
from tests.e2e.sse import post, stream

pytestmark = pytest.mark.e2e

LONG = " ".join(f"paragraph {i} of a long shared system prompt about KV caches." for i in range(60))


async def test_streaming_completion_openai_shape(stack):
    async with aiohttp.ClientSession() as s:
        r = await stream(
            s,
            stack.url,
            {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True},
        )
    assert r.status == 200, r.error
    assert r.done and r.error is None
    assert all(c["object"] == "text_completion" for c in r.chunks)
    assert r.usage["completion_tokens"] == 8
    assert r.usage["prompt_tokens"] > 0
    assert "cached_tokens" in r.usage["prompt_tokens_details"]


async def test_chat_non_streaming(stack):
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(
            s,
            stack.url,
            {
                "model": "tiny-llama",
                "max_tokens": 5,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
            path="/v1/chat/completions",
        )
    assert status == 200, body
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] == 5


async def test_prefix_reuse_reads_blocks_from_store(stack):
    tok = Tokenizer.from_dir(stack.cfg.model_dir)
    first = LONG + " First question: what is a block?"
    second = LONG + " Second question: why cache?"
    ids = tok.encode(first)
    shared = block_hashes(ids, stack.cfg.block_size)
    watcher = await KVEventWatcher().start(stack.nats_url)
    before = await worker_stats(stack.nats_url, "prefill", "prefill-0")
    try:
        async with aiohttp.ClientSession() as s:
            r1 = await stream(s, stack.url, {"prompt": first, "max_tokens": 4, "ignore_eos": True})
            assert r1.status == 200 and r1.done, r1.error
            assert r1.usage["prompt_tokens_details"]["cached_tokens"] == 0
            # The prefill node commits the blocks once the first token is out; wait for it.
            await watcher.wait_for(shared[:-1])
            r2 = await stream(s, stack.url, {"prompt": second, "max_tokens": 4, "ignore_eos": True})
    finally:
        await watcher.close()
    assert r2.status == 200 and r2.done, r2.error
    cached = r2.usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % stack.cfg.block_size == 0
    after = await worker_stats(stack.nats_url, "prefill", "prefill-0")
    assert after["prefix_tokens_loaded"] - before.get("prefix_tokens_loaded", 0) == cached


async def test_malformed_body_is_400_and_stack_keeps_serving(stack):
    async with aiohttp.ClientSession() as s:
        status, _, body = await post(s, stack.url, b'{"prompt": "unterminated')
        assert status == 400
        assert body["error"]["type"] == "invalid_request_error"
        status, _, body = await post(s, stack.url, {"prompt": 42})
        assert status == 400
        r = await stream(
            s, stack.url, {"prompt": "still alive?", "max_tokens": 2, "ignore_eos": True}
        )
    assert r.status == 200 and r.done
    assert not stack.exited()
