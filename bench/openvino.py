"""Runtimes on the CPU as whole commands (issue 67.4): chunkq with each backend and precision against
plain sentence-transformers on PyTorch and on OpenVINO, on the same texts.

    python bench/openvino.py [--rows 10000] [--repeats 2] [--out openvino.json]

Needs the ``openvino`` extra (``make test-openvino`` builds such an environment: run this with its
python). Every text distinct (``bench/gpu.py``'s docstring corpus: the vector cache saves nothing),
the bundled all-MiniLM-L6-v2, batch 32, torch's own thread count; each round runs every variant once
as a whole process, the order turned each round:

- ``plain torch``: ``SentenceTransformer(model).encode(texts)`` and ``np.save`` (``bench/whole.py``'s);
- ``plain openvino f32``: the same with ``backend="openvino"`` and the f32 precision hint;
- ``chunkq torch``, ``chunkq openvino f32``, ``chunkq openvino bf16``: ``chunkq run`` with the
  defaults and ``--backend``/``--precision``; each in a store of its own, the OpenVINO export
  already in this host's cache (made by a first, untimed run), as every run after a host's first;
- ``chunkq openvino int8``: the same with ``--precision int8`` and the model ``chunkq quantize`` made
  (untimed, its seconds printed) from the corpus's first 300 texts.

``--variants`` picks some (comma-separated); ``plain torch`` and ``chunkq torch`` always run, the
ratios' bases.

Prints and writes, per variant: the median wall seconds, the load average at each start, the ratio
to ``chunkq torch`` and to ``plain torch``, and each chunkq result's max abs difference and min
cosine against plain torch's vectors; first, the host's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu import docstring_corpus
from bench.host import cpu_described
from bench.whole import PLAIN, _measured
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model

PLAIN_OPENVINO = PLAIN.replace(
    'SentenceTransformer(model_path, device="cpu")',
    'SentenceTransformer(model_path, device="cpu", backend="openvino", '
    'model_kwargs={"ov_config": {"INFERENCE_PRECISION_HINT": "f32"}})',
)
CHUNKQ = {
    "chunkq torch": [],
    "chunkq openvino f32": ["--backend", "openvino"],
    "chunkq openvino bf16": ["--backend", "openvino", "--precision", "bf16"],
    "chunkq openvino int8": ["--backend", "openvino", "--precision", "int8"],  # and --model: main()
}
BASES = ("plain torch", "chunkq torch")


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def plain(work: Path, corpus: Path, script: str) -> tuple[dict[str, Any], Any]:
    out = work / f"plain-{time.monotonic_ns()}.npy"
    found = _measured(
        [sys.executable, "-c", script, str(corpus), resolve_model(BUNDLED_MODEL), str(out), "auto"], _env()
    )
    vectors = np.load(out)
    out.unlink()
    return found, vectors


def chunkq(work: Path, corpus: Path, args: list[str]) -> tuple[dict[str, Any], Any]:
    store = work / f"store-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "run", str(corpus)]
    cmd += ["--store", str(store)]
    found = _measured(cmd + args, _env())
    (run,) = (store / "runs").iterdir()
    return found, np.load(run / "result" / "embeddings.npy")


def _agreement(got: Any, want: Any) -> dict[str, float]:
    a, b = got.astype(np.float64), want.astype(np.float64)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return {"max_abs_diff": float(np.abs(a - b).max()), "min_cosine": float(cosine.min())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default=None, help="comma-separated; default: every one")
    args = parser.parse_args()
    host = cpu_described()
    print(host["said"], flush=True)  # OpenVINO's speed against torch's follows the CPU (bench/host.py)
    work = Path(tempfile.mkdtemp(prefix="chunkq-ov-"))
    corpus = docstring_corpus(work / "corpus.jsonl", args.rows)
    chunkq(work, docstring_corpus(work / "warm.jsonl", 100), CHUNKQ["chunkq openvino f32"])  # the export
    int8 = work / "int8-model"
    if not args.variants or "int8" in args.variants:
        made = _measured(
            [sys.executable, "-m", "chunkq.cli", "quantize", BUNDLED_MODEL, str(corpus), "--out", str(int8)],
            _env(),
        )
        print(f"chunkq quantize (300 texts): {made['wall']:.1f} s", flush=True)
    given = {name: a + (["--model", str(int8)] if "int8" in name else []) for name, a in CHUNKQ.items()}
    every: dict[str, Any] = {
        "plain torch": lambda: plain(work, corpus, PLAIN),
        "plain openvino f32": lambda: plain(work, corpus, PLAIN_OPENVINO),
        **{name: (lambda a=a: chunkq(work, corpus, a)) for name, a in given.items()},
    }
    picked = set(args.variants.split(",")) | set(BASES) if args.variants else set(every)
    variants = {name: run for name, run in every.items() if name in picked}
    walls: dict[str, list[float]] = {name: [] for name in variants}
    loads: dict[str, list[float]] = {name: [] for name in variants}
    vectors: dict[str, Any] = {}
    for round_ in range(args.repeats):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            found, vectors[name] = variants[name]()
            walls[name].append(found["wall"])
            loads[name].append(round(found["load_at_start"], 2))
            print(
                f"round {round_ + 1} {name}: {found['wall']:.1f} s (load {found['load_at_start']:.2f})",
                flush=True,
            )
    median = {name: statistics.median(w) for name, w in walls.items()}
    table = {
        name: {
            "wall_median": round(median[name], 2),
            "walls": walls[name],
            "loads": loads[name],
            "speed_vs_chunkq_torch": round(median["chunkq torch"] / median[name], 2),
            "speed_vs_plain_torch": round(median["plain torch"] / median[name], 2),
            **_agreement(vectors[name], vectors["plain torch"]),
        }
        for name in variants
    }
    for name, row in table.items():
        print(
            f"{name:22s} {row['wall_median']:7.1f} s  x{row['speed_vs_chunkq_torch']:.2f} chunkq torch  "
            f"x{row['speed_vs_plain_torch']:.2f} plain torch  max diff {row['max_abs_diff']:.1e}  "
            f"min cos {row['min_cosine']:.6f}  loads {row['loads']}"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": args.rows, "host": host, "variants": table}, indent=2))


if __name__ == "__main__":
    main()
