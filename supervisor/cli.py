"""The ``chunkq`` command line. Every option also reads a ``CHUNKQ_*`` environment variable."""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn, TypeVar

import click
import redis

from jobs import errors
from jobs.errors import AssemblyError, BadInputError, ChunkqError, ConfigError, RunConflictError
from jobs.models import default_model
from jobs.nopickle import forbid_pickle
from jobs.specs import BATCH_TOKENS_AUTO, DEFAULT_PRECISION, PRECISIONS, EncodeOptions
from jobs.storage import is_local, open_store
from jobs.store import RunLayout, read_json
from queue_worker import gpus as gpu_discovery
from queue_worker.pool import Pool
from queue_worker.settings import DEFAULT_QUEUE, DEFAULT_STORE, SETTINGS_JSON_ENV, PoolSettings, env_of
from supervisor.assemble import assemble, result_damage
from supervisor.attempts import describe_attempts, failed_attempts, to_json
from supervisor.corpus import FORMATS, CorpusOptions, detect_format
from supervisor.dashboard import DEFAULT_PORT as DEFAULT_DASHBOARD_PORT
from supervisor.dashboard import serve as serve_dashboard
from supervisor.display import ProgressDisplay, describe
from supervisor.doctor import examine, render
from supervisor.lock import RunLockedError
from supervisor.manifest import load_manifest
from supervisor.options import pool_setting_options, pool_settings, pop_pool_values
from supervisor.progress import Tracker
from supervisor.report import write_report
from supervisor.retry import RetryPolicy
from supervisor.run import RunOutcome, RunRequest, run
from supervisor.submit import DEFAULT_CHUNK_SIZE, SubmitRequest, submit
from supervisor.watch import Outcome, RedisGoneError, WatchSettings, failure_report, supervise

log = logging.getLogger("chunkq")

EXIT_OK = 0
EXIT_CHUNKS_FAILED = 1  # chunks were quarantined; the report names each with its rows and last error
EXIT_USAGE = 2  # click's own code for a bad command line
EXIT_BAD_INPUT = 3  # the corpus is malformed
EXIT_CONFLICT = 4  # the run id is taken by another corpus or other options
EXIT_ASSEMBLY = 5  # chunk outputs missing or corrupt
EXIT_CONFIG = 6  # settings that cannot work
EXIT_REDIS = 7  # Redis unreachable
EXIT_POOL_DIED = 8  # chunkq run: the worker pool ended before the run did
EXIT_PARTIAL = 9  # --allow-partial: a result without the quarantined chunks was published
EXIT_LOCKED = 10  # another supervisor is watching the run
EXIT_STORAGE = 11  # a disk or store is full, read-only or not ours to write
EXIT_INTERNAL = 70  # a bug in chunkq (sysexits' EX_SOFTWARE); the traceback is written to a file
EXIT_INTERRUPTED = 130  # Ctrl+C; the run resumes from the store

F = TypeVar("F", bound=Callable[..., Any])


def _exit_code(exc: Exception) -> int:
    for kind, code in (
        (RunLockedError, EXIT_LOCKED),
        (RedisGoneError, EXIT_REDIS),
        (AssemblyError, EXIT_ASSEMBLY),
        (BadInputError, EXIT_BAD_INPUT),
        (RunConflictError, EXIT_CONFLICT),
        (redis.RedisError, EXIT_REDIS),
    ):
        if isinstance(exc, kind):
            return code
    return EXIT_CONFIG


RESUME_HINT = "the store keeps every finished chunk: run the same command to resume"
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def reports_errors(func: F) -> F:
    """Turn every error into one clear line and a named exit code, never a traceback on the terminal."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except (ChunkqError, redis.RedisError) as exc:
            click.echo(f"chunkq: error: {exc}", err=True)
            sys.exit(_exit_code(exc))
        except KeyboardInterrupt:
            click.echo(f"chunkq: interrupted; {RESUME_HINT}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except click.ClickException:
            raise
        except OSError as exc:
            if exc.errno not in STORAGE_ERRNOS:
                _internal_error(exc)
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(
                f"chunkq: error: {exc.strerror}{where}; make room (or fix the permissions) and run the "
                f"same command again (nothing partial was published; {RESUME_HINT})",
                err=True,
            )
            sys.exit(EXIT_STORAGE)
        except Exception as exc:
            _internal_error(exc)

    return wrapper  # type: ignore[return-value]


def _internal_error(exc: BaseException) -> NoReturn:
    """A bug: one line on the terminal, the traceback in a file the line names."""
    crash = Path(tempfile.gettempdir()) / f"chunkq-crash-{os.getpid()}.txt"
    try:
        crash.write_text("".join(traceback.format_exception(exc)), encoding="utf-8")
        where = f"the traceback is in {crash}"
    except OSError:
        where = "run again with --log-level DEBUG for the traceback"
    log.debug("internal error", exc_info=exc)
    click.echo(
        f"chunkq: internal error: {type(exc).__name__}: {errors.first_line(str(exc))} (a bug in chunkq; "
        f"{where}); {RESUME_HINT}",
        err=True,
    )
    sys.exit(EXIT_INTERNAL)


def _interrupt_on_sigterm() -> None:
    """SIGTERM (timeout, systemd, docker, kill) does what Ctrl+C does: the first drains, the second
    stops now. Raising KeyboardInterrupt from the handler is what Python's own SIGINT handler does."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def store_option(func: F) -> F:
    return click.option(
        "--store",
        default=DEFAULT_STORE,
        envvar=env_of("store"),
        show_default=True,
        callback=_open_store,
        help="Store shared by all hosts: a local or network path, or s3://bucket/prefix, gs://bucket/prefix.",
    )(func)


def _open_store(ctx: click.Context, param: click.Parameter, value: str) -> Path:
    try:
        return open_store(value)
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from exc


def redis_option(required: bool) -> Callable[[F], F]:
    return click.option(
        "--redis-url",
        envvar=env_of("redis_url"),
        required=required,
        help="redis:// or rediss:// URL (password or ACL user included).",
    )


def queue_option(func: F) -> F:
    return click.option("--queue", default=DEFAULT_QUEUE, envvar=env_of("queue"), show_default=True)(func)


def submit_options(func: F) -> F:
    options = [
        click.argument("corpus", type=click.Path(path_type=Path)),
        click.option(
            "--model", envvar="CHUNKQ_MODEL", help="Model name or path (default: the bundled model)."
        ),
        click.option("--run-id", help="Default: derived from the corpus checksum and options."),
        click.option("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, show_default=True),
        click.option("--format", "fmt", type=click.Choice(FORMATS), help="Default: from the file suffix."),
        click.option("--text-field", default="text", show_default=True),
        click.option("--id-field", default="id", show_default=True),
        click.option("--batch-size", type=int, default=32, show_default=True),
        click.option(
            "--batch-tokens",
            default=None,
            callback=_batch_tokens_value,
            help="Batches by a budget of padded tokens over length-sorted texts instead of "
            "--batch-size texts: a number, or 'auto' (grows while it pays, learns from OOM).",
        ),
        click.option("--normalize/--no-normalize", default=False, show_default=True),
        click.option("--max-seq-length", type=int, default=None),
        click.option(
            "--precision", type=click.Choice(PRECISIONS), default=DEFAULT_PRECISION, show_default=True
        ),
        click.option(
            "--job-timeout", type=int, default=None, help="Seconds per chunk (default scales with size)."
        ),
        queue_option,
        store_option,
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _batch_tokens_value(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    if value is None or value == BATCH_TOKENS_AUTO:
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise click.BadParameter(f"{value!r}: give a number of tokens (1 or more) or 'auto'")


# What chunkq run decides for its pool itself, from its own options and its embedded Redis.
RUN_DECIDES_FOR_THE_POOL = (
    "queue",
    "store",
    "preload",
    "precision",
    "name",
    "metrics_port",
    "allowed_models",
)


def watch_options(func: F) -> F:
    options = [
        click.option("--poll", type=float, default=1.0, show_default=True, help="Seconds between looks."),
        click.option(
            "--max-attempts",
            type=click.IntRange(1),
            default=3,
            envvar="CHUNKQ_MAX_ATTEMPTS",
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
            help="Serve the supervisor's Prometheus metrics on 127.0.0.1:PORT "
            "(chunkq run: the pool's on PORT+1).",
        ),
        click.option(
            "--wait",
            is_flag=True,
            help="If another process owns the run (or the store's embedded Redis), wait for it "
            "instead of refusing.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def _watch_settings(
    poll: float, max_attempts: int, allow_partial: bool, metrics_port: int | None = None, wait: bool = False
) -> WatchSettings:
    return WatchSettings(
        poll_seconds=poll,
        policy=RetryPolicy(max_attempts=max_attempts),
        allow_partial=allow_partial,
        metrics_port=metrics_port,
        wait_for_owner=wait,
    )


def _submit_request(corpus: Path, **kw: Any) -> SubmitRequest:
    fmt = detect_format(corpus, kw["fmt"])
    return SubmitRequest(
        corpus=corpus,
        store=kw["store"],
        model=kw["model"] or default_model(),
        corpus_options=CorpusOptions(format=fmt, text_field=kw["text_field"], id_field=kw["id_field"]),
        chunk_size=kw["chunk_size"],
        encode=EncodeOptions(
            batch_size=kw["batch_size"],
            normalize_embeddings=kw["normalize"],
            max_seq_length=kw["max_seq_length"],
            precision=kw["precision"],
            batch_tokens=kw["batch_tokens"],
        ),
        run_id=kw["run_id"],
        queue=kw["queue"],
        job_timeout=kw["job_timeout"],
    )


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
    click.echo(
        f"run {result['run_id']}: {result['rows']} x {result['dim']} embeddings, "
        f"{len(result['workers'])} worker process(es)"
    )
    return EXIT_OK


@click.group()
@click.option("--log-level", default="INFO", envvar="CHUNKQ_LOG_LEVEL", show_default=True)
@click.version_option(package_name="chunkq")
@click.pass_context
def cli(ctx: click.Context, log_level: str) -> None:
    """chunkq: embed large corpora with sentence-transformers; nothing is lost when a process dies."""
    ctx.obj = {"log_level": log_level.upper()}  # the pool hands it to its workers
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


@cli.command("submit")
@submit_options
@redis_option(required=True)
@reports_errors
def submit_cmd(corpus: Path, redis_url: str, **kw: Any) -> None:
    """Split CORPUS into chunks in the store and enqueue one job per chunk (idempotent)."""
    result = submit(_submit_request(corpus, **kw), redis.Redis.from_url(redis_url))
    c = result.counts
    click.echo(
        f"{result.run_id}\t{result.rows} rows, {result.chunks} chunks: {result.done} done, "
        f"{c.in_flight} in flight, {c.enqueued} enqueued, {c.requeued} requeued"
    )


@cli.command("pool")
@pool_setting_options()
@click.option(
    "--settings-json",
    envvar=SETTINGS_JSON_ENV,
    hidden=True,
    help="Every setting at once, as chunkq run hands them to its pool.",
)
@store_option
@queue_option
@redis_option(required=True)
@reports_errors
def pool_cmd(redis_url: str, store: Path, queue: str, settings_json: str | None, **kw: Any) -> None:
    """Run fresh worker processes on this host's GPUs (or CPU) until signalled."""
    if settings_json:
        settings = PoolSettings.from_json(settings_json)
    else:
        log_level = click.get_current_context().obj["log_level"]
        settings = pool_settings(kw, redis_url=redis_url, store=str(store), queue=queue, log_level=log_level)
    chosen = gpu_discovery.choose(settings.gpus, settings.min_free_memory, settings.busy_gpus)
    if not chosen:
        log.info("no GPU in use; running %d CPU worker(s)", settings.cpu_workers)
    sys.exit(Pool(settings, chosen).run())


@cli.command("dashboard")
@click.option("--bind", default="127.0.0.1", envvar="CHUNKQ_DASHBOARD_BIND", show_default=True)
@click.option(
    "--port", type=int, default=DEFAULT_DASHBOARD_PORT, envvar="CHUNKQ_DASHBOARD_PORT", show_default=True
)
@click.option("--username", default=None, envvar="CHUNKQ_DASHBOARD_USERNAME")
@click.option(
    "--password",
    default=None,
    envvar="CHUNKQ_DASHBOARD_PASSWORD",
    help="Prefer CHUNKQ_DASHBOARD_PASSWORD: a command line is visible to every user of the host.",
)
@redis_option(required=True)
@reports_errors
def dashboard_cmd(redis_url: str, bind: str, port: int, username: str | None, password: str | None) -> None:
    """rq-dashboard for chunkq's queues: JSON only, loopback unless credentials are set."""
    serve_dashboard(redis_url, bind, port, username, password)


@cli.command("report")
@click.argument("run_id")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=None,
    help="Directory for report.png, report.md, report.json (default: the run's report/ in a "
    "filesystem store, ./chunkq-report-RUN otherwise).",
)
@store_option
@redis_option(required=False)
@reports_errors
def report_cmd(run_id: str, out: Path | None, store: Path, redis_url: str | None) -> None:
    """A timeline PNG and a summary of RUN: chunks per process, model loads, failures, throughput, lengths."""
    del redis_url  # accepted like everywhere; the report reads the store alone, Redis gone or not
    layout = RunLayout(store, run_id)
    if out is None:
        out = layout.root / "report" if is_local(store) else Path(f"chunkq-report-{run_id}")
    numbers = write_report(layout, out)
    click.echo(
        f"{out / 'report.png'}, {out / 'report.md'}: {numbers['rows_done']} rows, "
        f"{numbers['worker_processes']} worker processes, {numbers['failed_attempts']} failed attempt(s)"
    )


@cli.command("supervise")
@click.argument("run_id")
@watch_options
@store_option
@redis_option(required=True)
@reports_errors
def supervise_cmd(run_id: str, store: Path, redis_url: str, **watch: Any) -> None:
    """Watch RUN_ID: retry or quarantine failed chunks, then assemble the result when all are done."""
    with ProgressDisplay() as display:
        layout = RunLayout(store, run_id)
        outcome = supervise(redis.Redis.from_url(redis_url), layout, display, _watch_settings(**watch))
    sys.exit(_finish(outcome))


@cli.command("status")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option(required=True)
@reports_errors
def status_cmd(run_id: str, store: Path, redis_url: str, as_json: bool) -> None:
    """Print where RUN_ID stands, once."""
    layout = RunLayout(store, run_id)
    snap = Tracker(redis.Redis.from_url(redis_url), layout, load_manifest(layout)).poll_once()
    attempts = failed_attempts(layout)
    if as_json:
        click.echo(json.dumps({**snap.to_json(), "failed_attempts": to_json(attempts)}, indent=2))
        return
    click.echo(describe(snap))
    click.echo(describe_attempts(attempts))
    if snap.failures:
        click.echo(failure_report(snap.failures))
    if snap.result_published:
        click.echo(f"result published in {layout.result}")


@cli.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option(required=False)
@reports_errors
def doctor_cmd(store: Path, redis_url: str | None, as_json: bool) -> None:
    """List GPUs, what torch sees, Redis and the store; exit 1 with advice when something is wrong."""
    report = examine(store, redis_url)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else render(report))
    sys.exit(EXIT_OK if not report.problems else EXIT_CHUNKS_FAILED)


@cli.command("assemble")
@click.argument("run_id")
@click.option(
    "--verify", is_flag=True, help="Only check the published result against its manifest's checksums."
)
@store_option
@reports_errors
def assemble_cmd(run_id: str, store: Path, verify: bool) -> None:
    """Verify every chunk output of RUN_ID and publish result/ (whole, or not at all)."""
    layout = RunLayout(store, run_id)
    if verify:
        manifest_path = layout.result / "manifest.json"
        if not manifest_path.is_file():
            raise AssemblyError(run_id, [f"no result is published in {layout.result}"])
        result = read_json(manifest_path)
        damage = result_damage(layout, result)
        if damage:
            raise AssemblyError(run_id, [*damage, "run `chunkq assemble RUN` to assemble it again"])
        click.echo(
            f"{layout.result}: {result['rows']} x {result['dim']}, every checksum matches its manifest"
        )
        return
    result = assemble(layout)
    click.echo(f"{layout.result}: {result['rows']} x {result['dim']}")


@cli.command("run")
@submit_options
@pool_setting_options(exclude=RUN_DECIDES_FOR_THE_POOL)
@watch_options
@redis_option(required=False)
@reports_errors
def run_cmd(
    corpus: Path, redis_url: str | None, poll: float, max_attempts: int, allow_partial: bool, **kw: Any
) -> None:
    """Everything on this machine: embedded Redis (unless --redis-url), pool, submit, supervise, assemble."""
    metrics_port, wait = kw.pop("metrics_port"), kw.pop("wait")
    pool = pool_settings(
        pop_pool_values(kw, exclude=RUN_DECIDES_FOR_THE_POOL),
        metrics_port=None if metrics_port is None else (metrics_port + 1 if metrics_port else 0),
    )
    req = RunRequest(
        submit=_submit_request(corpus, **kw),
        redis_url=redis_url,
        pool=pool,
        watch=_watch_settings(poll, max_attempts, allow_partial, metrics_port, wait),
    )
    if pool.gpus not in ("all", "none", "cpu"):
        gpu_discovery.select(
            pool.gpus, gpu_discovery.discover()
        )  # refuse a missing GPU before starting anything
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


STORE_UMASK = 0o077  # every file and folder chunkq and its servers and workers create: owner-only


def main() -> None:
    # Stored texts, embeddings and the append-only file (which holds tracebacks that quote them) are
    # the user's data: one mode for all of them, whoever creates them (children inherit the mask).
    os.umask(STORE_UMASK)
    forbid_pickle()
    _interrupt_on_sigterm()  # the pool installs its own handlers, which drain the same way
    cli(prog_name="chunkq")


if __name__ == "__main__":
    main()
