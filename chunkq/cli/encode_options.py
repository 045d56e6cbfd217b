"""The options of a run's corpus, model and encoding (``submit``, ``run``) and of its watch
(``supervise``, ``run``)."""

from __future__ import annotations

import json
from typing import Any

import click

from chunkq.cli.common import (
    queue_option,
    store_option,
)
from chunkq.cli.pool_options import F
from chunkq.jobs.errors import ConfigError
from chunkq.jobs.models import BUNDLED_MODEL
from chunkq.jobs.specs import (
    BATCH_TOKENS_AUTO,
    DEFAULT_PRECISION,
    MODEL_KWARGS,
    OUTPUT_DTYPES,
    PRECISIONS,
    EncodeOptions,
    check_model_kwargs,
)
from chunkq.supervisor.corpus import FORMATS, CorpusOptions
from chunkq.supervisor.enqueue import DEFAULT_WINDOW, WINDOW_PER_WORKER
from chunkq.supervisor.result import DEFAULT_SHARD_BYTES
from chunkq.supervisor.retry import RetryPolicy
from chunkq.supervisor.submit import DEFAULT_CHUNK_SIZE
from chunkq.supervisor.supervise import WARN_IDLE_SECONDS, WatchSettings

MODEL_HELP = (
    f"Model: a local folder, a name in the Hugging Face cache, or the bundled model ({BUNDLED_MODEL}, "
    "also called all-MiniLM-L6-v2 and sentence-transformers/all-MiniLM-L6-v2; the default). Nothing "
    "is downloaded unless HF_HUB_OFFLINE=0."
)


def submit_options(func: F) -> F:
    options = [
        # Text, not click.Path: a corpus may be an fsspec URL (s3://bucket/corpus/*.parquet).
        click.argument("corpus", nargs=-1, required=True),
        click.option("--model", envvar="CHUNKQ_MODEL", show_envvar=True, help=MODEL_HELP),
        click.option(
            "--run-id",
            help="Name of the run in the store. Default: the corpus file's name and a fingerprint of the "
            "corpus and options (notes-3fa2c1d0e9b4), so the same command resumes the same run.",
        ),
        click.option(
            "--chunk-size",
            type=click.IntRange(1),
            default=DEFAULT_CHUNK_SIZE,
            show_default=True,
            help="Rows per chunk: one job, one output file, the unit that is retried.",
        ),
        click.option(
            "--format",
            "fmt",
            type=click.Choice(FORMATS),
            help="Corpus format. Default: from each file's suffix (.jsonl/.ndjson, .csv, .parquet, .txt).",
        ),
        click.option(
            "--text-field",
            default=CorpusOptions.text_field,
            show_default=True,
            help="Field (JSON Lines) or column (CSV, Parquet) holding the text.",
        ),
        click.option(
            "--id-field",
            default=CorpusOptions.id_field,
            show_default=True,
            help="Field or column holding each row's id; without one, ids are line or row numbers.",
        ),
        click.option(
            "--batch-size",
            type=click.IntRange(1),
            default=EncodeOptions.batch_size,
            show_default=True,
            help="Texts per encode batch (halved for the chunk after an out-of-memory error).",
        ),
        click.option(
            "--batch-tokens",
            default=None,
            callback=_batch_tokens_value,
            help="Batches by a budget of padded tokens over length-sorted texts instead of "
            "--batch-size texts: a number, or 'auto' (grows while it pays, learns from OOM).",
        ),
        click.option(
            "--normalize/--no-normalize",
            default=EncodeOptions.normalize_embeddings,
            show_default=True,
            help="Scale every embedding to unit length.",
        ),
        click.option(
            "--max-seq-length",
            type=click.IntRange(1),
            default=None,
            help="Tokens per text before truncation. Default: the model's own.",
        ),
        click.option(
            "--precision",
            type=click.Choice(PRECISIONS),
            default=DEFAULT_PRECISION,
            show_default=True,
            help="Weights and activations on the GPU; fp16 and bf16 need a GPU.",
        ),
        click.option(
            "--prompt", default=None, help='Text put before every text, e.g. "passage: " for E5 models.'
        ),
        click.option(
            "--prompt-name",
            default=None,
            help="One of the model's named prompts (chunkq model M lists them). Default: the model's own "
            "default prompt, if it has one.",
        ),
        click.option(
            "--truncate-dim",
            type=click.IntRange(1),
            default=None,
            help="Keep the first N dimensions (Matryoshka models); at most the model's dimension.",
        ),
        click.option(
            "--output-dtype",
            type=click.Choice(tuple(OUTPUT_DTYPES)),
            default="float32",
            show_default=True,
            help="How the result is stored: float16 halves it; int8/uint8 use one set of per-dimension "
            "ranges for the whole run, computed from a sample before the chunks run; binary/ubinary pack "
            "8 dimensions a byte.",
        ),
        click.option(
            "--trust-remote-code",
            is_flag=True,
            default=None,
            help="Run a model that brings its own Python code (nomic-embed, jina, gte-Qwen...). Pools "
            "must allow it too (chunkq run's own pool does).",
        ),
        click.option("--revision", default=None, help="The model's hub revision: a branch, tag or commit."),
        click.option(
            "--model-kwargs",
            default=None,
            callback=_model_kwargs_value,
            help="JSON object passed to the model's from_pretrained; only "
            + ", ".join(sorted(MODEL_KWARGS))
            + ' (e.g. \'{"attn_implementation": "sdpa"}\').',
        ),
        click.option(
            "--job-timeout",
            type=click.IntRange(1),
            default=None,
            help="Seconds a chunk may take before its worker is stopped. Default: grows with --chunk-size.",
        ),
        queue_option,
        store_option,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _model_kwargs_value(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    if value is None:
        return None
    try:
        return check_model_kwargs(json.loads(value))
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}") from exc
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


def _batch_tokens_value(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    if value is None or value == BATCH_TOKENS_AUTO:
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise click.BadParameter(f"{value!r}: give a number of tokens (1 or more) or 'auto'")


QUEUE_WINDOW_OPTION = click.option(
    "--queue-window",
    type=click.IntRange(1),
    default=None,
    help=f"Jobs of the run in Redis at once; the other chunks wait in the store and are queued in order "
    f"as chunks finish. Default: {DEFAULT_WINDOW}, or {WINDOW_PER_WORKER} per worker listening if more.",
)


SHARD_SIZE_OPTION = click.option(
    "--shard-size",
    default=f"{DEFAULT_SHARD_BYTES // 2**30}GiB",
    show_default=True,
    help="A result with more embedding bytes than this is published as ordered shards of this size "
    "(e.g. 512MiB, 2GB), each written straight to the store; up to it, one embeddings.npy.",
)


def watch_options(func: F) -> F:
    options = [
        QUEUE_WINDOW_OPTION,
        SHARD_SIZE_OPTION,
        click.option(
            "--poll",
            type=click.FloatRange(0.01),
            default=WatchSettings.poll_seconds,
            show_default=True,
            help="Seconds between looks at the run (a finished chunk wakes the supervisor sooner).",
        ),
        click.option(
            "--max-attempts",
            type=click.IntRange(1),
            default=RetryPolicy.max_attempts,
            envvar="CHUNKQ_MAX_ATTEMPTS",
            show_envvar=True,
            show_default=True,
            help="Attempts per chunk before it is quarantined.",
        ),
        click.option(
            "--allow-partial",
            is_flag=True,
            help="With quarantined chunks, publish the rest and list the missing rows (exit 9).",
        ),
        click.option(
            "--metrics-port",
            type=click.IntRange(0, 65535),
            default=None,
            envvar="CHUNKQ_METRICS_PORT",
            show_envvar=True,
            help="Serve the supervisor's Prometheus metrics on 127.0.0.1:PORT "
            "(chunkq run: the pool's on PORT+1).",
        ),
        click.option(
            "--wait",
            is_flag=True,
            help="If another process owns the run (or the store's embedded Redis), wait for it "
            "instead of refusing.",
        ),
        click.option(
            "--warn-idle",
            type=click.FloatRange(0.1),
            default=WARN_IDLE_SECONDS,
            show_default=True,
            help="Say so when chunks wait and no worker has taken one for this many seconds.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func
