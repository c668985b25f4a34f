"""Which cached block goes first when a store needs room: least recently used.

Pure and tiny so that the simulator's model of a store evicts in exactly the order
the live store does. Only *evictable* keys live here: a block enters when its last
lock is released and leaves when it is locked again or evicted. A locked block is
never in the policy, so it can never be chosen.
"""

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class LRUEviction(Generic[K]):
    """Keys ordered from least to most recently released; ``victim()`` is the oldest."""

    def __init__(self) -> None:
        self._order: OrderedDict[K, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[K]:
        """Oldest first (the order victims would be chosen in)."""
        return iter(self._order)

    def add(self, key: K) -> None:
        """``key`` became evictable now (or was used again): it is the newest."""
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: K) -> bool:
        """``key`` is locked again or gone; returns whether it was evictable."""
        if key in self._order:
            del self._order[key]
            return True
        return False

    def victim(self) -> K:
        """Remove and return the least recently used key (KeyError when empty)."""
        if not self._order:
            raise KeyError("no evictable block")
        key, _ = self._order.popitem(last=False)
        return key
