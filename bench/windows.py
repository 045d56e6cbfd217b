"""Long texts as windows (issue 33): ``--long-texts window`` and ``late`` against ``truncate`` on
real long text, the module docstrings of this Python's standard library (no corpus can be
downloaded here).

    python bench/windows.py [--repeats 2] [--modes truncate,window,late] [--out windows.json]

Each figure is `chunkq run` in a fresh process into a fresh store (chunks of 200, the bundled model,
its maximum length 256 tokens), rounds alternating which mode runs first. Reported per mode: wall
time, result rows, rows per second as `chunkq status` reports it (rows encoded over the time chunks
ran), and tokens per second (the text's tokens a mode reads over its wall time: a truncated text
counts the 254 it keeps; window and late read every token). Late's windows are a quarter of the
context (63 tokens) by default, so it gives about four times the rows of window.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.model_info import load_tokenizer
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.supervisor.store.ledger import of_run

CHUNKQ = str(Path(sys.executable).parent / "chunkq")


def docstrings() -> list[str]:
    """Every module docstring of the standard library of 200 characters or more."""
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and len(doc) >= 200:
            found.append(doc)
    return found


def run(corpus: Path, store: Path, mode: str) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(
        [CHUNKQ, "run", str(corpus), "--store", str(store), "--chunk-size", "200", "--long-texts", mode],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"chunkq run failed: {done.stderr[-2000:]}")
    (run_dir,) = (store / "runs").iterdir()
    result = json.loads((run_dir / "result" / "manifest.json").read_text())
    rate = of_run(store, run_dir.name).rows_per_second(running=False)
    return {"wall_seconds": round(wall, 2), "rows": result["rows"], "rows_per_second": round(rate or 0, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="truncate,window,late")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    texts = docstrings()
    tokenizer = load_tokenizer(resolve_model(BUNDLED_MODEL))
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    kept = sum(min(n, 254) for n in lengths)
    corpus_info = {
        "texts": len(texts),
        "tokens": sum(lengths),
        "longer_than_254_tokens": sum(n > 254 for n in lengths),
        "median_tokens": statistics.median(lengths),
        "max_tokens": max(lengths),
    }
    print(json.dumps(corpus_info), flush=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as scratch:
        corpus = Path(scratch) / "docstrings.jsonl"
        corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        for round_ in range(args.repeats):
            modes = args.modes.split(",")
            order = modes[round_ % len(modes) :] + modes[: round_ % len(modes)]  # each mode first in turn
            got = {mode: run(corpus, Path(scratch) / f"{mode}-{round_}", mode) for mode in order}
            for mode, figures in got.items():
                read = kept if mode == "truncate" else sum(lengths)
                figures["tokens_per_second"] = round(read / figures["wall_seconds"], 1)
            rounds.append(got)
            print(json.dumps(got), flush=True)
    results = {"corpus": corpus_info, "rounds": rounds}
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
