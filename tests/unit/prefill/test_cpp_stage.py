"""The chunked pipeline's data path: stages hand real activation-sized chunks to the
next over real TransferEngines (TCP on 127.0.0.1) with ZeroMQ notes; a dead stage is
an explicit StageError on its neighbours. Compute pacing is an injected sleep that
records what each stage was asked to spend."""

import asyncio

import pytest
import zmq.asyncio

from services.common.cost_model import CostModel
from services.policy import chunk_timing
from services.prefill.cpp_stage import (
    StageError,
    StageInbox,
    StageOutbox,
    activation_nbytes,
    first_activations,
    run_stage,
    stage_transform,
)
from services.transfer.batch_api import TransferEngine

# d = 512, 2 bytes: 1 KiB of activations per token; a 64-token chunk is 64 KiB
COST = CostModel(layers=8, d=512)
CHUNK = 64


def build(stages: int, slots: int = 2):
    ctx = zmq.asyncio.Context()
    engines = [TransferEngine("tcp") for _ in range(stages)]
    nbytes = activation_nbytes(COST, CHUNK)
    inboxes = [None] + [StageInbox(engines[s], ctx, nbytes, slots) for s in range(1, stages)]
    outboxes = [
        StageOutbox(
            engines[s],
            ctx,
            engines[s + 1].segment,
            inboxes[s + 1].region,
            inboxes[s + 1].address,
            nbytes,
            slots,
        )
        for s in range(stages - 1)
    ] + [None]
    return ctx, engines, inboxes, outboxes


def teardown(ctx, engines, inboxes, outboxes):
    for box in [*inboxes, *outboxes]:
        if box is not None:
            box.close()
    for e in engines:
        e.close()
    ctx.term()


def pacing():
    asked: list[tuple[int, float]] = []

    def sleeper(stage):
        async def sleep(s):
            asked.append((stage, s))
            await asyncio.sleep(0)

        return sleep

    return asked, sleeper


async def first_stage(outbox, chunks, sleeper, timeout_s: float, request_id: str = "r1") -> None:
    """Stage 0 of 2 of ``request_id``, writing into ``outbox``."""
    await run_stage(
        request_id=request_id,
        stage=0,
        stages=2,
        chunks=chunks,
        cost=COST,
        inbox=None,
        outbox=outbox,
        sleep=sleeper(0),
        timeout_s=timeout_s,
    )


def test_four_stages_chain_every_chunk_and_pace_by_their_layer_share():
    n, x = 5 * CHUNK + 10, 4
    chunks = chunk_timing.chunk_bounds(n, 0, CHUNK)
    ctx, engines, inboxes, outboxes = build(x)
    asked, sleeper = pacing()

    async def main():
        return await asyncio.gather(
            *[
                run_stage(
                    request_id="r1",
                    stage=s,
                    stages=x,
                    chunks=chunks,
                    cost=COST,
                    inbox=inboxes[s],
                    outbox=outboxes[s],
                    sleep=sleeper(s),
                )
                for s in range(x)
            ]
        )

    try:
        results = asyncio.run(main())
    finally:
        teardown(ctx, engines, inboxes, outboxes)
    last = results[-1]
    assert [len(r) for r in last] == [activation_nbytes(COST, b - a) for a, b in chunks]
    for k, (a, b) in enumerate(chunks):  # the bytes went through all four stages
        want = first_activations("r1", k, activation_nbytes(COST, b - a))
        for s in range(x):
            want = stage_transform(want, s)
        assert last[k] == want
    for s in range(x):
        assert [t for st, t in asked if st == s] == [COST.prefill_time(b, a) / x for a, b in chunks]


def test_a_dead_next_stage_fails_the_write_at_once_with_the_transport_error():
    chunks = chunk_timing.chunk_bounds(3 * CHUNK, 0, CHUNK)
    ctx, engines, inboxes, outboxes = build(2)
    _, sleeper = pacing()
    inboxes[1].close()
    engines[1].close()  # stage 1 is gone: its segment refuses the write

    try:
        with pytest.raises(StageError) as e:
            asyncio.run(first_stage(outboxes[0], chunks, sleeper, timeout_s=30.0))
        # refused by the dead segment, not a timeout (30 s would be one)
        assert e.value.code == "unreachable", e.value
        assert "Connection refused" in str(e.value)
    finally:
        outboxes[0].close()
        engines[0].close()
        ctx.term()


def test_an_out_of_order_or_foreign_chunk_is_refused():
    chunks = chunk_timing.chunk_bounds(2 * CHUNK, 0, CHUNK)
    ctx, engines, inboxes, outboxes = build(2)
    _, sleeper = pacing()

    async def main():
        # the upstream runs another request's chunks into this stage's inbox
        # (its drain waits for slots the refusing stage never frees: 1 s)
        send = first_stage(outboxes[0], chunks, sleeper, timeout_s=1.0, request_id="other")
        recv = run_stage(
            request_id="r1",
            stage=1,
            stages=2,
            chunks=chunks,
            cost=COST,
            inbox=inboxes[1],
            outbox=None,
            sleep=sleeper(1),
        )
        return await asyncio.gather(send, recv, return_exceptions=True)

    try:
        _, err = asyncio.run(main())
    finally:
        teardown(ctx, engines, inboxes, outboxes)
    assert isinstance(err, StageError) and err.code == "out_of_order"


def test_a_stage_is_done_only_once_the_next_has_read_its_chunks():
    """Two chunks in two slots: the upstream never waits for a slot, so only its drain
    keeps it from closing its socket (LINGER 0) while its notes may still sit in
    ZeroMQ's queue, lost to a next stage that then waits for them (a hang seen under
    load). A next stage that never reads fails the upstream instead of letting it
    report done."""
    chunks = chunk_timing.chunk_bounds(2 * CHUNK, 0, CHUNK)
    ctx, engines, inboxes, outboxes = build(2)
    _, sleeper = pacing()

    try:
        with pytest.raises(StageError) as e:  # stage 1's inbox is open but nobody reads it
            asyncio.run(first_stage(outboxes[0], chunks, sleeper, timeout_s=0.5))
        assert e.value.code == "downstream_silent"
    finally:
        teardown(ctx, engines, inboxes, outboxes)
