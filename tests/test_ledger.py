"""The run's ledger and summary (issue 22.2): status and report read a file per LEDGER_BATCH chunks,
agree with the chunk outputs, and rebuild what is missing from the outputs, once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.manifest import load_manifest
from chunkq.jobs.store import read_json
from chunkq.supervisor import ledger as ledger_module
from chunkq.supervisor.ledger import Ledger, read_ledger
from chunkq.supervisor.progress import store_snapshot
from chunkq.supervisor.throughput import of_outputs


def _opened(layout: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The chunk output metadata files this test's readers open, by name."""
    opened: list[str] = []
    real = ledger_module.read_json

    def counting(path: Path) -> Any:
        if path.stem.isdigit():  # a chunk output's metadata, not summary.json
            opened.append(path.name)
        return real(path)

    monkeypatch.setattr(ledger_module, "read_json", counting)
    return opened


def test_the_ledger_is_built_once_from_the_outputs_and_then_read_instead_of_them(
    encoded_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, _, _ = encoded_run
    manifest = load_manifest(layout)
    opened = _opened(layout, monkeypatch)
    outputs = [read_json(layout.output_meta(i)) for i in range(manifest.chunks)]
    want = of_outputs(outputs)

    first = store_snapshot(layout, manifest)  # no ledger yet: every output is read, then recorded
    assert sorted(opened) == [f"{i:06d}.json" for i in range(manifest.chunks)]
    assert sorted(r["chunk"] for r in read_ledger(layout)) == list(range(manifest.chunks))
    summary = json.loads(layout.summary.read_text())
    assert summary["chunks_recorded"] == manifest.chunks and summary["rows_recorded"] == 47

    opened.clear()
    again = store_snapshot(layout, manifest)
    assert opened == []  # the ledger answered: no chunk output was read
    assert again.rows_per_second == first.rows_per_second == want.rows_per_second(False)
    assert (again.chunks_done, again.rows_done) == (manifest.chunks, 47)

    # The ledger deleted: rebuilt from the outputs, once.
    for batch in layout.ledger.iterdir():
        batch.unlink()
    layout.summary.unlink()
    store_snapshot(layout, manifest)
    assert len(opened) == manifest.chunks and layout.summary.is_file()
    opened.clear()
    store_snapshot(layout, manifest)
    assert opened == []

    # A summary that covers fewer chunks than are done (stale) is not trusted: the ledger answers.
    layout.summary.write_text(json.dumps({**summary, "chunks_recorded": 1, "rows_recorded": 1}))
    assert store_snapshot(layout, manifest).rows_per_second == want.rows_per_second(False)


def test_an_owner_writes_batches_and_never_records_a_chunk_twice(
    encoded_run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    layout, _, _ = encoded_run
    monkeypatch.setattr(ledger_module, "LEDGER_BATCH", 2)
    ledger = Ledger.open(layout)
    metas = [read_json(layout.output_meta(i)) for i in range(5)]
    for meta in metas + metas[:2]:
        ledger.add(meta)
    ledger.flush()  # five pending, two to a batch: written at once
    assert sorted(p.name for p in layout.ledger.iterdir()) == ["000000.jsonl", "000001.jsonl", "000002.jsonl"]
    reopened = Ledger.open(layout)
    assert reopened.recorded == set(range(5)) and reopened.throughput == of_outputs(metas)
    reopened.add(metas[0])
    assert reopened.pending == []
