"""Issue 66.5: every destination is one entry of ``chunkq/sinks/destinations.py``'s table, as a kind
is one entry of ``jobs/kinds``: the CLI's formats, ``--to``'s schemes and their refusal come from
it, both paths share one check that nothing is written in the store, and a store added to the table
alone is what ``export --to`` writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from chunkq.sinks import destinations, export_to
from chunkq.sinks.destinations import DESTINATIONS, FILE_FORMATS, Destination
from chunkq.sinks.files import export
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import run_cli, write_encoded_run


class ListSink:
    """A store of this test's own: the rows it was given, in a module-level list."""

    whole = True
    got: ClassVar[list[tuple[list[str], Any]]] = []

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.label, self.path = f"--to {url}", Path(url.removeprefix("list:"))
        ListSink.got = []

    def writes_to(self) -> list[str]:
        return [str(self.path)]

    def open(self, rows: Any) -> None:
        self.dim = rows.dim

    def columns(self) -> set[str]:
        return set()

    def held(self) -> None:
        return None

    def prepare(self) -> None:
        pass

    def write(self, ids: list[str], vectors: Any, columns: dict[str, list[Any]]) -> None:
        ListSink.got.append((ids, np.array(vectors)))

    def close(self) -> dict[str, Any]:
        return {"kept": sum(len(ids) for ids, _ in ListSink.got)}

    def abort(self) -> None:
        ListSink.got = []


def test_a_store_added_to_the_table_alone_is_what_export_writes(tmp_path: Path, monkeypatch: Any) -> None:
    layout = write_encoded_run(tmp_path / "store", "mine", 50, 20, 8, seed=5)
    assemble(Run.of(layout))
    with pytest.raises(ConfigError, match="--to list:x: chunkq writes to lancedb://PATH/TABLE, faiss:PATH"):
        export_to(Run.of(layout), "list:x")
    mine = Destination("list", "list:PATH", ("list",), f"{__name__}:ListSink")
    monkeypatch.setattr(destinations, "DESTINATIONS", (*DESTINATIONS, mine))
    told = export_to(Run.of(layout), f"list:{tmp_path / 'out'}", batch_rows=16)
    assert told["kept"] == 50 and told["written"] == 50
    ids = [i for batch, _ in ListSink.got for i in batch]
    got = np.concatenate([block for _, block in ListSink.got])
    assert ids == [json.loads(x) for x in (layout.result / "ids.jsonl").read_text().splitlines()]
    assert np.array_equal(got, np.load(layout.result / "embeddings.npy"))
    with pytest.raises(ConfigError, match=r"is inside the store .*export somewhere else"):  # the shared check
        export_to(Run.of(layout), f"list:{layout.store / 'x'}")
    with pytest.raises(ConfigError, match=r"is inside the store .*export somewhere else"):
        export(Run.of(layout), "jsonl", layout.store / "x.jsonl")


def test_the_cli_offers_the_tables_file_formats_and_refuses_other_schemes_from_it(tmp_path: Path) -> None:
    assert FILE_FORMATS == ("parquet", "npy", "jsonl")
    said = run_cli("export", "--help").stdout
    assert "[parquet|npy|jsonl]" in said
    for destination in DESTINATIONS:
        if destination.schemes:
            module, name = destination.sink.split(":")
            assert destinations.for_url(f"{destination.schemes[0]}:x") is destination
            assert callable(getattr(__import__(module, fromlist=[name]), name))
    with pytest.raises(ConfigError) as refused:
        destinations.for_url("qdrant://localhost/c")
    assert all(d.usage in str(refused.value) for d in DESTINATIONS if d.schemes)


def test_a_files_name_chooses_its_format_and_a_name_that_says_another_is_refused(tmp_path: Path) -> None:
    """A newcomer's `export RUN --out e.jsonl` wrote Parquet under that name and said it was written.
    The ending chooses the format; --format that another ending contradicts, or an ending chunkq does
    not write (.csv) with no --format, is refused before anything is read."""
    file_format = destinations.file_format
    assert [file_format(Path(n), None) for n in ("a.jsonl", "a.NDJSON", "a.npy", "a.pq", "a", "-")] == [
        "jsonl",
        "jsonl",
        "npy",
        "parquet",
        "parquet",
        "parquet",
    ]
    assert file_format(Path("a.bin"), "npy") == "npy" and file_format(Path("-"), "jsonl") == "jsonl"
    with pytest.raises(ConfigError, match=r"names a jsonl file, and --format is parquet"):
        file_format(Path("e.jsonl"), "parquet")
    with pytest.raises(
        ConfigError, match=r"\.parquet \(parquet\), \.npy \(npy\), \.jsonl \(jsonl\) files, and \.csv"
    ):
        file_format(Path("out.csv"), None)
    store = tmp_path / "store"
    assemble(Run.of(write_encoded_run(store, "dense", 6, 3, 4)))
    written = run_cli(
        "export", "dense", "--store", str(store), "--out", str(tmp_path / "e.jsonl"), forks=False
    )
    assert written.returncode == 0, written.stderr
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and set(rows[0]) == {"id", "embedding"}
    refused = run_cli("export", "dense", "--store", str(store), "--out", str(tmp_path / "e.csv"), forks=False)
    assert refused.returncode != 0 and "and .csv is none of them" in refused.stderr
    assert not (tmp_path / "e.csv").exists()
