"""At most so many values by key, the least recently used dropped first (:class:`LeastRecentlyUsed`): what each step
plan keeps its captured graphs and compiled forwards in."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LeastRecentlyUsed(Generic[K, V]):
    """Values by key, at most ``capacity`` of them once a new one is made: the least recently used go first, except
    those a caller still needs (``keep``), which may hold it past ``capacity`` for as long as they are needed."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an LRU cache holds at least one value, not {capacity}")
        self.capacity = capacity
        self._values: dict[K, V] = {}  # least recently used first

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[K]:
        return iter(self._values)

    def __getitem__(self, key: K) -> V:
        return self._values[key]

    def values(self) -> list[V]:
        return list(self._values.values())

    def use(self, key: K) -> None:
        """Mark ``key``'s value (if kept) as the most recently used."""
        if key in self._values:
            self._values[key] = self._values.pop(key)

    def get_or_make(self, key: K, make: Callable[[], V], keep: Collection[K] = ()) -> V:
        """``key``'s value, now the most recently used; made by ``make`` if not kept, after room is made for it (before
        ``make`` runs, so that what the dropped values held is free for it). A ``make`` that raises keeps nothing."""
        if key in self._values:
            self.use(key)
            return self._values[key]
        while len(self._values) >= self.capacity and next(iter(self._values)) not in keep:
            del self._values[next(iter(self._values))]
        value = make()
        self._values[key] = value
        return value
