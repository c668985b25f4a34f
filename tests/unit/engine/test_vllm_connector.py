"""PerigeeConnector without an engine: the scheduler side's plans (what is loaded, saved
and shipped each step) and the worker side's page copies between fake paged caches and
bytearray "store slots", driven the way vLLM drives them."""

import importlib.util
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed", allow_module_level=True)

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from services.engine.vllm.bridge import Bridge, Plan, register, unregister  # noqa: E402
from services.engine.vllm.connector import PerigeeConnector, PerigeeMeta  # noqa: E402

LAYERS, HEADS, CONTENT = 4, 2, 128  # tiny-llama: 2 kv heads, K|V of head_dim 64
HBS = 32


def page_bytes(bs: int) -> int:
    return HEADS * bs * CONTENT * 4


@pytest.fixture
def bridge():
    b = Bridge(block_bytes=LAYERS * HBS * HEADS * CONTENT * 4, hash_block_size=HBS)
    key = register(b)
    b.registry_key = key
    yield b
    unregister(key)


def connector(bridge: Bridge, role: KVConnectorRole, vllm_bs: int = 32) -> PerigeeConnector:
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"registry_key": bridge.registry_key}
        ),
        cache_config=SimpleNamespace(block_size=vllm_bs),
    )
    return PerigeeConnector(cfg, role, None)


def request(rid: str, key: str, prompt_len: int, extra_tokens: int = 0):
    return SimpleNamespace(
        request_id=rid,
        prompt_token_ids=list(range(prompt_len)),
        num_tokens=prompt_len + extra_tokens,
        kv_transfer_params={"perigee": {"key": key}},
    )


def blocks(ids: list[int]):
    return SimpleNamespace(get_block_ids=lambda: (ids,))


def step_new(rid: str, ids: list[int], computed: int, scheduled: int):
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=rid, block_ids=(ids,), num_computed_tokens=computed)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={rid: scheduled},
    )


def step_cached(rid: str, new_ids: list[int], computed: int, scheduled: int):
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid],
            resumed_req_ids=set(),
            new_block_ids=[(new_ids,)],
            num_computed_tokens=[computed],
        ),
        num_scheduled_tokens={rid: scheduled},
    )


def plan(key: str, n_blocks: int, **kw) -> Plan:
    return Plan(
        key=key,
        slots=[memoryview(bytearray(LAYERS * HBS * HEADS * CONTENT * 4)) for _ in range(n_blocks)],
        **kw,
    )


def test_vllm_block_size_must_divide_the_hash_block_size(bridge):
    with pytest.raises(ValueError, match="must divide"):
        connector(bridge, KVConnectorRole.SCHEDULER, vllm_bs=24)


def test_unknown_registry_key_is_a_clear_error():
    cfg = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}),
        cache_config=SimpleNamespace(block_size=32),
    )
    with pytest.raises(ValueError, match="registry_key"):
        PerigeeConnector(cfg, KVConnectorRole.SCHEDULER, None)


def test_prefill_loads_the_prefix_saves_the_rest_and_ships_once(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(
        plan("a", 4, load_tokens=64, save_from=2, save_tokens=100, on_layer=lambda layer: None)
    )
    req = request("a-x", "a", 100)
    assert c.get_num_new_matched_tokens(req, 0) == (64, False)
    c.update_state_after_alloc(req, blocks([10, 11, 12, 13]), 64)
    meta = c.build_connector_meta(step_new("a-x", [10, 11, 12, 13], 64, 36))
    assert [(x.block_id, x.block, x.sub, x.eager) for x in meta.loads] == [
        (10, 0, 0, False),
        (11, 1, 0, False),
    ]
    assert [(x.block_id, x.block) for x in meta.saves] == [(12, 2), (13, 3)]
    assert meta.ship == ["a"] and meta.loaded == ["a"]
    # Loaded once: a later query (preemption, recompute) gets nothing from the slots.
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    done, params = c.request_finished(req, [])
    assert done is False
    assert params == {
        "perigee": {"loaded_tokens": 64, "computed_prompt_tokens": 36, "saved_blocks": 2}
    }


def test_full_hit_loads_all_but_the_last_token_eagerly_into_the_last_block(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(
        plan("b", 4, load_tokens=128, save_from=4, save_tokens=128, on_layer=lambda layer: None)
    )
    req = request("b-x", "b", 128)
    assert c.get_num_new_matched_tokens(req, 0) == (127, False)
    c.update_state_after_alloc(req, blocks([5, 6, 7, 8]), 127)
    meta = c.build_connector_meta(step_new("b-x", [5, 6, 7, 8], 127, 1))
    assert [(x.block_id, x.eager) for x in meta.loads] == [
        (5, False),
        (6, False),
        (7, False),
        (8, True),
    ]
    assert meta.saves == [] and meta.ship == ["b"]


def test_decode_loads_every_prompt_position_and_saves_nothing(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(plan("d", 5, load_tokens=136))
    req = request("d-x", "d", 137)  # prompt + the first token
    assert c.get_num_new_matched_tokens(req, 0) == (136, False)
    c.update_state_after_alloc(req, blocks([1, 2, 3, 4, 9]), 136)
    meta = c.build_connector_meta(step_new("d-x", [1, 2, 3, 4, 9], 136, 1))
    assert [(x.block_id, x.eager) for x in meta.loads][-1] == (9, True)  # the tail block
    assert len(meta.loads) == 5 and meta.saves == [] and meta.ship == []


def test_a_shared_sequence_finding_every_full_block_cached_loads_nothing(bridge):
    # Sequence 1 of n (decode): vLLM's prefix cache holds the 4 full blocks sequence 0
    # loaded; the partial block after them is computed, not loaded: the slots are read
    # once for the n sequences.
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(plan("s", 5, load_tokens=136, shared_prefix=True))
    req = request("s-1", "s", 137)  # the prompt only: it samples its own first token
    assert c.get_num_new_matched_tokens(req, 128) == (0, False)
    meta = c.build_connector_meta(step_new("s-1", [1, 2, 3, 4, 9], 128, 9))
    assert meta.loads == [] and meta.loaded == ["s"]  # on_loaded after this step
    assert bridge.plans["s"].consumed
    # never from the slots afterwards (preempted, its pages evicted: recomputed)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert bridge.counters["connector_tokens_cached"] == 128
    assert bridge.counters["connector_loads"] == 0


def test_a_shared_sequence_loads_what_the_cache_lacks(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(plan("s", 5, load_tokens=136, shared_prefix=True))
    req = request("s-1", "s", 137)
    assert c.get_num_new_matched_tokens(req, 64) == (72, False)  # blocks 2.. evicted
    c.update_state_after_alloc(req, blocks([1, 2, 3, 4, 9]), 72)
    meta = c.build_connector_meta(step_new("s-1", [1, 2, 3, 4, 9], 136, 1))
    assert [x.block_id for x in meta.loads] == [3, 4, 9] and meta.loaded == ["s"]
    assert bridge.counters["connector_tokens_cached"] == 64
    assert bridge.counters["connector_loads"] == 1


def test_an_unshared_request_loads_its_tail_after_a_cache_hit(bridge):
    # Sequence 0 (or n = 1) resumed with its full blocks cached: the rest from the slots.
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(plan("d", 5, load_tokens=136))
    req = request("d-x", "d", 137)
    assert c.get_num_new_matched_tokens(req, 128) == (8, False)


def test_chunked_prefill_saves_each_chunk_and_ships_after_the_last(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER)
    bridge.add(
        plan("c", 4, load_tokens=0, save_from=0, save_tokens=100, on_layer=lambda layer: None)
    )
    req = request("c-x", "c", 100)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    m1 = c.build_connector_meta(step_new("c-x", [20, 21], 0, 64))
    assert [x.block_id for x in m1.saves] == [20, 21] and m1.ship == []
    m2 = c.build_connector_meta(step_cached("c-x", [22, 23], 64, 36))
    assert [x.block_id for x in m2.saves] == [22, 23] and m2.ship == ["c"]


def test_vllm_blocks_of_16_map_onto_sub_blocks_of_perigee_blocks(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER, vllm_bs=16)
    bridge.add(
        plan("r", 3, load_tokens=64, save_from=2, save_tokens=80, on_layer=lambda layer: None)
    )
    req = request("r-x", "r", 80)
    assert c.get_num_new_matched_tokens(req, 0) == (64, False)
    ids = [30, 31, 32, 33, 34]
    c.update_state_after_alloc(req, blocks(ids), 64)
    meta = c.build_connector_meta(step_new("r-x", ids, 64, 16))
    assert [(x.block_id, x.block, x.sub) for x in meta.loads] == [
        (30, 0, 0),
        (31, 0, 1),
        (32, 1, 0),
        (33, 1, 1),
    ]
    assert [(x.block_id, x.block, x.sub) for x in meta.saves] == [(34, 2, 0)]


# ---------------------------------------------------------------------- worker side


def kv_caches(num_blocks: int = 16, bs: int = 32) -> dict[str, torch.Tensor]:
    return {
        f"model.layers.{i}.self_attn.attn": torch.zeros(num_blocks, HEADS, bs, CONTENT)
        for i in range(LAYERS)
    }


def test_register_rejects_a_store_block_of_another_size():
    b = Bridge(block_bytes=1234, hash_block_size=HBS)
    key = register(b)
    b.registry_key = key
    try:
        w = connector(b, KVConnectorRole.WORKER)
        with pytest.raises(ValueError, match="--block-bytes 131072"):
            w.register_kv_caches(kv_caches())
    finally:
        unregister(key)


def run_step(w: PerigeeConnector, meta: PerigeeMeta, caches: dict[str, torch.Tensor]) -> None:
    """The hook order of one vLLM forward (sync load step)."""
    w.bind_connector_metadata(meta)
    w.start_load_kv(None)
    for name in sorted(caches, key=lambda n: int(n.split(".")[2])):
        w.wait_for_layer_load(name)
        w.save_kv_layer(name, caches[name], None)
    w.wait_for_save()
    w.clear_connector_metadata()


def test_saved_pages_land_layer_major_in_the_slots_and_load_back(bridge):
    from services.engine.vllm.connector import Copy

    w = connector(bridge, KVConnectorRole.WORKER)
    src = kv_caches()
    w.register_kv_caches(src)
    for i, t in enumerate(src.values()):
        t[3].fill_(i + 1)  # block 3 of layer i holds i + 1
    shipped: list[int] = []

    def on_layer(layer: int) -> Future:
        shipped.append(layer)
        f: Future = Future()
        f.set_result(None)
        return f

    p = plan("s", 1, save_from=0, save_tokens=32, on_layer=on_layer)
    bridge.add(p)
    run_step(w, PerigeeMeta(saves=[Copy(3, "s", 0, 0)], ship=["s"]), src)
    assert shipped == [0, 1, 2, 3] and p.error is None
    lb = page_bytes(32)
    raw = torch.frombuffer(p.slots[0], dtype=torch.float32)
    for layer in range(LAYERS):
        span = raw[layer * lb // 4 : (layer + 1) * lb // 4]
        assert torch.all(span == layer + 1)
    # Another engine loads them into block 7 of its cache, one layer at a time.
    dst = kv_caches()
    loaded: list[str] = []
    w2 = connector(bridge, KVConnectorRole.WORKER)
    w2.register_kv_caches(dst)
    p.on_loaded = lambda: loaded.append("s")
    run_step(w2, PerigeeMeta(loads=[Copy(7, "s", 0, 0)], loaded=["s"]), dst)
    for i, t in enumerate(dst.values()):
        assert torch.all(t[7] == i + 1) and torch.all(t[6] == 0)
    assert loaded == ["s"]


def test_eager_block_is_copied_before_the_layer_computes_into_it(bridge):
    from services.engine.vllm.connector import Copy

    w = connector(bridge, KVConnectorRole.WORKER)
    caches = kv_caches()
    w.register_kv_caches(caches)
    p = plan("e", 1, load_tokens=20)
    torch.frombuffer(p.slots[0], dtype=torch.float32).fill_(5.0)
    bridge.add(p)
    w.bind_connector_metadata(PerigeeMeta(loads=[Copy(2, "e", 0, 0, eager=True)], loaded=["e"]))
    w.start_load_kv(None)
    name = next(iter(caches))
    assert torch.all(caches[name][2] == 5.0)  # every layer, before the forward
    caches[name][2][:, 20:] = -1.0  # the forward writes the computed positions...
    w.wait_for_layer_load(name)
    assert torch.all(caches[name][2][:, 20:] == -1.0)  # ...and no later copy clobbers them
    w.wait_for_save()


def test_a_failed_hand_off_marks_the_plan_and_never_raises_into_vllm(bridge):
    from services.engine.vllm.connector import Copy

    w = connector(bridge, KVConnectorRole.WORKER)
    caches = kv_caches()
    w.register_kv_caches(caches)

    def on_layer(layer: int) -> Future:
        f: Future = Future()
        f.set_exception(ConnectionError("decode node gone"))
        return f

    p = plan("f", 1, save_from=0, save_tokens=32, on_layer=on_layer)
    bridge.add(p)
    run_step(w, PerigeeMeta(saves=[Copy(1, "f", 0, 0)], ship=["f"]), caches)
    assert isinstance(p.error, ConnectionError)
    assert bridge.counters["connector_errors"] == 4


# ---------------------------------------------------------------------- decode write-back


def test_decode_writes_back_each_vllm_block_in_the_step_that_completes_it(bridge):
    # Prompt of 40 tokens (perigee block 1 holds its tail), vLLM blocks of 16: a vLLM
    # block is copied out in the step whose forward computes its last position.
    c = connector(bridge, KVConnectorRole.SCHEDULER, vllm_bs=16)
    bridge.add(plan("w", 2, load_tokens=40, writeback_from=1, on_block=lambda j, b: None))
    req = request("w-x", "w", 41)
    assert c.get_num_new_matched_tokens(req, 0) == (40, False)
    ids = [50, 51, 52]
    c.update_state_after_alloc(req, blocks(ids), 40)
    m1 = c.build_connector_meta(step_new("w-x", ids, 40, 1))
    assert m1.saves == []  # 41 positions: [32, 48) not complete yet
    saves = []
    for computed in range(41, 64):  # one token per step
        m = c.build_connector_meta(step_cached("w-x", [53] if computed == 48 else [], computed, 1))
        saves += [(computed, x.block_id, x.block, x.sub, x.wb) for x in m.saves]
    # [32, 48) completes in the step computing position 47, [48, 64) in the one computing 63.
    assert saves == [(47, 52, 1, 0, True), (63, 53, 1, 1, True)]


def test_a_fully_loaded_tail_sub_block_is_written_back_in_the_first_step(bridge):
    c = connector(bridge, KVConnectorRole.SCHEDULER, vllm_bs=16)
    bridge.add(plan("t", 2, load_tokens=50, writeback_from=1, on_block=lambda j, b: None))
    req = request("t-x", "t", 51)
    c.get_num_new_matched_tokens(req, 0)
    ids = [60, 61, 62, 63]
    c.update_state_after_alloc(req, blocks(ids), 50)
    m1 = c.build_connector_meta(step_new("t-x", ids, 50, 1))
    # Positions [32, 48) were all loaded: the block holding them goes out at once.
    assert [(x.block_id, x.block, x.sub, x.wb) for x in m1.saves] == [(62, 1, 0, True)]


def test_written_back_pages_come_out_layer_major_once_the_block_is_whole(bridge):
    from services.engine.vllm.connector import Copy

    w = connector(bridge, KVConnectorRole.WORKER, vllm_bs=16)
    src = kv_caches(bs=16)
    w.register_kv_caches(src)
    for i, t in enumerate(src.values()):
        t[4].fill_(10 + i)
        t[5].fill_(20 + i)
    got: list[tuple[int, bytes]] = []
    p = plan("o", 2, writeback_from=1, on_block=lambda j, b: got.append((j, bytes(b))))
    bridge.add(p)
    run_step(w, PerigeeMeta(saves=[Copy(4, "o", 1, 0, wb=True)]), src)
    assert got == []  # half the block: nothing handed over yet
    run_step(w, PerigeeMeta(saves=[Copy(5, "o", 1, 1, wb=True)]), src)
    assert [j for j, _ in got] == [1] and p.error is None
    raw = torch.frombuffer(bytearray(got[0][1]), dtype=torch.float32)
    lb = page_bytes(16) // 4
    for layer in range(LAYERS):
        assert torch.all(raw[(2 * layer) * lb : (2 * layer + 1) * lb] == 10 + layer)
        assert torch.all(raw[(2 * layer + 1) * lb : (2 * layer + 2) * lb] == 20 + layer)
    assert p.slots[1] == memoryview(bytearray(len(p.slots[1])))  # the slots untouched
    assert bridge.counters["connector_blocks_written_back"] == 1


def arena_plan(key: str, mapping: bytearray, slots: list[int], offset: int = 0, **kw) -> Plan:
    """A plan whose slots are slices of one shared mapping, as an arena's are."""
    bb = LAYERS * HBS * HEADS * CONTENT * 4
    view = memoryview(mapping)
    return Plan(key=key, slots=[view[offset + s * bb : offset + (s + 1) * bb] for s in slots], **kw)


@pytest.mark.parametrize("offset", [0, 4], ids=["whole-rows", "misaligned"])
def test_a_layers_pages_move_as_one_batch_per_mapping_byte_for_byte(bridge, offset):
    """Several plans' blocks in one mapping, two vLLM blocks per perigee block: the
    batched save puts each page where the page-by-page layout says (layer l, sub s of
    slot j at (l * 2 + s) pages into it), and the load brings every page back. A mapping
    whose slots are not whole rows (offset 4) takes the page-by-page way, with the same
    bytes."""
    from services.engine.vllm.connector import Copy

    bb = LAYERS * HBS * HEADS * CONTENT * 4
    lb = page_bytes(16)
    g = torch.Generator().manual_seed(3)
    src = kv_caches(bs=16)
    for t in src.values():
        t.copy_(torch.randn(t.shape, generator=g))
    w = connector(bridge, KVConnectorRole.WORKER, vllm_bs=16)
    w.register_kv_caches(src)
    mapping = bytearray(offset + 6 * bb)
    a = arena_plan("a", mapping, [4, 1], offset, save_from=0, save_tokens=64)
    b = arena_plan("b", mapping, [2], offset, save_from=0, save_tokens=32)
    bridge.add(a)
    bridge.add(b)
    # vLLM blocks (a: 9, 3 | 0, 7), (b: 5, 6)
    saves = [Copy(9, "a", 0, 0), Copy(3, "a", 0, 1), Copy(0, "a", 1, 0), Copy(7, "a", 1, 1)]
    saves += [Copy(5, "b", 0, 0), Copy(6, "b", 0, 1)]
    run_step(w, PerigeeMeta(saves=saves), src)
    assert a.error is None and b.error is None
    names = sorted(src, key=lambda n: int(n.split(".")[2]))
    for c in saves:
        p = a if c.key == "a" else b
        raw = bytes(p.slots[c.block])
        for layer, name in enumerate(names):
            at = (layer * 2 + c.sub) * lb
            want = src[name][c.block_id].contiguous().view(torch.uint8).numpy().tobytes()
            assert raw[at : at + lb] == want, (c, layer)
    assert bridge.counters["connector_layer_blocks_saved"] == len(saves) * LAYERS
    untouched = [0, 3, 5]  # slots no plan holds
    for s in untouched:
        assert mapping[offset + s * bb : offset + (s + 1) * bb] == bytearray(bb)
    # Another engine loads them into other blocks of its cache.
    dst = kv_caches(bs=16)
    w2 = connector(bridge, KVConnectorRole.WORKER, vllm_bs=16)
    w2.register_kv_caches(dst)
    moved = {9: 1, 3: 2, 0: 4, 7: 8, 5: 10, 6: 11}
    loads = [Copy(moved[c.block_id], c.key, c.block, c.sub) for c in saves]
    run_step(w2, PerigeeMeta(loads=loads), dst)
    for name in names:
        for was, now in moved.items():
            assert torch.equal(dst[name][now], src[name][was])
        others = [i for i in range(dst[name].shape[0]) if i not in moved.values()]
        assert not dst[name][others].any()
    assert bridge.counters["connector_layer_blocks_loaded"] == len(loads) * LAYERS


def test_a_steps_copies_are_grouped_once_not_per_layer(bridge, monkeypatch):
    """The grouping by mapping (a Python pass over every page) runs once a step: the
    layers differ only in the row their pages start at. A new step groups anew."""
    from services.engine.vllm import page_batch
    from services.engine.vllm.connector import Copy

    calls = []
    real = page_batch.host_rows
    monkeypatch.setattr(page_batch, "host_rows", lambda *a: calls.append(1) or real(*a))
    bb = LAYERS * HBS * HEADS * CONTENT * 4
    src = kv_caches()
    w = connector(bridge, KVConnectorRole.WORKER)
    w.register_kv_caches(src)
    mapping = bytearray(3 * bb)
    bridge.add(arena_plan("a", mapping, [2, 0], save_from=0, save_tokens=64))
    saves = [Copy(5, "a", 0, 0), Copy(1, "a", 1, 0)]
    run_step(w, PerigeeMeta(saves=saves), src)
    assert len(calls) == 1  # one mapping, one step: once, for all LAYERS layers
    names = sorted(src, key=lambda n: int(n.split(".")[2]))
    for layer, name in enumerate(names):
        for c, slot in zip(saves, (2, 0), strict=True):
            at = slot * bb + layer * page_bytes(32)
            want = src[name][c.block_id].contiguous().view(torch.uint8).numpy().tobytes()
            assert mapping[at : at + page_bytes(32)] == want, (c, layer)
    run_step(w, PerigeeMeta(saves=saves), src)
    assert len(calls) == 2


def test_a_batch_that_fails_fails_its_plans_and_never_raises_into_vllm(bridge, monkeypatch):
    from services.engine.vllm import page_batch
    from services.engine.vllm.connector import Copy

    w = connector(bridge, KVConnectorRole.WORKER)
    caches = kv_caches()
    w.register_kv_caches(caches)
    p = plan("f", 1, save_from=0, save_tokens=32)
    bridge.add(p)

    def broken(*a, **k):
        raise RuntimeError("device lost")

    monkeypatch.setattr(page_batch, "save", broken)
    run_step(w, PerigeeMeta(saves=[Copy(1, "f", 0, 0)]), caches)
    assert isinstance(p.error, RuntimeError) and bridge.counters["connector_errors"] >= 1


class _Stream:
    def __init__(self) -> None:
        self.syncs = 0

    def synchronize(self) -> None:
        self.syncs += 1


def test_queued_loads_wait_once_per_step_and_a_shipping_layer_at_once(bridge, monkeypatch):
    """Where copies are queued on a CUDA stream (pending): a step with loads only waits
    for the stream once, at its end; a step that ships waits at every layer, before the
    layer's bytes leave. (CPU pages here; the pending flag set as a CUDA load sets it.)"""
    from services.engine.vllm.connector import Copy

    stream = _Stream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: stream)
    w = connector(bridge, KVConnectorRole.WORKER)
    caches = kv_caches()
    w.register_kv_caches(caches)
    names = sorted(caches, key=lambda n: int(n.split(".")[2]))
    p = plan("l", 1, load_tokens=32)
    bridge.add(p)

    def step(meta: PerigeeMeta, per_layer: list[int]) -> None:
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for name in names:
            w.wait_for_layer_load(name)
            w._pending = True  # what the layer's queued CUDA copies leave
            w.save_kv_layer(name, caches[name], None)
            per_layer.append(stream.syncs)
        w.wait_for_save()
        w.clear_connector_metadata()

    seen: list[int] = []
    step(PerigeeMeta(loads=[Copy(1, "l", 0, 0)], loaded=["l"]), seen)
    assert seen == [0] * LAYERS and stream.syncs == 1
    q = plan("s", 1, save_from=0, save_tokens=32, on_layer=lambda layer: None)
    bridge.add(q)
    stream.syncs, seen = 0, []
    step(PerigeeMeta(saves=[Copy(2, "s", 0, 0)], ship=["s"]), seen)
    assert seen == list(range(1, LAYERS + 1))


def test_a_small_mapping_goes_page_by_page_on_cuda(bridge, monkeypatch):
    """On CUDA a few pages go one queued copy each (a batch's fixed cost loses there:
    CUDA_BATCH_MIN_PAGES); from the minimum on, one batch a layer. Same bytes either way.
    (CPU pages, with the CUDA minimum set as register_kv_caches sets it for CUDA.)"""
    from services.engine.vllm import connector as conn
    from services.engine.vllm import page_batch
    from services.engine.vllm.connector import Copy

    batched = []
    real = page_batch.save
    monkeypatch.setattr(page_batch, "save", lambda *a: batched.append(1) or real(*a))
    bb = LAYERS * HBS * HEADS * CONTENT * 4
    src = kv_caches()
    names = sorted(src, key=lambda n: int(n.split(".")[2]))
    for n_pages, want_batches in ((2, 0), (3, LAYERS)):
        batched.clear()
        w = connector(bridge, KVConnectorRole.WORKER)
        w.register_kv_caches(src)
        assert w._batch_min == 1  # CPU pages: always batched
        w._batch_min = 3
        mapping = bytearray(4 * bb)
        key = f"m{n_pages}"
        slots = list(range(n_pages))
        bridge.add(arena_plan(key, mapping, slots, save_from=0, save_tokens=32 * n_pages))
        saves = [Copy(5 + i, key, i, 0) for i in range(n_pages)]
        run_step(w, PerigeeMeta(saves=saves), src)
        assert len(batched) == want_batches
        for layer, name in enumerate(names):
            for c, slot in zip(saves, slots, strict=True):
                at = slot * bb + layer * page_bytes(32)
                want = src[name][c.block_id].contiguous().view(torch.uint8).numpy().tobytes()
                assert mapping[at : at + page_bytes(32)] == want, (n_pages, c, layer)
    assert conn.CUDA_BATCH_MIN_PAGES > 1
