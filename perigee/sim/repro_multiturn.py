"""``perigee sim repro multiturn``: the simulator with and without decode write-back
(:mod:`perigee.sim.writeback`) on a trace, its retention at smaller stores, and a plot.
Apart from writeback so that the simulator, which imports writeback, is not imported
back by it."""

from collections.abc import Sequence

from perigee.sim.writeback import MIN_SHARED, _infer, coverage, writeback_hits
from perigee.trace import TRACE_BLOCK, TraceRequest


def multiturn(
    trace: Sequence[TraceRequest],
    out: str,
    speeds=(1.0, 2.0),
    capacities=(1_000_000, 300_000),
) -> dict:
    """Cache hit rate and TTFT with and without decode write-back, 8P+8D, early
    admission, replay at each of ``speeds``; over every request and over the next
    turns the rule finds (those whose predecessor's answer fills a block). Retention:
    the same at x1 with smaller stores (``capacities``, tokens per node), and how many
    next turns still found their whole previous answer cached."""
    import os

    from perigee.sim import plots
    from perigee.sim.metrics import summarize
    from perigee.sim.simulator import SimConfig, Simulator

    answers, nxt = _infer(trace, TRACE_BLOCK, MIN_SHARED)
    turns = {nxt[i] for i in answers}
    res: dict = {
        "setup": "8P8D, early admission, global placement, 3M tokens per node; next turns: "
        f"requests the rule pairs with a predecessor whose answer fills a block "
        f"({len(turns)} of {len(trace)})",
        "coverage": coverage(trace).as_dict(),
        "runs": {},
    }
    rows = []
    setups = [(speed, 3_000_000) for speed in speeds] + [(1.0, cap) for cap in capacities]
    for speed, cap in setups:
        for wb in (False, True):
            cfg = SimConfig(speed=speed, decode_writeback=wb, cache_tokens_per_node=cap)
            sim = Simulator(trace, cfg).run()
            s = summarize(sim)
            nt = [r for r in sim.requests if r.index in turns and r.state == "DONE"]
            ttft = sorted(r.ttft_s for r in nt)
            s["next_turns"] = {
                "requests": len(nt),
                "cache_hit_rate": sum(r.cached_tokens for r in nt)
                / max(1, sum(r.num_tokens for r in nt)),
                "ttft_p50_s": ttft[len(ttft) // 2] if ttft else 0.0,
                "ttft_p90_s": ttft[int(len(ttft) * 0.9)] if ttft else 0.0,
                # next turns that found every block of their predecessor's prompt + answer
                "whole_answer_cached": sum(
                    1
                    for i, a in answers.items()
                    if sim.requests[nxt[i]].cached_tokens
                    >= (len(sim.requests[i].hashes) + len(a)) * TRACE_BLOCK
                ),
            }
            if sim.writeback is not None:
                s["writeback"] = {
                    **sim.writeback.stats,
                    "hits_by_tier": writeback_hits(sim.cluster),
                }
            key = f"x{speed:g}-{'writeback' if wb else 'none'}"
            if cap != 3_000_000:
                key += f"-{cap // 1000}k"
            res["runs"][key] = s
            rows.append(
                [
                    f"x{speed:g}",
                    f"{cap / 1e6:g}M",
                    "on" if wb else "off",
                    s["cache_hit_rate"],
                    s["next_turns"]["cache_hit_rate"],
                    s["ttft_s"]["mean"],
                    s["ttft_s"]["p90"],
                    s["next_turns"]["ttft_p50_s"],
                    s["next_turns"]["ttft_p90_s"],
                    s["next_turns"]["whole_answer_cached"],
                    s["rejected"],
                ]
            )
    header = [
        "replay",
        "store/node",
        "write-back",
        "hit rate",
        "hit rate (next turns)",
        "TTFT mean s",
        "TTFT p90 s",
        "next turns TTFT p50 s",
        "next turns TTFT p90 s",
        f"whole answer cached (of {len(answers)})",
        "rejected",
    ]
    res["table"] = _table(header, rows)
    _plot(res, speeds, os.path.join(out, "sim_multiturn.png"), plots)
    return res


def _table(header: list[str], rows: list[list]) -> str:
    def cell(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def _plot(res: dict, speeds, path: str, plots) -> None:
    plt = plots._plt()
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"x{s:g}" for s in speeds]
    width = 0.2
    for k, (metric, title) in enumerate(
        (("hit", "cache hit rate"), ("ttft", "next turns' TTFT (s)"))
    ):
        a = ax[k]
        for m, wb in enumerate(("none", "writeback")):
            runs = [res["runs"][f"{lab}-{wb}"] for lab in labels]
            if metric == "hit":
                vals = [
                    [r["cache_hit_rate"] for r in runs],
                    [r["next_turns"]["cache_hit_rate"] for r in runs],
                ]
                names = ("all", "next turns")
            else:
                vals = [
                    [r["next_turns"]["ttft_p50_s"] for r in runs],
                    [r["next_turns"]["ttft_p90_s"] for r in runs],
                ]
                names = ("p50", "p90")
            for v, (series, name) in enumerate(zip(vals, names, strict=True)):
                xs = [i + (2 * m + v - 1.5) * width for i in range(len(labels))]
                a.bar(
                    xs, series, width, label=f"{name}, write-back {'on' if wb != 'none' else 'off'}"
                )
        a.set_xticks(range(len(labels)), [f"replay {lab}" for lab in labels])
        a.set_title(title)
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.suptitle("Decode write-back (sim): 8P8D, early admission")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
