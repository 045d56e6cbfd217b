"""``postgresql://USER@HOST:PORT/DB?table=T``: a PostgreSQL table with the pgvector extension. The
table (``id text primary key``; a dense run's ``embedding`` of the type its dtype needs:
``vector(dim)`` for float32, ``halfvec(dim)`` for float16, ``bit(dim)`` for binary and ubinary; a
sparse run's ``sparse sparsevec(dim)``; ``--column NAME`` names it otherwise; a windowed run's window
columns) is created, or an existing one checked: a column of another type or dimension is refused
in one line, a column it lacks is added, so a dense and a sparse run of one corpus make one row per
id with both (the hybrid query of docs/hybrid.md). Rows are upserted by id (``INSERT ... ON
CONFLICT (id) DO UPDATE`` of this export's columns), a batch per transaction through a temporary
table filled by a binary COPY (pgvector's own Python adapters: text literals of 384 floats ran at
3,000 rows/s), so a rerun after a kill ends with exactly the run's rows. Each row's ``text_sha256``
says which text it is; a table that holds rows is checked against the run first (``same_rows``).
Everything that can refuse an export is checked before the table is touched, and the table's
creation or new columns are committed with the first batch: a refused export leaves it as it was.
One export writes a table at a time (a session advisory lock, released when its connection ends,
even by a kill), and an existing table is locked against every other writer from the check to the
first batch's commit: another export waits, then checks what the first left.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import numpy as np

from chunkq.jobs.contract.addresses import parse_postgres, split_table
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.redaction import redact, redacted
from chunkq.sinks.row_texts import HASH_COLUMN
from chunkq.sinks.rows import SPARSE, Rows, SparseRows
from chunkq.sinks.same_rows import Held

log = logging.getLogger(__name__)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
CONNECT_SECONDS = 10
# pgvector's own limit on a sparsevec (SPARSEVEC_MAX_NNZ in its src/sparsevec.h): past it the COPY
# fails with "sparsevec cannot have more than 16000 non-zero elements".
SPARSEVEC_MAX_NNZ = 16_000


WINDOW_COLUMNS = {
    "text_id": "text",
    "window": "bigint",
    "char_start": "bigint",
    "char_end": "bigint",
    "tokens": "bigint",
}


def column_type(dtype: str, dim: int) -> str:
    if dtype == "float32":
        return f"vector({dim})"
    if dtype == "float16":
        return f"halfvec({dim})"
    if dtype in ("binary", "ubinary"):
        return f"bit({dim * 8})"
    raise ConfigError(f"pgvector has no column type for {dtype} vectors; export float32, float16 or binary")


DENSE_COLUMN, SPARSE_COLUMN = "embedding", "sparse"


def _value(row: Any, dtype: str, dim: int) -> Any:
    """A row as pgvector's Python adapters send it in COPY's binary format: a dense row, or a sparse
    one as (indices, values)."""
    from pgvector import Bit, HalfVector, SparseVector

    if isinstance(row, tuple):
        indices, values = row
        return SparseVector(dict(zip(indices.tolist(), values.tolist(), strict=True)), dim)
    if dtype in ("binary", "ubinary"):
        return Bit(np.ascontiguousarray(row).view(np.uint8).tobytes())
    if dtype == "float16":
        return HalfVector(row)
    return row


class PgvectorSink:
    whole = False  # rows upserted a transaction per batch

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        dsn, table = split_table(url)
        if parse_postgres(dsn) is None:
            raise ConfigError(
                f"--to {redacted(url)}: libpq cannot read this address (not shown: it may hold a "
                "password); write it postgresql://USER:PASSWORD@HOST:PORT/DB?table=NAME with the "
                "password's special characters percent-encoded (/ as %2F, @ as %40, : as %3A, # as "
                "%23, ? as %3F, % as %25, a space as %20)"
            )
        if table is None or not _NAME.fullmatch(table):
            raise ConfigError(
                f"--to {redacted(url)}: name the table as ?table=NAME (letters, digits, underscores)"
            )
        self.table = table
        self.dsn = dsn  # the rest of the query is the connection's (host=/socket/dir, sslmode=...)
        self.url = url
        self.conn: Any = None
        self.exists = False
        self.to_add: list[str] = []
        self.label = f"--to {redacted(url)}: table {table}"

    def writes_to(self) -> list[str]:
        return []  # a server

    def open(self, rows: Rows) -> None:
        """Connect, and check that the table (if it exists) can take this export's rows; nothing
        is committed."""
        import psycopg
        from psycopg import sql

        sparse = rows.kind == SPARSE
        if sparse and (rows.max_active or 0) > SPARSEVEC_MAX_NNZ:
            raise ConfigError(
                f"{self.label}: this run's rows hold up to {rows.max_active:,} non-zero values, and "
                f"pgvector's sparsevec holds at most {SPARSEVEC_MAX_NNZ:,}; run it again with "
                f"--max-active-dims {SPARSEVEC_MAX_NNZ} or fewer, or export it to LanceDB"
            )
        self.rows = rows
        self.type = f"sparsevec({rows.dim})" if sparse else column_type(rows.dtype, rows.dim)
        self.vector = rows.column or (SPARSE_COLUMN if sparse else DENSE_COLUMN)
        self.name = sql.Identifier(self.table)
        self.names = [
            "id",
            self.vector,
            HASH_COLUMN,
            *(WINDOW_COLUMNS if rows.windowed else {}),
            *rows.columns,
        ]
        # chunkq's own column types; a corpus field is text
        self.types = {"id": "text PRIMARY KEY", self.vector: self.type, **WINDOW_COLUMNS}
        try:
            self.conn = psycopg.connect(self.dsn, autocommit=False, connect_timeout=CONNECT_SECONDS)
        except psycopg.Error as exc:
            why = redact(str(exc).strip().splitlines()[0])
            raise ConfigError(f"--to {redacted(self.url)}: cannot connect to PostgreSQL: {why}") from None
        # The table as every statement names it: quoted, so ?table=Docs is "Docs", never docs.
        self.regclass = self.name.as_string(self.conn)
        self.added: list[str] = []
        with self.conn.cursor() as cur:
            self._one_export_at_a_time(cur)
            cur.execute("SELECT to_regclass(%s)", (self.regclass,))
            self.exists = cur.fetchone()[0] is not None
            if self.exists:
                # Until the first batch commits, no other writer changes what the check reads.
                cur.execute(sql.SQL("LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE").format(self.name))
                self._fit(cur)

    def _one_export_at_a_time(self, cur: Any) -> None:
        """Hold the table's export lock (a session advisory lock, gone with the connection) for the
        whole export: the check of what the table holds and every batch after it are one step
        against any other chunkq export (two at once put two runs in one table, or raced to create
        it: ``UniqueViolation ... pg_type_typname_nsp_index``). A second export waits its turn, then
        checks what the first left: the same corpus's other columns go in, another corpus is refused."""
        key = f"chunkq export into {self.regclass}"
        cur.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))", (key,))
        if not cur.fetchone()[0]:
            log.warning("%s: another export is writing to this table; waiting for it to finish", self.label)
            cur.execute("SELECT pg_advisory_lock(hashtextextended(%s, 0))", (key,))

    def columns(self) -> set[str]:
        return set(self.names)

    def held(self) -> Held | None:
        """What the table holds, where it holds rows."""
        import pyarrow as pa
        from psycopg import sql

        if not self.exists:
            return None
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}").format(self.name))
            rows = int(cur.fetchone()[0])
            if not rows:
                return None
            keys = None
            if HASH_COLUMN in self.found:
                cur.execute(sql.SQL("SELECT id, {} FROM {}").format(sql.Identifier(HASH_COLUMN), self.name))
                ids, hashes = zip(*cur.fetchall(), strict=True)
                keys = pa.table(
                    {"id": pa.array(ids, pa.string()), HASH_COLUMN: pa.array(hashes, pa.string())}
                )
        return Held(rows, frozenset(self.found), keys)

    def prepare(self) -> None:
        """Create the table, or add the columns it lacks (null until this export fills them), in the
        transaction the first batch commits."""
        from pgvector.psycopg import register_vector
        from psycopg import sql

        with self.conn.cursor() as cur:
            # Two exports into two new tables of a new database would race to create it too.
            cur.execute("SELECT pg_advisory_xact_lock(hashtextextended('chunkq create extension vector', 0))")
            cur.execute("CREATE EXTENSION IF NOT EXISTS vector")
            if not self.exists:
                columns = sql.SQL(", ").join(
                    sql.SQL("{} " + self.types.get(name, "text")).format(sql.Identifier(name))
                    for name in self.names
                )  # every name quoted: "window" is a word of SQL
                cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(self.name, columns))
            for name in self.to_add:
                column = sql.SQL("ALTER TABLE {} ADD COLUMN {} " + self.types.get(name, "text"))
                cur.execute(column.format(self.name, sql.Identifier(name)))
                self.added.append(name)
        register_vector(self.conn)  # the extension's types, for COPY's binary format
        self.copy_types = [self.types.get(name, "text").split("(")[0].split()[0] for name in self.names]

    def _fit(self, cur: Any) -> None:
        """An existing table rows can be upserted into: an id of text with a primary key or unique
        constraint (ON CONFLICT needs one), this export's columns of the same types (those it lacks
        are added), and no other column that must be filled and has no default."""
        cur.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull AND NOT a.atthasdef "
            "FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped",
            (self.regclass,),
        )
        found = {name: (kind, required) for name, kind, required in cur.fetchall()}
        self.found = set(found)
        where = self.label
        if "id" not in found:
            raise ConfigError(f"{where} has no id column; export to another table")
        if found["id"][0] != "text":
            raise ConfigError(
                f"{where}'s id column is {found['id'][0]}, chunkq's ids are text; export to another table"
            )
        cur.execute(
            "SELECT 1 FROM pg_index i JOIN pg_attribute a "
            "ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) "
            "WHERE i.indrelid = to_regclass(%s) AND i.indisunique AND i.indnkeyatts = 1 AND a.attname = 'id'",
            (self.regclass,),
        )
        if cur.fetchone() is None:
            raise ConfigError(
                f"{where} has no primary key or unique constraint on id, which an upsert by id needs; "
                "export to another table (chunkq creates it with one)"
            )
        required = sorted(name for name, (_, needed) in found.items() if needed and name not in self.names)
        if required:
            raise ConfigError(
                f"{where} requires column(s) {', '.join(required)}, which this export does not fill "
                "(--columns copies corpus fields); export to another table"
            )
        for name in self.names[1:]:
            wanted = self.types.get(name, "text")
            if name in found and found[name][0] != wanted:
                raise ConfigError(
                    f"{where} holds {found[name][0]} in {name}, this run's are {wanted}; export to another "
                    "table, or name another column with --column"
                )
        self.to_add = [n for n in self.names[1:] if n not in found]

    def write(self, ids: list[str], vectors: Any, columns: dict[str, list[Any]]) -> None:
        from psycopg import sql

        names = sql.SQL(", ").join(map(sql.Identifier, self.names))
        updates = sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in self.names[1:]
        )
        staging = sql.SQL("CREATE TEMP TABLE IF NOT EXISTS chunkq_batch (LIKE {}) ON COMMIT DELETE ROWS")
        upsert = sql.SQL("INSERT INTO {} ({}) SELECT {} FROM chunkq_batch ON CONFLICT (id) DO UPDATE SET {}")
        with self.conn.cursor() as cur:
            cur.execute(staging.format(self.name))
            copy_in = sql.SQL("COPY chunkq_batch ({}) FROM STDIN WITH (FORMAT BINARY)").format(names)
            with cur.copy(copy_in) as copy:
                copy.set_types(self.copy_types)
                for i, rid in enumerate(ids):
                    extra = [columns[n][i] for n in self.names[2:]]
                    row = vectors.row(i) if isinstance(vectors, SparseRows) else vectors[i]
                    copy.write_row([rid, _value(row, self.rows.dtype, self.rows.dim), *extra])
            cur.execute(upsert.format(self.name, names, names, updates))
        # A batch is whole or absent (the first with the table's changes): a rerun upserts it again.
        self.conn.commit()

    def close(self) -> dict[str, Any]:
        from psycopg import sql

        self.conn.commit()  # the table's changes, where no batch was written
        with self.conn.cursor() as cur:
            cur.execute(sql.SQL("SELECT count(*) FROM {}").format(self.name))
            count = int(cur.fetchone()[0])
        self.conn.close()
        return {"table_rows": count, "column": self.type, "columns_added": self.added}

    def abort(self) -> None:
        if self.conn is not None and not self.conn.closed:
            self.conn.rollback()
            self.conn.close()
