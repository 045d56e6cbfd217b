"""Pay once for a text (issue 32): what the vector cache saves, against the same run with --no-cache.

    python bench/cache.py [--rows 20000] [--dupes-rows 3000 10000] [--repeats 3] [--out cache.json]

Three measurements, each `chunkq run` a fresh process into a fresh store unless said:
- duplicates: a corpus with 30 % exact duplicates, with the cache and with --no-cache, in rounds
  that alternate which runs first: rows encoded (from the run's plan), wall times, each round's
  ratio and the median;
- a new version: version 1 of a corpus (``--rows`` texts) is run to fill the cache; version 2 (2 % of
  texts changed, 1 % added) is run in the same store, and with --no-cache in another: rows encoded
  and wall time;
- look-up: the submit's hash join alone (supervisor.submit.hash_join: spool the corpus, read the
  cache's hashes, join) for corpora and caches of 10^5 and 10^6 texts, each in its own process:
  seconds and peak resident memory.
Texts are paragraphs of 40-120 words drawn from a fixed vocabulary (real corpora cannot be downloaded
here), so a text costs about what a passage of a real corpus does.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHUNKQ = str(Path(sys.executable).parent / "chunkq")
WORDS = (
    "alpha beta gamma delta river mountain queue worker chunk embed vector model sentence graph cloud rain "
    "sun tree ocean lantern copper violet harbor meadow engine signal archive orbit market ledger garden "
    "winter summer bridge station library window silver thunder meadow canyon forest village"
).split()


def paragraphs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(40, 120))) for _ in range(n)]


def write(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def run(corpus: Path, store: Path, *extra: str) -> dict[str, Any]:
    """Wall seconds of `chunkq run` and what its plan says it encoded."""
    started = time.perf_counter()
    done = subprocess.run(
        [CHUNKQ, "run", str(corpus), "--store", str(store), "--chunk-size", "500", *extra],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"chunkq run failed: {done.stderr[-2000:]}")
    newest = max((store / "runs").iterdir(), key=lambda p: (p / "manifest.json").stat().st_mtime)
    manifest = json.loads((newest / "manifest.json").read_text())
    plan = manifest.get("plan")
    encoded = manifest["rows"] if plan is None else plan["encode_rows"] + plan["cache_damaged_rows"]
    return {
        "wall_seconds": round(wall, 2),
        "rows": manifest.get("plan", {}).get("corpus_rows", manifest["rows"]),
        "encoded": encoded,
        "from_cache": 0 if plan is None else plan["cached_rows"],
        "deduplicated": 0 if plan is None else plan["duplicate_rows"],
    }


def duplicates(scratch: Path, rows: int, repeats: int) -> dict[str, Any]:
    """Rounds alternate which of the two runs first; the median round's ratio is the figure."""
    unique = paragraphs(round(rows * 0.7), seed=1)
    rng = random.Random(2)
    texts = unique + [rng.choice(unique) for _ in range(rows - len(unique))]
    rng.shuffle(texts)
    corpus = write(scratch / f"dupes-{rows}.jsonl", texts)
    rounds = []
    for round_ in range(repeats):
        order = ("cache", "no_cache") if round_ % 2 == 0 else ("no_cache", "cache")
        got = {
            kind: run(
                corpus,
                scratch / f"dupes-{rows}-{kind}-{round_}",
                *(["--no-cache"] if kind == "no_cache" else []),
            )
            for kind in order
        }
        got["ratio"] = round(got["cache"]["wall_seconds"] / got["no_cache"]["wall_seconds"], 3)
        rounds.append(got)
        print(json.dumps(got), flush=True)
    ratios = sorted(r["ratio"] for r in rounds)
    return {
        "rows": rows,
        "distinct": len(set(texts)),
        "rounds": rounds,
        "median_ratio": ratios[len(ratios) // 2],
    }


def versions(scratch: Path, rows: int) -> dict[str, Any]:
    v1 = paragraphs(rows, seed=3)
    rng = random.Random(4)
    v2 = list(v1)
    changed = rng.sample(range(rows), round(rows * 0.02))
    for i in changed:
        v2[i] = v2[i] + " revised"
    added = paragraphs(round(rows * 0.01), seed=5)
    v2 += added
    store = scratch / "versions"
    first = run(write(scratch / "v1.jsonl", v1), store)
    second = run(write(scratch / "v2.jsonl", v2), store)
    plain = run(scratch / "v2.jsonl", scratch / "versions-plain", "--no-cache")
    return {
        "changed": len(changed),
        "added": len(added),
        "v1": first,
        "v2_cache": second,
        "v2_no_cache": plain,
        "ratio": round(second["wall_seconds"] / plain["wall_seconds"], 3),
    }


LOOKUP = """
import json, resource, sys, tempfile, time
from pathlib import Path
import numpy as np
from chunkq.jobs.compute.vector_cache import VectorCache, text_hashes
from chunkq.supervisor.submit import hash_join
from chunkq.supervisor.corpus.records import Record
corpus_rows, cache_rows = int(sys.argv[1]), int(sys.argv[2])
root = Path(tempfile.mkdtemp())
cache = VectorCache(root / "store", "b" * 32)
known = text_hashes(f"text {i}" for i in range(cache_rows))
cache.write(known, np.zeros((cache_rows, 4), np.float32), "seed", 0.0)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
records = (Record(f"r{i}", f"text {i * 2}", "") for i in range(corpus_rows))  # half of them are cached
started = time.perf_counter()
spooled = hash_join.spool(records, root)
joined = hash_join.join(spooled, cache, root)
seconds = time.perf_counter() - started
hits = int((np.asarray(joined.hit_shard[:corpus_rows]) >= 0).sum())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"corpus_rows": corpus_rows, "cache_rows": cache_rows, "seconds": round(seconds, 2),
                  "hits": hits, "peak_rss_mib": round(peak / 1024), "rss_before_mib": round(base / 1024)}))
"""


def lookup() -> list[dict[str, Any]]:
    out = []
    for corpus_rows, cache_rows in ((10**5, 10**5), (10**5, 10**6), (10**6, 10**6)):
        done = subprocess.run(
            [sys.executable, "-c", LOOKUP, str(corpus_rows), str(cache_rows)],
            capture_output=True,
            text=True,
            timeout=1800,
            check=True,
        )
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--dupes-rows", type=int, nargs="+", default=[3000, 10000])
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the duplicates pair")
    parser.add_argument("--only", choices=("duplicates", "versions", "lookup"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        if args.only in (None, "lookup"):
            results["lookup"] = lookup()
        if args.only in (None, "duplicates"):
            results["duplicates"] = [duplicates(Path(scratch), n, args.repeats) for n in args.dupes_rows]
            print(json.dumps(results["duplicates"]), flush=True)
        if args.only in (None, "versions"):
            results["versions"] = versions(Path(scratch), args.rows)
            print(json.dumps(results["versions"]), flush=True)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
