"""The engine interface: what a prefill or decode worker asks of a model runner.

An engine never touches NATS or the store protocol. The worker hands it a job whose
KV lives in store slots (shared memory) behind a :class:`KVAccess`; the engine reads
the cached prefix from there and writes the new KV there, layer by layer, calling
``job.on_layer(layer)`` after each layer so the worker can ship that layer while the
next one computes (paper §4.1, layer-wise prefill).

How a vLLM backend maps onto this (through vLLM's KV-connector API):

- ``PrefillJob.prefix_tokens`` answers the scheduler-side
  ``get_num_new_matched_tokens``: those tokens are loaded, not computed;
- ``KVAccess.read`` / ``KVAccess.block`` serve ``start_load_kv`` /
  ``wait_for_layer_load`` (copy the prefix into the paged cache, per layer);
- ``KVAccess.write`` + ``PrefillJob.on_layer`` serve ``save_kv_layer`` (copy one
  layer out, then let the worker ship it); ``wait_for_save`` is the worker awaiting
  its ships;
- ``DecodeJob.kv`` is loaded whole by ``add_request`` before the request joins the
  running batch; after ``add_request`` returns the engine no longer needs the slots.
- ``DecodeJob.on_block`` serves ``save_kv_layer`` on the decode side: each block of
  the answer is copied out of the paged cache as it fills, so the worker can store it
  (write-back, :mod:`services.decode.writeback`).

Errors: :class:`EngineError` fails one request (the engine keeps serving);
:class:`EngineDeadError` means the engine is gone and the worker must stop.
"""

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from bus_schemas.requests import SamplingParams
from services.common.kv_layout import KVLayout
from services.common.model_spec import ModelSpec


class EngineError(RuntimeError):
    """One request failed (bad input, KV mismatch); the engine is fine."""


class EngineRequestError(EngineError):
    """The engine refused the request's parameters (a schema its grammar backend cannot
    compile, a value out of its bounds): the client's error, not the server's."""


class EngineDeadError(RuntimeError):
    """The engine stopped or crashed; no request can be served any more."""


class KVAccess(ABC):
    """KV of one request's token positions [0, num_tokens), per layer.

    Arrays are ``[2, n, row]`` (K then V; ``row = num_kv_heads * head_dim``) in the
    layout's dtype, exactly as :class:`~services.common.kv_layout.KVLayout` stores them.
    """

    layout: KVLayout
    num_tokens: int

    @abstractmethod
    def read(self, layer: int, start: int, end: int) -> np.ndarray:
        """A copy of the KV of positions [start, end) of ``layer``."""

    @abstractmethod
    def write(self, layer: int, start: int, kv: np.ndarray) -> None:
        """Store ``kv`` ([2, n, row]) at positions [start, start + n) of ``layer``."""

    @abstractmethod
    def block(self, index: int, layer: int) -> np.ndarray:
        """Writable ``[2, block_size, row]`` view of one block of one layer (zero copy)."""


class SlotKV(KVAccess):
    """KV access over store slots: ``slots[b]`` is the memoryview of block ``b``."""

    def __init__(self, layout: KVLayout, slots: Sequence[memoryview], num_tokens: int) -> None:
        if num_tokens > len(slots) * layout.block_size:
            raise EngineError(
                f"{num_tokens} tokens do not fit in {len(slots)} blocks of {layout.block_size}"
            )
        for s in slots:
            if len(s) < layout.block_bytes:
                raise EngineError(f"slot of {len(s)} bytes, block needs {layout.block_bytes}")
        self.layout = layout
        self.slots = list(slots)
        self.num_tokens = num_tokens

    def _check(self, layer: int, start: int, end: int) -> None:
        if not 0 <= layer < self.layout.spec.num_layers:
            raise EngineError(f"layer {layer} out of range")
        if not 0 <= start <= end <= self.num_tokens:
            raise EngineError(f"positions [{start}, {end}) outside [0, {self.num_tokens})")

    def read(self, layer: int, start: int, end: int) -> np.ndarray:
        self._check(layer, start, end)
        return self.layout.read_tokens(self.slots, layer, start, end)

    def write(self, layer: int, start: int, kv: np.ndarray) -> None:
        self._check(layer, start, start + kv.shape[1])
        self.layout.write_tokens(self.slots, layer, start, kv)

    def block(self, index: int, layer: int) -> np.ndarray:
        return self.layout.layer_view(self.slots[index], layer)


@dataclass
class PrefillJob:
    """Compute the KV of ``prompt_token_ids[prefix_tokens:]`` and the first token.

    The KV of positions [0, prefix_tokens) is already in ``kv`` (cached or pulled);
    the engine reads it instead of recomputing it, and writes positions
    [prefix_tokens, len(prompt)) of every layer. ``on_layer(layer)`` is awaited after
    layer ``layer`` has been written, in layer order.
    """

    request_id: str
    prompt_token_ids: Sequence[int]
    prefix_tokens: int
    sampling: SamplingParams
    kv: KVAccess
    on_layer: Callable[[int], Awaitable[None]] | None = None
    # False: the compute already happened elsewhere (a chunked pipeline's stages,
    # services.prefill.cpp_pipeline): write the KV and give the first token without
    # the engine's own time. Only the mock engine paces; vLLM computes either way.
    paced: bool = True
    # Set by an engine that computes them, when the sampling parameters ask: the first
    # token's log-probabilities and the prompt's (bus_schemas.requests.PositionLogprobs).
    first_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


@dataclass
class DecodeJob:
    """Continue a request whose prompt KV is in ``kv`` and whose first token is known.

    ``first_token`` None (a request's sequence ``seq`` > 0 when n > 1): the engine
    samples the first token itself, from the prompt's KV in ``kv`` (it computes only
    the last prompt position again) with ``sampling`` as given (its seed is the
    sequence's), and streams it first."""

    request_id: str
    prompt_token_ids: Sequence[int]
    first_token: int | None
    sampling: SamplingParams
    kv: KVAccess
    # Write-back (issue 24): called on the event loop with (block index j, the block's
    # bytes in the store's layout, every layer) once the engine holds the KV of every
    # position of block j, for each block from the one holding the prompt's end
    # (``len(prompt) // block_size``) onwards, in order. The KV is the engine's own,
    # copied out as it is computed; the last sampled token has none (it was never fed
    # back), so the blocks end before it. The bytes are the callee's.
    on_block: Callable[[int, memoryview], None] | None = None
    seq: int = 0  # which of the request's n sequences this is
    # The request this job is a sequence of (n > 1), None for its own: an engine that
    # can (vLLM on decode: its prefix cache, salted with it) lets the jobs of one group
    # share the prompt's pages, and keeps other groups' pages apart.
    prefix_group: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """What an engine's decode batch looks like now, for the load report."""

    batch_size: int  # requests in the running batch
    waiting: int  # admitted to the engine, waiting for a batch slot
    kv_tokens: int  # context tokens held by the running batch
    step_time_s: float  # estimated time of one decode step at this batch (TBT)


@dataclass
class RequestStream:
    """Tokens of one decoding request, after the first token, as they are produced.

    ``async for tok in stream`` yields one token at a time; ``await next_batch()``
    returns every token available now (waiting for at least one), ``[]`` once the
    request has finished. ``finish_reason`` ("stop" | "length" | "abort") is set
    when it finishes. If the engine dies the consumer gets :class:`EngineDeadError`.
    """

    request_id: str
    finish_reason: str | None = None
    _tokens: deque[int] = field(default_factory=deque)
    # Each token's log-probabilities, when the engine computes them (pushed with it).
    _logprobs: deque[list[tuple[int, float]]] = field(default_factory=deque)
    _error: BaseException | None = None
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    # -- producer side (the engine) --
    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self._error is not None

    def push(self, token: int, logprobs: list[tuple[int, float]] | None = None) -> None:
        self._tokens.append(token)
        if logprobs is not None:
            self._logprobs.append(logprobs)
        self._event.set()

    def take_logprobs(self) -> list[list[tuple[int, float]]] | None:
        """The log-probabilities of the tokens the last ``next_batch`` returned (None if
        the engine gave none)."""
        if not self._logprobs:
            return None
        out = list(self._logprobs)
        self._logprobs.clear()
        return out

    def finish(self, reason: str) -> None:
        if not self.done:
            self.finish_reason = reason
            self._event.set()

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self._error = error
            self._event.set()

    # -- consumer side (the worker) --
    def ended(self) -> bool:
        """Finished with nothing left to take: the last ``next_batch`` was the end."""
        return self.finish_reason is not None and not self._tokens

    async def next_batch(self) -> list[int]:
        while not self._tokens and not self.done:
            self._event.clear()
            await self._event.wait()
        if self._tokens:
            out = list(self._tokens)
            self._tokens.clear()
            return out
        if self._error is not None:
            raise self._error
        return []

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> int:
        while not self._tokens and not self.done:
            self._event.clear()
            await self._event.wait()
        if self._tokens:
            return self._tokens.popleft()
        if self._error is not None:
            raise self._error
        raise StopAsyncIteration


class Engine(ABC):
    """A model runner. Prefill side: :meth:`prefill`. Decode side: :meth:`add_request`
    (continuous batching inside the engine), :meth:`abort`, :meth:`stats`."""

    spec: ModelSpec
    max_batch: int
    # Called (on the event loop) after every decode step with (running batch size,
    # context tokens of the batch, seconds the step took): online calibration.
    on_decode_step: Callable[[int, int, float], None] | None = None

    @abstractmethod
    async def start(self) -> None:
        """Start background work (the decode loop). Call once before decoding."""

    @abstractmethod
    async def stop(self) -> None:
        """Stop; streams still running fail with :class:`EngineDeadError`."""

    @abstractmethod
    async def prefill(self, job: PrefillJob) -> int:
        """Run the prefill of ``job`` layer by layer; returns the first generated token."""

    @abstractmethod
    async def add_request(self, job: DecodeJob) -> RequestStream:
        """Load the job's KV (raising :class:`EngineError` if it is unusable), queue the
        request for the running batch and return its token stream. The first token is
        counted against ``max_tokens`` and may finish the request at once."""

    @abstractmethod
    def abort(self, request_id: str) -> bool:
        """Drop a decoding request; its stream finishes with "abort". False if unknown."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Current decode load."""
