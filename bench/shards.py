"""A large result on the object store: sharded against one file (issue 22.3).

    python bench/shards.py [--rows 1000000] [--dim 384] [--chunk-rows 10000] [--shard-size 1GiB]

Starts moto's S3 server (a dev dependency) on a loopback port, writes a finished run of ``--rows``
random float32 rows (``--chunk-rows`` a chunk, committed outputs as workers leave them, no model),
then assembles its result twice into the bucket: as shards of ``--shard-size`` and as one
``embeddings.npy`` (a shard size above the result). For each it measures the seconds, the peak
bytes of local scratch (the temporary folder, sampled every 20 ms) and the process's peak RSS,
then ``assemble --verify``'s check and 1,000 random rows read through
``RunResult.embeddings()``. Figures are printed as a table (and JSON with ``--out``).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a file, Python puts bench/ first on sys.path; the repository root instead, for
# tests.helpers' run writer (the same finished run the shard tests assemble).
if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import os
import socket
import subprocess
import tempfile
import threading
import time
from typing import Any

import numpy as np
import psutil

BUCKET = "chunkq-bench"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start_moto() -> subprocess.Popen[bytes]:
    binary = Path(sys.executable).parent / "moto_server"
    port = _free_port()
    proc = subprocess.Popen(
        [str(binary), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.environ |= {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    else:
        proc.kill()
        raise SystemExit("moto_server did not listen within 60 s")
    import s3fs

    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(BUCKET)
    return proc


class Peak:
    """Peak bytes under a folder and peak RSS of this process, sampled in a thread."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.disk, self.rss = folder, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            size = 0
            for root, _, files in os.walk(self.folder):
                for name in files:
                    try:
                        size += os.stat(os.path.join(root, name)).st_size
                    except FileNotFoundError:
                        pass
            self.disk = max(self.disk, size)
            self.rss = max(self.rss, me.memory_info().rss)
            self._stop.wait(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--chunk-rows", type=int, default=10_000)
    parser.add_argument("--shard-size", default="1GiB")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="chunkq-bench-scratch-"))
    tempfile.tempdir = str(scratch)  # where assembly builds what it uploads
    moto = _start_moto()
    try:
        from chunkq.api import RunResult
        from chunkq.jobs.contract.manifest import load_manifest
        from chunkq.jobs.contract.run import Run
        from chunkq.jobs.contract.storage import open_store
        from chunkq.supervisor.result.assemble import assemble
        from chunkq.supervisor.result.published import shard_bytes
        from chunkq.supervisor.result.reader import check_published
        from tests.helpers import write_encoded_run

        started = time.perf_counter()
        store = open_store(f"s3://{BUCKET}/run-{time.time_ns()}")
        layout = write_encoded_run(store, "big", args.rows, args.chunk_rows, args.dim)
        print(f"wrote {args.rows:,} rows x {args.dim} in {time.perf_counter() - started:.1f} s", flush=True)
        manifest = load_manifest(layout)
        size = shard_bytes(args.shard_size)
        result_bytes = args.rows * args.dim * 4
        figures: dict[str, Any] = {
            "rows": args.rows,
            "dim": args.dim,
            "result_mb": round(result_bytes / 1e6, 1),
        }
        for form, limit in (("sharded", size), ("one file", result_bytes + 1)):
            layout.result_manifest.unlink(missing_ok=True)  # assemble anew
            with Peak(scratch) as peak:
                t0 = time.perf_counter()
                result = assemble(Run.of(layout), shard_bytes=limit)
                seconds = time.perf_counter() - t0
            t0 = time.perf_counter()
            problems = check_published(layout, manifest)
            verify = time.perf_counter() - t0
            view = RunResult(layout.run_id, store, args.rows, args.dim, 0.0, 1, None).embeddings()
            picks = np.random.default_rng(0).integers(0, args.rows, 1000)
            t0 = time.perf_counter()
            np.asarray(view[picks])
            lazy = time.perf_counter() - t0
            figures[form] = {
                "shards": len(result.get("shards") or [None]),
                "assemble_s": round(seconds, 1),
                "scratch_peak_mb": round(peak.disk / 1e6, 1),
                "rss_peak_mb": round(peak.rss / 1e6, 1),
                "verify_s": round(verify, 1),
                "verified": problems == [],
                "random_1000_rows_s": round(lazy, 2),
            }
            print(form, json.dumps(figures[form]), flush=True)
        _table(figures, size)
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2) + "\n")
    finally:
        moto.terminate()
        moto.wait(timeout=30)


def _table(figures: dict[str, Any], size: int) -> None:
    print(
        f"\n{figures['rows']:,} rows x {figures['dim']} float32 = {figures['result_mb']} MB; shard size "
        f"{size / 2**20:g} MiB\n"
    )
    print("| form | shards | assemble s | scratch peak MB | peak RSS MB | verify s | 1,000 random rows s |")
    print("|---|---|---|---|---|---|---|")
    for form in ("sharded", "one file"):
        f = figures[form]
        print(
            f"| {form} | {f['shards']} | {f['assemble_s']} | {f['scratch_peak_mb']} | {f['rss_peak_mb']} | "
            f"{f['verify_s']} | {f['random_1000_rows_s']} |"
        )


if __name__ == "__main__":
    main()
