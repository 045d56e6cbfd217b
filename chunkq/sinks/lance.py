"""``lancedb://PATH/TABLE``: an embedded LanceDB table (a folder, local or on an object store LanceDB
reads: ``lancedb://s3://bucket/db/TABLE``). Columns ``id`` (the key), and this run's rows: a dense
run's ``vector`` (a fixed-size list of the result's dtype; binary results as their packed bytes), a
sparse run's ``sparse_indices`` and ``sparse_values`` (lists: LanceDB has no sparse vector type),
named otherwise with ``--column NAME``; a windowed run's window columns; ``--columns`` fields.

Rows are merged by id (``merge_insert``): a second export, or one after a kill, updates the rows it
finds and adds the others, so the table ends with exactly the run's rows. A table that lacks this
export's columns gains them (schema evolution, ``add_columns``), and the merge fills them by id and
leaves the others as they are: a dense and a sparse run of one corpus make one row per id with both.
Each row's ``text_sha256`` says which text it is; a table that holds rows is checked against the run
before anything is added (``same_rows``): another corpus's rows are refused, the table untouched.
One export writes a table at a time: a lock file beside it (``TABLE.chunkq-export.lock``, the
store's own lock: a dead holder's is taken over) is held from the check to the last merge, so a
second export waits, then checks what the first left; other programs writing the table are not
held off.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.redaction import redacted
from chunkq.jobs.contract.storage import open_store
from chunkq.sinks.row_texts import HASH_COLUMN
from chunkq.sinks.rows import SPARSE, WINDOW_FIELDS, Rows, SparseRows
from chunkq.sinks.same_rows import Held
from chunkq.supervisor.store.store_lock import StoreLock

DENSE_COLUMN, SPARSE_COLUMN = "vector", "sparse"  # LanceDB's search reads "vector" by default


_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # what LanceDB takes as a table's name


def _split(url: str) -> tuple[str, str]:
    rest = url[len("lancedb://") :]
    where, _, table = rest.rstrip("/").rpartition("/")
    if not where or not table:
        raise ConfigError(
            f"--to {redacted(url)}: expected lancedb://PATH/TABLE (a folder and the table's name)"
        )
    if "://" not in where and re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", where):
        # "lancedb://me:secret@/data/t": LanceDB took "me" for an object store (a raw ValueError).
        raise ConfigError(
            "--to lancedb://...: expected lancedb://PATH/TABLE or lancedb://s3://BUCKET/PATH/TABLE; "
            "what follows lancedb:// is neither a path nor an object store's URL (not shown: it may "
            "hold a user and password; an object store's credentials go in its own settings)"
        )
    if not _TABLE_NAME.fullmatch(table):
        raise ConfigError(
            f"--to {redacted(url)}: a LanceDB table's name holds letters, digits, underscores, hyphens "
            "and periods only"
        )
    return where, table


def sparse_columns(base: str) -> tuple[str, str]:
    """The two columns a sparse vector named ``base`` is stored in: its dimensions, its values."""
    return f"{base}_indices", f"{base}_values"


class LanceSink:
    whole = False  # rows merged a batch at a time

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url = url
        self.where, self.name = _split(url)
        self.table: Any = None
        self.db: Any = None
        self.created = False
        self.merged = 0  # batches merged by this export
        self.added: list[str] = []
        self.missing: list[Any] = []
        self.label = f"--to {redacted(url)}: the table"
        self.lock = StoreLock(_lock_path(self.where, self.name), self.label)

    def writes_to(self) -> list[str]:
        return [] if "://" in self.where else [f"{self.where}/{self.name}.lance"]

    def _schema(self, rows: Rows) -> Any:
        """The columns this export writes, the id first."""
        import pyarrow as pa

        fields = [pa.field("id", pa.string(), nullable=False), pa.field(HASH_COLUMN, pa.string())]
        if rows.kind == SPARSE:
            indices, values = sparse_columns(rows.column or SPARSE_COLUMN)
            fields += [pa.field(indices, pa.list_(pa.int32())), pa.field(values, pa.list_(pa.float32()))]
        else:
            dtype = np.dtype("uint8" if rows.dtype in ("binary", "ubinary") else rows.dtype)
            fields.append(
                pa.field(rows.column or DENSE_COLUMN, pa.list_(pa.from_numpy_dtype(dtype), rows.dim))
            )
        if rows.windowed:
            fields.append(pa.field("text_id", pa.string()))
            fields += [pa.field(name, pa.int64()) for name in WINDOW_FIELDS]
        fields += [pa.field(name, pa.string()) for name in rows.columns]
        return pa.schema(fields)

    def open(self, rows: Rows) -> None:
        """Take the table's export lock, connect, and check that an existing table can take this
        export's rows; nothing written."""
        import lancedb

        self.lock.acquire(wait=True)
        self.rows = rows
        self.schema = self._schema(rows)
        self.db = lancedb.connect(self.where)
        if _has_table(self.db, self.name):
            self.table = self.db.open_table(self.name)
            self._fit(self.table.schema)

    def columns(self) -> set[str]:
        return set(self.schema.names)

    def held(self) -> Held | None:
        """What the table holds, where it holds rows."""
        if self.table is None or not self.table.count_rows():
            return None
        names = set(self.table.schema.names)
        keys = None
        if HASH_COLUMN in names:
            keys = self.table.search().select(["id", HASH_COLUMN]).limit(None).to_arrow()
        return Held(int(self.table.count_rows()), frozenset(names), keys)

    def prepare(self) -> None:
        """Create the table, or add the columns it lacks (all null until the merge fills them)."""
        if self.table is None:
            self.table = self.db.create_table(self.name, schema=self.schema)
            self.created = True
        elif self.missing:
            self.table.add_columns(self.missing)
            self.added = [f.name for f in self.missing]

    def _fit(self, schema: Any) -> None:
        """An existing table rows can be merged into: ids of text, this export's columns of the
        same types (those it lacks are added), every column it requires filled by this export."""
        import pyarrow as pa

        if "id" not in schema.names or schema.field("id").type not in (pa.string(), pa.large_string()):
            found = schema.field("id").type if "id" in schema.names else "missing"
            raise ConfigError(
                f"{self.label}'s id column is {found}, chunkq's ids are text (a corpus's "
                "ids, or TEXT#WINDOW); export to another table"
            )
        for wanted in self.schema:
            if wanted.name in schema.names and schema.field(wanted.name).type != wanted.type:
                raise ConfigError(
                    f"{self.label}'s {wanted.name} column is {schema.field(wanted.name).type}, "
                    f"this run's is {wanted.type}; export to another table, or name another column "
                    "with --column"
                )
        required = [f.name for f in schema if not f.nullable and f.name not in self.schema.names]
        if required:
            raise ConfigError(
                f"{self.label} requires column(s) {', '.join(required)}, which this export "
                "does not fill (--columns copies corpus fields); export to another table"
            )
        self.missing = [f.with_nullable(True) for f in self.schema if f.name not in schema.names]

    def write(self, ids: list[str], vectors: Any, columns: dict[str, list[Any]]) -> None:
        import pyarrow as pa

        data: dict[str, Any] = {"id": pa.array(ids, pa.string())}
        if isinstance(vectors, SparseRows):
            indices, values = sparse_columns(self.rows.column or SPARSE_COLUMN)
            cut = pa.array(vectors.offsets.astype(np.int32))
            data[indices] = pa.ListArray.from_arrays(cut, pa.array(vectors.indices, pa.int32()))
            data[values] = pa.ListArray.from_arrays(cut, pa.array(vectors.values, pa.float32()))
        else:
            name = self.rows.column or DENSE_COLUMN
            flat = pa.array(
                np.ascontiguousarray(vectors)
                .reshape(-1)
                .view(self.schema.field(name).type.value_type.to_pandas_dtype())
            )
            data[name] = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
        data.update({name: pa.array(values) for name, values in columns.items()})
        batch = pa.table(data, schema=self.schema)
        self.lock.check()  # a holder paused past the lock's staleness must not write after its successor
        self.table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(batch)
        self.merged += 1

    def close(self) -> dict[str, Any]:
        try:
            return {
                "table_rows": int(self.table.count_rows()),
                "created": self.created,
                "columns_added": self.added,
            }
        finally:
            self.lock.release()

    def abort(self) -> None:
        # Every batch is a whole merge: what was merged stays, a rerun merges the rest. A table this
        # export created and wrote nothing into goes (a full disk left an empty one).
        if self.created and not self.merged and self.db is not None:
            with contextlib.suppress(Exception):
                self.db.drop_table(self.name)
        self.lock.release()


def _lock_path(where: str, name: str) -> Any:
    """The export lock beside the table: a file in the database's folder, or an object beside it."""
    if "://" in where:
        return open_store(f"{where}/{name}.chunkq-export.lock")
    return Path(where) / f"{name}.chunkq-export.lock"


def _has_table(db: Any, name: str) -> bool:
    """Whether ``db`` holds table ``name``: ``list_tables`` page by page where the installed LanceDB
    has it (``table_names`` is deprecated there), else ``table_names``."""
    pages = getattr(db, "list_tables", None)
    if pages is None:
        return name in db.table_names()
    token = None
    while True:
        page = pages(page_token=token)
        if name in page.tables:
            return True
        token = page.page_token
        if not token:
            return False
