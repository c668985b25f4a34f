"""``perigee bench ship``: what a request pays to move its KV store to store, in one run.

The serving path, end to end: a nats-server and four real store processes
(``python -m services.store``), two pairs:

    tcp  "two hosts on loopback": the source store on 127.0.0.1, the destination on
         127.0.0.2, both with ``--transports tcp`` (what two hosts have: no shared
         memory between them), so the bytes take the transfer engine's multi-stream TCP
    shm  one host: both on 127.0.0.1 with every transport, so the bytes take shared memory

For each size (a prompt of ``--tokens`` tokens, in blocks of the default model's KV:
SmolLM2-135M-Instruct, float32, 32 tokens a block = 1.47 MB), a PREFILL transaction
on the source and a DECODE one on the destination, the source slots filled with
random bytes; then the worker's own calls: ``StoreClient.lease`` (the store OPENs the
write grant on the peer: a prefill worker sends it as its compute starts, so it is
timed apart, ``open_ms``), then, timed, ``StoreClient.ship_layer`` of every block, the
whole KV at once (SHIP to its store over the store's Unix socket -> TransferEngine
WRITE under the grant, over shm split across two copy threads -> the verdict: over TCP
the receiver's acks, over shm the peer's slot generations read after the copy -> OK;
the CLOSE goes out unawaited). ``with_open`` is the
same transfer with the OPEN counted in. The first ship of each size is checked byte
for byte on the destination.

In the same run, per size and round, the ceilings of ``perigee bench transfer``
(reused from :mod:`perigee.bench.transfer`): **raw_socket**, 4 plain sockets with one
sending thread each into a peer process, and **memcpy**, one numpy copy of the same
size; then **mooncake**, Mooncake's own TransferEngine (TCP) between two processes, at
the same sizes (reported "unavailable" with the reason when it cannot be imported).

Each figure is the median over ``--repeats`` rounds after a warm-up; gbps is GB/s
(10^9 bytes/s). JSON: {"unit": "GB/s", "results": [{"backend", "size_bytes", "tokens",
"gbps", "runs", "status"}...], "ratios": {...}, "paired_ratios": {...}, "targets": {...}}.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from perigee.bench import transfer as tb
from perigee.natsd import NatsServer

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20
BLOCK_TOKENS = 32
# SmolLM2-135M-Instruct (the default model), float32: 30 layers x (K + V) x 3 KV heads x 64
TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
TOKENS = [32, 128, 384, 1024, 4096]
TARGET_MIN_BYTES = 16 * MIB
PAIRS = {  # name -> (source host, destination host, transports)
    "tcp": ("127.0.0.1", "127.0.0.2", "tcp"),
    "shm": ("127.0.0.1", "127.0.0.1", "rdma,shm,tcp"),
}


def _store(
    nats_url: str,
    node: str,
    host: str,
    transports: str,
    block_bytes: int,
    capacity: int,
    log_dir: str,
) -> subprocess.Popen:
    from services.transfer import data_auth

    os.environ.setdefault(
        data_auth.ENV, data_auth.new_key()
    )  # both stores (and this process) share it
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "none", "PYTHONUNBUFFERED": "1"}
    with open(os.path.join(log_dir, f"{node}.log"), "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.store",
                "--nats",
                nats_url,
                "--node",
                node,
                "--host",
                host,
                "--block-size",
                str(BLOCK_TOKENS),
                "--block-bytes",
                str(block_bytes),
                "--capacity-blocks",
                str(capacity),
                "--transports",
                transports,
                "--peer-timeout",
                "30",
                "--log-level",
                "WARNING",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


class _Pair:
    """A source and a destination store, their worker-side clients and two transactions
    per size (reused across rounds: the destination slots stay writable)."""

    def __init__(self, name: str, nc, src, dst) -> None:
        self.name = name
        self.nc = nc
        self.src, self.dst = src, dst
        self.txs: dict[int, tuple] = {}

    async def prepare(self, blocks: int, seed: int) -> None:
        from bus_schemas import subjects
        from bus_schemas.control import TxAllocate, TxHandle, TxReply, TxRole
        from services.common.bus import request

        handles = []
        for client, role in ((self.src, TxRole.PREFILL), (self.dst, TxRole.DECODE)):
            hashes = [(seed << 20) + i for i in range(blocks)]
            msg = TxAllocate(
                request_id=f"bench-ship-{self.name}-{blocks}",
                role=role,
                block_hashes=hashes,
                num_tokens=blocks * BLOCK_TOKENS,
                lease_s=600.0,
            )
            h = await request(
                self.nc,
                subjects.store_ctl(client.info.node, "tx.allocate"),
                msg,
                TxReply,
                timeout=30,
            )
            if not isinstance(h, TxHandle):
                raise RuntimeError(f"{client.info.node} refused the transaction: {h}")
            handles.append(h)
        rng = np.random.default_rng(seed)
        for s in handles[0].slots:
            self.src.slot(s)[:] = rng.integers(0, 256, self.src.arena.block_bytes, dtype=np.uint8)
        self.txs[blocks] = tuple(handles)

    async def lease(self, blocks: int) -> None:
        src, dst = self.txs[blocks]
        await self.src.lease(src, dst, list(range(blocks)))

    async def ship(self, blocks: int) -> None:
        src, dst = self.txs[blocks]
        bb = self.src.arena.block_bytes
        await self.src.ship_layer(src, dst, 0, list(range(blocks)), bb, 0)

    def check(self, blocks: int) -> None:
        src, dst = self.txs[blocks]
        for a, b in zip(src.slots, dst.slots, strict=True):
            if bytes(self.src.slot(a)) != bytes(self.dst.slot(b)):
                raise RuntimeError(f"{self.name}: slot {b} on {dst.node} differs from its source")

    async def release(self) -> None:
        from bus_schemas import subjects
        from bus_schemas.control import TxAbort, TxDoneReply
        from services.common.bus import request

        for src, dst in self.txs.values():
            for h in (src, dst):
                await request(
                    self.nc,
                    subjects.store_ctl(h.node, "tx.abort"),
                    TxAbort(tx_id=h.tx_id, request_id="bench-ship", reason="done"),
                    TxDoneReply,
                    timeout=30,
                )
        self.txs.clear()


async def _run(
    tokens: list[int],
    repeats: int,
    block_bytes: int,
    streams: int,
    mooncake_py: str | None,
    mc_why: str,
) -> tuple[dict, dict, str, dict, dict]:
    import nats

    from services.store.client.store_client import StoreClient

    sizes = {t: -(-t // BLOCK_TOKENS) for t in tokens}  # tokens -> blocks
    top = max(sizes.values()) * block_bytes
    capacity = max(sizes.values()) + 8
    runs: dict[tuple[str, int], list[float]] = {}
    mc_runs: dict[int, list[float]] = {}
    opens: dict[tuple[str, int], list[float]] = {}  # seconds, lease + ship
    stats: dict = {}
    with NatsServer() as srv, tempfile.TemporaryDirectory(prefix="perigee-bench-ship-") as logs:
        procs = []
        for name, (h_src, h_dst, transports) in PAIRS.items():
            procs.append(
                _store(srv.url, f"{name}-src", h_src, transports, block_bytes, capacity, logs)
            )
            procs.append(
                _store(srv.url, f"{name}-dst", h_dst, transports, block_bytes, capacity, logs)
            )
        peer = subprocess.Popen(
            [sys.executable, "-m", "perigee.bench.transfer", "--peer", "--size", str(top)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        mc = tb.MooncakeTE(mooncake_py, top) if mooncake_py and not mc_why else None
        nc = await nats.connect(srv.url)
        clients = []
        try:
            pairs = []
            for name in PAIRS:
                src = await StoreClient.connect(nc, f"{name}-src", timeout=60, op_timeout_s=120)
                dst = await StoreClient.connect(nc, f"{name}-dst", timeout=60, op_timeout_s=120)
                clients += [src, dst]
                pairs.append(_Pair(name, nc, src, dst))
            info = json.loads(peer.stdout.readline() if peer.stdout else "{}")
            raw = tb.RawSockets(info["raw_port"], streams)
            buf = memoryview(bytearray(os.urandom(top)))
            a = np.frombuffer(buf, dtype=np.uint8)
            b = np.empty(top, dtype=np.uint8)
            b[:] = 1  # touch every page

            for seed, (_t, blocks) in enumerate(sizes.items(), start=1):
                n = blocks * block_bytes
                for p in pairs:
                    await p.prepare(blocks, seed)
                    await p.lease(blocks)
                    await p.ship(blocks)  # warm-up: connections, mappings
                    p.check(blocks)
                raw.write(buf[:n])
                np.copyto(b[:n], a[:n])
                for _ in range(repeats):
                    for p in pairs:
                        t0 = time.perf_counter()
                        await p.lease(blocks)
                        t1 = time.perf_counter()
                        await p.ship(blocks)
                        t2 = time.perf_counter()
                        runs.setdefault((p.name, n), []).append(n / (t2 - t1) / 1e9)
                        opens.setdefault((p.name, n), []).append(t2 - t0)
                    t0 = time.perf_counter()
                    raw.write(buf[:n])
                    runs.setdefault(("raw_socket", n), []).append(
                        n / (time.perf_counter() - t0) / 1e9
                    )
                    t0 = time.perf_counter()
                    np.copyto(b[:n], a[:n])
                    runs.setdefault(("memcpy", n), []).append(n / (time.perf_counter() - t0) / 1e9)
                for p in pairs:
                    await p.release()
                if mc is not None and not mc_why:
                    got, mc_why = mc.run(n, repeats)
                    if got is not None:
                        mc_runs[n] = got
            for p in pairs:  # which transport each pair's bytes really took
                c = await _counters(nc, p.src.info.node)
                stats[p.name] = {t: c.get(f"{t}_bytes", 0) for t in ("tcp", "shm", "rdma")}
            # how the worker's requests reached its store (the Unix socket, or ZeroMQ)
            stats["_channel"] = {p.name: "unix" if p.src.local else "zeromq" for p in pairs}
            raw.close()
        finally:
            for c in clients:
                await c.close()
            await nc.close()
            if mc is not None:
                mc.close()
            if peer.stdin:
                peer.stdin.close()
            peer.wait(timeout=30)
            for pr in procs:
                pr.send_signal(signal.SIGTERM)
            for pr in procs:
                try:
                    pr.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pr.kill()
    stats["_with_open"] = opens
    return runs, mc_runs, mc_why, {n * block_bytes: t for t, n in sizes.items()}, stats


async def _counters(nc, node: str) -> dict[str, int]:
    from bus_schemas import subjects
    from bus_schemas.codec import decode
    from bus_schemas.load import WorkerStats

    msg = await nc.request(subjects.worker_stats("store", node), b"", timeout=10)
    return decode(msg.data, WorkerStats).counters


def report(
    runs: dict, mc_runs: dict, mc_why: str, tokens_of: dict, repeats: int, block_bytes: int
) -> dict:
    sizes = sorted(tokens_of)
    results = [
        {
            "backend": k,
            "size_bytes": n,
            "tokens": tokens_of[n],
            "gbps": round(statistics.median(v), 3),
            "runs": [round(x, 3) for x in v],
            "status": "ok",
        }
        for (k, n), v in runs.items()
    ]
    for n in sizes:
        v = mc_runs.get(n)
        row = {"backend": "mooncake", "size_bytes": n, "tokens": tokens_of[n]}
        if v is None:
            row |= {
                "gbps": None,
                "runs": [],
                "status": "unavailable",
                "reason": mc_why or "no result",
            }
        else:
            row |= {
                "gbps": round(statistics.median(v), 3),
                "runs": [round(x, 3) for x in v],
                "status": "ok",
            }
        results.append(row)
    g = {(r["backend"], r["size_bytes"]): r["gbps"] for r in results}
    ratios: dict[str, dict[str, float | None]] = {}
    for name, (num, den) in {
        "tcp_vs_raw_socket": ("tcp", "raw_socket"),
        "shm_vs_memcpy": ("shm", "memcpy"),
        "tcp_vs_mooncake": ("tcp", "mooncake"),
    }.items():
        ratios[name] = {}
        for n in sizes:
            x, y = g.get((num, n)), g.get((den, n))
            ratios[name][str(n)] = round(x / y, 3) if x and y else None
    paired = {
        name: {
            str(n): round(
                statistics.median(
                    x / y for x, y in zip(runs[(num, n)], runs[(den, n)], strict=True)
                ),
                3,
            )
            for n in sizes
        }
        for name, (num, den) in {
            "tcp_vs_raw_socket": ("tcp", "raw_socket"),
            "shm_vs_memcpy": ("shm", "memcpy"),
        }.items()
    }
    goals = {"tcp_vs_raw_socket": 0.8, "shm_vs_memcpy": 0.5, "tcp_vs_mooncake": 1.3}
    targets = {}
    for name, goal in goals.items():
        got = paired.get(name, ratios[name])
        for n in sizes:
            if n >= TARGET_MIN_BYTES:
                v = got[str(n)]
                targets[f"{name}@{n}"] = {
                    "goal": goal,
                    "ratio": v,
                    "met": None if v is None else v >= goal,
                }
    return {
        "unit": "GB/s",
        "repeats": repeats,
        "block_bytes": block_bytes,
        "block_tokens": BLOCK_TOKENS,
        "results": results,
        "ratios": ratios,
        "paired_ratios": paired,
        "targets": targets,
    }


def render(rep: dict) -> str:
    sizes = sorted({r["size_bytes"] for r in rep["results"]})
    names = ["tcp", "raw_socket", "shm", "memcpy", "mooncake"]
    g = {(r["backend"], r["size_bytes"]): r for r in rep["results"]}
    lines = [
        f"store -> store ship, median GB/s over {rep['repeats']} rounds "
        f"(blocks of {rep['block_bytes']} bytes)",
        "tokens   MiB  "
        + "".join(f"{n:>11}" for n in names)
        + "   tcp/raw  shm/memcpy  tcp/mooncake",
    ]
    for n in sizes:
        cells = []
        for name in names:
            r = g.get((name, n))
            cells.append(f"{r['gbps']:>11.3f}" if r and r["gbps"] is not None else f"{'n/a':>11}")
        tok = g[("tcp", n)]["tokens"] if ("tcp", n) in g else 0
        pr, rr = rep["paired_ratios"], rep["ratios"]
        fmt = [
            pr["tcp_vs_raw_socket"][str(n)],
            pr["shm_vs_memcpy"][str(n)],
            rr["tcp_vs_mooncake"][str(n)],
        ]
        lines.append(
            f"{tok:>6} {n / MIB:>5.1f}  "
            + "".join(cells)
            + "   "
            + "  ".join(f"{x:>9.2f}" if x is not None else f"{'n/a':>9}" for x in fmt)
        )
    mc = [r for r in rep["results"] if r["backend"] == "mooncake" and r["status"] != "ok"]
    if mc:
        lines.append(f"mooncake: unavailable ({mc[0]['reason']})")
    for pair, how in rep.get("worker_channel", {}).items():
        lines.append(f"{pair} pair: the worker's requests to its store over {how}")
    for pair, moved in rep.get("bytes_by_transport", {}).items():
        lines.append(
            f"{pair} pair moved: "
            + ", ".join(f"{t} {b / MIB:.0f} MiB" for t, b in moved.items() if b)
        )
    for pair, by_size in rep.get("with_open", {}).items():
        lines.append(
            f"{pair} with the OPEN counted in: "
            + ", ".join(
                f"{int(n) / MIB:.1f} MiB {g:.3f} GB/s (open {rep['open_ms'][pair][n]:.2f} ms)"
                for n, g in by_size.items()
            )
        )
    missed = [k for k, v in rep["targets"].items() if v["met"] is False]
    lines.append(
        "targets at >= 16 MiB: " + ("all met" if not missed else "missed " + ", ".join(missed))
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee bench ship", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument(
        "--tokens",
        default=",".join(map(str, TOKENS)),
        help="prompt lengths in tokens (comma-separated); 4096 is the 4k-token prompt",
    )
    p.add_argument(
        "--token-bytes",
        type=int,
        default=TOKEN_BYTES,
        help="KV bytes per token (default: SmolLM2-135M-Instruct, float32)",
    )
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--streams", type=int, default=4, help="raw-socket ceiling's streams")
    p.add_argument(
        "--mooncake-python",
        default=None,
        help="a Python that can import mooncake (default: search)",
    )
    p.add_argument("--no-mooncake", action="store_true")
    p.add_argument(
        "--cuda",
        action="store_true",
        help="add the connector's copies between vLLM's pages and the arena "
        "(perigee.bench.ship_cuda): CUDA pages where there is a GPU (pageable, page-locked, "
        "batched), else CPU pages (page by page against batched)",
    )
    p.add_argument("--cuda-only", action="store_true", help="only those (no stores)")
    args = p.parse_args(argv)
    tokens = [int(x) for x in args.tokens.split(",") if x]
    if args.cuda or args.cuda_only:
        from perigee.bench import ship_cuda

        cuda = ship_cuda.measure(tokens, max(1, args.repeats))
        print(ship_cuda.render(cuda))
        if args.cuda_only:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"cuda": cuda}, f, indent=2)
            return 0 if cuda.get("status") == "ok" else 1
    py = None if args.no_mooncake else tb.find_mooncake_python(args.mooncake_python)
    why = (
        "skipped (--no-mooncake)"
        if args.no_mooncake
        else ""
        if py
        else "mooncake is not importable here; pip install "
        "mooncake-transfer-engine-non-cuda in a separate venv and pass --mooncake-python"
    )
    block_bytes = BLOCK_TOKENS * args.token_bytes
    from services.common import runner  # uvloop where installed, as a worker runs

    runs, mc_runs, why, tokens_of, moved = runner.run(
        _run(tokens, max(1, args.repeats), block_bytes, max(1, args.streams), py, why)
    )
    rep = report(runs, mc_runs, why, tokens_of, max(1, args.repeats), block_bytes)
    rep["mooncake_python"] = py
    opens = moved.pop("_with_open")
    rep["worker_channel"] = moved.pop("_channel")
    # The same ships with their lease's OPEN counted in (a request whose compute is
    # shorter than that round trip pays it): median GB/s and the OPEN's median ms.
    rep["with_open"] = {
        name: {
            str(n): round(statistics.median(n / t for t in ts) / 1e9, 3)
            for (k, n), ts in opens.items()
            if k == name
        }
        for name in PAIRS
    }
    rep["open_ms"] = {
        name: {
            str(n): round(
                statistics.median(
                    (t - n / g / 1e9) * 1e3 for t, g in zip(ts, runs[(name, n)], strict=True)
                ),
                2,
            )
            for (k, n), ts in opens.items()
            if k == name
        }
        for name in PAIRS
    }
    rep["bytes_by_transport"] = moved  # per pair, from the source store's counters
    if args.cuda:
        rep["cuda"] = cuda
    print(render(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
