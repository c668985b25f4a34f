"""Helpers for the engine/prefill/decode tests: an in-memory StoreClient fake
(bytearrays as slots; ship_layer/pull copy spans between fakes of one FakeNet),
TxHandle builders and a writer of the mock engine's expected KV."""

import asyncio
import math
import time
import uuid
from collections.abc import Sequence
from typing import Any

import nats
import numpy as np

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import TxCommit, TxDone, TxHandle, TxRenew, TxRenewed
from bus_schemas.load import WorkerStats
from bus_schemas.placement import (
    ConductorEvent,
    DecodeTask,
    PrefillTask,
    PrefixSource,
    RemotePrefix,
)
from bus_schemas.requests import (
    Error,
    Finished,
    GenerateRequest,
    SamplingParams,
    StreamEvent,
    Tokens,
)
from services.common.cost_model import CostModel
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec
from services.common.store_tx import LeaseExpired
from services.decode.worker import DecodeWorker
from services.engine import SlotKV, make_engine, synth
from services.prefill.reserve import Reservation
from services.prefill.worker import PrefillWorker
from services.store.client.store_client import TransferError


class FakeNet(dict):
    """node -> FakeStore; a transfer with a node that is not here fails like a dead peer."""


class FakeStore:
    def __init__(self, net: FakeNet, node: str, capacity: int, block_bytes: int) -> None:
        self.net = net
        self.node = node
        self.block_bytes = block_bytes
        self.mem = bytearray(capacity * block_bytes)
        self.ships: list[tuple[int, tuple[int, ...]]] = []  # (first layer, blocks) per ship
        self.spans: list[tuple[int, int, tuple[int, ...]]] = []  # (offset, bytes, blocks)
        self.pulls: list[RemotePrefix] = []
        self.leases: list[tuple[str, tuple[int, ...]]] = []  # (decode tx, blocks)
        self.shipped_commits: list[tuple[str, str]] = []  # (src tx, request id)
        self.gate: asyncio.Event | None = None  # set: ships wait until it is set
        self.at_gate = 0  # ships waiting on the gate right now
        net[node] = self

    async def gate_drained(self) -> None:
        """Until no ship waits on the gate: each was cancelled, or was let through and
        (the rest of ship_layer does not await) has landed."""
        while self.at_gate:
            await asyncio.sleep(0)

    async def attached(self, tx: TxHandle) -> None:
        """One incarnation: nothing to follow."""

    def slot(self, i: int) -> memoryview:
        bb = self.block_bytes
        return memoryview(self.mem)[i * bb : (i + 1) * bb]

    async def ship_layer(
        self,
        src: TxHandle,
        dst: TxHandle,
        layer: int,
        blocks: list[int],
        layer_bytes: int,
        layer_offset: int,
        commit_src: str = "",
    ) -> None:
        assert src.node == self.node
        await asyncio.sleep(0)
        if self.gate is not None:
            self.at_gate += 1
            try:
                await self.gate.wait()
            finally:
                self.at_gate -= 1
        peer = self.net.get(dst.node)
        if peer is None:
            raise TransferError("peer_closed", f"store {dst.node} unreachable")
        span = slice(layer_offset, layer_offset + layer_bytes)
        for b in blocks:
            peer.slot(dst.slots[b])[span] = self.slot(src.slots[b])[span]
        self.ships.append((layer, tuple(blocks)))
        self.spans.append((layer_offset, layer_bytes, tuple(blocks)))
        if commit_src:
            self.shipped_commits.append((src.tx_id, commit_src))

    async def lease(self, src: TxHandle, dst: TxHandle, blocks: list[int]) -> None:
        assert src.node == self.node
        self.leases.append((dst.tx_id, tuple(blocks)))

    async def pull(self, dst: TxHandle, remote: RemotePrefix) -> None:
        assert dst.node == self.node
        await asyncio.sleep(0)
        src = self.net.get(remote.source_node)
        if src is None:
            raise TransferError("peer_closed", f"store {remote.source_node} unreachable")
        for b in range(remote.first_block, remote.first_block + remote.num_blocks):
            self.slot(dst.slots[b])[:] = src.slot(remote.source_tx.slots[b])
        self.pulls.append(remote)


def handle(node: str, slots: Sequence[int], hit_blocks: int, block_bytes: int) -> TxHandle:
    return TxHandle(
        tx_id=f"tx-{node}-{uuid.uuid4().hex[:6]}",
        node=node,
        epoch=1,
        slots=list(slots),
        hit_blocks=hit_blocks,
        shm_name="",
        data_addr="",
        block_bytes=block_bytes,
    )


def slot_kv(store: FakeStore, layout: KVLayout, slots: Sequence[int], n: int) -> SlotKV:
    return SlotKV(layout, [store.slot(s) for s in slots], n)


def write_expected(kv: SlotKV, tokens: Sequence[int], start: int, end: int) -> None:
    """Write the mock engine's KV of positions [start, end) of ``tokens``, all layers."""
    hashes = synth.prefix_hashes(tokens[:end])
    for layer in range(kv.layout.spec.num_layers):
        kv.write(
            layer, start, synth.layer_kv(hashes[start:end], layer, kv.layout.row, kv.layout.dtype)
        )


def assert_expected(kv: SlotKV, tokens: Sequence[int]) -> None:
    hashes = synth.prefix_hashes(tokens)
    for layer in range(kv.layout.spec.num_layers):
        want = synth.layer_kv(hashes, layer, kv.layout.row, kv.layout.dtype)
        np.testing.assert_array_equal(kv.read(layer, 0, len(tokens)), want)


class FakeReserver:
    """Hands the prefill worker the reservation the test prepared for each request
    (:meth:`Rig.task`), and records what the worker did with it."""

    def __init__(self) -> None:
        self.planned: dict[str, Reservation] = {}
        self.reserved: list[str] = []
        self.handed_off: list[str] = []
        self.committed: list[str] = []  # prefill tx ids committed with their last ship
        self.released: list[tuple[str, str]] = []  # (request id, reason)
        self.lose: set[str] = set()  # prefill tx ids whose lease ends before the compute

    async def reserve(self, task: PrefillTask, ahead=None) -> Reservation:
        rid = task.request.request_id
        self.reserved.append(rid)
        return self.planned[rid]

    async def computing(self, r: Reservation, work):
        if r.prefill_tx.tx_id in self.lose:
            work.close()
            raise LeaseExpired("the store no longer holds the slots (test)")
        return await work

    def prefill_committed(self, r: Reservation) -> None:
        self.committed.append(r.prefill_tx.tx_id)

    async def hand_off(self, task: PrefillTask, r: Reservation) -> None:
        self.handed_off.append(task.request.request_id)

    async def release(self, task: PrefillTask, r: Reservation, reason: str) -> None:
        self.released.append((task.request.request_id, reason))

    async def close(self) -> None:
        pass


# -- an in-process prefill + decode pair on a real nats-server ----------------------


class Rig:
    """A PrefillWorker and a DecodeWorker in this process, fake stores for nodes
    p/d/r, a fake decode-store commit endpoint, and the test's own NATS connection
    playing gateway and conductor."""

    def __init__(
        self,
        speedup: float = math.inf,
        prefill_sleep=None,
        block_size: int = 32,
        commit_reply: Any = None,
        max_batch: int = 8,
        clock: Any = None,
    ) -> None:
        sfx = uuid.uuid4().hex[:8]
        self.clock = clock  # the prefill worker's (None: its own)
        self.spec = ModelSpec.from_dir()
        self.layout = KVLayout(self.spec, block_size)
        self.bs = block_size
        self.cost = CostModel(speedup=speedup)
        self.pi, self.di, self.cid = f"prefill-{sfx}", f"decode-{sfx}", f"cond-{sfx}"
        self.pn, self.dn, self.rn = f"p-{sfx}", f"d-{sfx}", f"r-{sfx}"
        self.net = FakeNet()
        bb = self.layout.block_bytes
        self.p = FakeStore(self.net, self.pn, 32, bb)
        self.d = FakeStore(self.net, self.dn, 32, bb)
        self.r = FakeStore(self.net, self.rn, 32, bb)
        self._next = {self.pn: 0, self.dn: 0, self.rn: 0}
        self.prefill_sleep = prefill_sleep
        self.max_batch = max_batch
        self.commit_reply = commit_reply  # None: TxDone
        self.commits: list[TxCommit] = []
        self.reserver = FakeReserver()
        self.renewals: list[TxRenew] = []
        self.renew_known = True  # False: the decode store answers that it lost the tx
        self.conductor: asyncio.Queue = asyncio.Queue()
        self.decode_tasks: asyncio.Queue = asyncio.Queue()

    async def start(self, url: str) -> "Rig":
        self.nc = await nats.connect(url)
        self.tnc = await nats.connect(url)
        self.pengine = make_engine("mock", self.spec, self.cost, sleep=self.prefill_sleep)
        self.dengine = make_engine("mock", self.spec, self.cost, max_batch=self.max_batch)
        await self.dengine.start()
        self.prefill = PrefillWorker(
            self.nc,
            self.p,
            self.pengine,
            instance=self.pi,
            node=self.pn,
            layout=self.layout,
            cost=self.cost,
            report_interval=0.05,
            reserver=self.reserver,
            clock=self.clock,
        )
        self.decode = DecodeWorker(
            self.nc,
            self.d,
            self.dengine,
            instance=self.di,
            node=self.dn,
            layout=self.layout,
            report_interval=0.05,
        )

        async def on_commit(m):
            c = decode(m.data, TxCommit)
            self.commits.append(c)
            reply = self.commit_reply or TxDone(tx_id=c.tx_id, stored_blocks=0)
            await self.tnc.publish(m.reply, encode(reply))

        async def on_renew(m):
            r = decode(m.data, TxRenew)
            self.renewals.append(r)
            ok = self.renew_known
            await self.tnc.publish(
                m.reply,
                encode(
                    TxRenewed(
                        expires_at=time.time() + r.lease_s,
                        renewed=r.tx_ids if ok else [],
                        unknown=[] if ok else r.tx_ids,
                    )
                ),
            )

        async def on_conductor(m):
            await self.conductor.put(decode(m.data, ConductorEvent))

        async def on_decode_task(m):
            await self.decode_tasks.put(decode(m.data, DecodeTask))

        await self.tnc.subscribe(subjects.store_ctl(self.dn, "tx.commit"), cb=on_commit)
        await self.tnc.subscribe(subjects.store_ctl(self.dn, "tx.renew"), cb=on_renew)
        await self.tnc.subscribe(subjects.conductor_events_from_workers(self.cid), cb=on_conductor)
        await self.tnc.subscribe(subjects.decode_tasks(self.di), cb=on_decode_task)
        await self.tnc.flush()
        await self.prefill.start()
        await self.decode.start()
        return self

    async def close(self) -> None:
        await self.prefill.close()
        await self.decode.close()
        await self.pengine.stop()
        await self.dengine.stop()
        await self.nc.close()
        await self.tnc.close()

    def alloc(self, node: str, k: int) -> list[int]:
        start = self._next[node]
        self._next[node] = start + k
        return list(range(start, start + k))

    def prompt(self, n: int, seed: int = 0) -> list[int]:
        rng = np.random.default_rng(seed)
        return [int(x) for x in rng.integers(3, self.spec.vocab_size, n)]

    def reference(self, prompt: Sequence[int], n: int) -> list[int]:
        return synth.reference_generate(prompt, n, self.spec.vocab_size, self.spec.eos_token_id)

    def task(
        self,
        prompt: Sequence[int],
        *,
        p_hit: int = 0,
        d_hit: int = 0,
        remote_blocks: int = 0,
        max_tokens: int = 8,
        write_prefix: bool = True,
        rid: str | None = None,
        **sampling: Any,
    ) -> PrefillTask:
        """A PrefillTask as a conductor would place it, and the reservation its prefill
        will get (:meth:`res`); cached blocks already hold the right KV on their nodes
        (unless ``write_prefix`` is False)."""
        n, bs, bb = len(prompt), self.bs, self.layout.block_bytes
        nb = -(-n // bs)
        rid = rid or f"req-{uuid.uuid4().hex[:8]}"
        ptx = handle(self.pn, self.alloc(self.pn, nb), p_hit, bb)
        dtx = handle(self.dn, self.alloc(self.dn, nb), d_hit, bb)
        remote = None
        if remote_blocks:
            src = handle(
                self.rn, self.alloc(self.rn, p_hit + remote_blocks), p_hit + remote_blocks, bb
            )
            if write_prefix:
                held = min(n, (p_hit + remote_blocks) * bs)
                write_expected(slot_kv(self.r, self.layout, src.slots, held), prompt, 0, held)
            remote = RemotePrefix(
                source_node=self.rn, source_tx=src, first_block=p_hit, num_blocks=remote_blocks
            )
        if write_prefix:
            write_expected(slot_kv(self.p, self.layout, ptx.slots, n), prompt, 0, p_hit * bs)
            write_expected(slot_kv(self.d, self.layout, dtx.slots, n), prompt, 0, d_hit * bs)
        req = GenerateRequest(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling=SamplingParams(max_tokens=max_tokens, **sampling),
            block_size=bs,
            reply_subject=f"test.reply.{rid}",
        )
        self.reserver.planned[rid] = Reservation(prefill_tx=ptx, decode_tx=dtx, remote=remote)
        source = (
            PrefixSource(node=self.rn, first_block=p_hit, num_blocks=remote_blocks)
            if remote_blocks
            else None
        )
        return PrefillTask(
            request=req,
            conductor_id=self.cid,
            prefill_instance=self.pi,
            decode_instance=self.di,
            prefill_node=self.pn,
            decode_node=self.dn,
            expected_hit_blocks=p_hit,
            source=source,
        )

    def res(self, t: PrefillTask) -> Reservation:
        """The reservation ``t``'s prefill gets when its compute starts."""
        return self.reserver.planned[t.request.request_id]

    async def listen(self, t: PrefillTask) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()

        async def cb(m):
            await q.put(decode(m.data, StreamEvent))

        await self.tnc.subscribe(t.request.reply_subject, cb=cb)
        await self.tnc.flush()
        return q

    async def submit(self, t: PrefillTask) -> asyncio.Queue:
        q = await self.listen(t)
        await self.tnc.publish(subjects.prefill_tasks(self.pi), encode(t))
        return q

    async def stats(self, role: str, instance: str) -> dict[str, int]:
        # Generous: a loaded CI box can stall a reply for seconds (what is asserted is
        # the counters, not how fast they come).
        m = await self.tnc.request(subjects.worker_stats(role, instance), b"", timeout=10)
        return decode(m.data, WorkerStats).counters


async def until_terminal(q: asyncio.Queue, timeout: float = 10.0) -> list:
    """Stream events up to and including Finished or Error."""
    out = []
    while True:
        ev = await asyncio.wait_for(q.get(), timeout)
        out.append(ev)
        if isinstance(ev, Finished | Error):
            return out


def tokens_of(events: list, start: int = 0) -> list[int]:
    """The generated tokens in ``events``, whose first Tokens has index ``start``
    (a decode stream after prefill streamed the first token starts at 1)."""
    toks: list[int] = []
    for ev in events:
        if isinstance(ev, Tokens):
            assert ev.index == start + len(toks), "Tokens indices must be contiguous"
            toks.extend(ev.token_ids)
    return toks


def shipped_layers(store: "FakeStore", layer_bytes: int) -> list[tuple[int, tuple[int, ...]]]:
    """Every (layer, blocks) the ships covered, in order: finished layers may travel
    together in one span, but each must go exactly once."""
    out = []
    for offset, length, blocks in store.spans:
        out += [
            (layer, blocks)
            for layer in range(offset // layer_bytes, (offset + length) // layer_bytes)
        ]
    return out
