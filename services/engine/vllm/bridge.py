"""What the vLLM engine tells its KV connector about each request (no vLLM import).

The engine (:mod:`.engine`) and both connector instances (scheduler and worker role,
:mod:`.connector`) live in one process: vLLM runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), stepped by one engine thread. vLLM builds the
connector itself from ``kv_connector_extra_config``, which must stay plain data, so
the engine registers a :class:`Bridge` here under a random key and passes the key;
the connector looks it up. Per request the engine adds a :class:`Plan` before it
hands the request to vLLM, keyed by the perigee request id, which rides in
``SamplingParams.extra_args["kv_transfer_params"]["perigee"]["key"]``.

Lifecycle of a plan:

    engine (event loop)  add(plan)          before vLLM sees the request
    connector (sched.)   load planned       plan.consumed: never loaded twice (also set
                                            when first scheduled with nothing to load)
    connector (worker)   load done          plan.on_loaded() (decode: slots released)
                         layer saved        plan.on_layer(layer) (prefill: ship it)
                         answer block full  plan.on_block(j, bytes) (decode write-back)
                         failure            plan.error (never raised inside vLLM)
    engine (thread)      drop(key)          when vLLM reports the request finished
"""

import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Plan:
    """KV of one request in the node store's slots.

    ``slots[j]`` is the shared-memory slot of perigee block ``j`` (``hash_block_size``
    tokens, every layer). Positions ``[0, load_tokens)`` are loaded from the slots
    (vLLM caps it at prompt length - 1: something must be computed to sample).
    If ``save_from`` is set, vLLM's KV of blocks ``save_from ..`` up to position
    ``save_tokens`` is written into the slots as it is computed, and once the prompt
    is complete ``on_layer(layer)`` runs after each layer's copy (in layer order).
    """

    key: str
    slots: Sequence[memoryview]
    load_tokens: int = 0
    save_from: int | None = None
    save_tokens: int = 0
    # Engine thread -> event loop hooks; on_layer returns a future the connector waits
    # on before the step ends (wait_for_save), or None.
    on_layer: Callable[[int], Future | None] | None = None
    on_loaded: Callable[[], None] | None = None
    # Structured output: the answer so far (tokens already in the prompt), fed to the
    # request's grammar once it is compiled, before vLLM samples (advance_grammar).
    # A sequence > 0 of a request's n (decode): sequence 0 loaded the same prompt into
    # pages vLLM's prefix cache holds, salted for the request. When the cache holds every
    # full vLLM block of the load, the partial block after them is computed here rather
    # than loaded, so the slots are read once for the n sequences; otherwise (the
    # pages were evicted) whatever the cache lacks is loaded, as for any request.
    shared_prefix: bool = False
    grammar_prefix: Sequence[int] = ()
    grammar_advanced: bool = False
    # Seeded sampling that goes on from a token sampled elsewhere (decode after
    # prefill's first token): the request's generator is advanced by this many sampling
    # steps before its first sample here, so token k comes from the k-th draw of the
    # seed's generator, as in one engine (skip_draws).
    skip_draws: int = 0
    # Decode write-back: from perigee block ``writeback_from`` on, each block whose
    # positions all have KV is copied out of vLLM's pages (every layer, into
    # ``wb_tensors``) and handed to ``on_block(j, bytes)`` (engine thread).
    writeback_from: int | None = None
    on_block: Callable[[int, memoryview], None] | None = None
    wb_tensors: dict[int, Any] = field(default_factory=dict)
    # Progress, written on the engine thread.
    consumed: bool = False
    loaded_tokens: int = 0
    computed_prompt_tokens: int = 0
    saved_blocks: set[int] = field(default_factory=set)
    shipped_layers: int = 0
    error: BaseException | None = None
    # Worker-side cache: uint8 tensors over the slots (built on first use).
    tensors: dict[int, Any] = field(default_factory=dict)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error


def advance_grammar(plan: Plan, request: Any) -> None:
    """Feed ``plan.grammar_prefix`` to the vLLM request's grammar, once. Called by the
    scheduler-side connector when vLLM schedules the request: its grammar is compiled by
    then (vLLM holds a request back until it is) and nothing has been sampled yet."""
    if not plan.grammar_prefix or plan.grammar_advanced:
        return
    plan.grammar_advanced = True
    so = getattr(request, "structured_output_request", None)
    grammar = so.grammar if so is not None else None
    if grammar is None or isinstance(grammar, Exception):
        plan.fail(RuntimeError(f"no grammar to resume: {grammar!r}"))
    elif not grammar.accept_tokens(request.request_id, list(plan.grammar_prefix)):
        plan.fail(RuntimeError("the answer so far does not fit the grammar"))


class Bridge:
    """One engine's plans plus the store geometry the connector checks against."""

    def __init__(self, block_bytes: int, hash_block_size: int) -> None:
        if block_bytes <= 0 or hash_block_size <= 0:
            raise ValueError("block_bytes and hash_block_size must be positive")
        self.block_bytes = block_bytes
        self.hash_block_size = hash_block_size
        self.plans: dict[str, Plan] = {}
        # Connector-side counters (engine thread writes, anyone reads).
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "connector_tokens_loaded",
                # plans whose KV was copied from the slots (a load), and the positions
                # of plans' loads that vLLM's prefix cache held instead (decode, n > 1)
                "connector_loads",
                "connector_tokens_cached",
                "connector_layer_blocks_loaded",
                "connector_layer_blocks_saved",
                "connector_blocks_saved",
                "connector_layers_shipped",
                "connector_blocks_written_back",
                "connector_errors",
                "connector_draws_skipped",
            ),
            0,
        )
        self.layer_block_bytes = 0  # vLLM's bytes per block per layer, set by the worker
        # Page-lock the store's arena for copies to and from CUDA pages (kv_pages).
        self.pin_arena = True
        # vLLM request id -> its sampling generator (the model runner's), or None; set
        # by the engine once vLLM is built (skip_draws).
        self.generator_of: Callable[[str], Any] | None = None
        self.vocab_size = 0

    def add(self, plan: Plan) -> None:
        if plan.key in self.plans:
            raise ValueError(f"a plan for {plan.key} exists already")
        self.plans[plan.key] = plan

    def get(self, key: str | None) -> Plan | None:
        return None if key is None else self.plans.get(key)

    def drop(self, key: str) -> Plan | None:
        return self.plans.pop(key, None)


_REGISTRY: dict[str, Bridge] = {}
_LOCK = threading.Lock()


def register(bridge: Bridge) -> str:
    key = uuid.uuid4().hex
    with _LOCK:
        _REGISTRY[key] = bridge
    return key


def unregister(key: str) -> None:
    with _LOCK:
        _REGISTRY.pop(key, None)


def lookup(key: str | None) -> Bridge:
    with _LOCK:
        bridge = _REGISTRY.get(key or "")
    if bridge is None:
        raise ValueError(
            "PerigeeConnector needs kv_connector_extra_config['registry_key'] of a Bridge "
            "registered in this process (services.engine.vllm.bridge.register); vLLM must "
            "run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0)"
        )
    return bridge


def request_key(kv_transfer_params: dict | None) -> str | None:
    p = (kv_transfer_params or {}).get("perigee")
    return p.get("key") if isinstance(p, dict) else None


def skip_draws(bridge: Bridge, req_id: str, steps: int) -> bool:
    """Advance vLLM request ``req_id``'s seeded generator by ``steps`` sampling steps,
    drawing exactly what vLLM's sampler draws per step: on CPU (``forward_cpu``) one
    ``randint(0, 2**31)``; elsewhere (``random_sample``) one exponential per vocabulary
    entry. False when the request has no generator (greedy, or no seed)."""
    import torch
    from vllm.platforms import current_platform

    gen = bridge.generator_of(req_id) if bridge.generator_of is not None else None
    if gen is None:
        return False
    for _ in range(steps):
        if current_platform.is_cpu():
            torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        else:
            torch.empty(bridge.vocab_size, device=gen.device).exponential_(generator=gen)
    return True
