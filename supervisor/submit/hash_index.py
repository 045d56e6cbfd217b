"""A set of text hashes and a number for each: what the streamed plan keeps of the distinct texts it
has seen and of the vector cache's, looked up and filled a block of keys at a time.

In memory, a table of 12 bytes a slot (open addressing, linear probing, at least half the slots
free): each key's first 8 bytes (the keys are sha256 prefixes, so they are also its slot) and the
number of its record. The records (the whole 16-byte key and the caller's number, 24 bytes each)
are in an unnamed file, appended as keys are put and read back only for a key whose first 8 bytes
match: nothing is answered on 8 bytes alone. About 29 bytes of memory a text at 10^6 texts, where
the keys and numbers in the table itself took 58 (and a dict of the keys 147).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]
MISSING = np.iinfo(np.int64).min  # get's answer for a key never put (a caller's numbers may be < 0)
_MOVED_AT_A_TIME = 1 << 16  # slots moved a round when the table grows: its scratch arrays stay small
_RECORD = np.dtype([("key", "<u8", (2,)), ("value", "<i8")])


class HashIndex:
    """16-byte keys to int64 numbers; a key is put once. ``folder``: where the records' file is
    made (unnamed: nothing is left behind); the system's temporary folder by default."""

    def __init__(self, capacity: int = 1 << 12, folder: Path | None = None) -> None:
        self.count = 0
        self._records = tempfile.TemporaryFile(dir=folder)
        self._folder = folder or Path(tempfile.gettempdir())
        self._empty(capacity)

    def _empty(self, capacity: int) -> None:
        self.first_words = np.zeros(capacity, dtype=np.uint64)
        # a record's number; a free slot's is the largest (never a record's: half the slots stay free)
        dtype = np.uint32 if capacity <= 1 << 32 else np.uint64
        self.free = np.iinfo(dtype).max
        self.record = np.full(capacity, self.free, dtype=dtype)
        self.mask = np.uint64(capacity - 1)

    def __len__(self) -> int:
        return self.count

    def close(self) -> None:
        self._records.close()

    @staticmethod
    def _split(keys: Array) -> Array:
        """(n,) 'S16' keys as (n, 2) uint64."""
        return np.ascontiguousarray(keys).view(np.uint64).reshape(-1, 2)

    def _mapped(self) -> Array:
        """The records (each put flushed them), mapped while one call reads them (their pages are
        not kept)."""
        return np.memmap(self._records, dtype=_RECORD, mode="r", shape=(self.count,))

    def get(self, keys: Array) -> Array:
        """Each key's number, MISSING where it was never put."""
        words = self._split(keys)
        found = np.full(len(words), MISSING, dtype=np.int64)
        slot = words[:, 0] & self.mask
        pending = np.arange(len(words))
        records = None
        while pending.size:
            at = slot[pending]
            number = self.record[at]
            used = number != self.free
            maybe = np.flatnonzero(used & (self.first_words[at] == words[pending, 0]))
            same = np.zeros(len(pending), dtype=bool)
            if maybe.size:
                records = self._mapped() if records is None else records
                held = records[number[maybe]]
                whole = (held["key"] == words[pending[maybe]]).all(axis=1)
                same[maybe[whole]] = True
                found[pending[maybe[whole]]] = held["value"][whole]
            go_on = used & ~same
            pending = pending[go_on]
            slot[pending] = (at[go_on] + np.uint64(1)) & self.mask
        return found

    def put(self, keys: Array, values: Array) -> None:
        """Add ``keys`` (distinct, none put before) with their ``values``."""
        if not len(keys):
            return
        if 2 * (self.count + len(keys)) > len(self.record):
            self._grow(self.count + len(keys))
        words = self._split(keys)
        added = np.empty(len(words), dtype=_RECORD)
        added["key"], added["value"] = words, np.asarray(values, dtype=np.int64)
        self._records.seek(0, 2)
        try:
            self._records.write(added.tobytes())
            self._records.flush()
        except OSError as exc:  # an unnamed file: a full disk's message names its folder
            exc.filename = exc.filename or str(self._folder)
            raise
        self._place(
            words[:, 0].copy(), np.arange(self.count, self.count + len(words), dtype=self.record.dtype)
        )
        self.count += len(keys)

    def _place(self, first_words: Array, numbers: Array) -> None:
        slot = first_words & self.mask
        pending = np.arange(len(first_words))
        while pending.size:
            at = slot[pending]
            free = self.record[at] == self.free
            # Of the keys that reached a free slot, the first of each takes it; the others look again.
            taken, first = np.unique(at[free], return_index=True)
            winners = pending[free][first]
            self.first_words[taken], self.record[taken] = first_words[winners], numbers[winners]
            slot[pending[~free]] = (at[~free] + np.uint64(1)) & self.mask
            pending = np.setdiff1d(pending, winners, assume_unique=True)

    def _grow(self, wanted: int) -> None:
        capacity = len(self.record)
        while 2 * wanted > capacity:
            capacity *= 2
        used = self.record != self.free
        first_words, numbers = self.first_words[used], self.record[used]
        # The old table goes before the new one is filled: the two alive at once were 3.5x the keys.
        del used, self.first_words, self.record
        self._empty(capacity)
        numbers = numbers.astype(self.record.dtype)
        for start in range(0, len(numbers), _MOVED_AT_A_TIME):
            end = start + _MOVED_AT_A_TIME
            self._place(first_words[start:end], numbers[start:end])
