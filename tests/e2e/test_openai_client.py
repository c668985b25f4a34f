"""The official ``openai`` Python client against the gateway of a real stack:
completions, chat, streaming, usage (cached tokens included), and API keys."""

import aiohttp
import openai
import pytest

from services.common.hashing import block_hashes
from services.common.tokenizer import Tokenizer
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import KVEventWatcher

pytestmark = pytest.mark.e2e

MODEL = "tiny-llama"
NO_EOS = {"ignore_eos": True}  # vLLM's extension, through extra_body
LONG = " ".join(
    f"Section {i}: the client shares this preamble with every request." for i in range(40)
)


def client(url: str, key: str = "no-key-needed") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


async def test_models_and_completion(stack):
    async with client(stack.url) as c:
        models = await c.models.list()
        assert [m.id for m in models.data] == [MODEL]
        r = await c.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, extra_body=NO_EOS
        )
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].text, str)
    u = r.usage
    assert u.completion_tokens == 6 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + 6
    assert u.prompt_tokens_details.cached_tokens == 0


async def test_chat_completion(stack):
    async with client(stack.url) as c:
        r = await c.chat.completions.create(
            model=MODEL,
            max_completion_tokens=5,
            extra_body=NO_EOS,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello."},
            ],
        )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


async def test_streaming_completion_and_chat_with_usage(stack):
    async with client(stack.url) as c:
        chunks = [
            ch
            async for ch in await c.completions.create(
                model=MODEL,
                prompt="Stream me",
                max_tokens=7,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_EOS,
            )
        ]
        text_chunks = [ch for ch in chunks if ch.choices]
        assert all(ch.object == "text_completion" for ch in chunks)
        assert text_chunks[-1].choices[0].finish_reason == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7

        chat = [
            ch
            async for ch in await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Stream a chat"}],
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body=NO_EOS,
            )
        ]
    assert chat[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chat)
    assert [ch.choices[0].finish_reason for ch in chat if ch.choices][-1] == "length"
    assert chat[-1].usage.completion_tokens == 4
    assert chat[-1].usage.prompt_tokens_details.cached_tokens == 0


async def test_usage_reports_cached_prefix_tokens(stack):
    tok = Tokenizer.from_dir(stack.cfg.model_dir)
    first, second = LONG + " First: what is cached?", LONG + " Second: and now?"
    shared = block_hashes(tok.encode(first), stack.cfg.block_size)
    watcher = await KVEventWatcher().start(stack.nats_url)
    try:
        async with client(stack.url) as c:
            r1 = await c.completions.create(
                model=MODEL, prompt=first, max_tokens=2, extra_body=NO_EOS
            )
            assert r1.usage.prompt_tokens_details.cached_tokens == 0
            await watcher.wait_for(shared[:-1])  # the prefill node committed the prefix
            r2 = await c.completions.create(
                model=MODEL, prompt=second, max_tokens=2, extra_body=NO_EOS
            )
    finally:
        await watcher.close()
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % stack.cfg.block_size == 0
    assert cached < r2.usage.prompt_tokens


@pytest.fixture(scope="module")
def keyed_stack(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "keyed",
        engine="mock",
        prefill=1,
        decode=1,
        speedup="100",
        api_key="sk-perigee-1,sk-perigee-2",
    )
    s.start()
    yield s
    s.stop()


async def test_api_key_required_and_accepted(keyed_stack):
    url = keyed_stack.url
    for key in ("sk-perigee-1", "sk-perigee-2"):
        async with client(url, key) as c:
            r = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                extra_body=NO_EOS,
            )
        assert r.usage.completion_tokens == 3
    async with client(url, "sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            await c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert e.value.status_code == 401
    assert e.value.code == "invalid_api_key"
    assert e.value.body["type"] == "invalid_request_error"
    async with client(url, "sk-wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.models.list()


async def test_no_key_is_401_health_stays_open(keyed_stack):
    url = keyed_stack.url
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            err = (await r.json())["error"]
        async with http.get(url + "/health") as r:
            assert r.status == 200
    assert (err["type"], err["code"], err["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
