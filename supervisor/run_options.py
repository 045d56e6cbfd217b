"""Every option of a run, written once: what the corpus, the model and its encoding are (received
by submit, part of the run's identity) and how the run is watched (received by the supervisor).

Each entry is ``(name, Meta, default)``, the form of the pool's settings (``jobs/contract/settings.py``):
the name is the Python API's keyword and the command line's parameter; the flag, the environment
variable, the help and how a value given as text is checked come from its ``Meta``. From this table
come the options of ``chunkq run``, ``submit``, ``supervise`` and ``assemble`` (``chunkq/cli/``), the
names ``chunkq.run(...)`` takes (``supervisor/request.py``) and a test against docs/settings.md's tables.
``--store`` and ``--queue`` are every command's, and ``chunkq/cli/common.py``'s.
"""

from __future__ import annotations

from typing import Any

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.defaults import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_PRECISION,
    DEFAULT_PRIORITY,
    DEFAULT_SHARD_BYTES,
    DEFAULT_WINDOW,
    HEARTBEAT_SECONDS,
    STALE_AFTER_LOWEST,
    STALE_AFTER_SECONDS,
    WARN_IDLE_SECONDS,
    WINDOW_PER_WORKER,
)
from chunkq.jobs.contract.settings import Meta
from chunkq.jobs.contract.specs import (
    BACKENDS,
    MODEL_KWARGS,
    OUTPUT_DTYPES,
    PRECISIONS,
    ROLES,
    EncodeOptions,
    batch_tokens_value,
    model_kwargs_value,
)
from chunkq.jobs.kinds import KINDS
from chunkq.jobs.queue.run_queues import MAX_PRIORITY
from chunkq.supervisor.corpus.records import FORMATS, CorpusOptions
from chunkq.supervisor.submit.windows import LONG_TEXTS, POOLS
from chunkq.supervisor.watch.retry import RetryPolicy
from chunkq.supervisor.watch.supervise import WatchSettings

SUBMIT, WATCH = "submit", "watch"
Option = tuple[str, Meta, Any]


def _submit(name: str, default: Any, help: str, **meta: Any) -> Option:
    return name, Meta(help, env=meta.pop("env", None), receiver=SUBMIT, **meta), default


def _watch(name: str, default: Any, help: str, **meta: Any) -> Option:
    return name, Meta(help, env=meta.pop("env", None), receiver=WATCH, **meta), default


RUN_OPTIONS: tuple[Option, ...] = (
    _submit(
        "model",
        None,
        f"Model: a local folder, a name in the Hugging Face cache, or the bundled model ({BUNDLED_MODEL}, "
        "also called all-MiniLM-L6-v2 and sentence-transformers/all-MiniLM-L6-v2; the default). Nothing "
        "is downloaded unless HF_HUB_OFFLINE=0.",
        env="",
    ),
    _submit(
        "kind",
        None,
        "What the model is: dense (a vector per text, SentenceTransformer.encode), cross (a score per "
        "pair, CrossEncoder.predict; with --pair-field), sparse (SparseEncoder: CSR rows), multivector "
        "(MultiVectorEncoder: token vectors) or image (a multimodal model's encode of images by path or "
        "URL). Default: what the model's files say; a kind they contradict is refused.",
        kind="choice",
        choices=tuple(KINDS),
    ),
    _submit(
        "role",
        None,
        "query or document: encode as the model's encode_query / encode_document do (its own prompt and "
        "routing for that role). Default: a plain encode.",
        kind="choice",
        choices=ROLES[1:],
    ),
    _submit(
        "max_active_dims",
        None,
        "--kind sparse: keep each vector's N largest values. (SparseEncoder's max_active_dims.)",
        kind="int",
        low=1,
    ),
    _submit(
        "allow_missing",
        False,
        "--kind image: a row whose image is missing or cannot be decoded is left out of the result and "
        "listed in it (with its reason) instead of failing its chunk.",
        kind="switch",
    ),
    _submit(
        "run_id",
        None,
        "Name of the run in the store. Default: the corpus file's name and a fingerprint of the corpus "
        "and options (notes-3fa2c1d0e9b4), so the same command resumes the same run.",
    ),
    _submit(
        "chunk_size",
        DEFAULT_CHUNK_SIZE,
        "Rows per chunk: one job and output, retried whole.",
        kind="int",
        low=1,
    ),
    _submit(
        "fmt",
        None,
        "Corpus format. Default: from each file's suffix (.jsonl/.ndjson, .csv, .parquet, .txt).",
        kind="choice",
        choices=FORMATS,
        flag="--format",
    ),
    _submit(
        "text_field",
        CorpusOptions.text_field,
        "Field (JSON Lines) or column (CSV, Parquet) holding the text.",
    ),
    _submit(
        "pair_field",
        None,
        "--kind cross: the field or column holding each pair's second text (the passage); --text-field "
        "holds the first (the query).",
    ),
    _submit(
        "id_field",
        CorpusOptions.id_field,
        "Field or column holding each row's id; without one, ids are line or row numbers.",
    ),
    _submit(
        "batch_size",
        None,
        f"Texts per encode batch (halved for the chunk after an out-of-memory error). Default: "
        f"{EncodeOptions.batch_size}; given without --batch-tokens, a GPU runs batches of this size too.",
        kind="int",
        low=1,
    ),
    _submit(
        "batch_tokens",
        None,
        "Batches by a budget of padded tokens over length-sorted texts instead of --batch-size texts: a "
        "number, 'auto' (grows while it pays, learns from OOM) or 'off'. Default: auto on a GPU, "
        "--batch-size batches on the CPU (measured faster there).",
        parse=batch_tokens_value,
    ),
    _submit(
        "normalize",
        EncodeOptions.normalize_embeddings,
        "Scale every embedding to unit length.",
        kind="switch",
    ),
    _submit(
        "max_seq_length",
        None,
        "Tokens per text before truncation. Default: the model's own.",
        kind="int",
        low=1,
    ),
    _submit(
        "precision",
        DEFAULT_PRECISION,
        "fp32, or fp16/bf16 on GPUs. bf16 runs on CPU workers too with --backend openvino (faster, "
        "rounded: docs/models.md), and int8 there with a model `chunkq quantize` made.",
        kind="choice",
        choices=PRECISIONS,
    ),
    _submit(
        "backend",
        EncodeOptions.backend,
        "torch or openvino (CPU). OpenVINO runs dense, cross and sparse models on CPU workers, needs "
        "chunkq[openvino], and runs in fp32, equal to torch within 1e-5, unless --precision bf16 or "
        "int8 (dense models; docs/models.md).",
        kind="choice",
        choices=BACKENDS,
    ),
    _submit("prompt", None, 'Text put before every text, e.g. "passage: " for E5 models.'),
    _submit(
        "prompt_name",
        None,
        "One of the model's named prompts (chunkq model M lists them). Default: the model's own default "
        "prompt, if it has one.",
    ),
    _submit(
        "truncate_dim",
        None,
        "Keep the first N dimensions (Matryoshka models); at most the model's dimension.",
        kind="int",
        low=1,
    ),
    _submit(
        "output_dtype",
        EncodeOptions.output_dtype,
        "How the result is stored: float16 halves it; int8/uint8 use one set of per-dimension ranges for "
        "the whole run, computed from a sample before the chunks run; binary/ubinary pack 8 dimensions a "
        "byte.",
        kind="choice",
        choices=tuple(OUTPUT_DTYPES),
    ),
    _submit(
        "trust_remote_code",
        None,
        "Run a model that brings its own Python code (nomic-embed, jina, gte-Qwen...). Pools must allow "
        "it too (chunkq run's own pool does).",
        kind="flag",
    ),
    _submit(
        "accept_unidentified_code",
        False,
        "Run remote code chunkq cannot identify. With --trust-remote-code, chunkq loads a "
        "model once on the CPU at submit to list the code it runs; one that connects somewhere or runs a "
        "program while it loads, or will not load there, is refused without this flag, which compares "
        "its files alone and uses no vector cache.",
        kind="flag",
    ),
    _submit("revision", None, "The hub revision: a branch, tag or commit."),
    _submit(
        "model_kwargs",
        None,
        "JSON object passed to the model's from_pretrained; only "
        + ", ".join(sorted(MODEL_KWARGS))
        + ' (e.g. \'{"attn_implementation": "sdpa"}\').',
        parse=model_kwargs_value,
    ),
    _submit(
        "cache",
        None,
        "The store's vector cache: each distinct text is encoded once, and texts an earlier run encoded "
        "with the same model files and options are read from the cache, not encoded. Default: on when "
        "the result is float32 or float16 (--cache for int8/uint8/binary, derived from cached floats).",
        kind="switch",
        env="",
    ),
    _submit(
        "long_texts",
        LONG_TEXTS[0],
        "A text longer than the model reads: truncate (what a plain encode does), window: cut into "
        "overlapping windows on the model's tokenizer, each a row of the result (id, window, char_start, "
        "char_end, tokens), or late: the same rows, each pooled from one pass over the segment of the "
        "model's context around it (late chunking; mean-pooling models only).",
        kind="choice",
        choices=LONG_TEXTS,
    ),
    _submit(
        "window_tokens",
        None,
        "Tokens a window holds (--long-texts window, late). Default: the model's maximum length less its "
        "special tokens and prompt, the most it reads; with late, a quarter of that.",
        kind="int",
        low=1,
    ),
    _submit(
        "window_stride",
        None,
        "Tokens a window shares with the next (--long-texts window, late), as Hugging Face tokenizers' "
        "stride. Default: a quarter of a window.",
        kind="int",
        low=0,
    ),
    _submit(
        "pool",
        POOLS[0],
        "With --long-texts window or late, a vector per text as well (result/texts.npy): the mean of its "
        "windows', or weighted by each window's tokens; unit length where the model's vectors are.",
        kind="choice",
        choices=POOLS,
    ),
    _submit(
        "job_timeout",
        None,
        "Seconds a chunk may take before its worker is stopped. Default: grows with --chunk-size.",
        kind="int",
        low=1,
    ),
    _submit(
        "priority",
        None,
        "Turns at workers shared with other runs. A run of priority N takes N turns for each turn of a "
        f"priority-1 run (1-{MAX_PRIORITY}); every run gets turns, none waits behind another's backlog. "
        f"Default: {DEFAULT_PRIORITY}; a resumed run keeps its own unless given.",
        kind="int",
        low=1,
        high=MAX_PRIORITY,
    ),
    _watch(
        "queue_window",
        None,
        "Jobs of the run in Redis at once; the other chunks wait in the store and are queued in order as "
        f"chunks finish. Default: {DEFAULT_WINDOW}, or {WINDOW_PER_WORKER} per worker listening if more.",
        kind="int",
        low=1,
    ),
    _watch(
        "shard_size",
        f"{DEFAULT_SHARD_BYTES // 2**30}GiB",
        "A result with more embedding bytes than this is published as ordered shards of this size (e.g. "
        "512MiB, 2GB), each written straight to the store; up to it, one embeddings.npy.",
    ),
    _watch(
        "keep_outputs",
        False,
        "Keep the chunk arrays after publishing. By default they are deleted once the result, which "
        "holds their rows, is published; kept, the disk holds the vectors twice and `chunkq assemble` "
        "can publish the result again from them.",
        kind="flag",
    ),
    _watch(
        "poll",
        WatchSettings.poll_seconds,
        "Seconds between looks at the run (a finished chunk wakes the supervisor sooner).",
        kind="float",
        low=0.01,
    ),
    _watch(
        "max_attempts",
        RetryPolicy.max_attempts,
        "Attempts per chunk before it is quarantined.",
        kind="int",
        low=1,
        env="",
    ),
    _watch(
        "allow_partial",
        False,
        "With quarantined chunks, publish the rest and list the missing rows (exit 9).",
        kind="flag",
    ),
    _watch(
        "metrics_port",
        None,
        "Serve the supervisor's Prometheus metrics on 127.0.0.1:PORT (chunkq run: the pool's on PORT+1).",
        kind="int",
        low=0,
        high=65535,
        env="",
    ),
    _watch(
        "wait",
        False,
        "If another process owns the run (or the store's embedded Redis), wait for it instead of refusing.",
        kind="flag",
    ),
    _watch(
        "warn_idle",
        WARN_IDLE_SECONDS,
        "Say so when chunks wait and no worker has taken one for this many seconds.",
        kind="float",
        low=0.1,
    ),
    _watch(
        "stale_after",
        STALE_AFTER_SECONDS,
        f"Seconds a running chunk's worker may go without a heartbeat (it beats every "
        f"{HEARTBEAT_SECONDS:g} s) before the chunk is taken for stuck: failed as abandoned and retried.",
        kind="float",
        low=STALE_AFTER_LOWEST,
    ),
)


def run_option_names(receiver: str) -> frozenset[str]:
    return frozenset(name for name, meta, _ in RUN_OPTIONS if meta.receiver == receiver)


def run_option(name: str) -> Option:
    return next(option for option in RUN_OPTIONS if option[0] == name)
