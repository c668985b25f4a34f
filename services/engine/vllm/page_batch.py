"""A layer's page copies between vLLM's KV cache and the store's arena as one batch.

Copied page by page, a 5,449-token prompt is 171 pages a layer, 5,130 ``copy_`` calls
over 30 layers. On CUDA each costs its launch more than its 48 KiB: the first H200 run
(issue 28) measured 1-2 GB/s against a 27-55 GB/s ceiling, and prefill and decode
spent more time in these copies than in the model. Batched, one layer's pages move
with a handful of operations whatever their number:

    save  ``kv.index_select`` of the layer's blocks (one gather kernel), one copy into
          a page-locked staging buffer, and, once the stream has run it, one
          scatter of its rows into the arena's pages (numpy: a memcpy per row);
    load  one ``index_select`` of the arena's pages into a page-locked staging buffer,
          one copy to the device, one ``index_copy_`` into the layer's blocks.

The arena is seen as rows of ``page_bytes``: a slot holds one perigee block, every layer,
layer-major, and every slot starts at a multiple of the block size, so every page of
every slot is a whole row (see :mod:`.kv_pages`). On CPU the staging is skipped. No
vLLM import: the GPU tests and ``perigee bench ship --cuda`` use it without an engine.
"""

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


def host_rows(base: Any, page_bytes: int) -> torch.Tensor:
    """The mapping ``base`` (an mmap, a bytearray: what slot views slice) as rows of
    ``page_bytes``; no copy. Made per batch, so no export outlives it."""
    flat = torch.frombuffer(base, dtype=torch.uint8)
    n = flat.numel() // page_bytes
    return flat[: n * page_bytes].view(n, page_bytes)


def first_row(raw: torch.Tensor, rows: torch.Tensor, page_bytes: int) -> int | None:
    """The row of ``rows`` where the slot ``raw`` starts, or None where it is not a
    whole row of that mapping (a caller then copies its pages one by one)."""
    off = raw.data_ptr() - rows.data_ptr()
    if off < 0 or off % page_bytes or off + raw.numel() > rows.numel():
        return None
    return off // page_bytes


def _as_bytes(pages: torch.Tensor) -> torch.Tensor:
    return pages.reshape(pages.shape[0], -1).view(torch.uint8)


def _host_blocks(kv_layer: torch.Tensor) -> np.ndarray | None:
    """A CPU layer as a numpy array of block rows (a view), or None where its blocks are
    not contiguous rows."""
    if not kv_layer.is_contiguous():
        return None
    return _as_bytes(kv_layer).numpy()


# Host copies go through numpy's fancy indexing: a memcpy per row (~15 GB/s here),
# where torch's index_copy_ on uint8 rows moved 1.3 GB/s.


def _on(device: torch.device, block_ids: list[int] | torch.Tensor) -> torch.Tensor:
    """The ids as a tensor on ``device`` (one made from a list waits for the stream)."""
    if isinstance(block_ids, torch.Tensor):
        return block_ids
    return torch.tensor(block_ids, dtype=torch.long, device=device)


def save(
    kv_layer: torch.Tensor,
    block_ids: list[int] | torch.Tensor,
    rows: torch.Tensor,
    to_rows: Sequence[int] | np.ndarray,
) -> Callable[[], None] | None:
    """Blocks ``block_ids`` of the layer into ``rows[to_rows]``. On CUDA the device copy
    is queued and the host part returned: call it once the current stream has been
    synchronized. On CPU it is done here and None is returned."""
    if kv_layer.is_cuda:
        got = _as_bytes(kv_layer.index_select(0, _on(kv_layer.device, block_ids)))
        host = torch.empty(got.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(got, non_blocking=True)
        dst = np.asarray(to_rows)
        return lambda: rows.numpy().__setitem__(dst, host.numpy())
    blocks = _host_blocks(kv_layer)
    if blocks is None:
        got = _as_bytes(kv_layer.index_select(0, _on(kv_layer.device, block_ids)))
        rows.numpy()[to_rows] = got.numpy()
    else:
        rows.numpy()[to_rows] = blocks[block_ids]
    return None


def load(
    kv_layer: torch.Tensor,
    block_ids: list[int] | torch.Tensor,
    rows: torch.Tensor,
    from_rows: Sequence[int] | np.ndarray,
) -> torch.Tensor | None:
    """``rows[from_rows]`` into blocks ``block_ids`` of the layer. On CUDA the copies are
    queued on the current stream; the page-locked staging buffer is returned, to be kept
    until the stream has run them."""
    n = len(block_ids)
    src = torch.as_tensor(np.asarray(from_rows, dtype=np.int64))
    if not kv_layer.is_cuda:
        blocks = _host_blocks(kv_layer)
        if blocks is not None:
            blocks[block_ids] = rows.numpy()[from_rows]
            return None
    host = torch.empty((n, rows.shape[1]), dtype=torch.uint8, pin_memory=kv_layer.is_cuda)
    torch.index_select(rows, 0, src, out=host)
    got = host.to(kv_layer.device, non_blocking=True)
    pages = got.view(kv_layer.dtype).view(n, *kv_layer.shape[1:])
    kv_layer.index_copy_(0, _on(kv_layer.device, block_ids), pages)
    return host if kv_layer.is_cuda else None
