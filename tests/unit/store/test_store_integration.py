"""Two real store processes on a real nats-server: ship, pull, events, errors.

Stores are started once for the module; each test uses its own block hashes.
Readiness is awaited by polling the store's ``info`` endpoint with a deadline.
"""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import nats
import pytest
import zmq
import zmq.asyncio

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import (
    DumpPage,
    DumpRequest,
    Refused,
    TxAbort,
    TxAllocate,
    TxCommit,
    TxDone,
    TxDoneReply,
    TxHandle,
    TxReply,
    TxRole,
)
from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import WorkerStats
from bus_schemas.placement import RemotePrefix
from perigee.natsd import free_port
from services.common.bus import ERROR_HEADER, request
from services.store.client.store_client import StoreClient, TransferError, _channel_to, fetch_info
from services.transfer import data_auth, wire
from services.transfer.channel import Channel, ChannelError
from services.transfer.local_channel import LocalChannel

ROOT = Path(__file__).resolve().parents[3]
BS = 4  # tokens per block
BB = 64 * 1024  # bytes per block: 4 "layers" of 16 KiB
LAYER = BB // 4
pytestmark = pytest.mark.timeout(120)


def start_store(nats_url: str, node: str, log_dir: str) -> subprocess.Popen:
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(log_dir, f"{node}.log"), "wb") as log:  # the child keeps its own fd
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
                "32",
                "--peer-timeout",
                "1.0",
                "--announce-interval",
                "0.5",
                "--log-level",
                "INFO",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def stop_store(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="module")
def stores(nats_server):
    with tempfile.TemporaryDirectory(prefix="perigee-store-test-") as logs:
        procs = {node: start_store(nats_server.url, node, logs) for node in ("sa", "sb")}
        try:
            yield procs
        finally:
            codes = {node: stop_store(p) for node, p in procs.items()}
            if any(codes.values()):
                for node in procs:
                    print(Path(logs, f"{node}.log").read_text()[-4000:])
            assert codes == {"sa": 0, "sb": 0}


@pytest.fixture
async def env(stores, nats_url):
    nc = await nats.connect(nats_url)
    a = await StoreClient.connect(nc, "sa", timeout=30)
    b = await StoreClient.connect(nc, "sb", timeout=30)
    yield nc, a, b
    await a.close()
    await b.close()
    await nc.close()


async def tx(nc, node: str, role: TxRole, hashes: list[int], num_tokens: int, **kw) -> TxHandle:
    msg = TxAllocate(
        request_id=kw.pop("request_id", "r"),
        role=role,
        block_hashes=hashes,
        num_tokens=num_tokens,
        **kw,
    )
    reply = await request(nc, subjects.store_ctl(node, "tx.allocate"), msg, TxReply)
    assert isinstance(reply, TxHandle), reply
    return reply


async def commit(nc, node: str, h: TxHandle) -> TxDone | Refused:
    msg = TxCommit(tx_id=h.tx_id, request_id="r")
    return await request(nc, subjects.store_ctl(node, "tx.commit"), msg, TxDoneReply)


def fill(client: StoreClient, h: TxHandle, seed: int) -> list[bytes]:
    data = []
    for i, s in enumerate(h.slots):
        blob = bytes([(seed + i + k) % 251 for k in range(251)]) * (BB // 251) + bytes(BB % 251)
        client.slot(s)[:] = blob
        data.append(blob)
    return data


async def test_ship_two_layers_then_commit_publishes_blockstored(env):
    nc, a, b = env
    events = await nc.subscribe(subjects.kv_events("sa"))
    hashes = [101, 102, 103]
    src = await tx(nc, "sa", TxRole.PREFILL, hashes, 3 * BS + 1)
    dst = await tx(nc, "sb", TxRole.DECODE, hashes, 3 * BS + 1)
    assert (len(src.slots), src.hit_blocks, src.data_addr) == (4, 0, a.info.data_addr)
    assert a.local and b.local  # a worker's requests take its store's Unix socket
    data = fill(a, src, seed=1)
    blocks = [0, 1, 2, 3]
    await asyncio.gather(
        a.ship_layer(src, dst, 0, blocks, LAYER, 0),
        a.ship_layer(src, dst, 1, blocks, LAYER, LAYER),
    )
    for i, s in enumerate(dst.slots):
        assert bytes(b.slot(s)[: 2 * LAYER]) == data[i][: 2 * LAYER]
        assert bytes(b.slot(s)[2 * LAYER :]) == bytes(2 * LAYER)  # layers 2, 3 not shipped
    # layers 2 and 3 in one span: it reaches the slots' end, so it closes their grant
    await a.ship_layer(src, dst, 2, blocks, 2 * LAYER, 2 * LAYER)
    for i, s in enumerate(dst.slots):
        assert bytes(b.slot(s)) == data[i]

    assert await commit(nc, "sa", src) == TxDone(tx_id=src.tx_id, stored_blocks=3)
    batch = decode((await events.next_msg(timeout=5)).data, EventBatch)
    assert (batch.node, batch.epoch, batch.seq) == ("sa", a.info.epoch, 1)
    assert batch.events == [BlockStored(block_hashes=hashes)]
    page = await request(nc, subjects.store_ctl("sa", "dump"), DumpRequest(), DumpPage)
    assert (page.block_hashes, page.seq, page.next_cursor) == (hashes, 1, None)
    # every ship went under one grant (one OPEN); the commit waits for its CLOSE (the
    # last ship's OK did not: the writer read sb's slot generations), so the counters
    # are final
    assert await commit(nc, "sb", dst) == TxDone(tx_id=dst.tx_id, stored_blocks=3)
    stats = await request(nc, subjects.worker_stats("store", "sb"), {}, WorkerStats)
    assert stats.role == "store"
    assert stats.counters["grants_served"] == 1
    # sa's OPEN and CLOSE took sb's Unix socket (same host), not ZeroMQ
    assert stats.counters["grant_requests_local"] == 2
    assert stats.counters["blocks_written_remote"] == 4  # one grant on 4 blocks
    assert stats.counters["bytes_in"] == 4 * BB  # 4 layers x 4 blocks
    sent = await request(nc, subjects.worker_stats("store", "sa"), {}, WorkerStats)
    assert sent.counters["shm_bytes"] == 4 * BB  # same host: through shared memory
    await events.unsubscribe()


async def test_the_last_ship_with_commit_src_commits_the_source_tx_on_its_store(env):
    # A prefill's last ship is its transaction's last read: the store commits it there
    # (BlockStored published, blocks cached), and no TxCommit need follow.
    nc, a, b = env
    events = await nc.subscribe(subjects.kv_events("sa"))
    hashes = [111, 112]
    src = await tx(nc, "sa", TxRole.PREFILL, hashes, 2 * BS, request_id="rc")
    dst = await tx(nc, "sb", TxRole.DECODE, hashes, 2 * BS, request_id="rc")
    data = fill(a, src, seed=3)
    await a.ship_layer(src, dst, 0, [0, 1], 2 * LAYER, 0)  # not the last: no commit
    sent = await request(nc, subjects.worker_stats("store", "sa"), {}, WorkerStats)
    assert sent.counters["commits_on_ship"] == 0
    await a.ship_layer(src, dst, 2, [0, 1], 2 * LAYER, 2 * LAYER, commit_src="rc")
    for i, s in enumerate(dst.slots):
        assert bytes(b.slot(s)) == data[i]
    batch = decode((await events.next_msg(timeout=5)).data, EventBatch)
    assert batch.events == [BlockStored(block_hashes=hashes)]
    sent = await request(nc, subjects.worker_stats("store", "sa"), {}, WorkerStats)
    assert sent.counters["commits_on_ship"] == 1
    late = await commit(nc, "sa", src)  # the conductor's commit, were it still sent
    assert isinstance(late, Refused)
    again = await tx(nc, "sa", TxRole.PREFILL, hashes, 2 * BS, request_id="rd")
    assert again.hit_blocks == 2  # cached by the commit on the ship
    await events.unsubscribe()


async def test_pull_whole_blocks_from_a_source_tx(env):
    nc, a, b = env
    hashes = [201, 202, 203]
    made = await tx(nc, "sa", TxRole.PREFILL, hashes, 3 * BS)
    data = fill(a, made, seed=7)
    assert isinstance(await commit(nc, "sa", made), TxDone)
    source = await tx(nc, "sa", TxRole.SOURCE, hashes, 3 * BS)
    assert source.slots == made.slots and source.hit_blocks == 3
    dst = await tx(nc, "sb", TxRole.PREFILL, [*hashes, 204], 4 * BS + 2)
    assert (len(dst.slots), dst.hit_blocks) == (5, 0)
    await b.pull(dst, RemotePrefix(source_node="sa", source_tx=source, first_block=0, num_blocks=2))
    await b.pull(dst, RemotePrefix(source_node="sa", source_tx=source, first_block=2, num_blocks=1))
    for i in range(3):
        assert bytes(b.slot(dst.slots[i])) == data[i]
    assert isinstance(await commit(nc, "sa", source), TxDone)


async def test_transfer_into_a_closed_tx_is_refused_by_the_peer(env):
    nc, a, b = env
    src = await tx(nc, "sa", TxRole.PREFILL, [301], BS)
    dst = await tx(nc, "sb", TxRole.DECODE, [301], BS)
    msg = TxAbort(tx_id=dst.tx_id, request_id="r", reason="test")
    assert await request(nc, subjects.store_ctl("sb", "tx.abort"), msg, TxDoneReply) == TxDone(
        tx_id=dst.tx_id
    )
    with pytest.raises(TransferError) as e:
        await a.ship_layer(src, dst, 0, [0], LAYER, 0)
    assert e.value.code == "peer_forbidden"
    with pytest.raises(TransferError) as e:
        await a.ship_layer(dst, src, 0, [0], LAYER, 0)
    assert e.value.code == "wrong_node"


async def test_ship_to_a_dead_peer_fails_within_a_bounded_wait(env):
    nc, a, _ = env
    src = await tx(nc, "sa", TxRole.PREFILL, [401], BS)
    dead = TxHandle(
        tx_id="x",
        node="gone",
        epoch=1,
        slots=[0],
        hit_blocks=0,
        shm_name="",
        data_addr=f"tcp://127.0.0.1:{free_port()}",
        block_bytes=BB,
    )
    # a store the registry knows (it announced itself), dead since
    gone = msgspec.structs.replace(a.info, node="gone", data_addr=dead.data_addr, ctl_path="")
    await nc.publish(subjects.store_announce("gone"), encode(gone))
    with pytest.raises(TransferError) as e:
        await asyncio.wait_for(a.ship_layer(src, dead, 0, [0], LAYER, 0), timeout=20)
    assert e.value.code == "timeout" and "tcp://127.0.0.1" in e.value.message
    # the store is still fine
    assert (await fetch_info(nc, "sa", timeout=5)).node == "sa"


async def test_malformed_input_gets_an_error_and_the_store_keeps_serving(env):
    nc, a, _ = env
    resp = await nc.request(subjects.store_ctl("sa", "tx.allocate"), b"{not json", timeout=5)
    assert resp.headers and resp.headers.get(ERROR_HEADER) == "bad_request"
    bad = encode({"request_id": "r", "role": 9, "block_hashes": [], "num_tokens": 1})
    resp = await nc.request(subjects.store_ctl("sa", "tx.allocate"), bad, timeout=5)
    assert resp.headers and resp.headers.get(ERROR_HEADER) == "bad_request"
    refused = await request(
        nc,
        subjects.store_ctl("sa", "tx.allocate"),
        TxAllocate(request_id="r", role=TxRole.PREFILL, block_hashes=[1, 2], num_tokens=1),
        TxReply,
    )
    assert isinstance(refused, Refused) and refused.reason == "bad_request"
    # garbage on the data plane: an ERR reply, the ROUTER goes on
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(a.info.data_addr)
    write = wire.Open(
        id=5, tx="nope", epoch=a.info.epoch, slots=[10_000], offset=0, length=4, write=True
    )
    macs = data_auth.Macs(data_auth.data_key())  # this run's key: the store answers
    for parts, code in (
        ([b"\x99", b"junk"], "bad_frame"),
        (wire.frames(write), "forbidden"),
        (wire.frames(wire.Close(id=7, grant=10**9, ok=True)), "fenced"),
        ([b"\x03", encode({"id": 6})], "bad_frame"),
        (wire.frames(wire.ObjGet(id=8, key="k")), "bad_frame"),  # objects: TCP endpoint
    ):
        # the same frames unsigned (or with payload after the MAC) get no reply at all:
        # the first reply that comes is the signed request's
        await sock.send_multipart(parts)
        await sock.send_multipart([*parts, macs.sign(parts), b"kv bytes"])
        await sock.send_multipart([*parts, macs.sign(parts)])
        kind, err = wire.parse(await asyncio.wait_for(sock.recv_multipart(), 5), macs)
        assert (kind, err.code) == (wire.Kind.ERR, code)
    sock.close()
    assert isinstance(await tx(nc, "sa", TxRole.PREFILL, [501], BS), TxHandle)


async def test_a_worker_that_cannot_reach_the_stores_socket_ships_over_zeromq(env):
    nc, a, b = env
    elsewhere = msgspec.structs.replace(a.info, ctl_path="/nonexistent/perigee.ctl")
    channel = await _channel_to(elsewhere, zmq.asyncio.Context.instance())
    assert isinstance(channel, Channel) and channel.addr == a.info.data_addr
    via_zmq = StoreClient(nc, a.info, a.arena, channel, op_timeout_s=10)
    assert not via_zmq.local
    src = await tx(nc, "sa", TxRole.PREFILL, [801], BS)
    dst = await tx(nc, "sb", TxRole.DECODE, [801], BS)
    data = fill(a, src, seed=3)
    await via_zmq.ship_layer(src, dst, 0, [0], BB, 0)
    assert bytes(b.slot(dst.slots[0])) == data[0]
    await channel.aclose()


async def test_garbage_on_the_local_socket_gets_an_error_and_the_store_keeps_serving(env):
    nc, a, b = env
    reader, writer = await asyncio.open_unix_connection(a.info.ctl_path)
    msgpack = msgspec.msgpack.encode

    async def ask(frame: bytes) -> tuple[wire.Kind, object]:
        writer.write(len(frame).to_bytes(4, "little") + frame)
        n = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 5), "little")
        reply = await reader.readexactly(n)
        kind, header = wire.parse([reply[:1], reply[1:]])
        return kind, header

    opened = wire.Open(id=9, tx="t", epoch=1, slots=[0], offset=0, length=4, write=True)
    for frame, code, rid in (
        (b"\x99" + msgpack({"id": 3}), "bad_frame", 3),  # no such kind
        (b"\x01" + msgpack({"id": 4, "src_tx": 1}), "bad_frame", 4),  # a SHIP that is not one
        # a same-host peer's OPEN is served here too: checked like one over ZeroMQ
        (b"\x03" + wire.frames(opened)[1], "epoch", 9),
        (b"\x10" + msgpack({"id": 5}), "bad_request", 5),  # an OK is no request
        (b"\x01", "bad_frame", -1),  # no header at all
    ):
        kind, err = await ask(frame)
        assert (kind, err.code, err.id) == (wire.Kind.ERR, code, rid), err
    # a length no header has: that connection is closed, nothing else
    writer.write((1 << 30).to_bytes(4, "little"))
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    # a worker that drops its connection with a ship in flight: the reply is dropped
    src = await tx(nc, "sa", TxRole.PREFILL, [901], BS)
    dst = await tx(nc, "sb", TxRole.DECODE, [901], BS)
    data = fill(a, src, seed=5)
    dropped = await LocalChannel.connect(a.info.ctl_path)
    pending = asyncio.ensure_future(
        dropped.request(
            wire.Ship(
                id=77,
                src_tx=src.tx_id,
                src_epoch=src.epoch,
                src_slots=src.slots,
                dst_addr=dst.data_addr,
                dst_tx=dst.tx_id,
                dst_epoch=dst.epoch,
                dst_slots=dst.slots,
                offset=0,
                length=LAYER,
                last=False,
            )
        )
    )
    await asyncio.sleep(0)  # one loop turn: the task runs up to its write (no timing)
    dropped.close()
    with pytest.raises(ChannelError):
        await pending
    # the store still serves its workers over the socket
    await a.ship_layer(src, dst, 1, [0], BB - LAYER, LAYER)
    assert bytes(b.slot(dst.slots[0])[LAYER:]) == data[0][LAYER:]
    assert a.local


async def test_sigterm_exits_cleanly_and_unlinks_the_arena(nats_url):
    with tempfile.TemporaryDirectory() as logs:
        proc = start_store(nats_url, "sc", logs)
        try:
            nc = await nats.connect(nats_url)
            info = await fetch_info(nc, "sc", timeout=30)
            await nc.close()
            assert os.path.exists(f"/dev/shm/{info.shm_name}")
        finally:
            code = stop_store(proc)
        assert code == 0
        assert not os.path.exists(f"/dev/shm/{info.shm_name}")
        assert not os.path.exists(f"/dev/shm/{info.shm_name}_gen")  # its slot generations
        assert info.ctl_path and not os.path.exists(info.ctl_path)  # its workers' socket


async def test_client_follows_a_restarted_store_and_same_node_ship_is_a_local_copy(nats_url):
    with tempfile.TemporaryDirectory() as logs:
        proc = start_store(nats_url, "sd", logs)
        nc = await nats.connect(nats_url)
        client = await StoreClient.connect(nc, "sd", timeout=30)
        try:
            first = client.info.epoch
            assert stop_store(proc) == 0
            proc = start_store(nats_url, "sd", logs)
            await fetch_info(nc, "sd", timeout=30)  # the new store is up
            src = await tx(nc, "sd", TxRole.PREFILL, [601], BS)
            dst = await tx(nc, "sd", TxRole.DECODE, [601], BS)
            assert src.epoch > first
            await client.ship_layer(src, dst, 0, [0], BB, 0)  # reattaches, then copies
            assert client.info.epoch == src.epoch
            data = fill(client, src, seed=3)
            await client.ship_layer(src, dst, 2, [0], LAYER, 2 * LAYER)
            got = bytes(client.slot(dst.slots[0]))
            assert got[2 * LAYER : 3 * LAYER] == data[0][2 * LAYER : 3 * LAYER]
            assert got[: 2 * LAYER] == bytes(2 * LAYER)
            stats = await request(nc, subjects.worker_stats("store", "sd"), {}, WorkerStats)
            assert (stats.counters["local_copies"], stats.counters["blocks_written_remote"]) == (
                2,
                0,
            )
        finally:
            await client.close()
            await nc.close()
            stop_store(proc)


def test_the_kv_event_outbox_is_bounded_an_overflow_is_a_gap(monkeypatch):
    """The bus down or slower than the pool: the outbox keeps the newest MAX_OUTBOX
    batches; the oldest go, and the sequence gap makes consumers dump the node."""
    from bus_schemas.kv_events import BlockStored
    from services.store.node import server as srv

    monkeypatch.setattr(srv, "MAX_OUTBOX", 3)

    class _Replay:
        def add(self, batch) -> None:
            pass

    svc = srv.StoreService.__new__(srv.StoreService)
    svc.node, svc.epoch, svc.seq, svc.outbox_dropped = "n", 1, 0, 0
    svc.replay = _Replay()
    svc._outbox = asyncio.Queue()
    for h in range(5):
        svc._emit([BlockStored(block_hashes=[h])])
    seqs = [svc._outbox.get_nowait().seq for _ in range(svc._outbox.qsize())]
    assert seqs == [3, 4, 5] and svc.outbox_dropped == 2
