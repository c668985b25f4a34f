"""A (re)started admission or conductor waits, bounded, until both pools reported."""

import asyncio

from services.common.pools_heard import PoolsHeard


async def test_waits_for_both_pools_then_goes():
    prefill: list[str] = []
    decode: list[str] = []
    heard = PoolsHeard(lambda: prefill, lambda: decode)
    waiter = asyncio.ensure_future(heard.wait(60.0))
    prefill.append("prefill-0")
    heard.check()
    await asyncio.sleep(0)
    assert not waiter.done()  # one pool is not enough
    decode.append("decode-0")
    heard.check()
    assert await waiter is True


async def test_a_stack_without_workers_is_not_waited_on_forever():
    heard = PoolsHeard(list, list)
    assert await heard.wait(0.01) is False
