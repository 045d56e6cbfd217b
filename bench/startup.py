"""The first seconds (issue 24.4): time to the first chunk and to a 2-text ``chunkq.embed``, against
loading the model in a plain process in the same run.

    python bench/startup.py [--repeats 3] [--out startup.json]

Each figure is a fresh process, timed from its launch, in rounds that alternate the four
measurements (the median of ``--repeats`` rounds is reported):
- plain load: ``SentenceTransformer(<bundled model>)`` in a new Python process (imports included);
- plain load + encode: the same, then ``encode`` of 2 texts;
- chunkq run, first chunk: ``chunkq run`` of 200 short texts (chunks of 50) into a new store, from
  launch to the first chunk's ``started_at`` (its output metadata), and to the end;
- chunkq.embed, 2 texts: ``import chunkq; chunkq.embed(["first text", "second text"])`` (in the
  caller's process, as a few texts are: issue 37.4), and the same with ``isolated=True`` (a run:
  embedded Redis, a pool, a store);
- a second query in a process that has embedded once: the in-process path's cost per call.
- first rows: from the run's launch to its first batch's rows, and each step before them, as
  ``chunkq report`` gives them (issue 46.4); and from the last chunk's end to the result written.
Goals: first chunk <= 1.5x the plain load; embed of 2 texts <= 2x the plain load and encode; first
rows <= the plain load + 3 s; last chunk to result <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.store.ledger import of_run
from chunkq.tools import first_row
from chunkq.tools.run_facts import gather

CHUNKQ = str(Path(sys.executable).parent / "chunkq")
PLAIN = (
    "from sentence_transformers import SentenceTransformer; m = SentenceTransformer({path!r}, device='cpu')"
)
ENCODE = "; m.encode(['first text', 'second text'])"
EMBED = "import chunkq; chunkq.embed(['first text', 'second text'])"
EMBED_ISOLATED = "import chunkq; chunkq.embed(['first text', 'second text'], isolated=True)"
SECOND_QUERY = (
    "import time, chunkq; chunkq.embed(['warm']); t = time.perf_counter(); chunkq.embed(['a query']); "
    "print(time.perf_counter() - t)"
)


def _timed(cmd: list[str]) -> tuple[float, float]:
    """(launch time as epoch seconds, seconds the command took); raises if it failed."""
    launched, started = time.time(), time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)[:120]} failed: {done.stderr[-2000:]}")
    return launched, time.perf_counter() - started


def _first_chunk(scratch: Path, round_: int) -> tuple[float, float, dict[str, Any]]:
    """(seconds from launch to the first chunk's start, seconds to the end, the report's account of
    the seconds before the first row) of a fresh chunkq run."""
    corpus = scratch / "startup.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": f"short text number {i}"}) + "\n" for i in range(200)))
    store = scratch / f"store-{round_}"
    launched, total = _timed([CHUNKQ, "run", str(corpus), "--store", str(store), "--chunk-size", "50"])
    (run_dir,) = (store / "runs").iterdir()
    first = of_run(store, run_dir.name).first_start
    assert first is not None
    layout = RunLayout(store, run_dir.name)
    run = Run.of(layout)
    facts = gather(run)
    before = first_row.breakdown(run, facts.first, facts.throughput.last_end)
    return first.timestamp() - launched, total, before


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    path = resolve_model(BUNDLED_MODEL)
    names = (
        "load",
        "load_encode",
        "first_chunk",
        "first_rows",
        "last_chunk_to_result",
        "run",
        "embed",
        "embed_isolated",
        "second_query",
    )
    steps: list[list[Any]] = []
    figures: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory(prefix="chunkq-startup-") as scratch:
        for round_ in range(args.repeats):
            figures["load"].append(_timed([sys.executable, "-c", PLAIN.format(path=path)])[1])
            first, total, before = _first_chunk(Path(scratch), round_)
            figures["first_chunk"].append(first)
            figures["first_rows"].append(before["first_row_seconds"])
            figures["last_chunk_to_result"].append(before["last_chunk_to_result_seconds"])
            steps.append(before["marks"])
            figures["run"].append(total)
            figures["load_encode"].append(_timed([sys.executable, "-c", PLAIN.format(path=path) + ENCODE])[1])
            figures["embed"].append(_timed([sys.executable, "-c", EMBED])[1])
            figures["embed_isolated"].append(_timed([sys.executable, "-c", EMBED_ISOLATED])[1])
            second = subprocess.run(
                [sys.executable, "-c", SECOND_QUERY], capture_output=True, text=True, check=True
            )
            figures["second_query"].append(float(second.stdout.strip().splitlines()[-1]))
            print(json.dumps({k: round(v[-1], 2) for k, v in figures.items()}), flush=True)
    median = {k: statistics.median(v) for k, v in figures.items()}
    result: dict[str, Any] = {
        "median_seconds": {k: round(v, 2) for k, v in median.items()},
        "first_chunk_vs_load": round(median["first_chunk"] / median["load"], 2),
        "embed_vs_load_encode": round(median["embed"] / median["load_encode"], 2),
        # issue 46.4: the first rows at most the plain imports + load + 3 s
        "first_rows_minus_load": round(median["first_rows"] - median["load"], 2),
        "steps_of_each_round": steps,
        "rounds": {k: [round(x, 2) for x in v] for k, v in figures.items()},
    }
    print(
        f"\nmedian of {args.repeats} rounds (s): plain load {median['load']:.2f}, plain load + encode "
        f"{median['load_encode']:.2f}; chunkq run: first chunk {median['first_chunk']:.2f} "
        f"({result['first_chunk_vs_load']}x the plain load; goal <= 1.5x), first rows "
        f"{median['first_rows']:.2f} (the plain load + {result['first_rows_minus_load']}; goal <= + 3 s), "
        f"last chunk to result {median['last_chunk_to_result']:.2f} (goal <= 2 s), "
        f"whole run {median['run']:.2f}; "
        f"chunkq.embed of 2 texts {median['embed']:.2f} ({result['embed_vs_load_encode']}x the plain load "
        f"and encode; goal <= 2x), isolated {median['embed_isolated']:.2f}; a second query in a warm "
        f"process {median['second_query'] * 1000:.1f} ms"
    )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
