"""The store service of one node: a thin adapter around :class:`BlockPool` and the arena.

Lifecycle::

    start: create the shared-memory arena, bind the ZeroMQ ROUTER (data-plane
           coordination) and start the transfer engines (shm, TCP, RDMA: the bytes),
           subscribe the control endpoints, announce StoreInfo
    serve: NATS  perigee.store.<node>.tx.allocate  TxAllocate -> TxHandle | Refused
                 perigee.store.<node>.tx.commit    TxCommit   -> TxDone | Refused
                 perigee.store.<node>.tx.abort     TxAbort    -> TxDone | Refused
                 perigee.store.<node>.tx.renew     TxRenew    -> TxRenewed (lease holders)
                 perigee.store.<node>.dump         DumpRequest -> DumpPage
                 perigee.store.<node>.info         (anything) -> StoreInfo
                 perigee.store.discover            (anything) -> an announce now (no reply)
                 perigee.store.<node>.stats        (anything) -> WorkerStats(role="store")
                 perigee.store.<node>.clear        ClearRequest -> ClearDone (AllBlocksCleared)
                 perigee.store.<node>.replay       ReplayRequest -> ReplayPage (recent batches)
                 perigee.store.<node>.obj.stat     ObjectKey -> ObjectDone
                 perigee.store.<node>.obj.remove   ObjectKey -> ObjectDone
                 perigee.store.<node>.obj.replicate ObjectReplicate -> ObjectDone | Refused
                 perigee.ctl.kv.replicate          Replicate (acted on by dest_node's store)
           TCP   object put/get on StoreInfo.obj_addr (services.store.node.object_server)
           tasks data-plane   ROUTER loop (SHIP/PULL from workers, OPEN/CLOSE from peers;
                              services.store.node.data_plane), grant sweep
                 announce     StoreInfo on perigee.store.<node>.announce every announce
                              interval (and on a discovery); the other stores' feed the
                              node registry, each believed only on its own node's subject
                 lease-sweep  aborts transactions whose lease ran out, drops expired pins
                 kv-events    publishes EventBatch on perigee.kv.events.<node> in seq order,
                              into the JetStream stream (services.common.kv_stream)
                 write-back   copies committed DRAM blocks to SSD (--ssd-dir), persists
                              the SSD index; a restart reloads it (new epoch, BlockStored)
    stop:  unsubscribe, cancel tasks, close sockets, close and unlink the arena

Every pool operation that changes what the node holds queues KV events in the pool;
when the operation returns, the pool calls the one place that collects them
(:meth:`StoreService._collect`, its ``on_change`` hook): they get the next sequence
number (from 1, per epoch; epoch = start time in ns) in the same synchronous step, so
a dump taken at ``seq`` is exactly the state after batch ``seq``. Tier moves
(promotions from SSD, demotions, offloads) the pool asks for run in that same step,
before anything else touches the pool. Tiering, objects and replication get the
:class:`~services.store.node.store_core.StoreCore` (pool, arena, block geometry), not the service.
"""

import asyncio
import socket
import time
from typing import Any

import structlog
import zmq.asyncio
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode, encode
from bus_schemas.control import (
    ClearDone,
    ClearRequest,
    DumpPage,
    DumpRequest,
    ObjectDone,
    ObjectKey,
    ObjectReplicate,
    Refused,
    ReplayPage,
    ReplayRequest,
    Replicate,
    StoreInfo,
    TxAbort,
    TxAllocate,
    TxCommit,
    TxDone,
    TxHandle,
    TxRenew,
    TxRenewed,
)
from bus_schemas.kv_events import EventBatch, KVEvent
from bus_schemas.load import WorkerStats
from services.common import defaults, kv_stream
from services.common.bus import Subscriptions, js_publish, publish, sync
from services.common.clock import Clock, WallClock
from services.common.incarnation import new_incarnation
from services.common.tasks import cancel_and_wait
from services.store.arena import Arena
from services.store.node import tiering
from services.store.node.data_plane import TRANSPORTS, DataPlane
from services.store.node.object_server import ObjectServer
from services.store.node.object_service import ObjectService
from services.store.node.replication import Replicator
from services.store.node.store_core import StoreCore
from services.store.pool.block_pool import BlockPool
from services.store.pool.registry import NodeRegistry
from services.transfer.backends import shm as shm_transport
from tracing import inject

log = structlog.get_logger()

PUBLISH_WINDOW = 256  # KV-event batches awaiting the stream's acks at once
# KV-event batches waiting to be published, at most: past it (the bus is down or slower
# than the pool) the oldest are dropped, and consumers see the sequence gap and dump.
MAX_OUTBOX = 16_384
ANNOUNCE_MIN_GAP_S = 0.05  # announces at most this often, however many discoveries ask


class StoreService:
    """One node's store: control endpoints, KV events and the data plane around its pool."""

    def __init__(
        self,
        nc: NATS,
        *,
        node: str,
        block_size: int = defaults.BLOCK_SIZE,
        block_bytes: int = 131072,
        capacity_blocks: int = 2048,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        announce_interval_s: float = 1.0,
        sweep_interval_s: float = 0.25,
        peer_timeout_s: float = 5.0,
        transports: tuple[str, ...] = TRANSPORTS,
        shm_copy_threads: int = 2,
        prefault: bool = True,
        clock: Clock | None = None,
        ssd_dir: str | None = None,
        ssd_capacity_blocks: int = 0,
        vram_capacity_blocks: int = 0,
        replay_batches: int = 1024,
    ) -> None:
        self.nc = nc
        self.node = node
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.capacity = capacity_blocks
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.announce_interval_s = announce_interval_s
        self.sweep_interval_s = sweep_interval_s
        self.peer_timeout_s = peer_timeout_s
        self.transports = transports
        self.shm_copy_threads = shm_copy_threads
        self.clock = clock or WallClock()
        self.prefault = prefault
        self.epoch = new_incarnation()  # its incarnation: a restart is a new store
        self.seq = 0
        self.ssd_dir = ssd_dir
        if ssd_dir is None:
            ssd_capacity_blocks = 0
        self.pool = BlockPool(
            capacity_blocks,
            block_size,
            self.clock,
            id_prefix=f"{node}-{self.epoch}-",
            random_ids=True,
            ssd_capacity=ssd_capacity_blocks,
            vram_capacity=vram_capacity_blocks if tiering.vram_ok(vram_capacity_blocks) else 0,
        )
        self.core = StoreCore(
            node=node,
            epoch=self.epoch,
            pool=self.pool,
            block_size=block_size,
            block_bytes=block_bytes,
            clock=self.clock,
        )
        self.objects = ObjectService(self.core)
        self.tiers = tiering.Tiers(
            self.core, self.objects, ssd_dir=ssd_dir, vram_capacity_blocks=vram_capacity_blocks
        )
        self.replicas = Replicator(self.core, nc, self.objects, peer_timeout_s=peer_timeout_s)
        self.obj_server: ObjectServer | None = None
        # Where SHIP / PULL may go: stores that announced themselves (StoreInfo).
        self.registry = NodeRegistry(
            node,
            wait_s=max(3.0, 3 * announce_interval_s),
            stale_s=max(30.0, 30 * announce_interval_s),
        )
        self.replay = tiering.ReplayBuffer(replay_batches)
        self.arena: Arena | None = None
        self.data: DataPlane | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._subs = Subscriptions(nc)
        self._raw_subs: list[Any] = []
        self._outbox: asyncio.Queue[EventBatch] = asyncio.Queue()
        self.outbox_dropped = 0
        self._announce_now = asyncio.Event()  # a discovery asked for an announce
        self._tasks: list[asyncio.Task] = []
        # Set when a background task dies: the process should exit (and be restarted).
        self.failed = asyncio.Event()
        # Set once every endpoint is subscribed: events (e.g. the SSD blocks a restart
        # reloads) go out only when a consumer can already ask for a dump or replay.
        self._serving = asyncio.Event()
        self.pool.on_change = self._collect

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        swept = shm_transport.sweep_stale()
        if swept:
            log.info("stale_shm_files_removed", node=self.node, files=swept)
        self.arena = Arena.create(self.capacity, self.block_bytes)
        # Its pages are mapped while it serves: all at once took 1.2-6 s for a 2 GB
        # arena, the restarted store answering nothing meanwhile. An older kernel
        # writes zeros instead, which only an arena not yet in use may get.
        populate = self.prefault and self.arena.populates()
        if self.prefault and not populate:
            self.arena.prefault()
        self.core.arena = self.arena
        self._ctx = zmq.asyncio.Context()
        advertise = self.advertise_host
        if advertise is None and self.host in ("0.0.0.0", "*"):
            advertise = socket.gethostname()
        self.data = DataPlane(
            self._ctx,
            self.pool,
            self.arena,
            self.epoch,
            host=self.host,
            port=self.port,
            advertise_host=advertise,
            peer_timeout_s=self.peer_timeout_s,
            transports=self.transports,
            sweep_interval_s=self.sweep_interval_s,
            shm_copy_threads=self.shm_copy_threads,
            known_peer=self.registry.knows,
            peer_socket=self.registry.ctl_path,
        )
        self.replicas.data = self.data
        self._raw_subs.append(await self.nc.subscribe(subjects.STORE_ANNOUNCE, cb=self._announced))
        self.obj_server = ObjectServer(self.objects)
        await self.obj_server.start(self.host, advertise)
        self.tiers.open()  # SSD files / GPU memory; reloads what a previous run left on SSD
        loop = asyncio.get_running_loop()
        for name, coro in (
            ("data-plane", self.data.run()),
            ("kv-events", self._publish_events()),
            ("lease-sweep", self._sweep()),
            ("announce", self._announce()),
            ("write-back", self.tiers.run_writeback()),
        ):
            self._tasks.append(loop.create_task(coro, name=f"store:{name}"))
            self._tasks[-1].add_done_callback(self._task_died)
        ctl = subjects.store_ctl
        await self._subs.serve(ctl(self.node, "tx.allocate"), TxAllocate, self._allocate)
        await self._subs.serve(ctl(self.node, "tx.commit"), TxCommit, self._commit)
        await self._subs.serve(ctl(self.node, "tx.abort"), TxAbort, self._abort)
        await self._subs.serve(ctl(self.node, "tx.renew"), TxRenew, self._renew)
        await self._subs.serve(ctl(self.node, "dump"), DumpRequest, self._dump)
        await self._subs.serve(ctl(self.node, "clear"), ClearRequest, self._clear)
        await self._subs.serve(ctl(self.node, "replay"), ReplayRequest, self._replay)
        await self._subs.serve(ctl(self.node, "obj.stat"), ObjectKey, self._obj_stat)
        await self._subs.serve(ctl(self.node, "obj.remove"), ObjectKey, self._obj_remove)
        await self._subs.serve(
            ctl(self.node, "obj.replicate"), ObjectReplicate, self._obj_replicate, concurrent=True
        )
        await self._subs.serve(subjects.CTL_REPLICATE, Replicate, self._replicate, concurrent=True)
        for subject, reply in (
            (ctl(self.node, "info"), self.info),
            (subjects.worker_stats("store", self.node), self.stats),
        ):
            self._raw_subs.append(await self.nc.subscribe(subject, cb=self._answer(reply)))
        self._raw_subs.append(await self.nc.subscribe(subjects.STORE_DISCOVER, cb=self._discover))
        await sync(self.nc)  # its subscriptions are live on the server from here
        self._serving.set()
        log.info(
            "store_started",
            node=self.node,
            epoch=self.epoch,
            data_addr=self.data.data_addr,
            shm=self.arena.name,
            capacity_blocks=self.capacity,
            block_bytes=self.block_bytes,
        )
        if populate:  # once it serves: the mapping's chunks then wait between requests
            self._tasks.append(loop.create_task(self._populate(), name="store:prefault"))
            self._tasks[-1].add_done_callback(self._task_died)

    async def stop(self, flush_s: float = 5.0) -> None:
        for s in self._raw_subs:
            try:
                await s.unsubscribe()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
        await self._subs.close()
        if not await self.tiers.flush(flush_s):
            log.warning(
                "writeback_not_flushed", node=self.node, pending=self.pool.writeback_pending()
            )
        await cancel_and_wait(self._tasks)
        if self.data is not None:
            await self.data.close()
        if self.obj_server is not None:
            await self.obj_server.close()
        self.tiers.close()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
        if self.arena is not None:
            self.arena.close()
            self.arena.unlink()
        log.info("store_stopped", node=self.node)

    # ---------------------------------------------------------------- views

    def info(self) -> StoreInfo:
        assert self.arena is not None and self.data is not None
        return StoreInfo(
            node=self.node,
            epoch=self.epoch,
            seq=self.seq,
            data_addr=self.data.data_addr,
            shm_name=self.arena.name,
            block_size=self.block_size,
            block_bytes=self.block_bytes,
            capacity_blocks=self.capacity,
            used_blocks=self.pool.used_blocks,
            host=socket.gethostname(),
            ts=time.time(),
            obj_addr=self.obj_server.addr if self.obj_server is not None else "",
            ctl_path=self.data.ctl_path,
        )

    def stats(self) -> WorkerStats:
        counters = {
            **self.pool.stats(),
            **(self.data.counters if self.data else {}),
            **(self.data.security_counters() if self.data else {}),
            **self.objects.counters,
            **(self.obj_server.counters if self.obj_server else {}),
        }
        counters["seq"] = self.seq
        counters["kv_outbox"] = self._outbox.qsize()
        counters["kv_outbox_dropped"] = self.outbox_dropped
        counters["known_stores"] = len(self.registry)
        counters["ssd_index_dirty"] = int(self.pool.ssd_dirty)  # SSD blocks not yet in the index
        return WorkerStats(instance=self.node, node=self.node, role="store", counters=counters)

    # ---------------------------------------------------------------- handlers

    async def _allocate(self, req: TxAllocate, _m: NatsMsg) -> TxHandle | Refused:
        with structlog.contextvars.bound_contextvars(request_id=req.request_id):
            result = self.pool.allocate(req)
            if isinstance(result, Refused):
                log.info("tx_refused", reason=result.reason, detail=result.message)
                return result
            assert self.arena is not None and self.data is not None
            return TxHandle(
                tx_id=result.tx_id,
                node=self.node,
                epoch=self.epoch,
                slots=result.slots,
                hit_blocks=result.hit_blocks,
                shm_name=self.arena.name,
                data_addr=self.data.data_addr,
                block_bytes=self.block_bytes,
                expires_at=time.time() + req.lease_s,
            )

    async def _commit(self, req: TxCommit, _m: NatsMsg) -> TxDone | Refused:
        with structlog.contextvars.bound_contextvars(request_id=req.request_id):
            assert self.data is not None
            return await self.data.commit(req.tx_id, req.request_id)

    async def _abort(self, req: TxAbort, _m: NatsMsg) -> TxDone | Refused:
        with structlog.contextvars.bound_contextvars(request_id=req.request_id):
            result = self.pool.abort(req.tx_id)
            log.info(
                "tx_aborted", tx_id=req.tx_id, reason=req.reason, ok=isinstance(result, TxDone)
            )
            return result

    async def _renew(self, req: TxRenew, _m: NatsMsg) -> TxRenewed:
        renewed = [t for t in req.tx_ids if self.pool.renew(t, req.lease_s)]
        unknown = [t for t in req.tx_ids if t not in set(renewed)]
        if unknown:
            log.info("tx_renew_unknown", request_id=req.request_id, tx_ids=unknown)
        return TxRenewed(expires_at=time.time() + req.lease_s, renewed=renewed, unknown=unknown)

    async def _dump(self, req: DumpRequest, _m: NatsMsg) -> DumpPage:
        hashes, nxt = self.pool.dump(req.cursor, req.limit)
        if self.objects.block_hashes:  # objects are not KV: kept out of dumps as of events
            hashes = [h for h in hashes if h not in self.objects.block_hashes]
        return DumpPage(
            node=self.node, epoch=self.epoch, seq=self.seq, block_hashes=hashes, next_cursor=nxt
        )

    async def _clear(self, req: ClearRequest, _m: NatsMsg) -> ClearDone:
        removed = self.pool.clear()
        log.warning("store_cleared", removed=len(removed), reason=req.reason)
        return ClearDone(
            node=self.node,
            epoch=self.epoch,
            seq=self.seq,
            removed_blocks=len(removed),
            kept_blocks=self.pool.cached_blocks,
        )

    async def _replay(self, req: ReplayRequest, _m: NatsMsg) -> ReplayPage:
        batches, complete = self.replay.after(req.after_seq, req.limit)
        return ReplayPage(
            node=self.node, epoch=self.epoch, seq=self.seq, complete=complete, batches=batches
        )

    async def _obj_stat(self, req: ObjectKey, _m: NatsMsg) -> ObjectDone:
        size = self.objects.stat(req.key)
        return ObjectDone(
            key=req.key,
            node=self.node,
            size=size or 0,
            present=size is not None,
            block_hashes=self.objects.hashes(req.key) if size is not None else [],
        )

    async def _obj_remove(self, req: ObjectKey, _m: NatsMsg) -> ObjectDone:
        return ObjectDone(key=req.key, node=self.node, present=self.objects.remove(req.key))

    async def _obj_replicate(self, req: ObjectReplicate, _m: NatsMsg) -> ObjectDone | Refused:
        return await self.replicas.copy_object(req)

    async def _replicate(self, req: Replicate, _m: NatsMsg) -> Any:
        if req.dest_node != self.node:
            return None  # another store's job
        return await self.replicas.copy_blocks(req)

    async def _announced(self, m: NatsMsg) -> None:
        try:
            info = decode(m.data, StoreInfo)
        except BadMessage:
            log.warning("bad_announcement", subject=m.subject)
            return
        if not subjects.announced_by(m.subject, info.node):
            # only the node's own login may publish its subject: a store claiming another
            log.warning("store_announce_impostor", subject=m.subject, claimed=info.node)
            return
        self.registry.seen(info)

    async def _discover(self, _m: NatsMsg) -> None:
        """A discovery: announce now, on our own subject (a reply on the asker's inbox
        would prove nothing of who sent it). Discoveries in a burst make one announce."""
        self._announce_now.set()

    def _answer(self, make: Any):
        async def cb(m: NatsMsg) -> None:
            if m.reply:
                try:
                    await self.nc.publish(m.reply, encode(make()))
                except Exception:  # noqa: BLE001 - keep serving
                    log.exception("reply_failed", subject=m.subject)

        return cb

    # ---------------------------------------------------------------- tasks

    def _collect(self) -> None:
        """The pool's ``on_change`` hook, after each of its operations: run the tier moves
        it queued, in order, then give its KV events (objects' blocks left out) the
        next sequence number. The one place pool events leave the pool."""
        self.tiers.run_moves()
        events = self.pool.take_events()
        if events:
            self._emit(self.objects.kv_only(events))

    def _emit(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = EventBatch(
            node=self.node, epoch=self.epoch, seq=self.seq, ts=time.time(), events=events
        )
        self.replay.add(batch)
        if self._outbox.qsize() >= MAX_OUTBOX:
            self._outbox.get_nowait()  # a gap, which consumers repair with a dump
            self.outbox_dropped += 1
        self._outbox.put_nowait(batch)

    async def _publish_events(self) -> None:
        """Each batch into the KV-event stream (services.common.kv_stream), acked, once
        per ``<node>.<epoch>.<seq>``; the previous epoch's batches are purged first, so the
        stream holds this incarnation only. Without JetStream, or past the publish's
        bound, a batch goes out on core NATS alone (live consumers get it; a conductor
        replaying the stream later sees the gap and dumps this node)."""
        subject = subjects.kv_events(self.node)
        await self._serving.wait()
        js = self.nc.jetstream(timeout=self.peer_timeout_s)
        durable = True
        try:
            await kv_stream.ensure(js)
            await js.purge_stream(kv_stream.STREAM, subject=subject)
        except Exception as e:  # noqa: BLE001 - a bus without JetStream still carries events
            durable = False
            log.warning("kv_stream_unavailable", error=f"{type(e).__name__}: {e}")
        while True:
            # What queued meanwhile goes out together, its acks awaited at once (one
            # connection: the first tries reach the stream in seq order).
            window = [await self._outbox.get()]
            while len(window) < PUBLISH_WINDOW and not self._outbox.empty():
                window.append(self._outbox.get_nowait())
            if durable:
                acks = await asyncio.gather(
                    *(
                        js_publish(
                            js,
                            subject,
                            encode(b),
                            headers=inject(),
                            msg_id=kv_stream.msg_id(self.node, b.epoch, b.seq),
                            timeout=self.peer_timeout_s,
                        )
                        for b in window
                    ),
                    return_exceptions=True,
                )
                failed = [
                    (b, a)
                    for b, a in zip(window, acks, strict=True)
                    if isinstance(a, BaseException)
                ]
                for b, a in failed:  # the live path must not stall
                    log.warning(
                        "kv_stream_publish_failed", seq=b.seq, error=f"{type(a).__name__}: {a}"
                    )
                window = [b for b, _ in failed]
            for batch in window:
                try:
                    await publish(self.nc, subject, batch)
                except Exception:  # noqa: BLE001 - consumers recover gaps with a dump
                    log.exception("kv_event_publish_failed", seq=batch.seq)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            for tx_id in self.pool.expire():
                log.warning("tx_lease_expired", tx_id=tx_id)

    async def _announce(self) -> None:
        subject = subjects.store_announce(self.node)
        while True:
            self._announce_now.clear()
            try:
                await publish(self.nc, subject, self.info())
            except Exception:  # noqa: BLE001 - try again next tick
                log.exception("announce_failed")
            # the next tick, or a discovery (a flood of them: one announce per 50 ms)
            await asyncio.sleep(min(ANNOUNCE_MIN_GAP_S, self.announce_interval_s))
            try:
                await asyncio.wait_for(
                    self._announce_now.wait(),
                    max(0.0, self.announce_interval_s - ANNOUNCE_MIN_GAP_S),
                )
            except TimeoutError:
                pass

    async def _populate(self) -> None:
        assert self.arena is not None
        t0 = time.monotonic()
        complete = await self.arena.populate()
        log.info(
            "arena_prefaulted",
            node=self.node,
            seconds=round(time.monotonic() - t0, 2),
            complete=complete,
        )

    def _task_died(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("store_task_died", task=task.get_name(), error=repr(task.exception()))
            self.failed.set()
