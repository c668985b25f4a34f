"""The conductor service in-process on a real nats-server, against fake stores (tiny NATS
responders for tx.allocate/commit/abort, dump and discover) and hand-published load
reports."""

import asyncio
import itertools
import time

import nats
import pytest
from nats.js.errors import NotFoundError

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import (
    DumpPage,
    DumpRequest,
    Refused,
    RoleSwitch,
    StoreInfo,
    TxAbort,
    TxAllocate,
    TxCommit,
    TxDone,
    TxHandle,
    TxRole,
)
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import DecodeLoad, PrefillLoad
from bus_schemas.placement import FirstTokenNotice, PrefillTask, PrefixSource, RequestFailed
from bus_schemas.requests import Accepted, Error, ErrorCode, GenerateRequest, stream_event_decoder
from services.common import kv_stream
from services.common.bus import sync
from services.common.clock import ManualClock
from services.common.cost_fit import FittedCostModel, PrefillSample, fit_cost_model
from services.common.cost_model import CostModel
from services.common.defaults import TX_LEASE_S
from services.common.hashing import block_hashes
from services.conductor.service import ConductorConfig, ConductorService

BS = 32
PROMPT = list(range(1, 101))  # 3 full blocks and a 4-token tail
HASHES = block_hashes(PROMPT, BS)
CID = "conductor-t"
EPOCH = 77
_tx_ids = itertools.count(1)


class FakeStore:
    """Answers a node's store_ctl endpoints and STORE_DISCOVER (with an announce);
    records what it got."""

    def __init__(self, nc, node: str, held=(), refuse: dict[TxRole, str] | None = None) -> None:
        self.nc = nc
        self.node = node
        self.held = list(held)
        self.refuse = refuse or {}
        self.seq = 0
        self.allocs: asyncio.Queue[TxAllocate] = asyncio.Queue()
        self.commits: asyncio.Queue[TxCommit] = asyncio.Queue()
        self.commit_replies: list[str] = []  # each commit's reply subject
        self.aborts: asyncio.Queue[TxAbort] = asyncio.Queue()
        self.dumps: asyncio.Queue[DumpRequest] = asyncio.Queue()
        self.granted: list[TxHandle] = []

    def info(self) -> StoreInfo:
        return StoreInfo(
            node=self.node,
            epoch=EPOCH,
            seq=self.seq,
            data_addr="tcp://127.0.0.1:1",
            shm_name="none",
            block_size=BS,
            block_bytes=1,
            capacity_blocks=100,
            used_blocks=len(self.held),
        )

    async def start(self) -> "FakeStore":
        ctl = subjects.store_ctl

        async def reply(m, obj):
            if m.reply:  # the conductor's commits ask no answer
                await self.nc.publish(m.reply, encode(obj))

        async def allocate(m):
            a = decode(m.data, TxAllocate)
            await self.allocs.put(a)
            if a.role in self.refuse:
                return await reply(m, Refused(reason=self.refuse[a.role], message="fake"))
            hit = 0
            while hit < len(a.block_hashes) and a.block_hashes[hit] in self.held:
                hit += 1
            if a.role == TxRole.SOURCE and hit < len(a.block_hashes):
                return await reply(m, Refused(reason="missing", message="fake"))
            nslots = len(a.block_hashes) if a.role == TxRole.SOURCE else -(-a.num_tokens // BS)
            h = TxHandle(
                tx_id=f"{self.node}-tx{next(_tx_ids)}",
                node=self.node,
                epoch=EPOCH,
                slots=list(range(nslots)),
                hit_blocks=hit,
                shm_name="none",
                data_addr="tcp://127.0.0.1:1",
                block_bytes=1,
            )
            self.granted.append(h)
            await reply(m, h)

        async def commit(m):
            c = decode(m.data, TxCommit)
            self.commit_replies.append(m.reply)
            await self.commits.put(c)
            await reply(m, TxDone(tx_id=c.tx_id))

        async def abort(m):
            a = decode(m.data, TxAbort)
            await self.aborts.put(a)
            await reply(m, TxDone(tx_id=a.tx_id))

        async def dump(m):
            d = decode(m.data, DumpRequest)
            await self.dumps.put(d)
            # Two pages when there is more than one block, to exercise the cursor.
            page = self.held[d.cursor : d.cursor + 1] if d.cursor == 0 else self.held[d.cursor :]
            nxt = 1 if d.cursor == 0 and len(self.held) > 1 else None
            await reply(
                m,
                DumpPage(
                    node=self.node, epoch=EPOCH, seq=self.seq, block_hashes=page, next_cursor=nxt
                ),
            )

        async def discover(m):  # as a store does: an announce on its own subject
            await self.nc.publish(subjects.store_announce(self.node), encode(self.info()))

        for ep, cb in (
            ("tx.allocate", allocate),
            ("tx.commit", commit),
            ("tx.abort", abort),
            ("dump", dump),
        ):
            await self.nc.subscribe(ctl(self.node, ep), cb=cb)
        await self.nc.subscribe(subjects.STORE_DISCOVER, cb=discover)
        return self


async def wait_until(pred, timeout: float = 5.0) -> None:
    async def loop():
        while not pred():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(loop(), timeout)


async def next_of(q: asyncio.Queue, timeout: float = 5.0):
    return await asyncio.wait_for(q.get(), timeout)


class Harness:
    def __init__(self, nats_url: str) -> None:
        self.url = nats_url

    async def start(
        self, stores: list[FakeStore], prefills, decodes, clock=None, **cfg
    ) -> "Harness":
        self.nc = await nats.connect(self.url)
        try:  # the server outlives a test: no test replays another's KV events
            await self.nc.jetstream().delete_stream(kv_stream.STREAM)
        except NotFoundError:
            pass
        self.stores = {}
        for s in stores:
            s.nc = self.nc
            self.stores[s.node] = await s.start()
        await sync(self.nc)  # the fake stores' SUBs are on the server from here
        self.cnc = await nats.connect(self.url)
        # The prefill instances reserve their own (reserve-ahead has its own test).
        conf = dict(
            conductor_id=CID,
            block_size=BS,
            discover_window_s=0.3,
            tx_timeout_s=1.0,
            reserve_ahead_queue_s=-1.0,
        )
        conf.update(cfg)
        self.svc = ConductorService(self.cnc, ConductorConfig(**conf), clock=clock)
        await self.svc.start()
        await wait_until(lambda: self.svc.shadow.dumps_done >= len(stores))
        self.tasks = await self.nc.subscribe("perigee.prefill.*.tasks")
        self.inbox = self.nc.new_inbox()
        self.events = await self.nc.subscribe(self.inbox)
        self.prefills, self.decodes = prefills, decodes
        await self.report()
        await wait_until(
            lambda: (
                self.svc.policy.live_prefill() == sorted(i for i, _, _ in prefills)
                and self.svc.policy.live_decode() == sorted(i for i, _ in decodes)
            )
        )
        return self

    async def report(self) -> None:
        now = time.time()
        for inst, node, work in self.prefills:
            load = PrefillLoad(
                instance=inst, node=node, queue_len=0, queued_tokens=0, queued_work_s=work, ts=now
            )
            await self.nc.publish(subjects.load_report("prefill", inst), encode(load))
        for inst, node in self.decodes:
            load = DecodeLoad(
                instance=inst,
                node=node,
                batch_size=0,
                waiting=0,
                max_batch=8,
                kv_tokens=0,
                step_time_s=0.0,
                ts=now,
            )
            await self.nc.publish(subjects.load_report("decode", inst), encode(load))
        await self.nc.flush()

    async def schedule(self, rid: str = "r1") -> None:
        req = GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, reply_subject=self.inbox)
        await self.nc.publish(subjects.SCHEDULE, encode(req))

    async def event(self):
        m = await self.events.next_msg(timeout=5)
        return stream_event_decoder().decode(m.data)

    async def task(self) -> PrefillTask:
        m = await self.tasks.next_msg(timeout=5)
        return decode(m.data, PrefillTask)

    async def close(self) -> None:
        await self.svc.stop()
        await self.cnc.close()
        await self.nc.close()


@pytest.fixture
async def harness(nats_url):
    h = Harness(nats_url)
    yield h
    await h.close()


async def test_places_on_the_cached_node_reserves_nothing_and_commits_on_first_token(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "np1", held=HASHES[:2]), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0), ("prefill-1", "np1", 0.0)],
        decodes=[("decode-0", "nd0")],
    )
    assert h.svc.shadow.index.match(HASHES) == {"np1": 2}  # rebuilt from the paged dump
    await h.schedule("r1")
    task = await h.task()
    assert task.prefill_instance == "prefill-1" and task.decode_instance == "decode-0"
    assert task.conductor_id == CID
    assert (task.prefill_node, task.decode_node, task.expected_hit_blocks) == ("np1", "nd0", 2)
    assert task.source is None
    assert task.request.block_hashes == HASHES and task.request.block_size == BS
    assert task.request.reply_subject == h.inbox
    acc = await h.event()
    assert acc == Accepted(
        request_id="r1",
        prefill_instance="prefill-1",
        decode_instance="decode-0",
        cached_tokens=64,
        est_ttft_s=task.est_ttft_s,
    )
    assert acc.est_ttft_s > 0
    # A placed request waits in its prefill queue holding no store slot: the prefill
    # instance reserves when its compute starts.
    assert all(s.allocs.empty() for s in h.stores.values())
    assert set(h.svc.pending) == {"r1"}

    notice = FirstTokenNotice(
        request_id="r1", prefill_node="np1", prefill_tx_id="np1-tx-a", ts=time.time()
    )
    await h.nc.publish(subjects.conductor_events(CID), encode(notice))
    assert await next_of(h.stores["np1"].commits) == TxCommit(tx_id="np1-tx-a", request_id="r1")
    assert h.stores["np1"].commit_replies == [""]  # sent without asking for an answer
    await wait_until(lambda: not h.svc.pending)

    # A prefill whose store committed its tx with the last ship: nothing to commit (the
    # next commit the store sees is the next request's).
    for rid, tx, committed in (("r2", "np1-tx-b", True), ("r3", "np1-tx-c", False)):
        await h.schedule(rid)
        await h.task()
        n = FirstTokenNotice(
            request_id=rid,
            prefill_node="np1",
            prefill_tx_id=tx,
            ts=time.time(),
            prefill_committed=committed,
        )
        await h.nc.publish(subjects.conductor_events(CID), encode(n))
    assert await next_of(h.stores["np1"].commits) == TxCommit(tx_id="np1-tx-c", request_id="r3")


async def test_an_idle_instance_has_its_reservation_sent_ahead_of_its_task(harness):
    # The stores' round trip overlaps the task's way to an idle instance: the conductor
    # sends the first TxAllocates itself and the stores answer the instance, on the
    # task's key. An instance with a queue reserves its own when its compute starts.
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0)],
        decodes=[("decode-0", "nd0")],
        reserve_ahead_queue_s=0.05,
    )
    answers = await h.nc.subscribe(subjects.prefill_reserved("prefill-0"))
    await h.schedule("r1")
    task = await h.task()
    assert len(task.reserved_ahead) == 16
    pa, da = await next_of(h.stores["np0"].allocs), await next_of(h.stores["nd0"].allocs)
    assert (pa.role, da.role) == (TxRole.PREFILL, TxRole.DECODE)
    assert pa.request_id == da.request_id == "r1" and pa.block_hashes == HASHES
    assert pa.lease_s == da.lease_s == TX_LEASE_S
    got = {}
    for _ in range(2):
        m = await answers.next_msg(timeout=5)
        got[m.subject] = decode(m.data, TxHandle).node
    assert got == {
        subjects.prefill_reserved("prefill-0", task.reserved_ahead, "prefill"): "np0",
        subjects.prefill_reserved("prefill-0", task.reserved_ahead, "decode"): "nd0",
    }
    h.prefills = [("prefill-0", "np0", 1.0)]  # a second of work queued there now
    await h.report()
    await wait_until(lambda: h.svc.policy.loads.prefill["prefill-0"].queued_work_s == 1.0)
    await h.schedule("r2")
    assert (await h.task()).reserved_ahead == ""
    assert h.stores["np0"].allocs.empty() and h.stores["nd0"].allocs.empty()


async def test_busy_holder_makes_another_node_pull_the_prefix(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "np1", held=HASHES), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0), ("prefill-1", "np1", 100.0)],
        decodes=[("decode-0", "nd0")],
    )
    await h.schedule("r2")
    task = await h.task()
    assert task.prefill_instance == "prefill-0" and task.expected_hit_blocks == 0
    assert task.source == PrefixSource(node="np1", first_block=0, num_blocks=3)
    acc = await h.event()
    assert isinstance(acc, Accepted) and acc.cached_tokens == 96
    assert all(s.allocs.empty() for s in h.stores.values())

    notice = FirstTokenNotice(
        request_id="r2",
        prefill_node="np0",
        prefill_tx_id="np0-tx-b",
        ts=time.time(),
        source_node="np1",
        source_tx_id="np1-tx-c",
    )
    await h.nc.publish(subjects.conductor_events(CID), encode(notice))
    assert (await next_of(h.stores["np0"].commits)).tx_id == "np0-tx-b"
    assert (await next_of(h.stores["np1"].commits)).tx_id == "np1-tx-c"


async def test_request_failed_releases_the_request_and_aborts_the_named_tx(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0)],
        decodes=[("decode-0", "nd0")],
    )
    await h.schedule("r5")
    await h.task()
    assert h.svc.policy.dispatched() == ["r5"]
    fail = RequestFailed(
        request_id="r5", prefill_node="np0", prefill_tx_id="np0-tx-d", reason="boom"
    )
    await h.nc.publish(subjects.conductor_events(CID), encode(fail))
    assert (await next_of(h.stores["np0"].aborts)).tx_id == "np0-tx-d"
    await wait_until(lambda: not h.svc.pending and h.svc.policy.dispatched() == [])


async def test_unmeetable_ttft_slo_is_429_before_any_allocation(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.5)],  # busy: an idle one would serve it anyway
        decodes=[("decode-0", "nd0")],
        ttft_slo_s=0.0001,
    )
    await h.schedule("r6")
    err = await h.event()
    assert isinstance(err, Error) and err.code == ErrorCode.REJECTED and err.retry_after_s >= 1.0
    assert h.stores["np0"].allocs.empty() and h.stores["nd0"].allocs.empty()


async def test_no_instances_is_503_and_bad_payload_is_400(harness):
    h = await harness.start([FakeStore(None, "np0")], prefills=[], decodes=[])
    await h.schedule("r7")
    err = await h.event()
    assert isinstance(err, Error) and err.code == ErrorCode.UNAVAILABLE
    await h.nc.publish(
        subjects.SCHEDULE,
        b'{"request_id": "r8", "reply_subject": "%s", "bogus": 1}' % h.inbox.encode(),
    )
    err = await h.event()
    assert isinstance(err, Error) and (err.request_id, err.code) == ("r8", ErrorCode.BAD_REQUEST)


async def test_kv_event_gap_triggers_a_dump(harness):
    store = FakeStore(None, "np0", held=HASHES[:1])
    h = await harness.start(
        [store, FakeStore(None, "nd0")], prefills=[("prefill-0", "np0", 0.0)], decodes=[]
    )
    while not store.dumps.empty():
        store.dumps.get_nowait()
    store.held = HASHES[:3]
    store.seq = 5
    batch = EventBatch(
        node="np0",
        epoch=EPOCH,
        seq=5,
        ts=time.time(),
        events=[BlockStored(block_hashes=HASHES[2:3])],
    )
    await h.nc.publish(subjects.kv_events("np0"), encode(batch))
    assert (await next_of(store.dumps)).cursor == 0
    await wait_until(lambda: h.svc.shadow.index.state("np0") == (EPOCH, 5))
    assert h.svc.shadow.index.match(HASHES) == {"np0": 3}


async def test_notice_for_a_request_placed_before_a_restart_still_commits(harness):
    h = await harness.start([FakeStore(None, "np0")], prefills=[], decodes=[])
    notice = FirstTokenNotice(
        request_id="old", prefill_node="np0", prefill_tx_id="np0-tx-old", ts=time.time()
    )
    await h.nc.publish(subjects.conductor_events(CID), encode(notice))
    assert await next_of(h.stores["np0"].commits) == TxCommit(tx_id="np0-tx-old", request_id="old")


async def test_sweep_forgets_expired_requests_and_silent_stores(harness):
    clock = ManualClock(1000.0)
    h = await harness.start(
        [FakeStore(None, "np0", held=HASHES[:1]), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0)],
        decodes=[("decode-0", "nd0")],
        clock=clock,
        ttft_slo_s=10.0,
        store_dead_after_s=5.0,
    )
    await h.schedule("r9")
    await h.task()
    assert set(h.svc.pending) == {"r9"} and h.svc.policy.dispatched() == ["r9"]
    assert h.svc.cfg.forget_after_s == 70.0  # 4 TTFT SLOs + 30 s
    clock.advance(69.0)
    h.svc.sweep()
    assert set(h.svc.pending) == {"r9"}
    assert h.svc.shadow.index.nodes() == []  # no announce for 69 s: both stores forgotten
    clock.advance(2.0)
    h.svc.sweep()
    assert h.svc.pending == {} and h.svc.policy.dispatched() == []


async def test_pd_controller_publishes_role_switches_and_the_old_role_is_forgotten(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "nd0"), FakeStore(None, "nd1")],
        prefills=[("prefill-0", "np0", 30.0)],  # load 1.0 against the 30 s TTFT SLO
        decodes=[("decode-0", "nd0"), ("decode-1", "nd1")],  # idle: load 0
        pd_controller=True,
        pd_interval_s=3600.0,  # stepped by hand below
        pd_min_samples=1,
        pd_cooldown_s=0.0,
        # Held still: the instances report once, and must stay alive however slowly
        # this test runs (only the role switch may take decode-0 out of its pool).
        clock=ManualClock(time.time()),
    )
    ctl = await h.nc.subscribe(subjects.CTL_ROLE)
    # Twice: nats-py's flush() PING can overtake a SUB still in its pending buffer.
    await h.nc.flush()
    await h.nc.flush()
    out = await h.svc.roles.step()
    # f_im = (0 + 1) / (1 + 1) = 0.5 < 1/1.5: one decode instance (the first by name) goes
    assert out == [RoleSwitch(instance="decode-0", role="prefill")]
    assert decode((await ctl.next_msg(timeout=5)).data, RoleSwitch) == out[0]
    await wait_until(lambda: h.svc.policy.live_decode() == ["decode-1"])
    assert h.svc.policy.live_prefill() == ["prefill-0"]
    assert (await h.svc.roles.step()) == []  # its samples were dropped with the change


async def test_role_switch_from_another_conductor_takes_the_instance_out_of_its_pool(harness):
    h = await harness.start(
        [FakeStore(None, "np0"), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0)],
        decodes=[("decode-0", "nd0")],
    )
    await h.nc.publish(subjects.CTL_ROLE, encode(RoleSwitch(instance="prefill-0", role="decode")))
    await wait_until(lambda: h.svc.policy.live_prefill() == [])
    await h.schedule("r11")
    err = await h.event()
    assert isinstance(err, Error) and err.code == ErrorCode.UNAVAILABLE


def test_config_selects_cost_model_adaptive_threshold_and_tbt_check(tmp_path):
    samples = [
        PrefillSample(n, p, CostModel().prefill_time(n, p))
        for n in (256, 1024, 4096)
        for p in (0, n // 2, n // 4)
    ]
    path = tmp_path / "cm.json"
    fit_cost_model(samples).save(path)
    cfg = ConductorConfig(
        cost_model=str(path),
        speedup=10.0,
        adaptive_threshold=True,
        balancing_threshold=3.0,
        tbt_check=False,
    )
    svc = ConductorService(None, cfg)
    assert isinstance(svc.cost, FittedCostModel) and svc.cost.speedup == 10.0
    assert svc.policy.adaptive is not None and svc.policy.threshold() == 3.0
    assert svc.policy.tbt_check is False and svc.roles.pd is None
    plain = ConductorService(None, ConductorConfig())
    assert (
        type(plain.cost) is CostModel
        and plain.policy.adaptive is None
        and plain.policy.threshold() == 2.0
    )


async def test_a_notice_settles_transactions_only_from_a_worker_on_their_node(nats_url):
    """Any worker may publish on the conductor's events subject, under its own name: a
    notice from decode-0 (node nd0) naming np1's prefill tx commits nothing there; the
    same from prefill-1, whose node it is, commits it."""
    h = Harness(nats_url)
    await h.start(
        [FakeStore(None, "np0"), FakeStore(None, "np1", held=HASHES[:2]), FakeStore(None, "nd0")],
        prefills=[("prefill-0", "np0", 0.0), ("prefill-1", "np1", 0.0)],
        decodes=[("decode-0", "nd0")],
    )
    try:
        # The impostor's notice is taken first and, were it believed, would send its
        # commit first (its handler reaches the commit before awaiting anything).
        for sender, tx in (("decode-0", "tx-evil"), ("prefill-1", "tx-1")):
            notice = FirstTokenNotice(
                request_id=f"r-{tx}", prefill_node="np1", prefill_tx_id=tx, ts=time.time()
            )
            await h.nc.publish(subjects.conductor_events(CID, sender), encode(notice))
        await h.nc.flush()
        commit = await asyncio.wait_for(h.stores["np1"].commits.get(), 5)
        assert commit.tx_id == "tx-1"
    finally:
        await h.close()
