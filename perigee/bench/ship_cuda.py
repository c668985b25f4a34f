"""``perigee bench ship --cuda``: the connector's copies between vLLM's paged KV cache
on CUDA and the store's shared-memory arena, the arena pageable against page-locked
(``cudaHostRegister``, services.engine.vllm.kv_pages), in one run. Without a GPU the
same pages on CPU, page by page against batched (the pinned kinds need CUDA).

A prompt of ``tokens`` tokens is ``ceil(tokens / 32)`` perigee blocks of the default
model's KV (SmolLM2-135M-Instruct, float32: 30 layers of 32 tokens x K|V x 3 heads x
64). Per size and round, both ways, page by page as the connector copies them (one
vLLM block of one layer per ``copy_``, blocking, layer-major in the slot):

    save  CUDA pages -> slots (a prefill worker's save_kv_layer)
    load  slots -> CUDA pages (a decode worker's wait_for_layer_load)

on two mappings of the same arena, one left pageable and one page-locked, rounds
alternating; each copy waits for itself (``pageable``, ``pinned``: the connector before
page-locking was queued), or, page-locked, the copies of a layer are queued and waited
for once per layer (``pinned_queued``: the connector until page_batch), and ``batched``:
a layer's pages in one gather, one copy through page-locked staging and one host
scatter (services.engine.vllm.page_batch, the connector now). Beside them the ceiling: one ``copy_`` of the same bytes between a CUDA
tensor and torch's own pinned host buffer. Medians over ``repeats`` rounds after a
warm-up; GB/s is 10^9 bytes/s."""

import statistics
import time

import torch

from services.engine.vllm import page_batch
from services.engine.vllm.kv_pages import ArenaPinner, page_view
from services.store.arena import Arena

LAYERS, BS, HEADS, HD = 30, 32, 3, 64
PAGE = (2, BS, HEADS, HD)


def _copies(kv: list[torch.Tensor], raws: list[torch.Tensor], save: bool, queued: bool) -> None:
    like = kv[0][0]
    nbytes = like.numel() * like.element_size()
    for layer in range(len(kv)):
        for bid, raw in enumerate(raws):
            page = kv[layer][bid]
            span = page_view(raw, layer, 0, 1, nbytes, page)
            if save:
                span.copy_(page, non_blocking=queued)
            else:
                page.copy_(span, non_blocking=queued)
        if queued:  # the connector waits once per layer, before the layer ships
            torch.cuda.current_stream().synchronize()
    _sync()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _batched(kv: list[torch.Tensor], rows: torch.Tensor, firsts: list[int], save: bool) -> None:
    ids = list(range(len(firsts)))
    for layer in range(len(kv)):
        at = [f + layer for f in firsts]
        if save:
            rest = page_batch.save(kv[layer], ids, rows, at)
            if rest is not None:
                torch.cuda.current_stream().synchronize()  # as the connector's _settle
                rest()
        else:
            page_batch.load(kv[layer], ids, rows, at)
    _sync()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(tokens: list[int], repeats: int, device: str | None = None) -> dict:
    """On CUDA where there is a GPU; else CPU pages, page by page against batched (the
    copies perigee up's CPU workers make), with no page-locked kinds."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    page_bytes = int(torch.tensor(PAGE).prod()) * 4
    block_bytes = LAYERS * page_bytes
    most = max(-(-n // BS) for n in tokens)
    store = Arena.create(most, block_bytes)
    pageable = Arena.attach(store.name, most, block_bytes)
    locked = Arena.attach(store.name, most, block_bytes)
    pinner = ArenaPinner(enabled=cuda)
    pinned = pinner.pin(locked.slot(0))
    results: list[dict] = []
    try:
        kv = [torch.randn((most, *PAGE), device=device) for _ in range(LAYERS)]
        for n in tokens:
            blocks = -(-n // BS)
            size = blocks * block_bytes
            arenas = {"pageable": pageable, "pinned": locked, "pinned_queued": locked}
            raws = {
                k: [torch.frombuffer(a.slot(i), dtype=torch.uint8) for i in range(blocks)]
                for k, a in arenas.items()
            }
            kv_n = [t[:blocks] for t in kv]
            rows = page_batch.host_rows(pageable.slot(0).obj, page_bytes)
            firsts = [page_batch.first_row(raw, rows, page_bytes) for raw in raws["pageable"]]
            assert None not in firsts  # every slot is whole rows of its mapping
            host = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
            dev = torch.empty(size, dtype=torch.uint8, device=device)
            runs: dict[tuple[str, str], list[float]] = {}
            for r in range(repeats + 1):
                kinds = ("pageable", "pinned", "pinned_queued") if cuda else ("pageable",)
                for kind in kinds if r % 2 else kinds[::-1]:
                    q = kind == "pinned_queued"
                    for way, save in (("save", True), ("load", False)):
                        t = _timed(lambda r=raws[kind], s=save, kv=kv_n, q=q: _copies(kv, r, s, q))
                        if r:
                            runs.setdefault((kind, way), []).append(t)
                for way, save in (("save", True), ("load", False)):
                    t = _timed(lambda s=save, kv=kv_n, w=rows, f=firsts: _batched(kv, w, f, s))
                    if r:
                        runs.setdefault(("batched", way), []).append(t)
                for way, (dst, src) in (("save", (host, dev)), ("load", (dev, host))):
                    t = _timed(lambda d=dst, s=src: (d.copy_(s), _sync()))
                    if r:
                        runs.setdefault(("ceiling", way), []).append(t)
            # the bytes that crossed, checked once: a page-locked save equals the pages
            _copies(kv_n, raws["pinned"], True, cuda)
            ok = all(
                torch.equal(
                    page_view(raws["pinned"][b], layer, 0, 1, page_bytes, kv_n[layer][b]),
                    kv_n[layer][b].cpu(),
                )
                for layer in (0, LAYERS - 1)
                for b in (0, blocks - 1)
            )
            for (kind, way), ts in runs.items():
                results.append(
                    {
                        "arena": kind,
                        "direction": way,
                        "tokens": n,
                        "size_bytes": size,
                        "copies": 1 if kind == "ceiling" else blocks * LAYERS,
                        "gbps": round(size / statistics.median(ts) / 1e9, 3),
                        "runs": len(ts),
                        "checked": ok,
                    }
                )
    finally:
        pinner.close()
        for a in (pageable, locked, store):
            a.close()
        store.unlink()
    by = {(r["arena"], r["direction"], r["tokens"]): r["gbps"] for r in results}
    ratios: dict[str, dict[str, float]] = {"pinned": {}, "pinned_queued": {}, "batched": {}}
    for (kind, way, n), g in by.items():
        if kind in ratios:
            ratios[kind][f"{way}@{n}"] = round(g / by[("pageable", way, n)], 2)
    name = torch.cuda.get_device_name(0) if cuda else f"CPU ({torch.get_num_threads()} threads)"

    return {
        "status": "ok",
        "device": name,
        "torch": torch.__version__,
        "arena_pinned": pinned,
        "page_bytes": page_bytes,
        "block_bytes": block_bytes,
        "results": results,
        "pinned_over_pageable": ratios,
    }


def render(rep: dict) -> str:
    if rep.get("status") != "ok":
        return f"cuda copies: {rep.get('status')}"
    lines = [f"KV pages <-> arena on {rep['device']} (GB/s; page {rep['page_bytes']} B)"]
    head = ("tokens", "way", "pageable", "pinned", "queued", "batched", "ceiling")
    head += ("x pin", "x queued", "x batched")
    lines.append("".join(f"{h:>10}" for h in head))
    by = {(r["arena"], r["direction"], r["tokens"]): r["gbps"] for r in rep["results"]}
    kinds = ("pageable", "pinned", "pinned_queued", "batched", "ceiling")
    x = rep["pinned_over_pageable"]
    for n in sorted({r["tokens"] for r in rep["results"]}):
        for way in ("save", "load"):
            row = (
                n,
                way,
                *(by.get((k, way, n), "-") for k in kinds),
                *(x[k].get(f"{way}@{n}", "-") for k in ("pinned", "pinned_queued", "batched")),
            )
            lines.append("".join(f"{v:>10}" for v in row))
    return "\n".join(lines)
