"""Instances kept in order of a load key, O(log n) per change: the placement search
(services.conductor.placement_policy) walks them from the least loaded and stops at a bound, so
a decision does not scan the cluster. Pure."""

from collections.abc import Iterator
from typing import Any

from sortedcontainers import SortedList


class _Top:
    """Above every instance name: ``(key, TOP)`` sorts after each ``(key, name)``."""

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return True


TOP = _Top()


class LoadOrder:
    """instance -> key, iterable as (key, instance) in ascending order."""

    def __init__(self) -> None:
        self._keys: dict[str, Any] = {}
        self._sorted: SortedList = SortedList()

    def set(self, instance: str, key: Any) -> None:
        old = self._keys.get(instance)
        if old is not None:
            if old == key:
                return
            self._sorted.remove((old, instance))
        self._keys[instance] = key
        self._sorted.add((key, instance))

    def discard(self, instance: str) -> None:
        old = self._keys.pop(instance, None)
        if old is not None:
            self._sorted.remove((old, instance))

    def instances(self) -> list[str]:
        return list(self._keys)

    def key(self, instance: str) -> Any:
        return self._keys.get(instance)

    def __iter__(self) -> Iterator[tuple[Any, str]]:
        return iter(self._sorted)

    def after(self, key: Any) -> Iterator[tuple[Any, str]]:
        """As iterating, from the first instance whose key is above ``key``: a walk
        skips the rest of a group of equal keys in O(log n)."""
        return iter(self._sorted.irange(minimum=(key, TOP), inclusive=(False, False)))

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, instance: object) -> bool:
        return instance in self._keys
