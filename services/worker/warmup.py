"""The calibration warm-up a worker runs on its engine before its first load report
(the gateway's /ready waits for those, so a stack is ready only once calibrated):
a few prefills of mixed lengths, one with a reused prefix, and, on a decode
instance, a few requests decoded side by side so the batch size varies. Everything
runs through the Engine interface on private buffers (no store, no bus); what the
engine measures goes to the instance's :class:`~services.common.calibrator.Calibrator`.
"""

import asyncio
import time

import structlog

from bus_schemas.requests import SamplingParams
from bus_schemas.roles import Role
from services.common.calibrator import Calibrator
from services.common.hashing import num_blocks
from services.common.kv_layout import KVLayout
from services.engine import (
    DecodeJob,
    Engine,
    EngineDeadError,
    EngineError,
    PrefillJob,
    SlotKV,
)

log = structlog.get_logger()

# Prompt lengths in the order they run: short and long alternate, so even a short
# warm-up spans the range (capped below the engine's max_model_len).
LENGTHS = (64, 1536, 256, 3072, 128, 768, 2048, 512)
DECODE_LENGTHS = (64, 256, 128, 512)
# Three coefficients need three lengths: the budget cuts the warm-up only after these
# (with two, a loaded CPU's fit put 90 % of a 3k-token prefill on the quadratic term).
MIN_PREFILLS = 3
LONG_DECODE = 2048  # decoded alone first (capped below max_model_len)
FIRST_TOKEN_ID = 3  # skip pad/bos/eos


def _prompt(k: int, n: int, vocab: int) -> list[int]:
    span = max(vocab - FIRST_TOKEN_ID, 1)
    return [FIRST_TOKEN_ID + (7919 * k + 104729 * i + i * i) % span for i in range(n)]


def _slots(layout: KVLayout, n: int) -> list[memoryview]:
    return [
        memoryview(bytearray(layout.block_bytes)) for _ in range(num_blocks(n, layout.block_size))
    ]


def max_prompt(engine: Engine) -> int:
    return int(getattr(engine, "max_model_len", 0) or engine.spec.max_model_len) - 2


async def _prefill(
    engine: Engine,
    layout: KVLayout,
    calib: Calibrator | None,
    rid: str,
    prompt: list[int],
    prefix: int,
    slots: list[memoryview],
) -> int:
    job = PrefillJob(
        rid, prompt, prefix, SamplingParams(max_tokens=1), SlotKV(layout, slots, len(prompt))
    )
    t0 = time.perf_counter()
    first = await engine.prefill(job)
    if calib is not None:
        calib.prefill(len(prompt), prefix, time.perf_counter() - t0)
    return first


async def warm_prefill(
    engine: Engine, layout: KVLayout, calib: Calibrator, count: int, budget_s: float = 10.0
) -> None:
    """``count`` prefills of mixed lengths, then one that reuses half of the longest's KV;
    past the first ``MIN_PREFILLS``, no new prompt starts after ``budget_s`` (a very slow
    engine calibrates on fewer)."""
    vocab, cap, bs = engine.spec.vocab_size, max_prompt(engine), layout.block_size
    lengths = list(dict.fromkeys(min(n, cap) for n in LENGTHS[:count]))
    if not lengths or cap < 2 * bs:
        return
    t0 = time.perf_counter()
    kept: tuple[list[int], list[memoryview]] | None = None
    for k, n in enumerate(lengths):
        if k >= MIN_PREFILLS and time.perf_counter() - t0 > budget_s:
            return
        prompt, slots = _prompt(k, n, vocab), _slots(layout, n)
        await _prefill(engine, layout, calib, f"perigee-calibrate-{k}", prompt, 0, slots)
        if kept is None or n > len(kept[0]):
            kept = (prompt, slots)
    if kept is None:  # no lengths to run
        return
    prompt, slots = kept
    p = (len(prompt) // 2) // bs * bs
    n = min(cap, len(prompt) + 256)
    if p > 0:
        longer = prompt + _prompt(len(lengths), n - len(prompt), vocab)
        more = _slots(layout, n)[len(slots) :]
        await _prefill(engine, layout, calib, "perigee-calibrate-prefix", longer, p, slots + more)


async def _decode_job(engine: Engine, layout: KVLayout, k: int, n: int, steps: int) -> DecodeJob:
    """A private prompt of ``n`` tokens prefilled, to decode ``steps`` tokens."""
    prompt, slots = _prompt(100 + k, n, engine.spec.vocab_size), _slots(layout, n)
    first = await _prefill(engine, layout, None, f"perigee-calibrate-d{k}", prompt, 0, slots)
    return DecodeJob(
        f"perigee-calibrate-d{k}",
        prompt,
        first,
        SamplingParams(max_tokens=steps, ignore_eos=True),
        SlotKV(layout, slots, n),
    )


async def _decode_together(engine: Engine, jobs: list[DecodeJob]) -> None:
    for s in await asyncio.gather(*(engine.add_request(j) for j in jobs)):
        async for _ in s:
            pass


async def warm_decode(engine: Engine, layout: KVLayout, count: int, steps: int = 6) -> None:
    """One long request decoded alone, then ``count`` short ones decoding together,
    finishing one after another (batch ``count`` down to 1); the engine reports each
    step to the calibrator.

    The long one alone is what separates the two slopes of the fit: in the batch the
    context shrinks with the batch size, so the fit cannot tell a step's cost per
    sequence from its cost per context token, and it put it all on the context (on a
    CPU: 1.4 s predicted for a 3k-token request alone, 0.24 s measured)."""
    cap = max_prompt(engine)
    long = min(LONG_DECODE, cap)
    if long > max(DECODE_LENGTHS):
        await _decode_together(engine, [await _decode_job(engine, layout, 99, long, steps)])
    jobs = [
        await _decode_job(engine, layout, k, min(n, cap), steps + 4 * k)
        for k, n in enumerate(DECODE_LENGTHS[:count])
    ]
    await _decode_together(engine, jobs)


async def warm_up(
    engine: Engine, layout: KVLayout, calib: Calibrator, roles: tuple[str, ...], count: int
) -> None:
    """Calibrate ``engine`` for ``roles`` with ``count`` prefills (and, for decode,
    ``min(count, 4)`` requests decoded side by side). 0: nothing."""
    if count <= 0:
        return
    t0 = time.perf_counter()
    if Role.PREFILL in roles:
        await warm_prefill(engine, layout, calib, count)
    if Role.DECODE in roles:
        await warm_decode(engine, layout, min(count, len(DECODE_LENGTHS)))
    f = calib.fit
    log.info(
        "calibrated",
        roles=list(roles),
        seconds=round(time.perf_counter() - t0, 3),
        prefill_samples=f.prefill_samples,
        decode_samples=f.decode_samples,
        prefill_coef=[float(f"{c:.4g}") for c in f.prefill_coef()],
        decode_coef=[float(f"{c:.4g}") for c in f.decode_coef()],
    )


async def calibrate(
    engine: Engine,
    layout: KVLayout,
    calib: Calibrator,
    roles: tuple[str, ...],
    count: int,
    stop: asyncio.Event,
) -> bool:
    """:func:`warm_up`, unless ``stop`` is set first (then False, the warm-up cancelled).
    A request the engine refuses leaves the fit as far as it got (logged); a dead
    engine raises."""
    task = asyncio.ensure_future(warm_up(engine, layout, calib, roles, count))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    err = task.exception()
    if isinstance(err, EngineError) and not isinstance(err, EngineDeadError):
        log.warning("calibration_warmup_failed", error=str(err))
    elif err is not None:
        raise err
    return True
