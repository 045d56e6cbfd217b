"""Duplicate-id detection with flat memory: ids go into an on-disk SQLite table with a unique key.

``unique_ids`` checks a corpus's records a block at a time as the split reads them; at the first
duplicate it reads the rest on for more, as the readers do for their bad rows (corpus/bad_rows.py),
and one error names them all, the first first, with the reader's own bad rows after them: every row
the reader gave came before its first bad one. Before, duplicates were named one per run, and a
duplicate before a bad row not at all (its block was checked after the reader had failed).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType

from chunkq.jobs.contract.errors import CorpusError
from chunkq.jobs.contract.storage import private_dirs, private_open
from chunkq.supervisor.corpus import bad_rows
from chunkq.supervisor.corpus.records import Record

ID_BLOCK = 1000  # records checked at once: what a row waits at most before the split sees it
ID_BLOCK_CHARACTERS = 1 << 25  # and their texts at most: 1,000 texts near the 1 MiB limit held 1 GB
CORPUS = "the corpus"


class IdRegistry:
    """The ids seen so far; ``duplicates(records)`` names both places where an id occurs twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        private_dirs(path.parent)
        path.unlink(missing_ok=True)
        private_open(path).close()  # sqlite would create it with the process's umask
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, place TEXT NOT NULL) WITHOUT ROWID")

    def duplicates(self, records: list[Record]) -> list[CorpusError]:
        """Record ``records``' ids; an error for each one seen before (here or earlier), in order."""
        try:
            self.db.execute("BEGIN")
            try:
                self.db.executemany("INSERT INTO ids VALUES (?, ?)", [(r.id, r.where) for r in records])
            except sqlite3.IntegrityError:
                self.db.execute("ROLLBACK")
                self.db.execute("BEGIN")
                found = self._one_by_one(records)
                self.db.execute("COMMIT")
                return found
            self.db.execute("COMMIT")
            return []
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                raise
            # "database or disk is full": the disk, said as every full disk is (exit 11, the file)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path)) from exc

    def _one_by_one(self, records: list[Record]) -> list[CorpusError]:
        found = []
        for record in records:
            row = self.db.execute("SELECT place FROM ids WHERE id = ?", (record.id,)).fetchone()
            if row is not None:
                found.append(CorpusError(f"{record.where}: duplicate id {record.id!r} (first at {row[0]})"))
            else:
                self.db.execute("INSERT INTO ids VALUES (?, ?)", (record.id, record.where))
        return found

    def close(self) -> None:
        self.db.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> IdRegistry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def unique_ids(records: Iterable[Record], registry: IdRegistry) -> Iterator[Record]:
    """``records``, each once its block's ids are known to be new (see the module's docstring)."""
    it, held, characters = iter(records), list[Record](), 0
    try:
        for record in it:
            held.append(record)
            characters += len(record.text)
            if len(held) == ID_BLOCK or characters > ID_BLOCK_CHARACTERS:
                _check(held, registry, it)
                yield from held
                held, characters = [], 0
    except CorpusError as read:
        if isinstance(read, _Duplicates):
            raise
        found = registry.duplicates(held)  # read before the reader's first bad row
        if not found:
            raise
        rows, cut = bad_rows.rows_of(read)
        raise _told([*found, *rows], cut) from None
    _check(held, registry, it)
    yield from held


class _Duplicates(CorpusError):
    """The duplicates found, and any bad row read on after them, in one error."""


def _check(block: list[Record], registry: IdRegistry, rest: Iterator[Record]) -> None:
    found = registry.duplicates(block)
    if found:
        raise _read_on(found, registry, rest)


def _read_on(found: list[CorpusError], registry: IdRegistry, rest: Iterator[Record]) -> CorpusError:
    """The rest of the corpus read for more duplicates (and bad rows), within bad_rows' bounds."""
    since, cut, block = time.monotonic(), "", list[Record]()
    try:
        for record in rest:
            block.append(record)
            if len(block) < ID_BLOCK:
                continue
            found += registry.duplicates(block)
            block = []
            if len(found) >= bad_rows.SHOWN:
                cut = bad_rows.stopped_at_shown()
                break
            if time.monotonic() - since > bad_rows.SCAN_SECONDS:
                cut = bad_rows.read_on_to(record.where)
                break
        else:
            found += registry.duplicates(block)
    except CorpusError as read:
        rows, cut = bad_rows.rows_of(read)
        found += registry.duplicates(block) + rows
    return _Duplicates(str(_told(found, cut)))


def _told(found: list[CorpusError], cut: str) -> CorpusError:
    if len(found) > bad_rows.SHOWN:
        cut = cut or bad_rows.stopped_at_shown()
    return bad_rows.told(found[: bad_rows.SHOWN], CORPUS, cut)
