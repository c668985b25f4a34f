"""Deterministic stand-ins for a model's outputs, used by the mock engine.

Everything is a pure function of the token sequence, so the same prompt gives the
same tokens and the same KV bytes in any process on any machine:

- ``H_i``, the rolling hash of tokens[0..i], is a polynomial hash mod 2**64
  (``H_i = H_{i-1} * P + t_i + 1``), computed for all positions at once with numpy;
- the next token after a sequence is ``splitmix64(H_last ^ salt) % vocab``
  (never the EOS id, so requests end by ``max_tokens`` or ``stop_token_ids``);
- the KV of position ``i`` in layer ``L`` hashes (``H_i``, ``L``) into a 32-bit key
  and mixes it with a per-element constant over a [2, tokens, row] grid
  (murmur3 finaliser), giving values in [-0.5, 0.5) of the model's KV dtype.

A 4096-token prompt of the tiny model (4 layers, row 128) takes ~10 ms of numpy.
"""

from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
P = 0x100000001B3  # odd, so invertible mod 2**64
P_INV = pow(P, -1, 1 << 64)
TOKEN_SALT = 0x5DEECE66D2B7E151
_LAYER_MULT = 0xD1B54A32D192ED03


def prefix_hashes(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``H_i`` for every position i (uint64 [n]): H_i = sum_j (t_j + 1) * P**(i - j)."""
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64) + np.uint64(1)
    n = t.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    pw = np.full(n, P, dtype=np.uint64)
    ip = np.full(n, P_INV, dtype=np.uint64)
    pw[0] = ip[0] = 1
    pw = np.cumprod(pw, dtype=np.uint64)
    ip = np.cumprod(ip, dtype=np.uint64)
    return pw * np.cumsum(t * ip, dtype=np.uint64)


def extend_hash(h: int, token: int) -> int:
    """The rolling hash after appending ``token`` to a sequence whose hash is ``h``."""
    return (h * P + token + 1) & MASK64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def next_token(h: int, vocab_size: int, eos_token_id: int | None = None) -> int:
    """The token that follows a sequence whose rolling hash is ``h``."""
    tok = _splitmix64(h ^ TOKEN_SALT) % vocab_size
    if tok == eos_token_id:
        tok = (tok + 1) % vocab_size
    return tok


def reference_generate(
    prompt: Sequence[int], n: int, vocab_size: int, eos_token_id: int | None = None
) -> list[int]:
    """The ``n`` tokens a single process computing everything from scratch emits."""
    h = int(prefix_hashes(prompt)[-1]) if len(prompt) else 0
    out: list[int] = []
    for _ in range(n):
        tok = next_token(h, vocab_size, eos_token_id)
        out.append(tok)
        h = extend_hash(h, tok)
    return out


_row_consts: dict[int, np.ndarray] = {}


def _row_const(row: int) -> np.ndarray:
    c = _row_consts.get(row)
    if c is None:
        idx = np.arange(2 * row, dtype=np.uint32)
        c = (idx * np.uint32(0x9E3779B1) + np.uint32(0x7F4A7C15)).reshape(2, 1, row)
        _row_consts[row] = c
    return c


def layer_kv(hashes: np.ndarray, layer: int, row: int, dtype: np.dtype) -> np.ndarray:
    """KV ([2, n, row], ``dtype``) of the positions whose rolling hashes are ``hashes``."""
    salt = np.uint64(((layer + 1) * _LAYER_MULT) & MASK64)
    key = (_splitmix64_np(hashes ^ salt) >> np.uint64(32)).astype(np.uint32)
    return _mix(_row_const(row) ^ key[None, :, None], dtype)


def layers_kv(hashes: np.ndarray, layers: int, row: int, dtype: np.dtype) -> np.ndarray:
    """:func:`layer_kv` of layers ``0 .. layers - 1`` at once ([layers, 2, n, row]), the
    same bytes: numpy's cost per call, not per element, is what a short prompt pays."""
    salt = (np.arange(1, layers + 1, dtype=np.uint64) * np.uint64(_LAYER_MULT))[:, None]
    key = (_splitmix64_np(hashes[None, :] ^ salt) >> np.uint64(32)).astype(np.uint32)
    return _mix(_row_const(row)[None] ^ key[:, None, :, None], dtype)


def _mix(k: np.ndarray, dtype: np.dtype) -> np.ndarray:
    k *= np.uint32(0x85EBCA6B)
    k ^= k >> np.uint32(13)
    k *= np.uint32(0xC2B2AE35)
    k ^= k >> np.uint32(16)
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        out = (k >> np.uint32(8)).astype(np.float32)
        out *= np.float32(2.0**-24)
        out -= np.float32(0.5)
        return out if dtype == np.float32 else out.astype(dtype)
    # raw 16-bit storage (bfloat16): keep the top bits of the mixed key
    return (k >> np.uint32(32 - 8 * dtype.itemsize)).astype(dtype)


def first_mismatch(got: np.ndarray, expected: np.ndarray) -> int | None:
    """Token position (axis 1) of the first difference, or None when equal."""
    if got.shape == expected.shape and np.array_equal(got, expected):
        return None
    if got.shape != expected.shape:
        return 0
    diff = np.any(got != expected, axis=(0, 2))
    return int(np.argmax(diff))
