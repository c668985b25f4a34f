"""``n`` > 1 through the whole stack with the mock engine (what scale tests and benches
run): the gateway, admission, conductor, a prefill and a decode worker, real NATS and
stores. The mock ignores seeds but gives each sequence its own synthetic answer."""

import openai

from tests.e2e.helpers import worker_stats


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)


async def test_n3_through_the_mock_stack(stack):
    before = await worker_stats(stack.nats_url, "decode", "decode-0")
    prompt = "A prompt for three answers from the mock engine " * 3
    async with client(stack.url) as c:
        model = (await c.models.list()).data[0].id
        out = await c.completions.create(
            model=model,
            prompt=prompt,
            n=3,
            max_tokens=10,
            extra_body={"ignore_eos": True},
        )
        texts = [""] * 3
        async for ch in await c.completions.create(
            model=model,
            prompt=prompt,
            n=3,
            max_tokens=10,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            for choice in ch.choices:
                texts[choice.index] += choice.text
    after = await worker_stats(stack.nats_url, "decode", "decode-0")
    got = sorted(out.choices, key=lambda ch: ch.index)
    assert [ch.index for ch in got] == [0, 1, 2]
    assert all(ch.finish_reason == "length" for ch in got)
    assert out.usage.completion_tokens == 30
    assert len({ch.text for ch in got}) == 3  # three answers
    assert texts == [ch.text for ch in got]  # the mock is deterministic
    # two requests, each one task whose two other sequences shared its KV
    assert after["sequences_sharing_kv"] - before.get("sequences_sharing_kv", 0) == 4
    assert after["tasks_done"] - before["tasks_done"] == 2
