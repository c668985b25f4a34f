"""An anchor drives a chunked pipeline over its members' StageServers
(services.prefill.cpp_pipeline): the coordination on a real nats-server, the
activations over real TransferEngines (TCP on 127.0.0.1). A fast cost model (1 KiB of
activations a token, speedup 1000) keeps it short; no timing is asserted."""

import asyncio

import nats
import pytest

from services.common.clock import ManualClock, WallClock
from services.common.cost_model import CostModel
from services.policy import chunk_timing
from services.prefill.cpp_pipeline import PipelineError, StageServer, run_pipeline

COST = CostModel(layers=8, d=512).with_speedup(1000.0)
N, CHUNK = 1000, 256


async def members(url: str, names: list[str]):
    out = []
    for name in names:
        nc = await nats.connect(url)
        counters: dict[str, int] = {}
        srv = StageServer(nc, name, lambda: COST, WallClock(), counters, asyncio.Lock())
        await srv.start()
        out.append((nc, srv, counters))
    return out


async def close(ms) -> None:
    for nc, srv, _ in ms:
        await srv.close()
        await nc.close()


async def test_every_stage_runs_its_share_of_every_chunk(nats_url):
    ms = await members(nats_url, ["a", "b", "c"])
    anchor = await nats.connect(nats_url)
    try:
        done = await run_pipeline(anchor, "r1", ["a", "b", "c"], N, 0, CHUNK, expected_s=1.0)
        chunks = chunk_timing.chunk_bounds(N, 0, CHUNK)
        share = sum(COST.prefill_time(b, a) for a, b in chunks) / 3
        assert [(d.stage, d.chunks, d.compute_s) for d in done] == [
            (s, len(chunks), share) for s in range(3)
        ]
        assert [c for _, _, c in ms] == [{"cpp_stages_run": 1}] * 3
        # a cached prefix is not computed again: the chunks cover [prefix, n)
        done = await run_pipeline(anchor, "r2", ["a", "b"], N, 600, CHUNK, expected_s=1.0)
        assert (
            [d.chunks for d in done]
            == [len(chunk_timing.chunk_bounds(N, 600, CHUNK))] * 2
            == [2, 2]
        )
    finally:
        await anchor.close()
        await close(ms)


async def test_a_stage_not_serving_fails_the_pipeline_at_once(nats_url):
    ms = await members(nats_url, ["a"])
    anchor = await nats.connect(nats_url)
    try:
        with pytest.raises(PipelineError) as e:
            await run_pipeline(anchor, "r1", ["a", "ghost"], N, 0, CHUNK, expected_s=1.0)
        assert e.value.code == "stage_unavailable"
        assert "stage 1 (ghost) is not serving" in e.value.message
        assert ms[0][2] == {}  # a never ran
    finally:
        await anchor.close()
        await close(ms)


async def test_a_bad_stage_request_is_an_explicit_error(nats_url):
    ms = await members(nats_url, ["a"])
    anchor = await nats.connect(nats_url)
    try:
        with pytest.raises(PipelineError) as e:
            await run_pipeline(anchor, "r1", ["a"], N, 0, 0, expected_s=1.0)
        assert e.value.code == "bad_request" and "stage 0 (a)" in e.value.message
        assert ms[0][2] == {"cpp_stages_failed": 1}
    finally:
        await anchor.close()
        await close(ms)


async def test_the_chunk_in_progress_is_what_the_member_reports_busy(nats_url):
    clock = ManualClock()
    seen: list[tuple[float, float]] = []
    nc = await nats.connect(nats_url)

    async def sleep(t: float) -> None:  # the member's view mid-chunk, then time moves
        seen.append((t, srv.busy_s()))
        clock.advance(t)
        await asyncio.sleep(0)

    srv = StageServer(nc, "a", lambda: COST, clock, {}, asyncio.Lock(), sleep=sleep)
    await srv.start()
    try:
        await run_pipeline(nc, "r1", ["a"], N, 0, CHUNK, expected_s=1.0)
        chunk_s = [COST.prefill_time(b, a) for a, b in chunk_timing.chunk_bounds(N, 0, CHUNK)]
        assert [t for t, _ in seen] == pytest.approx(chunk_s)
        assert [busy for _, busy in seen] == pytest.approx(chunk_s)
        assert srv.busy_s() == 0.0
    finally:
        await srv.close()
        await nc.close()
