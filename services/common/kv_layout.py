"""How one block's bytes are laid out, shared by every worker that reads or writes KV.

A block slot holds ``block_size`` tokens for every layer, layer-major so that one
layer of one block is a contiguous span (shipping layer by layer copies whole spans):

    slot = [layer 0 | layer 1 | ... ]     layer = [K or V][token][kv_head * head_dim]

The store sees only ``block_bytes``-sized slots; only workers know this shape.
"""

from collections.abc import Sequence

import numpy as np

from services.common.hashing import num_blocks
from services.common.model_spec import ModelSpec


class KVLayout:
    """Where each layer, K/V half and token of a block sits in its slot's bytes."""

    def __init__(self, spec: ModelSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.dtype = np.dtype(spec.dtype if spec.dtype != "bfloat16" else "uint16")
        self.row = spec.num_kv_heads * spec.head_dim  # elements per token per K or V
        self.layer_bytes = spec.layer_block_bytes(block_size)
        self.block_bytes = spec.block_bytes(block_size)

    def layer_span(self, layer: int) -> tuple[int, int]:
        """Byte range of ``layer`` inside a block slot."""
        start = layer * self.layer_bytes
        return start, start + self.layer_bytes

    def layer_view(self, slot_buf: memoryview | np.ndarray, layer: int) -> np.ndarray:
        """A writable [2, block_size, row] array over one layer of one slot."""
        start, end = self.layer_span(layer)
        raw = np.frombuffer(slot_buf, dtype=np.uint8)[start:end]
        return raw.view(self.dtype).reshape(2, self.block_size, self.row)

    def read_tokens(
        self, slots: Sequence[memoryview], layer: int, start: int, end: int
    ) -> np.ndarray:
        """KV of token positions [start, end) of ``layer``, gathered across blocks: [2, n, row]."""
        out = np.empty((2, end - start, self.row), dtype=self.dtype)
        pos = start
        while pos < end:
            b, off = divmod(pos, self.block_size)
            n = min(self.block_size - off, end - pos)
            out[:, pos - start : pos - start + n] = self.layer_view(slots[b], layer)[
                :, off : off + n
            ]
            pos += n
        return out

    def write_tokens(
        self, slots: Sequence[memoryview], layer: int, start: int, kv: np.ndarray
    ) -> None:
        """Scatter ``kv`` ([2, n, row]) into token positions starting at ``start``."""
        end = start + kv.shape[1]
        pos = start
        while pos < end:
            b, off = divmod(pos, self.block_size)
            n = min(self.block_size - off, end - pos)
            self.layer_view(slots[b], layer)[:, off : off + n] = kv[
                :, pos - start : pos - start + n
            ]
            pos += n


def store_too_small(capacity_blocks: int, max_model_len: int, block_size: int) -> str:
    """Why a store of ``capacity_blocks`` cannot hold one maximum-length request ("" when
    it can): such a store would refuse that request after it was accepted."""
    need = num_blocks(max_model_len, block_size)
    if capacity_blocks >= need:
        return ""
    return (
        f"the store has {capacity_blocks} blocks of {block_size} tokens but one "
        f"request of max_model_len {max_model_len} tokens needs {need}: start the store "
        f"with --capacity-blocks {need} or more"
    )
