"""vLLM's paged KV cache on CUDA to and from the store's shared-memory arena, the
connector's copies (services.engine.vllm.kv_pages), with the arena page-locked and not.

The pages are CUDA tensors in a paged layout (blocks, K|V, tokens, heads, head_dim),
bfloat16; the slots are a real Arena's, created here and attached as a worker
attaches. The same test runs on CPU pages (no pinning) wherever it runs, so the
layout checks hold without a GPU too."""

import numpy as np
import pytest
import torch

from services.engine.vllm.kv_pages import ArenaPinner, page_view
from services.store.arena import Arena
from tests.gpu.helpers import gpu_marks

LAYERS, PER_BLOCK, BS, HEADS, HD = 3, 2, 16, 2, 64  # a perigee block = 2 vLLM blocks
PAGE = (2, BS, HEADS, HD)
PAGE_BYTES = int(np.prod(PAGE)) * 2  # bfloat16
BLOCK_BYTES = LAYERS * PER_BLOCK * PAGE_BYTES

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=gpu_marks()),
]


def kv_cache(device: str, blocks: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn((blocks, *PAGE), generator=g).to(torch.bfloat16).to(device)
        for _ in range(LAYERS)
    ]


def save(kv, block_ids: list[int], slot: memoryview) -> None:
    raw = torch.frombuffer(slot, dtype=torch.uint8)
    for layer in range(LAYERS):
        for sub, bid in enumerate(block_ids):
            page = kv[layer][bid]
            page_view(raw, layer, sub, PER_BLOCK, PAGE_BYTES, page).copy_(page)


def load(kv, block_ids: list[int], slot: memoryview) -> None:
    raw = torch.frombuffer(slot, dtype=torch.uint8)
    for layer in range(LAYERS):
        for sub, bid in enumerate(block_ids):
            page = kv[layer][bid]
            page.copy_(page_view(raw, layer, sub, PER_BLOCK, PAGE_BYTES, page))


def host_bytes(t: torch.Tensor) -> bytes:
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("pin", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("device", DEVICES)
def test_pages_to_slots_and_back_byte_for_byte(device, pin):
    store = Arena.create(4, BLOCK_BYTES)
    worker = Arena.attach(store.name, 4, BLOCK_BYTES)  # what a worker maps
    pinner = ArenaPinner(enabled=pin and device == "cuda")  # as the connector decides
    try:
        src = kv_cache(device, 8, seed=1)
        pinned = pinner.pin(worker.slot(1))
        assert pinned == (pin and device == "cuda")
        if pinned:
            assert torch.frombuffer(worker.slot(3), dtype=torch.uint8).is_pinned()
            assert pinner.pin(worker.slot(2)) and pinner.pinned_bytes == len(worker.buf)
        save(src, [5, 2], worker.slot(1))
        # layer-major in the slot: layer l, sub-block s at (l * PER_BLOCK + s) * PAGE_BYTES
        want = b"".join(host_bytes(src[layer][b]) for layer in range(LAYERS) for b in (5, 2))
        assert bytes(store.slot(1)) == want
        dst = [torch.zeros_like(t) for t in src]
        load(dst, [0, 7], worker.slot(1))
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][0], src[layer][5])
            assert torch.equal(dst[layer][7], src[layer][2])
            assert not dst[layer][1:7].any()
    finally:
        pinner.close()
        worker.close()
        store.close()
        store.unlink()


@pytest.mark.parametrize("device", DEVICES)
def test_pinner_keeps_one_registration_per_mapping(device):
    store = Arena.create(2, BLOCK_BYTES)
    a = Arena.attach(store.name, 2, BLOCK_BYTES)
    b = Arena.attach(store.name, 2, BLOCK_BYTES)  # a restarted store's new mapping
    on = device == "cuda"
    pinner = ArenaPinner(enabled=on)
    try:
        assert pinner.enabled == on
        assert [pinner.pin(a.slot(0)), pinner.pin(a.slot(1)), pinner.pin(b.slot(0))] == [on] * 3
        assert pinner.pinned_bytes == (2 * len(a.buf) if on else 0)
        pinner.close()
        assert pinner.pinned_bytes == 0
        if on:
            assert not torch.frombuffer(a.slot(0), dtype=torch.uint8).is_pinned()
    finally:
        pinner.close()
        for x in (a, b, store):
            x.close()
        store.unlink()


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_batched_to_slots_and_back_equals_page_by_page(device):
    """page_batch, as the connector runs it: per layer one gather into staging, the
    host part once the stream has run (CUDA), then the load the same way. The slots
    hold what the page-by-page save writes, and the load restores every page."""
    from services.engine.vllm import page_batch

    store = Arena.create(6, BLOCK_BYTES)
    worker = Arena.attach(store.name, 6, BLOCK_BYTES)
    try:
        src = kv_cache(device, 8, seed=2)
        rows = page_batch.host_rows(worker.slot(0).obj, PAGE_BYTES)
        # perigee blocks -> slots 4 and 1; vLLM blocks (5, 2) and (7, 0)
        where = {4: [5, 2], 1: [7, 0]}
        for layer in range(LAYERS):
            ids, at = [], []
            for slot, bids in where.items():
                raw = torch.frombuffer(worker.slot(slot), dtype=torch.uint8)
                first = page_batch.first_row(raw, rows, PAGE_BYTES)
                assert first == slot * LAYERS * PER_BLOCK
                ids += bids
                at += [first + layer * PER_BLOCK + sub for sub in range(PER_BLOCK)]
            rest = page_batch.save(src[layer], ids, rows, at)
            assert (rest is not None) == (device == "cuda")
            if rest is not None:
                torch.cuda.current_stream().synchronize()
                rest()
        check = Arena.create(2, BLOCK_BYTES)
        try:
            for slot, bids in where.items():
                save(src, bids, check.slot(0))
                assert bytes(store.slot(slot)) == bytes(check.slot(0))
        finally:
            check.close()
            check.unlink()
        dst = [torch.zeros_like(t) for t in src]
        moved = {5: 0, 2: 3, 7: 6, 0: 1}
        for layer in range(LAYERS):
            ids, at = [], []
            for slot, bids in where.items():
                ids += [moved[b] for b in bids]
                at += [slot * LAYERS * PER_BLOCK + layer * PER_BLOCK + s for s in range(PER_BLOCK)]
            staged = page_batch.load(dst[layer], ids, rows, at)
            assert (staged is not None) == (device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        for layer in range(LAYERS):
            for was, now in moved.items():
                assert torch.equal(dst[layer][now], src[layer][was])
            assert not dst[layer][[2, 4, 5, 7]].any()
    finally:
        del rows
        worker.close()
        store.close()
        store.unlink()
