"""``--columns``: corpus fields copied beside each exported row, read from the run's corpus in step
with the result (both are in corpus order; a window's rows share their text's record, and the text
field of a window is the window's own span, not its whole document)."""

from __future__ import annotations

import json
import re
from typing import Any

from chunkq.jobs.contract.errors import ConfigError, StoreError
from chunkq.sinks.row_texts import HASH_COLUMN
from chunkq.sinks.rows import WINDOW_FIELDS

COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# chunkq's own columns: a row's key, its window, and the hash of its text (sinks/row_texts.py)
KEYS = frozenset({"id", "text_id", HASH_COLUMN, *WINDOW_FIELDS})
VECTOR_DEFAULTS = ("vector", "embedding", "sparse")  # the sinks' vector columns, unless --column names one


def vector_columns(base: str) -> set[str]:
    """The columns a vector named ``base`` may take: itself, or a sparse one's two LanceDB columns."""
    return {base, f"{base}_indices", f"{base}_values"}


def _check(name: str, flag: str, described: str, reserved: frozenset[str]) -> None:
    if not COLUMN_NAME.fullmatch(name) or name in reserved:
        raise ConfigError(
            f"{flag} {name!r}: {described} with letters, digits and underscores, other than "
            f"{', '.join(sorted(reserved))}"
        )


def check_columns(columns: tuple[str, ...], vector_column: str | None = None) -> None:
    """``--columns`` names and ``--column``'s: valid, and none of them a column chunkq writes itself
    (``--columns sparse_values`` failed inside LanceDB and PostgreSQL)."""
    if vector_column is not None:
        _check(vector_column, "--column", "a name", KEYS)
    bases = (vector_column,) if vector_column else VECTOR_DEFAULTS
    reserved = KEYS.union(*(vector_columns(base) for base in bases))
    for name in columns:
        _check(name, "--columns", "a corpus field named", reserved)


def _as_text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def check_present(manifest: Any, names: tuple[str, ...]) -> None:
    """ConfigError for a field no row of the run's corpus has a value for (``--columns nosuch``
    wrote a column of nulls): the corpus is read until each has one, its first row as a rule."""
    from chunkq.supervisor.corpus.files import run_corpus_fields

    wanting = set(names)
    for record in run_corpus_fields(manifest, names):
        wanting -= {name for name, value in (record.extra or {}).items() if value is not None}
        if not wanting:
            return
    raise ConfigError(
        f"--columns {', '.join(sorted(wanting))}: no row of run {manifest.run_id}'s corpus has a value "
        "for it; name fields the corpus holds"
    )


class CorpusColumns:
    """The corpus fields of each result row."""

    def __init__(self, manifest: Any, names: tuple[str, ...], windowed: bool) -> None:
        from chunkq.supervisor.corpus.files import run_corpus_fields

        check_present(manifest, names)
        self.names, self.windowed = names, windowed
        self.text_field = str(manifest.data["corpus"]["text_field"])
        self.records = run_corpus_fields(manifest, names)
        self.current: Any = None

    def of(self, ids: list[Any]) -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {name: [] for name in self.names}
        for rid in ids:
            key = str(rid["id"] if self.windowed else rid)
            while self.current is None or self.current.id != key:
                self.current = next(self.records, None)
                if self.current is None:
                    raise StoreError(f"--columns: row {key!r} of the result is not in the run's corpus")
            for name in self.names:
                value = (self.current.extra or {}).get(name)
                if self.windowed and name == self.text_field and isinstance(value, str):
                    value = value[int(rid["char_start"]) : int(rid["char_end"])]  # the window's own text
                found[name].append(_as_text(value))
        return found


def beside_rows(manifest: Any, names: tuple[str, ...], value_column: str, windowed: bool) -> Any:
    """The reader of corpus fields ``names`` beside a file's rows (None without any), the names
    checked against the file's own columns first (``export --format parquet|jsonl --columns``)."""
    if not names:
        return None
    check_columns(names, value_column)
    return CorpusColumns(manifest, names, windowed)
