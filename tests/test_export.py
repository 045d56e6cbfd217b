"""``export`` streams: memory stays flat in the row count, and a damaged result is never exported."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chunkq.jobs.errors import AssemblyError
from chunkq.jobs.store import RunLayout, atomic_write_json, file_sha256
from chunkq.supervisor.export import BATCH_ROWS, export

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
    manifest = {
        "run_id": "big",
        "rows": rows,
        "dim": DIM,
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
        export(layout, "parquet", tmp_path / "out.parquet")
        export(layout, "npy", tmp_path / "out.npy")
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
        with pytest.raises(AssemblyError, match="checksums do not match"):
            export(layout, fmt, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["store"], fmt  # no file, whole or partial
