"""A capped pool of endpoints, evicted by SIEVE (Zhang et al., NSDI'24; paper §3.2.3).

Pure: no I/O. Keys sit in insertion order (oldest first) with a *visited* bit that
``get`` sets. To make room, the hand walks from where it stopped towards newer keys
(wrapping to the oldest), clearing visited bits, and evicts the first key that is
not visited. Unlike LRU a hit moves nothing, so lookups are cheap and a burst of
one-off peers cannot flush the endpoints that are used again and again.

``busy(value)`` marks endpoints that should not be closed now (requests in flight):
the hand passes over them as if visited; if every endpoint is busy the one under the
hand goes anyway, so the cap always holds.
"""

from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SievePool(Generic[K, V]):
    """A capped pool of endpoints that evicts by SIEVE: a hit moves nothing."""

    def __init__(self, capacity: int, busy: Callable[[V], bool] | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self._busy = busy or (lambda _v: False)
        self._keys: list[K] = []  # oldest first
        self._values: dict[K, V] = {}
        self._visited: dict[K, bool] = {}
        self._hand = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._keys))

    def get(self, key: K) -> V | None:
        v = self._values.get(key)
        if v is not None:
            self._visited[key] = True
        return v

    def peek(self, key: K) -> V | None:
        return self._values.get(key)

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Insert (or replace) ``key``; returns the evicted ``(key, value)`` pairs for the
        caller to close."""
        if key in self._values:
            self._values[key] = value
            self._visited[key] = True
            return []
        out: list[tuple[K, V]] = []
        while len(self._keys) >= self.capacity:
            out.append(self._evict())
        self._keys.append(key)
        self._values[key] = value
        self._visited[key] = False
        return out

    def remove(self, key: K) -> V | None:
        """Drop ``key`` (a broken endpoint); the hand keeps its place."""
        if key not in self._values:
            return None
        i = self._keys.index(key)
        del self._keys[i]
        if i < self._hand:
            self._hand -= 1
        if self._hand >= len(self._keys):
            self._hand = 0
        self._visited.pop(key)
        return self._values.pop(key)

    def visited(self, key: K) -> bool:
        return self._visited.get(key, False)

    def _evict(self) -> tuple[K, V]:
        n = len(self._keys)
        i = self._hand if self._hand < n else 0
        for _ in range(2 * n):
            k = self._keys[i]
            if self._visited[k]:
                self._visited[k] = False
            elif not self._busy(self._values[k]):
                break
            i = (i + 1) % n
        k = self._keys.pop(i)
        self._hand = i if i < len(self._keys) else 0
        self._visited.pop(k)
        self.evictions += 1
        return k, self._values.pop(k)
