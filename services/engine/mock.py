"""MockEngine: the paper's cost model for time, deterministic synthetic outputs for data.

Prefill sleeps ``cost.prefill_time(n, prefix)`` split evenly over the layers; after
each layer it has *read and verified* the prefix KV from the slots (a mismatch is an
:class:`EngineError` "kv mismatch") and *written* the suffix KV, then awaits
``job.on_layer(layer)``. Decode is one asyncio task running continuous batching:

    WaitingQueue --(step boundary, batch < max_batch)--> RunningBatch --> finished

each step sleeps ``cost.decode_step_time(batch, context tokens)`` and then gives one
token to every running request. Tokens and KV come from :mod:`services.engine.synth`,
so a disaggregated run produces exactly the tokens of one process computing
everything from scratch. With ``speedup = inf`` nothing sleeps: a prefill's layers
run back to back (yielding every ``UNPACED_SLICE_S``), every decode step yields.
"""

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog

from services.common.clock import SleepFn
from services.common.cost_model import CostModel
from services.common.model_spec import ModelSpec
from services.common.tasks import cancel_and_wait
from services.engine import synth
from services.engine.base import (
    DecodeJob,
    Engine,
    EngineDeadError,
    EngineError,
    EngineStats,
    KVAccess,
    PrefillJob,
    RequestStream,
)

log = structlog.get_logger()


# Above this many KV elements per layer the numpy work runs in a thread, so a long
# prompt does not stall the event loop (ships, load reports, the decode loop).
THREAD_ELEMENTS = 1 << 18
# Up to this many KV elements over all layers, a prompt's KV is made in one go (numpy's
# cost per call is what a short prompt pays: 22 against 62 us for 9 tokens, 4 layers of
# 128); above it, layer by layer (a bigger array no longer fits the caches: slower).
ALL_LAYERS_ELEMENTS = 1 << 15


@dataclass
class _Req:
    job: DecodeJob
    stream: RequestStream
    h: int  # rolling hash of prompt + generated tokens
    generated: int  # completion tokens so far, the first token included
    context: int  # tokens of context: prompt + generated
    # Write-back (job.on_block): rolling hashes of the positions of the block filling
    # now, which is block ``wb_block``.
    wb_hashes: list[int] | None = None
    wb_block: int = 0


# An unpaced prefill (zero compute) yields to the event loop at most this often.
UNPACED_SLICE_S = 0.002


class MockEngine(Engine):
    """An engine timed by the cost model that writes and checks real-sized synthetic KV."""

    def __init__(
        self,
        spec: ModelSpec,
        cost: CostModel,
        *,
        max_batch: int = 128,
        sleep: SleepFn | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.spec = spec
        self.cost = cost
        self.max_batch = max_batch
        self._sleep = sleep or asyncio.sleep
        # Pacing is by deadline: the cost model's time includes the mock's own numpy work,
        # so a prefill takes cost.prefill_time of wall time, not that plus the bookkeeping.
        # A test that injects ``sleep`` alone gets virtual time that moves only by what
        # was slept, so the requested durations stay exact.
        self._virtual = clock is None and sleep is not None
        self._vt = 0.0
        self._now = clock or ((lambda: self._vt) if self._virtual else time.monotonic)
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_id: dict[str, _Req] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._dead: EngineDeadError | None = None
        self.steps = 0

    # -- lifecycle --
    async def start(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._decode_loop(), name="mock-decode-loop")

    async def stop(self) -> None:
        self._kill(EngineDeadError("engine stopped"))
        task, self._loop_task = self._loop_task, None
        if task is not None:
            await cancel_and_wait([task])

    def _kill(self, err: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = err
        for r in list(self._by_id.values()):
            r.stream.fail(err)
        self._by_id.clear()
        self._waiting.clear()
        self._running.clear()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    async def _pause(self, seconds: float) -> None:
        if seconds > 0:
            await self._sleep(seconds)
            if self._virtual:
                self._vt += seconds
        else:
            await asyncio.sleep(0)

    async def _pace(self, nominal: float, deadline: float) -> None:
        """Sleep until ``deadline`` (``nominal`` seconds after its start, as the cost
        model says); under virtual time exactly ``nominal``."""
        await self._pause(nominal if self._virtual else deadline - self._now())

    # -- prefill --
    async def prefill(self, job: PrefillJob) -> int:
        self._check_alive()
        prompt = np.asarray(job.prompt_token_ids, dtype=np.int64)
        n, p = len(prompt), job.prefix_tokens
        if n == 0:
            raise EngineError("empty prompt")
        if not 0 <= p <= n:
            raise EngineError(f"prefix_tokens {p} outside [0, {n}]")
        if n > self.spec.max_model_len:
            raise EngineError(
                f"prompt of {n} tokens exceeds max_model_len {self.spec.max_model_len}"
            )
        if job.kv.num_tokens < n:
            raise EngineError(f"kv holds {job.kv.num_tokens} positions, prompt has {n}")
        hashes = synth.prefix_hashes(prompt)
        per_layer = self.cost.prefill_time(n, p) / self.spec.num_layers if job.paced else 0.0
        big = n * job.kv.layout.row * 2 >= THREAD_ELEMENTS
        every = self._expected_all(job.kv, hashes) if self._all_at_once(job.kv, n) else None
        start = yielded = self._now()
        for layer in range(self.spec.num_layers):
            if big:
                await asyncio.to_thread(self._prefill_layer, job.kv, hashes, layer, p)
            else:
                self._prefill_layer(job.kv, hashes, layer, p, every)
            if per_layer > 0:
                await self._pace(per_layer, start + (layer + 1) * per_layer)
            elif self._now() - yielded >= UNPACED_SLICE_S:
                # Unpaced, the layers run back to back as in one forward pass of a real
                # engine (its connector sees every layer before the loop runs again),
                # yielding only as often as keeps this process answering.
                await asyncio.sleep(0)
                yielded = self._now()
            self._check_alive()
            if job.on_layer is not None:
                await job.on_layer(layer)
        return synth.next_token(int(hashes[-1]), self.spec.vocab_size, self.spec.eos_token_id)

    def _expected(self, kv: KVAccess, hashes: np.ndarray, layer: int) -> np.ndarray:
        return synth.layer_kv(hashes, layer, kv.layout.row, kv.layout.dtype)

    def _all_at_once(self, kv: KVAccess, n: int) -> bool:
        return n * kv.layout.row * 2 * self.spec.num_layers <= ALL_LAYERS_ELEMENTS

    def _expected_all(self, kv: KVAccess, hashes: np.ndarray) -> np.ndarray:
        return synth.layers_kv(hashes, self.spec.num_layers, kv.layout.row, kv.layout.dtype)

    def _verify(
        self,
        kv: KVAccess,
        hashes: np.ndarray,
        layer: int,
        end: int,
        every: np.ndarray | None = None,
    ) -> None:
        """``every``: the KV of all layers at ``hashes``' positions (``_expected_all``)."""
        if end == 0:
            return
        got = kv.read(layer, 0, end)
        want = (
            every[layer][:, :end] if every is not None else self._expected(kv, hashes[:end], layer)
        )
        bad = synth.first_mismatch(got, want)
        if bad is not None:
            raise EngineError(f"kv mismatch: layer {layer}, token {bad} of {end} loaded")

    def _prefill_layer(
        self,
        kv: KVAccess,
        hashes: np.ndarray,
        layer: int,
        prefix: int,
        every: np.ndarray | None = None,
    ) -> None:
        self._verify(kv, hashes, layer, prefix, every)
        if prefix < len(hashes):
            want = (
                every[layer][:, prefix:]
                if every is not None
                else self._expected(kv, hashes[prefix:], layer)
            )
            kv.write(layer, prefix, want)

    # -- decode --
    async def add_request(self, job: DecodeJob) -> RequestStream:
        self._check_alive()
        if self._loop_task is None:
            raise EngineDeadError("engine not started")
        rid = job.request_id
        if rid in self._by_id:
            raise EngineError(f"request {rid} is already decoding")
        prompt = np.asarray(job.prompt_token_ids, dtype=np.int64)
        n = len(prompt)
        if n == 0:
            raise EngineError("empty prompt")
        if job.kv.num_tokens < n:
            raise EngineError(f"kv holds {job.kv.num_tokens} positions, prompt has {n}")
        first = job.first_token
        if first is not None and not 0 <= first < self.spec.vocab_size:
            raise EngineError(f"first token {first} outside the vocabulary")
        hashes = synth.prefix_hashes(prompt)
        if n * job.kv.layout.row * 2 >= THREAD_ELEMENTS:
            await asyncio.to_thread(self._verify_all, job.kv, hashes, n)
        else:
            self._verify_all(job.kv, hashes, n)
        self._check_alive()
        if rid in self._by_id:
            raise EngineError(f"request {rid} is already decoding")
        if first is None:
            # Sequence seq > 0 of n: its own first token, the prompt's hash salted with
            # the sequence (the mock ignores seeds), pushed as the stream's first token.
            first = synth.next_token(
                synth.extend_hash(int(hashes[-1]), self.spec.vocab_size + job.seq),
                self.spec.vocab_size,
                self.spec.eos_token_id,
            )
        h = synth.extend_hash(int(hashes[-1]), first)
        req = _Req(job=job, stream=RequestStream(rid), h=h, generated=1, context=n + 1)
        if job.first_token is None:
            req.stream.push(first)
        if job.on_block is not None:
            bs = job.kv.layout.block_size
            req.wb_block = n // bs
            req.wb_hashes = [int(x) for x in hashes[req.wb_block * bs :]] + [h]
        reason = self._finish_reason(req, first)
        if reason is not None:
            req.stream.finish(reason)
            return req.stream
        self._by_id[rid] = req
        self._waiting.append(req)
        self._wake.set()
        return req.stream

    def _verify_all(self, kv: KVAccess, hashes: np.ndarray, n: int) -> None:
        every = self._expected_all(kv, hashes[:n]) if self._all_at_once(kv, n) else None
        for layer in range(self.spec.num_layers):
            self._verify(kv, hashes, layer, n, every)

    def _finish_reason(self, req: _Req, token: int) -> str | None:
        s = req.job.sampling
        if token in s.stop_token_ids:
            return "stop"
        if not s.ignore_eos and token == self.spec.eos_token_id:
            return "stop"
        if req.generated >= s.max_tokens or req.context >= self.spec.max_model_len:
            return "length"
        return None

    def abort(self, request_id: str) -> bool:
        req = self._by_id.pop(request_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        req.stream.finish("abort")
        return True

    def stats(self) -> EngineStats:
        kv_tokens = sum(r.context for r in self._running)
        return EngineStats(
            batch_size=len(self._running),
            waiting=len(self._waiting),
            kv_tokens=kv_tokens,
            step_time_s=self.cost.decode_step_time(len(self._running), kv_tokens),
        )

    async def _decode_loop(self) -> None:
        last_deadline: float | None = None
        try:
            while True:
                while self._waiting and len(self._running) < self.max_batch:
                    self._running.append(self._waiting.popleft())
                if not self._running:
                    last_deadline = None
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch = list(self._running)
                context = sum(r.context for r in batch)
                step = self.cost.decode_step_time(len(batch), context)
                # Back-to-back steps are paced from the previous deadline, so the token
                # bookkeeping between them is inside the step time, not added to it.
                t0 = self._now()
                if last_deadline is not None and t0 - last_deadline < step:
                    t0 = last_deadline
                last_deadline = t0 + step
                await self._pace(step, last_deadline)
                self.steps += 1
                if self.on_decode_step is not None:
                    self.on_decode_step(len(batch), context, self._now() - t0)
                for req in batch:
                    if self._by_id.get(req.job.request_id) is not req:
                        continue  # aborted during the step
                    self._step(req)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a loop bug kills the engine, loudly
            log.exception("decode_loop_crashed")
            self._kill(EngineDeadError(f"decode loop crashed: {type(e).__name__}: {e}"))

    def _step(self, req: _Req) -> None:
        tok = synth.next_token(req.h, self.spec.vocab_size, self.spec.eos_token_id)
        req.h = synth.extend_hash(req.h, tok)
        req.generated += 1
        req.context += 1
        if req.wb_hashes is not None:
            self._write_back(req)
        req.stream.push(tok)
        reason = self._finish_reason(req, tok)
        if reason is not None:
            del self._by_id[req.job.request_id]
            self._running.remove(req)
            req.stream.finish(reason)

    def _write_back(self, req: _Req) -> None:
        """After a step: the token fed to it now has KV, the one it sampled has none
        (as in a real engine). A block whose positions all have KV goes out."""
        assert req.wb_hashes is not None and req.job.on_block is not None
        req.wb_hashes.append(req.h)  # the sampled token's position
        layout = req.job.kv.layout
        bs = layout.block_size
        if len(req.wb_hashes) - 1 < bs:
            return
        buf = memoryview(bytearray(layout.block_bytes))
        hashes = np.asarray(req.wb_hashes[:bs], dtype=np.uint64)
        for layer in range(self.spec.num_layers):
            kv = synth.layer_kv(hashes, layer, layout.row, layout.dtype)
            layout.write_tokens([buf], layer, 0, kv)
        req.job.on_block(req.wb_block, buf)
        req.wb_block += 1
        req.wb_hashes = req.wb_hashes[bs:]
