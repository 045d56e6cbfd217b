"""``export`` streams: memory stays flat in the row count, and a damaged result is never exported."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkq.jobs.contract.errors import AssemblyError
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, file_sha256
from chunkq.sinks.files import export
from chunkq.supervisor.result.reader import BATCH_ROWS

ROWS, DIM = 200_000, 64  # 51 MB: more than Arrow's Parquet writer buffers (~27 MB, whatever the rows)


def _published(store: Path, rows: int = ROWS) -> tuple[RunLayout, np.ndarray, list[str]]:
    """A published result as assembly writes it: the array, its ids, and a manifest with checksums."""
    layout = RunLayout(store, "big")
    layout.result.mkdir(parents=True)
    rng = np.random.default_rng(0)
    embeddings = rng.standard_normal((rows, DIM), dtype=np.float32)
    ids = [f"row-{i}" for i in range(rows)]
    np.save(layout.result / "embeddings.npy", embeddings)
    (layout.result / "ids.jsonl").write_text("".join(json.dumps(i) + "\n" for i in ids))
    run = {"run_id": "big", "fingerprint": "f" * 64, "model": "m", "options": {}, "rows": rows}
    atomic_write_json(layout.manifest, {**run, "chunk_size": rows, "chunks": 1})
    manifest = {
        **run,
        "corpus_rows": rows,
        "complete": True,
        "missing": [],
        "dim": DIM,
        "dtype": "float32",
        "embeddings_sha256": file_sha256(layout.result / "embeddings.npy"),
        "ids_sha256": file_sha256(layout.result / "ids.jsonl"),
    }
    atomic_write_json(layout.result / "manifest.json", manifest)
    return layout, embeddings, ids


@pytest.mark.slow  # 51 MB traced by tracemalloc: several seconds
def test_parquet_and_npy_exports_stream_with_flat_memory(tmp_path: Path) -> None:
    layout, embeddings, ids = _published(tmp_path / "store")
    batch_bytes = BATCH_ROWS * DIM * 4
    assert embeddings.nbytes > 6 * batch_bytes  # the bound below is far under the whole array

    pool = pa.default_memory_pool()
    arrow_before = pool.max_memory()
    tracemalloc.start()
    try:
        export(Run.of(layout), "parquet", tmp_path / "out.parquet")
        export(Run.of(layout), "npy", tmp_path / "out.npy")
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    arrow_peak = pool.max_memory() - arrow_before
    assert python_peak < 4 * batch_bytes, python_peak
    assert arrow_peak < embeddings.nbytes / 1.5, arrow_peak

    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == ROWS and table.column("id").to_pylist() == ids
    values = table.column("embedding").combine_chunks().flatten().to_numpy()
    assert values.tobytes() == embeddings.tobytes()
    assert np.load(tmp_path / "out.npy").tobytes() == embeddings.tobytes()


def test_a_damaged_result_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    layout, _, _ = _published(tmp_path / "store", rows=3 * BATCH_ROWS)
    path = layout.result / "embeddings.npy"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the last row
    path.write_bytes(bytes(data))
    for fmt in ("parquet", "npy", "jsonl"):
        out = tmp_path / f"out.{fmt}"
        with pytest.raises(AssemblyError, match=r"embeddings\.npy does not match the checksum"):
            export(Run.of(layout), fmt, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["store"], fmt  # no file, whole or partial


def test_out_is_never_replaced_unasked_and_streams_are_written_through(tmp_path: Path) -> None:
    """Issue 21.10: a device, a link to /proc/self/fd/1 and /dev/stdout each became a 2.5 MB regular
    file; an existing file was overwritten silently; a missing folder was created."""
    import os
    import subprocess

    from chunkq.jobs.contract.errors import ConfigError
    from tests.helpers import CLI, cli_env

    layout, embeddings, ids = _published(tmp_path / "store", rows=50)
    existing = tmp_path / "kept.jsonl"
    existing.write_text("mine\n")
    with pytest.raises(ConfigError, match="exists; pass --force to replace it"):
        export(Run.of(layout), "jsonl", existing)
    assert existing.read_text() == "mine\n"
    link = tmp_path / "link.jsonl"
    link.symlink_to(existing)
    export(Run.of(layout), "jsonl", link, force=True)  # replaces the file the link names; the link stays
    assert link.is_symlink() and len(existing.read_text().splitlines()) == 50
    with pytest.raises(ConfigError, match="no such folder"):
        export(Run.of(layout), "jsonl", tmp_path / "missing" / "out.jsonl")
    assert not (tmp_path / "missing").exists()

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    export(Run.of(layout), "parquet", fifo)
    parquet_bytes, _ = reader.communicate(timeout=60)
    assert fifo.exists() and not fifo.is_file()  # still the FIFO, not replaced by a regular file
    (tmp_path / "from-fifo.parquet").write_bytes(parquet_bytes)
    assert pq.read_table(tmp_path / "from-fifo.parquet").column("id").to_pylist() == ids
    with pytest.raises(ConfigError, match="npy writes two files"):
        export(Run.of(layout), "npy", fifo)

    for out in ("-", "/dev/stdout"):
        piped = subprocess.run(
            [*CLI, "export", "big", "--store", str(layout.store), "--format", "jsonl", "--out", out],
            env=cli_env(forks=False),
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert piped.returncode == 0, piped.stderr
        assert b"/dev/stdout" not in piped.stderr  # issue 45.12: no file to name, so none is named
        rows = [json.loads(line) for line in piped.stdout.splitlines()]
        assert [r["id"] for r in rows] == ids and np.allclose([r["embedding"] for r in rows], embeddings)
    assert not Path("/dev/stdout").is_file() or Path("/dev/stdout").is_symlink()


@pytest.mark.slow  # loads or runs the model in a subprocess or several times: the slow tier
def test_an_export_is_written_with_the_callers_umask_and_the_store_stays_owner_only(tmp_path: Path) -> None:
    """Issue 37.7: `chunkq export` wrote 0600 files (the command's own umask); a result is for sharing."""
    import os
    import subprocess

    from tests.helpers import CLI, cli_env

    layout, _, _ = _published(tmp_path / "store", rows=50)
    os.chmod(layout.result / "embeddings.npy", 0o600)
    for fmt, name in (("parquet", "out.parquet"), ("npy", "out.npy"), ("jsonl", "out.jsonl")):
        done = subprocess.run(
            [
                *CLI,
                "export",
                "big",
                "--store",
                str(tmp_path / "store"),
                "--format",
                fmt,
                "--out",
                str(tmp_path / name),
            ],
            env=cli_env(forks=False),
            capture_output=True,
            text=True,
            timeout=120,
            umask=0o022,
        )
        assert done.returncode == 0, done.stderr
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, fmt
    assert (tmp_path / "out.ids.jsonl").stat().st_mode & 0o777 == 0o644
    assert (layout.result / "embeddings.npy").stat().st_mode & 0o777 == 0o600


def test_an_export_into_the_store_is_refused_even_with_force(tmp_path: Path) -> None:
    """Issue 37.16: `export --force --out <store>/runs/<run>/result/embeddings.npy` replaced the published
    file."""
    from chunkq.jobs.contract.errors import ConfigError

    layout, _, _ = _published(tmp_path / "store", rows=20)
    published = layout.result / "embeddings.npy"
    before = published.read_bytes()
    link = tmp_path / "into-the-store.npy"
    link.symlink_to(published)
    for out in (published, layout.root / "copy.jsonl", link):
        with pytest.raises(ConfigError, match="is inside the store"):
            export(Run.of(layout), "npy" if out.suffix == ".npy" else "jsonl", out, force=True)
    assert published.read_bytes() == before and not (layout.root / "copy.jsonl").exists()
    # An .npy's ids beside it, linked into the store: a hostile pass's overwrote another run's ids.
    ids = layout.result / "ids.jsonl"
    ids_before = ids.read_bytes()
    (tmp_path / "q.ids.jsonl").symlink_to(ids)
    with pytest.raises(ConfigError, match="is inside the store"):
        export(Run.of(layout), "npy", tmp_path / "q.npy", force=True)
    assert ids.read_bytes() == ids_before and not (tmp_path / "q.npy").exists()


@pytest.mark.slow
def test_corpus_fields_go_beside_each_row_of_a_parquet_or_jsonl_file_or_are_refused(
    tmp_path: Path, store: Path, connection: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51.12: `export --format parquet --columns text` (and npy, jsonl) ignored --columns. Each
    row carries its own text, a window its own span (over several batches: the value column was
    renamed by the window loop after the first), an .npy or a sparse run refuses them."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.errors import ConfigError
    from chunkq.sinks import files as export_module
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from tests.helpers import write_ragged_run
    from tests.jobs.test_kinds import _encode_in_process
    from tests.jobs.test_windows import _long_text

    monkeypatch.setattr(export_module, "BATCH_ROWS", 5)
    rows = [{"id": f"d{i}", "text": _long_text(70 if i % 2 else 10, seed=i), "n": i} for i in range(8)]
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_id = {r["id"]: r for r in rows}
    for windowed in (False, True):
        options = {"long_texts": "window", "window_tokens": 32, "pool": "mean"} if windowed else {}
        request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), chunk_size=8, **options)
        layout = _encode_in_process(request, connection)
        parquet = export(Run.of(layout), "parquet", tmp_path / f"w{windowed}.parquet", columns=("text", "n"))[
            0
        ]
        table = pq.read_table(parquet).to_pylist()
        jsonl = export(Run.of(layout), "jsonl", tmp_path / f"w{windowed}.jsonl", columns=("text", "n"))[0]
        lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
        assert len(table) == len(lines) > 5 and [r["id"] for r in table] == [r["id"] for r in lines]
        for got in (*table, *lines):
            text = by_id[got["id"]]["text"]
            want = text[got["char_start"] : got["char_end"]] if windowed else text
            assert got["text"] == want and got["n"] == str(by_id[got["id"]]["n"])
            assert len(got["embedding"]) == 384
        with pytest.raises(ConfigError, match=r"--columns: an .npy file holds the matrix alone"):
            export(Run.of(layout), "npy", tmp_path / f"w{windowed}.npy", columns=("text",))
        with pytest.raises(ConfigError, match=r"--columns 'embedding'"):
            export(Run.of(layout), "parquet", tmp_path / "x.parquet", columns=("embedding",))
    sparse = write_ragged_run(tmp_path / "s", "sparse")
    from chunkq.supervisor.result.assemble import assemble

    assemble(Run.of(sparse))
    with pytest.raises(ConfigError, match=r"--columns: a sparse run takes no corpus fields here"):
        export(Run.of(sparse), "parquet", tmp_path / "s.parquet", columns=("text",))
