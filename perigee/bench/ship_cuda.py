"""``perigee bench ship --cuda``: the connector's copies between vLLM's paged KV cache
on CUDA and the store's shared-memory arena, the arena pageable against page-locked
(``cudaHostRegister``, services.engine.vllm.kv_pages), in one run.

A prompt of ``tokens`` tokens is ``ceil(tokens / 32)`` perigee blocks of the default
model's KV (SmolLM2-135M-Instruct, float32: 30 layers of 32 tokens x K|V x 3 heads x
64). Per size and round, both ways, page by page as the connector copies them (one
vLLM block of one layer per ``copy_``, blocking, layer-major in the slot):

    save  CUDA pages -> slots (a prefill worker's save_kv_layer)
    load  slots -> CUDA pages (a decode worker's wait_for_layer_load)

on two mappings of the same arena, one left pageable and one page-locked, rounds
alternating; each copy waits for itself (``pageable``, ``pinned``: the connector before
page-locking was queued), or, page-locked, the copies of a layer are queued and waited
for once per layer (``pinned_queued``: the connector now). Beside them the ceiling: one ``copy_`` of the same bytes between a CUDA
tensor and torch's own pinned host buffer. Medians over ``repeats`` rounds after a
warm-up; GB/s is 10^9 bytes/s."""

import statistics
import time

import torch

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
    torch.cuda.synchronize()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(tokens: list[int], repeats: int, device: str = "cuda") -> dict:
    if not torch.cuda.is_available():
        return {"status": "unavailable: torch.cuda.is_available() is False"}
    page_bytes = int(torch.tensor(PAGE).prod()) * 4
    block_bytes = LAYERS * page_bytes
    most = max(-(-n // BS) for n in tokens)
    store = Arena.create(most, block_bytes)
    pageable = Arena.attach(store.name, most, block_bytes)
    locked = Arena.attach(store.name, most, block_bytes)
    pinner = ArenaPinner()
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
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(size, dtype=torch.uint8, device=device)
            runs: dict[tuple[str, str], list[float]] = {}
            for r in range(repeats + 1):
                kinds = ("pageable", "pinned", "pinned_queued")
                for kind in kinds if r % 2 else kinds[::-1]:
                    q = kind == "pinned_queued"
                    for way, save in (("save", True), ("load", False)):
                        t = _timed(lambda r=raws[kind], s=save, kv=kv_n, q=q: _copies(kv, r, s, q))
                        if r:
                            runs.setdefault((kind, way), []).append(t)
                for way, (dst, src) in (("save", (host, dev)), ("load", (dev, host))):
                    t = _timed(lambda d=dst, s=src: (d.copy_(s), torch.cuda.synchronize()))
                    if r:
                        runs.setdefault(("ceiling", way), []).append(t)
            # the bytes that crossed, checked once: a page-locked save equals the pages
            _copies(kv_n, raws["pinned"], True, True)
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
    ratios: dict[str, dict[str, float]] = {"pinned": {}, "pinned_queued": {}}
    for (kind, way, n), g in by.items():
        if kind in ratios:
            ratios[kind][f"{way}@{n}"] = round(g / by[("pageable", way, n)], 2)

    return {
        "status": "ok",
        "device": torch.cuda.get_device_name(0),
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
    lines = [f"CUDA pages <-> arena on {rep['device']} (GB/s; page {rep['page_bytes']} B)"]
    head = ("tokens", "way", "pageable", "pinned", "queued", "ceiling", "x pin", "x queued")
    lines.append("".join(f"{h:>9}" for h in head))
    by = {(r["arena"], r["direction"], r["tokens"]): r["gbps"] for r in rep["results"]}
    x = rep["pinned_over_pageable"]
    for n in sorted({r["tokens"] for r in rep["results"]}):
        for way in ("save", "load"):
            row = (
                n,
                way,
                by[("pageable", way, n)],
                by[("pinned", way, n)],
                by[("pinned_queued", way, n)],
                by[("ceiling", way, n)],
                x["pinned"][f"{way}@{n}"],
                x["pinned_queued"][f"{way}@{n}"],
            )
            lines.append("".join(f"{v:>9}" for v in row))
    return "\n".join(lines)
