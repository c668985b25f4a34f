"""``perigee sim repro scale``: how the simulator's time grows with the work.

The work grows as a cluster planner grows it: ``k`` copies of the trace, each copy's
hash ids offset so that copies share no prefix, merged by arrival time, replayed on
``k`` times the nodes (``k*P + k*D``). Each copy therefore sees the load of the
``k = 1`` run; a simulator whose cost per event does not depend on the cluster's size
takes ``k`` times the ``k = 1`` wall time. Every point is timed in the same process,
one after the other, and reported as a ratio against ``k = 1``.

The wall time is split by who spends it (``perf_counter`` around the calls, so the
split is the same code path as an untimed run):

    reports     Simulator.refresh: the load snapshots handed to both policies
    admission   AdmissionPolicy.decide
    placement   PlacementPolicy.place and the prefix index's match
    rest        the event loop, the instances, the stores, the index's updates

Beside it, where a Python with NVIDIA Dynamo is given (``--dynamo PYTHON``, or
``.venv-dynamo/bin/python`` when present), ``dynamo.replay.run_trace_replay`` on the
same traces: its Rust mocker, ``kv_router``, ``k*(P+D)`` aggregated workers.
"""

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from perigee.sim import plots
from perigee.sim.gc_policy import paused_gc
from perigee.sim.metrics import summarize
from perigee.sim.simulator import SimConfig, Simulator
from perigee.trace import TRACE_BLOCK, TraceRequest

DEFAULT_COPIES = (1, 2, 4, 10)
# What a run decided (summary keys): the reference run must give the same.
OUTCOME = (
    "completed",
    "rejected",
    "rejected_by",
    "cache_hit_rate",
    "pulled_token_rate",
    "ttft_s",
    "tbt_s",
    "prefill_gpu_s",
    "sim_time_s",
    "events",
)
PARTS = ("reports", "admission", "placement")
DYNAMO_VENV = Path(__file__).resolve().parents[2] / ".venv-dynamo" / "bin" / "python"


def replicate(trace: Sequence[TraceRequest], copies: int) -> list[TraceRequest]:
    """``copies`` copies of ``trace`` merged by arrival time (a copy's requests keep
    their order, copies alternate at equal times), copy ``c``'s hash ids shifted by
    ``c`` times one more than the trace's largest id."""
    if copies < 1:
        raise ValueError(f"copies must be at least 1, not {copies}")
    span = 1 + max((h for r in trace for h in r.hash_ids), default=-1)
    out = list(trace)
    with paused_gc():  # a million requests built: no cycles among them to collect
        for c in range(1, copies):
            shift = (c * span).__add__
            out += [
                TraceRequest(
                    r.timestamp_s, r.input_length, r.output_length, tuple(map(shift, r.hash_ids))
                )
                for r in trace
            ]
    out.sort(key=lambda r: r.timestamp_s)  # stable
    return out


def _timed(split: dict[str, float], part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    clock = time.perf_counter

    def wrapper(*args: Any, **kw: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kw)
        finally:
            split[part] += clock() - t0

    return wrapper


def timed_run(
    trace: Sequence[TraceRequest],
    cfg: SimConfig,
    *,
    progress: bool = False,
    reference: bool = False,
) -> tuple[Simulator, dict[str, Any]]:
    """Run the simulator on ``trace``; its summary with ``wall_split_s`` added.
    ``reference``: every decision scans the cluster, as before issue 27 (every instance
    reports, admission and placement scan every live instance): same decisions."""
    if reference:
        cfg = replace(cfg, incremental_reports=False)
    sim = Simulator(trace, cfg, progress=progress)
    if reference:
        for policy in (sim.admission, sim.placement):
            if hasattr(policy, "pruned"):
                policy.pruned = False
    split = dict.fromkeys(PARTS, 0.0)
    # Instance attributes shadow the bound methods each caller looks up per call.
    sim.refresh = _timed(split, "reports", sim.refresh)  # type: ignore[method-assign]
    sim.admission.decide = _timed(split, "admission", sim.admission.decide)  # type: ignore[method-assign]
    sim.placement.place = _timed(split, "placement", sim.placement.place)  # type: ignore[method-assign]
    index = sim.cluster.index
    index.match = _timed(split, "placement", index.match)  # type: ignore[method-assign]
    sim.run()
    s = summarize(sim)
    split["rest"] = max(0.0, sim.wall_s - sum(split.values()))
    s["wall_split_s"] = split
    return sim, s


POINT_KEYS = (*OUTCOME, "requests", "cache_hit_rate", "wall_s", "wall_split_s")


def point(
    source: tuple[str, int | None],
    k: int,
    prefill: int,
    decode: int,
    *,
    reference: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """One point of the curve in a fresh Python process (each run starts from the same
    empty heap, whatever ran before it): the trace ``source`` (path, limit) ``k`` times
    over on ``k*prefill + k*decode`` nodes; the summary's keys the curve keeps."""
    spec = {
        "trace": source[0],
        "limit": source[1],
        "copies": k,
        "prefill": prefill,
        "decode": decode,
        "reference": reference,
        "progress": progress,
    }
    p = subprocess.run(
        [sys.executable, "-m", "perigee.sim.scale", json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    )
    return json.loads(p.stdout.strip().splitlines()[-1])


def _point_main(spec: dict[str, Any]) -> None:
    from perigee.trace import load_trace

    k = spec["copies"]
    tr = replicate(load_trace(spec["trace"], spec["limit"]), k)
    cfg = SimConfig(prefill=k * spec["prefill"], decode=k * spec["decode"])
    _, s = timed_run(tr, cfg, progress=spec["progress"], reference=spec["reference"])
    print(json.dumps({key: s[key] for key in POINT_KEYS}))


def dynamo_run(python: str, trace: Sequence[TraceRequest], workers: int) -> dict[str, Any]:
    """``dynamo.replay.run_trace_replay`` on ``trace`` in ``python`` (a separate venv):
    wall time of the call, and what its report says it did."""
    script = (
        "import json, sys, time\n"
        "from dynamo.replay import run_trace_replay\n"
        "t0 = time.perf_counter()\n"
        "r = run_trace_replay(sys.argv[1], num_workers=int(sys.argv[2]),"
        f" router_mode='kv_router', trace_block_size={TRACE_BLOCK})\n"
        "wall = time.perf_counter() - t0\n"
        "s = r.summary\n"
        "print(json.dumps({'wall_s': wall, 'requests': s.get('num_requests'),"
        " 'completed': s.get('completed_requests')}))\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for r in trace:
            row = {
                "timestamp": round(r.timestamp_s * 1000),
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            f.write(json.dumps(row) + "\n")
        path = f.name
    try:
        env = {**os.environ, "DYN_LOG": "error"}
        p = subprocess.run(
            [python, "-c", script, path, str(workers)],
            capture_output=True,
            text=True,
            env=env,
            timeout=3600,
        )
    finally:
        os.unlink(path)
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:] or ["failed"]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def scale(
    trace: Sequence[TraceRequest],
    out: str,
    *,
    copies: Sequence[int] = DEFAULT_COPIES,
    prefill: int = 8,
    decode: int = 8,
    dynamo: str | None = None,
    progress: bool = False,
    reference: bool = False,
    source: tuple[str, int | None] | None = None,
) -> dict:
    """The curve: each ``k`` in ``copies`` (1 first, added when missing) on
    ``k*prefill + k*decode`` nodes; each run in a fresh process when the trace's
    ``source`` (path, limit) is given, else in this one."""
    copies = sorted({1, *copies})
    if dynamo is None and DYNAMO_VENV.exists():
        dynamo = str(DYNAMO_VENV)  # "" : none
    res: dict[str, Any] = {
        "setup": f"k copies of the trace (hash ids offset per copy) on k*{prefill}P + "
        f"k*{decode}D, perigee sim defaults (global placement, early admission, exact "
        "load snapshots before each decision)",
        "points": [],
        "dynamo": dynamo,
    }
    base: dict[str, float] = {}
    for k in copies:
        tr = replicate(trace, k)
        cfg = SimConfig(prefill=k * prefill, decode=k * decode)
        if source is not None:
            s = point(source, k, prefill, decode, progress=progress)
        else:
            s = timed_run(tr, cfg, progress=progress)[1]
        ref: dict[str, Any] = {}
        if reference:
            if source is not None:
                r = point(source, k, prefill, decode, reference=True)
            else:
                r = timed_run(tr, cfg, reference=True)[1]
            same = all(r[key] == s[key] for key in OUTCOME)
            ref = {"wall_s": r["wall_s"], "wall_split_s": r["wall_split_s"], "same": same}
        pt: dict[str, Any] = {
            "copies": k,
            "prefill": cfg.prefill,
            "decode": cfg.decode,
            "requests": s["requests"],
            "completed": s["completed"],
            "events": s["events"],
            "cache_hit_rate": s["cache_hit_rate"],
            "ttft_mean_s": s["ttft_s"]["mean"],
            "wall_s": s["wall_s"],
            "wall_split_s": s["wall_split_s"],
            "us_per_request": 1e6 * s["wall_s"] / max(1, s["requests"]),
        }
        if ref:
            pt["reference"] = ref
        if dynamo:
            pt["dynamo"] = dynamo_run(dynamo, tr, cfg.prefill + cfg.decode)
        base = base or {
            "wall_s": pt["wall_s"],
            "dynamo": pt.get("dynamo", {}).get("wall_s", 0),
            "reference": ref.get("wall_s", 0),
        }
        pt["wall_ratio"] = pt["wall_s"] / base["wall_s"]
        if ref and base["reference"]:
            ref["wall_ratio"] = ref["wall_s"] / base["reference"]
        if base["dynamo"] and "wall_s" in pt.get("dynamo", {}):
            pt["dynamo"]["wall_ratio"] = pt["dynamo"]["wall_s"] / base["dynamo"]
        res["points"].append(pt)
        print(_row(pt), flush=True)
    ks = [p["copies"] for p in res["points"]]
    series = {"perigee sim": [p["wall_ratio"] for p in res["points"]]}
    if reference:
        series["perigee sim, full scans (before issue 27)"] = [
            p["reference"]["wall_ratio"] for p in res["points"]
        ]
    if any("wall_ratio" in p.get("dynamo", {}) for p in res["points"]):
        series["Dynamo replay (kv_router)"] = [
            p.get("dynamo", {}).get("wall_ratio", float("nan")) for p in res["points"]
        ]
    series["the work (k)"] = [float(k) for k in ks]
    plots.lines(
        os.path.join(out, "sim_scale.png"),
        ks,
        series,
        f"copies k of the trace (on k*{prefill}P + k*{decode}D)",
        "wall time / wall time at k = 1",
        "Simulator scaling: wall time against the work",
    )
    res["table"] = _table(res["points"])
    return res


def _row(p: dict) -> str:
    sp = p["wall_split_s"]
    dyn = p.get("dynamo", {})
    d = f" dynamo {dyn['wall_s']:.1f}s" if "wall_s" in dyn else ""
    if "reference" in p:
        r = p["reference"]
        d += f" full-scan {r['wall_s']:.1f}s ({r.get('wall_ratio', 1.0):.2f}x, same {r['same']})"
    return (
        f"x{p['copies']} {p['prefill']}P+{p['decode']}D {p['requests']} req: "
        f"{p['wall_s']:.1f}s ({p['wall_ratio']:.2f}x) reports {sp['reports']:.1f} "
        f"admission {sp['admission']:.1f} placement {sp['placement']:.1f} rest {sp['rest']:.1f}"
        f"{d}"
    )


def _table(points: list[dict]) -> str:
    header = [
        "copies",
        "nodes",
        "requests",
        "wall s",
        "x of k=1",
        "us/request",
        "reports s",
        "admission s",
        "placement s",
        "rest s",
        "Dynamo s",
        "Dynamo x of k=1",
        "full scans s",
        "full scans x of k=1",
    ]
    rows = []
    for p in points:
        sp, dyn = p["wall_split_s"], p.get("dynamo", {})
        rows.append(
            [
                str(p["copies"]),
                f"{p['prefill']}P+{p['decode']}D",
                str(p["requests"]),
                f"{p['wall_s']:.1f}",
                f"{p['wall_ratio']:.2f}",
                f"{p['us_per_request']:.0f}",
                *(f"{sp[k]:.1f}" for k in (*PARTS, "rest")),
                f"{dyn['wall_s']:.1f}" if "wall_s" in dyn else "-",
                f"{dyn['wall_ratio']:.2f}" if "wall_ratio" in dyn else "-",
                f"{p['reference']['wall_s']:.1f}" if "reference" in p else "-",
                f"{p['reference']['wall_ratio']:.2f}"
                if "wall_ratio" in p.get("reference", {})
                else "-",
            ]
        )
    out = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def main_args(argv: list[str]) -> dict[str, Any]:
    """``scale``'s own options (after the common ``perigee sim repro`` ones)."""
    import argparse

    p = argparse.ArgumentParser(prog="perigee sim repro scale")
    p.add_argument("--copies", default=",".join(map(str, DEFAULT_COPIES)))
    p.add_argument("--prefill", type=int, default=8, help="prefill nodes per copy")
    p.add_argument("--decode", type=int, default=8, help="decode nodes per copy")
    p.add_argument(
        "--dynamo",
        default=None,
        help="a Python with ai-dynamo installed (default: .venv-dynamo/bin/python if present)",
    )
    p.add_argument("--no-dynamo", action="store_true", help="perigee's simulator alone")
    p.add_argument("--progress", action="store_true", help="a progress bar per run")
    p.add_argument(
        "--reference",
        action="store_true",
        help="also time each point with every decision scanning the cluster (as before "
        "issue 27; the same decisions, checked)",
    )
    a = p.parse_args(argv)
    try:
        copies = [int(c) for c in a.copies.split(",") if c.strip()]
    except ValueError:
        p.error(f"--copies takes integers separated by commas, not {a.copies!r}")
    if not copies or min(copies) < 1:
        p.error("--copies needs at least one integer >= 1")
    return {
        "copies": copies,
        "prefill": a.prefill,
        "decode": a.decode,
        "dynamo": "" if a.no_dynamo else a.dynamo,
        "progress": a.progress,
        "reference": a.reference,
    }


if __name__ == "__main__":  # one point, for scale(): python -m perigee.sim.scale SPEC
    if len(sys.argv) != 2:
        sys.exit("run: perigee sim repro scale")
    _point_main(json.loads(sys.argv[1]))
