"""RDMA sender and receiver (reliable-connected QPs, one-sided WRITE/READ).

Lifecycle::

    RdmaReceiver: open the device, register each exposed region as an MR (remote
        read/write), serve a TCP *bootstrap* socket: a sender sends its QP numbers,
        LID, GID and PSNs; the receiver makes a QP per path, moves them to RTS and
        answers with its own and the region table (address, rkey, size). From then on
        the receiver's CPU is not involved.
    RdmaSender: an endpoint per target (SIEVE pool, capped) = ``paths`` QPs on one CQ
        and a poller thread. submit() slices the request, posts one signalled work
        request per slice (round robin over QPs) and returns a Ticket; the poller
        completes slices. A completion with an error status marks that QP down and
        posts the slice on another; when none is left the request fails (``broken``).

Local memory must be registered first (``register``), as in Listing 1. Checksums
are not offered: a one-sided write has no receiver CPU to check it.
"""

import json
import random
import socket
import threading
import time
import types
from dataclasses import dataclass

import numpy as np

from services.transfer.backends import slicing
from services.transfer.backends.contract import (
    Opcode,
    Receiver,
    Region,
    Request,
    Sender,
    Ticket,
    TransportError,
)
from services.transfer.backends.rdma import verbs as verbs_mod
from services.transfer.backends.sieve import SievePool

QP_DEPTH = 256


def address_of(buf: memoryview) -> int:
    if len(buf) == 0:
        return 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _open(v: types.SimpleNamespace, device: str | None):
    ok, names = verbs_mod.discover(v)
    if not ok.ok:
        raise TransportError("unavailable", ok.reason)
    name = device or names[0]
    if name not in names:
        raise TransportError("unavailable", f"no RDMA device {name!r} (have {names})")
    ctx = v.device.Context(name=name)
    return ctx, v.pd.PD(ctx)


def _access(v: types.SimpleNamespace) -> int:
    e = v.enums
    return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ


class _QPSet:
    """``n`` RC QPs on one CQ, plus what the peer needs to connect to them."""

    def __init__(self, v, ctx, pd, n: int, port_num: int, gid_index: int) -> None:
        self.v = v
        self.port_num = port_num
        self.gid_index = gid_index
        self.cq = v.cq.CQ(ctx, QP_DEPTH * n)
        cap = v.qp.QPCap(max_send_wr=QP_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = v.qp.QPInitAttr(qp_type=v.enums.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap)
        self.qps = [v.qp.QP(pd, init) for _ in range(n)]
        self.psns = [random.randrange(1 << 24) for _ in range(n)]
        self.lid = ctx.query_port(port_num).lid
        self.gid = str(ctx.query_gid(port_num, gid_index))

    def describe(self) -> dict:
        return {
            "qpns": [q.qp_num for q in self.qps],
            "psns": self.psns,
            "lid": self.lid,
            "gid": self.gid,
        }

    def connect(self, peer: dict) -> None:
        v = self.v
        for qp, psn, rqpn, rpsn in zip(
            self.qps, self.psns, peer["qpns"], peer["psns"], strict=True
        ):
            attr = v.qp.QPAttr(port_num=self.port_num)
            attr.qp_access_flags = _access(v)
            attr.dest_qp_num = rqpn
            attr.rq_psn = rpsn
            attr.sq_psn = psn
            attr.path_mtu = v.enums.IBV_MTU_1024
            attr.max_dest_rd_atomic = 16
            attr.max_rd_atomic = 16
            gr = v.addr.GlobalRoute(dgid=v.addr.GID(peer["gid"]), sgid_index=self.gid_index)
            attr.ah_attr = v.addr.AHAttr(
                port_num=self.port_num, is_global=1, gr=gr, dlid=peer["lid"]
            )
            qp.to_rts(attr)


def _send_json(sock: socket.socket, obj: dict) -> None:
    sock.sendall(json.dumps(obj).encode() + b"\n")


def _recv_json(sock: socket.socket) -> dict:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("bootstrap peer closed")
        buf += chunk
    return json.loads(buf)


class RdmaReceiver(Receiver):
    """Exposes registered memory to RDMA peers (the target side)."""

    scheme = "rdma"

    def __init__(
        self,
        v: types.SimpleNamespace | None = None,
        device: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        port_num: int = 1,
        gid_index: int = 0,
    ) -> None:
        self.v = v or verbs_mod.load()
        self.ctx, self.pd = _open(self.v, device)
        self.port_num, self.gid_index = port_num, gid_index
        self._mrs: dict[int, tuple[object, int, int]] = {}  # region -> (mr, addr, size)
        self._qpsets: list[_QPSet] = []
        self._lsock = socket.create_server((host, port))
        self._host, self._port = host, self._lsock.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="rdma-bootstrap", daemon=True).start()

    @property
    def address(self) -> str:
        return f"rdma://{self._host}:{self._port}"

    def expose(self, region: Region) -> None:
        addr = address_of(region.buf)
        mr = self.v.mr.MR(self.pd, len(region.buf), _access(self.v), address=addr)
        self._mrs[region.id] = (mr, addr, len(region.buf))

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            try:
                with conn:
                    hello = _recv_json(conn)
                    qs = _QPSet(
                        self.v, self.ctx, self.pd, len(hello["qpns"]), self.port_num, self.gid_index
                    )
                    qs.connect(hello)
                    self._qpsets.append(qs)
                    regions = {str(rid): [a, mr.rkey, n] for rid, (mr, a, n) in self._mrs.items()}
                    _send_json(conn, {**qs.describe(), "regions": regions})
            except (OSError, ValueError, KeyError, ConnectionError):
                continue

    def close(self) -> None:
        self._closed = True
        self._lsock.close()
        for qs in self._qpsets:
            for qp in qs.qps:
                qp.close()
        for mr, _, _ in self._mrs.values():
            mr.close()


@dataclass(eq=False)
class _Op:
    ticket: Ticket
    opcode: Opcode
    laddr: int
    lkey: int
    length: int
    region: int
    offset: int
    tried: set


class _Endpoint:
    def __init__(self, sender: "RdmaSender", target: str) -> None:
        self.sender = sender
        self.target = target
        v = sender.v
        host, _, port = target.removeprefix("rdma://").rpartition(":")
        self.qs = _QPSet(v, sender.ctx, sender.pd, sender.paths, sender.port_num, sender.gid_index)
        try:
            with socket.create_connection((host, int(port)), timeout=sender.connect_timeout_s) as s:
                _send_json(s, self.qs.describe())
                peer = _recv_json(s)
        except (OSError, ValueError, ConnectionError) as e:
            raise TransportError(
                "unreachable", f"RDMA bootstrap with {target} failed: {e}"
            ) from None
        self.qs.connect(peer)
        self.regions = {int(k): tuple(val) for k, val in peer["regions"].items()}
        self.down: set[int] = set()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._ops: dict[int, tuple[_Op, int]] = {}
        self._next = 1
        self._rr = 0
        self._closed = False
        threading.Thread(target=self._poll, name="rdma-poll", daemon=True).start()

    @property
    def in_flight(self) -> int:
        return len(self._ops)

    def post(self, op: _Op, path: int) -> None:
        v = self.sender.v
        n = len(self.qs.qps)
        for k in range(n):
            p = (path + k) % n
            if p in self.down or p in op.tried:
                continue
            raddr, rkey, rsize = self.regions[op.region]
            with self._cv:
                wr_id = self._next
                self._next += 1
                self._ops[wr_id] = (op, p)
                self._cv.notify()
            sge = v.wr.SGE(op.laddr, op.length, op.lkey)
            code = (
                v.enums.IBV_WR_RDMA_WRITE if op.opcode == Opcode.WRITE else v.enums.IBV_WR_RDMA_READ
            )
            wr = v.wr.SendWR(
                wr_id=wr_id, opcode=code, num_sge=1, sg=[sge], send_flags=v.enums.IBV_SEND_SIGNALED
            )
            wr.set_wr_rdma(rkey, raddr + op.offset)
            try:
                self.qs.qps[p].post_send(wr)
                op.ticket.started()
                return
            except Exception:  # noqa: BLE001 - a QP in error: try the next path
                with self._cv:
                    self._ops.pop(wr_id, None)
                self.down.add(p)
        op.ticket.fail(TransportError("broken", f"all {n} paths to {self.target} failed"))

    def _poll(self) -> None:
        v = self.sender.v
        ok = v.enums.IBV_WC_SUCCESS
        while True:
            with self._cv:
                while not self._ops and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
            npolled, wcs = self.qs.cq.poll(32)
            if not npolled:
                time.sleep(20e-6)  # no completion channel: poll, but yield the core
            for wc in wcs[:npolled]:
                with self._cv:
                    item = self._ops.pop(wc.wr_id, None)
                if item is None:
                    continue
                op, p = item
                if wc.status == ok:
                    op.ticket.slice_done(op.length)
                else:
                    self.down.add(p)
                    op.tried.add(p)
                    self.post(op, p + 1)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            ops = list(self._ops.values())
            self._ops.clear()
            self._cv.notify_all()
        for op, _ in ops:
            op.ticket.fail(TransportError("closed", f"endpoint {self.target} closed"))
        for qp in self.qs.qps:
            qp.close()


class RdmaSender(Sender):
    """Moves bytes to and from peers' regions with RDMA (the initiator side)."""

    scheme = "rdma"

    def __init__(
        self,
        v: types.SimpleNamespace | None = None,
        device: str | None = None,
        paths: int = 2,
        max_endpoints: int = 64,
        slice_bytes: int = 1 << 20,
        port_num: int = 1,
        gid_index: int = 0,
        connect_timeout_s: float = 3.0,
    ) -> None:
        self.v = v or verbs_mod.load()
        self.ctx, self.pd = _open(self.v, device)
        self.paths = max(1, paths)
        self.slice_bytes = slice_bytes
        self.port_num, self.gid_index = port_num, gid_index
        self.connect_timeout_s = connect_timeout_s
        self._local: list[tuple[int, int, object]] = []  # (addr, size, mr)
        self._lock = threading.Lock()
        self._pool: SievePool[str, _Endpoint] = SievePool(
            max_endpoints, busy=lambda e: e.in_flight > 0
        )

    def register(self, region: Region) -> None:
        addr = address_of(region.buf)
        mr = self.v.mr.MR(self.pd, len(region.buf), _access(self.v), address=addr)
        self._local.append((addr, len(region.buf), mr))

    def _lkey(self, addr: int, n: int) -> int | None:
        for a, size, mr in self._local:
            if a <= addr and addr + n <= a + size:
                return mr.lkey
        return None

    def submit(self, req: Request) -> Ticket:
        plan = slicing.plan(req.length, self.paths, 0, self.slice_bytes, self.slice_bytes)
        t = Ticket(req.length, len(plan))
        try:
            if req.checksum:
                raise TransportError("bad_request", "checksums are not offered over one-sided RDMA")
            laddr = address_of(req.local)
            lkey = self._lkey(laddr, req.length)
            if lkey is None:
                raise TransportError("bad_request", "local memory is not registered")
            ep = self._endpoint(req.target)
            raddr = ep.regions.get(req.region)
            if raddr is None:
                raise TransportError("refused", f"{req.target} has no region {req.region}")
            if req.offset < 0 or req.offset + req.length > raddr[2]:
                raise TransportError(
                    "refused",
                    f"span {req.offset}+{req.length} outside region "
                    f"{req.region} of {raddr[2]} bytes",
                )
        except TransportError as e:
            t.fail(e)
            return t
        for p in plan:
            op = _Op(
                t,
                req.opcode,
                laddr + p.offset,
                lkey,
                p.length,
                req.region,
                req.offset + p.offset,
                set(),
            )
            ep.post(op, p.path)
        return t

    def _endpoint(self, target: str) -> _Endpoint:
        with self._lock:
            ep = self._pool.get(target)
            if ep is not None and len(ep.down) == len(ep.qs.qps) and ep.in_flight == 0:
                self._pool.remove(target)
                ep.close()
                ep = None
            if ep is None:
                ep = _Endpoint(self, target)
                for _, old in self._pool.put(target, ep):
                    old.close()
            return ep

    def close(self) -> None:
        with self._lock:
            eps = [self._pool.remove(k) for k in list(self._pool)]
        for ep in eps:
            if ep is not None:
                ep.close()
        for _, _, mr in self._local:
            mr.close()
