"""``perigee bench calibration``: how well an instance's online fit predicts its own
prefill times (issue target: median absolute error <= 20 % on mixed-length prompts).

One in-process engine per kind (``--engine mock|vllm|both``; vLLM on ``--model-dir``,
dummy weights unless the directory has some). The worker's path, minus the bus:
the calibration warm-up (services.worker.warmup) from the paper's analytic prior,
then ``--requests`` prompts of mixed lengths (log-uniform in [32, ``--max-len``], a
third reusing a block-aligned prefix of an earlier prompt), one at a time. Before
each prompt the online fit predicts its compute time; after it the measured time
goes to the fit (services.common.calibrator.Calibrator, as in the prefill worker).

Beside the online fit, in the same run: the analytic prior (what the conductor used
before) and the fit frozen after the warm-up (what an offline profile gives).
Reported per engine: median and p90 of |predicted / measured - 1| for each.
"""

import argparse
import asyncio
import json
import math
import random
import sys
import time
from pathlib import Path

from bus_schemas.requests import SamplingParams
from bus_schemas.roles import Role
from services.common import defaults
from services.common.calibration import OnlineFit
from services.common.calibrator import Calibrator
from services.common.cost_model import CostModel
from services.common.hashing import num_blocks
from services.common.kv_layout import KVLayout
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec
from services.engine import PrefillJob, SlotKV, make_engine
from services.worker.warmup import FIRST_TOKEN_ID, max_prompt, warm_prefill


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def prompt_set(
    rng: random.Random, count: int, max_len: int, block: int
) -> list[tuple[int, int, int]]:
    """(n, p, k): prompt length, reused prefix, index of the earlier prompt it extends
    (-1: none)."""
    out: list[tuple[int, int, int]] = []
    for i in range(count):
        n = int(math.exp(rng.uniform(math.log(32), math.log(max_len))))
        if i >= 3 and rng.random() < 1 / 3:
            k = rng.randrange(i)
            base = out[k][0]
            p = rng.randrange(1, max(2, base // block + 1)) * block
            if p < base:
                out.append((max(n, p + 16), p, k))
                continue
        out.append((n, 0, -1))
    return out


async def run_engine(kind: str, args: argparse.Namespace) -> dict:
    spec = ModelSpec.from_dir(args.model_dir)
    layout = KVLayout(spec, args.block_size)
    prior = CostModel()  # the paper's LLaMA3-70B on 8xA800: the services' default
    vllm = None
    if kind == "vllm":
        from services.engine.vllm.options import VllmOptions

        vllm = VllmOptions(
            model_dir=str(args.model_dir or DEFAULT_MODEL_DIR), load_format=args.load_format
        )
    engine = make_engine(
        kind,
        spec,
        CostModel(speedup=args.mock_speedup),
        role=Role.PREFILL,
        layout=layout,
        vllm=vllm,
    )
    t0 = time.perf_counter()
    await engine.start()
    started = time.perf_counter() - t0
    calib = Calibrator(OnlineFit(prior))
    errs: dict[str, list[float]] = {"online": [], "warmup_only": [], "prior": []}
    rows = []
    try:
        t0 = time.perf_counter()
        await warm_prefill(engine, layout, calib, args.warmup)
        warm_s = time.perf_counter() - t0
        frozen = calib.model()
        rng = random.Random(args.seed)
        cap = min(args.max_len, max_prompt(engine))
        kept: list[tuple[list[int], list[memoryview]]] = []
        span = spec.vocab_size - FIRST_TOKEN_ID
        for i, (n, p, k) in enumerate(prompt_set(rng, args.requests, cap, layout.block_size)):
            n = min(n, cap)
            if k >= 0:
                base_ids, base_slots = kept[k]
                ids = base_ids[:p] + [FIRST_TOKEN_ID + rng.randrange(span) for _ in range(n - p)]
                slots = base_slots[: p // layout.block_size]
            else:
                ids = [FIRST_TOKEN_ID + rng.randrange(span) for _ in range(n)]
                slots = []
            slots = slots + [
                memoryview(bytearray(layout.block_bytes))
                for _ in range(num_blocks(n, layout.block_size) - len(slots))
            ]
            kept.append((ids, slots))
            preds = {
                "online": calib.model().prefill_time(n, p),
                "warmup_only": frozen.prefill_time(n, p),
                "prior": prior.prefill_time(n, p),
            }
            job = PrefillJob(
                f"bench-{i}", ids, p, SamplingParams(max_tokens=1), SlotKV(layout, slots, n)
            )
            t = time.perf_counter()
            await engine.prefill(job)
            measured = time.perf_counter() - t
            calib.prefill(n, p, measured, preds["online"])
            for name, pred in preds.items():
                errs[name].append(abs(pred / measured - 1))
            rows.append({"n": n, "p": p, "measured_s": measured, "predicted_s": preds["online"]})
    finally:
        await engine.stop()
    out = {
        "engine": kind,
        "requests": len(rows),
        "warmup_prefills": calib.fit.prefill_samples - len(rows),
        "engine_start_s": round(started, 2),
        "warmup_s": round(warm_s, 2),
        "prefill_coef": list(calib.fit.prefill_coef()),
        "samples": rows,
    }
    for name, e in errs.items():
        out[f"{name}_median_abs_err"] = _quantile(e, 0.5)
        out[f"{name}_p90_abs_err"] = _quantile(e, 0.9)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="perigee bench calibration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=("mock", "vllm", "both"), default="both")
    p.add_argument("--requests", type=int, default=40, help="prompts measured after warm-up")
    p.add_argument("--warmup", type=int, default=6, help="warm-up prefills (as a worker)")
    p.add_argument("--max-len", type=int, default=3072, help="longest prompt, tokens")
    p.add_argument("--model-dir", default=None, help="model directory (default: tiny-llama)")
    p.add_argument("--load-format", default=None, help="vllm: auto | dummy (default: auto-detect)")
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    p.add_argument(
        "--mock-speedup",
        type=float,
        default=1.0,
        help="mock engine speed over the paper's A800 (the prior stays at 1)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    kinds = ["mock", "vllm"] if args.engine == "both" else [args.engine]
    runs = [asyncio.run(run_engine(k, args)) for k in kinds]
    print(f"{'engine':<6} {'requests':>8}  {'median |err|':>26}  {'p90 |err|':>26}")
    print(f"{'':<6} {'':>8}  {'online  warm-up  prior':>26}  {'online  warm-up  prior':>26}")
    for r in runs:
        med = "  ".join(
            f"{r[f'{n}_median_abs_err']:.3g}" for n in ("online", "warmup_only", "prior")
        )
        p90 = "  ".join(f"{r[f'{n}_p90_abs_err']:.3g}" for n in ("online", "warmup_only", "prior"))
        print(f"{r['engine']:<6} {r['requests']:>8}  {med:>26}  {p90:>26}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
