"""The commands that look at runs, models and the machine: ``status``, ``report``, ``model``,
``doctor``, ``dashboard``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from chunkq.cli.common import (
    need_redis,
    redis_option,
    store_option,
)
from chunkq.cli.group import command
from chunkq.jobs import kinds
from chunkq.jobs.compute import model_info
from chunkq.jobs.compute.model_refs import check_model, default_model
from chunkq.jobs.contract import environment
from chunkq.jobs.contract.defaults import DASHBOARD_PORT as DEFAULT_DASHBOARD_PORT
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.storage import is_local
from chunkq.queue_worker.exit_codes import EXIT_ASSEMBLY, EXIT_CHUNKS_FAILED, EXIT_OK
from chunkq.supervisor.request import (
    reach_redis,
)
from chunkq.supervisor.result.planned_rows import describe_savings
from chunkq.supervisor.result.published import describe_left_out, rebuild_advice
from chunkq.supervisor.result.reader import result_problems
from chunkq.supervisor.server.store_redis import served_url
from chunkq.supervisor.store.attempts import describe_attempts, failed_attempts, to_json
from chunkq.supervisor.watch.display import describe
from chunkq.supervisor.watch.progress import Tracker
from chunkq.supervisor.watch.snapshot import store_snapshot
from chunkq.supervisor.watch.supervise import failure_report, unsettled_report
from chunkq.tools.dashboard import serve as serve_dashboard
from chunkq.tools.doctor import examine, render
from chunkq.tools.report import write_report
from chunkq.tools.run_list import checked_at_a_look


@command("dashboard")
@click.option(
    "--bind",
    default="127.0.0.1",
    envvar=environment.DASHBOARD_BIND,
    show_envvar=True,
    show_default=True,
    help="Address to serve on; anything but loopback needs --username and --password.",
)
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=DEFAULT_DASHBOARD_PORT,
    envvar=environment.DASHBOARD_PORT,
    show_envvar=True,
    show_default=True,
    help="Port to serve on.",
)
@click.option(
    "--username",
    default=None,
    envvar=environment.DASHBOARD_USERNAME,
    show_envvar=True,
    help="Basic-auth user name.",
)
@click.option(
    "--password",
    default=None,
    envvar=environment.DASHBOARD_PASSWORD,
    show_envvar=True,
    help="Basic-auth password. Prefer the variable: a command line is visible to every user of the host.",
)
@store_option
@redis_option("needed")
def dashboard_cmd(
    redis_url: str | None, bind: str, port: int, username: str | None, password: str | None, store: Path
) -> None:
    """rq-dashboard for chunkq's queues: JSON only, loopback unless credentials are set.

    Its front page counts finished chunks from --store: Redis forgets them once the store has them."""
    serve_dashboard(need_redis(redis_url, store), bind, port, username, password, store)


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
    run = Run.open(store, run_id)
    if out is None:
        out = run.layout.root / "report" if is_local(store) else Path(f"chunkq-report-{run_id}")
    numbers = write_report(run, out)
    click.echo(
        f"{out / 'report.png'}, {out / 'report.md'}: {numbers['rows_done']} rows, "
        f"{numbers['worker_processes']} worker processes, {numbers['failed_attempts']} failed attempt(s)"
    )


@command("status")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("status")
def status_cmd(run_id: str, store: Path, redis_url: str | None, as_json: bool) -> None:
    """Print where RUN_ID stands, once: from the store, and from Redis when one is given. Exits 5
    when its published result is damaged (as ``assemble --verify`` does): a script that checks a
    run with ``status`` must not read a damaged result as done."""
    run = Run.open(store, run_id)
    layout, manifest = run.layout, run.manifest
    redis_url = redis_url or served_url(store)  # a `chunkq run` or `serve-redis` serving it now
    if redis_url:
        snap = Tracker(reach_redis(redis_url), layout, manifest, records=False).poll()
    else:
        snap = store_snapshot(layout, manifest)
    attempts = failed_attempts(layout)
    whole = snap.result_published and checked_at_a_look(layout)
    damage = result_problems(run, checksums=whole) if snap.result_published else []
    if as_json:
        checked = {"every_byte": whole, "problems": damage} if snap.result_published else None
        body = {**snap.to_json(), "result_checked": checked, "failed_attempts": to_json(attempts)}
        click.echo(json.dumps(body, indent=2))
        if damage:
            sys.exit(EXIT_ASSEMBLY)
        return
    click.echo(describe(snap))
    if snap.cache is not None:
        click.echo(f"vector cache: {describe_savings(snap.cache, planned=not snap.result_published)}")
    click.echo(describe_attempts(attempts))
    if snap.quarantined:
        click.echo(failure_report(snap.quarantined, snap.run_id))
    elif snap.failures:  # in Redis, not settled yet: no supervisor has numbered or recorded them
        click.echo(unsettled_report(snap.failures, snap.run_id))
    if snap.result_published:
        if damage:
            click.echo(f"result in {layout.result} is DAMAGED ({damage[0]}); {rebuild_advice(layout)}")
            sys.exit(EXIT_ASSEMBLY)
        else:
            left_out = run.result.bad_rows if run.result is not None else []
            if left_out:
                click.echo(f"--allow-missing: {describe_left_out(left_out)}")
            how = (
                "every byte checked"
                if whole
                else "its files' sizes checked: `assemble --verify` reads every byte"
            )
            click.echo(f"result published in {layout.result} ({how})")


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
        f"kind                {_kind_line(info.kind)}\n"
        f"runs as             {' or '.join(info.kinds) or 'unknown'} (any other --kind is refused)\n"
        f"dimension           {info.dim or 'unknown'}{_dim_note(info.kind)}\n"
        f"max sequence length {_length_line(info)}\n"
        f"remote code         {'needed: --trust-remote-code' if info.remote_code else 'no'}\n"
        f"default prompt      {default}\n"
        f"named prompts (--prompt-name)\n{prompts}"
    )


def _length_line(info: model_info.ModelInfo) -> str:
    if info.static:
        return "none: a static embedding averages every token of a text (no --max-seq-length)"
    return (
        f"{info.max_seq_length or 'the tokenizer maximum'} tokens (--max-seq-length; "
        f"at most {info.positions or 'its positions'})"
    )


def _kind_line(kind: str) -> str:
    if kind in kinds.KINDS:
        found = kinds.KINDS[kind]
        return f"{kind}: {found.row}, as {found.reference} (--kind)"
    return f"{kind} (not built yet: chunkq refuses to run it)"


def _dim_note(kind: str) -> str:
    """What the dimension is for the model's kind (only a dense vector may be cut, --truncate-dim)."""
    return kinds.get(kind).dim_note if kind in kinds.KINDS else ""


@command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("live")
def doctor_cmd(store: Path, redis_url: str | None, as_json: bool) -> None:
    """List GPUs, what torch sees, Redis and the store; exit 1 with advice when something is wrong."""
    report = examine(store, redis_url)
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else render(report))
    sys.exit(EXIT_OK if not report.problems else EXIT_CHUNKS_FAILED)
