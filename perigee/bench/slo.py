"""``perigee bench slo``: effective request capacity (paper §7.2) on the engine that runs.

One run replays the same Mooncake trace slice (``perigee replay``) against

  (a) the perigee stack (``perigee up``'s defaults: vLLM, the default model, 1P+1D), and
  (b) plain vLLM's own OpenAI server on the same model with prefix caching,

one after the other, each at every ``--speeds`` factor of the trace's arrival rate.
Per system and speed: completed, 429s, other errors, cut streams (HTTP 200 that broke
off short), TTFT p50/p90 and TBT p90 of the completed, and good requests per second
(completed within the TTFT and TBT SLOs, over the slice's wall time). On one small
machine perigee's prefill and decode engines share the cores that plain vLLM has to
itself: say so beside the figures.

JSON (``--json PATH``)::

    {"runs": [{"system": "perigee"|"vllm", "speed", "completed", "rejected_429",
               "errors", "cut", "ttft_p50_s", "ttft_p90_s", "tbt_p90_s", "good_per_s",
               ...}], "config": {...}}
"""

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from perigee import models, up
from perigee.natsd import free_port
from perigee.replay import ReplayOutcome, replay, summarize
from perigee.stack import Stack, StackConfig, default_slos
from perigee.trace import DEFAULT_TRACE, PromptBuilder, load_trace, spread_ties
from services.common.model_spec import ModelSpec
from services.engine.vllm import options as vllm_options


def run_row(
    system: str,
    speed: float,
    outs: list[ReplayOutcome],
    wall: float,
    ttft_slo: float,
    tbt_slo: float,
) -> dict:
    s = summarize(outs, wall, ttft_slo, tbt_slo)
    return {
        "system": system,
        "speed": speed,
        "requests": s["requests"],
        "completed": s["completed"],
        "rejected_429": s["rejected"],
        "errors": s["failed"],
        "cut": s["cut"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "tbt_p90_s": s["tbt_s"]["p90"],
        "good": s["goodput"]["requests"],
        "good_per_s": s["goodput"]["rps"],
        "wall_s": wall,
        "error_samples": sorted({o.error for o in outs if o.error and o.status != 429})[:5],
    }


async def _replay_all(url: str, model: str, system: str, a, reqs, vocab: int) -> list[dict]:
    rows = []
    for i, speed in enumerate(a.speeds):
        # Fresh prompts per speed (same trace shape, other tokens): a later speed must not
        # find every prefix cached by the one before.
        builder = PromptBuilder(a.block_tokens, vocab, seed=i)
        outs, wall = await replay(
            reqs,
            url,
            speedup=speed,
            builder=builder,
            model=model,
            output_scale=1.0,
            max_output=a.max_output,
            api_key=None,
            progress=False,
        )
        row = run_row(system, speed, outs, wall, a.ttft_slo, a.tbt_slo)
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


def _fmt(r: dict) -> str:
    return (
        f"{r['system']:8s} x{r['speed']:<4g} completed {r['completed']:3d}  429 "
        f"{r['rejected_429']:3d}  errors {r['errors']:3d}  cut {r['cut']:3d}  TTFT p50 "
        f"{r['ttft_p50_s']:.2f}s p90 {r['ttft_p90_s']:.2f}s  TBT p90 {r['tbt_p90_s']:.3f}s  "
        f"good/s {r['good_per_s']:.3f}"
    )


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"plain vLLM server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"plain vLLM server not ready after {timeout:.0f} s")


def vllm_server_cmd(
    model_dir: str, name: str, port: int, block_size: int, max_model_len: int
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model_dir,
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        str(block_size),
        "--enforce-eager",
        "--enable-prefix-caching",
    ]
    if max_model_len:
        cmd += ["--max-model-len", str(max_model_len)]
    if not vllm_options.has_weights(model_dir):
        cmd += ["--load-format", "dummy"]
    return cmd


def plain_vllm(a, reqs, vocab: int, name: str, log_dir: Path) -> list[dict]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_gib)}
    for k, v in vllm_options.DEFAULT_ENV.items():
        env.setdefault(k, v)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log = open(log_dir / "plain-vllm.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        vllm_server_cmd(a.model, name, port, a.block_size, a.max_model_len),
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", proc, a.start_timeout)
        return asyncio.run(_replay_all(f"http://127.0.0.1:{port}", name, "vllm", a, reqs, vocab))
    finally:
        _stop_group(proc)
        log.close()


def _stop_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def perigee_config(a, log_dir: Path) -> StackConfig:
    """Exactly what ``perigee up`` would run (its own argument parsing and defaults:
    the default model, store bounds, SLOs for this machine), on a free port."""
    argv = [
        "--engine",
        "vllm",
        "--port",
        str(free_port()),
        "--log-dir",
        str(log_dir / "perigee"),
        "--block-size",
        str(a.block_size),
        "--ttft-slo",
        str(a.ttft_slo),
        "--tbt-slo",
        str(a.tbt_slo),
    ]
    if a.model:
        argv += ["--model", a.model]
    cfg = up.parse(argv)
    return dataclasses.replace(
        cfg, max_model_len=a.max_model_len, extra_env=dict(kv.split("=", 1) for kv in a.env)
    )


def perigee_stack(a, reqs, vocab: int, name: str, log_dir: Path) -> list[dict]:
    stack = Stack(perigee_config(a, log_dir)).start(a.start_timeout)
    try:
        return asyncio.run(_replay_all(stack.url, name, "perigee", a, reqs, vocab))
    finally:
        stack.stop()


def main(argv: list[str]) -> int:
    d = StackConfig()
    p = argparse.ArgumentParser(
        prog="perigee bench slo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=40, help="first N requests of the trace")
    p.add_argument(
        "--speeds",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1.0, 2.0, 4.0],
        help="arrival-rate factors, comma list",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        default=32,
        help="prompt tokens per trace hash id (512 in the trace; fewer fit a CPU)",
    )
    p.add_argument("--max-output", type=int, default=16, help="output tokens per request, at most")
    p.add_argument(
        "--model",
        default=None,
        help="as perigee up's --model (default: the default model, as perigee up)",
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        help="TTFT SLO, s (default: perigee up's for vLLM on this machine)",
    )
    p.add_argument("--tbt-slo", type=float, default=None, help="TBT SLO, s (likewise)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="plain vLLM's KV cache, GiB")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--systems", default="perigee,vllm", help="which to run, comma list")
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="K=V",
        help="environment for the perigee services (repeatable)",
    )
    p.add_argument("--log-dir", default=".perigee/bench-slo")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    slos = default_slos("vllm")
    a.ttft_slo = slos[0] if a.ttft_slo is None else a.ttft_slo
    a.tbt_slo = slos[1] if a.tbt_slo is None else a.tbt_slo
    try:
        model = models.resolve(a.model)
    except models.ModelNotReady as e:
        p.exit(2, f"perigee bench slo: {e}\n")
    a.model = str(model.path)
    spec = ModelSpec.from_dir(a.model)
    name = model.name
    reqs = spread_ties(load_trace(a.trace, a.limit))
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(reqs)} requests over {reqs[-1].timestamp_s - reqs[0].timestamp_s:.1f} s, "
        f"speeds {a.speeds}, TTFT SLO {a.ttft_slo} s, TBT SLO {a.tbt_slo} s",
        flush=True,
    )
    runs: list[dict] = []
    systems = a.systems.split(",")
    if "perigee" in systems:
        runs += perigee_stack(a, reqs, spec.vocab_size, name, log_dir)
    if "vllm" in systems:
        runs += plain_vllm(a, reqs, spec.vocab_size, name, log_dir)
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"runs": runs, "config": {k: v for k, v in vars(a).items() if k not in ("json",)}},
                indent=2,
            )
        )
    return 0
