"""The ``chunkq`` command line. Options that read an environment variable show it in ``--help``."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from chunkq.jobs import model_info
from chunkq.jobs.errors import AssemblyError, ConfigError
from chunkq.jobs.manifest import load_manifest
from chunkq.jobs.models import BUNDLED_MODEL, assume_offline, check_model, default_model
from chunkq.jobs.nopickle import forbid_pickle
from chunkq.jobs.specs import (
    BATCH_TOKENS_AUTO,
    DEFAULT_PRECISION,
    MODEL_KWARGS,
    OUTPUT_DTYPES,
    PRECISIONS,
    EncodeOptions,
    check_model_kwargs,
)
from chunkq.jobs.storage import OWNER_ONLY, is_local
from chunkq.jobs.store import RunLayout, read_json
from chunkq.queue_worker import gpus as gpu_discovery
from chunkq.queue_worker.exit_codes import EXIT_CHUNKS_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_POOL_DIED
from chunkq.queue_worker.pool import start as start_pool
from chunkq.queue_worker.settings import PoolSettings
from chunkq.supervisor.assemble import assemble
from chunkq.supervisor.attempts import describe_attempts, failed_attempts, to_json
from chunkq.supervisor.cli_common import (
    configure_logging,
    interrupt_on_sigterm,
    log_level_option,
    need_redis,
    queue_option,
    redis_option,
    reports_errors,
    store_option,
)
from chunkq.supervisor.cli_runs import clean_cmd, export_cmd, runs_cmd
from chunkq.supervisor.corpus import FORMATS, CorpusOptions
from chunkq.supervisor.dashboard import DEFAULT_PORT as DEFAULT_DASHBOARD_PORT
from chunkq.supervisor.dashboard import serve as serve_dashboard
from chunkq.supervisor.display import ProgressDisplay, describe
from chunkq.supervisor.doctor import examine, render
from chunkq.supervisor.enqueue import DEFAULT_WINDOW, WINDOW_PER_WORKER
from chunkq.supervisor.options import F, pool_setting_options, pool_settings, pop_pool_values
from chunkq.supervisor.progress import Tracker, store_snapshot
from chunkq.supervisor.report import write_report
from chunkq.supervisor.request import (
    RUN_DECIDES_FOR_THE_POOL,
    build_run_request,
    reach_redis,
    submit_request,
    watch_settings,
)
from chunkq.supervisor.result import DEFAULT_SHARD_BYTES, check_published, shard_bytes
from chunkq.supervisor.retry import RetryPolicy
from chunkq.supervisor.run import RunOutcome, embedded_url, run
from chunkq.supervisor.submit import DEFAULT_CHUNK_SIZE, submit
from chunkq.supervisor.watch import WARN_IDLE_SECONDS, Outcome, WatchSettings, failure_report, supervise

log = logging.getLogger("chunkq")

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


def _finish(outcome: Outcome) -> int:
    """Print the end of a watched run and pick the exit code."""
    if outcome.quarantined:
        click.echo(failure_report(outcome.quarantined), err=True)
        if outcome.partial and outcome.result is not None:
            result = outcome.result
            click.echo(
                f"PARTIAL result: {result['rows']} of {result['corpus_rows']} rows; the missing row "
                "ranges are listed under 'missing' in result/manifest.json",
                err=True,
            )
            return EXIT_PARTIAL
        return EXIT_CHUNKS_FAILED
    if outcome.result is None:
        click.echo(
            f"run {outcome.snapshot.run_id} stopped before it settled: {describe(outcome.snapshot)}", err=True
        )
        return EXIT_CHUNKS_FAILED
    result = outcome.result
    rate = outcome.snapshot.rows_per_second
    click.echo(
        f"run {result['run_id']}: {result['rows']} x {result['dim']} embeddings, "
        f"{len(result['workers'])} worker process(es)" + (f", {rate:,.1f} rows/s" if rate else "")
    )
    return EXIT_OK


def _log_level() -> str:
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


@click.group()
@log_level_option
@click.version_option(package_name="chunkq")
def cli() -> None:
    """chunkq: embed large corpora with sentence-transformers; nothing is lost when a process dies.

    Start with `chunkq run CORPUS`; `chunkq runs` lists what the store holds.
    """
    if not logging.getLogger().handlers:
        configure_logging(PoolSettings.log_level)


def command(name: str) -> Callable[[F], click.Command]:
    """A subcommand that takes --log-level after its name too, and reports errors in one line."""

    def decorate(func: F) -> click.Command:
        return cli.command(name)(log_level_option(reports_errors(func)))

    return decorate


@command("submit")
@submit_options
@QUEUE_WINDOW_OPTION
@redis_option("needed")
@click.option("--json", "as_json", is_flag=True, help="Print the run's figures as JSON, not its id alone.")
def submit_cmd(corpus: tuple[str, ...], redis_url: str | None, as_json: bool, **kw: Any) -> None:
    """Split CORPUS (files or glob patterns) into chunks in the store and enqueue one job per chunk.

    Idempotent: the same command again enqueues only what is neither done nor in flight. Prints the
    run id (for `chunkq supervise RUN`).
    """
    connection = reach_redis(need_redis(redis_url))  # before anything is written
    request = submit_request(corpus, kw.pop("store"), **kw)
    result = submit(request, connection)
    if not as_json:
        click.echo(result.run_id)
        return
    c = result.counts
    figures = {
        "run_id": result.run_id,
        "rows": result.rows,
        "chunks": result.chunks,
        "done": result.done,
        "in_flight": c.in_flight,
        "enqueued": c.enqueued,
        "requeued": c.requeued,
        "waiting": c.waiting,
        "created": result.created,
    }
    click.echo(json.dumps(figures, indent=2))


@command("pool")
@pool_setting_options()
@store_option
@queue_option
@redis_option("needed")
def pool_cmd(redis_url: str | None, store: Path, queue: str, **kw: Any) -> None:
    """Run fresh worker processes on this host's GPUs (or CPU) until signalled."""
    url = need_redis(redis_url)
    settings = pool_settings(kw, redis_url=url, store=str(store), queue=queue, log_level=_log_level())
    if settings.preload:  # a name people type, or one that cannot load here: before any worker
        settings = replace(settings, preload=check_model(settings.preload))
    sys.exit(start_pool(settings))


@command("dashboard")
@click.option(
    "--bind",
    default="127.0.0.1",
    envvar="CHUNKQ_DASHBOARD_BIND",
    show_envvar=True,
    show_default=True,
    help="Address to serve on; anything but loopback needs --username and --password.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_DASHBOARD_PORT,
    envvar="CHUNKQ_DASHBOARD_PORT",
    show_envvar=True,
    show_default=True,
    help="Port to serve on.",
)
@click.option(
    "--username",
    default=None,
    envvar="CHUNKQ_DASHBOARD_USERNAME",
    show_envvar=True,
    help="Basic-auth user name.",
)
@click.option(
    "--password",
    default=None,
    envvar="CHUNKQ_DASHBOARD_PASSWORD",
    show_envvar=True,
    help="Basic-auth password. Prefer the variable: a command line is visible to every user of the host.",
)
@redis_option("needed")
def dashboard_cmd(
    redis_url: str | None, bind: str, port: int, username: str | None, password: str | None
) -> None:
    """rq-dashboard for chunkq's queues: JSON only, loopback unless credentials are set."""
    serve_dashboard(need_redis(redis_url), bind, port, username, password)


@command("report")
@click.argument("run_id")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for report.png, report.md, report.json (default: the run's report/ in a "
    "filesystem store, ./chunkq-report-RUN otherwise).",
)
@store_option
@redis_option("unused")
def report_cmd(run_id: str, out: Path | None, store: Path, redis_url: str | None) -> None:
    """A timeline PNG and a summary of RUN: chunks per process, model loads, failures, throughput, lengths."""
    del redis_url  # the report reads the store alone, Redis gone or not
    layout = RunLayout(store, run_id)
    if out is None:
        out = layout.root / "report" if is_local(store) else Path(f"chunkq-report-{run_id}")
    numbers = write_report(layout, out)
    click.echo(
        f"{out / 'report.png'}, {out / 'report.md'}: {numbers['rows_done']} rows, "
        f"{numbers['worker_processes']} worker processes, {numbers['failed_attempts']} failed attempt(s)"
    )


@command("supervise")
@click.argument("run_id")
@watch_options
@store_option
@redis_option("needed")
def supervise_cmd(run_id: str, store: Path, redis_url: str | None, **watch: Any) -> None:
    """Watch RUN_ID: retry or quarantine failed chunks, then assemble the result when all are done."""
    connection = reach_redis(need_redis(redis_url))
    with ProgressDisplay() as display:
        layout = RunLayout(store, run_id)
        outcome = supervise(connection, layout, display, watch_settings(**watch))
    sys.exit(_finish(outcome))


@command("status")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("status")
def status_cmd(run_id: str, store: Path, redis_url: str | None, as_json: bool) -> None:
    """Print where RUN_ID stands, once: from the store, and from Redis when one is given."""
    layout = RunLayout(store, run_id)
    manifest = load_manifest(layout)
    redis_url = redis_url or embedded_url(store)  # a `chunkq run` serving this store right now
    if redis_url:
        snap = Tracker(reach_redis(redis_url), layout, manifest).poll()
    else:
        snap = store_snapshot(layout, manifest)
    attempts = failed_attempts(layout)
    if as_json:
        click.echo(json.dumps({**snap.to_json(), "failed_attempts": to_json(attempts)}, indent=2))
        return
    click.echo(describe(snap))
    click.echo(describe_attempts(attempts))
    if snap.failures:
        click.echo(failure_report(snap.quarantined or snap.failures))
    if snap.result_published:
        click.echo(f"result published in {layout.result}")


@command("model")
@click.argument("model", required=False)
@click.option("--revision", default=None, help="The hub revision to describe (default: the cache's main).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@redis_option("unused")
def model_cmd(model: str | None, revision: str | None, as_json: bool, redis_url: str | None) -> None:
    """What chunkq will run for MODEL (default: the bundled one), read from its files: dimension,
    maximum sequence length, named prompts and the default one, remote code, the cached revision."""
    del redis_url
    ref = check_model(model) if model else default_model()
    info = model_info.describe(ref, revision)
    if as_json:
        click.echo(json.dumps(info.to_json(), indent=2))
        return
    prompts = (
        "\n".join(f"    {name!r}: {text!r}" for name, text in sorted(info.prompts.items())) or "    none"
    )
    default = info.default_prompt_name or "none (no prompt unless --prompt or --prompt-name)"
    click.echo(
        f"model               {info.ref}\n"
        f"files               {info.folder or 'not on this host'}\n"
        f"revision            {info.revision or '-'}\n"
        f"dimension           {info.dim or 'unknown'} (--truncate-dim may keep fewer)\n"
        f"max sequence length {info.max_seq_length or 'the tokenizer maximum'} tokens (--max-seq-length)\n"
        f"remote code         {'needed: --trust-remote-code' if info.remote_code else 'no'}\n"
        f"default prompt      {default}\n"
        f"named prompts (--prompt-name)\n{prompts}"
    )


@command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("live")
def doctor_cmd(store: Path, redis_url: str | None, as_json: bool) -> None:
    """List GPUs, what torch sees, Redis and the store; exit 1 with advice when something is wrong."""
    report = examine(store, redis_url)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else render(report))
    sys.exit(EXIT_OK if not report.problems else EXIT_CHUNKS_FAILED)


@command("assemble")
@click.argument("run_id")
@click.option(
    "--verify",
    is_flag=True,
    help="Only check the published result: its checksums, and that it is the run's (rows, model, options)",
)
@SHARD_SIZE_OPTION
@store_option
@redis_option("unused")
def assemble_cmd(run_id: str, store: Path, verify: bool, shard_size: str, redis_url: str | None) -> None:
    """Verify every chunk output of RUN_ID and publish result/ (whole, or not at all)."""
    del redis_url
    layout = RunLayout(store, run_id)
    if verify:
        damage = check_published(layout, load_manifest(layout))
        if damage:
            raise AssemblyError(run_id, [*damage, "run `chunkq assemble RUN` to assemble it again"])
        result = read_json(layout.result_manifest)
        click.echo(
            f"{layout.result}: {result['rows']} x {result['dim']}, every checksum matches its manifest "
            "and the result is the run's (fingerprint, model, options, rows)"
        )
        return
    result = assemble(layout, shard_bytes=shard_bytes(shard_size))
    shards = f" in {len(result['shards'])} shards" if result.get("shards") else ""
    click.echo(f"{layout.result}: {result['rows']} x {result['dim']}{shards}")


@command("run")
@submit_options
@pool_setting_options(exclude=RUN_DECIDES_FOR_THE_POOL)
@watch_options
@redis_option("embedded")
def run_cmd(corpus: tuple[str, ...], redis_url: str | None, **kw: Any) -> None:
    """Everything on this machine: embedded Redis (unless --redis-url), pool, submit, supervise, assemble.

    CORPUS: one or more files, or glob patterns ('data/*.parquet'), read in order as one corpus.
    Everything is checked before anything starts; the same command again resumes the run.
    """
    pool_values = pop_pool_values(kw, exclude=RUN_DECIDES_FOR_THE_POOL)
    if pool_values.get("gpus") not in (None, "all", "none", "cpu"):
        gpu_discovery.select(pool_values["gpus"], gpu_discovery.discover())  # refuse a missing GPU up front
    req = build_run_request(corpus, store=kw.pop("store"), redis_url=redis_url, **kw, **pool_values)
    with ProgressDisplay() as display:
        outcome: RunOutcome = run(req, display)
    layout = RunLayout(req.submit.store, outcome.submitted.run_id)
    if outcome.outcome is None:
        click.echo(f"run {outcome.submitted.run_id}: already complete; result in {layout.result}")
        sys.exit(EXIT_OK)
    if outcome.pool_died and outcome.outcome.result is None:
        click.echo(
            "chunkq: error: the worker pool exited before the run finished; see its log above", err=True
        )
        sys.exit(EXIT_POOL_DIED)
    code = _finish(outcome.outcome)
    if code == EXIT_OK:
        click.echo(f"result in {layout.result}")
    sys.exit(code)


for _command in (runs_cmd, clean_cmd, export_cmd):
    cli.add_command(log_level_option(_command))


def main() -> None:
    # Stored texts, embeddings and the append-only file (which holds tracebacks that quote them) are
    # the user's data: one mode for all of them, whoever creates them (children inherit the mask).
    os.umask(OWNER_ONLY)
    forbid_pickle()
    assume_offline()  # models load from folders and the cache; HF_HUB_OFFLINE=0 allows downloads
    interrupt_on_sigterm()  # the pool installs its own handlers, which drain the same way
    cli(prog_name="chunkq")


if __name__ == "__main__":
    main()
