"""The paper's §7.1 metrics over a finished simulation.

- TTFT: arrival -> first token at the client: computed by the prefill instance and
  streamed while the KV moves to decode (baseline admission: once decode took the
  request), plus ``first_token_hop_s``.
- TBT: per request, the mean of the longest 10% of its token gaps.
- Effective request capacity: the share of *all* requests that completed with TTFT and
  TBT under their thresholds (a rejected request is not effective).
- Prefill GPU time: cost-model compute seconds of the prefill stage (wasted: spent on
  requests rejected afterwards).
- Cache hit rate: cached prompt tokens / prompt tokens, over completed requests (what
  ``perigee replay`` reports from the live stack as the cached-token ratio).
"""

import math

from perigee.bench.stats import percentile

TBT_THRESHOLDS_S = (0.1, 0.2, 0.3)  # paper §7.1


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": sum(values) / len(values) if values else math.nan,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
    }


def effective(reqs, ttft_max: float, tbt_max: float) -> float:
    """Effective request capacity: share of ``reqs`` done within both thresholds."""
    if not reqs:
        return 0.0
    good = sum(1 for r in reqs if r.state == "DONE" and r.ttft_s <= ttft_max and r.tbt_s <= tbt_max)
    return good / len(reqs)


def summarize(sim) -> dict:
    cfg, reqs = sim.cfg, sim.requests
    done = [r for r in reqs if r.state == "DONE"]
    rejected = [r for r in reqs if r.state == "REJECTED"]
    placed = [r for r in reqs if r.prefill_instance]
    prompt = sum(r.num_tokens for r in done)
    placed_prompt = sum(r.num_tokens for r in placed)
    by_stage: dict[str, int] = {"admission": 0, "conductor": 0, "decode": 0}
    for r in rejected:
        by_stage[r.reject_stage] = by_stage.get(r.reject_stage, 0) + 1
    gpu = sum(r.compute_s for r in placed if r.prefill_end >= 0)
    wasted = sum(r.compute_s for r in rejected if r.prefill_end >= 0)
    tbts = [r.tbt_s for r in done if r.tbt_s >= 0]
    end = max((r.finished for r in done), default=0.0)
    links = sim.cluster.nodes.values()
    out = {
        "requests": len(reqs),
        "completed": len(done),
        "rejected": len(rejected),
        "rejected_by": by_stage,
        "unfinished": len(reqs) - len(done) - len(rejected),
        "cache_hit_rate": sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
        "cache_hit_rate_placed": (
            sum(r.cached_tokens for r in placed) / placed_prompt if placed_prompt else 0.0
        ),
        "pulled_token_rate": (
            sum(r.pulled_tokens for r in placed) / placed_prompt if placed_prompt else 0.0
        ),
        "ttft_s": _stats([r.ttft_s for r in done]),
        "tbt_s": _stats(tbts),
        "effective_capacity": {
            f"ttft<={cfg.ttft_slo_s:g}s,tbt<={t:g}s": effective(reqs, cfg.ttft_slo_s, t)
            for t in sorted({*TBT_THRESHOLDS_S, cfg.tbt_slo_s})
        },
        "prefill_gpu_s": {
            "total": gpu,
            "mean_per_request": gpu / len(placed) if placed else 0.0,
            "wasted": wasted,
        },
        "transfer_gb": sum(n.link.bytes_moved for n in links) / 1e9,
        "decode_tokens": sum(d.tokens for d in sim.decodes.values()) + len(done),
        "sim_time_s": end,
        "events": sim.loop.events_run,
        "wall_s": sim.wall_s,
        "placement_stats": dict(getattr(sim.placement, "stats", {})),
        "balancing_threshold_final": sim.placement.threshold()
        if hasattr(sim.placement, "threshold")
        else cfg.balancing_threshold,
        "pools_final": {"prefill": len(sim.prefills), "decode": len(sim.decodes)},
        "pd_switches": [list(x) for x in sim.resizer.switches] if sim.resizer else [],
        "config": {
            "prefill": cfg.prefill,
            "decode": cfg.decode,
            "policy": cfg.policy,
            "admission": cfg.admission,
            "cache_tokens_per_node": cfg.cache_tokens_per_node,
            "block_size": cfg.block_size,
            "speed": cfg.speed,
            "ttft_slo_s": cfg.ttft_slo_s,
            "tbt_slo_s": cfg.tbt_slo_s,
            "max_batch": cfg.max_batch,
            "speedup": cfg.cost.speedup,
            "pd_controller": cfg.pd_controller,
            "adaptive_threshold": cfg.adaptive_threshold,
        },
    }
    return out


def format_summary(s: dict) -> str:
    t, b = s["ttft_s"], s["tbt_s"]
    eff = ", ".join(f"{k}: {v:.1%}" for k, v in s["effective_capacity"].items())
    return "\n".join(
        [
            f"requests {s['requests']}  completed {s['completed']}  rejected {s['rejected']} "
            f"{s['rejected_by']}  sim {s['sim_time_s']:.0f}s  wall {s['wall_s']:.1f}s",
            f"TTFT mean {t['mean']:.3f}s p50 {t['p50']:.3f}s p99 {t['p99']:.3f}s   "
            f"TBT mean {b['mean'] * 1e3:.1f}ms p99 {b['p99'] * 1e3:.1f}ms",
            f"cache hit rate {s['cache_hit_rate']:.3f} (pulled {s['pulled_token_rate']:.3f})  "
            f"prefill GPU {s['prefill_gpu_s']['mean_per_request']:.3f}s/req "
            f"(wasted {s['prefill_gpu_s']['wasted']:.0f}s)",
            f"effective request capacity: {eff}",
        ]
    )
