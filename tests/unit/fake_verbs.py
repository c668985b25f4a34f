"""A stand-in for pyverbs, enough for the RDMA backend's code path in one process.

``make(devices)`` returns a namespace shaped like :func:`rdma.verbs.load`'s. MRs are
real addresses of this process; a QP connected with ``to_rts`` executes RDMA WRITE
and READ at ``post_send`` with ``ctypes.memmove`` after checking the remote key and
bounds, and queues a work completion on its CQ. QP numbers in ``state.down`` complete
with an error status (a broken path).
"""

import ctypes
import itertools
import types
from collections import deque


class VerbsError(Exception):
    pass


def make(devices: tuple[str, ...] = ("fake_mlx5_0",)) -> types.SimpleNamespace:
    state = types.SimpleNamespace(mrs={}, qps={}, down=set(), posted=[])
    keys = itertools.count(100)
    qpns = itertools.count(10)

    enums = types.SimpleNamespace(
        IBV_ACCESS_LOCAL_WRITE=1,
        IBV_ACCESS_REMOTE_WRITE=2,
        IBV_ACCESS_REMOTE_READ=4,
        IBV_QPT_RC=2,
        IBV_MTU_1024=3,
        IBV_WR_RDMA_WRITE=0,
        IBV_WR_RDMA_READ=4,
        IBV_SEND_SIGNALED=2,
        IBV_WC_SUCCESS=0,
        IBV_WC_REM_ACCESS_ERR=10,
        IBV_WC_RETRY_EXC_ERR=12,
    )

    class Dev:
        def __init__(self, name: str) -> None:
            self.name = name.encode()

    def get_device_list():
        if not devices:
            raise VerbsError("Failed to get devices list")
        return [Dev(n) for n in devices]

    class Context:
        def __init__(self, name: str) -> None:
            self.name = name

        def query_port(self, port_num):
            return types.SimpleNamespace(lid=port_num)

        def query_gid(self, port_num, index):
            return f"fe80::{port_num}:{index}"

    class PD:
        def __init__(self, ctx) -> None:
            self.ctx = ctx

    class MR:
        def __init__(self, pd, length, access, address=None) -> None:
            self.lkey = self.rkey = next(keys)
            self.addr, self.length, self.access = address, length, access
            state.mrs[self.rkey] = self

        def close(self) -> None:
            state.mrs.pop(self.rkey, None)

    class WC:
        def __init__(self, wr_id, status, byte_len) -> None:
            self.wr_id, self.status, self.byte_len = wr_id, status, byte_len

    class CQ:
        def __init__(self, ctx, cqe) -> None:
            self.q: deque = deque()

        def poll(self, num_entries=1):
            out = [self.q.popleft() for _ in range(min(num_entries, len(self.q)))]
            return len(out), out

    class QPCap:
        def __init__(self, **kw) -> None:
            self.__dict__.update(kw)

    class QPInitAttr:
        def __init__(self, qp_type, scq, rcq, cap) -> None:
            self.qp_type, self.scq, self.rcq, self.cap = qp_type, scq, rcq, cap

    class QPAttr:
        def __init__(self, port_num=1) -> None:
            self.port_num = port_num

    class QP:
        def __init__(self, pd, init) -> None:
            self.qp_num = next(qpns)
            self.cq = init.scq
            self.peer = None
            state.qps[self.qp_num] = self

        def to_rts(self, attr) -> None:
            self.peer = attr.dest_qp_num

        def post_send(self, wr) -> None:
            if self.peer is None:
                raise VerbsError("QP is not connected")
            state.posted.append((self.qp_num, wr.opcode, wr.sg[0].length))
            status = enums.IBV_WC_SUCCESS
            if self.qp_num in state.down or self.peer in state.down:
                status = enums.IBV_WC_RETRY_EXC_ERR
            else:
                sge = wr.sg[0]
                local, remote = state.mrs.get(sge.lkey), state.mrs.get(wr.rkey)
                if (
                    local is None
                    or remote is None
                    or not remote.addr <= wr.raddr <= remote.addr + remote.length - sge.length
                    or not local.addr <= sge.addr <= local.addr + local.length - sge.length
                ):
                    status = enums.IBV_WC_REM_ACCESS_ERR
                elif wr.opcode == enums.IBV_WR_RDMA_WRITE:
                    ctypes.memmove(wr.raddr, sge.addr, sge.length)
                else:
                    ctypes.memmove(sge.addr, wr.raddr, sge.length)
            self.cq.q.append(WC(wr.wr_id, status, wr.sg[0].length))

        def close(self) -> None:
            state.qps.pop(self.qp_num, None)

    class SGE:
        def __init__(self, addr, length, lkey) -> None:
            self.addr, self.length, self.lkey = addr, length, lkey

    class SendWR:
        def __init__(self, wr_id=0, opcode=0, num_sge=1, sg=None, send_flags=0) -> None:
            self.wr_id, self.opcode, self.sg, self.send_flags = wr_id, opcode, sg or [], send_flags
            self.rkey = self.raddr = 0

        def set_wr_rdma(self, rkey, addr) -> None:
            self.rkey, self.raddr = rkey, addr

    class GID:
        def __init__(self, val) -> None:
            self.val = val

    class GlobalRoute:
        def __init__(self, dgid=None, sgid_index=0) -> None:
            self.dgid, self.sgid_index = dgid, sgid_index

    class AHAttr:
        def __init__(self, **kw) -> None:
            self.__dict__.update(kw)

    ns = types.SimpleNamespace
    return ns(
        state=state,
        enums=enums,
        device=ns(get_device_list=get_device_list, Context=Context),
        pd=ns(PD=PD),
        mr=ns(MR=MR),
        cq=ns(CQ=CQ),
        qp=ns(QP=QP, QPCap=QPCap, QPInitAttr=QPInitAttr, QPAttr=QPAttr),
        wr=ns(SGE=SGE, SendWR=SendWR),
        addr=ns(GID=GID, GlobalRoute=GlobalRoute, AHAttr=AHAttr),
    )
