"""A store that dies, and the durable KV events (issue 13 items 2 and 4), on the mock
engine with SSD tiers:

- store-p0 SIGKILLed while requests stream: every request completes or ends with a
  clear error, none hangs;
- restarted, it comes back with a new epoch and the blocks its SSD tier held;
- a conductor view started afterwards rebuilds every node from the KV-event stream
  alone (no dump) and equals what each store holds, the restarted one included;
- the stack's conductor SIGKILLed and restarted replays the stream and serves on.
"""

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import nats
import pytest

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.control import DumpPage, DumpRequest, StoreInfo
from bus_schemas.load import DecodeLoad
from services.common import bus
from services.common.clock import WallClock
from services.conductor.shadow import ShadowView
from tests.e2e.conftest import make_stack
from tests.e2e.helpers import worker_stats
from tests.e2e.sse import stream

pytestmark = pytest.mark.e2e

NODES = ("p0", "d0")
MAX_TOKENS = 30


@pytest.fixture(scope="module")
def ssd_stack(tmp_path_factory):
    s = make_stack(
        tmp_path_factory,
        "store-fail",
        prefill=1,
        decode=1,
        speedup="1",
        tbt_slo=10.0,
        store_ssd_blocks=1024,
    )
    s.start()
    yield s
    s.stop()


def prompt(i: int) -> str:
    return f"tale {i}: " + "a stitch in time saves nine " * 40


async def dump(nc, node: str) -> list[int]:
    hashes, cursor = [], 0
    while True:
        page = await bus.request(
            nc,
            subjects.store_ctl(node, "dump"),
            DumpRequest(cursor=cursor, limit=500),
            DumpPage,
            timeout=5,
        )
        hashes.extend(page.block_hashes)
        if page.next_cursor is None:
            return hashes
        cursor = page.next_cursor


async def info(nc, node: str) -> StoreInfo:
    return await bus.request(nc, subjects.store_ctl(node, "info"), b"", StoreInfo, timeout=5)


async def until(pred, timeout: float, every: float = 0.1):
    async def loop():
        while not (out := await pred()):
            await asyncio.sleep(every)
        return out

    return await asyncio.wait_for(loop(), timeout)


async def quiet(url: str, node: str) -> dict[str, int]:
    """The node's counters once nothing is open and its SSD tier and index are written."""

    async def ok():
        st = await worker_stats(url, "store", node)
        done = (
            st["open_txs"] == 0
            and st["locked_blocks"] == 0
            and st["writeback_queued"] == 0
            and st["writeback_inflight"] == 0
            and st["ssd_index_dirty"] == 0
        )
        return st if done else None

    return await until(ok, 60)


def log_events(s, name: str, event: str) -> list[dict]:
    out = []
    for line in (Path(s.cfg.log_dir) / f"{name}.log").read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


async def test_a_killed_store_comes_back_with_its_ssd_and_the_stream_rebuilds_the_view(ssd_stack):
    s = ssd_stack
    nc = await nats.connect(s.nats_url)
    try:
        async with aiohttp.ClientSession() as http:
            # Warm: four prompts whose blocks p0 commits and writes back to its SSD tier.
            for i in range(4):
                r = await stream(
                    http, s.url, {"prompt": prompt(i), "max_tokens": 2, "ignore_eos": True}
                )
                assert r.status == 200 and r.done and r.error is None, r.error
            st = await quiet(s.nats_url, "p0")
            before = set(await dump(nc, "p0"))
            assert before and st["ssd_blocks"] >= len(before), st
            old = await info(nc, "p0")

            # Load, and p0's store SIGKILLed while the requests decode.
            decoding = asyncio.Event()

            async def on_load(m) -> None:
                if decode(m.data, DecodeLoad).batch_size >= 1:
                    decoding.set()

            await nc.subscribe(subjects.load_report("decode", "decode-0"), cb=on_load)
            bodies = [
                {"prompt": prompt(100 + i), "max_tokens": MAX_TOKENS, "ignore_eos": True}
                for i in range(6)
            ]
            tasks = [asyncio.create_task(stream(http, s.url, b)) for b in bodies]
            await asyncio.wait_for(decoding.wait(), 60)
            s.kill("store-p0", signal.SIGKILL)
            # A bound that only a hang reaches: each request ends, in full or with a reason.
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            for r in results:
                assert r.status in (200, 429, 503), (r.status, r.error)
                if r.error is None:
                    assert r.done and r.usage["completion_tokens"] == MAX_TOKENS, r
                else:
                    assert r.error["error"]["message"], r.error

            # Restarted: a new epoch, and what its SSD tier held is back.
            s.restart("store-p0")
            new = await until(lambda: _newer(nc, "p0", old.epoch), 60)
            assert new.epoch > old.epoch
            await quiet(s.nats_url, "p0")
            await quiet(s.nats_url, "d0")
            after = set(await dump(nc, "p0"))
            assert before <= after, (len(before - after), len(before))

            # A conductor view started now: every node from the stream, none dumped.
            subs = bus.Subscriptions(nc)
            view = ShadowView(nc, subs, WallClock())
            await view.start(discover_window_s=1.0)
            try:
                await asyncio.wait_for(view.caught_up.wait(), 30)
                assert view.durable and view.catch_up.replayed > 0
                for node in NODES:
                    held = set(await dump(nc, node))
                    st = await info(nc, node)
                    await until(lambda n=node, st=st: _synced(view, n, st), 15)
                    assert view.index.blocks(node) == frozenset(held), node
                assert view.index.state("p0")[0] == new.epoch
                assert view.dumps_done == 0
            finally:
                await subs.close()

            # The stack's conductor SIGKILLed mid-run: its successor replays the stream.
            starts = len(log_events(s, "conductor", "kv_stream_replayed"))
            s.kill("conductor", signal.SIGKILL)
            s.restart("conductor")
            replayed = await until(
                lambda: _async(
                    (e := log_events(s, "conductor", "kv_stream_replayed"))[starts:] and e
                ),
                60,
            )
            assert replayed[-1]["batches"] > 0 and set(NODES) <= set(replayed[-1]["nodes"])
            r = await asyncio.wait_for(
                stream(http, s.url, {"prompt": prompt(0), "max_tokens": 2, "ignore_eos": True}), 60
            )
            assert r.status == 200 and r.done and r.error is None, r.error
    finally:
        await nc.close()


async def _newer(nc, node: str, epoch: int) -> StoreInfo | None:
    try:
        i = await info(nc, node)
    except Exception:  # noqa: BLE001 - not up yet
        return None
    return i if i.epoch > epoch else None


async def _synced(view: ShadowView, node: str, st: StoreInfo) -> bool:
    return view.index.state(node) == (st.epoch, st.seq) and not view.index.resyncing(node)


async def _async(x):
    return x
