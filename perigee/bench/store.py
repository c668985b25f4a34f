"""``perigee bench store``: small-object put/get latency, perigee's store beside Mooncake's.

perigee: a nats-server, one store process (``python -m services.store``) and this
process as the client: every put and get is one request/reply on the store's ZeroMQ
data plane, the value copied into / out of the store's shared-memory arena. Measured
with the blocking :class:`~services.store.client.object_client.SyncObjectClient` ("perigee", the
same shape as Mooncake's Python API) and with the asyncio
:class:`~services.store.client.object_client.ObjectClient` ("perigee-async").

Mooncake (same run, same sizes and counts, when a Python that imports ``mooncake``
is found): ``mooncake_master`` (with its HTTP metadata server), one client process
that mounts the memory segment (it holds the data, like our store process) and one
client process with no segment that runs the timed put/get (data over Mooncake's TCP
transport to the holder). Unavailable -> reported as such.

Latencies are per operation, sequential (one in flight), after a warm-up; p50 / p99
in microseconds. Both systems stay up for the whole run and are measured in
alternating chunks (``--rounds``) per size, so both see the same load. JSON: {"results": [{"system", "op", "size_bytes", "p50_us", "p99_us",
"ops"}...]}.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perigee.bench.stats import percentile
from perigee.bench.transfer import find_mooncake_python
from perigee.natsd import NatsServer, free_port
from services.transfer import data_auth

ROOT = Path(__file__).resolve().parents[2]

MOONCAKE_STORE = r"""
import json, sys, time
from mooncake.store import MooncakeDistributedStore
role, meta, master = sys.argv[1], sys.argv[2], sys.argv[3]
s = MooncakeDistributedStore()
seg = (512 << 20) if role == "holder" else 0
rc = s.setup("127.0.0.1", meta, seg, 64 << 20, "tcp", "", master)
if rc != 0:
    print(json.dumps({"error": "setup failed: %d" % rc}), flush=True); sys.exit(1)
if role == "holder":
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.read()
    sys.exit(0)
sizes, n, warm = json.loads(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
out = {}
for size in sizes:
    v = bytes(range(256)) * (size // 256) + bytes(size % 256)
    put, get = [], []
    for i in range(warm + n):
        key = "k%d_%d" % (size, i)
        t = time.perf_counter(); rc = s.put(key, v); dt_p = time.perf_counter() - t
        if rc != 0:
            print(json.dumps({"error": "put failed: %d" % rc}), flush=True); sys.exit(1)
        t = time.perf_counter(); got = s.get(key); dt_g = time.perf_counter() - t
        if got != v:
            print(json.dumps({"error": "get returned %d bytes" % len(got)}), flush=True); sys.exit(1)
        if i >= warm:
            put.append(dt_p); get.append(dt_g)
        s.remove(key)
    out[str(size)] = {"put": put, "get": get}
print(json.dumps({"results": out}), flush=True)
"""


class _Mooncake:
    """mooncake_master + a holder client (mounts the segment) for the whole run; each
    timed chunk is a fresh client process with no segment."""

    def __init__(self, py: str) -> None:
        self.py = py
        self.procs: list[subprocess.Popen] = []
        self.meta = self.master = ""

    def start(self) -> str:
        master_bin = shutil.which("mooncake_master", path=os.path.dirname(self.py))
        if master_bin is None:
            return f"no mooncake_master next to {self.py}"
        rpc, http = free_port(), free_port()
        self.meta, self.master = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
        self.procs.append(
            subprocess.Popen(
                [
                    master_bin,
                    "-enable_http_metadata_server=true",
                    f"-http_metadata_server_port={http}",
                    f"-rpc_port={rpc}",
                    f"-metrics_port={free_port()}",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        holder = subprocess.Popen(
            [self.py, "-c", MOONCAKE_STORE, "holder", self.meta, self.master],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.procs.append(holder)
        line = holder.stdout.readline() if holder.stdout else ""
        return "" if '"ready"' in line else f"mooncake holder did not start ({line.strip()[:200]})"

    def chunk(self, size: int, n: int, warm: int) -> tuple[dict[str, list[float]] | None, str]:
        run = subprocess.run(
            [
                self.py,
                "-c",
                MOONCAKE_STORE,
                "client",
                self.meta,
                self.master,
                json.dumps([size]),
                str(n),
                str(warm),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        last = (run.stdout.strip().splitlines() or ["{}"])[-1]
        res = json.loads(last)
        if "results" not in res:
            return None, f"mooncake client failed: {res.get('error', run.stderr[-300:])}"
        return res["results"][str(size)], ""

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.stdin:
                p.stdin.close()
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()


async def run_all(
    sizes: list[int], n: int, warm: int, rounds: int, py: str | None, why: str
) -> tuple[
    dict[int, dict[str, list[float]]],
    dict[int, dict[str, list[float]]],
    dict[int, dict[str, list[float]]] | None,
    str,
]:
    """Both systems up for the whole run; per round and size, a perigee chunk then a
    Mooncake chunk, so that both see the same load on a shared box."""
    import nats

    from services.store.client.object_client import ObjectClient, SyncObjectClient

    ours: dict[int, dict[str, list[float]]] = {s: {"put": [], "get": []} for s in sizes}
    ours_async: dict[int, dict[str, list[float]]] = {s: {"put": [], "get": []} for s in sizes}
    theirs: dict[int, dict[str, list[float]]] | None = None
    mc = _Mooncake(py) if py else None
    per = max(1, n // rounds)
    with NatsServer() as srv, tempfile.TemporaryDirectory() as logs:
        env = {**os.environ, "OTEL_TRACES_EXPORTER": "none"}
        with open(os.path.join(logs, "store.log"), "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "services.store",
                    "--nats",
                    srv.url,
                    "--node",
                    "bench0",
                    "--capacity-blocks",
                    "1024",
                    "--log-level",
                    "WARNING",
                ],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            if mc is not None:
                why = mc.start()
                theirs = None if why else {s: {"put": [], "get": []} for s in sizes}
            nc = await nats.connect(srv.url)
            objs = await ObjectClient.connect(nc, ["bench0"], timeout=30)
            sync = SyncObjectClient.of(objs)
            for r in range(rounds):
                w = warm if r == 0 else 5
                for size in sizes:
                    v = bytes(range(256)) * (size // 256) + bytes(size % 256)
                    for i in range(w + per):  # the blocking client, as Mooncake's API is
                        key = f"s{size}_{r}_{i}"
                        t = time.perf_counter()
                        sync.put(key, v)
                        dt_p = time.perf_counter() - t
                        t = time.perf_counter()
                        got = sync.get(key)
                        dt_g = time.perf_counter() - t
                        if got != v:
                            raise RuntimeError(f"get returned {len(got)} bytes, want {size}")
                        if i >= w:
                            ours[size]["put"].append(dt_p)
                            ours[size]["get"].append(dt_g)
                        if i % 64 == 63:
                            await objs.remove(key)
                    for i in range(w + per):  # the asyncio client
                        key = f"a{size}_{r}_{i}"
                        t = time.perf_counter()
                        await objs.put(key, v)
                        dt_p = time.perf_counter() - t
                        t = time.perf_counter()
                        got = await objs.get(key)
                        dt_g = time.perf_counter() - t
                        if got != v:
                            raise RuntimeError(f"get returned {len(got)} bytes, want {size}")
                        if i >= w:
                            ours_async[size]["put"].append(dt_p)
                            ours_async[size]["get"].append(dt_g)
                        if i % 64 == 63:
                            await objs.remove(key)
                    if theirs is not None and mc is not None:
                        got_mc, why = mc.chunk(size, per, w)
                        if got_mc is None:
                            theirs = None
                        else:
                            theirs[size]["put"] += got_mc["put"]
                            theirs[size]["get"] += got_mc["get"]
            sync.close()
            await objs.close()
            await nc.close()
        finally:
            if mc is not None:
                mc.stop()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
    return ours, ours_async, theirs, why


def rows(system: str, data: dict[int, dict[str, list[float]]]) -> list[dict]:
    out = []
    for size, ops in sorted(data.items()):
        for op in ("put", "get"):
            v = ops[op]
            out.append(
                {
                    "system": system,
                    "op": op,
                    "size_bytes": size,
                    "ops": len(v),
                    "p50_us": round(percentile(v, 50) * 1e6, 1),
                    "p99_us": round(percentile(v, 99) * 1e6, 1),
                    "status": "ok",
                }
            )
    return out


def render(report: dict) -> str:
    lines = [f"{'system':<14}{'op':<5}{'size':>9}{'p50 us':>10}{'p99 us':>10}{'ops':>7}"]
    for r in report["results"]:
        if r["status"] != "ok":
            lines.append(
                f"{r['system']:<14}{r['op']:<5}{r['size_bytes']:>9}  unavailable: {r['reason']}"
            )
            continue
        lines.append(
            f"{r['system']:<14}{r['op']:<5}{r['size_bytes']:>9}{r['p50_us']:>10.1f}"
            f"{r['p99_us']:>10.1f}{r['ops']:>7}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee bench store", description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--sizes", default="1024,4096,65536", help="object sizes in bytes")
    p.add_argument("--ops", type=int, default=500, help="timed put+get pairs per size")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="alternate perigee / Mooncake chunks this many times per size",
    )
    p.add_argument("--mooncake-python", default=None)
    p.add_argument("--no-mooncake", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault(data_auth.ENV, data_auth.new_key())  # the store and this client share it
    sizes = [int(x) for x in args.sizes.split(",") if x]
    py = None if args.no_mooncake else find_mooncake_python(args.mooncake_python)
    why = "skipped" if args.no_mooncake else "mooncake is not importable here"
    from services.common import runner  # uvloop where installed, as the services run

    ours, ours_async, theirs, why = runner.run(
        run_all(sizes, args.ops, args.warmup, max(1, args.rounds), py, why)
    )
    results = rows("perigee", ours) + rows("perigee-async", ours_async)
    if theirs is None:
        results += [
            {
                "system": "mooncake",
                "op": op,
                "size_bytes": s,
                "status": "unavailable",
                "reason": why,
            }
            for s in sizes
            for op in ("put", "get")
        ]
    else:
        results += rows("mooncake", theirs)
    report = {"results": results, "mooncake_python": py}
    print(render(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
