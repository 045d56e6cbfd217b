"""Duplicate-id detection with flat memory: ids go into an on-disk SQLite table with a unique key."""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path
from types import TracebackType

from chunkq.jobs.contract.errors import CorpusError
from chunkq.jobs.contract.storage import private_dirs, private_open
from chunkq.supervisor.corpus.records import Record


class IdRegistry:
    """``add(records)`` raises CorpusError naming both places where an id occurs twice."""

    def __init__(self, path: Path) -> None:
        self.path = path
        private_dirs(path.parent)
        path.unlink(missing_ok=True)
        private_open(path).close()  # sqlite would create it with the process's umask
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=OFF")
        self.db.execute("PRAGMA synchronous=OFF")
        self.db.execute("CREATE TABLE ids (id TEXT PRIMARY KEY, place TEXT NOT NULL) WITHOUT ROWID")

    def add(self, records: list[Record]) -> None:
        try:
            self.db.execute("BEGIN")
            self.db.executemany("INSERT INTO ids VALUES (?, ?)", [(r.id, r.where) for r in records])
            self.db.execute("COMMIT")
        except sqlite3.IntegrityError:
            self.db.execute("ROLLBACK")
            self._name_duplicate(records)
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode != sqlite3.SQLITE_FULL:
                raise
            # "database or disk is full": the disk, said as every full disk is (exit 11, the file)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path)) from exc

    def _name_duplicate(self, records: list[Record]) -> None:
        seen: dict[str, str] = {}
        for record in records:
            row = self.db.execute("SELECT place FROM ids WHERE id = ?", (record.id,)).fetchone()
            first = row[0] if row else seen.get(record.id)
            if first is not None:
                raise CorpusError(f"{record.where}: duplicate id {record.id!r} (first at {first})")
            seen[record.id] = record.where
        raise CorpusError("duplicate id in the corpus")  # unreachable: the batch held one

    def close(self) -> None:
        self.db.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> IdRegistry:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
