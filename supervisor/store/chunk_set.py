"""A set of chunk indices at one byte a chunk.

A run of 10^6 chunks is what a billion texts make; the supervisor keeps which chunks are pending,
waiting and recorded for the whole run, and a Python set of ints costs ~70 bytes an entry (70 MB
each at 10^6 chunks) where a flag array costs one byte.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

BLOCK = 8192  # indices materialised at once when iterating


class ChunkSet:
    """Chunk indices 0.. as flags: add, discard, ``in``, ``len`` and ascending iteration."""

    def __init__(self, size: int = 0, full: bool = False) -> None:
        self._flags = np.full(size, full, dtype=bool)
        self._count = size if full else 0
        self._low = 0  # no member below this index: take_lowest scans from here

    def __len__(self) -> int:
        return self._count

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < self._flags.size and bool(self._flags[index])

    def __iter__(self) -> Iterator[int]:
        for block in self.blocks():
            yield from block

    def blocks(self, size: int = BLOCK) -> Iterator[list[int]]:
        """The members in ascending order, at most ``size`` at a time."""
        for start in range(self._low, self._flags.size, size):
            found = np.flatnonzero(self._flags[start : start + size])
            if found.size:
                yield (found + start).tolist()

    def add(self, index: int) -> None:
        if index < 0:
            raise ValueError(f"chunk index {index} is negative")
        if index >= self._flags.size:
            grown = np.zeros(max(index + 1, 2 * self._flags.size), dtype=bool)
            grown[: self._flags.size] = self._flags
            self._flags = grown
        if not self._flags[index]:
            self._flags[index] = True
            self._count += 1
            self._low = min(self._low, index)

    def update(self, indices: Iterable[int]) -> None:
        for index in indices:
            self.add(index)

    def discard(self, index: int) -> None:
        if index in self:
            self._flags[index] = False
            self._count -= 1

    def take_lowest(self, n: int) -> list[int]:
        """Remove and return the ``n`` lowest members (fewer when there are fewer)."""
        taken: list[int] = []
        if n <= 0:
            return taken
        for block in self.blocks():
            taken += block[: n - len(taken)]
            self._low = taken[-1] + 1
            if len(taken) == n:
                break
        for index in taken:
            self.discard(index)
        if not self._count:
            self._low = self._flags.size
        return taken
