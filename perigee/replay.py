"""``perigee replay``: open-loop replay of a Mooncake trace against any OpenAI endpoint.

Each request is sent at its trace timestamp (divided by ``--speedup``) as a streaming
``/v1/completions`` call with the prompt as token ids (vLLM's server accepts the same),
``max_tokens`` = the trace's output length (scaled) and ``ignore_eos``. Reports TTFT
and TBT percentiles (TBT = mean of the longest 10 % of a request's token gaps, as in
the paper §7.1), goodput under the thresholds, and the cached-token ratio from
``usage.prompt_tokens_details.cached_tokens``.

The SLOs that goodput is graded against are the stack's own, read from the gateway's
``GET /v1/perigee/config``, unless ``--ttft-slo``/``--tbt-slo`` are given (another
server: the paper's 30 s / 0.1 s).
"""

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from tqdm import tqdm

from perigee.bench.stats import percentile
from perigee.trace import DEFAULT_TRACE, PromptBuilder, TraceRequest, load_trace
from services.common import defaults

WAIT_S = 120.0  # a stack still starting: perigee up takes tens of seconds with vLLM


@dataclass
class ReplayOutcome:
    """One replayed request: status, TTFT, token gaps and counts, or its error."""

    ok: bool
    status: int = 0
    ttft_s: float = math.nan
    gaps: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    expected_tokens: int = 0  # max_tokens asked (ignore_eos: every one is owed)
    tokens_seen: int = 0  # stream chunks that carried text
    error: str = ""

    @property
    def cut(self) -> bool:
        """Accepted (HTTP 200) but the stream broke off: an error event, no [DONE], or
        fewer tokens than asked for."""
        if self.status != 200:
            return False
        got = self.completion_tokens or self.tokens_seen
        return not self.ok or (self.expected_tokens > 0 and got < self.expected_tokens)

    @property
    def tbt_s(self) -> float:
        if not self.gaps:
            return 0.0
        k = max(1, math.ceil(len(self.gaps) * 0.1))
        return sum(sorted(self.gaps)[-k:]) / k


async def send(
    http, url: str, model: str, prompt: list[int], max_tokens: int, headers: dict
) -> ReplayOutcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    last = None
    out = ReplayOutcome(ok=False, expected_tokens=max_tokens)
    try:
        async with http.post(url.rstrip("/") + "/v1/completions", json=body, headers=headers) as r:
            out.status = r.status
            if r.status != 200:
                out.error = (await r.text())[:200]
                return out
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    out.ok = True
                    break
                obj = json.loads(data)
                if "error" in obj:
                    out.error = str(obj["error"])[:200]
                    break
                now = time.perf_counter()
                if obj.get("choices") and obj["choices"][0].get("text") is not None:
                    if last is None:
                        out.ttft_s = now - t0
                    else:
                        out.gaps.append(now - last)
                    last = now
                    out.tokens_seen += 1
                usage = obj.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens", 0)
                    out.completion_tokens = usage.get("completion_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens") or 0
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = repr(e)
    return out


async def models_listed(
    http, url: str, headers: dict, wait_s: float = WAIT_S, required: bool = True
) -> list[dict]:
    """``/v1/models``' list, once the endpoint serves: a perigee gateway whose stack is
    still starting answers 503 with ``Retry-After`` (vLLM does not listen until it
    serves), waited for up to ``wait_s``. Not ``required`` (the model was named), any
    other answer, or a wait that ran out, is an empty list rather than the end."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        async with http.get(url.rstrip("/") + "/v1/models", headers=headers) as r:
            try:
                body = await r.json(content_type=None)
            except ValueError:  # not JSON: a proxy's page
                body = None
            if r.status == 200:
                return (body or {}).get("data") or []
            left = deadline - time.monotonic()
            if r.status != 503 or left <= 0:
                if not required:
                    return []
                raise SystemExit(
                    f"perigee replay: GET /v1/models answered {r.status}: {error_text(body)}"
                )
            if not said:
                print(f"perigee replay: waiting for the endpoint ({error_text(body)})", flush=True)
                said = True
            await asyncio.sleep(min(left, float(r.headers.get("Retry-After") or 1)))


def error_text(body) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    return str(err.get("message")) if isinstance(err, dict) else "no error message"


async def stack_slos(url: str, api_key: str | None) -> tuple[float, float] | None:
    """(TTFT, TBT) SLOs, s, from a perigee gateway's ``GET /v1/perigee/config``; None
    from an endpoint that does not serve it (vLLM's server, an older gateway)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=10)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as http,
            http.get(url.rstrip("/") + "/v1/perigee/config", headers=headers) as r,
        ):
            if r.status != 200:
                return None
            cfg = await r.json()
            return float(cfg["ttft_slo_s"]), float(cfg["tbt_slo_s"])
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None


async def replay(
    reqs: list[TraceRequest],
    url: str,
    *,
    speedup: float,
    builder: PromptBuilder,
    model: str | None,
    output_scale: float,
    max_output: int,
    api_key: str | None,
    progress: bool = True,
    wait_s: float = 0.0,
) -> tuple[list[ReplayOutcome], float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bar = tqdm(total=len(reqs), desc="replay", unit="req", disable=not progress)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as http:
        listed = await models_listed(http, url, headers, wait_s, required=model is None)
        if model is None:
            if not listed:
                raise SystemExit("perigee replay: the endpoint lists no model; give --model")
            model = listed[0]["id"]
        t_start = time.perf_counter()
        base = reqs[0].timestamp_s if reqs else 0.0

        async def one(r: TraceRequest) -> ReplayOutcome:
            delay = t_start + (r.timestamp_s - base) / speedup - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            n_out = max(1, min(max_output, round(r.output_length * output_scale)))
            o = await send(http, url, model, builder.tokens(r), n_out, headers)
            bar.update(1)
            return o

        outs = await asyncio.gather(*(one(r) for r in reqs))
        wall = time.perf_counter() - t_start
    bar.close()
    return list(outs), wall


def why(o: ReplayOutcome) -> str:
    """What a failed or cut request was told: its status and the error's message."""
    msg = o.error
    try:
        body = json.loads(msg)
        msg = body["error"]["message"] if isinstance(body.get("error"), dict) else msg
    except (ValueError, TypeError, KeyError, AttributeError):
        pass
    return f"{o.status or 'no answer'}: {msg or 'stream ended early'}"


def summarize(outs: list[ReplayOutcome], wall_s: float, ttft_slo: float, tbt_slo: float) -> dict:
    done = [o for o in outs if o.ok and not o.cut]
    ttfts = [o.ttft_s for o in done]
    tbts = [o.tbt_s for o in done]
    good = [o for o in done if o.ttft_s <= ttft_slo and o.tbt_s <= tbt_slo]
    prompt = sum(o.prompt_tokens for o in done)

    def pct(v):
        return {
            "mean": sum(v) / len(v) if v else math.nan,
            "p50": percentile(v, 50),
            "p90": percentile(v, 90),
            "p99": percentile(v, 99),
        }

    return {
        "requests": len(outs),
        "completed": len(done),
        "rejected": sum(1 for o in outs if o.status == 429),
        "failed": sum(1 for o in outs if o.status not in (200, 429)),
        "cut": sum(1 for o in outs if o.cut),
        # Why the failed and cut ones failed: the commonest answers, with their counts.
        "errors": dict(
            Counter(why(o) for o in outs if o.cut or o.status not in (200, 429)).most_common(5)
        ),
        "ttft_s": pct(ttfts),
        "tbt_s": pct(tbts),
        "goodput": {
            "ttft_slo_s": ttft_slo,
            "tbt_slo_s": tbt_slo,
            "requests": len(good),
            "fraction": len(good) / len(outs) if outs else 0.0,
            "rps": len(good) / wall_s if wall_s > 0 else 0.0,
        },
        "cached_token_ratio": (sum(o.cached_tokens for o in done) / prompt) if prompt else 0.0,
        "prompt_tokens": prompt,
        "wall_s": wall_s,
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="perigee replay", description=__doc__)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument(
        "--url", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000"
    )
    p.add_argument("--model", default=None, help="model name (default: the first on /v1/models)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide trace timestamps by this")
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id")
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--output-scale", type=float, default=1.0)
    p.add_argument("--max-output", type=int, default=4096)
    p.add_argument(
        "--ttft-slo",
        type=float,
        default=None,
        help="TTFT SLO for goodput, s (default: the stack's, from GET /v1/perigee/config; "
        f"{defaults.TTFT_SLO_S:g} from an endpoint without it)",
    )
    p.add_argument(
        "--tbt-slo",
        type=float,
        default=None,
        help="TBT SLO for goodput, s (default: the stack's; "
        f"{defaults.TBT_SLO_S:g} from an endpoint without it)",
    )
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--wait",
        type=float,
        default=WAIT_S,
        help="seconds to wait for an endpoint still starting (503 on /v1/models)",
    )
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.ttft_slo is None or a.tbt_slo is None:
        got = asyncio.run(stack_slos(a.url, a.api_key))
        if got is None:
            got = (defaults.TTFT_SLO_S, defaults.TBT_SLO_S)
            print(
                f"perigee replay: {a.url} does not report its SLOs (GET /v1/perigee/config): "
                f"goodput against {got[0]:g} s TTFT / {got[1]:g} s TBT unless --ttft-slo/--tbt-slo"
            )
        if a.ttft_slo is None:
            a.ttft_slo = got[0]
        if a.tbt_slo is None:
            a.tbt_slo = got[1]
    reqs = load_trace(a.trace, a.limit)
    builder = PromptBuilder(a.block_tokens, a.vocab_size)
    outs, wall = asyncio.run(
        replay(
            reqs,
            a.url,
            speedup=a.speedup,
            builder=builder,
            model=a.model,
            output_scale=a.output_scale,
            max_output=a.max_output,
            api_key=a.api_key,
            progress=not a.no_progress,
            wait_s=a.wait,
        )
    )
    s = summarize(outs, wall, a.ttft_slo, a.tbt_slo)
    print(
        f"requests {s['requests']}  completed {s['completed']}  rejected {s['rejected']}  "
        f"failed {s['failed']}  cut {s['cut']}  wall {s['wall_s']:.1f}s"
    )
    for msg, n in s["errors"].items():
        print(f"  {n} x {msg}")
    print(
        f"TTFT p50 {s['ttft_s']['p50']:.4f}s p99 {s['ttft_s']['p99']:.4f}s   "
        f"TBT p50 {s['tbt_s']['p50']:.4f}s p99 {s['tbt_s']['p99']:.4f}s"
    )
    print(
        f"goodput {s['goodput']['requests']} ({s['goodput']['fraction']:.1%}; "
        f"TTFT <= {a.ttft_slo:g} s, TBT <= {a.tbt_slo:g} s)  "
        f"cached-token ratio {s['cached_token_ratio']:.3f}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0
