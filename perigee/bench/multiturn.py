"""``perigee bench multiturn``: conversations against perigee and plain vLLM (issue 24).

N conversations of K turns of real text on the default model, each turn a streaming
``/v1/chat/completions`` call (greedy, ``max_tokens`` per answer) whose messages are the
conversation so far: the previous turns' questions and the assistant's answers as the
server streamed them, then the next question; the server renders and tokenizes it,
so a next turn reuses the previous answer only where that text tokenizes back to the
generated tokens (the same for both systems). Conversations arrive open-loop at
``--rate`` per second times each ``--loads`` factor; within a conversation each turn
is sent when the previous answer ends.

The same conversations run against

  (a) the perigee stack (``perigee up``'s defaults: vLLM, the default model, 1P+1D),
  (b) plain vLLM's own OpenAI server on the same model with prefix caching
      (``--enable-prompt-tokens-details`` for its cached-token counts),

one after the other. Per system, load and turn: cached tokens over prompt tokens, TTFT
p50/p90, and good requests (TTFT and TBT within the SLOs). Every load uses fresh facts
(its own conversations), so no load finds another's blocks. On one small machine
perigee's two engines share the cores plain vLLM has to itself: say so beside the
figures.

JSON (``--json PATH``)::

    {"runs": [{"system", "load", "turn", "requests", "completed", "prompt_tokens",
               "cached_tokens", "cached_ratio", "ttft_p50_s", "ttft_p90_s", "good",
               "rejections", "errors"}], "config": {...}}

A rejected turn (429) is sent again after its ``Retry-After`` up to ``--retries`` times,
as the ``openai`` client does; its TTFT counts from the first attempt.
"""

import argparse
import asyncio
import json
import math
import os
import subprocess
import time
from pathlib import Path

import aiohttp

from perigee import models
from perigee.bench.slo import _stop_group, _wait_http, perigee_config, vllm_server_cmd
from perigee.bench.stats import percentile
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig, default_slos
from services.engine.vllm import options as vllm_options

COLORS = ("red", "blue", "green", "white", "black", "grey", "gold", "pink", "brown", "teal")
QUESTIONS = (
    "Repeat the facts above, one per line.",
    "Now repeat them in reverse order.",
    "Which lighthouse is the tallest, and when was it built?",
    "Which one is the oldest?",
    "Summarise the facts in one sentence.",
)


def conversation_facts(conv: int, load: int, n_facts: int) -> str:
    """Facts of one conversation: distinct per conversation and per load."""
    base = 97 * conv + 1009 * load
    return " ".join(
        f"Fact {i}: the {COLORS[(base + i) % len(COLORS)]} lighthouse number {base + i} "
        f"is {(base + i * 11) % 37 + 5} metres tall and was built in {1800 + (base + i * 7) % 200}."
        for i in range(n_facts)
    )


async def chat_turn(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    retries: int = 0,
) -> dict:
    """One streaming turn: its text, TTFT, token gaps, prompt and cached tokens.

    A 429 is tried again up to ``retries`` times after its ``Retry-After``, as the
    official ``openai`` client does (``max_retries`` 2 by default). TTFT counts from the
    first attempt, so the wait a rejection costs the user is in it."""
    t0 = time.perf_counter()
    out: dict = {}
    for attempt in range(retries + 1):
        out = await _attempt(http, url, model, messages, max_tokens, t0)
        out["rejections"] = attempt + (1 if out.get("status") == 429 else 0)
        if out.get("status") != 429 or attempt == retries:
            return out
        await asyncio.sleep(out["retry_after_s"])
    return out


async def _attempt(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    messages: list[dict],
    max_tokens: int,
    t0: float,
) -> dict:
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out: dict = {"ok": False, "text": "", "ttft_s": math.nan, "gaps": [], "error": ""}
    last = t0
    parts: list[str] = []
    try:
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            if r.status != 200:
                out["status"] = r.status
                out["retry_after_s"] = _retry_after(r.headers.get("Retry-After"))
                out["error"] = f"HTTP {r.status}: {(await r.text())[:160]}"
                return out
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out["ok"] = True
                    break
                ev = json.loads(data)
                if ev.get("error"):
                    out["error"] = str(ev["error"])[:160]
                    break
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        now = time.perf_counter()
                        if not parts:
                            out["ttft_s"] = now - t0
                        else:
                            out["gaps"].append(now - last)
                        last = now
                        parts.append(piece)
                u = ev.get("usage")
                if u:
                    out["prompt_tokens"] = u.get("prompt_tokens", 0)
                    out["completion_tokens"] = u.get("completion_tokens", 0)
                    out["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ) or 0
    except (aiohttp.ClientError, TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["text"] = "".join(parts)
    return out


def _retry_after(value: str | None) -> float:
    """Seconds from a ``Retry-After`` header (delta-seconds), 1 s when absent, and at most
    60 s as the ``openai`` client caps it."""
    try:
        return min(max(float(value or 1.0), 0.0), 60.0)
    except ValueError:
        return 1.0


def tbt(gaps: list[float]) -> float:
    """Mean of the longest 10 % of the gaps (paper §7.1)."""
    if not gaps:
        return 0.0
    k = max(1, math.ceil(len(gaps) * 0.1))
    return sum(sorted(gaps)[-k:]) / k


async def run_load(url: str, model: str, a, load: float, load_index: int) -> list[list[dict]]:
    """Every conversation at this load: per conversation, its turns' outcomes."""
    timeout = aiohttp.ClientTimeout(total=a.request_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(c: int) -> list[dict]:
            await asyncio.sleep(c / (a.rate * load))
            messages = [
                {
                    "role": "system",
                    "content": "You are a careful assistant.\n"
                    + conversation_facts(c, load_index, a.facts),
                }
            ]
            turns = []
            for k in range(a.turns):
                messages.append({"role": "user", "content": QUESTIONS[k % len(QUESTIONS)]})
                r = await chat_turn(http, url, model, messages, a.answer_tokens, a.retries)
                turns.append(r)
                if not r["ok"]:
                    break  # the conversation cannot go on without the answer
                messages.append({"role": "assistant", "content": r["text"]})
            return turns

        return await asyncio.gather(*(one(c) for c in range(a.conversations)))


def rows_of(system: str, load: float, convs: list[list[dict]], a) -> list[dict]:
    rows = []
    for k in range(a.turns):
        outs = [c[k] for c in convs if len(c) > k]
        done = [o for o in outs if o["ok"]]
        ttfts = [o["ttft_s"] for o in done if not math.isnan(o["ttft_s"])]
        prompt = sum(o.get("prompt_tokens", 0) for o in done)
        cached = sum(o.get("cached_tokens", 0) for o in done)
        rows.append(
            {
                "system": system,
                "load": load,
                "turn": k + 1,
                "requests": len(outs),
                "completed": len(done),
                "prompt_tokens": prompt,
                "cached_tokens": cached,
                "cached_ratio": cached / prompt if prompt else 0.0,
                "ttft_p50_s": percentile(ttfts, 50) if ttfts else math.nan,
                "ttft_p90_s": percentile(ttfts, 90) if ttfts else math.nan,
                "good": sum(
                    1 for o in done if o["ttft_s"] <= a.ttft_slo and tbt(o["gaps"]) <= a.tbt_slo
                ),
                "rejections": sum(o.get("rejections", 0) for o in outs),
                "errors": sorted({o["error"] for o in outs if o["error"]})[:3],
            }
        )
    return rows


def _fmt(r: dict) -> str:
    return (
        f"{r['system']:8s} load x{r['load']:<3g} turn {r['turn']}  done {r['completed']:2d}/"
        f"{r['requests']:<2d} cached {r['cached_tokens']:6d}/{r['prompt_tokens']:<6d} "
        f"({r['cached_ratio']:.3f})  TTFT p50 {r['ttft_p50_s']:.3f}s p90 "
        f"{r['ttft_p90_s']:.3f}s  good {r['good']}  429s {r['rejections']}"
    )


def run_system(system: str, url: str, model: str, a) -> list[dict]:
    rows = []
    for i, load in enumerate(a.loads):
        convs = asyncio.run(run_load(url, model, a, load, i))
        for r in rows_of(system, load, convs, a):
            print(_fmt(r), flush=True)
            rows.append(r)
    return rows


def perigee_runs(a, name: str, log_dir: Path) -> list[dict]:
    stack = Stack(perigee_config(a, log_dir)).start(a.start_timeout)
    try:
        return run_system("perigee", stack.url, name, a)
    finally:
        stack.stop()


def vllm_runs(a, name: str, log_dir: Path) -> list[dict]:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(a.vllm_kv_gib)}
    for k, v in vllm_options.DEFAULT_ENV.items():
        env.setdefault(k, v)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [
        *vllm_server_cmd(a.model, name, port, a.block_size, a.max_model_len),
        "--enable-prompt-tokens-details",
    ]
    with open(log_dir / "plain-vllm.log", "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_http(f"http://127.0.0.1:{port}/health", proc, a.start_timeout)
            return run_system("vllm", f"http://127.0.0.1:{port}", name, a)
        finally:
            _stop_group(proc)


def main(argv: list[str]) -> int:
    d = StackConfig()
    p = argparse.ArgumentParser(
        prog="perigee bench multiturn",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--answer-tokens", type=int, default=64, help="max_tokens per answer")
    p.add_argument("--facts", type=int, default=12, help="facts per conversation's prompt")
    p.add_argument("--rate", type=float, default=0.5, help="conversations per second at x1")
    p.add_argument(
        "--loads",
        type=lambda v: [float(x) for x in v.split(",")],
        default=[1.0, 2.0, 4.0],
        help="arrival-rate factors, comma list",
    )
    p.add_argument("--model", default=None, help="as perigee up's --model")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--ttft-slo", type=float, default=None, help="s (default: perigee up's)")
    p.add_argument("--tbt-slo", type=float, default=None, help="s (default: perigee up's)")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="plain vLLM's KV cache, GiB")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        help="a 429 is sent again after its Retry-After, this many times (the openai "
        "client's default is 2); TTFT counts from the first attempt",
    )
    p.add_argument("--systems", default="perigee,vllm", help="which to run, comma list")
    p.add_argument("--env", action="append", default=[], metavar="K=V")
    p.add_argument("--log-dir", default=".perigee/bench-multiturn")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.conversations < 1 or a.turns < 1 or a.answer_tokens < 1 or a.rate <= 0:
        p.error("--conversations, --turns, --answer-tokens and --rate must be positive")
    slos = default_slos("vllm")
    a.ttft_slo = slos[0] if a.ttft_slo is None else a.ttft_slo
    a.tbt_slo = slos[1] if a.tbt_slo is None else a.tbt_slo
    try:
        model = models.resolve(a.model)
    except models.ModelNotReady as e:
        p.exit(2, f"perigee bench multiturn: {e}\n")
    a.model = str(model.path)
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"{a.conversations} conversations x {a.turns} turns, {a.rate:g}/s x {a.loads}, "
        f"TTFT SLO {a.ttft_slo} s, TBT SLO {a.tbt_slo} s",
        flush=True,
    )
    runs: list[dict] = []
    systems = a.systems.split(",")
    if "perigee" in systems:
        runs += perigee_runs(a, model.name, log_dir)
    if "vllm" in systems:
        runs += vllm_runs(a, model.name, log_dir)
    if a.json:
        Path(a.json).write_text(
            json.dumps({"runs": runs, "config": {k: v for k, v in vars(a).items()}}, indent=2)
        )
    return 0
