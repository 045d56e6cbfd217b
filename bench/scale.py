"""How a run's costs grow with its chunk count: a growth table (issue 22).

    python bench/scale.py [--chunks 2000 5000 20000] [--workers 1] [--out scale.json]

Each size is a fresh ``chunkq run`` of N chunks of one short text (``--chunk-size 1``, the bundled
model on the CPU) against a Valkey server this script starts (so Redis can be measured after the
run too). Measured for each size:
- wall time of the run and chunks/s; per-chunk overhead: wall time / chunks, minus the encode time
  the workers report, and at steady state (the first chunk's start to the last one's end, so
  start-up and assembly are left out);
- the supervisor's peak RSS (the ``chunkq run`` process, sampled every 50 ms);
- Redis ``used_memory``: peak while the run goes on (sampled) and after it;
- ``status``, ``status --json``, ``runs`` and ``report``: seconds and peak RSS, each a fresh process;
- ``assemble`` again (the result removed first): seconds; the result's size.
Printed as a table with each figure's growth against the smallest size.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import redis

from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.server.embedded_redis import EmbeddedRedis
from chunkq.supervisor.store.ledger import of_run

CLI = [sys.executable, "-m", "chunkq.cli"]
WORDS = "alpha beta gamma delta river mountain queue worker chunk embed vector model".split()


def _peak_rss(proc: subprocess.Popen[bytes], samples: list[float], stop: threading.Event) -> None:
    try:
        me = psutil.Process(proc.pid)
        while not stop.is_set() and proc.poll() is None:
            samples.append(me.memory_info().rss)
            time.sleep(0.05)
    except psutil.Error:
        pass


def timed(cmd: list[str], **kw: Any) -> tuple[float, float, subprocess.CompletedProcess[bytes]]:
    """(seconds, peak RSS MB, completed process) of one command in a fresh process."""
    samples: list[float] = [0.0]
    stop = threading.Event()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    sampler = threading.Thread(target=_peak_rss, args=(proc, samples, stop), daemon=True)
    sampler.start()
    out, err = proc.communicate()
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    return seconds, max(samples) / 2**20, done


def _span(run_dir: Path) -> float:
    """Seconds from the first chunk's start to the last chunk's end, as ``status`` measures them."""
    return of_run(run_dir.parent.parent, run_dir.name).seconds(running=False) or 0.0


def measure(chunks: int, workers: int, server: EmbeddedRedis, scratch: Path) -> dict[str, Any]:
    corpus, store = scratch / f"c{chunks}.jsonl", scratch / f"store{chunks}"
    with open(corpus, "w", encoding="utf-8") as fh:
        for i in range(chunks):
            fh.write(json.dumps({"id": f"t{i}", "text": f"{WORDS[i % len(WORDS)]} {i}"}) + "\n")
    connection = redis.Redis.from_url(server.url)
    connection.flushdb()
    connection.config_resetstat()
    peak_redis = [0]
    stop = threading.Event()

    def sample_redis() -> None:
        while not stop.is_set():
            peak_redis[0] = max(peak_redis[0], int(connection.info("memory")["used_memory"]))
            time.sleep(0.05)

    baseline = int(connection.info("memory")["used_memory"])
    sampler = threading.Thread(target=sample_redis, daemon=True)
    sampler.start()
    run = [*CLI, "run", str(corpus), "--chunk-size", "1", "--store", str(store), "--redis-url", server.url]
    run += ["--cpu-workers", str(workers), "--queue", f"scale{chunks}"]
    wall, supervisor_mb, _ = timed(run)
    stop.set()
    sampler.join()
    after = int(connection.info("memory")["used_memory"])
    (run_dir,) = (store / "runs").iterdir()
    run_id = run_dir.name
    encode = 0.0
    for line in RunLayout(store, run_id).result_manifest.read_text().splitlines():
        if '"encode_seconds"' in line:
            encode = float(line.split(":")[1].strip().rstrip(","))
    figures: dict[str, Any] = {
        "chunks": chunks,
        "wall_s": round(wall, 1),
        "chunks_per_s": round(chunks / wall, 1),
        "overhead_ms_per_chunk": round(1000 * (wall - encode / workers) / chunks, 1),
        "steady_overhead_ms_per_chunk": round(1000 * (_span(run_dir) - encode / workers) / chunks, 1),
        "supervisor_peak_mb": round(supervisor_mb, 1),
        "redis_peak_mb": round((peak_redis[0] - baseline) / 2**20, 2),
        "redis_after_mb": round((after - baseline) / 2**20, 2),
    }
    for name, extra in (("status", []), ("status_json", ["--json"]), ("runs", None), ("report", [])):
        cmd = [*CLI, "runs", "--store", str(store)] if extra is None else [*CLI, name.split("_")[0], run_id]
        if extra is not None:
            cmd += [*extra, "--store", str(store)]
        seconds, mb, _ = timed(cmd)
        figures[f"{name}_s"], figures[f"{name}_mb"] = round(seconds, 2), round(mb, 1)
    shutil.rmtree(run_dir / "result")
    figures["assemble_s"] = round(timed([*CLI, "assemble", run_id, "--store", str(store)])[0], 2)
    figures["result_mb"] = round(sum(p.stat().st_size for p in (run_dir / "result").iterdir()) / 2**20, 2)
    shutil.rmtree(store)
    return figures


def table(rows: list[dict[str, Any]]) -> str:
    keys = [k for k in rows[0] if k != "chunks"]
    lines = ["| figure | " + " | ".join(f"{r['chunks']:,} chunks" for r in rows) + " | growth |"]
    lines.append("|---" * (len(rows) + 2) + "|")
    for key in keys:
        first, last = rows[0][key], rows[-1][key]
        growth = f"{last / first:.2f}x" if isinstance(first, int | float) and first else "-"
        lines.append(f"| {key} | " + " | ".join(str(r[key]) for r in rows) + f" | {growth} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--chunks", type=int, nargs="+", default=[2000, 5000, 20000])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", type=Path, help="Also write the figures as JSON here.")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="chunkq-scale-") as tmp:
        scratch = Path(tmp)
        server = EmbeddedRedis(scratch / "redis").start()
        try:
            for chunks in args.chunks:
                rows.append(measure(chunks, args.workers, server, scratch))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    print(table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
