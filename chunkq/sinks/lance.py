"""``lancedb://PATH/TABLE``: an embedded LanceDB table (a folder, local or on an object store LanceDB
reads: ``lancedb://s3://bucket/db/TABLE``). Columns ``id`` (the key), ``vector`` (a fixed-size list
of the result's dtype; binary results as their packed bytes), and a windowed run's window columns.
Rows are merged by id (``merge_insert``): a second export, or one after a kill, updates the rows it
finds and adds the others, so the table ends with exactly the run's rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkq.jobs.errors import ConfigError
from chunkq.sinks import Rows

WINDOW_TYPES = {
    "text_id": "string",
    "window": "int64",
    "char_start": "int64",
    "char_end": "int64",
    "tokens": "int64",
}


def _split(url: str) -> tuple[str, str]:
    rest = url[len("lancedb://") :]
    where, _, table = rest.rstrip("/").rpartition("/")
    if not where or not table:
        raise ConfigError(f"--to {url}: expected lancedb://PATH/TABLE (a folder and the table's name)")
    return where, table


class LanceSink:
    def __init__(self, url: str) -> None:
        self.url = url
        self.where, self.name = _split(url)
        self.table: Any = None
        self.created = False

    def writes_to(self) -> list[str]:
        return [] if "://" in self.where else [f"{self.where}/{self.name}.lance"]

    def open(self, rows: Rows) -> None:
        import lancedb
        import pyarrow as pa

        value = pa.from_numpy_dtype(np.dtype("uint8" if rows.dtype in ("binary", "ubinary") else rows.dtype))
        fields = [pa.field("id", pa.string(), nullable=False), pa.field("vector", pa.list_(value, rows.dim))]
        if rows.windowed:
            fields += [pa.field(name, getattr(pa, kind)()) for name, kind in WINDOW_TYPES.items()]
        fields += [pa.field(name, pa.string()) for name in rows.columns]
        self.schema = pa.schema(fields)
        db = lancedb.connect(self.where)
        if self.name not in db.table_names():
            self.table = db.create_table(self.name, schema=self.schema)
            self.created = True
            return
        self.table = db.open_table(self.name)
        found = self.table.schema.field("vector").type if "vector" in self.table.schema.names else None
        if found != self.schema.field("vector").type:
            raise ConfigError(
                f"--to {self.url}: the table's vector column is {found}, this run's rows are "
                f"{self.schema.field('vector').type}; export to another table"
            )
        lacking = [name for name in self.schema.names if name not in self.table.schema.names]
        if lacking:
            raise ConfigError(
                f"--to {self.url}: the table has no column {', '.join(lacking)}; export to another"
            )
        self._check_existing(self.table.schema)

    def _check_existing(self, schema: Any) -> None:
        """An existing table rows can be merged into: ids of text, every other column it requires
        one this export fills."""
        import pyarrow as pa

        if schema.field("id").type not in (pa.string(), pa.large_string()):
            raise ConfigError(
                f"--to {self.url}: the table's id column is {schema.field('id').type}, chunkq's ids are "
                "text (a corpus's ids, or TEXT#WINDOW); export to another table"
            )
        required = [f.name for f in schema if not f.nullable and f.name not in self.schema.names]
        if required:
            raise ConfigError(
                f"--to {self.url}: the table requires column(s) {', '.join(required)}, which this export "
                "does not fill (--columns copies corpus fields); export to another table"
            )

    def write(self, ids: list[str], vectors: np.ndarray[Any, Any], columns: dict[str, list[Any]]) -> None:
        import pyarrow as pa

        flat = pa.array(
            np.ascontiguousarray(vectors)
            .reshape(-1)
            .view(self.schema.field("vector").type.value_type.to_pandas_dtype())
        )
        data = {
            "id": pa.array(ids, pa.string()),
            "vector": pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1]),
        }
        data.update({name: pa.array(values) for name, values in columns.items()})
        batch = pa.table(data, schema=self.schema)
        self.table.merge_insert("id").when_matched_update_all().when_not_matched_insert_all().execute(batch)

    def close(self) -> dict[str, Any]:
        return {"table_rows": int(self.table.count_rows()), "created": self.created}

    def abort(self) -> None:
        pass  # every batch is a whole merge: what was merged stays, a rerun merges the rest
