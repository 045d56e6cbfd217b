"""A set of text hashes and a number for each, in numpy arrays: what the streamed plan keeps of the
distinct texts it has seen and of the vector cache's, 24 bytes a slot and at least half the slots
free (about 48 bytes a text, where a dict of the keys took 147), looked up and filled a block of
keys at a time (open addressing, linear probing; the keys are sha256 prefixes, so their first 8
bytes are the slot)."""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
MISSING = np.iinfo(np.int64).min  # no number a caller gives (theirs may be negative)


class HashIndex:
    """16-byte keys to int64 numbers; a key is put once."""

    def __init__(self, capacity: int = 1 << 12) -> None:
        self.count = 0
        self._empty(capacity)

    def _empty(self, capacity: int) -> None:
        self.keys = np.zeros((capacity, 2), dtype=np.uint64)
        self.values = np.zeros(capacity, dtype=np.int64)
        self.used = np.zeros(capacity, dtype=bool)
        self.mask = np.uint64(capacity - 1)

    def __len__(self) -> int:
        return self.count

    @staticmethod
    def _split(keys: Array) -> Array:
        """(n,) 'S16' keys as (n, 2) uint64."""
        return np.ascontiguousarray(keys).view(np.uint64).reshape(-1, 2)

    def get(self, keys: Array) -> Array:
        """Each key's number, MISSING where it was never put."""
        words = self._split(keys)
        found = np.full(len(words), MISSING, dtype=np.int64)
        slot = words[:, 0] & self.mask
        pending = np.arange(len(words))
        while pending.size:
            at = slot[pending]
            used = self.used[at]
            same = used & (self.keys[at] == words[pending]).all(axis=1)
            found[pending[same]] = self.values[at[same]]
            go_on = used & ~same
            pending = pending[go_on]
            slot[pending] = (at[go_on] + np.uint64(1)) & self.mask
        return found

    def put(self, keys: Array, values: Array) -> None:
        """Add ``keys`` (distinct, none put before) with their ``values``."""
        if not len(keys):
            return
        if 2 * (self.count + len(keys)) > len(self.used):
            self._grow(self.count + len(keys))
        self._place(self._split(keys), np.asarray(values, dtype=np.int64))
        self.count += len(keys)

    def _place(self, words: Array, values: Array) -> None:
        slot = words[:, 0] & self.mask
        pending = np.arange(len(words))
        while pending.size:
            at = slot[pending]
            free = ~self.used[at]
            # Of the keys that reached a free slot, the first of each takes it; the others look again.
            taken, first = np.unique(at[free], return_index=True)
            winners = pending[free][first]
            self.used[taken], self.keys[taken], self.values[taken] = True, words[winners], values[winners]
            slot[pending[~free]] = (at[~free] + np.uint64(1)) & self.mask
            pending = np.setdiff1d(pending, winners, assume_unique=True)

    def _grow(self, wanted: int) -> None:
        capacity = len(self.used)
        while 2 * wanted > capacity:
            capacity *= 2
        keys, values = self.keys[self.used], self.values[self.used]
        self._empty(capacity)
        self._place(keys, values)
