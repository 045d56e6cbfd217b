"""Whether an export may write into a table that already holds rows.

A table chunkq writes holds one corpus's rows, and every column of a row comes from that row's text:
a dense run's vector beside a sparse run's, each row's ``text_sha256`` saying which text it is
(``row_texts``). An export into a table that holds rows goes ahead only when it keeps that true:

- every row the table holds is one of the run's rows, with the same text (none *missing* from the
  run, none *changed*): otherwise some rows would keep another text's vectors beside this run's;
- the run brings rows the table lacks (*extra*) only into a table with no column this export does
  not write (a rerun of the same export after a kill): otherwise those rows would lack the others.

Anything else is refused before the table is touched, in one line with the three counts. A table
with rows and no ``text_sha256`` column (written by another tool, or by chunkq before 51.4) cannot be
checked, so it is refused too; export to a new table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkq.jobs.contract.errors import ConfigError
from chunkq.sinks.row_texts import HASH_COLUMN


@dataclass(frozen=True)
class Held:
    """What a table already holds: its rows, its columns, and each row's id and text hash (None
    where it has no hash column)."""

    rows: int
    columns: frozenset[str]
    keys: Any  # a pyarrow Table of id and text_sha256, or None


def check_same_rows(where: str, held: Held, run_keys: Any, writes: set[str]) -> None:
    """ConfigError unless writing ``run_keys`` (a pyarrow Table: id, text_sha256) into the table
    keeps every row's columns from its own text; ``writes``: the columns this export writes."""
    if held.keys is None:
        raise ConfigError(
            f"{where} holds {held.rows:,} rows and no {HASH_COLUMN} column, so chunkq cannot check that "
            "they are this run's texts before adding its columns beside them; export to a new table"
        )
    missing, extra, changed = _differences(held.keys, run_keys)
    others = sorted(held.columns - writes)
    if not (missing or changed or (extra and others)):
        return
    raise ConfigError(
        f"{where} holds other rows than this run's: {missing:,} the run does not have, {extra:,} the "
        f"table does not have, {changed:,} of another text (the table: {held.rows:,} rows, the run: "
        f"{run_keys.num_rows:,}); every row of a table chunkq writes has all its columns from one text"
        + (f" (this export does not write {', '.join(others)}); " if others else "; ")
        + "export to a new table, or run the other exports again on this run's corpus"
    )


def _differences(table: Any, run: Any) -> tuple[int, int, int]:
    """(rows of the table the run lacks, rows of the run the table lacks, rows in both whose texts
    differ or whose table hash is empty)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    def side(keys: Any, name: str) -> Any:
        present = pa.array(np.ones(keys.num_rows, dtype=bool))
        return pa.table({"id": keys.column("id"), f"{name}_hash": keys.column(HASH_COLUMN), name: present})

    joined = side(run, "run").join(side(table, "table"), keys="id", join_type="full outer")
    in_run = pc.fill_null(joined.column("run"), False)
    in_table = pc.fill_null(joined.column("table"), False)
    same = pc.fill_null(pc.equal(joined.column("run_hash"), joined.column("table_hash")), False)

    def count(mask: Any) -> int:
        return int(pc.sum(pc.cast(mask, pa.int64())).as_py() or 0)

    return (
        count(pc.and_(in_table, pc.invert(in_run))),
        count(pc.and_(in_run, pc.invert(in_table))),
        count(pc.and_(pc.and_(in_run, in_table), pc.invert(same))),
    )
