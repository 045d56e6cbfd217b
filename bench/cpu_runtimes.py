"""The CPU runtimes in one process (issue 67's first table, remeasured): sentence-transformers' own
``encode`` of the same texts on PyTorch and on OpenVINO at each precision, per thread count.

    python bench/cpu_runtimes.py [--rows 2000] [--rounds 3] [--out runtimes.json]

Needs the ``openvino`` extra (``make test-openvino``'s environment). The bundled all-MiniLM-L6-v2,
``bench/gpu.py``'s docstrings (every text distinct), batch 32, sentence-transformers' own batches
(sorted by characters). One process per thread count (1 and 2): every model loaded and warmed, then
``rounds`` rounds, the order turned each round; the best time of each. Variants: ``torch``;
``openvino f32`` (chunkq's default hint); ``openvino default`` (OpenVINO's own precision: bf16 where
the CPU has it); ``openvino int8`` (the model ``chunkq quantize`` made from the corpus's first 300
texts, its other operations in f32 as chunkq runs it); ``onnxruntime`` and ``fastembed`` where they
are importable (``bench/onnx_rows.py`` says how). Prints and writes the host's CPU (OpenVINO's speed
against torch's depends on its generation: ``bench/host.py``) and each variant's ratio to torch, max
abs difference and min cosine against torch's vectors.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Run as a script, this folder leads the path, and its openvino.py would stand for OpenVINO's package.
sys.path[:] = [p for p in sys.path if Path(p).resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import onnx_rows
from bench.gpu import docstring_corpus
from bench.host import cpu_described
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.compute.ov_quantize import QUANTIZED_FILE

BATCH = 32


def _configs(threads: int) -> dict[str, tuple[str, dict[str, Any] | None]]:
    exact = {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False}
    own = {"INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False}
    return {
        "torch": ("", None),
        "openvino f32": ("", {"ov_config": exact}),
        "openvino default": ("", {"ov_config": own}),
        "openvino int8": ("int8", {"ov_config": exact, "file_name": QUANTIZED_FILE}),
    }


def child(threads: int, corpus: Path, int8: Path, rounds: int, work: Path) -> dict[str, Any]:
    import numpy as np
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(threads)
    texts = [json.loads(line)["text"] for line in corpus.open(encoding="utf-8")]
    models: dict[str, Callable[[list[str]], Any]] = {}
    loaded: dict[str, Any] = {}
    for name, (which, kwargs) in _configs(threads).items():
        path = str(int8) if which == "int8" else resolve_model(BUNDLED_MODEL)
        backend = {"backend": "openvino", "model_kwargs": kwargs} if kwargs is not None else {}
        loaded[name] = SentenceTransformer(path, device="cpu", **backend)
        models[name] = functools.partial(loaded[name].encode, batch_size=BATCH)
    torch_model = loaded["torch"]
    has = onnx_rows.available()
    if has["onnxruntime"] or has["fastembed"]:
        graph = onnx_rows.export(torch_model, work / f"onnx-{threads}", resolve_model(BUNDLED_MODEL))
        if has["onnxruntime"]:
            models["onnxruntime"] = onnx_rows.onnxruntime_encoder(torch_model, graph, threads, BATCH)
        if has["fastembed"]:
            models["fastembed"] = onnx_rows.fastembed_encoder(graph, threads, BATCH)
    for encode in models.values():
        encode(texts[:64])  # warmed
    best = dict.fromkeys(models, float("inf"))
    vectors: dict[str, Any] = {}
    for round_ in range(rounds):
        for name in list(models) if round_ % 2 == 0 else list(reversed(models)):
            started = time.perf_counter()
            vectors[name] = models[name](texts)
            best[name] = min(best[name], time.perf_counter() - started)
    want = vectors["torch"].astype(np.float64)
    table = {}
    for name, got in vectors.items():
        got = got.astype(np.float64)
        cosine = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        table[name] = {
            "seconds": round(best[name], 3),
            "speed_vs_torch": round(best["torch"] / best[name], 2),
            "max_abs_diff": float(np.abs(got - want).max()),
            "min_cosine": round(float(cosine.min()), 6),
        }
    return table


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--int8", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.corpus, args.int8, args.rounds, args.corpus.parent)))
        return
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    work = Path(tempfile.mkdtemp(prefix="chunkq-runtimes-"))
    corpus = docstring_corpus(work / "corpus.jsonl", args.rows)
    int8 = work / "int8-model"
    quantize = [
        sys.executable,
        "-m",
        "chunkq.cli",
        "quantize",
        BUNDLED_MODEL,
        str(corpus),
        "--out",
        str(int8),
    ]
    subprocess.run(quantize, env=env, check=True, capture_output=True)
    host = cpu_described()
    print(host["said"], flush=True)
    found: dict[str, Any] = {"rows": args.rows, "host": host, "threads": {}}
    for threads in (1, 2):
        load = os.getloadavg()[0]
        command = [sys.executable, __file__, "--child", str(threads), "--rounds", str(args.rounds)]
        done = subprocess.run(
            [*command, "--corpus", str(corpus), "--int8", str(int8)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        table = json.loads(done.stdout.strip().splitlines()[-1])
        found["threads"][threads] = {"load_at_start": round(load, 2), "variants": table}
        for name, row in table.items():
            print(
                f"{threads} thread(s)  {name:17s} {row['seconds']:7.2f} s  x{row['speed_vs_torch']:.2f}  "
                f"max diff {row['max_abs_diff']:.1e}  min cos {row['min_cosine']:.6f}  (load {load:.2f})",
                flush=True,
            )
    if args.out is not None:
        args.out.write_text(json.dumps(found, indent=2))


if __name__ == "__main__":
    main()
