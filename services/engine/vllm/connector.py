"""PerigeeConnector: vLLM's KV-connector (v1) API over the node store's shared memory.

vLLM builds it from ``KVTransferConfig(kv_connector="PerigeeConnector",
kv_connector_module_path="services.engine.vllm.connector", kv_role="kv_both",
kv_connector_extra_config={"registry_key": ...})`` twice: role SCHEDULER (plans) and
role WORKER (copies bytes). Both run in the perigee worker process, on the engine
thread (vLLM in-process), and find the engine's :class:`~.bridge.Bridge` by the
registry key. The request's :class:`~.bridge.Plan` says which store slots hold its KV;
the prefill instance reserved them when its compute started (prefill_tx / decode_tx), so nothing is looked up.

Scheduler side, per request (sync loads: vLLM loads before the forward of the same step):
  get_num_new_matched_tokens -> min(plan.load_tokens, prompt - 1) minus vLLM's own hit
                                (decode engines run vLLM's prefix cache, salted per
                                request: the n sequences of one request share pages;
                                a plan.shared_prefix sequence whose full blocks are all
                                hits loads nothing and computes the partial tail)
  update_state_after_alloc    -> (vLLM block id, perigee block, sub-block) per loaded block
  build_connector_meta        -> this step's loads, saves of the blocks this step computes
                                 (block >= plan.save_from), and "ship" once the prompt is
                                 complete; a request first scheduled with nothing to load
                                 is consumed too (plan.on_loaded after the step)
  request_finished            -> counters back as kv_transfer_params
  (decode write-back)         -> saves of every vLLM block from plan.writeback_from on,
                                 in the step whose forward completes it (a block of the
                                 prompt's tail, loaded whole, in the first step)
Worker side, per step:
  start_load_kv       copy the block holding the load's end, all layers (see Copy.eager)
  wait_for_layer_load copy that layer of the other loaded blocks into the paged cache
  save_kv_layer       copy that layer of the saved blocks into the slots, then
                      plan.on_layer(layer): the prefill worker ships it to the decode node
                      while the next layers compute
  wait_for_save       waits for those on_layer hand-offs; load done -> plan.on_loaded();
                      a write-back block whose last vLLM block was saved this step (all
                      layers) -> plan.on_block(j, its bytes)

Copies are whole pages (``kv[block_id]``: one block of one layer, vLLM's logical
[heads, tokens, K|V] order), a layer's pages in one batch per arena mapping
(:mod:`.page_batch`), so CPU and CUDA layouts work alike; P and D must run the
same attention backend. A perigee block of ``hash_block_size`` tokens holds
``ratio = hash_block_size // block_size`` vLLM blocks, layer-major: layer ``l``,
sub-block ``s`` at byte ``(l * ratio + s) * page_bytes`` -- the layer spans the
prefill worker ships are contiguous. Hooks never raise into vLLM (that kills the
engine): a failure is recorded on the plan and the engine fails the request.
"""

import re
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from services.engine.vllm import page_batch
from services.engine.vllm.bridge import Plan, advance_grammar, lookup, request_key, skip_draws
from services.engine.vllm.kv_pages import ArenaPinner, page_view

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = structlog.get_logger()

# On CUDA, a mapping's pages in one layer go as one batch from this many on, and one
# queued copy_ each below it: batching pays a gather, a page-locked staging buffer, a
# wait and a host scatter whatever the count (about 80 us a layer on an H200), and won
# only from about 12 pages (bench ship --cuda-only, BENCHMARKS.md "Third GPU run":
# batched 0.39-0.47x page by page at 1 page, 0.66-0.72x of queued at 4, 1.04-1.42x at
# 12). On CPU pages batching wins at any count.
CUDA_BATCH_MIN_PAGES = 8

# How long wait_for_save waits for the event loop to take a layer (the loop only
# appends it to the ship queue; a stuck loop means the process is going down).
HANDOFF_TIMEOUT_S = 60.0


@dataclass
class Copy:
    """One vLLM block <-> one sub-block span of perigee block ``block`` of plan ``key``."""

    block_id: int
    key: str
    block: int
    sub: int
    # Load it in start_load_kv, before the forward: this block also receives KV that
    # vLLM computes this step, and backends with forward_includes_kv_cache_update=False
    # (CPU, flash-attn) write that KV *before* the attention op that calls
    # wait_for_layer_load, so a later whole-page copy would clobber it.
    eager: bool = False
    # Decode write-back: into the plan's staging block (plan.wb_tensors), not a slot.
    wb: bool = False


@dataclass
class PerigeeMeta(KVConnectorMetadata):
    """What the scheduler tells the workers to do this step: loads, saves and ships."""

    loads: list[Copy] = field(default_factory=list)
    saves: list[Copy] = field(default_factory=list)
    ship: list[str] = field(default_factory=list)  # plans whose prompt completes this step
    loaded: list[str] = field(default_factory=list)  # plans whose load runs this step
    # (vLLM request id, sampling steps) whose generator is advanced before this step
    # samples (Plan.skip_draws)
    skips: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class _Req:
    plan: Plan
    num_prompt: int
    block_ids: list[int] = field(default_factory=list)
    load_range: tuple[int, int] | None = None
    pending_load: list[Copy] = field(default_factory=list)
    shipped: bool = False
    wb_next: int | None = None  # next vLLM block to write back (decode)
    cached: int = 0  # positions of the load vLLM's prefix cache holds (its local hit)


def layer_index(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot find a layer index in {name!r}")
    return int(m.group(1))


# A mapping's copies in one layer: its rows, vLLM block ids (on the pages' device), their
# pages' rows, plans.
_Group = tuple[torch.Tensor, list[int] | torch.Tensor, np.ndarray, set[str]]


class PerigeeConnector(KVConnectorBase_V1):
    """vLLM's KV connector over the node store's slots: loads prefixes and saves new KV."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        role: KVConnectorRole,
        kv_cache_config: "KVCacheConfig | None" = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.bridge = lookup(extra.get("registry_key"))
        self.vllm_block_tokens = vllm_config.cache_config.block_size
        self.store_block_tokens = self.bridge.hash_block_size
        if self.store_block_tokens % self.vllm_block_tokens:
            raise ValueError(
                f"vLLM block_size {self.vllm_block_tokens} must divide perigee's hash block size "
                f"{self.store_block_tokens} (--block-size); choose a vLLM block size that divides it"
            )
        self.vllm_blocks_per_block = self.store_block_tokens // self.vllm_block_tokens
        self._reqs: dict[str, _Req] = {}  # scheduler side, by vLLM request id
        # worker side
        self._kv: dict[str, torch.Tensor] = {}
        self._layer_of: dict[str, int] = {}
        self._layer_block_bytes = 0  # bytes of one vLLM block of one layer
        self._loads: list[Copy] = []
        self._layers_loaded: set[str] = set()
        self._handoffs: list[tuple[str, Future]] = []
        # Page-locks the arena once pages are CUDA. Then copies are queued without waiting
        # for each (one wait per layer: _settle); else a copy_ waits for its own completion.
        self._pinner = ArenaPinner(enabled=False)
        self._batch_min = 1  # pages of a mapping in a layer that go as one batch
        self._pending = False
        # Batched CUDA copies (page_batch): a save's host part, run once the stream has
        # run its device part (_settle), and a load's staging buffers, kept until then.
        self._after_sync: list[tuple[set[str], Any]] = []
        self._staged: list[torch.Tensor] = []
        # This step's copies grouped by mapping (_group), by the id of the list they came
        # in: a step's saves and loads are the same in every layer, only the row moves.
        self._grouped: dict[int, tuple[list[Copy], list[_Group], list[Copy]]] = {}

    # ------------------------------------------------------------------ scheduler side

    def _state(self, request: "Request") -> _Req | None:
        st = self._reqs.get(request.request_id)
        if st is None:
            plan = self.bridge.get(request_key(request.kv_transfer_params))
            if plan is None:
                return None
            st = _Req(plan=plan, num_prompt=len(request.prompt_token_ids or []))
            self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is not None:
            advance_grammar(st.plan, request)  # structured output resumes (issue 25)
        st_load = None
        if st is not None and not st.plan.consumed and st.plan.error is None:
            # vLLM must compute at least one token to sample from; a load may end
            # mid-block (vLLM computes the rest of that block).
            target = min(st.plan.load_tokens, request.num_tokens - 1)
            st.cached = min(num_computed_tokens, target)
            if st.plan.shared_prefix and num_computed_tokens >= target - target % (
                self.vllm_block_tokens
            ):
                target = num_computed_tokens  # every full block is a hit: compute the tail
            if target > num_computed_tokens:
                st_load = (num_computed_tokens, target)
        if st is not None:
            st.load_range = st_load
        return (0 if st_load is None else st_load[1] - st_load[0]), False

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        st = self._reqs.get(request.request_id)
        if st is None or num_external_tokens == 0 or st.load_range is None:
            return
        start, end = st.load_range
        if end - start != num_external_tokens:
            raise AssertionError(f"load {st.load_range} vs {num_external_tokens} external tokens")
        ids = blocks.get_block_ids()[0]  # every block of the request, index = block position
        st.pending_load = [
            Copy(
                ids[i],
                st.plan.key,
                *divmod(i, self.vllm_blocks_per_block),
                eager=(i == end // self.vllm_block_tokens),
            )
            for i in range(start // self.vllm_block_tokens, -(-end // self.vllm_block_tokens))
        ]
        st.plan.consumed = True  # the slots may be gone once the request is running
        st.plan.loaded_tokens += num_external_tokens
        self.bridge.counters["connector_loads"] += 1
        st.load_range = None

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PerigeeMeta()
        sched = scheduler_output
        for nr in sched.scheduled_new_reqs:
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.block_ids = list(nr.block_ids[0])
            if st.plan.skip_draws:
                meta.skips.append((nr.req_id, st.plan.skip_draws))
                st.plan.skip_draws = 0
            self._take_loads(st, meta)
            self.bridge.counters["connector_tokens_cached"] += st.cached
            if not st.plan.consumed:
                # Nothing to load (vLLM's prefix cache holds it, or there is none): the
                # slots are never read for this request, now or after a preemption.
                st.plan.consumed = True
                meta.loaded.append(st.plan.key)
            self._plan_saves(
                st, nr.num_computed_tokens, sched.num_scheduled_tokens[nr.req_id], meta
            )
        cached = sched.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:  # preempted and back: block list replaced
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])
            self._take_loads(st, meta)
            self._plan_saves(
                st, cached.num_computed_tokens[i], sched.num_scheduled_tokens.get(rid, 0), meta
            )
        return meta

    def _take_loads(self, st: _Req, meta: PerigeeMeta) -> None:
        if st.pending_load:
            meta.loads += st.pending_load
            meta.loaded.append(st.plan.key)
            st.pending_load = []

    def _plan_saves(self, st: _Req, before: int, scheduled: int, meta: PerigeeMeta) -> None:
        plan, after = st.plan, before + scheduled
        plan.computed_prompt_tokens += max(0, min(after, st.num_prompt) - before)
        if plan.save_from is not None:
            end = min(after, plan.save_tokens)
            first = max(
                before // self.vllm_block_tokens, plan.save_from * self.vllm_blocks_per_block
            )
            for i in range(first, -(-end // self.vllm_block_tokens)):
                j, sub = divmod(i, self.vllm_blocks_per_block)
                meta.saves.append(Copy(st.block_ids[i], plan.key, j, sub))
                plan.saved_blocks.add(j)
        if plan.writeback_from is not None:
            self._plan_writeback(st, after, meta)
        if plan.on_layer is not None and not st.shipped and after >= plan.save_tokens:
            st.shipped = True
            meta.ship.append(plan.key)

    def _plan_writeback(self, st: _Req, after: int, meta: PerigeeMeta) -> None:
        """Save every vLLM block whose positions all have KV once this step's forward is
        done (``after`` of them), in order; the KV a block holds is final then."""
        plan, vb = st.plan, self.vllm_block_tokens
        if st.wb_next is None:
            st.wb_next = (plan.writeback_from or 0) * self.vllm_blocks_per_block
        while (st.wb_next + 1) * vb <= after and st.wb_next < len(st.block_ids):
            j, sub = divmod(st.wb_next, self.vllm_blocks_per_block)
            meta.saves.append(Copy(st.block_ids[st.wb_next], plan.key, j, sub, wb=True))
            st.wb_next += 1

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return False, None
        plan = st.plan
        return False, {
            "perigee": {
                "loaded_tokens": plan.loaded_tokens,
                "computed_prompt_tokens": plan.computed_prompt_tokens,
                "saved_blocks": len(plan.saved_blocks),
            }
        }

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = kv_caches
        order = sorted(kv_caches, key=layer_index)
        self._layer_of = {name: i for i, name in enumerate(order)}
        page = next(iter(kv_caches.values()))[0]  # one block of one layer
        self._layer_block_bytes = page.numel() * page.element_size()
        need = len(order) * self.vllm_blocks_per_block * self._layer_block_bytes
        if need != self.bridge.block_bytes:
            raise ValueError(
                f"vLLM holds {self._layer_block_bytes} bytes per block per layer ({len(order)} layers, "
                f"{self.vllm_blocks_per_block} vLLM blocks per perigee block: {need} bytes per perigee "
                f"block), but the store's blocks are {self.bridge.block_bytes} bytes; start "
                f"the stores with --block-bytes {need}"
            )
        self.bridge.layer_block_bytes = self._layer_block_bytes
        self._pinner = ArenaPinner(enabled=page.is_cuda and self.bridge.pin_arena)
        self._batch_min = CUDA_BATCH_MIN_PAGES if page.is_cuda else 1

    def _slot_tensor(self, plan: Plan, block: int) -> torch.Tensor:
        """Slot ``block`` of ``plan`` as bytes (made once, its mapping page-locked then)."""
        raw = plan.tensors.get(block)
        if raw is None:
            slot = plan.slots[block]
            self._pinner.pin(slot)
            raw = plan.tensors[block] = torch.frombuffer(slot, dtype=torch.uint8)
        return raw

    def _page(self, c: Copy, layer: int, like: torch.Tensor) -> torch.Tensor | None:
        plan = self.bridge.get(c.key)
        if plan is None:
            return None
        if c.wb:
            raw = plan.wb_tensors.get(c.block)
            if raw is None:
                raw = plan.wb_tensors[c.block] = torch.empty(
                    self.bridge.block_bytes, dtype=torch.uint8, pin_memory=self._pinner.enabled
                )
        else:
            raw = self._slot_tensor(plan, c.block)
        return page_view(
            raw, layer, c.sub, self.vllm_blocks_per_block, self._layer_block_bytes, like
        )

    def _guard(self, key: str, err: BaseException) -> None:
        self.bridge.counters["connector_errors"] += 1
        plan = self.bridge.get(key)
        if plan is not None:
            plan.fail(err)
        log.error("kv_connector_failed", key=key, error=f"{type(err).__name__}: {err}")

    def _slot_rows(self, copies: list[Copy], layer: int) -> tuple[list[_Group], list[Copy]]:
        """``copies`` grouped by the mapping their slot lies in: per mapping, its rows
        (page_batch.host_rows), the vLLM block ids, the rows of their pages in ``layer``
        and the plans. Write-back copies, slots that are not whole rows of their
        mapping, and on CUDA a mapping with fewer than CUDA_BATCH_MIN_PAGES pages, come
        back apart (copied page by page). Grouped once a step: a 5,449-token
        prompt's 171 pages cost ~0.5 ms of Python to group, every layer until then."""
        got = self._grouped.get(id(copies))
        if got is None or got[0] is not copies:
            got = self._grouped[id(copies)] = (copies, *self._group(copies))
        _, groups, apart = got
        off = layer * self.vllm_blocks_per_block
        return [(rows, ids, at + off, keys) for rows, ids, at, keys in groups], apart

    def _group(self, copies: list[Copy]) -> tuple[list[_Group], list[Copy]]:
        """:meth:`_slot_rows` of layer 0."""
        # per mapping: its rows, the rows of the copies' pages in layer 0, the copies
        groups: dict[int, tuple[torch.Tensor, list[int], list[Copy]]] = {}
        apart: list[Copy] = []
        pb = self._layer_block_bytes
        for c in copies:
            if c.wb:
                apart.append(c)
                continue
            try:
                plan = self.bridge.get(c.key)
                if plan is None:
                    continue
                slot = plan.slots[c.block]
                raw = self._slot_tensor(plan, c.block)
                base = slot.obj if isinstance(slot, memoryview) else slot
                g = groups.get(id(base))
                if g is None:
                    g = groups[id(base)] = (page_batch.host_rows(base, pb), [], [])
                first = page_batch.first_row(raw, g[0], pb)
                if first is None:
                    apart.append(c)
                    continue
                g[1].append(first + c.sub)
                g[2].append(c)
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                self._guard(c.key, e)
        batches: list[_Group] = []
        for rows, at, batch in groups.values():
            if len(batch) < self._batch_min:
                apart += batch
                continue
            ids = self._ids_on_device([c.block_id for c in batch])
            batches.append((rows, ids, np.asarray(at, dtype=np.int64), {c.key for c in batch}))
        return batches, apart

    def _ids_on_device(self, ids: list[int]) -> list[int] | torch.Tensor:
        """vLLM block ids where the pages are: on CUDA a tensor, queued from page-locked
        memory once a step (page_batch would otherwise make one per layer, and a tensor
        made from a list waits for the stream: every queued kernel, every layer)."""
        layer = next(iter(self._kv.values()), None)
        if layer is None or not layer.is_cuda:
            return ids
        host = torch.tensor(ids, dtype=torch.long).pin_memory()
        self._staged.append(host)  # kept until the stream has run the copy (_settle)
        self._pending = True
        return host.to(layer.device, non_blocking=True)

    def _load_layer(self, copies: list[Copy], name: str) -> None:
        """Layer ``name`` of ``copies`` from the slots into the paged cache, a batch per
        mapping (page_batch.load)."""
        kv = self._kv[name]
        groups, apart = self._slot_rows(copies, self._layer_of[name])
        for rows, ids, at, keys in groups:
            try:
                staged = page_batch.load(kv, ids, rows, at)
                if staged is not None:
                    self._staged.append(staged)
                    self._pending = True
                self.bridge.counters["connector_layer_blocks_loaded"] += len(ids)
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                for key in keys:
                    self._guard(key, e)
        for c in apart:
            self._load(c, name)

    def _load(self, c: Copy, name: str) -> None:
        """One page, the one-by-one way (kept for what _slot_rows sets apart)."""
        try:
            page = self._kv[name][c.block_id]
            src = self._page(c, self._layer_of[name], page)
            if src is not None:
                page.copy_(src, non_blocking=self._pinner.enabled)
                self._pending |= self._pinner.enabled
                self.bridge.counters["connector_layer_blocks_loaded"] += 1
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            self._guard(c.key, e)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PerigeeMeta)
        self._layers_loaded.clear()
        self._loads = []
        self._grouped.clear()
        for req_id, steps in meta.skips:
            try:
                if skip_draws(self.bridge, req_id, steps):
                    self.bridge.counters["connector_draws_skipped"] += steps
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                log.warning("skip_draws_failed", request_id=req_id, error=str(e))
        eager = [c for c in meta.loads if c.eager]  # all layers now; see Copy.eager
        self._loads = [c for c in meta.loads if not c.eager]
        if eager:
            for name in self._kv:
                self._load_layer(eager, name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._loads or layer_name in self._layers_loaded:
            return
        self._layers_loaded.add(layer_name)
        self._load_layer(self._loads, layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PerigeeMeta)
        layer = self._layer_of[layer_name]
        groups, apart = self._slot_rows(meta.saves, layer)
        for rows, ids, at, keys in groups:
            try:
                rest = page_batch.save(kv_layer, ids, rows, at)
                if rest is not None:
                    self._after_sync.append((keys, rest))
                    self._pending = True
                self.bridge.counters["connector_layer_blocks_saved"] += len(ids)
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                for key in keys:
                    self._guard(key, e)
        for c in apart:  # write-back staging blocks, a few pages on CUDA: one page each
            try:
                page = kv_layer[c.block_id]
                dst = self._page(c, layer, page)
                if dst is not None:
                    dst.copy_(page, non_blocking=self._pinner.enabled)
                    self._pending |= self._pinner.enabled
                    self.bridge.counters["connector_layer_blocks_saved"] += 1
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                self._guard(c.key, e)
        # A layer that ships, or whose saves end on the host, waits for the stream here:
        # its bytes are in the slots before they leave. Loads alone wait at the step's
        # end (wait_for_save), so a decode step that takes a joining request's pages
        # does not stall its CPU at every layer.
        if meta.ship or self._after_sync:
            self._settle()
        for key in meta.ship:
            plan = self.bridge.get(key)
            if plan is None or plan.on_layer is None:
                continue
            try:
                fut = plan.on_layer(layer)
                plan.shipped_layers += 1
                if fut is not None:
                    self._handoffs.append((key, fut))
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                self._guard(key, e)

    def _hand_back(self, c: Copy) -> None:
        """Write-back block ``c.block`` is complete in every layer: hand its bytes over."""
        plan = self.bridge.get(c.key)
        if plan is None or plan.error is not None:
            return
        raw = plan.wb_tensors.pop(c.block, None)
        if raw is None or plan.on_block is None:
            return
        try:
            plan.on_block(c.block, memoryview(raw.numpy()))
            self.bridge.counters["connector_blocks_written_back"] += 1
        except Exception as e:  # noqa: BLE001 - never raise into vLLM
            self._guard(c.key, e)

    def _settle(self) -> None:
        """Wait for this step's asynchronous copies (page-locked slots: copies are queued
        on the compute stream, ordered after the kernels that write the pages and
        before those that read them): before bytes leave through a ship or a
        hand-back, and before loaded slots are released."""
        if self._pending:
            torch.cuda.current_stream().synchronize()
            self._pending = False
        self._staged.clear()
        after, self._after_sync = self._after_sync, []
        for keys, rest in after:
            try:
                rest()
            except Exception as e:  # noqa: BLE001 - never raise into vLLM
                for key in keys:
                    self._guard(key, e)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PerigeeMeta)
        for name in self._kv:  # a layer vLLM did not announce (should not happen)
            if self._loads and name not in self._layers_loaded:
                self.wait_for_layer_load(name)
        self._settle()
        handoffs, self._handoffs = self._handoffs, []
        if handoffs:
            wait([f for _, f in handoffs], timeout=HANDOFF_TIMEOUT_S)
        for key, fut in handoffs:
            if not fut.done():
                err: BaseException | None = TimeoutError("the event loop did not take the layer")
            elif fut.cancelled():
                err = RuntimeError("layer hand-off cancelled")
            else:
                err = fut.exception()
            if err is not None:
                self._guard(key, err)
            else:
                self.bridge.counters["connector_layers_shipped"] += 1
        self.bridge.counters["connector_blocks_saved"] += len(
            {(c.key, c.block) for c in meta.saves if not c.wb}
        )
        for c in meta.saves:
            if c.wb and c.sub == self.vllm_blocks_per_block - 1:
                self._hand_back(c)
        for key in meta.loaded:
            plan = self.bridge.get(key)
            if plan is not None:
                self.bridge.counters["connector_tokens_loaded"] += plan.loaded_tokens
                if plan.on_loaded is not None:
                    plan.on_loaded()
        self._loads = []
        self._grouped.clear()  # its tensors view the slots: kept no longer than the step

    def shutdown(self) -> None:
        self._pinner.close()
