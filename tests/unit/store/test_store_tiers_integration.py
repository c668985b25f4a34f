"""Real store processes: SSD tier across a restart, wipe, replay, objects and replicas.

Waits are on messages and on polled counters with deadlines, never on sleeps.
"""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.control import (
    ClearDone,
    ClearRequest,
    DumpPage,
    DumpRequest,
    ObjectDone,
    ObjectReplicate,
    Refused,
    ReplayPage,
    ReplayRequest,
    Replicate,
    TxAllocate,
    TxCommit,
    TxDone,
    TxDoneReply,
    TxHandle,
    TxReply,
    TxRole,
)
from bus_schemas.kv_events import AllBlocksCleared, BlockStored, EventBatch
from bus_schemas.load import WorkerStats
from bus_schemas.requests import Retention
from services.common.bus import request
from services.store.client.object_client import ObjectClient, SyncObjectClient
from services.store.client.store_client import StoreClient, fetch_info

ROOT = Path(__file__).resolve().parents[3]
BS, BB = 4, 16 * 1024
pytestmark = pytest.mark.timeout(120)


def start(nats_url: str, node: str, logs: str, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(logs, f"{node}.log"), "ab") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.store",
                "--nats",
                nats_url,
                "--node",
                node,
                "--block-size",
                str(BS),
                "--block-bytes",
                str(BB),
                "--capacity-blocks",
                "4",
                "--peer-timeout",
                "1.0",
                "--announce-interval",
                "0.5",
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


async def alloc(nc, node, hashes, role=TxRole.PREFILL, **kw) -> TxHandle:
    n = kw.pop("num_tokens", len(hashes) * BS)
    r = await request(
        nc,
        subjects.store_ctl(node, "tx.allocate"),
        TxAllocate(request_id="r", role=role, block_hashes=hashes, num_tokens=n, **kw),
        TxReply,
        timeout=5,
    )
    assert isinstance(r, TxHandle), r
    return r


async def commit(nc, node, h: TxHandle):
    return await request(
        nc,
        subjects.store_ctl(node, "tx.commit"),
        TxCommit(tx_id=h.tx_id, request_id="r"),
        TxDoneReply,
        timeout=5,
    )


async def counters(nc, node) -> dict[str, int]:
    return (
        await request(nc, subjects.worker_stats("store", node), {}, WorkerStats, timeout=5)
    ).counters


async def until(pred, what: str, timeout: float = 20.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        got = await pred()
        if got:
            return got
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # polling a condition with a deadline, not synchronising


async def test_ssd_tier_survives_a_restart_and_promotes_on_hit(nats_url):
    with tempfile.TemporaryDirectory() as tmp:
        ssd = os.path.join(tmp, "ssd")
        args = ("--ssd-dir", ssd, "--ssd-capacity-blocks", "16")
        proc = start(nats_url, "t1", tmp, *args)
        nc = await nats.connect(nats_url)
        try:
            client = await StoreClient.connect(nc, "t1", timeout=30)
            first_epoch = client.info.epoch
            hashes = [11, 12, 13]
            h = await alloc(
                nc, "t1", hashes, retention=Retention.CONTEXT_CACHE, context_ttl_s=3600.0
            )
            blobs = [os.urandom(BB) for _ in hashes]
            for s, b in zip(h.slots, blobs, strict=True):
                client.slot(s)[:] = b
            assert await commit(nc, "t1", h) == TxDone(tx_id=h.tx_id, stored_blocks=3)
            await until(lambda: _ge(nc, "t1", "writebacks", 3), "write-back")
            await client.close()
            assert stop(proc) == 0
            assert os.path.exists(os.path.join(ssd, "index.msgpack"))

            events = await nc.subscribe(subjects.kv_events("t1"))
            proc = start(nats_url, "t1", tmp, *args)
            batch = decode((await events.next_msg(timeout=30)).data, EventBatch)
            assert (batch.seq, batch.events) == (1, [BlockStored(block_hashes=hashes)])
            assert batch.epoch > first_epoch
            page = await request(nc, subjects.store_ctl("t1", "dump"), DumpRequest(), DumpPage)
            assert page.block_hashes == hashes
            st = await counters(nc, "t1")
            assert (st["ssd_blocks"], st["ssd_pinned_blocks"], st["dram_cached_blocks"]) == (
                3,
                3,
                0,
            )
            client = await StoreClient.connect(nc, "t1", timeout=30)
            src = await alloc(nc, "t1", hashes, role=TxRole.SOURCE, num_tokens=0)
            assert [bytes(client.slot(s)) for s in src.slots] == blobs  # promoted from SSD
            assert isinstance(await commit(nc, "t1", src), TxDone)
            assert (await counters(nc, "t1"))["promoted"] == 3

            replay = await request(
                nc, subjects.store_ctl("t1", "replay"), ReplayRequest(), ReplayPage
            )
            assert replay.complete and [b.seq for b in replay.batches] == [1]
            cleared = await request(
                nc, subjects.store_ctl("t1", "clear"), ClearRequest(reason="test"), ClearDone
            )
            assert (cleared.removed_blocks, cleared.kept_blocks, cleared.seq) == (3, 0, 2)
            batch = decode((await events.next_msg(timeout=10)).data, EventBatch)
            assert (batch.seq, batch.events) == (2, [AllBlocksCleared()])
            await client.close()
        finally:
            await nc.close()
            assert stop(proc) == 0


async def test_objects_on_ssd_survive_a_restart_and_stay_out_of_kv_events(nats_url):
    with tempfile.TemporaryDirectory() as tmp:
        ssd = os.path.join(tmp, "ssd")
        args = ("--ssd-dir", ssd, "--ssd-capacity-blocks", "16")
        proc = start(nats_url, "os1", tmp, *args)
        nc = await nats.connect(nats_url)
        try:
            client = await StoreClient.connect(nc, "os1", timeout=30)
            objs = await ObjectClient.connect(nc, ["os1"])
            a, b = os.urandom(BB * 2 + 7), b"small value"
            await objs.put("a", a)
            await objs.put("gone", b"removed before the restart")
            assert await objs.remove("gone") == ["os1"]
            await objs.put("b", b)
            h = await alloc(nc, "os1", [91])  # one KV block beside the objects
            client.slot(h.slots[0])[:] = b"k" * BB
            await commit(nc, "os1", h)
            await until(lambda: _ge(nc, "os1", "ssd_blocks", 5), "a, b and the KV block on SSD")
            await objs.close()
            await client.close()
            assert stop(proc) == 0

            events = await nc.subscribe(subjects.kv_events("os1"))
            proc = start(nats_url, "os1", tmp, *args)
            batch = decode((await events.next_msg(timeout=30)).data, EventBatch)
            assert (batch.seq, batch.events) == (1, [BlockStored(block_hashes=[91])])
            page = await request(nc, subjects.store_ctl("os1", "dump"), DumpRequest(), DumpPage)
            assert page.block_hashes == [91]  # object blocks are not KV
            objs = await ObjectClient.connect(nc, ["os1"])
            assert await objs.get("a") == a and await objs.get("b") == b  # promoted from SSD
            with pytest.raises(KeyError):
                await objs.get("gone")
            assert await objs.holders("b") == {"os1"}
            await objs.put("b", b"b after the restart")  # a new version, no clash
            assert await objs.get("b") == b"b after the restart"
            assert await objs.remove("a") == ["os1"]
            st = await counters(nc, "os1")
            assert (st["ssd_blocks"], st["obj_gets"], st["obj_misses"]) == (2, 3, 1)
            await objs.close()
        finally:
            await nc.close()
            assert stop(proc) == 0


async def _ge(nc, node, key, n):
    return (await counters(nc, node)).get(key, 0) >= n


async def test_objects_replicas_and_block_replication(nats_url):
    with tempfile.TemporaryDirectory() as tmp:
        procs = [start(nats_url, n, tmp, "--capacity-blocks", "32") for n in ("oa", "ob", "oc")]
        nc = await nats.connect(nats_url)
        try:
            for n in ("oa", "ob", "oc"):
                await fetch_info(nc, n, timeout=30)
            objs = await ObjectClient.connect(nc, ["oa", "ob", "oc"])
            value = os.urandom(BB * 2 + 5)
            placed = await objs.put("k1", value, replicas=2)
            assert placed == objs.placement("k1")[:2] and len(set(placed)) == 2
            assert await objs.holders("k1") == set(placed)
            assert await objs.get("k1") == value
            v2 = os.urandom(BB * 3 + 1)
            await objs.put("k1", v2)  # replaced where it is put
            assert await objs.get("k1") == v2
            (new,) = {"oa", "ob", "oc"} - set(placed)
            before = await counters(nc, new)
            keep = await objs.change_replica("k1", 3)
            assert sorted(keep) == ["oa", "ob", "oc"] and await objs.holders("k1") == set(keep)
            # The copy was pulled into the new holder through the transfer engine (same
            # host: shared memory), its 4 blocks in one pull, and reads back whole there.
            after = await counters(nc, new)
            assert after["obj_copies_in"] == before.get("obj_copies_in", 0) + 1
            assert after["pulls"] == before.get("pulls", 0) + 1
            moved = sum(after[f"{t}_bytes"] - before.get(f"{t}_bytes", 0) for t in ("shm", "tcp"))
            assert moved == 4 * BB
            there = SyncObjectClient({new: objs.infos[new].obj_addr})
            assert there.get("k1") == v2
            there.close()
            missing = await request(
                nc,
                subjects.store_ctl(new, "obj.replicate"),
                ObjectReplicate(key="nope", source_node=placed[0], dest_node=new),
                ObjectDone | Refused,
                timeout=10,
            )
            assert isinstance(missing, Refused) and missing.reason == "missing"
            keep = await objs.change_replica("k1", 1)
            assert await objs.holders("k1") == set(keep) and await objs.get("k1") == v2
            assert await objs.remove("k1") == keep
            with pytest.raises(KeyError):
                await objs.get("k1")
            sync = SyncObjectClient.of(objs)  # blocking client, same placement
            assert sync.put("k2", value, replicas=2) == objs.placement("k2")[:2]
            assert sync.get("k2") == value and await objs.get("k2") == value
            with pytest.raises(KeyError):
                sync.get("k3")
            sync.close()
            await objs.close()

            client = await StoreClient.connect(nc, "oa", timeout=30)
            h = await alloc(nc, "oa", [71, 72])
            for s in h.slots:
                client.slot(s)[:] = bytes([s % 251]) * BB
            await commit(nc, "oa", h)
            done = await request(
                nc,
                subjects.CTL_REPLICATE,
                Replicate(block_hashes=[71, 72], source_node="oa", dest_node="ob"),
                TxDoneReply,
                timeout=10,
            )
            assert isinstance(done, TxDone) and done.stored_blocks == 2
            page = await request(nc, subjects.store_ctl("ob", "dump"), DumpRequest(), DumpPage)
            assert page.block_hashes == [71, 72]
            await client.close()
        finally:
            await nc.close()
            assert [stop(p) for p in procs] == [0, 0, 0]
