"""The commands that do a run's work: ``run``, ``submit``, ``pool``, ``supervise``."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from chunkq.cli.common import (
    need_redis,
    queue_option,
    quiet_unless,
    redis_option,
    store_option,
    verbose_option,
)
from chunkq.cli.encode_options import QUEUE_WINDOW_OPTION, submit_options, watch_options
from chunkq.cli.group import command, current_log_level
from chunkq.cli.settings_options import pool_setting_options, pool_settings, pop_pool_values
from chunkq.jobs import kinds
from chunkq.jobs.compute.model_refs import check_model
from chunkq.jobs.contract.defaults import DEFAULT_KIND
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.storage import is_local
from chunkq.jobs.contract.units import size_text
from chunkq.queue_worker.exit_codes import EXIT_CHUNKS_FAILED, EXIT_OK, EXIT_PARTIAL, EXIT_POOL_DIED
from chunkq.supervisor.local_run import RunOutcome, run
from chunkq.supervisor.request import (
    RUN_DECIDES_FOR_THE_POOL,
    build_run_request,
    reach_redis,
    submit_request,
    watch_settings,
)
from chunkq.supervisor.result.planned_rows import describe_savings, savings
from chunkq.supervisor.result.published import describe_left_out
from chunkq.supervisor.run_options import run_option
from chunkq.supervisor.server.store_redis import local_state_dir
from chunkq.supervisor.store.run_log import RunLog, log_path
from chunkq.supervisor.submit.plan import CACHE_WORKER
from chunkq.supervisor.submit.submission import submit
from chunkq.supervisor.watch.display import ProgressDisplay, describe
from chunkq.supervisor.watch.supervise import Outcome, failure_report, supervise

log = logging.getLogger(__name__)


def _finish(outcome: Outcome) -> int:
    """Print the end of a watched run and pick the exit code."""
    if outcome.quarantined:
        click.echo(failure_report(outcome.quarantined, outcome.snapshot.run_id), err=True)
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
        f"run {result['run_id']}: {result['rows']} x {result['dim']} {_what(result)}, {_work(outcome)}"
    )
    if result.get("bad_rows"):
        click.echo(f"--allow-missing: {describe_left_out(result['bad_rows'])}")
    saved = savings(result.get("plan"))
    if saved is not None:
        click.echo(describe_savings(saved))
    return EXIT_OK


def _outputs_kept(layout: RunLayout) -> None:
    """Say what the chunk outputs beside a published result take: the same rows again (a sparse
    run's, hundreds of MB), kept until the user frees them (a later change of the run reassembles
    from them; `clean --outputs-only` frees them once the result is verified)."""
    if not is_local(layout.outputs):
        return
    kept = sum(p.stat().st_size for p in layout.outputs.glob("*.npy"))
    if kept:
        click.echo(
            f"its chunk outputs ({size_text(kept)}) stay beside the result; `chunkq clean {layout.run_id} "
            "--outputs-only` frees them"
        )


def _work(outcome: Outcome) -> str:
    """What the workers did, in the words that are true of it: none, when the vector cache held
    every text; else how many processes encoded how many rows at what rate."""
    workers = [w for w in outcome.result["workers"] if w != CACHE_WORKER] if outcome.result else []
    if not workers:
        return "no row encoded: every text came from the vector cache"
    snap = outcome.snapshot
    saved = savings(outcome.result.get("plan")) if outcome.result else None
    encoded = saved["encoded"] if saved is not None else snap.rows_done
    rate = f" at {snap.rows_per_second:,.1f} rows/s" if snap.rows_per_second else ""
    processes = outcome.result.get("worker_processes", len(workers)) if outcome.result else len(workers)
    return f"{encoded:,} row(s) encoded by {processes} worker process(es){rate}"


def _what(result: dict[str, Any]) -> str:
    return kinds.get((result.get("options") or {}).get("kind", DEFAULT_KIND)).rows_are


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
    store = kw.pop("store")
    connection = reach_redis(need_redis(redis_url, store))  # before anything is written
    request = submit_request(corpus, store, **kw)
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
    url = need_redis(redis_url, store)
    settings = pool_settings(kw, redis_url=url, store=str(store), queue=queue, log_level=current_log_level())
    settings = with_the_runs_model(settings)
    if settings.preload:  # a name people type, or one that cannot load here: before any worker
        settings = replace(settings, preload=check_model(settings.preload))
    from chunkq.queue_worker.processes.pool import (
        start as start_pool,  # the pool's modules: this command's alone
    )

    sys.exit(start_pool(settings))


def with_the_runs_model(settings: Any) -> Any:
    """The model named once for a fleet: CHUNKQ_MODEL, which submit and run read, is
    one this pool may load too. The operator set it in the pool's own environment, which is the
    allow-list's protection: a job through Redis still names only what the pool allowed."""
    name, meta, _ = run_option("model")
    env = meta.env_name(name)
    model = os.environ.get(env, "").strip() if env else ""
    if not model or model in settings.allowed_models:
        return settings
    log.info("pool: %s names the run's model, %s; it may be loaded", env, model)
    return replace(settings, allowed_models=(*settings.allowed_models, model))


@command("supervise")
@click.argument("run_id")
@watch_options
@store_option
@redis_option("needed")
@verbose_option
def supervise_cmd(run_id: str, store: Path, redis_url: str | None, verbose: int, **watch: Any) -> None:
    """Watch RUN_ID: retry or quarantine failed chunks, then assemble the result when all are done."""
    quiet_unless(verbose)
    connection = reach_redis(need_redis(redis_url, store))
    layout = RunLayout(store, run_id)
    if not layout.manifest.is_file():  # said before its log file would be made; read under its lock
        load_manifest(layout)
    with RunLog(log_path(local_state_dir(store), run_id)), ProgressDisplay() as display:
        outcome = supervise(connection, layout, display, watch_settings(**watch))
    sys.exit(_finish(outcome))


@command("run")
@submit_options
@pool_setting_options(exclude=RUN_DECIDES_FOR_THE_POOL)
@watch_options
@redis_option("embedded")
@verbose_option
def run_cmd(corpus: tuple[str, ...], redis_url: str | None, verbose: int, **kw: Any) -> None:
    """Everything on this machine: embedded Redis (unless --redis-url), pool, submit, supervise, assemble.

    CORPUS: one or more files, or glob patterns ('data/*.parquet'), read in order as one corpus.
    Everything is checked before anything starts; the same command again resumes the run.
    """
    quiet_unless(verbose)
    pool_values = pop_pool_values(kw, exclude=RUN_DECIDES_FOR_THE_POOL)
    req = build_run_request(corpus, store=kw.pop("store"), redis_url=redis_url, **kw, **pool_values)
    req = replace(req, log_file=True)
    with ProgressDisplay() as display:
        outcome: RunOutcome = run(req, display)
    layout = RunLayout(req.submit.store, outcome.submitted.run_id)
    if outcome.outcome is None:
        click.echo(f"run {outcome.submitted.run_id}: already complete; result in {layout.result}")
        sys.exit(EXIT_OK)
    if outcome.forgotten:  # nothing was done: the run is not kept, so the same command starts afresh
        why = f": {outcome.pool_said}" if outcome.pool_said else ""
        click.echo(
            f"chunkq: error: the worker pool exited before the run finished{why}; nothing was encoded, so "
            "the run is not kept: mend the cause and run the same command",
            err=True,
        )
        sys.exit(EXIT_POOL_DIED)
    if outcome.pool_died and outcome.outcome.result is None:
        where = log_path(local_state_dir(req.submit.store), outcome.submitted.run_id)
        why = f": {outcome.pool_said}" if outcome.pool_said else ""
        click.echo(
            f"chunkq: error: the worker pool exited before the run finished{why}; its log: {where}", err=True
        )
        sys.exit(EXIT_POOL_DIED)
    code = _finish(outcome.outcome)
    if code == EXIT_OK:
        click.echo(f"result in {layout.result}")
        _outputs_kept(layout)
    sys.exit(code)
