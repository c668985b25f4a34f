"""Chained block hashes: hash(parent or NONE_HASH, tokens, extra), full blocks only.

Stable across processes and machines (blake2b, not Python's salted ``hash``), so a
gateway, a conductor and a store agree on every key.
"""

import hashlib
from collections.abc import Sequence

import numpy as np

NONE_HASH_SEED = b"perigee-none-hash-v1"
NONE_HASH = int.from_bytes(hashlib.blake2b(NONE_HASH_SEED, digest_size=8).digest(), "little")


def hash_block(parent: int | None, tokens: Sequence[int] | np.ndarray, extra: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((NONE_HASH if parent is None else parent).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def block_hashes(tokens: Sequence[int], block_size: int, extra: bytes = b"") -> list[int]:
    """Hashes of every *full* block of ``tokens``; a trailing partial block has none."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = np.asarray(tokens, dtype=np.int64)
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(arr) - block_size + 1, block_size):
        parent = hash_block(parent, arr[start : start + block_size], extra)
        out.append(parent)
    return out


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` (the partial tail counts)."""
    return -(-num_tokens // block_size)
