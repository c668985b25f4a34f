"""The conductor's shadow view of every node's blocks (paper §5.3, stateless conductor).

Lifecycle of a node in the view:

    unseen --StoreInfo (an announce, periodic or asked by STORE_DISCOVER) or first KV batch-->
    DUMPING (index buffers the node's batches; "dump" pages fetched over store_ctl)
    --pages complete--> SYNCED (KV batches applied in sequence)
    SYNCED --gap in seq / new epoch with seq > 1 / announce shows the view lagging
        behind a seq it announced one period earlier--> DUMPING
    any --store silent for store_dead_after_s--> REMOVED (a later sighting starts over)

On start the service reads the KV-event stream (services.common.kv_stream) from its
beginning with an ordered JetStream consumer that then goes on with the live batches,
so a restarted conductor rebuilds each node's view from its current epoch's batches
without asking the store; only a node whose replay does not start at seq 1 (the
stream's per-node limit dropped its oldest batches) or lags its announce is dumped.
Replayed batches are history: they do not make their store look alive (a store that
died stays dead to the view until it announces again). Once the replay caught up (or
after ``replay_timeout_s``), the service subscribes to announces and publishes
STORE_DISCOVER, which makes every store announce at once; later announces catch a store
that missed the discovery window. An announce is believed only on its node's own
subject (``perigee.store.<node>.announce``, which only that node's login may publish);
a discovery has no reply on an inbox, which would prove nothing of its sender. Without
JetStream the view falls back to a core subscription and dumps every node it discovers.
"""

import asyncio

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg as NatsMsg
from nats.js.api import DeliverPolicy

from bus_schemas import subjects
from bus_schemas.codec import BadMessage, decode
from bus_schemas.control import DumpPage, DumpRequest, StoreInfo
from bus_schemas.kv_events import EventBatch
from services.common import bus, kv_stream
from services.common.clock import Clock
from services.common.liveness import OrderedLiveness
from services.conductor.prefix_index import Matches, PrefixIndex
from tracing import inject

log = structlog.get_logger()


class ShadowView:
    """Keeps the prefix index in step with every store: dumps, replays and live KV events."""

    def __init__(
        self,
        nc: NATS,
        subs: bus.Subscriptions,
        clock: Clock,
        *,
        store_dead_after_s: float = 5.0,
        request_timeout_s: float = 2.0,
        dump_page_blocks: int = 20_000,
        replay_timeout_s: float = 10.0,
    ) -> None:
        self.nc = nc
        self.subs = subs
        self.index = PrefixIndex()
        self.stores = OrderedLiveness(clock, store_dead_after_s)
        self.request_timeout_s = request_timeout_s
        self.dump_page_blocks = dump_page_blocks
        self._dumping: set[str] = set()
        self._announced: dict[str, tuple[int, int]] = {}
        self.dumps_done = 0  # completed dumps, for tests and stats
        self.replay_timeout_s = replay_timeout_s
        self.catch_up = kv_stream.CatchUp(0)
        self.caught_up = asyncio.Event()  # the stream's history is in the index
        self.durable = False  # following the JetStream stream (else core NATS only)
        self.clock = clock
        self._live_since: float | None = None  # first sweep after the replay
        self._gone: set[str] = set()  # swept as silent, until the store shows up again
        self._unseen: set[str] = set()  # index nodes the liveness book does not know
        self._unseen_stamp: tuple[int, int] | None = None
        # Nodes announced during each discovery under way (start's and a caller's can overlap).
        self._discovering: list[set[str]] = []

    async def start(self, discover_window_s: float = 0.5) -> None:
        """Follow the KV events (the stream's history first), then in the background
        subscribe to announces and discover the stores once the history is in
        (placement works meanwhile, just without the cache view)."""
        await self._follow_events()
        await bus.sync(self.nc)
        self.subs.spawn(self._bootstrap(discover_window_s), name="conductor:discover")

    async def _follow_events(self) -> None:
        js = self.nc.jetstream(timeout=self.request_timeout_s)
        try:
            await kv_stream.ensure(js)
            info = await js.stream_info(kv_stream.STREAM)
            self.catch_up = kv_stream.CatchUp(info.state.messages)
            sub = await js.subscribe(
                subjects.KV_EVENTS_ALL,
                stream=kv_stream.STREAM,
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
                cb=self._on_stream_msg,
            )
            self.subs.adopt(sub)
            self.durable = True
        except Exception as e:  # noqa: BLE001 - a bus without JetStream: live events only
            log.warning("kv_stream_unavailable", error=f"{type(e).__name__}: {e}")
            self.catch_up = kv_stream.CatchUp(0)
            await self.subs.serve(
                subjects.KV_EVENTS_ALL, EventBatch, self._on_batch, span_name="conductor.kv_events"
            )
        if self.catch_up.done:
            self.caught_up.set()

    async def _bootstrap(self, discover_window_s: float) -> None:
        try:
            await asyncio.wait_for(self.caught_up.wait(), self.replay_timeout_s)
        except TimeoutError:
            log.warning("kv_stream_replay_slow", replayed=self.catch_up.replayed)
        log.info(
            "kv_stream_replayed",
            batches=self.catch_up.replayed,
            nodes=self.index.nodes(),
            durable=self.durable,
        )
        await self.subs.serve(
            subjects.STORE_ANNOUNCE,
            StoreInfo,
            self._on_announce,
            span_name="conductor.store_announce",
        )
        await self.discover(discover_window_s)

    async def _on_stream_msg(self, m: NatsMsg) -> None:
        try:
            history = self.catch_up.on_message(m.metadata.num_pending)
        except Exception:  # noqa: BLE001 - not a stream delivery (no metadata): live
            history = False
        if self.catch_up.done:
            self.caught_up.set()
        try:
            batch = decode(m.data, EventBatch)
        except BadMessage as e:
            log.warning("bad_kv_batch", subject=m.subject, error=str(e))
            return
        if not subjects.named_by(m.subject, batch.node):
            log.warning("kv_events_impostor", subject=m.subject, claimed=batch.node)
            return
        self.apply(batch, live=not history)

    # ------------------------------------------------------------ queries

    def match(self, block_hashes: list[int] | tuple[int, ...]) -> Matches:
        """Prefix length in blocks per node whose store is alive: the index's match less
        the nodes whose store is silent or was never seen alive (O(those), not a step
        per matched node: a prefix a thousand nodes hold is one group)."""
        return self.index.match(block_hashes).without(self._not_alive())

    def _not_alive(self) -> set[str]:
        """The index's nodes whose store is not alive now: the silent ones (in time
        order, O(silent)) and those the liveness book does not know (kept as a set,
        built again only when either side's names change)."""
        stamp = (self.index.ids_version, self.stores.names_version)
        if stamp != self._unseen_stamp:
            self._unseen = set(self.index.node_names()).difference(self.stores.names())
            self._unseen_stamp = stamp
        silent = self.stores.silent()
        return self._unseen.union(silent) if silent else self._unseen

    def down(self) -> set[str]:
        """Nodes whose store was seen and has gone silent (or was swept since), until it
        shows up again: placement keeps their instances out (services.conductor.migrated_placement)."""
        # The silent stores in time order, not a walk over every node (issue 27).
        silent = {n for n in self.stores.silent() if self.index.state(n) is not None}
        return silent | self._gone

    # ------------------------------------------------------------ inputs

    async def discover(self, window_s: float) -> list[str]:
        """Ask every store to announce itself now; returns the nodes whose announce (on
        their own subject, to the subscription :meth:`start` made) came within
        ``window_s``. Each is handled as any announce (dumped when new)."""
        found: set[str] = set()
        self._discovering.append(found)
        try:
            await self.nc.publish(subjects.STORE_DISCOVER, b"{}", headers=inject())
            await asyncio.sleep(window_s)
        finally:
            self._discovering = [f for f in self._discovering if f is not found]
        log.info("stores_discovered", nodes=sorted(found))
        return sorted(found)

    def on_info(self, info: StoreInfo) -> None:
        self.stores.seen(info.node)
        self._gone.discard(info.node)
        state = self.index.state(info.node)
        prev = self._announced.get(info.node)
        self._announced[info.node] = (info.epoch, info.seq)
        if state is None or info.epoch > state[0]:
            self.request_dump(info.node)
        elif (
            info.epoch == state[0]
            and not self.index.resyncing(info.node)
            and prev is not None
            and prev[0] == info.epoch
            and state[1] < prev[1]
        ):
            # One announce period later we still have not seen a batch the store had
            # already published: it was lost (a trailing gap no later batch reveals).
            self.request_dump(info.node)

    async def _on_announce(self, info: StoreInfo, m: NatsMsg) -> None:
        if not subjects.announced_by(m.subject, info.node):
            log.warning("store_announce_impostor", subject=m.subject, claimed=info.node)
            return
        for found in self._discovering:
            found.add(info.node)
        self.on_info(info)

    async def _on_batch(self, batch: EventBatch, m: NatsMsg) -> None:
        if not subjects.named_by(m.subject, batch.node):
            log.warning("kv_events_impostor", subject=m.subject, claimed=batch.node)
            return
        self.apply(batch)

    def apply(self, batch: EventBatch, live: bool = True) -> None:
        """One node's batch; a ``live`` one is also a sign that its store is alive."""
        if live:
            self.stores.seen(batch.node)
            self._gone.discard(batch.node)
        if self.index.apply(batch):
            log.info("kv_events_gap", node=batch.node, epoch=batch.epoch, seq=batch.seq)
            self.request_dump(batch.node)

    # ------------------------------------------------------------ dumps

    def request_dump(self, node: str) -> None:
        if node in self._dumping:
            return
        self._dumping.add(node)
        self.index.begin_resync(node)
        self.subs.spawn(self._dump(node), name=f"dump:{node}")

    async def _dump(self, node: str) -> None:
        again = False
        try:
            first: DumpPage | None = None
            hashes: list[int] = []
            cursor = 0
            while True:
                page = await bus.request(
                    self.nc,
                    subjects.store_ctl(node, "dump"),
                    DumpRequest(cursor=cursor, limit=self.dump_page_blocks),
                    DumpPage,
                    timeout=self.request_timeout_s,
                )
                if first is None:
                    first = page
                elif page.epoch != first.epoch:
                    raise RuntimeError("store restarted during the dump")
                hashes.extend(page.block_hashes)
                if page.next_cursor is None:
                    break
                cursor = page.next_cursor
            again = self.index.replace_node(node, first.epoch, first.seq, hashes)
            self.dumps_done += 1
            log.info(
                "store_dumped", node=node, epoch=first.epoch, seq=first.seq, blocks=len(hashes)
            )
        except Exception as e:  # noqa: BLE001 - a dead or slow store must not stop the conductor
            log.warning("store_dump_failed", node=node, error=f"{type(e).__name__}: {e}")
            self.index.dump_failed(node)
        finally:
            self._dumping.discard(node)
        if again:
            self.request_dump(node)

    # ------------------------------------------------------------ housekeeping

    def sweep(self) -> list[str]:
        """Drop nodes whose store went silent; returns them. A node known only from the
        stream's history gets one ``store_dead_after_s`` after the replay to show that it
        is alive (announce, discovery reply or a live batch); none is dropped before."""
        if not self.caught_up.is_set():
            return []
        now = self.clock.now()
        if self._live_since is None:
            self._live_since = now
        grace = now - self._live_since <= self.stores.dead_after_s
        gone = [
            n
            for n in self.index.nodes()
            if not self.stores.alive(n)
            and n not in self._dumping
            and (self.stores.known(n) or not grace)
        ]
        for n in gone:
            self.index.remove_node(n)
            self.stores.forget(n)
            self._announced.pop(n, None)
            self._gone.add(n)
            log.info("store_gone", node=n)
        return gone
