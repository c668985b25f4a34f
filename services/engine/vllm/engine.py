"""VllmEngine: vLLM in-process behind the :class:`~services.engine.base.Engine` interface.

One ``LLMEngine`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, executor "uni") is built and
stepped by one dedicated thread; the event loop talks to it through a command queue
and gets results back with ``call_soon_threadsafe``. The node store is the cache, and
:class:`~.connector.PerigeeConnector` moves KV between the store's shared-memory slots
and vLLM's paged cache. vLLM's own prefix cache is off on prefill; on decode it is on,
each request's prompt salted with the request's id (``DecodeJob.prefix_group``), so
that it serves one thing only: the n sequences of one request share the prompt's
pages, which the first of them loads from the slots.

Request states (event-loop side, ``_active``):

    prefill  add (max_tokens=1, plan: load prefix_tokens from the slots, save the rest,
             on_layer after each layer) -> first token, or the error a layer hand-off
             recorded; cancelled -> abort, and wait until the engine dropped it (its
             slots are not written after prefill() returns)
    decode   add (prompt + first token, plan: load every prompt position; a sequence
             > 0 of n: the prompt, its full blocks shared with the sequence loaded
             before it when vLLM's cache holds them) -> "loaded"
             (add_request returns: the slots are free) -> Tokens as each step makes them
             (and each answer block, copied out as it fills: job.on_block) -> finished
             (stop | length | abort)
    warmup   one small request at start (the first forward is slow)

Engine-thread loop: drain commands (block when vLLM is idle) -> ``step()`` -> post the
outputs. A crash in the thread fails every request with :class:`EngineDeadError`.
"""

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from bus_schemas.requests import PositionLogprobs, SamplingParams
from bus_schemas.roles import ROLES, Role
from services.common.model_spec import ModelSpec
from services.engine.base import (
    DecodeJob,
    Engine,
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EngineStats,
    PrefillJob,
    RequestStream,
)
from services.engine.vllm.args import engine_args, on_cpu, sampling_params
from services.engine.vllm.bridge import Bridge, Plan, register, unregister
from services.engine.vllm.options import VllmOptions, prepare_env

log = structlog.get_logger()

WARMUP_ID = "perigee-warmup"
START_TIMEOUT_S = 600.0
ABORT_TIMEOUT_S = 60.0
STEP_EMA = 0.2
# A step this long is logged (vllm_step_slow). On a GPU the default model's steps take
# milliseconds; the third H200 run's decode engine stood still for 12 s (BENCHMARKS.md,
# "Third GPU run"), which only the spans' gaps showed. On CPU a long prompt's prefill
# step takes seconds by itself.
SLOW_STEP_S = 1.0
SLOW_STEP_CPU_S = 30.0


@dataclass
class _Active:
    kind: str  # "prefill" | "decode" | "warmup"
    fut: asyncio.Future | None = None  # prefill: first token; warmup: tokens
    stream: RequestStream | None = None
    loaded: asyncio.Future | None = None  # decode: KV loaded, or the request is over
    context: int = 0  # decode: prompt + generated tokens
    aborting: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # prefill's first token's
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)


def _positions(per_position: Any) -> list[Any]:
    """vLLM's logprobs (a dict ``token id -> Logprob`` per position, or None) as wire
    data: ``[token id, logprob]`` pairs in vLLM's order, -inf clamped at -9999."""
    return [
        None if d is None else [(t, max(lp.logprob, -9999.0)) for t, lp in d.items()]
        for d in per_position
    ]


def _answer_so_far(s: SamplingParams, prompt: list[int], first: int | None = None) -> list[int]:
    """The tokens of the answer the request's grammar must accept before sampling: after
    a migration those the prompt holds past ``answer_start``; on decode, then the first
    token (prefill's)."""
    so = s.structured
    if so is None:
        return []
    return [*prompt[so.answer_start or len(prompt) :], *(() if first is None else (first,))]


def _generators(engine: Any) -> Callable[[str], Any] | None:
    """vLLM request id -> its seeded sampling generator, from the in-process model
    runner (``uni`` executor); None, with a warning, if this vLLM is laid out otherwise
    (a seeded answer's tokens after the first then differ from one engine's)."""
    try:
        runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        requests = runner.requests
    except AttributeError:
        log.warning("vllm_model_runner_not_found")
        return None

    def generator_of(req_id: str) -> Any:
        state = requests.get(req_id)
        return None if state is None else state.generator

    return generator_of


def _settle(
    fut: asyncio.Future | None, result: Any = None, error: BaseException | None = None
) -> None:
    if fut is None or fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class VllmEngine(Engine):
    """vLLM in-process on its own thread, behind the Engine interface."""

    def __init__(
        self,
        spec: ModelSpec,
        options: VllmOptions,
        *,
        role: str,
        hash_block_size: int,
        block_bytes: int,
        max_batch: int = 128,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be prefill or decode, not {role!r}")
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        prepare_env()
        self.spec = spec
        self.opts = options
        self.role = role
        self.max_batch = max_batch
        self.max_model_len = options.max_model_len or spec.max_model_len
        self.vllm_block_size = options.vllm_block_size(hash_block_size)
        if hash_block_size % self.vllm_block_size:
            raise ValueError(
                f"vLLM block size {self.vllm_block_size} must divide perigee's block size "
                f"{hash_block_size}"
            )
        self.hash_block_size = hash_block_size
        self.bridge = Bridge(block_bytes, hash_block_size)
        self.bridge.pin_arena = options.pin_arena
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "vllm_requests",
                "vllm_steps",
                "vllm_slow_steps",
                "vllm_prompt_tokens_computed",
                "vllm_cached_tokens",
                "vllm_tokens_generated",
            ),
            0,
        )
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._active: dict[str, _Active] = {}
        self._dead: EngineDeadError | None = None
        self._step_ema = 0.0
        self._key = ""
        self.slow_step_s = SLOW_STEP_S  # SLOW_STEP_CPU_S once vLLM says it runs on CPU

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        ready = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="vllm-engine", daemon=True
        )
        self._thread.start()
        try:
            await asyncio.wait_for(ready, START_TIMEOUT_S)
            await self._warm_up()
        except EngineDeadError as e:
            self._dead = e
            raise
        except TimeoutError as e:
            self._dead = EngineDeadError(f"vLLM did not start in {START_TIMEOUT_S:g} s")
            raise self._dead from e

    async def stop(self) -> None:
        self._kill(EngineDeadError("engine stopped"))
        thread, self._thread = self._thread, None
        if thread is not None:
            self._cmds.put(("stop",))
            await asyncio.to_thread(thread.join, 30)

    def counters_snapshot(self) -> dict[str, int]:
        """vLLM-side and connector counters (worker stats merge them in)."""
        return {**self.counters, **self.bridge.counters}

    async def _warm_up(self) -> None:
        fut = self._loop.create_future()
        self._active[WARMUP_ID] = _Active("warmup", fut=fut)
        prompt = [3 + (7 * i) % (self.spec.vocab_size - 3) for i in range(64)]
        self._cmds.put(("add", WARMUP_ID, prompt, self._sampling(SamplingParams(), 2, None)))
        t = time.perf_counter()
        await asyncio.wait_for(fut, START_TIMEOUT_S)
        log.info(
            "vllm_ready",
            role=self.role,
            warmup_s=round(time.perf_counter() - t, 3),
            block_size=self.vllm_block_size,
            max_model_len=self.max_model_len,
            load_format=self.opts.resolved_load_format(),
        )

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            raise EngineDeadError("engine not started")

    def _kill(self, err: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = err
        for a in self._active.values():
            _settle(a.fut, error=err)
            _settle(a.loaded, error=err)
            if a.stream is not None:
                a.stream.fail(err)
        self._active.clear()

    # ------------------------------------------------------------------ prefill

    async def prefill(self, job: PrefillJob) -> int:
        self._check_alive()
        rid, prompt = job.request_id, list(job.prompt_token_ids)
        n, p, hash_block = len(prompt), job.prefix_tokens, self.hash_block_size
        if n == 0:
            raise EngineError("empty prompt")
        if not 0 <= p <= n or (p % hash_block and p != n):
            raise EngineError(f"prefix_tokens {p} must be a multiple of {hash_block} in [0, {n}]")
        if n >= self.max_model_len:
            raise EngineError(
                f"prompt of {n} tokens leaves no room in max_model_len {self.max_model_len}"
            )
        slots = self._slots(job.kv, n)
        if rid in self._active:
            raise EngineError(f"request {rid} is already running")
        s = job.sampling
        # Prompt logprobs need every prompt position computed: nothing is loaded (the
        # cached blocks are still not saved again).
        with_prompt_lps = s.prompt_logprobs is not None
        params = self._request_params(
            prompt, s, 1, rid, min_tokens=min(s.min_tokens, 1), prompt_logprobs=with_prompt_lps
        )
        loop = self._loop
        on_layer: Callable[[int], Any] | None = None
        if job.on_layer is not None:
            hook = job.on_layer

            def on_layer(layer: int) -> Any:  # engine thread
                return asyncio.run_coroutine_threadsafe(hook(layer), loop)

        plan = Plan(
            key=rid,
            slots=slots,
            load_tokens=0 if with_prompt_lps else p,
            save_from=p // hash_block,
            save_tokens=n,
            on_layer=on_layer,
            grammar_prefix=_answer_so_far(s, prompt),
        )
        fut = loop.create_future()
        self.bridge.add(plan)
        a = self._active[rid] = _Active("prefill", fut=fut)
        self._cmds.put(("add", rid, prompt, params))
        try:
            first = await fut
            if s.logprobs is not None:
                job.first_logprobs = a.logprobs[0] if a.logprobs else None
            if with_prompt_lps:
                job.prompt_logprobs = a.prompt_logprobs
            return first
        except asyncio.CancelledError:
            await self._abort_and_wait(rid)
            raise

    async def _abort_and_wait(self, rid: str) -> None:
        """Abort ``rid`` and return once the engine thread dropped it (no slot writes after)."""
        if self._dead is not None or self._thread is None:
            return
        done = self._loop.create_future()
        self._cmds.put(("abort", rid, done))
        try:
            await asyncio.wait_for(asyncio.shield(done), ABORT_TIMEOUT_S)
        except TimeoutError:
            log.warning("vllm_abort_timeout", request_id=rid)

    def _slots(self, kv: Any, n: int) -> list[memoryview]:
        slots = getattr(kv, "slots", None)
        if slots is None:
            raise EngineError("the vllm engine needs the request's store slots (SlotKV)")
        need = -(-n // self.hash_block_size)
        if len(slots) < need:
            raise EngineError(f"{len(slots)} slots for {n} tokens, need {need}")
        for s in slots[:need]:
            if len(s) < self.bridge.block_bytes:
                raise EngineError(f"slot of {len(s)} bytes, blocks are {self.bridge.block_bytes}")
        return list(slots[:need])

    # ------------------------------------------------------------------ decode

    async def add_request(self, job: DecodeJob) -> RequestStream:
        self._check_alive()
        rid, prompt = job.request_id, list(job.prompt_token_ids)
        n, first = len(prompt), job.first_token
        if n == 0:
            raise EngineError("empty prompt")
        if first is not None and not 0 <= first < self.spec.vocab_size:
            raise EngineError(f"first token {first} outside the vocabulary")
        if rid in self._active:
            raise EngineError(f"request {rid} is already decoding")
        slots = self._slots(job.kv, n)
        # No first token (a sequence > 0 of n): vLLM samples it here, after the prompt's
        # last position, whose KV it computes again: the whole budget, and a fresh
        # generator of the sequence's seed as vLLM's own parallel sampling has it. The
        # prompt's full blocks are the pages of the group's sequence added before this
        # one (vLLM's prefix cache), the partial block after them is computed again;
        # should the cache lack them, they are loaded from the slots.
        own = 0 if first is None else 1
        params = self._request_params(
            prompt,
            job.sampling,
            max(job.sampling.max_tokens - own, 1),
            rid,
            min_tokens=max(job.sampling.min_tokens - own, 0),  # the first token counts
        )
        stream = RequestStream(rid)
        reason = None if first is None else self._first_token_finish(job.sampling, first, n + 1)
        if reason is not None:
            stream.finish(reason)
            return stream
        loop = self._loop
        loaded = loop.create_future()
        a = _Active("decode", stream=stream, loaded=loaded, context=n + own)

        def on_loaded() -> None:  # engine thread
            loop.call_soon_threadsafe(_settle, loaded)

        plan = Plan(
            key=rid,
            slots=slots,
            load_tokens=n - 1 + own,
            on_loaded=on_loaded,
            grammar_prefix=_answer_so_far(job.sampling, prompt, first),
            # prefill drew the first token from the seed's generator: decode goes on
            # from the second draw (no first token: it draws its own first)
            skip_draws=own,
            shared_prefix=first is None,
        )
        if job.on_block is not None:
            sink = job.on_block
            plan.writeback_from = n // self.hash_block_size

            def on_block(j: int, data: memoryview) -> None:  # engine thread
                loop.call_soon_threadsafe(sink, j, data)

            plan.on_block = on_block
        self.bridge.add(plan)
        self._active[rid] = a
        salt = job.prefix_group or rid
        self._cmds.put(("add", rid, prompt if first is None else [*prompt, first], params, salt))
        try:
            await loaded
        except asyncio.CancelledError:
            await self._abort_and_wait(rid)
            raise
        if plan.error is not None:
            # A connector hook failed, the load perhaps (the engine drops the request):
            # raised here, so that no other sequence of the request is added to share
            # the pages it left.
            raise EngineError(f"{type(plan.error).__name__}: {plan.error}")
        return stream

    def _sampling(self, s: SamplingParams, max_tokens: int, key: str | None, **role: Any) -> Any:
        return sampling_params(
            s, max_tokens, key, self.spec.eos_token_id, self.spec.vocab_size, **role
        )

    def _request_params(
        self, prompt: list[int], s: SamplingParams, max_tokens: int, key: str, **role: Any
    ) -> Any:
        """vLLM's SamplingParams for one request, or :class:`EngineError`: a value that
        would fail inside ``step()`` (a token id off the embedding table, a seed beyond
        64 bits) takes the whole engine down, so nothing reaches it unchecked, whoever
        sent the task."""
        v = self.spec.vocab_size
        bad = next((t for t in prompt if not 0 <= t < v), None)
        if bad is not None:
            raise EngineError(f"prompt token id {bad} is outside the vocabulary [0, {v})")
        problem = s.problem()
        if problem is not None:
            raise EngineError(f"bad sampling parameters: {problem[1]}")
        bad = next((t for t in s.token_ids_used() if not 0 <= t < v), None)
        if bad is not None:
            raise EngineError(f"sampling token id {bad} is outside the vocabulary [0, {v})")
        try:
            return self._sampling(s, max_tokens, key, **role)
        except Exception as e:  # noqa: BLE001 - vLLM's own checks: this request only
            raise EngineRequestError(f"vLLM refused the sampling parameters: {e}") from None

    def _first_token_finish(self, s: SamplingParams, token: int, context: int) -> str | None:
        if token in s.stop_token_ids or (not s.ignore_eos and token == self.spec.eos_token_id):
            return "stop"
        if s.max_tokens <= 1 or context >= self.max_model_len:
            return "length"
        return None

    def abort(self, request_id: str) -> bool:
        a = self._active.get(request_id)
        if a is None or a.kind == "warmup":
            return False
        if not a.aborting and self._thread is not None:
            a.aborting = True
            self._cmds.put(("abort", request_id, None))
        return True

    def stats(self) -> EngineStats:
        dec = [a for a in self._active.values() if a.kind == "decode"]
        running = [a for a in dec if a.loaded is not None and a.loaded.done()]
        batch = min(len(running), self.max_batch)
        return EngineStats(
            batch_size=batch,
            waiting=len(dec) - batch,
            kv_tokens=sum(a.context for a in running),
            step_time_s=self._step_ema,
        )

    # ------------------------------------------------------------------ engine thread

    def _post(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the process is exiting
            pass

    def _main(self, ready: asyncio.Future) -> None:
        self._key = register(self.bridge)
        try:
            from vllm.v1.engine.llm_engine import LLMEngine

            engine = LLMEngine.from_engine_args(
                engine_args(
                    self.opts,
                    role=self.role,
                    dtype=self.opts.dtype or self.spec.dtype,
                    block_size=self.vllm_block_size,
                    max_model_len=self.max_model_len,
                    max_batch=self.max_batch,
                    registry_key=self._key,
                )
            )
        except BaseException as e:  # noqa: BLE001 - reported to start()
            log.exception("vllm_start_failed")
            unregister(self._key)
            self._post(
                _settle,
                ready,
                None,
                EngineDeadError(f"vLLM failed to start: {type(e).__name__}: {e}"),
            )
            return
        self.bridge.generator_of = _generators(engine)
        if on_cpu():
            self.slow_step_s = SLOW_STEP_CPU_S
        self.bridge.vocab_size = self.spec.vocab_size
        self._post(_settle, ready, None)
        try:
            self._serve(engine)
        except BaseException as e:  # noqa: BLE001 - the engine is gone; say so
            log.exception("vllm_engine_crashed")
            self._post(self._kill, EngineDeadError(f"vLLM engine crashed: {type(e).__name__}: {e}"))
        finally:
            unregister(self._key)
            self._shutdown(engine)

    @staticmethod
    def _shutdown(engine: Any) -> None:
        """Release vLLM's engine core and process group here: left to interpreter exit,
        their teardown takes seconds."""
        try:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            engine.engine_core.shutdown()
            cleanup_dist_env_and_memory()
        except Exception:  # noqa: BLE001 - best effort on the way out
            log.warning("vllm_shutdown_failed", exc_info=True)

    def _serve(self, engine: Any) -> None:
        from vllm.inputs import TokensPrompt

        while True:
            cmds = [] if engine.has_unfinished_requests() else [self._cmds.get()]
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd[0] == "stop":
                    return
                if cmd[0] == "add":
                    _, rid, prompt, params, *salt = cmd  # salt: decode's prefix cache
                    inputs = TokensPrompt(prompt_token_ids=prompt)
                    if salt:
                        inputs["cache_salt"] = salt[0]
                    try:
                        engine.add_request(rid, inputs, params)
                    except Exception as e:  # noqa: BLE001 - one bad request
                        self.bridge.drop(rid)
                        self._post(
                            self._on_failed, rid, EngineRequestError(f"vLLM refused it: {e}")
                        )
                else:  # abort
                    _, rid, done = cmd
                    engine.abort_request([rid])
                    self.bridge.drop(rid)
                    self._post(self._on_aborted, rid, done)
            if engine.has_unfinished_requests():
                t = time.perf_counter()
                outs = engine.step()
                self._after_step(engine, outs, time.perf_counter() - t)

    def _after_step(self, engine: Any, outs: list, dt: float) -> None:
        self.counters["vllm_steps"] += 1
        if dt >= self.slow_step_s:
            self.counters["vllm_slow_steps"] += 1
            log.warning(
                "vllm_step_slow",
                role=self.role,
                seconds=round(dt, 3),
                outputs=len(outs),
                request_ids=[o.request_id for o in outs[:8]],
            )
        if self.on_decode_step is not None:
            self._post(self._on_step, dt)  # before the outputs: the batch as it stepped
        if self.role == Role.DECODE:
            ema = self._step_ema
            self._step_ema = dt if not ema else (1 - STEP_EMA) * ema + STEP_EMA * dt
        for out in outs:
            rid = out.request_id
            comp = out.outputs[0] if out.outputs else None
            toks = list(comp.token_ids) if comp is not None else []
            lps = _positions(comp.logprobs) if comp is not None and comp.logprobs else None
            plps = _positions(out.prompt_logprobs) if out.prompt_logprobs else None
            reason = comp.finish_reason if comp is not None else None
            plan = self.bridge.get(rid)
            err = plan.error if plan is not None else None
            finished = out.finished
            if err is not None and not finished:
                engine.abort_request([rid])
                finished = True
            if finished:
                self.bridge.drop(rid)
            if rid != WARMUP_ID:  # the warm-up is not counted
                self.counters["vllm_tokens_generated"] += len(toks)
                if finished:
                    self.counters["vllm_requests"] += 1
                    self.counters["vllm_cached_tokens"] += out.num_cached_tokens or 0
                if finished and plan is not None:
                    self.counters["vllm_prompt_tokens_computed"] += plan.computed_prompt_tokens
            self._post(self._on_output, rid, toks, finished, reason, err, lps, plps)

    # ------------------------------------------------------------------ event-loop side

    def _on_output(
        self,
        rid: str,
        toks: list[int],
        finished: bool,
        reason: str | None,
        err: BaseException | None,
        lps: list[PositionLogprobs] | None = None,
        plps: list[PositionLogprobs | None] | None = None,
    ) -> None:
        a = self._active.get(rid)
        if a is None:
            return
        if plps:
            a.prompt_logprobs += plps
        _settle(a.loaded)
        if finished:
            del self._active[rid]
        if a.kind == "prefill":
            if lps:
                a.logprobs += lps
            if err is not None:
                _settle(a.fut, error=err)
            elif toks:
                _settle(a.fut, toks[0])
            elif finished:
                _settle(a.fut, error=EngineError(f"prefill ended without a token ({reason})"))
        elif a.kind == "decode":
            for i, t in enumerate(toks):
                a.stream.push(t, lps[i] if lps and i < len(lps) else None)
            a.context += len(toks)
            if err is not None:
                a.stream.fail(EngineError(f"decode failed: {type(err).__name__}: {err}"))
            elif finished:
                a.stream.finish(reason if reason in ("stop", "length") else "abort")
        else:
            a.tokens += toks
            if finished:
                _settle(a.fut, a.tokens)

    def _on_step(self, dt: float) -> None:
        running = [
            a
            for a in self._active.values()
            if a.kind == "decode" and a.loaded is not None and a.loaded.done()
        ]
        if running and self.on_decode_step is not None:
            self.on_decode_step(len(running), sum(a.context for a in running), dt)

    def _on_aborted(self, rid: str, done: asyncio.Future | None) -> None:
        a = self._active.pop(rid, None)
        if a is not None:
            _settle(a.fut, error=EngineError("aborted"))
            _settle(a.loaded)
            if a.stream is not None:
                a.stream.finish("abort")
        _settle(done)

    def _on_failed(self, rid: str, err: BaseException) -> None:
        a = self._active.pop(rid, None)
        if a is None:
            return
        _settle(a.fut, error=err)
        if a.loaded is not None and not a.loaded.done():
            _settle(a.loaded, error=err)
        elif a.stream is not None:
            a.stream.fail(err)
