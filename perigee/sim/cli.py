"""``perigee sim``: replay a Mooncake trace through the live policy objects on a
simulated clock (LLaMA3-70B on 8xA800 by the paper's cost model, 512-token blocks).

    perigee sim --trace data/conversation_trace.jsonl --policy global --admission early \\
        --prefill 8 --decode 8 --json out.json --png out.png
    perigee sim repro {fig5,fig16,fig17,table4,fig23,all}   # the paper's figures
"""

import argparse
import json
import sys

from perigee.trace import DEFAULT_TRACE, TRACE_BLOCK, load_trace
from services.common import admission_mode, defaults
from services.conductor.placement_policy import DEFAULT_BALANCING_THRESHOLD, STRATEGIES


def admission_modes() -> list[str]:
    """The live services' modes (services.common.admission_mode), by the same names."""
    return admission_mode.names()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="perigee sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (jsonl)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--png", default=None, help="plot TTFT/TBT and load over time here")
    p.add_argument("--policy", choices=STRATEGIES, default="global", help="placement strategy")
    p.add_argument(
        "--admission",
        choices=admission_modes(),
        default=str(admission_mode.DEFAULT),
        help="admission mode, as the live services' --admission-mode",
    )
    p.add_argument("--prefill", type=int, default=8, help="prefill nodes")
    p.add_argument("--decode", type=int, default=8, help="decode nodes")
    p.add_argument(
        "--cache-tokens-per-node",
        type=int,
        default=3_000_000,
        help="store capacity per node in tokens (paper: 1 TB DRAM ~ 3M tokens)",
    )
    p.add_argument(
        "--decode-cache-tokens",
        type=int,
        default=None,
        help="store capacity of decode nodes (default: as prefill; 0: none)",
    )
    p.add_argument("--speed", type=float, default=1.0, help="replay speed (timestamps / X)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument(
        "--copies",
        type=int,
        default=1,
        help="the trace this many times over, each copy's hash ids offset (shares "
        "nothing with the others), merged by arrival time: a k-fold load",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=TRACE_BLOCK,
        help="tokens per block; a trace hash id is one block (lengths scaled)",
    )
    p.add_argument("--ttft-slo", type=float, default=defaults.TTFT_SLO_S)
    p.add_argument("--tbt-slo", type=float, default=defaults.TBT_SLO_S)
    p.add_argument("--max-batch", type=int, default=128, help="decode running batch limit")
    p.add_argument("--chunk-tokens", type=int, default=0, help="prefill chunk (0: whole)")
    p.add_argument(
        "--cpp-group",
        type=int,
        default=1,
        help="chunked pipeline parallelism: prefill nodes per group (1: off)",
    )
    p.add_argument(
        "--cpp-chunk-tokens",
        type=int,
        default=None,
        help="the pipeline's prefill_chunk (default: services.policy.chunk_timing's)",
    )
    p.add_argument("--balancing-threshold", type=float, default=DEFAULT_BALANCING_THRESHOLD)
    p.add_argument(
        "--adaptive-threshold",
        action="store_true",
        help="tune the balancing threshold online (conductor's AdaptiveThreshold)",
    )
    p.add_argument(
        "--predict-decode-time",
        type=float,
        default=None,
        help="predict admission: the uniform decode time t_d, s",
    )
    p.add_argument("--cost-model", default=None, help="fitted cost model JSON (perigee profile)")
    p.add_argument("--output-tokens", type=int, default=None, help="force every output length")
    p.add_argument("--speedup", type=float, default=1.0, help="cost-model speedup ('inf': none)")
    p.add_argument(
        "--pd-controller",
        action="store_true",
        help="resize the pools with the conductor's P/D ratio controller",
    )
    p.add_argument(
        "--report-interval",
        type=float,
        default=0.0,
        help="seconds between each instance's load reports, as the live workers "
        "(--report-interval); 0: the policies see exact snapshots",
    )
    p.add_argument(
        "--decode-writeback",
        action="store_true",
        help="decode writes each answer's blocks back to its store and the prefill node's, "
        "answers inferred from the trace (perigee.sim.writeback)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "repro":
        from perigee.sim import repro

        return repro.main(argv[1:])
    a = build_parser().parse_args(argv)
    from perigee.sim.gc_policy import no_collection_at_exit
    from perigee.sim.metrics import format_summary, summarize
    from perigee.sim.simulator import SimConfig, Simulator
    from services.common.cost_fit import load_cost_model

    trace = load_trace(a.trace, a.limit)
    if not trace:
        print(f"no requests in {a.trace}", file=sys.stderr)
        return 2
    if a.copies < 1:
        print(f"--copies must be at least 1, not {a.copies}", file=sys.stderr)
        return 2
    if a.copies > 1:
        from perigee.sim.scale import replicate

        trace = replicate(trace, a.copies)
    cfg = SimConfig(
        prefill=a.prefill,
        decode=a.decode,
        policy=a.policy,
        admission=a.admission,
        cache_tokens_per_node=a.cache_tokens_per_node,
        decode_cache_tokens=a.decode_cache_tokens,
        block_size=a.block_size,
        speed=a.speed,
        ttft_slo_s=a.ttft_slo,
        tbt_slo_s=a.tbt_slo,
        max_batch=a.max_batch,
        chunk_tokens=a.chunk_tokens,
        cpp_group=a.cpp_group,
        **({"cpp_chunk_tokens": a.cpp_chunk_tokens} if a.cpp_chunk_tokens else {}),
        balancing_threshold=a.balancing_threshold,
        output_tokens=a.output_tokens,
        seed=a.seed,
        cost=load_cost_model(a.cost_model, a.speedup),
        pd_controller=a.pd_controller,
        adaptive_threshold=a.adaptive_threshold,
        report_interval_s=a.report_interval,
        decode_writeback=a.decode_writeback,
        # stale reports: the conductor's grace bridges dispatches the reports cannot show yet
        placement_kw={"report_grace_s": defaults.REPORT_GRACE_S} if a.report_interval > 0 else {},
        admission_kw=(
            {"decode_time_s": a.predict_decode_time}
            if a.admission == "predict" and a.predict_decode_time
            else {}
        ),
    )
    sim = Simulator(trace, cfg, progress=not a.no_progress).run()
    no_collection_at_exit()
    s = summarize(sim)
    if a.cpp_group > 1:
        from perigee.sim.pipeline_gang import ttft_buckets

        s["buckets"] = ttft_buckets({a.cpp_group: sim.requests})
        s["pipelined"] = len(sim.pipelined)
    if sim.writeback is not None:
        from perigee.sim.writeback import coverage, writeback_hits

        s["writeback"] = {
            **sim.writeback.stats,
            "hits_by_tier": writeback_hits(sim.cluster),
            "coverage": coverage(trace).as_dict(),
        }
    print(format_summary(s))
    if s.get("writeback"):
        print(f"decode write-back: {s['writeback']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2)
    if a.png:
        from perigee.sim.plots import run_figure

        run_figure(sim, a.png)
        print(f"wrote {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
