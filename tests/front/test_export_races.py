"""Issue 63.2: two exports into one table at once. The check of what a table holds and the writes
after it are one step against any other export: a second export waits for the first, then checks
what it left, so two runs never share a table, and a dense and a sparse export of one corpus (the
hybrid recipe) both land. Real LanceDB and a real PostgreSQL with pgvector; the first export is held
where the hostile pass found the hole: its check done, its table created, no row written yet."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from chunkq.sinks import export_to
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import wait_for, write_encoded_run, write_ragged_run

WAIT = 90.0


def _url(sink: str, tmp_path: Path, pg: str) -> str:
    return (
        f"lancedb://{tmp_path / 'db'}/docs" if sink == "lancedb" else f"{pg}&table=docs_{tmp_path.name[-12:]}"
    )


class _Said(logging.Handler):
    """Sets ``seen`` once a log line holds ``words``, whichever thread logs it."""

    def __init__(self, words: str) -> None:
        super().__init__(logging.WARNING)
        self.words, self.seen = words, threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if self.words in record.getMessage():
            self.seen.set()


def _at_once(first: Callable[..., Any], second: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    """Run ``first`` until its destination is ready and holds no row of it, start ``second`` and
    wait until it says it waits for the first, then let the first go on; both outcomes."""
    holding, release = threading.Event(), threading.Event()
    done: dict[str, Any] = {}

    def hold(progress: Any) -> None:
        if progress.written == 0:
            holding.set()
            assert release.wait(WAIT)

    def call(name: str, export: Callable[..., Any], **kwargs: Any) -> None:
        try:
            done[name] = export(**kwargs)
        except Exception as exc:
            done[name] = exc

    said = _Said("waiting for it")
    logging.getLogger().addHandler(said)
    threads = [threading.Thread(target=call, args=("first", first), kwargs={"on_progress": hold})]
    try:
        threads[0].start()
        assert holding.wait(WAIT), done
        threads.append(threading.Thread(target=call, args=("second", second)))
        threads[1].start()
        wait_for(lambda: said.seen.is_set() or "second" in done, WAIT, "the second export to wait")
        assert "second" not in done, done["second"]  # it waits, neither refused nor written
    finally:
        release.set()
        for thread in threads:
            thread.join(WAIT)
        logging.getLogger().removeHandler(said)
    yield done


def _rows(sink: str, url: str, pg: str) -> dict[str, dict[str, Any]]:
    """Each row of the table by id: its text hash and which vector columns it fills."""
    if sink == "lancedb":
        import lancedb

        where, _, name = url[len("lancedb://") :].rpartition("/")
        data = lancedb.connect(where).open_table(name).to_arrow().to_pylist()
    else:
        import psycopg

        table = url.rpartition("table=")[2]
        with psycopg.connect(pg) as conn, conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
            cur.execute(f"SELECT * FROM {table}")  # noqa: S608 - the test's own table name
            data = cur.fetchall()
    return {row["id"]: row for row in data}


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["lancedb", "pgvector"])
def test_two_exports_of_two_runs_into_one_new_table_never_mix(
    tmp_path: Path, postgres: str, sink: str
) -> None:
    """Before: both exits 0 and 6,000 rows of two corpora in one table (LanceDB 3 of ~10 tries,
    pgvector every time the first was held between its check and its create)."""
    first = write_encoded_run(tmp_path / "a", "first", 600, 200, 16, seed=1, texts="alpha")
    second = write_encoded_run(tmp_path / "b", "second", 600, 200, 16, seed=2, texts="beta")
    assemble(Run.of(first))
    assemble(Run.of(second))
    url = _url(sink, tmp_path, postgres)
    (done,) = _at_once(
        lambda **kw: export_to(Run.of(first), url, batch_rows=200, **kw),
        lambda **kw: export_to(Run.of(second), url, batch_rows=200, **kw),
    )
    assert done["first"]["table_rows"] == 600, done
    refused = done["second"]
    assert isinstance(refused, ConfigError) and "600 of another text" in str(refused)
    rows = _rows(sink, url, postgres)
    assert len(rows) == 600
    from chunkq.sinks.row_texts import HASH_COLUMN, text_sha256

    assert all(row[HASH_COLUMN] == text_sha256(f"alpha {rid[1:]}") for rid, row in rows.items())


@pytest.mark.slow
@pytest.mark.parametrize("sink", ["lancedb", "pgvector"])
def test_a_dense_and_a_sparse_export_of_one_corpus_at_once_both_land(
    tmp_path: Path, postgres: str, sink: str
) -> None:
    dense = write_encoded_run(tmp_path / "d", "dense", 200, 20, 16, seed=3)
    sparse = write_ragged_run(tmp_path / "s", "sparse", rows=200, chunk_size=20, seed=4)
    assemble(Run.of(dense))
    assemble(Run.of(sparse))
    url = _url(sink, tmp_path, postgres)
    (done,) = _at_once(
        lambda **kw: export_to(Run.of(dense), url, batch_rows=50, **kw),
        lambda **kw: export_to(Run.of(sparse), url, batch_rows=50, **kw),
    )
    assert done["first"]["written"] == done["second"]["written"] == 200, done
    rows = _rows(sink, url, postgres)
    vector, sparse_column = ("vector", "sparse_indices") if sink == "lancedb" else ("embedding", "sparse")
    assert len(rows) == 200
    assert all(row[vector] is not None and row[sparse_column] is not None for row in rows.values())
