"""``perigee profile``: measure prefill times over (input length n, prefix hit p), fit the
polynomial cost model (services.common.cost_fit) and write it as JSON for
``--cost-model`` of the conductor and admission.

Three ways to reach an engine:

- ``--nats URL``: a running stack over the bus (GenerateRequest on perigee.requests,
  StreamEvents back); time = publish -> first token, p = Accepted.cached_tokens;
- ``--url URL``: a running stack over the gateway (POST /v1/completions with token
  ids, max_tokens 1); time = the whole response, p = usage cached_tokens;
- neither: in-process against ``services.engine.make_engine(--engine)``; time = the
  engine's ``prefill`` call alone (and, with ``--decode``, decode step times too).

Every sample uses fresh random token ids, so nothing is cached but what the sample
warms itself: for p > 0 the first p tokens are sent first (live: again until the
stack reports them cached, i.e. the blocks are committed; in-process: prefilled into
the same slots). Samples run one at a time so no queueing enters the timings; live
timings include the stack's fixed overheads, which the fit's constant term absorbs.
"""

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common import defaults
from services.common.cost_fit import (
    DecodeSample,
    FittedCostModel,
    PrefillSample,
    fit_cost_model,
)
from services.common.cost_model import CostModel
from services.common.hashing import num_blocks
from services.common.kv_layout import KVLayout
from services.common.model_spec import DEFAULT_MODEL_DIR, ModelSpec

Now = Callable[[], float]
DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096)
DEFAULT_FRACTIONS = (0.0, 0.25, 0.5, 0.75)
FIRST_TOKEN_ID = 3  # skip pad/bos/eos


def default_grid(
    block_size: int,
    max_len: int,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
) -> list[tuple[int, int]]:
    """(n, p) pairs: each length (capped below ``max_len``) with each prefix fraction,
    p rounded down to whole blocks (only whole blocks are ever reused)."""
    out: list[tuple[int, int]] = []
    for n in lengths:
        n = min(n, max_len - 1)
        for f in fractions:
            p = int(n * f) // block_size * block_size
            if (n, p) not in out and 0 < n and p < n:
                out.append((n, p))
    return out


def random_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(n)]


# --------------------------------------------------------------------- in-process


def _slots(layout: KVLayout, n: int) -> list[memoryview]:
    return [
        memoryview(bytearray(layout.block_bytes)) for _ in range(num_blocks(n, layout.block_size))
    ]


async def profile_engine(
    engine,
    layout: KVLayout,
    grid: Sequence[tuple[int, int]],
    *,
    now: Now = time.perf_counter,
    seed: int = 0,
    repeats: int = 1,
) -> list[PrefillSample]:
    """Time ``engine.prefill`` for every (n, p) of ``grid``. The prefix KV is produced by
    an untimed prefill of the first p tokens into the same slots."""
    from bus_schemas.requests import SamplingParams
    from services.engine import PrefillJob, SlotKV

    rng = random.Random(seed)
    samples: list[PrefillSample] = []
    for k, (n, p) in enumerate([g for g in grid for _ in range(repeats)]):
        ids = random_prompt(rng, n, layout.spec.vocab_size)
        slots = _slots(layout, n)
        sampling = SamplingParams(max_tokens=1)
        if p > 0:
            warm = PrefillJob(f"profile-{k}-warm", ids[:p], 0, sampling, SlotKV(layout, slots, p))
            await engine.prefill(warm)
        job = PrefillJob(f"profile-{k}", ids, p, sampling, SlotKV(layout, slots, n))
        t0 = now()
        await engine.prefill(job)
        samples.append(PrefillSample(n, p, now() - t0))
    return samples


async def profile_decode_engine(
    engine,
    layout: KVLayout,
    batches: Sequence[int] = (1, 4, 16),
    lengths: Sequence[int] = (128, 512),
    *,
    steps: int = 8,
    now: Now = time.perf_counter,
    seed: int = 1,
) -> list[DecodeSample]:
    """Mean decode step time for ``batch`` requests of ``length`` prompt tokens each:
    once the whole batch runs, time ``steps`` tokens of one stream. The context grows by
    ``batch`` per step, so the sample's context is the mean over those steps."""
    from bus_schemas.requests import SamplingParams
    from services.engine import DecodeJob, PrefillJob, SlotKV

    rng = random.Random(seed)
    out: list[DecodeSample] = []
    for b in batches:
        for length in lengths:
            sampling = SamplingParams(max_tokens=steps * 4 + 64, ignore_eos=True)
            ready = []
            for i in range(b):  # prefill them all first, so the batch forms at once
                ids = random_prompt(rng, length, layout.spec.vocab_size)
                kv = SlotKV(layout, _slots(layout, length), length)
                rid = f"dec-{b}-{length}-{i}"
                ready.append(
                    (rid, ids, await engine.prefill(PrefillJob(rid, ids, 0, sampling, kv)), kv)
                )
            streams = [
                await engine.add_request(DecodeJob(rid, ids, first, sampling, kv))
                for rid, ids, first, kv in ready
            ]
            watch = streams[0]
            t0 = ctx0 = None
            seen = 0
            try:
                async for _ in watch:
                    if t0 is None:
                        st = engine.stats()
                        if st.batch_size == b and st.waiting == 0:
                            t0, ctx0 = now(), st.kv_tokens
                        continue
                    seen += 1
                    if seen == steps:
                        dt = now() - t0
                        out.append(DecodeSample(b, ctx0 + b * (steps - 1) / 2, dt / steps))
                        break
            finally:
                for s in streams:
                    engine.abort(s.request_id)
            if seen < steps:
                raise RuntimeError(f"batch {b} x {length}: the stream ended before {steps} steps")
    return out


# --------------------------------------------------------------------- live stacks


@dataclass
class ProfileOutcome:
    """One profiled request: its seconds and cached tokens, or its error."""

    seconds: float
    cached_tokens: int
    error: str = ""


class BusTarget:
    """A running stack over NATS: the request path a gateway uses."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, now: Now = time.perf_counter) -> None:
        self.url, self.timeout_s, self.now = url, timeout_s, now
        self.nc = None

    async def __aenter__(self) -> "BusTarget":
        import nats

        self.nc = await nats.connect(self.url)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def generate(self, ids: list[int]) -> ProfileOutcome:
        from bus_schemas import subjects
        from bus_schemas.codec import encode
        from bus_schemas.requests import (
            Accepted,
            Error,
            Finished,
            GenerateRequest,
            SamplingParams,
            Tokens,
            stream_event_decoder,
        )

        dec = stream_event_decoder()
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        req = GenerateRequest(
            request_id=f"profile-{uuid.uuid4().hex[:12]}",
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=1, ignore_eos=True),
            reply_subject=inbox,
        )
        cached, first = 0, None
        try:
            t0 = self.now()
            await self.nc.publish(subjects.REQUESTS, encode(req), reply=inbox)
            while True:
                ev = dec.decode((await sub.next_msg(timeout=self.timeout_s)).data)
                if isinstance(ev, Accepted):
                    cached = ev.cached_tokens
                elif isinstance(ev, Tokens) and first is None:
                    first = self.now() - t0
                elif isinstance(ev, Error):
                    return ProfileOutcome(0.0, 0, f"{int(ev.code)} {ev.message}")
                elif isinstance(ev, Finished):
                    return ProfileOutcome(first if first is not None else self.now() - t0, cached)
        finally:
            await sub.unsubscribe()


class HttpTarget:
    """A running stack over the gateway's OpenAI API (prompt as token ids)."""

    def __init__(self, url: str, *, timeout_s: float = 60.0, now: Now = time.perf_counter) -> None:
        self.url, self.timeout_s, self.now = url.rstrip("/"), timeout_s, now
        self.session = None

    async def __aenter__(self) -> "HttpTarget":
        import aiohttp

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.close()

    async def generate(self, ids: list[int]) -> ProfileOutcome:
        body = {"prompt": ids, "max_tokens": 1, "ignore_eos": True}
        t0 = self.now()
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            data = await r.json(content_type=None)
            dt = self.now() - t0
        if r.status != 200:
            return ProfileOutcome(0.0, 0, f"HTTP {r.status}: {data}")
        cached = data.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return ProfileOutcome(dt, int(cached or 0))


async def profile_live(
    target,
    grid: Sequence[tuple[int, int]],
    vocab: int,
    *,
    seed: int = 0,
    repeats: int = 1,
    warm_attempts: int = 20,
    pause: Callable[[float], Awaitable[object]] = asyncio.sleep,
    log: Callable[[str], None] = lambda _: None,
) -> list[PrefillSample]:
    """One request at a time through ``target.generate``. For p > 0 the prefix is sent
    until the stack reports it cached (its blocks committed), then the whole prompt;
    the sample's p is what the stack reported reusing."""
    rng = random.Random(seed)
    samples: list[PrefillSample] = []
    for n, p in [g for g in grid for _ in range(repeats)]:
        ids = random_prompt(rng, n, vocab)
        if p > 0:
            for attempt in range(warm_attempts):
                warm = await target.generate(ids[:p])
                if warm.error:
                    log(f"warm-up of p={p} failed: {warm.error}")
                elif warm.cached_tokens >= p:
                    break
                await pause(0.02 * (attempt + 1))  # the commit follows the first token
        got = await target.generate(ids)
        if got.error:
            log(f"n={n} p={p}: {got.error}; sample skipped")
            continue
        samples.append(PrefillSample(n, got.cached_tokens, got.seconds))
        log(f"n={n} p={got.cached_tokens} (asked {p}): {got.seconds * 1e3:.2f} ms")
    return samples


# --------------------------------------------------------------------- CLI


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="perigee profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--nats", help="profile a running stack over this NATS server")
    where.add_argument("--url", help="profile a running stack through this gateway URL")
    ap.add_argument("--engine", default="mock", help="in-process engine kind (no --nats/--url)")
    ap.add_argument("--json", required=True, help="write the fitted cost model here")
    ap.add_argument("--samples-json", help="also write the raw samples here")
    ap.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE)
    ap.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        help="the profiled engine's speedup (in-process: the mock runs at it; live: "
        "give the stack's --speedup); recorded as fitted_speedup",
    )
    ap.add_argument(
        "--lengths",
        type=_ints,
        default=list(DEFAULT_LENGTHS),
        help="prompt lengths, comma separated",
    )
    ap.add_argument(
        "--fractions",
        type=_floats,
        default=list(DEFAULT_FRACTIONS),
        help="prefix hit fractions of each length, comma separated",
    )
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--degree", type=int, default=2, help="polynomial degree in (n, p)")
    ap.add_argument(
        "--decode",
        action="store_true",
        help="in-process only: fit decode step time on (batch, context) too",
    )
    ap.add_argument(
        "--seed",
        type=int,
        default=None,
        help="prompt RNG seed (default: fresh, so a rerun against the same stack "
        "does not hit the previous run's cache)",
    )
    ap.add_argument("--timeout", type=float, default=60.0, help="per request, seconds (live)")
    return ap.parse_args(argv)


async def run(args: argparse.Namespace) -> FittedCostModel:
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    spec = ModelSpec.from_dir(args.model_dir)
    layout = KVLayout(spec, args.block_size)
    grid = default_grid(args.block_size, spec.max_model_len, args.lengths, args.fractions)
    say = lambda s: print(f"perigee profile: {s}", file=sys.stderr, flush=True)  # noqa: E731
    decode: list[DecodeSample] = []
    if args.nats or args.url:
        target = (
            BusTarget(args.nats, timeout_s=args.timeout)
            if args.nats
            else HttpTarget(args.url, timeout_s=args.timeout)
        )
        async with target:
            prefill = await profile_live(
                target, grid, spec.vocab_size, seed=args.seed, repeats=args.repeats, log=say
            )
        source = f"nats {args.nats}" if args.nats else f"gateway {args.url}"
    else:
        from services.engine import make_engine

        engine = make_engine(args.engine, spec, CostModel(speedup=args.speedup))
        await engine.start()
        try:
            prefill = await profile_engine(
                engine, layout, grid, seed=args.seed, repeats=args.repeats
            )
            if args.decode:
                decode = await profile_decode_engine(engine, layout)
        finally:
            await engine.stop()
        source = f"in-process {args.engine} engine"
    if args.samples_json:
        Path(args.samples_json).write_text(
            json.dumps(
                {
                    "prefill": [[s.n, s.p, s.seconds] for s in prefill],
                    "decode": [[s.batch, s.context, s.seconds] for s in decode],
                },
                indent=1,
            )
            + "\n"
        )
    model = fit_cost_model(
        prefill,
        decode,
        degree=args.degree,
        fitted_speedup=args.speedup,
        meta={
            "source": source,
            "model": spec.name,
            "seed": args.seed,
            "block_size": args.block_size,
            "created": time.time(),
        },
    )
    model.save(args.json)
    stats = model.meta["prefill_fit"]
    say(
        f"{len(prefill)} prefill samples, rmse {stats['rmse_s'] * 1e3:.3f} ms, "
        f"max rel err {stats['max_rel_err']:.3g}; wrote {args.json}"
    )
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        asyncio.run(run(args))
    except ValueError as e:  # too few / degenerate samples
        print(f"perigee profile: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
