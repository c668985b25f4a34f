"""``perigee bench transfer``: the transfer engine beside its ceilings, in one run.

Cross-process, same host. A peer process (``python -m perigee.bench.transfer --peer``)
registers a buffer with a TCP and a shared-memory TransferEngine and runs a plain
raw-socket sink. This process then, for 1, 4, 16 and 64 MiB, in interleaved rounds:

    tcp         TransferEngine("tcp") WRITE into the peer (4 streams, sliced)
    raw_socket  the ceiling: 4 plain sockets, ``sendall`` of a quarter each into
                ``recv_into`` on the peer, acked per stream (what the engine also waits for),
                one persistent sending thread per socket
    raw_socket_1thread  the same 4 sockets' work done by the calling thread alone: it
                sends the 4 quarters one after the other, then reads the 4 acks (no
                hand-off between threads; faster up to a few MiB on a 2-core host)
    shm         TransferEngine("shm") WRITE into the peer's shared memory
    memcpy      the ceiling: one numpy copy of the same size inside this process, from
                the same source buffer the shm run copies (same cache state)
    mooncake    Mooncake's own transfer engine (TCP protocol, P2P handshake), target
                and initiator in two processes, ``transfer_sync_write`` of the same sizes;
                run with the Python that can import ``mooncake`` (--mooncake-python,
                $PERIGEE_MOONCAKE_PYTHON, this one, <repo>/.venv-mooncake,
                /work/mooncake-venv), else reported "unavailable"

Each figure is the median over ``--repeats`` runs after a warm-up; gbps is GB/s
(10^9 bytes per second). JSON: {"unit": "GB/s", "results": [{"backend", "size_bytes",
"gbps", "runs", "status"}...], "ratios": {...}}.
"""

import argparse
import json
import os
import queue
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time

import numpy as np

MIB = 1 << 20
SIZES = [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
RAW_HDR = struct.Struct("<QQ")
DEFAULT_MOONCAKE_PYTHONS = (
    os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", ".venv-mooncake", "bin", "python"
    ),
    "/work/mooncake-venv/bin/python",
)

# Run under the Python that has ``mooncake`` (no perigee imports): target or initiator.
MOONCAKE_TE = r"""
import json, sys, time
from mooncake.engine import TransferEngine
role, size = sys.argv[1], int(sys.argv[2])
e = TransferEngine()
if e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
    print(json.dumps({"error": "initialize failed"}), flush=True); sys.exit(1)
buf = e.allocate_managed_buffer(size)
if role == "target":
    print(json.dumps({"session": "127.0.0.1:%d" % e.get_rpc_port(), "addr": buf}), flush=True)
    sys.stdin.read()
else:
    peer = json.loads(sys.argv[3]); sizes = json.loads(sys.argv[4]); repeats = int(sys.argv[5])
    e.write_bytes_to_buffer(buf, b"\x5a" * size, size)
    out = {}
    for n in sizes:
        if e.transfer_sync_write(peer["session"], buf, peer["addr"], n) != 0:  # warm-up
            print(json.dumps({"error": "transfer_sync_write failed"}), flush=True); sys.exit(1)
        runs = []
        for _ in range(repeats):
            t = time.perf_counter()
            rc = e.transfer_sync_write(peer["session"], buf, peer["addr"], n)
            dt = time.perf_counter() - t
            if rc != 0:
                print(json.dumps({"error": "transfer_sync_write failed"}), flush=True); sys.exit(1)
            runs.append(n / dt / 1e9)
        out[str(n)] = runs
    print(json.dumps({"results": out}), flush=True)
"""


# ---------------------------------------------------------------------- peer process


def _raw_sink(buf: memoryview) -> int:
    """Plain sockets: per connection, [offset, length] then that many bytes, then an ack."""
    from services.transfer.backends.tcp.frames import recv_exact, tune

    lsock = socket.create_server(("127.0.0.1", 0), backlog=64)

    def serve(conn: socket.socket) -> None:
        tune(conn)
        hdr = memoryview(bytearray(RAW_HDR.size))
        try:
            while True:
                recv_exact(conn, hdr)
                off, n = RAW_HDR.unpack(hdr)
                recv_exact(conn, buf[off : off + n])
                conn.sendall(b"\x01")
        except (OSError, ConnectionError):
            conn.close()

    def accept() -> None:
        while True:
            conn, _ = lsock.accept()
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return lsock.getsockname()[1]


def peer(size: int) -> int:
    from services.transfer.batch_api import TransferEngine

    tcp = TransferEngine("tcp")
    tcp_rid, tcp_buf = tcp.allocate_managed_buffer(size)
    shm = TransferEngine("shm")
    shm_rid, _ = shm.allocate_managed_buffer(size)
    raw = memoryview(bytearray(size))
    raw[:] = tcp_buf  # touch every page
    port = _raw_sink(raw)
    print(
        json.dumps(
            {
                "tcp": tcp.segment,
                "tcp_region": tcp_rid,
                "shm": shm.segment,
                "shm_region": shm_rid,
                "raw_port": port,
            }
        ),
        flush=True,
    )
    sys.stdin.read()  # until the bench closes our stdin
    tcp.close()
    shm.close()
    return 0


# ---------------------------------------------------------------------- initiator side


def _connect(port: int, streams: int) -> list[socket.socket]:
    """``streams`` plain loopback connections, tuned as the engine tunes its own."""
    from services.transfer.backends.tcp.frames import tune

    socks = []
    for _ in range(streams):
        s = socket.create_connection(("127.0.0.1", port))
        tune(s)
        socks.append(s)
    return socks


class RawInline:
    """Plain sockets without threads: the caller sends each part, then reads the acks."""

    def __init__(self, port: int, streams: int) -> None:
        self.socks = _connect(port, streams)

    def write(self, src: memoryview) -> None:
        part = -(-len(src) // len(self.socks))
        used = []
        for s, o in zip(self.socks, range(0, len(src), part), strict=False):
            view = src[o : o + part]
            s.sendall(RAW_HDR.pack(o, len(view)))
            s.sendall(view)
            used.append(s)
        if not all(s.recv(1) == b"\x01" for s in used):
            raise RuntimeError("raw socket transfer failed")

    def close(self) -> None:
        for s in self.socks:
            s.close()


class RawSockets:
    """The ceiling: ``streams`` plain connections, one persistent thread each."""

    def __init__(self, port: int, streams: int) -> None:
        self.socks = _connect(port, streams)
        self.jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in self.socks]
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        for s, q in zip(self.socks, self.jobs, strict=True):
            threading.Thread(target=self._run, args=(s, q), daemon=True).start()

    def _run(self, s: socket.socket, q: queue.SimpleQueue) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            off, view = job
            s.sendall(RAW_HDR.pack(off, len(view)))
            s.sendall(view)
            ack = s.recv(1)
            self.done.put(ack == b"\x01")

    def write(self, src: memoryview) -> None:
        n = len(self.socks)
        part = -(-len(src) // n)
        jobs = [(o, src[o : o + part]) for o in range(0, len(src), part)]
        for q, job in zip(self.jobs, jobs, strict=False):
            q.put(job)
        if not all(self.done.get() for _ in jobs):
            raise RuntimeError("raw socket transfer failed")

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for s in self.socks:
            s.close()


def _gbps(n: int, dt: float) -> float:
    return n / dt / 1e9


def find_mooncake_python(explicit: str | None) -> str | None:
    cands = [
        explicit,
        os.environ.get("PERIGEE_MOONCAKE_PYTHON"),
        sys.executable,
        *DEFAULT_MOONCAKE_PYTHONS,
    ]
    for c in cands:
        if not c or not (os.path.exists(c) or shutil.which(c)):
            continue
        ok = subprocess.run([c, "-c", "import mooncake.engine"], capture_output=True, timeout=60)
        if ok.returncode == 0:
            return c
    return None


class MooncakeTE:
    """Mooncake's transfer engine: a target process for the whole run, an initiator
    process per size (so its runs sit right after ours for that size)."""

    def __init__(self, py: str, size: int) -> None:
        self.py = py
        self.target = subprocess.Popen(
            [py, "-c", MOONCAKE_TE, "target", str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.target.stdout.readline() if self.target.stdout else ""
        try:
            self.info = json.loads(line or "{}")
        except ValueError:
            self.info = {}
        self.size = size
        self.error = (
            "" if "session" in self.info else f"mooncake target did not start: {line.strip()[:200]}"
        )

    def run(self, n: int, repeats: int) -> tuple[list[float] | None, str]:
        if self.error:
            return None, self.error
        out = subprocess.run(
            [
                self.py,
                "-c",
                MOONCAKE_TE,
                "init",
                str(self.size),
                json.dumps(self.info),
                json.dumps([n]),
                str(repeats),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = (out.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            res = json.loads(last)
        except ValueError:
            res = {}
        if "results" not in res:
            return None, f"mooncake initiator failed: {res.get('error', out.stderr[-300:])}"
        return res["results"][str(n)], ""

    def close(self) -> None:
        if self.target.stdin:
            self.target.stdin.close()
        try:
            self.target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.target.kill()


def bench(
    sizes: list[int], repeats: int, streams: int, mooncake_py: str | None, skip_mooncake: bool
) -> dict:
    """Per size: warm-up, then ``repeats`` rounds of tcp, raw_socket, memcpy, shm back to
    back (each round's ratios are kept: the paired ratios), then Mooncake's runs."""
    from services.transfer.backends import Opcode
    from services.transfer.batch_api import TransferEngine, TransferRequest

    top = max(sizes)
    proc = subprocess.Popen(
        [sys.executable, "-m", "perigee.bench.transfer", "--peer", "--size", str(top)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    runs: dict[tuple[str, int], list[float]] = {}
    if skip_mooncake:
        mc_why = "skipped (--no-mooncake)"
    elif mooncake_py is None:
        mc_why = (
            "mooncake is not importable here; pip install "
            "mooncake-transfer-engine-non-cuda in a separate venv and pass "
            "--mooncake-python"
        )
    else:
        mc_why = ""
    mc = MooncakeTE(mooncake_py, top) if mooncake_py and not skip_mooncake else None
    mc_runs: dict[int, list[float]] = {}
    try:
        info = json.loads(proc.stdout.readline() if proc.stdout else "{}")
        tcp = TransferEngine("tcp", serve=False, sender_opts={"streams": streams})
        shm = TransferEngine("shm", serve=False)
        tcp_src, tcp_buf = tcp.allocate_managed_buffer(top)
        shm_src, shm_buf = shm.allocate_managed_buffer(top)
        tcp_buf[:] = os.urandom(top)
        shm_buf[:] = tcp_buf
        raw = RawSockets(info["raw_port"], streams)
        raw1 = RawInline(info["raw_port"], streams)
        a = np.frombuffer(shm_buf, dtype=np.uint8)  # the same source bytes the shm run copies
        b = np.empty(top, dtype=np.uint8)
        b[:] = 1  # touch every page

        def t_tcp(n: int) -> None:
            tcp.transfer_sync(
                [TransferRequest(Opcode.WRITE, tcp_src, 0, n, info["tcp"], info["tcp_region"], 0)],
                timeout=120,
            )

        def t_shm(n: int) -> None:
            shm.transfer_sync(
                [TransferRequest(Opcode.WRITE, shm_src, 0, n, info["shm"], info["shm_region"], 0)],
                timeout=120,
            )

        def t_raw(n: int) -> None:
            raw.write(tcp_buf[:n])

        def t_raw1(n: int) -> None:
            raw1.write(tcp_buf[:n])

        def t_memcpy(n: int) -> None:
            np.copyto(b[:n], a[:n])

        fns = {
            "raw_socket": t_raw,
            "tcp": t_tcp,
            "raw_socket_1thread": t_raw1,
            "memcpy": t_memcpy,
            "shm": t_shm,
        }
        for n in sizes:
            for f in fns.values():
                f(n)  # warm-up: connections, mappings, page tables
            for _ in range(repeats):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f(n)
                    runs.setdefault((name, n), []).append(_gbps(n, time.perf_counter() - t0))
            if mc is not None and not mc_why:
                got, mc_why = mc.run(n, repeats)
                if got is not None:
                    mc_runs[n] = got
        raw.close()
        raw1.close()
        tcp.close()
        shm.close()
    finally:
        if mc is not None:
            mc.close()
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=30)

    results = [
        {
            "backend": k,
            "size_bytes": n,
            "gbps": round(statistics.median(v), 3),
            "runs": [round(x, 3) for x in v],
            "status": "ok",
        }
        for (k, n), v in runs.items()
    ]
    for n in sizes:
        v = mc_runs.get(n)
        if v is None:
            results.append(
                {
                    "backend": "mooncake",
                    "size_bytes": n,
                    "gbps": None,
                    "runs": [],
                    "status": "unavailable",
                    "reason": mc_why or "no result",
                }
            )
        else:
            results.append(
                {
                    "backend": "mooncake",
                    "size_bytes": n,
                    "gbps": round(statistics.median(v), 3),
                    "runs": [round(x, 3) for x in v],
                    "status": "ok",
                }
            )
    return {
        "unit": "GB/s",
        "repeats": repeats,
        "streams": streams,
        "results": results,
        "ratios": ratios(results, sizes),
        "paired_ratios": paired(runs, sizes),
    }


def paired(
    runs: dict[tuple[str, int], list[float]], sizes: list[int]
) -> dict[str, dict[str, float]]:
    """Median over rounds of each round's own ratio (the two runs were back to back, so a
    load swing on a shared box moves both)."""
    out: dict[str, dict[str, float]] = {}
    for name, (num, den) in {
        "tcp_vs_raw_socket": ("tcp", "raw_socket"),
        "tcp_vs_raw_socket_1thread": ("tcp", "raw_socket_1thread"),
        "shm_vs_memcpy": ("shm", "memcpy"),
    }.items():
        out[name] = {
            str(n): round(
                statistics.median(
                    a / b for a, b in zip(runs[(num, n)], runs[(den, n)], strict=True)
                ),
                3,
            )
            for n in sizes
        }
    return out


def ratios(results: list[dict], sizes: list[int]) -> dict[str, dict[str, float | None]]:
    g = {(r["backend"], r["size_bytes"]): r["gbps"] for r in results}
    out: dict[str, dict[str, float | None]] = {}
    for name, (num, den) in {
        "tcp_vs_raw_socket": ("tcp", "raw_socket"),
        "tcp_vs_raw_socket_1thread": ("tcp", "raw_socket_1thread"),
        "shm_vs_memcpy": ("shm", "memcpy"),
        "tcp_vs_mooncake": ("tcp", "mooncake"),
        "raw_socket_vs_mooncake": ("raw_socket", "mooncake"),
        "raw_socket_1thread_vs_mooncake": ("raw_socket_1thread", "mooncake"),
    }.items():
        out[name] = {}
        for n in sizes:
            a, b = g.get((num, n)), g.get((den, n))
            out[name][str(n)] = round(a / b, 3) if a and b else None
    return out


def render(report: dict) -> str:
    sizes = sorted({r["size_bytes"] for r in report["results"]})
    names = ["tcp", "raw_socket", "raw_1thread", "shm", "memcpy", "mooncake"]
    backend = {"raw_1thread": "raw_socket_1thread"}
    g = {(r["backend"], r["size_bytes"]): r for r in report["results"]}
    lines = [
        f"median GB/s over {report['repeats']} runs (same host, cross-process)",
        "size      "
        + "".join(f"{n:>12}" for n in names)
        + "   tcp/raw  tcp/raw1  shm/memcpy  tcp/mooncake",
    ]
    for n in sizes:
        cells = []
        for name in names:
            r = g.get((backend.get(name, name), n))
            cells.append(f"{r['gbps']:>12.3f}" if r and r["gbps"] is not None else f"{'n/a':>12}")
        rr = report["ratios"]
        fmt = [
            rr[k][str(n)]
            for k in (
                "tcp_vs_raw_socket",
                "tcp_vs_raw_socket_1thread",
                "shm_vs_memcpy",
                "tcp_vs_mooncake",
            )
        ]
        lines.append(
            f"{n // MIB:>4} MiB  "
            + "".join(cells)
            + "   "
            + "  ".join(f"{x:>8.2f}" if x is not None else f"{'n/a':>8}" for x in fmt)
        )
    pr = report["paired_ratios"]
    for key, label in (
        ("tcp_vs_raw_socket", "tcp/raw"),
        ("tcp_vs_raw_socket_1thread", "tcp/raw1"),
        ("shm_vs_memcpy", "shm/memcpy"),
    ):
        lines.append(
            f"paired (per-round) medians {label}: "
            + ", ".join(f"{int(k) // MIB} MiB {v:.2f}" for k, v in pr[key].items())
        )
    mc = [r for r in report["results"] if r["backend"] == "mooncake" and r["status"] != "ok"]
    if mc:
        lines.append(f"mooncake: unavailable ({mc[0]['reason']})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee bench transfer", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--sizes-mib", default="1,4,16,64", help="comma-separated sizes in MiB")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--streams", type=int, default=4, help="TCP streams (engine and raw sockets)")
    p.add_argument(
        "--mooncake-python",
        default=None,
        help="a Python that can import mooncake (default: search)",
    )
    p.add_argument("--no-mooncake", action="store_true")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.peer:
        return peer(args.size)
    sizes = [int(float(x) * MIB) for x in args.sizes_mib.split(",") if x]
    py = None if args.no_mooncake else find_mooncake_python(args.mooncake_python)
    report = bench(sizes, max(1, args.repeats), max(1, args.streams), py, args.no_mooncake)
    report["mooncake_python"] = py
    from services.transfer.backends import backends

    report["backends"] = {k: {"ok": v.ok, "reason": v.reason} for k, v in backends().items()}
    print(render(report))
    if not report["backends"]["rdma"]["ok"]:
        print(f"rdma: skipped ({report['backends']['rdma']['reason']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
