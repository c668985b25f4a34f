"""``perigee bench migration``: what a dead decode worker costs a request, against
re-prefilling it.

Starts a stack (1 prefill, 2 decode; the mock engine at the paper's A800 speed by
default, ``--engine vllm`` for the real model) and, per trial:

1. streams a request of ``--prompt-tokens`` fresh token ids (nothing cached) through
   the gateway, ``--max-tokens`` long;
2. once ``--kill-after`` of its tokens are out, SIGKILLs the decode instance serving it;
   the gateway's watchdog notices (``--dead-after``) and resends it (issue 13): the
   prompt's KV comes from the prefill node's store, the generated tokens are computed
   again, and the stream goes on on the other decode instance;
3. measures, on a bus tap: **detection** (kill -> the migrated request is on the bus),
   **migration** (that -> its first token on the reply subject) and the client's whole
   **stall** (kill -> next token);
4. baseline, in the same run: the very tokens the migration prefilled (prompt +
   generated so far) sent on the bus as a new request under salted block hashes, so no
   store has them: a **re-prefill** from scratch (what a migration without the KV, as
   Dynamo's, costs at best), publish -> first token;
5. restarts the killed decode instance and waits for its load report.

Reports p50/mean of each, ``migration / re-prefill`` (both from the same trials), the
tokens the migrated requests took from a store against those computed again, and
whether every stream ended complete. SLOs are set out of the way: this measures time,
not admission.
"""

import argparse
import asyncio
import json
import math
import random
import signal
import sys
import time
import uuid

import aiohttp
import nats

from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.load import WorkerStats
from bus_schemas.requests import Error, Finished, GenerateRequest, SamplingParams
from bus_schemas.roles import Role
from perigee import models
from perigee.bench.stats import summary_ms
from perigee.bench.stats import unmeasured as not_figures
from perigee.natsd import free_port
from perigee.stack import Stack, StackConfig
from services.common import defaults
from services.common.hashing import block_hashes
from services.common.model_spec import ModelSpec

DECODES = ("decode-0", "decode-1")


class Tap:
    """When each GenerateRequest and each request's first Tokens crossed the bus."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[float, GenerateRequest]] = {}
        self.first_token: dict[str, float] = {}
        self.tokens: dict[str, int] = {}  # request id -> tokens seen
        self.decode_of: dict[str, str] = {}
        self.nc = None

    async def start(self, url: str) -> "Tap":
        self.nc = await nats.connect(url)

        async def on_req(m) -> None:
            r = decode(m.data, GenerateRequest)
            self.requests[r.request_id] = (time.perf_counter(), r)

        async def on_event(m) -> None:
            now = time.perf_counter()
            obj = json.loads(m.data)
            if not isinstance(obj, dict):  # the gateway's own echo on perigee.gw.<id>
                return
            rid = obj.get("request_id", "")  # (the subject ends in the stream's nonce)
            if obj.get("type") == "accepted":
                self.decode_of[rid] = obj["decode_instance"]
            elif obj.get("type") == "tokens":
                self.first_token.setdefault(rid, now)
                self.tokens[rid] = self.tokens.get(rid, 0) + len(obj["token_ids"])
            elif obj.get("type") == "finished" and obj.get("tokens"):  # the last, bundled
                self.tokens[rid] = self.tokens.get(rid, 0) + len(obj["tokens"]["token_ids"])

        # The gateway sends a request, and a migration's resend of it, on the durable
        # intake (JetStream work queue: its publishes still reach a core subscriber)
        # unless it runs --no-durable-intake, then on core REQUESTS: watch both.
        await self.nc.subscribe(subjects.INTAKE, cb=on_req)
        await self.nc.subscribe(subjects.REQUESTS, cb=on_req)
        await self.nc.subscribe("perigee.gw.>", cb=on_event)
        await self.nc.flush()
        return self


async def stream(
    http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, on_token
) -> tuple[str, int, str]:
    """(request id, completion tokens, error) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rid, completion, error = "", 0, ""
    async with http.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return "", 0, f"HTTP {r.status}: {await r.text()}"
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            obj = json.loads(line[5:])
            if "error" in obj:
                return rid, completion, obj["error"].get("message", "error")
            rid = obj.get("id", rid)
            if obj.get("usage"):
                completion = obj["usage"]["completion_tokens"]
            await on_token(rid)
    return rid, completion, error


async def reprefill(nc, tokens: list[int], block_size: int, salt: str) -> float:
    """Publish -> first token of a cold prefill of ``tokens`` (salted block hashes)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(
        request_id=f"bench-reprefill-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=tokens,
        sampling=SamplingParams(max_tokens=1, ignore_eos=True),
        block_size=block_size,
        block_hashes=block_hashes(tokens, block_size, salt.encode()),
    )
    t0 = time.perf_counter()
    await nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
    first = None
    try:
        while True:
            m = await sub.next_msg(timeout=300)
            obj = json.loads(m.data)
            if obj.get("type") == "tokens" and first is None:
                first = time.perf_counter() - t0
            if obj.get("type") in ("finished", "error"):
                if obj["type"] == "error":
                    raise RuntimeError(f"re-prefill failed: {decode(m.data, Error).message}")
                decode(m.data, Finished)
                return first if first is not None else float("nan")
    finally:
        await sub.unsubscribe()


async def stats(nc, instance: str) -> dict[str, int]:
    m = await nc.request(subjects.worker_stats(Role.DECODE, instance), b"{}", timeout=10)
    return decode(m.data, WorkerStats).counters


async def wait_reporting(nc, instance: str, timeout: float) -> None:
    seen = asyncio.Event()
    since = time.time()

    async def cb(m) -> None:
        if json.loads(m.data).get("ts", 0) > since:
            seen.set()

    sub = await nc.subscribe(subjects.load_report(Role.DECODE, instance), cb=cb)
    try:
        await asyncio.wait_for(seen.wait(), timeout)
    finally:
        await sub.unsubscribe()


async def run(stack: Stack, a: argparse.Namespace, vocab: int) -> dict:
    tap = await Tap().start(stack.nats_url)
    nc = await nats.connect(stack.nats_url)
    rng = random.Random(a.seed)
    rows, failures = [], []
    timeout = aiohttp.ClientTimeout(total=600)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            pulled = recomputed = migrated = 0
            for trial in range(a.trials):
                prompt = [rng.randrange(100, vocab - 100) for _ in range(a.prompt_tokens)]
                before = {d: await stats(nc, d) for d in DECODES}
                killed: dict[str, float] = {}

                async def on_token(rid: str, killed: dict[str, float] = killed) -> None:
                    if not killed and tap.tokens.get(rid, 0) >= a.kill_after:
                        name = tap.decode_of[rid]
                        killed[name] = time.perf_counter()
                        stack.kill(name, signal.SIGKILL)

                rid, completion, error = await stream(
                    http, stack.url, prompt, a.max_tokens, on_token
                )
                if error or completion != a.max_tokens or not killed:
                    failures.append(
                        {
                            "trial": trial,
                            "error": error or "incomplete",
                            "completion_tokens": completion,
                            "killed": bool(killed),
                        }
                    )
                    if not killed:
                        continue
                [(name, t_kill)] = killed.items()
                # The survivor counts what the migrated request took (the killed
                # instance's counters die with it).
                for d in DECODES:
                    if d != name:
                        st = await stats(nc, d)
                        migrated += st.get("migrated_tasks", 0) - before[d].get("migrated_tasks", 0)
                        pulled += st.get("migration_kv_tokens_pulled", 0) - before[d].get(
                            "migration_kv_tokens_pulled", 0
                        )
                        recomputed += st.get("migration_tokens_recomputed", 0) - before[d].get(
                            "migration_tokens_recomputed", 0
                        )
                mig = [
                    (t, r)
                    for t, r in tap.requests.values()
                    if r.migration and r.migration.of_request_id == rid
                ]
                if not mig:
                    # The kill happened but the tap never saw the resend: the bench
                    # cannot time this trial (it watches the wrong subject?).
                    failures.append(
                        {
                            "trial": trial,
                            "error": f"the bus tap saw no migrated request of {rid!r}",
                            "completion_tokens": completion,
                            "killed": True,
                        }
                    )
                else:
                    t_resend, mreq = mig[-1]
                    t_first = tap.first_token.get(mreq.request_id, float("nan"))
                    if t_first != t_first:
                        failures.append(
                            {
                                "trial": trial,
                                "error": f"the bus tap saw no token of {mreq.request_id!r}",
                                "completion_tokens": completion,
                                "killed": True,
                            }
                        )
                    cold = await reprefill(
                        nc, mreq.prompt_token_ids, a.block_size, f"bench-cold-{trial}"
                    )
                    rows.append(
                        {
                            "detection_s": t_resend - t_kill,
                            "migration_s": t_first - t_resend,
                            "stall_s": t_first - t_kill,
                            "reprefill_s": cold,
                            "resumed_tokens": mreq.migration.resumed_tokens,
                            "context_tokens": len(mreq.prompt_token_ids),
                        }
                    )
                    print(
                        f"trial {trial}: killed {name} after {mreq.migration.resumed_tokens} "
                        f"tokens; detection {rows[-1]['detection_s'] * 1e3:.0f} ms, migration "
                        f"{rows[-1]['migration_s'] * 1e3:.1f} ms, re-prefill "
                        f"{cold * 1e3:.1f} ms",
                        flush=True,
                    )
                if trial < a.trials - 1:
                    stack._spawn(stack.children[name])  # back for the next trial
                    await wait_reporting(nc, name, a.restart_timeout)
    finally:
        await nc.close()
        await tap.nc.close()

    def col(k: str) -> list[float]:
        return [r[k] for r in rows if r[k] == r[k]]

    out = {
        "engine": a.engine,
        "model": a.model_name,
        "prompt_tokens": a.prompt_tokens,
        "max_tokens": a.max_tokens,
        "kill_after": a.kill_after,
        "dead_after_s": a.dead_after,
        "trials": a.trials,
        "migrated_trials": len(rows),
        "failures": failures,
        "detection_ms": summary_ms(col("detection_s")),
        "migration_ms": summary_ms(col("migration_s")),
        "stall_ms": summary_ms(col("stall_s")),
        "reprefill_ms": summary_ms(col("reprefill_s")),
        "kv_tokens_pulled": pulled,
        "tokens_recomputed": recomputed,
        "migrated_requests_counted": migrated,
        "rows": rows,
    }
    m, r = out["migration_ms"]["p50"], out["reprefill_ms"]["p50"]
    out["migration_over_reprefill_p50"] = round(m / r, 3) if r and math.isfinite(m / r) else None
    return out


FIGURES = ("detection_ms", "migration_ms", "reprefill_ms", "stall_ms")


def unmeasured(out: dict) -> list[str]:
    """The figures of ``out`` that are not finite numbers (no trial measured them)."""
    return not_figures(out, *(f"{k}.*" for k in FIGURES), "migration_over_reprefill_p50")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="perigee bench migration",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--engine", choices=["mock", "vllm"], default="mock")
    p.add_argument("--model", default=None, help="--engine vllm: default SmolLM2-135M-Instruct")
    p.add_argument("--speedup", default="1", help="mock engine speed against the paper's A800")
    p.add_argument(
        "--prompt-tokens", type=int, default=None, help="default 4096 (mock), 1024 (vllm)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kill-after", type=int, default=16, help="tokens out before the kill")
    p.add_argument("--trials", type=int, default=None, help="default 5 (mock), 2 (vllm)")
    p.add_argument("--dead-after", type=float, default=defaults.DEAD_AFTER_S)
    p.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    p.add_argument("--restart-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=13)
    p.add_argument("--log-dir", default=".perigee/bench-logs/migration")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    vllm = a.engine == "vllm"
    a.prompt_tokens = a.prompt_tokens or (1024 if vllm else 4096)
    a.trials = a.trials or (2 if vllm else 5)
    model = models.resolve(a.model or (None if vllm else models.TINY_NAME))
    a.model_name = model.name
    spec = ModelSpec.from_dir(model.path)
    block = spec.block_bytes(a.block_size)
    need = 3 * (a.prompt_tokens + a.max_tokens) // a.block_size + 64
    cfg = StackConfig(
        port=free_port(),
        engine=a.engine,
        prefill=1,
        decode=2,
        model_dir=str(model.path),
        served_model_name=model.name,
        block_size=a.block_size,
        speedup=a.speedup,
        ttft_slo=1e6,
        tbt_slo=1e6,
        dead_after=a.dead_after,
        log_dir=a.log_dir,
        log_level="WARNING",
        store_capacity_blocks=max(need, min(4096, (2 << 30) // block)),
    )
    with Stack(cfg) as stack:
        out = asyncio.run(run(stack, a, spec.vocab_size))
    print(
        f"{out['migrated_trials']}/{a.trials} trials migrated, {len(out['failures'])} failed "
        f"({a.engine}, {out['model']}, {a.prompt_tokens}-token prompts)"
    )
    for k in FIGURES:
        print(f"  {k[:-3]:<10} p50 {out[k]['p50']:9.1f} ms   mean {out[k]['mean']:9.1f} ms")
    print(f"  migration / re-prefill (p50): {out['migration_over_reprefill_p50']}")
    print(
        f"  migrated context: {out['kv_tokens_pulled']} tokens pulled from a store, "
        f"{out['tokens_recomputed']} computed again"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    for f in out["failures"]:
        print(f"  trial {f['trial']} failed: {f['error']}", file=sys.stderr)
    bad = unmeasured(out)
    if bad:
        print(
            "perigee bench migration: not measured (NaN): "
            f"{', '.join(dict.fromkeys(b.split('.')[0].split('=')[0] for b in bad))}; "
            f"{out['migrated_trials']}/{a.trials} trials timed",
            file=sys.stderr,
        )
        return 1
    return 0 if not out["failures"] and out["migrated_trials"] == a.trials else 1
