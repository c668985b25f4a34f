"""``perigee breakdown SPANS [--png PATH] [--json PATH]``: where a request's time goes.

Reads the JSONL spans the services write (:mod:`tracing.jsonl`; the stack's file is
``<log_dir>/spans.jsonl``), groups them by trace (one trace per request) and splits
each request's end-to-end latency into the stages of the Mooncake paper's Fig. 22,
along its critical path. The boundaries come from these spans::

    T0 gateway.request start           (the request reached the gateway)
    T1 prefill.load_prefix / prefill.compute start, whichever first
    T2 prefill.load_prefix end         (T1 when no remote prefix was pulled)
    T3 prefill.compute end
    T4 decode.load_kv start            (every layer landed, DecodeTask received)
    T5 decode.load_kv end
    T6 gateway.request "first_token" event (else start + perigee.ttft_s)
    T7 gateway.request end

When prefill streams the first token itself (the default), it reaches the client
before the KV has landed on the decode node: the order is then T0 T1 T2 T3 T6 T4 T5
T7, ``first_token`` = T6 - T3 and ``transfer`` = T4 - T6 (after the first token).
TTFT is T6 - T0 either way.

    queue           T1 - T0   admission, conductor placement, store transactions,
                              the prefill queue, the bus hops between them
    prefix_load     T2 - T1   remote prefix pulled store to store (a local hit is read
                              inside the layer-wise prefill, as in the paper)
    prefill_compute T3 - T2   layer-wise prefill (KV shipped per layer meanwhile)
    transfer        T4 - T3   the KV transfer not hidden behind compute, and the handoff
    decode_load     T5 - T4   decode engine loads the KV from its node's store
    first_token     T6 - T5   first token to the client
    decode          T7 - T6   the remaining tokens

Boundaries are made monotonic (``Ti = max(Ti, Ti-1)``, against clock skew between
hosts), so the stages are never negative and add up to the end-to-end latency.
``kv_ship`` (the whole ``prefill.ship`` span, mostly overlapped) is reported beside.

Requests are grouped by prefix hit (``cached_tokens / prompt_tokens``: 0 %, partial,
high >= ``--high-hit``) and prompt length (powers of two); ``--png`` draws the Fig. 22
stacked bars, 0 % next to high hit per length, stages that overlap inference hatched.
"""

import argparse
import json
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

STAGES = (
    "queue",
    "prefix_load",
    "prefill_compute",
    "transfer",
    "decode_load",
    "first_token",
    "decode",
)
LABELS = {
    "queue": "Schedule/queue",
    "prefix_load": "Prefix load",
    "prefill_compute": "Prefill",
    "transfer": "Transfer",
    "decode_load": "Load cache",
    "first_token": "First token",
    "decode": "Decode",
}
ASYNC_STAGES = frozenset({"queue", "transfer", "decode_load"})  # hatched, as in Fig. 22
ROOT = "gateway.request"


@dataclass
class TracedRequest:
    """One request's trace split into the stages of the paper's Fig. 22."""

    trace_id: str
    request_id: str
    status: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    stages_ns: dict[str, int]
    ttft_ns: int = 0  # request start -> first token (the stages before it, in time order)
    kv_ship_ns: int = 0
    services: list[str] = field(default_factory=list)
    start_ns: int = 0

    @property
    def hit(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def e2e_ns(self) -> int:
        return sum(self.stages_ns.values())

    def to_dict(self) -> dict:
        return {
            "trace_id": self.trace_id,
            "request_id": self.request_id,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "output_tokens": self.output_tokens,
            "prefix_hit": self.hit,
            "stages_s": {k: v / 1e9 for k, v in self.stages_ns.items()},
            "ttft_s": self.ttft_ns / 1e9,
            "e2e_s": self.e2e_ns / 1e9,
            "kv_ship_s": self.kv_ship_ns / 1e9,
            "services": self.services,
        }


def read_spans(path: str | Path) -> list[dict]:
    """Every span line of ``path``; lines that are not span objects are skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and {"trace_id", "name", "start_ns", "end_ns"} <= obj.keys():
                out.append(obj)
    return out


def by_trace(spans: Iterable[dict]) -> dict[str, list[dict]]:
    traces: dict[str, list[dict]] = defaultdict(list)
    for s in spans:
        traces[s["trace_id"]].append(s)
    return traces


def _first(spans: list[dict], name: str) -> dict | None:
    found = [s for s in spans if s["name"] == name]
    return min(found, key=lambda s: s["start_ns"]) if found else None


def breakdown(spans: list[dict]) -> TracedRequest | None:
    """One request's stages from its trace; None if the trace is not a complete request
    (no gateway span, or it never reached prefill and decode)."""
    root = _first(spans, ROOT)
    compute = _first(spans, "prefill.compute")
    load_kv = _first(spans, "decode.load_kv")
    if root is None or compute is None or load_kv is None:
        return None
    a = root.get("attributes", {})
    pull = _first(spans, "prefill.load_prefix")
    first_token = next(
        (e["ts_ns"] for e in root.get("events", ()) if e["name"] == "first_token"), None
    )
    if first_token is None:
        ttft = a.get("perigee.ttft_s")
        first_token = (
            root["start_ns"] + round(ttft * 1e9) if ttft is not None else load_kv["end_ns"]
        )
    t1 = min(compute["start_ns"], pull["start_ns"]) if pull else compute["start_ns"]
    early = first_token < load_kv["start_ns"]  # streamed by prefill, ahead of the handoff
    order = (
        [*STAGES[:3], "first_token", "transfer", "decode_load", "decode"] if early else list(STAGES)
    )
    points = [root["start_ns"], t1, pull["end_ns"] if pull else t1, compute["end_ns"]]
    points += (
        [first_token, load_kv["start_ns"], load_kv["end_ns"]]
        if early
        else [load_kv["start_ns"], load_kv["end_ns"], first_token]
    )
    points.append(root["end_ns"])
    for i in range(1, len(points)):
        points[i] = max(points[i], points[i - 1])
    stages = {s: points[i + 1] - points[i] for i, s in enumerate(order)}
    stages = {s: stages[s] for s in STAGES}
    ttft = points[order.index("first_token") + 1] - points[0]
    ship = _first(spans, "prefill.ship")
    return TracedRequest(
        trace_id=root["trace_id"],
        request_id=str(a.get("gen_ai.response.id", "")),
        status=int(a.get("http.response.status_code", 200)),
        prompt_tokens=int(a.get("gen_ai.usage.input_tokens", 0)),
        cached_tokens=int(a.get("perigee.cached_tokens", 0)),
        output_tokens=int(a.get("gen_ai.usage.output_tokens", 0)),
        stages_ns=stages,
        ttft_ns=ttft,
        kv_ship_ns=ship["end_ns"] - ship["start_ns"] if ship else 0,
        services=sorted({s.get("service") or "" for s in spans} - {""}),
        start_ns=root["start_ns"],
    )


def requests_from(spans: Iterable[dict]) -> list[TracedRequest]:
    out = [r for t in by_trace(spans).values() if (r := breakdown(t)) is not None]
    return sorted(out, key=lambda r: (r.start_ns, r.trace_id))


# ------------------------------------------------------------------ groups


def hit_class(hit: float, high: float) -> str:
    if hit <= 0:
        return "0%"
    return f">={high:.0%}" if hit >= high else "partial"


def length_class(tokens: int) -> int:
    """The power of two at or above ``tokens`` (the x axis of Fig. 22)."""
    return 1 << max(0, math.ceil(math.log2(max(1, tokens))))


def groups(reqs: list[TracedRequest], high: float = 0.5) -> list[dict]:
    """Mean stages per (prompt length class, prefix hit class), successful requests only."""
    bins: dict[tuple[int, str], list[TracedRequest]] = defaultdict(list)
    for r in reqs:
        if r.status == 200:
            bins[(length_class(r.prompt_tokens), hit_class(r.hit, high))].append(r)
    order = {"0%": 0, "partial": 1}
    out = []
    for (length, hit), rs in sorted(
        bins.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 2))
    ):
        n = len(rs)
        out.append(
            {
                "prompt_tokens_upto": length,
                "prefix_hit": hit,
                "requests": n,
                "mean_prefix_hit": sum(r.hit for r in rs) / n,
                "stages_s": {s: sum(r.stages_ns[s] for r in rs) / n / 1e9 for s in STAGES},
                "ttft_s": sum(r.ttft_ns for r in rs) / n / 1e9,
                "e2e_s": sum(r.e2e_ns for r in rs) / n / 1e9,
                "kv_ship_s": sum(r.kv_ship_ns for r in rs) / n / 1e9,
            }
        )
    return out


# ------------------------------------------------------------------ output


def _ms(ns_or_s: float, seconds: bool = False) -> str:
    return f"{(ns_or_s * 1e3 if seconds else ns_or_s / 1e6):9.2f}"


def render(reqs: list[TracedRequest], grps: list[dict], limit: int = 20) -> str:
    head = "".join(f"{s[:9]:>10}" for s in STAGES)
    lines = [f"{len(reqs)} requests; stages in ms (critical path; they add up to e2e)", ""]
    lines.append(f"{'request':<22}{'prompt':>7}{'hit':>6}{head}{'ttft':>10}{'e2e':>10}")
    shown = reqs if limit <= 0 else reqs[:limit]
    for r in shown:
        rid = (r.request_id or r.trace_id)[:21]
        cells = "".join(f" {_ms(r.stages_ns[s])}" for s in STAGES)
        lines.append(
            f"{rid:<22}{r.prompt_tokens:>7}{r.hit:>6.0%}{cells} {_ms(r.ttft_ns)} {_ms(r.e2e_ns)}"
        )
    if len(shown) < len(reqs):
        lines.append(f"... {len(reqs) - len(shown)} more (--requests 0 shows all)")
    lines += ["", "mean per group (prompt tokens up to, prefix hit)", ""]
    lines.append(f"{'group':<22}{'n':>7}{'hit':>6}{head}{'ttft':>10}{'e2e':>10}")
    for g in grps:
        name = f"<={g['prompt_tokens_upto']} {g['prefix_hit']}"
        cells = "".join(f" {_ms(g['stages_s'][s], True)}" for s in STAGES)
        lines.append(
            f"{name:<22}{g['requests']:>7}{g['mean_prefix_hit']:>6.0%}{cells} "
            f"{_ms(g['ttft_s'], True)} {_ms(g['e2e_s'], True)}"
        )
    return "\n".join(lines)


def plot(grps: list[dict], path: str | Path) -> None:
    """Fig. 22-style stacked bars: one per group, 0 % and high hit side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(grps) + 3), 4.5))
    colors = plt.get_cmap("tab10").colors
    xs = list(range(len(grps)))
    bottoms = [0.0] * len(grps)
    for i, stage in enumerate(STAGES):
        vals = [g["stages_s"][stage] * 1e3 for g in grps]
        ax.bar(
            xs,
            vals,
            bottom=bottoms,
            color=colors[i % len(colors)],
            edgecolor="black",
            linewidth=0.4,
            hatch="//" if stage in ASYNC_STAGES else None,
            label=LABELS[stage],
        )
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    ax.set_xticks(
        xs, [f"{g['prefix_hit']}\n≤{g['prompt_tokens_upto']} tok\nn={g['requests']}" for g in grps]
    )
    ax.set_ylabel("latency (ms)")
    ax.set_title("Latency breakdown (hatched: overlaps inference)", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="perigee breakdown",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("spans", help="JSONL spans file (PERIGEE_SPANS_FILE)")
    p.add_argument("--png", help="write the stacked-bar figure here")
    p.add_argument("--json", help="write per-request and per-group breakdowns here")
    p.add_argument("--requests", type=int, default=20, help="requests to list (0: all)")
    p.add_argument(
        "--high-hit",
        type=float,
        default=0.5,
        help="prefix hit ratio counted as a high hit (default 0.5)",
    )
    a = p.parse_args(argv)
    if not Path(a.spans).exists():
        p.error(f"{a.spans}: no such file")
    reqs = requests_from(read_spans(a.spans))
    grps = groups(reqs, a.high_hit)
    print(render(reqs, grps, a.requests))
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {"stages": list(STAGES), "requests": [r.to_dict() for r in reqs], "groups": grps},
                indent=2,
            )
            + "\n"
        )
    if a.png:
        if not grps:
            print("no complete request: no figure", file=sys.stderr)
            return 1
        plot(grps, a.png)
    return 0 if reqs else 1
