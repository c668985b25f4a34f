"""``perigee sim repro NAME``: the paper's scheduling figures on the conversation trace.

    fig5    prefill scheduling: random / load / local / global, average TTFT (16 nodes)
    fig16   cache hit rate against cache capacity, request sequence only
    fig17   local vs global cache: 10 prefill nodes of 3M tokens, outputs of 1 token
    table4  rejections under baseline / early / predict admission, 8P+8D, replay x2
    fig23   P/D ratio sweep on 16 nodes (TTFT 10 s, TBT 100 ms thresholds)
    cpp     chunked pipeline parallelism: TTFT by prompt length, groups of X = 1, 2, 4
    multiturn  decode write-back on and off: cache hit rate and TTFT, all requests and
            the next turns perigee.sim.writeback infers (issue 24)
    scale   the simulator's wall time as the trace and the cluster grow k-fold
            (perigee.sim.scale; its options: perigee sim repro scale --help-scale)

Each writes ``<out>/sim_<name>.json`` and ``<out>/sim_<name>.png`` and prints a
markdown table. Every number comes from :class:`Simulator` runs with the defaults of
``perigee sim`` unless the experiment names a change.
"""

import argparse
import json
import os
import sys
import time

from perigee.sim import plots, repro_multiturn, scale
from perigee.sim.capacity import hit_rate
from perigee.sim.metrics import effective, summarize
from perigee.sim.simulator import SimConfig, Simulator
from perigee.trace import DEFAULT_TRACE, load_trace

STRATEGIES = ("random", "load", "local", "global")


def _run(trace, **kw) -> tuple[Simulator, dict]:
    sim = Simulator(trace, SimConfig(**kw)).run()
    return sim, summarize(sim)


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def fig5(trace, out: str, speeds=(1.0, 3.0)) -> dict:
    res: dict = {"setup": "8 prefill + 8 decode nodes, early admission, 3M tokens/node", "runs": {}}
    rows = []
    for speed in speeds:
        for pol in STRATEGIES:
            _, s = _run(trace, policy=pol, speed=speed)
            res["runs"][f"{pol}@{speed:g}"] = s
            rows.append(
                [
                    f"x{speed:g}",
                    pol,
                    s["ttft_s"]["mean"],
                    s["ttft_s"]["p50"],
                    s["ttft_s"]["p99"],
                    s["cache_hit_rate"],
                    s["pulled_token_rate"],
                    s["prefill_gpu_s"]["mean_per_request"],
                    s["rejected"],
                ]
            )
    plots.bars(
        os.path.join(out, "sim_fig5.png"),
        list(STRATEGIES),
        {
            f"replay x{sp:g}": [res["runs"][f"{p}@{sp:g}"]["ttft_s"]["mean"] for p in STRATEGIES]
            for sp in speeds
        },
        "average TTFT (s)",
        "Fig. 5 (sim): prefill scheduling, conversation trace, 8P+8D",
    )
    res["table"] = _table(
        [
            "replay",
            "strategy",
            "avg TTFT s",
            "p50 s",
            "p99 s",
            "cache hit",
            "pulled",
            "prefill GPU s/req",
            "rejected",
        ],
        rows,
    )
    return res


def fig16(
    trace, out: str, capacities=(0.25e6, 0.5e6, 1e6, 2e6, 3e6, 5e6, 10e6, 20e6, 30e6, 50e6, 100e6)
) -> dict:
    best = hit_rate(trace, None)
    pts = [(c, hit_rate(trace, int(c))) for c in capacities]
    plots.lines(
        os.path.join(out, "sim_fig16.png"),
        [c / 1e6 for c, _ in pts],
        {
            "LRU cache hit rate": [h for _, h in pts],
            "theoretical max (unbounded)": [best] * len(pts),
        },
        "cache capacity (M tokens)",
        "cache hit rate",
        "Fig. 16 (sim): hit rate vs capacity, conversation trace",
        xlog=True,
        vline=3.0,
    )
    rows = [[f"{c / 1e6:g}M", h, h / best] for c, h in pts] + [["unbounded", best, 1.0]]
    return {
        "theoretical_max": best,
        "points": [{"capacity_tokens": c, "hit_rate": h} for c, h in pts],
        "table": _table(["capacity (tokens)", "hit rate", "of theoretical max"], rows),
    }


def fig17(trace, out: str, speeds=(1.0, 3.0), cap: int = 3_000_000) -> dict:
    res: dict = {
        "setup": f"10 prefill nodes x {cap / 1e6:g}M tokens, 1 decode node without a "
        "store, every output 1 token, early admission",
        "runs": {},
    }
    rows = []
    for speed in speeds:
        for label, pol in (("local cache", "local"), ("global cache", "global")):
            _, s = _run(
                trace,
                policy=pol,
                prefill=10,
                decode=1,
                decode_cache_tokens=0,
                output_tokens=1,
                cache_tokens_per_node=cap,
                speed=speed,
            )
            res["runs"][f"{pol}@{speed:g}"] = s
            rows.append(
                [
                    f"x{speed:g}",
                    label,
                    s["cache_hit_rate"],
                    s["pulled_token_rate"],
                    s["prefill_gpu_s"]["mean_per_request"],
                    s["ttft_s"]["mean"],
                    s["rejected"],
                ]
            )
    plt = plots._plt()
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.8))
    w = 0.8 / len(speeds)
    for a, key, title in (
        (ax[0], lambda s: s["cache_hit_rate"], "cache hit rate"),
        (
            ax[1],
            lambda s: s["prefill_gpu_s"]["mean_per_request"],
            "avg prefill GPU time per request (s)",
        ),
    ):
        for j, sp in enumerate(speeds):
            vals = [key(res["runs"][f"{p}@{sp:g}"]) for p in ("local", "global")]
            xs = [i + (j - (len(speeds) - 1) / 2) * w for i in range(2)]
            b = a.bar(xs, vals, w, label=f"replay x{sp:g}")
            a.bar_label(b, labels=[f"{v:.3f}" for v in vals], fontsize=8)
        a.set_xticks([0, 1], ["local cache", "global cache"])
        a.set_title(title)
        a.legend(fontsize=8)
    fig.suptitle(f"Fig. 17 (sim): 10 prefill nodes x {cap / 1e6:g}M tokens, conversation trace")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "sim_fig17.png"), dpi=110)
    plt.close(fig)
    res["table"] = _table(
        ["replay", "setup", "cache hit", "pulled", "prefill GPU s/req", "avg TTFT s", "rejected"],
        rows,
    )
    return res


def table4(trace, out: str, setups=((8, 8, 2.0), (8, 8, 8.0), (14, 2, 8.0))) -> dict:
    from services.common.admission_mode import names

    modes = names()  # baseline, early, predict: the live services' admission modes
    res: dict = {"modes": modes, "runs": {}}
    rows = []
    for p, d, speed in setups:
        for mode in modes:
            _, s = _run(trace, admission=mode, prefill=p, decode=d, speed=speed)
            res["runs"][f"{mode}@{p}P{d}D x{speed:g}"] = s
            by = s["rejected_by"]
            rows.append(
                [
                    f"{p}P{d}D x{speed:g}",
                    mode,
                    s["rejected"],
                    by["admission"],
                    by["conductor"],
                    by["decode"],
                    s["prefill_gpu_s"]["wasted"],
                    s["completed"],
                    s["ttft_s"]["mean"],
                    s["tbt_s"]["mean"] * 1e3,
                ]
            )
    labels = [f"{p}P{d}D x{sp:g}" for p, d, sp in setups]
    plots.bars(
        os.path.join(out, "sim_table4.png"),
        labels,
        {m: [res["runs"][f"{m}@{lab}"]["rejected"] for lab in labels] for m in modes},
        "rejected requests",
        "Table 4 (sim): rejections by admission policy",
        fmt="{:.0f}",
    )
    res["table"] = _table(
        [
            "cluster, replay",
            "admission",
            "rejected",
            "at admission",
            "at conductor",
            "after prefill",
            "wasted prefill GPU s",
            "completed",
            "avg TTFT s",
            "avg TBT ms",
        ],
        rows,
    )
    return res


def fig23(
    trace,
    out: str,
    speeds=(2.0, 4.0, 6.0),
    prefills=(2, 4, 6, 8, 10, 12, 13, 14, 15),
    ttft_max: float = 10.0,
    tbt_max: float = 0.1,
) -> dict:
    res: dict = {
        "setup": f"16 nodes, early admission, thresholds TTFT {ttft_max:g}s "
        f"TBT {tbt_max * 1e3:g}ms",
        "runs": {},
    }
    rows, labels = [], [f"{p}P{16 - p}D" for p in prefills]
    for speed in speeds:
        for p, label in zip(prefills, labels, strict=True):
            sim, s = _run(trace, prefill=p, decode=16 - p, speed=speed)
            e = effective(sim.requests, ttft_max, tbt_max)
            s["effective_capacity_fig23"] = e
            res["runs"][f"{label} x{speed:g}"] = s
            rows.append(
                [
                    f"x{speed:g}",
                    label,
                    e,
                    s["ttft_s"]["mean"],
                    s["tbt_s"]["mean"] * 1e3,
                    s["tbt_s"]["p99"] * 1e3,
                    s["rejected"],
                ]
            )
        sim, s = _run(trace, prefill=8, decode=8, speed=speed, pd_controller=True)
        e = effective(sim.requests, ttft_max, tbt_max)
        s["effective_capacity_fig23"] = e
        s["switches"] = sim.resizer.switches
        res["runs"][f"controller x{speed:g}"] = s
        rows.append(
            [
                f"x{speed:g}",
                f"8P8D + P/D controller -> {len(sim.prefills)}P{len(sim.decodes)}D",
                e,
                s["ttft_s"]["mean"],
                s["tbt_s"]["mean"] * 1e3,
                s["tbt_s"]["p99"] * 1e3,
                s["rejected"],
            ]
        )
    plot_fig23(res, labels, speeds, out)
    res["table"] = _table(
        [
            "replay",
            "P/D",
            "effective capacity",
            "avg TTFT s",
            "avg TBT ms",
            "p99 TBT ms",
            "rejected",
        ],
        rows,
    )
    return res


def plot_fig23(res: dict, labels: list[str], speeds, out: str) -> None:
    mid = speeds[len(speeds) // 2]
    eff = {
        f"effective capacity, replay x{sp:g}": [
            res["runs"][f"{lab} x{sp:g}"]["effective_capacity_fig23"] for lab in labels
        ]
        for sp in speeds
    }
    plots.xticks_lines(
        os.path.join(out, "sim_fig23.png"),
        labels,
        eff,
        "share of requests within SLOs",
        "Fig. 23 (sim): P/D ratio on 16 nodes, conversation trace",
        secondary={
            f"avg TTFT (s), x{mid:g}": [
                res["runs"][f"{lab} x{mid:g}"]["ttft_s"]["mean"] for lab in labels
            ],
            f"avg TBT (s), x{mid:g}": [
                res["runs"][f"{lab} x{mid:g}"]["tbt_s"]["mean"] for lab in labels
            ],
        },
        ylabel2="seconds (log)",
        log2=True,
    )


def cpp(
    trace, out: str, groups=(1, 2, 4), prefill: int = 8, decode: int = 8, speed: float = 1.0
) -> dict:
    from perigee.sim.pipeline_gang import TTFT_THRESHOLD_S, ttft_buckets

    res: dict = {
        "setup": f"{prefill}P{decode}D, replay x{speed:g}, early admission, "
        f"groups of X prefill nodes (chunked pipeline parallelism), "
        f"TTFT threshold {TTFT_THRESHOLD_S:g}s",
        "runs": {},
    }
    reqs = {}
    for x in groups:
        sim, s = _run(trace, prefill=prefill, decode=decode, speed=speed, cpp_group=x)
        s["pipelined"] = sum(1 for r in sim.requests if r.rid in sim.pipelined)
        res["runs"][str(x)] = s
        reqs[x] = sim.requests
    res["buckets"] = ttft_buckets(reqs)
    rows = []
    for b in res["buckets"]:
        label = f"{b['min_tokens'] // 1024}k-" + (
            f"{b['max_tokens'] // 1024}k" if b["max_tokens"] else ""
        )
        for x in groups:
            k = str(x)
            rows.append(
                [
                    label,
                    b["requests"],
                    x,
                    b["ttft_s"][k],
                    b["ttft_p90_s"][k],
                    b["ttft_s"][k] / b["ttft_s"]["1"],
                    b["within_ttft"][k],
                ]
            )
    res["table"] = _table(
        [
            "prompt tokens",
            "requests",
            "X",
            "avg TTFT s",
            "p90 TTFT s",
            "vs X=1",
            f"within {TTFT_THRESHOLD_S:g}s",
        ],
        rows,
    )
    labels = [r[0] for r in rows[:: len(groups)]]
    plots.bars(
        os.path.join(out, "sim_cpp.png"),
        labels,
        {f"X = {x}": [b["ttft_s"][str(x)] for b in res["buckets"]] for x in groups},
        "average TTFT (s)",
        f"CPP (sim): TTFT by prompt length, {prefill}P{decode}D x{speed:g}, conversation trace",
    )
    return res


EXPERIMENTS = {
    "fig5": fig5,
    "fig16": fig16,
    "fig17": fig17,
    "table4": table4,
    "fig23": fig23,
    "cpp": cpp,
    "multiturn": repro_multiturn.multiturn,
    "scale": scale.scale,
}


# Where the figures go without --out: a scratch folder (.perigee/ is git-ignored), so a
# run never overwrites the tracked docs/figures/ that BENCHMARKS.md shows.
SCRATCH = ".perigee/sim-repro"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee sim repro",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("name", choices=[*EXPERIMENTS, "all"])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None)
    p.add_argument(
        "--out",
        default=SCRATCH,
        help="folder for sim_NAME.json and .png (default: %(default)s, untracked; the "
        "recorded figures in BENCHMARKS.md: --out docs/figures)",
    )
    p.add_argument("--json", default=None, help="also write the (last) experiment's JSON here")
    a, rest = p.parse_known_args(argv)
    extra: dict = {}
    if a.name == "scale":
        extra = scale.main_args(["--help"] if "--help-scale" in rest else rest)
        extra["source"] = (a.trace, a.limit)  # each run in a fresh process
    elif rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    os.makedirs(a.out, exist_ok=True)
    trace = load_trace(a.trace, a.limit)
    # "all" is the paper's figures; scale is a benchmark of the simulator itself
    names = [n for n in EXPERIMENTS if n != "scale"] if a.name == "all" else [a.name]
    print(f"perigee sim repro: writing to {os.path.abspath(a.out)}/", flush=True)
    for name in names:
        t0 = time.perf_counter()
        res = EXPERIMENTS[name](trace, a.out, **(extra if name == "scale" else {}))
        res["wall_s"] = time.perf_counter() - t0
        for path in filter(None, (os.path.join(a.out, f"sim_{name}.json"), a.json)):
            with open(path, "w") as f:
                json.dump(res, f, indent=1)
        print(f"## {name} ({res['wall_s']:.0f} s)\n\n{res['table']}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
