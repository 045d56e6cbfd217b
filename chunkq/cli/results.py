"""``chunkq runs``, ``chunkq clean`` and ``chunkq export``: what the store holds, read from the store."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from chunkq.cli.common import (
    reach_redis_if,
    redis_option,
    store_option,
)
from chunkq.cli.encode_options import KEEP_OUTPUTS_OPTION, SHARD_SIZE_OPTION
from chunkq.cli.group import command
from chunkq.jobs.contract.errors import AssemblyError, StoreError
from chunkq.jobs.contract.run import ResultManifest, Run
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.units import age_text, size_text, table_text
from chunkq.queue_worker.exit_codes import EXIT_PARTIAL
from chunkq.sinks.destinations import file_format
from chunkq.sinks.files import EXPORT_FORMATS, STDOUT, export
from chunkq.supervisor.result.assemble import assemble
from chunkq.supervisor.result.published import rebuild_advice, shard_bytes
from chunkq.supervisor.result.reader import result_problems, texts_of
from chunkq.supervisor.store.store_lock import StoreLock
from chunkq.tools.run_list import RunInfo, clean, list_runs


def _table(runs: list[RunInfo]) -> str:
    rows = [("RUN", "STATE", "ROWS", "CORPUS", "MODEL", "OPTIONS", "AGE", "SIZE")]
    rows += [
        (
            r.run_id,
            r.state,
            f"{r.rows_done:,}/{r.rows:,}",
            r.corpus,
            r.model,
            r.options or "-",
            age_text(r.age_seconds),
            size_text(r.bytes),
        )
        for r in runs
    ]
    return table_text(rows)


@command("runs")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("unused")
def runs_cmd(store: Path, as_json: bool, redis_url: str | None) -> None:
    """List the runs of the store, newest first: state, rows done, corpus, model, the options that
    differ from the defaults, age and size."""
    del redis_url
    runs = list_runs(store)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in runs], indent=2))
    elif runs:
        click.echo(_table(runs))
    else:
        click.echo(f"no runs in {store}")


@command("clean")
@click.argument("run_id")
@click.option(
    "--outputs-only",
    is_flag=True,
    help="Free only the per-chunk embeddings of a run whose whole result is published; without it, "
    "delete the run.",
)
@store_option
@redis_option("live")
def clean_cmd(run_id: str, outputs_only: bool, store: Path, redis_url: str | None) -> None:
    """Delete RUN_ID from the store, or free its chunk outputs; a run in flight is refused."""
    layout = RunLayout(store, run_id)
    cleaned = clean(layout, outputs_only, reach_redis_if(redis_url))
    what = "chunk outputs of run" if outputs_only else "run"
    click.echo(f"freed {size_text(cleaned.freed)}: {what} {run_id}")
    if cleaned.held:  # a newcomer's clean said "freed 22.7 MiB" of files the cache's links kept
        click.echo(
            f"{size_text(cleaned.held)} of its files stay on the disk: the store's vector cache links "
            "them (`chunkq cache` shows it, `chunkq cache clean` frees it)"
        )


@command("export")
@click.argument("run_id")
@click.option(
    "--format",
    "out_format",
    type=click.Choice(EXPORT_FORMATS),
    default=None,
    help="The file's format: what --out's name ends in (.parquet, .npy, .jsonl), else parquet. "
    "parquet: columns id (string) and embedding (fixed-size list of float32); npy: the array, and its "
    "ids beside it in NAME.ids.jsonl; jsonl: {id, embedding} per line.",
)
@click.option(
    "--out",
    type=click.Path(path_type=Path, dir_okay=False, allow_dash=True),
    default=None,
    help="File to write, in an existing folder; '-', a pipe or a device is written through.",
)
@click.option(
    "--to",
    "to",
    default=None,
    metavar="URL",
    help="Write into a vector store instead of a file, upserting by id: lancedb://PATH/TABLE, "
    "faiss:PATH (an index file, --index), postgresql://USER@HOST:PORT/DB?table=T (pgvector).",
)
@click.option(
    "--index",
    default=None,
    help="--to faiss:PATH: the FAISS index to build, as a factory string (Flat, HNSW32, 'IVF1024,PQ32'); "
    "default Flat. Trained on a sample of the run where it must be.",
)
@click.option(
    "--columns",
    default="",
    help="Corpus fields to copy beside each row, comma-separated (title,url), as text: into a table "
    "(--to), or a Parquet or JSON Lines file of a dense run.",
)
@click.option(
    "--column",
    "vector_column",
    default=None,
    metavar="NAME",
    help="--to a table: the vector column's name (default: vector for LanceDB, embedding for pgvector; "
    "a sparse run's: sparse). A second run of the same corpus adds its column to the same table.",
)
@click.option(
    "--level",
    type=click.Choice(("window", "document")),
    default="window",
    show_default=True,
    help="A windowed run (--long-texts window|late): a row per window, or per text (its --pool vector).",
)
@click.option("--json", "as_json", is_flag=True, help="--to: print the summary as JSON.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace --out if it is an existing file; with --to faiss:PATH, a file there chunkq did not write.",
)
@click.option(
    "--tokens",
    is_flag=True,
    help="A sparse run: each row's active dimensions as the model's vocabulary words too (a tokens column).",
)
@store_option
@redis_option("unused")
def export_cmd(
    run_id: str,
    out_format: str | None,
    out: Path | None,
    to: str | None,
    index: str | None,
    columns: str,
    vector_column: str | None,
    level: str,
    as_json: bool,
    force: bool,
    tokens: bool,
    store: Path,
    redis_url: str | None,
) -> None:
    """Write RUN_ID's published result, in corpus order with its ids, to one file (streaming), or
    with --to into a vector store."""
    del redis_url
    if (out is None) == (to is None):
        raise click.UsageError("give --out FILE or --to URL")
    names = tuple(name.strip() for name in columns.split(",") if name.strip())
    if to is not None or out is None:
        options = {"index": index, "force": force, "column": vector_column, "level": level}
        _export_to(Run.open(store, run_id), str(to), options, names, as_json)
        return
    # Where the data itself goes to stdout, a pipe or a device, the note of what was written must not join it.
    stream = out == STDOUT or (out.exists() and not out.is_file())
    fmt = file_format(out, out_format)
    run = Run.open(store, run_id)
    written = export(run, fmt, out, force, tokens=tokens, level=level, columns=names)
    result = run.result  # as export read it: the rows written are this manifest's
    if result is None:
        raise StoreError(f"run {run_id} has no published result")
    if not stream:  # to stdout or a pipe there is no file to name: the data is what was written
        click.echo(_written_line(run, result, written, level))
    if not result.complete:
        click.echo(f"chunkq: PARTIAL: {result.partial_note()}; the export holds only those rows", err=True)
        sys.exit(EXIT_PARTIAL)


def _written_line(run: Run, result: ResultManifest, written: list[Path], level: str) -> str:
    """What a file export wrote, as --to says it: rows, of which run, where, how many bytes (it
    printed the file's name alone); at ``level`` document, a windowed run's texts (it said the
    windows' count of a file of texts)."""
    rows, dim, run_id = result.rows, result.dim, run.run_id
    if level == "document" and (run.manifest.plan or {}).get("windows"):
        texts = texts_of(run.manifest, result)
        rows, dim = int(texts["rows"]), int(texts["dim"])
    shape = f"{rows:,} rows" + (f" x {dim}" if dim else "") if isinstance(rows, int) else "the rows"
    size = sum(p.stat().st_size for p in written if p.is_file())
    return f"{shape} of run {run_id} written to {', '.join(str(p) for p in written)} ({size_text(size)})"


def _export_to(run: Run, url: str, options: dict[str, Any], columns: tuple[str, ...], as_json: bool) -> None:
    from chunkq.sinks import export_to

    shown = False
    counting = not as_json and sys.stderr.isatty()  # a log or a pipe kept "0/301 rows301/301 rows"

    def say(progress: Any) -> None:
        nonlocal shown
        if counting:
            click.echo(f"\r{progress.written:,}/{progress.total:,} rows", nl=False, err=True)
            shown = True

    try:
        summary = export_to(run, url, options, on_progress=say, columns=columns)
    except BaseException:
        if shown:
            click.echo("", err=True)  # the error on a line of its own, not after the count
        raise
    if as_json:
        click.echo(json.dumps(summary, indent=2))
        return
    if shown:
        click.echo("", err=True)
    click.echo(
        f"{summary['written']:,} rows of run {run.run_id} written to {summary['url']} in "
        f"{summary['seconds']} s ({summary['rows_per_second']} rows/s)"
        + (f"; the table holds {summary['table_rows']:,} rows" if "table_rows" in summary else "")
    )


@command("assemble")
@click.argument("run_id")
@click.option(
    "--verify",
    is_flag=True,
    help="Only check the published result: its checksums, and that it is the run's (rows, model, options)",
)
@SHARD_SIZE_OPTION
@KEEP_OUTPUTS_OPTION
@store_option
@redis_option("unused")
def assemble_cmd(
    run_id: str, store: Path, verify: bool, shard_size: str, keep_outputs: bool, redis_url: str | None
) -> None:
    """Verify every chunk output of RUN_ID and publish result/ (whole, or not at all)."""
    del redis_url
    layout = RunLayout(store, run_id)
    if verify:
        run = Run.open(store, run_id)
        damage = result_problems(run)
        if damage or run.result is None:
            raise AssemblyError(run_id, [*damage, rebuild_advice(layout)])
        click.echo(
            f"{layout.result}: {run.result.rows} x {run.result.dim}, every checksum matches its manifest "
            "and the result is the run's (fingerprint, model, options, rows)"
        )
        if not run.result.complete:
            click.echo(f"PARTIAL: {run.result.partial_note()}")
            sys.exit(EXIT_PARTIAL)
        return
    # Under the run's lock, as clean: beside the live run that owns it, every chunk it had yet to
    # finish was listed as "output metadata missing" (a hostile pass); now it is said to be in use.
    run = Run.of(layout)
    with StoreLock(
        layout.owner, f"run {run_id}", wait_hint=f"run `chunkq assemble {run_id}` once it has finished"
    ) as lock:
        lock.acquire()
        result = assemble(
            run, fence=lock.check, shard_bytes=shard_bytes(shard_size), keep_outputs=keep_outputs
        )
    shards = f" in {len(result['shards'])} shards" if result.get("shards") else ""
    click.echo(f"{layout.result}: {result['rows']} x {result['dim']}{shards}")
