"""Chunked pipeline parallelism on a live stack (issue 16 item 3): real nats-server,
real store processes, the mock engine, started by perigee.stack.

Two prefill instances form a group (``--cpp-group 2``). A long prompt is placed on the
group, as the simulator's pipeline timing orders it (the group before one instance):
both members run a stage, each pacing its layers' chunk time from the cost model and
handing a real activation-sized message (16 KiB a token) to the next over the
transfer engine; the anchor's store ships the KV to the decode node's store (the
decode engine verifies every position of it) and the first token streams through the
gateway. A short prompt stays on one instance, as the simulator orders it. A stage
SIGKILLed while its pipeline runs fails the request with an explicit error, never a
hang, and the stack serves on; the anchor SIGKILLed is a prefill worker's death, and
the gateway's migration re-places the request, which completes on the survivor. No timing is asserted: the orders compared are the
placements' (which the cost model's estimates decide), not measured TTFTs.
"""

import asyncio
import json
import random

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from services.common.cost_model import CostModel
from services.policy import chunk_timing
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e

SPEEDUP = 0.2  # slow enough that a stage is still running when the test kills it
CHUNK = 1024
MIN_TOKENS = 2048
LONG, SHORT = 6000, 200
MEMBERS = ("prefill-0", "prefill-1")


def group_stack(tmp_path_factory, name: str):
    return make_stack(
        tmp_path_factory,
        name,
        prefill=2,
        decode=1,
        speedup=str(SPEEDUP),
        cpp_group=2,
        cpp_chunk_tokens=CHUNK,
        cpp_min_tokens=MIN_TOKENS,
    )


@pytest.fixture(scope="module")
def cpp_stack(tmp_path_factory):
    s = group_stack(tmp_path_factory, "cpp")
    s.start()
    yield s
    s.stop()


@pytest.fixture
def fresh_cpp_stack(tmp_path_factory):
    """A stack of its own: whether the conductor still prefers the group after some
    pipelines depends on their observed TTFT (its feedback), which this machine sets."""
    s = group_stack(tmp_path_factory, "cpp-fresh")
    s.start()
    yield s
    s.stop()


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


async def stages_run(url: str) -> dict[str, int]:
    return {m: (await worker_stats(url, "prefill", m)).get("cpp_stages_run", 0) for m in MEMBERS}


def body(ids: list[int]) -> dict:
    return {"prompt": ids, "max_tokens": 4, "ignore_eos": True}


def test_the_simulators_order():
    """What the live placements below must follow: the conductor's prior cost model
    (the analytic model at the stack's speedup) through the simulator's timing."""
    cost = CostModel.llama3_70b_a800(speedup=SPEEDUP)
    group = chunk_timing.pipeline_timing([cost] * 2, LONG, 0, CHUNK).ttft_s
    assert group < cost.prefill_time(LONG)  # the long prompt: the group first
    short = chunk_timing.pipeline_timing([cost] * 2, SHORT, 0, CHUNK).ttft_s
    assert short > cost.prefill_time(SHORT)  # one chunk: one instance first


async def test_a_long_prompt_runs_on_the_group_and_a_short_one_on_one_instance(cpp_stack):
    s = cpp_stack
    async with aiohttp.ClientSession() as http:
        before = await stages_run(s.nats_url)
        long_ids = prompt(LONG, 1)
        first = await stream(http, s.url, body(long_ids))
        assert first.status == 200 and first.done and first.error is None, first.error
        assert first.usage["prompt_tokens"] == LONG and first.usage["completion_tokens"] == 4
        after = await stages_run(s.nats_url)
        assert {m: after[m] - before[m] for m in MEMBERS} == dict.fromkeys(MEMBERS, 1)

        r = await stream(http, s.url, body(prompt(SHORT, 2)))
        assert r.status == 200 and r.done and r.error is None, r.error
        assert await stages_run(s.nats_url) == after  # no stage ran for it

        # The same long prompt again: its blocks are cached now, so too little is left to
        # compute for a group and one instance serves it; the tokens are the pipeline's.
        again = await stream(http, s.url, body(long_ids))
        assert again.done and again.error is None, again.error
        assert again.usage["prompt_tokens_details"]["cached_tokens"] > LONG - MIN_TOKENS
        assert again.text == first.text
        assert await stages_run(s.nats_url) == after


async def test_short_requests_sent_while_a_pipeline_runs_complete_beside_it(fresh_cpp_stack):
    """Both members are stages; the short requests placed meanwhile are computed between
    the pipeline's chunks (each member's compute_lock), the anchor's included: nothing
    waits on anything else for good."""
    s = fresh_cpp_stack
    nc = await nats.connect(s.nats_url)
    running = asyncio.Event()

    async def on_run(m) -> None:
        running.set()

    await nc.subscribe(subjects.cpp_stage("prefill-1", "run"), cb=on_run)
    await nc.flush()
    try:
        async with aiohttp.ClientSession() as http:
            before = await stages_run(s.nats_url)
            long_req = asyncio.ensure_future(stream(http, s.url, body(prompt(LONG, 6))))
            await asyncio.wait_for(running.wait(), 60)
            shorts = [stream(http, s.url, body(prompt(SHORT, 10 + i))) for i in range(4)]
            rs = await asyncio.wait_for(asyncio.gather(long_req, *shorts), 120)
            assert all(r.done and r.error is None for r in rs), [r.error for r in rs]
            after = await stages_run(s.nats_url)
            assert {m: after[m] - before[m] for m in MEMBERS} == dict.fromkeys(MEMBERS, 1)
    finally:
        await nc.close()


async def test_a_stage_killed_mid_pipeline_fails_the_request_explicitly(fresh_cpp_stack):
    s = fresh_cpp_stack
    nc = await nats.connect(s.nats_url)
    running = asyncio.Event()

    async def on_run(m) -> None:
        running.set()

    # prefill-0 anchors (no cached prefix anywhere: by name) and, both idle, goes first:
    # prefill-1 is the last stage
    await nc.subscribe(subjects.cpp_stage("prefill-1", "run"), cb=on_run)
    await nc.flush()
    try:
        async with aiohttp.ClientSession() as http:
            req = asyncio.ensure_future(stream(http, s.url, body(prompt(LONG, 3))))
            await asyncio.wait_for(running.wait(), 60)
            s.kill("prefill-1")
            r = await asyncio.wait_for(req, 120)
            # an explicit error naming the pipeline, not a hang and not a cut stream
            assert r.error is not None and not r.done, r.chunks
            assert "cpp pipeline failed" in json.dumps(r.error), r.error

            # the stack serves on: once the conductor has dropped the dead member (its
            # reports stop), its group is broken and a long prompt runs on prefill-0
            # alone; until then each attempt ends with the same explicit error
            async def served() -> None:
                while True:
                    r = await stream(http, s.url, body(prompt(LONG, 4)))
                    if r.done and r.error is None:
                        return
                    assert "cpp pipeline failed" in json.dumps(r.error), r.error

            await asyncio.wait_for(served(), 60)
    finally:
        await nc.close()


async def test_the_anchor_killed_mid_pipeline_is_migrated_and_completes(fresh_cpp_stack):
    """The anchor holds the request: its death is a prefill worker's death, which the
    gateway migrates (--migration-limit); the conductor re-places the request on the
    survivor alone (the group has lost a member) and it completes there."""
    s = fresh_cpp_stack
    nc = await nats.connect(s.nats_url)
    running = asyncio.Event()

    async def on_run(m) -> None:
        running.set()

    await nc.subscribe(subjects.cpp_stage("prefill-0", "run"), cb=on_run)
    await nc.flush()
    try:
        async with aiohttp.ClientSession() as http:
            before = await worker_stats(s.nats_url, "prefill", "prefill-1")
            req = asyncio.ensure_future(stream(http, s.url, body(prompt(LONG, 5))))
            await asyncio.wait_for(running.wait(), 60)
            s.kill("prefill-0")
            r = await asyncio.wait_for(req, 120)
            assert r.done and r.error is None, r.error
            assert r.usage["prompt_tokens"] == LONG and r.usage["completion_tokens"] == 4
            after = await worker_stats(s.nats_url, "prefill", "prefill-1")
            # prefill-1 computed it alone after the migration
            assert after["tasks_done"] == before.get("tasks_done", 0) + 1, after
    finally:
        await nc.close()
