"""chunkq against a plain ``SentenceTransformer.encode`` on a GPU host without network.

    python bench/gpu.py [--rows 20000] [--large-rows 8000] [--large PATH] [--chunk-size 1000]
                        [--configs one,auto,recycled,fixed] [--device cuda] [--out results.json]
                        [--baselines/--no-baselines]

Models: the bundled all-MiniLM-L6-v2 in fp32, and a larger local model in fp16 (``--large PATH``;
without one, a random-weight BERT of bge-large's shape, 335M parameters, built here with
transformers: fine for speed, meaningless for quality). The corpus: docstring paragraphs of
Python's standard library (no network needed; past its size each copy of a paragraph is made
distinct, so the vector cache saves nothing). For each model, in one run and on one GPU:
- plain: a fresh process loads the model and calls ``encode(texts, batch_size=32)`` once per
  100,000 rows, saving each slice: what users write for a corpus of any size (10^6 rows included);
- with ``--baselines`` (the default on a GPU): plain tuned (fp16, batch 256), sentence-transformers'
  own multi-process pool (4 processes on the one GPU, batch 32), and the ceiling: the model's
  forward alone over the corpus tokenised beforehand, sorted by length, batch 256 (fp32) or 1,024;
- chunkq ``run`` configurations: ``one`` (1 worker per GPU, never recycled), ``auto`` (the
  defaults: --workers-per-gpu auto, token-budget batches on a GPU, recycled after 600 s of work),
  ``recycled`` (the defaults with --recycle-after 20, so recycling shows), ``fixed`` (the defaults
  with --batch-tokens off: batches of 32, the GPU's defaults before issue 46), ``warm`` (the
  defaults with a standing fork server, ``chunkq serve-forks --preload``, started and warm before
  the command: what a host's second and later runs pay; its own start is not counted).
Printed: rows/s of each, its ratio to plain (steady state: the encode call against the span from
the first chunk's start to the last chunk's end; end to end: whole commands) and to the tuned plain
and the ceiling; the GPU's utilisation sampled through NVML every 0.2 s over that span, and the busy
share the chunks recorded; the seconds from the command's start to its first rows and from its last
chunk to the result. Then, in this process, a chunk's encode with the chunk tokenised once
(``jobs/compute/tokenized.py``) against tokenised twice (its lengths first, then ``model.encode`` per
batch), in batches of 32 and in the device's own, rounds of alternating order, medians of
``--repeats``. ``--out`` writes every figure as JSON, again after each
one is measured (a run cut at a time limit keeps what it measured).

One GPU throughout: the first this process may use (an inherited ``CUDA_VISIBLE_DEVICES`` is
honoured). chunkq is given it by NVML index (``--gpus``), the plain script and the in-process
encode by its UUID in ``CUDA_VISIBLE_DEVICES``, and utilisation is read from NVML by that UUID.
``--device cpu`` runs the same on the CPU with small defaults (to test the script itself).
Goals (issue 46): MiniLM at 10^6 rows (``--rows 1000000``) end to end >= 4x plain and >= 1.5x the
tuned plain, at 10^5 >= 3x; steady state >= 90 % of the ceiling with the defaults; GPU busy >= 85 %.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.supervisor.store.ledger import of_run
from chunkq.tools import first_row
from chunkq.tools.run_facts import gather

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tree_memory import TreeMemory
from tests.warm_forks import SOCKET_ENV, start_standing_server, stop_standing_server

CONFIGS = {
    "one": ["--workers-per-gpu", "1", "--recycle-after", "0"],
    "auto": [],  # the defaults: on a GPU, token-budget batches that tune themselves (issue 46.1)
    "recycled": ["--recycle-after", "20"],
    "fixed": ["--batch-tokens", "off"],  # batches of 32 texts: the defaults before issue 46
    "behind": [],  # the defaults, each chunk tokenised before its forward, not beside it (issue 52.2)
    "warm": [],  # the defaults, workers forked by a standing fork server started before the command
}
CONFIG_ENV = {"behind": {"CHUNKQ_TOKENISE_AHEAD": "0"}}  # what a configuration sets beside its options

PLAIN = """
import json, sys, time
import numpy as np, torch
from sentence_transformers import SentenceTransformer
from chunkq.jobs.compute.model_refs import resolve_model
corpus, model_ref, out, device, precision, batch, piece = sys.argv[1:8]
model = SentenceTransformer(resolve_model(model_ref), device=device)
if precision != "fp32":
    model = model.to({"fp16": torch.float16, "bf16": torch.bfloat16}[precision])
print("ready", flush=True)
encode_seconds, rows, started, part = 0.0, 0, time.time(), 0
with open(corpus, encoding="utf-8") as lines:
    while True:  # a slice of the corpus at a time, each one encode call, saved as it comes
        texts = [json.loads(line)["text"] for _, line in zip(range(int(piece)), lines)]
        if not texts:
            break
        t1 = time.perf_counter()
        matrix = model.encode(texts, batch_size=int(batch), convert_to_numpy=True)
        if device == "cuda":
            torch.cuda.synchronize()
        encode_seconds += time.perf_counter() - t1
        np.save(f"{out}-{part:04d}.npy", matrix.astype(np.float32))
        rows, part = rows + len(texts), part + 1
print(json.dumps({"encode_seconds": encode_seconds, "rows": rows, "start": started, "end": time.time()}))
"""

# sentence-transformers' own multi-process pool: N processes on the one GPU, each a model copy.
POOL = """
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
from chunkq.jobs.compute.model_refs import resolve_model
corpus, model_ref, device, precision, processes = sys.argv[1:6]
model = SentenceTransformer(resolve_model(model_ref), device="cpu")
texts = [json.loads(line)["text"] for line in open(corpus, encoding="utf-8")]
if __name__ == "__main__":
    pool = model.start_multi_process_pool([device] * int(processes))
    t1, started = time.perf_counter(), time.time()
    matrix = model.encode(texts, batch_size=32, pool=pool)
    seconds = time.perf_counter() - t1
    model.stop_multi_process_pool(pool)
    print(json.dumps({"encode_seconds": seconds, "rows": len(matrix), "start": started, "end": time.time()}))
"""
PLAIN_SLICE = 100_000  # rows per plain encode call: a user's loop over a corpus too large for one
TUNED = {"cuda": ("fp16", 256), "cpu": ("fp32", 32)}  # plain, tuned: the precision and batch it runs


def docstring_corpus(path: Path, rows: int) -> Path:
    """Paragraphs of the standard library's docstrings (mean ~180 characters): real text, offline."""
    found: list[str] = []
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            tree = ast.parse(source.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                found += [" ".join(p.split()) for p in (doc or "").split("\n\n") if len(p.split()) >= 4]
        if len(found) >= rows:
            break
    copies, unique = 1, list(found)
    while len(found) < rows:  # a small stdlib: repeat it, each copy distinct (the cache must not help)
        found += [f"{text} (copy {copies})" for text in unique[: rows - len(found)]]
        copies += 1
    with open(path, "w", encoding="utf-8") as fh:
        for i, text in enumerate(found[:rows]):
            fh.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def large_model(work: Path, tokenizer_of: str) -> str:
    """A random-weight BERT of bge-large's shape with the tokenizer of ``tokenizer_of`` (``--model``:
    a BERT vocabulary of 30,522; the bundled package need not be installed, as on a GPU host that
    carries the model's folder alone)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoTokenizer, BertConfig, BertModel

    from chunkq.jobs.compute.model_refs import resolve_model

    target = work / "bert-large-random"
    config = BertConfig(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        vocab_size=30522,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(target / "hf")
    AutoTokenizer.from_pretrained(resolve_model(tokenizer_of)).save_pretrained(target / "hf")
    word = models.Transformer(str(target / "hf"), max_seq_length=512)
    pooling = models.Pooling(word.get_word_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[word, pooling], device="cpu").save(str(target / "st"))
    return str(target / "st")


class Utilisation:
    """GPU utilisation samples (time, percent) from NVML every 0.2 s, in a thread."""

    def __init__(self, uuid: str | None) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if uuid is not None:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            self._thread = threading.Thread(target=self._run, args=(pynvml, handle), daemon=True)
            self._thread.start()

    def _run(self, pynvml: Any, handle: Any) -> None:
        while not self._stop.wait(0.2):
            self.samples.append((time.time(), int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)))

    def mean(self, start: float, end: float) -> float | None:
        inside = [p for t, p in self.samples if start <= t <= end]
        return statistics.mean(inside) if inside else None

    def close(self) -> None:
        self._stop.set()


def _script(script: str, args: list[str], gpu: Any) -> dict[str, Any]:
    """A fresh Python process running ``script``; its last line's figures and its wall time."""
    started = time.perf_counter()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid  # the GPU chunkq is given, whatever CUDA's order
    out = subprocess.run(
        [sys.executable, "-c", script, *args], check=True, capture_output=True, text=True, env=env
    )
    figures: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    figures["wall"] = time.perf_counter() - started
    return figures


def plain(
    work: Path, corpus: Path, model: str, device: str, precision: str, gpu: Any, batch: int = 32
) -> dict[str, Any]:
    """A user's script: load, then one ``encode`` call per PLAIN_SLICE rows, each slice saved."""
    out = str(work / f"plain-{precision}-{batch}")
    return _script(PLAIN, [str(corpus), model, out, device, precision, str(batch), str(PLAIN_SLICE)], gpu)


def st_pool(work: Path, corpus: Path, model: str, device: str, precision: str, gpu: Any) -> dict[str, Any]:
    """sentence-transformers' multi-process pool, as many processes on the GPU as chunkq's auto
    gives workers (4 at most), fp32 batch 32 as its users call it."""
    processes = "4" if device == "cuda" else "2"
    return {**_script(POOL, [str(corpus), model, device, precision, processes], gpu), "processes": processes}


def ceiling(corpus: Path, model: str, precision: str, device: str) -> dict[str, Any]:
    """The model's forward alone, in this process: the corpus tokenised first (not timed), sorted by
    length, in batches of 256 (fp32) or 1,024 (fp16/bf16) texts; what no queue can beat."""
    import torch

    from chunkq.jobs.compute import models

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    loaded = models.get_model(model, "cuda:0" if device == "cuda" else "cpu", precision)
    st = loaded.model
    size = 256 if precision == "fp32" else 1024
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = [[texts[i] for i in order[k : k + size]] for k in range(0, len(order), size)]
    features = [st.tokenize(batch) for batch in batches]
    target = st.device

    def moved(feature: dict[str, Any]) -> dict[str, Any]:  # tensors to the device; the rest as it is
        return {k: v.to(target, non_blocking=True) if torch.is_tensor(v) else v for k, v in feature.items()}

    with torch.inference_mode():
        st(moved(features[0]))  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        for feature in features:
            st(moved(feature))
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "rows": len(texts), "rows_per_s": len(texts) / seconds, "batch": size}


def chunkq(
    work: Path,
    corpus: Path,
    model: str,
    precision: str,
    extra: list[str],
    chunk_size: int,
    gpu: Any,
    env: dict[str, str] | None = None,
    forks: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """``chunkq run`` of ``corpus``, its figures; ``forks``: the standing fork server it uses (its
    socket and pid: its workers are that server's children, their memory counted with the run's)."""
    if forks is not None:
        env = {**(env or {}), SOCKET_ENV: forks[0]}
    store = work / f"store-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "chunkq.cli", "--log-level", "WARNING", "run", str(corpus)]
    cmd += ["--store", str(store), "--model", model, "--precision", precision]
    cmd += ["--chunk-size", str(chunk_size), *extra]
    cmd += ["--gpus", str(gpu.index) if gpu is not None else "none"]
    # Cold unless the configuration names a standing server: one inherited is not the defaults.
    cold = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(cold, HF_HUB_OFFLINE="1", **(env or {})),
    )
    # The host memory a GPU worker holds (no GPU lease has measured it); a standing server's too.
    memory = TreeMemory(proc.pid, *([forks[1]] if forks else []))
    _out, err = proc.communicate()
    wall = time.perf_counter() - started
    memory.stop()
    if proc.returncode != 0:
        # The error's own words, in this script's log: the exception below shows the command only.
        sys.stderr.write(err.decode(errors="replace")[-4000:])
        raise subprocess.CalledProcessError(proc.returncode, cmd, stderr=err)
    (run_dir,) = (store / "runs").iterdir()
    # A pool that cannot use the standing server says so and starts its own: then not warm at all.
    refused = [line for line in err.decode(errors="replace").splitlines() if STANDING_REFUSED in line]
    metas = [json.loads(p.read_text()) for p in (run_dir / "outputs").glob("*.json")]
    throughput = of_run(store, run_dir.name)
    first, last = throughput.first_start, throughput.last_end
    assert first is not None and last is not None
    young = [m["seconds"] for m in metas if m.get("attempt", 1) == 1]
    layout = RunLayout(store, run_dir.name)
    run = Run.of(layout)
    facts = gather(run)
    before = first_row.breakdown(run, facts.first, facts.throughput.last_end)
    return {
        "wall": wall,
        "span": (last - first).total_seconds(),
        "start": first.timestamp(),
        "end": last.timestamp(),
        "processes": len({m["pid"] for m in metas}),
        "chunk_seconds_median": statistics.median(young) if young else None,
        "busy": throughput.busy.figure(),  # what the chunks recorded (jobs.compute.device_busy)
        "first_rows_seconds": before["first_row_seconds"],  # from the command's start
        "last_chunk_to_result_seconds": before["last_chunk_to_result_seconds"],
        "steps_before_first_row": before["marks"],
        "batch_tokens": sorted({m.get("batch_tokens") or 0 for m in metas}),  # 0: batches by count
        **({"standing_refused": refused[-1][-300:]} if refused else {}),
        "peak_pss_bytes": memory.peak,  # the whole command's processes, summed
        "largest_process_pss_bytes": memory.largest,
    }


STANDING_REFUSED = "cannot use the standing fork server"


@contextlib.contextmanager
def standing_forks(model: str) -> Iterator[tuple[str, int]]:
    """``chunkq serve-forks`` with ``model`` preloaded (the tests' own starter: it returns once the
    server serves), its socket and pid; stopped after."""
    folder = Path(tempfile.mkdtemp(prefix="cq-forks-"))  # a socket's path stays under 108 bytes
    proc = start_standing_server(folder / "forks.sock", dict(os.environ, HF_HUB_OFFLINE="1"), preload=model)
    try:
        yield str(folder / "forks.sock"), proc.pid
    finally:
        stop_standing_server(proc, folder / "forks.sock")


def tokenisation(
    corpus: Path, model: str, precision: str, device: str, args: argparse.Namespace
) -> dict[str, Any]:
    """Seconds to encode the corpus chunk by chunk, tokenised once and tokenised twice, in this
    process: in batches of 32, and in the device's own (a budget of AUTO_START_TOKENS on a GPU).
    ``--repeats`` rounds whose order alternates (once first, then twice first): the H100 runs of
    2026-11-25/26 measured once first in every round, so an order effect could not be told from a
    real one. Medians, and every sample."""
    import torch

    from chunkq.jobs.compute import models, token_batches, tokenized

    texts = [json.loads(line)["text"] for line in corpus.read_text(encoding="utf-8").splitlines()]
    chunks = [texts[i : i + args.chunk_size] for i in range(0, len(texts), args.chunk_size)]
    loaded = models.get_model(model, "cuda:0" if device == "cuda" else "cpu", precision)
    real = tokenized.features
    batchings = {"batch 32": (32, False)}
    if device == "cuda":
        budget = token_batches.AUTO_START_TOKENS
        batchings[f"budget {budget} tokens"] = (budget, True)

    def timed(features: Any, limit: int, by_tokens: bool) -> float:
        tokenized.features = features  # type: ignore[assignment]
        started = time.perf_counter()
        for chunk in chunks:
            token_batches.encode(loaded.model, chunk, limit, {}, by_tokens=by_tokens)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - started

    modes = {"once": real, "twice": lambda model, texts, prompt: None}
    figures: dict[str, Any] = {"rows": len(texts), "chunk_size": args.chunk_size}
    try:
        for label, (limit, by_tokens) in batchings.items():
            timed(real, limit, by_tokens)  # warm-up
            samples: dict[str, list[float]] = {"once": [], "twice": []}
            for round_ in range(args.repeats):
                for mode in ("once", "twice") if round_ % 2 == 0 else ("twice", "once"):
                    samples[mode].append(timed(modes[mode], limit, by_tokens))
            figures[label] = {
                "once_seconds": statistics.median(samples["once"]),
                "twice_seconds": statistics.median(samples["twice"]),
                "samples": samples,
            }
    finally:
        tokenized.features = real  # type: ignore[assignment]
    return figures


def bench_model(
    work: Path,
    label: str,
    model: str,
    precision: str,
    rows: int,
    args: argparse.Namespace,
    gpu: Utilisation,
    results: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Fills ``results`` figure by figure, saving after each: a run cut at a time limit keeps what it
    measured (on a lent GPU the limit is real: the first run there lost every figure)."""
    corpus = docstring_corpus(work / f"corpus-{rows}.jsonl", rows)
    base = plain(work, corpus, model, args.device, precision, args.gpu)
    util = gpu.mean(base["start"], base["end"])
    results["plain"] = {**base, "rows_per_s": rows / base["encode_seconds"], "gpu_util": util}
    save()
    print(f"\n{label} ({precision}), {rows} rows on {args.device}")
    print(
        f"  plain encode, batch 32, {PLAIN_SLICE} rows a call: {rows / base['encode_seconds']:.0f} rows/s"
        f" ({base['wall']:.1f} s end to end){f', GPU {util:.0f} %' if util is not None else ''}"
    )
    tuned_precision, tuned_batch = TUNED[args.device]
    if args.baselines:
        tuned = plain(work, corpus, model, args.device, tuned_precision, args.gpu, tuned_batch)
        results["plain_tuned"] = {**tuned, "rows_per_s": rows / tuned["encode_seconds"]}
        save()
        tuned_rate = rows / tuned["encode_seconds"]
        print(f"  plain, tuned ({tuned_precision}, batch {tuned_batch}): {tuned_rate:.0f} rows/s")
        top = ceiling(corpus, model, precision, args.device)
        results["ceiling"] = top
        save()
        print(f"  the forward alone, pre-tokenised, batch {top['batch']}: {top['rows_per_s']:.0f} rows/s")
    for name in args.configs:
        with standing_forks(model) if name == "warm" else contextlib.nullcontext() as forks:
            env = CONFIG_ENV.get(name)
            run = chunkq(work, corpus, model, precision, CONFIGS[name], args.chunk_size, args.gpu, env, forks)
        util = gpu.mean(run["start"], run["end"])
        steady, e2e = base["encode_seconds"] / run["span"], base["wall"] / run["wall"]
        results[name] = {
            **run,
            "rows_per_s": rows / run["span"],
            "steady_ratio": steady,
            "e2e_ratio": e2e,
            "gpu_util": util,
        }
        if "plain_tuned" in results:
            results[name]["e2e_ratio_to_tuned"] = results["plain_tuned"]["wall"] / run["wall"]
            results[name]["share_of_ceiling"] = rows / run["span"] / results["ceiling"]["rows_per_s"]
        save()
        gpu_text = f", GPU {util:.0f} %" if util is not None else ""
        busy = run["busy"]
        busy_text = f", busy {100 * busy['share']:.0f} % ({busy['source']})" if busy else ""
        print(
            f"  chunkq {name:9s}: {rows / run['span']:.0f} rows/s, {steady:.2f}x plain "
            f"(end to end {e2e:.2f}x, {run['wall']:.1f} s), {run['processes']} worker process(es)"
            f"{gpu_text}{busy_text}; first rows at {run['first_rows_seconds']} s, last chunk to "
            f"result {run['last_chunk_to_result_seconds']} s"
        )
    if args.baselines:
        # Last: its start costs a minute on a GPU host (four processes each import and load), and a
        # lease cut short must keep chunkq's own figures first (the 2026-11-27 check lost them so).
        pooled = st_pool(work, corpus, model, args.device, precision, args.gpu)
        results["st_pool"] = {**pooled, "rows_per_s": rows / pooled["encode_seconds"]}
        save()
        print(
            f"  sentence-transformers' pool, {pooled['processes']} processes: "
            f"{rows / pooled['encode_seconds']:.0f} rows/s"
        )
    if args.repeats:
        tok = tokenisation(corpus, model, precision, args.device, args)
        results["tokenisation"] = tok
        save()
        for label, figure in tok.items():
            if not isinstance(figure, dict):
                continue
            once, twice = rows / figure["once_seconds"], rows / figure["twice_seconds"]
            print(
                f"  chunks of {args.chunk_size}, {label}, in-process: tokenised once {once:.0f} rows/s, "
                f"twice {twice:.0f} rows/s ({figure['twice_seconds'] / figure['once_seconds']:.2f}x the time)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--rows", type=int, default=None, help="MiniLM corpus (default 20000; 300 on cpu; 0: skip)"
    )
    parser.add_argument(
        "--large-rows", type=int, default=None, help="large model corpus (default 8000; 0: skip)"
    )
    parser.add_argument(
        "--large", default=None, help="a local larger model (default: random bge-large shape)"
    )
    parser.add_argument("--model", default="bundled:all-MiniLM-L6-v2")
    parser.add_argument("--chunk-size", type=int, default=None, help="default 1000; 100 on cpu")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"out of {', '.join(CONFIGS)}")
    parser.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    parser.add_argument("--repeats", type=int, default=3, help="tokenised once/twice rounds (0: skip)")
    parser.add_argument(
        "--baselines",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also plain tuned (fp16, batch 256), sentence-transformers' multi-process pool and the "
        "forward alone (default: on a GPU)",
    )
    args = parser.parse_args()
    cpu = args.device == "cpu"
    args.rows = args.rows if args.rows is not None else (300 if cpu else 20_000)
    args.large_rows = args.large_rows if args.large_rows is not None else (0 if cpu else 8000)
    args.chunk_size = args.chunk_size or (100 if cpu else 1000)
    args.baselines = (not cpu) if args.baselines is None else args.baselines
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configuration(s) {sorted(unknown)}")
    args.gpu = None
    if not cpu:
        from chunkq.queue_worker.devices.discovery import discover

        found = discover()
        if not found:
            parser.error("no GPU this process may use: run on a GPU host, or pass --device cpu")
        args.gpu = found[0]
        # This process's own encode (tokenisation) must land on the same GPU: pin it before CUDA starts.
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpu.uuid
        print(f"on {args.gpu.label} ({args.gpu.name}, {args.gpu.uuid})")
    gpu = Utilisation(args.gpu.uuid if args.gpu is not None else None)
    figures: dict[str, Any] = {"device": args.device, "cpu_cores": os.cpu_count(), "minilm": {}}

    def save() -> None:
        if args.out:
            args.out.write_text(json.dumps(figures, indent=2, default=str) + "\n")

    try:
        with tempfile.TemporaryDirectory(prefix="chunkq-gpu-bench-") as tmp:
            work = Path(tmp)
            minilm = figures["minilm"]
            if args.rows:
                bench_model(work, "all-MiniLM-L6-v2", args.model, "fp32", args.rows, args, gpu, minilm, save)
            if args.large_rows:
                large = args.large or large_model(work, args.model)
                figures["large"] = {}
                bench_model(
                    work, "bge-large shape", large, "fp16", args.large_rows, args, gpu, figures["large"], save
                )
    finally:
        gpu.close()
        save()


if __name__ == "__main__":
    main()
