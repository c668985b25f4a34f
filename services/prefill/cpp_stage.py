"""The data path of one chunked-pipeline stage (paper §3.3; issue 16 item 3, part).

A stage computes its share of the layers for every chunk of a prompt, paced by the
cost model (``cost.prefill_time(b, a) / X`` per chunk, as
:func:`services.policy.chunk_timing.pipeline_timing` assumes), and hands each chunk's
activations (``(b - a) * d * elem_bytes`` bytes) to the next stage::

    stage s:  [recv chunk k from s-1] -> compute -> write the activations into a free
              slot of stage s+1's inbox over the TransferEngine (one data plane)
              -> ChunkNote over ZeroMQ (coordination only) -> s+1 computes chunk k
              while s computes chunk k+1; s+1 frees the slot (Freed) once read

The inbox is ``slots`` chunk-sized slots of memory registered with the receiving
stage's TransferEngine; a sender holds at most ``slots`` chunks in flight, so a slow
downstream stage stalls its upstream instead of being overrun. Nothing is pickled:
notes are msgpack (msgspec).

Failures are explicit :class:`StageError`\\ s, never a hang: a dead downstream stage
fails the write (the transfer engine's error code), a silent one fails the wait for a
free slot after ``timeout_s``; a dead upstream stage fails the wait for the next chunk
after ``timeout_s``.

The prefill workers serve these stages for the conductor's pipelines
(:mod:`services.prefill.cpp_pipeline`); ``python -m services.prefill.cpp_stage`` runs
one stage on its own (tests/e2e/test_cpp_stages.py).
"""

import asyncio
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from services.common.clock import SleepFn
from services.common.cost_model import CostModel
from services.common.errors import CodedError
from services.transfer.backends import Opcode, Poll
from services.transfer.batch_api import TransferEngine, TransferRequest

# How long a closed inbox's queued Freed notes may take to leave (ms).
FREED_LINGER_MS = 1000


class StageError(CodedError, RuntimeError):
    """A pipeline stage could not hand on or receive a chunk."""


class ChunkNote(msgspec.Struct, frozen=True):
    """A stage's note that chunk ``chunk`` is in the next stage's inbox slot ``slot``."""

    request_id: str
    chunk: int
    slot: int
    nbytes: int


class Freed(msgspec.Struct, frozen=True):
    """A stage's note that it has read inbox slot ``slot``: the sender may reuse it."""

    request_id: str
    slot: int


def activation_nbytes(cost: CostModel, tokens: int) -> int:
    return tokens * cost.d * cost.elem_bytes


class StageInbox:
    """Stage s+1's side: ``slots`` registered chunk slots and a ROUTER for the notes."""

    def __init__(
        self,
        engine: TransferEngine,
        ctx: zmq.asyncio.Context,
        chunk_bytes: int,
        slots: int = 2,
        host: str = "127.0.0.1",
    ) -> None:
        self.engine, self.chunk_bytes, self.slots = engine, chunk_bytes, slots
        self.buf = bytearray(chunk_bytes * slots)
        self.region = engine.register_local_memory(self.buf)
        self.sock = ctx.socket(zmq.ROUTER)
        # Its last Freed may still be queued when the stage ends, and the upstream's
        # drain waits for it: ZeroMQ's I/O thread gets a bounded while to send it.
        self.sock.setsockopt(zmq.LINGER, FREED_LINGER_MS)
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = f"tcp://{host}:{port}"
        self._peer: bytes | None = None

    async def recv(self, timeout_s: float) -> tuple[ChunkNote, memoryview]:
        try:
            peer, raw = await asyncio.wait_for(self.sock.recv_multipart(), timeout_s)
        except TimeoutError:
            raise StageError(
                "upstream_silent", f"no chunk from the previous stage in {timeout_s:g}s"
            ) from None
        self._peer = peer
        note = msgspec.msgpack.decode(raw, type=ChunkNote)
        if not (0 <= note.slot < self.slots and 0 <= note.nbytes <= self.chunk_bytes):
            raise StageError("bad_note", f"chunk note out of range: {note}")
        start = note.slot * self.chunk_bytes
        return note, memoryview(self.buf)[start : start + note.nbytes]

    async def free(self, note: ChunkNote) -> None:
        assert self._peer is not None
        await self.sock.send_multipart(
            [self._peer, msgspec.msgpack.encode(Freed(note.request_id, note.slot))]
        )

    def close(self) -> None:
        self.sock.close()
        self.engine.unregister_local_memory(self.region)


class StageOutbox:
    """Stage s's side: writes into stage s+1's inbox over its own TransferEngine."""

    def __init__(
        self,
        engine: TransferEngine,
        ctx: zmq.asyncio.Context,
        inbox_segment: str,
        inbox_region: int,
        inbox_address: str,
        chunk_bytes: int,
        slots: int = 2,
    ) -> None:
        self.engine, self.segment, self.region = engine, inbox_segment, inbox_region
        self.chunk_bytes, self.slots = chunk_bytes, slots
        self.staging = bytearray(chunk_bytes * slots)
        self.local = engine.register_local_memory(self.staging)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(inbox_address)
        self._free = list(range(slots))

    async def _freed(self, timeout_s: float) -> None:
        try:
            raw = await asyncio.wait_for(self.sock.recv(), timeout_s)
        except TimeoutError:
            raise StageError(
                "downstream_silent", f"the next stage freed no slot in {timeout_s:g}s"
            ) from None
        self._free.append(msgspec.msgpack.decode(raw, type=Freed).slot)

    async def _slot(self, timeout_s: float) -> int:
        while not self._free:
            await self._freed(timeout_s)
        return self._free.pop(0)

    async def drain(self, timeout_s: float) -> None:
        """Wait until the next stage has read every chunk sent (each slot freed again).
        A note only queued in ZeroMQ is dropped when the socket closes (LINGER 0): a
        stage with no more chunks than slots never waits for a slot, so without this it
        could close before its notes left, under load before the connection was even
        up, and the next stage waited for them in vain."""
        while len(self._free) < self.slots:
            await self._freed(timeout_s)

    async def send(
        self, request_id: str, chunk: int, data: bytes | memoryview, timeout_s: float
    ) -> None:
        n = len(data)
        if n > self.chunk_bytes:
            raise StageError("bad_request", f"{n} bytes exceed the {self.chunk_bytes}-byte slot")
        slot = await self._slot(timeout_s)
        off = slot * self.chunk_bytes
        self.staging[off : off + n] = data
        bid = self.engine.allocate_batch_id(1)
        self.engine.submit_transfer(
            bid, [TransferRequest(Opcode.WRITE, self.local, off, n, self.segment, self.region, off)]
        )
        try:
            (status,) = await self.engine.wait_batch(bid, timeout_s)
        except TimeoutError:
            raise StageError(
                "downstream_silent", f"activation write not done in {timeout_s:g}s"
            ) from None
        if status.state != Poll.SUCCESS:
            self.engine.free_batch_id(bid)
            raise StageError(
                status.code or "transfer_failed",
                f"activation write to the next stage failed: {status.error}",
            )
        self.engine.free_batch_id(bid)
        await self.sock.send(msgspec.msgpack.encode(ChunkNote(request_id, chunk, slot, n)))

    def close(self) -> None:
        self.sock.close(0)
        self.engine.unregister_local_memory(self.local)


def first_activations(request_id: str, chunk: int, nbytes: int) -> bytes:
    """Stage 0's input stand-in: deterministic bytes per (request, chunk)."""
    import zlib

    seed = zlib.crc32(f"{request_id}/{chunk}".encode()) & 0xFF  # the same in every process
    return bytes((seed + i) & 0xFF for i in range(min(nbytes, 256))) * (nbytes // 256) + bytes(
        (seed + i) & 0xFF for i in range(nbytes % 256)
    )


def stage_transform(data: bytes | memoryview, stage: int) -> bytes:
    """What a stage 'computes' on the bytes (so the test can check the chain): + stage."""
    import numpy as np

    arr = np.frombuffer(data, dtype=np.uint8)
    return (arr + np.uint8(stage)).astype(np.uint8).tobytes()


async def run_stage(
    *,
    request_id: str,
    stage: int,
    stages: int,
    chunks: Sequence[tuple[int, int]],
    cost: CostModel,
    inbox: StageInbox | None,
    outbox: StageOutbox | None,
    sleep: SleepFn,
    timeout_s: float = 10.0,
    keep_output: bool = True,
) -> list[bytes]:
    """Run stage ``stage`` of ``stages`` over ``chunks``; returns what the last stage
    produced per chunk (empty for the others, and with ``keep_output`` False)."""
    out: list[bytes] = []
    # Chunk k's hand-off overlaps chunk k+1's compute, as the paper's stage boundaries
    # do; hand-offs stay in chunk order (the next waits for the one before).
    sending: asyncio.Future[None] | None = None
    try:
        for k, (a, b) in enumerate(chunks):
            nbytes = activation_nbytes(cost, b - a)
            if inbox is None:
                data: bytes | memoryview = first_activations(request_id, k, nbytes)
            else:
                note, view = await inbox.recv(timeout_s)
                if (note.request_id, note.chunk, note.nbytes) != (request_id, k, nbytes):
                    raise StageError(
                        "out_of_order",
                        f"expected chunk {k} of {request_id} ({nbytes} bytes), got {note}",
                    )
                data = bytes(view)
                await inbox.free(note)
            await sleep(cost.prefill_time(b, a) / stages)
            result = stage_transform(data, stage)
            if outbox is None:
                if keep_output:
                    out.append(result)
            else:
                if sending is not None:
                    await sending
                sending = asyncio.ensure_future(outbox.send(request_id, k, result, timeout_s))
        if sending is not None:
            await sending
        if outbox is not None:
            await outbox.drain(timeout_s)
    finally:
        if sending is not None and not sending.done():
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
    return out


# ---------------------------------------------------------------- one stage process


async def _serve(a) -> int:  # type: ignore[no-untyped-def]
    import hashlib
    import json
    import sys
    import time

    from services.policy.chunk_timing import chunk_bounds

    cost = CostModel(d=a.d).with_speedup(a.speedup)
    nbytes = activation_nbytes(cost, a.chunk)
    ctx = zmq.asyncio.Context()
    engine = TransferEngine("tcp")
    inbox = StageInbox(engine, ctx, nbytes, a.slots) if a.stage > 0 else None
    outbox = None
    if a.next:
        nxt = json.loads(a.next)
        outbox = StageOutbox(
            engine, ctx, nxt["segment"], nxt["region"], nxt["address"], nbytes, a.slots
        )

    def say(**kw: object) -> None:
        sys.stdout.write(json.dumps(kw) + "\n")
        sys.stdout.flush()

    if inbox is not None:
        say(segment=engine.segment, region=inbox.region, address=inbox.address)
    else:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # "go"
        say(t_start=time.time())
    deadline = time.monotonic()

    async def pace(seconds: float) -> None:  # by deadline: the bookkeeping is inside it
        nonlocal deadline
        deadline = max(deadline, time.monotonic()) + seconds
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))

    try:
        out = await run_stage(
            request_id=a.request_id,
            stage=a.stage,
            stages=a.stages,
            chunks=chunk_bounds(a.n, 0, a.chunk),
            cost=cost,
            inbox=inbox,
            outbox=outbox,
            sleep=pace,
            timeout_s=a.timeout,
        )
    except StageError as e:
        say(error=e.code, message=str(e))
        return 3
    finally:
        for box in (inbox, outbox):
            if box is not None:
                box.close()
        engine.close()
        ctx.term()
    if outbox is None:
        digest = hashlib.sha256(b"".join(out)).hexdigest()
        say(t_done=time.time(), digest=digest, chunks=len(out))
    else:
        say(sent=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m services.prefill.cpp_stage``: one stage as its own process (the live
    pipeline's building block; the e2e test wires X of them last to first)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m services.prefill.cpp_stage")
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--n", type=int, required=True, help="prompt tokens")
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--d", type=int, default=CostModel.d, help="hidden size (activation bytes)")
    p.add_argument("--speedup", type=float, default=1.0)
    p.add_argument("--request-id", default="r1")
    p.add_argument("--next", default="", help="the next stage's inbox, as it printed it")
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--timeout", type=float, default=30.0)
    return asyncio.run(_serve(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
