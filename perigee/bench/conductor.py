"""``perigee bench conductor``: how long one placement decision takes at scale.

Builds the conductor's real :class:`PrefixIndex` with ``--blocks`` distinct blocks
(chains of ``--chain`` blocks, each chain held by 1-3 of the ``--instances`` prefill
nodes, fed as KV event batches exactly as the stores publish them) and a
:class:`PlacementPolicy` (strategy ``global``) with fresh load reports from every
prefill and decode instance. Each measured decision is what the conductor service does
per request: one placement round (services.conductor.placement_round: the shadow
view's down stores, its match over the index, the policy's choice, the task fields)
for a 16k-token prompt whose prefix is shared with a random chain. Load reports (and
the stores' announces) arrive every 100 placements (0.1 s of simulated time at 1,000
placements/s); a placed request is released at once. ``--idle``: every instance reports
nothing queued and nothing running, so all tie (the walk through ties of issue 27).
``--cpp-group X``: chunked pipeline parallelism's groups of X prefill instances compete
(with ``--cpp-min-tokens`` at most the prompt's 16k tokens, every request evaluates
them). ``--overloaded``: every decode instance runs a full batch of 8 with a backlog of
96 to 400 waiting, so none meets the TBT SLO (the requests are rejected, the TBT check
on, after the same search). ``--fitted``: every instance reports a fitted model of its
own (coefficients spread by up to 20%).
"""

import argparse
import json
import random
import time

from bus_schemas.kv_events import BlockStored, EventBatch
from bus_schemas.load import CostFit, DecodeLoad, PrefillLoad
from perigee.bench.stats import percentile
from services.common.clock import ManualClock
from services.common.cost_model import CostModel
from services.conductor import placement_round
from services.conductor.placement_policy import PlacementPolicy, PlacementRequest
from services.conductor.prefix_index import PrefixIndex
from services.conductor.shadow import ShadowView
from services.policy.chunk_timing import DEFAULT_MIN_TOKENS, CppConfig

BLOCK = 512


def build_index(instances: int, blocks: int, chain: int, rng: random.Random) -> PrefixIndex:
    index = PrefixIndex()
    per_node: dict[int, list[int]] = {i: [] for i in range(instances)}
    for c in range(blocks // chain):
        hashes = range(c * chain, (c + 1) * chain)
        for node in rng.sample(range(instances), min(instances, 1 + c % 3)):
            per_node[node].extend(hashes)
    for node, hashes in per_node.items():
        for seq, start in enumerate(range(0, len(hashes), 10_000), 1):
            index.apply(
                EventBatch(
                    node=f"p{node:02d}",
                    epoch=1,
                    seq=seq,
                    ts=0.0,
                    events=[BlockStored(block_hashes=hashes[start : start + 10_000])],
                )
            )
    return index


def report(
    policy: PlacementPolicy,
    instances: int,
    decodes: int,
    rng: random.Random,
    now: float,
    idle: bool = False,
    overloaded: bool = False,
    fitted: bool = False,
) -> None:
    for i in range(instances):
        q = 0.0 if idle else rng.random() * 5
        policy.observe_prefill(
            PrefillLoad(
                instance=f"prefill-{i}",
                node=f"p{i:02d}",
                queue_len=int(q),
                queued_tokens=int(q * 8000),
                queued_work_s=q,
                ts=now,
                fit=_fit(i) if fitted else None,
            )
        )
    for i in range(decodes):
        b = 0 if idle else rng.randrange(1, 64)
        waiting, cap = 0, 128
        if overloaded:
            b, waiting, cap = 8, rng.randrange(96, 400), 8
        policy.observe_decode(
            DecodeLoad(
                instance=f"decode-{i}",
                node=f"d{i:02d}",
                batch_size=b,
                waiting=waiting,
                max_batch=cap,
                kv_tokens=(b + waiting) * 12_000,
                step_time_s=0.02,
                ts=now,
                fit=_fit(i) if fitted else None,
            )
        )


def _fit(i: int) -> CostFit:
    """Instance ``i``'s own fitted model: the reported forms, coefficients spread by up
    to 20% (deterministic in ``i``)."""
    s = 1.0 + (i * 7919 % 101) / 500
    return CostFit(prefill=[0.01 * s, 5e-5 * s, 2e-9 * s], decode=[0.02 * s, 1e-4 * s, 1e-8 * s])


def run(
    instances: int = 64,
    decodes: int = 16,
    blocks: int = 1_000_000,
    chain: int = 32,
    placements: int = 20_000,
    warmup: int = 1_000,
    seed: int = 0,
    scan: bool = False,
    idle: bool = False,
    cpp_group: int = 1,
    cpp_min_tokens: int = DEFAULT_MIN_TOKENS,
    overloaded: bool = False,
    fitted: bool = False,
) -> dict:
    rng = random.Random(seed)
    index = build_index(instances, blocks, chain, rng)
    clock = ManualClock(0.0)
    cpp = CppConfig(group_size=cpp_group, min_tokens=cpp_min_tokens)
    policy = PlacementPolicy(clock, CostModel(), strategy="global", cpp=cpp)
    policy.pruned = not scan  # --scan: every live instance evaluated (the reference)
    shadow = ShadowView(None, None, clock)  # type: ignore[arg-type]  # no bus: fed here
    shadow.index = index
    nodes = index.nodes()

    def announce() -> None:
        for node in nodes:
            shadow.stores.seen(node)

    loads = dict(idle=idle, overloaded=overloaded, fitted=fitted)
    report(policy, instances, decodes, rng, clock.now(), **loads)
    announce()
    chains = blocks // chain
    fresh = blocks + 1
    lat: list[float] = []
    placed = 0
    for k in range(warmup + placements):
        c = rng.randrange(chains)
        shared = rng.randrange(chain + 1)
        hashes = list(range(c * chain, c * chain + shared)) + list(
            range(fresh, fresh + chain - shared)
        )
        fresh += chain - shared
        req = PlacementRequest(f"r{k}", chain * BLOCK, tuple(hashes), BLOCK)
        t0 = time.perf_counter_ns()
        d = placement_round.place(policy, req, shadow.match, down=shadow.down())
        dt = time.perf_counter_ns() - t0
        if k >= warmup:
            lat.append(dt / 1e3)
        placed += k >= warmup and isinstance(d, placement_round.Placed)
        policy.release(req.request_id)
        clock.advance(0.001)
        if k % 100 == 99:
            report(policy, instances, decodes, rng, clock.now(), **loads)
            announce()
    return {
        "placement_us": {
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "mean": sum(lat) / len(lat),
        },
        "instances": instances,
        "decode_instances": decodes,
        "indexed_blocks": index.num_blocks(),
        "placements": placements,
        "placed": placed,
        "search": "scan" if scan else "pruned",
        "idle": idle,
        "cpp_group": cpp_group,
        "cpp_min_tokens": cpp_min_tokens,
        "overloaded": overloaded,
        "fitted": fitted,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee bench conductor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--instances", type=int, default=64, help="prefill instances (one per node)")
    p.add_argument("--decodes", type=int, default=16, help="decode instances")
    p.add_argument("--blocks", type=int, default=1_000_000, help="distinct indexed blocks")
    p.add_argument("--chain", type=int, default=32, help="blocks per prompt (512 tokens each)")
    p.add_argument("--placements", type=int, default=20_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scan", action="store_true", help="evaluate every instance (the search's reference)"
    )
    p.add_argument(
        "--idle", action="store_true", help="every instance idle: all tie for every request"
    )
    p.add_argument("--cpp-group", type=int, default=1, help="CPP group size (1: none)")
    p.add_argument(
        "--cpp-min-tokens",
        type=int,
        default=DEFAULT_MIN_TOKENS,
        help="computed tokens from which a request is offered a group",
    )
    p.add_argument("--overloaded", action="store_true", help="no decode instance meets the TBT SLO")
    p.add_argument(
        "--fitted", action="store_true", help="every instance reports a fitted model of its own"
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    s = run(
        a.instances,
        a.decodes,
        a.blocks,
        a.chain,
        a.placements,
        seed=a.seed,
        scan=a.scan,
        idle=a.idle,
        cpp_group=a.cpp_group,
        cpp_min_tokens=a.cpp_min_tokens,
        overloaded=a.overloaded,
        fitted=a.fitted,
    )
    u = s["placement_us"]
    print(
        f"placement ({s['search']}{', idle' if s['idle'] else ''}"
        f"{', cpp ' + str(a.cpp_group) if a.cpp_group > 1 else ''}"
        f"{', overloaded' if a.overloaded else ''}{', fitted' if a.fitted else ''}) over {s['instances']} prefill + {s['decode_instances']} "
        f"decode instances, {s['indexed_blocks']:,} indexed blocks: p50 {u['p50']:.0f} us  p90 {u['p90']:.0f} us  p99 {u['p99']:.0f} us  "
        f"(mean {u['mean']:.0f} us, {s['placements']} placements)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0
