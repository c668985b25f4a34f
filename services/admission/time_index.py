"""Keyed entries on a time axis, counted up to any time in O(log T).

:class:`TimeIndex` holds entries ``key -> (time, tokens)`` and answers
``upto(x) = (#entries with time <= x, sum of their tokens)`` exactly: a Fenwick tree
over buckets of ``resolution`` seconds (sparse: a dict of the nodes in use) gives the
totals of the buckets before x's, and the entries of x's own bucket are compared one by
one. Times before ``origin`` share bucket 0. Counts and tokens are ints, so adding and
removing never drifts. Pure, no clock.
"""

import math

_LEVELS = 44  # buckets 0 .. 2**44 - 2: ~557 years of 1 ms buckets


class TimeIndex:
    """Entries on a time axis, counted (each with its weight, 1 unless given) with their
    tokens up to any time in O(log T)."""

    def __init__(self, origin: float = 0.0, resolution: float = 1e-3) -> None:
        if resolution <= 0:
            raise ValueError("resolution must be positive")
        self.origin = origin
        self.resolution = resolution
        self._tree: dict[int, list[int]] = {}  # Fenwick node -> [count, tokens]
        self._buckets: dict[int, dict[object, tuple[float, int, int]]] = {}
        self._where: dict[object, int] = {}  # key -> bucket

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def _bucket(self, t: float) -> int:
        b = math.floor((t - self.origin) / self.resolution)
        return min(max(b, 0), (1 << _LEVELS) - 2)

    def _update(self, bucket: int, count: int, tokens: int) -> None:
        i, tree = bucket + 1, self._tree
        while i < 1 << _LEVELS:
            node = tree.get(i)
            if node is None:
                node = tree[i] = [0, 0]
            node[0] += count
            node[1] += tokens
            if node[0] == 0:
                del tree[i]
            i += i & -i

    def add(self, key: object, t: float, tokens: int = 0, count: int = 1) -> None:
        """Insert ``key`` at time ``t`` (replacing it if present), counting ``count``."""
        if count < 1:
            raise ValueError("count must be at least 1")
        self.remove(key)
        b = self._bucket(t)
        self._buckets.setdefault(b, {})[key] = (t, tokens, count)
        self._where[key] = b
        self._update(b, count, tokens)

    def remove(self, key: object) -> None:
        b = self._where.pop(key, None)
        if b is None:
            return
        bucket = self._buckets[b]
        _, tokens, count = bucket.pop(key)
        if not bucket:
            del self._buckets[b]
        self._update(b, -count, -tokens)

    def upto(self, x: float) -> tuple[int, int]:
        """(count, tokens) of the entries whose time is <= ``x``."""
        b = self._bucket(x)
        count = tokens = 0
        i, tree = b, self._tree  # Fenwick prefix over buckets 0 .. b-1 (nodes 1 .. b)
        while i > 0:
            node = tree.get(i)
            if node is not None:
                count += node[0]
                tokens += node[1]
            i &= i - 1
        for t, n, c in self._buckets.get(b, {}).values():
            if t <= x:
                count += c
                tokens += n
        return count, tokens
