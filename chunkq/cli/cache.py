"""``chunkq cache`` and ``chunkq cache clean``: the store's vector cache, through
jobs/compute/vector_cache.py; ``chunkq cache exports``: this host's OpenVINO exports
(jobs/compute/ov_exports.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from chunkq.cli.common import log_level_option, redis_option, reports_errors, store_option
from chunkq.cli.group import cli
from chunkq.jobs.compute import cache_upkeep, ov_exports
from chunkq.jobs.compute.ov_backend import exports_dir
from chunkq.jobs.compute.vector_cache import VectorCache
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions, vector_options
from chunkq.jobs.contract.units import DURATION_FORMS, age_text, duration_seconds, size_text, table_text


def age_seconds(text: str) -> float:
    """``--older-than``: seconds, or a number with s, m (min), h, d or w (``30d``)."""
    seconds = duration_seconds(text)
    if seconds is None:
        raise ConfigError(f"--older-than {text!r}: give {DURATION_FORMS}")
    return seconds


def _options(options: Any) -> str:
    """A producer's options that differ from the defaults (its kind, role, prompt, late chunking...)."""
    defaults = vector_options(EncodeOptions())
    chosen = {k: v for k, v in (options or {}).items() if defaults.get(k) != v and v is not None}
    return ", ".join(f"{k}={v}" for k, v in chosen.items()) or "-"


def _table(entries: list[dict[str, Any]]) -> str:
    rows = [("PRODUCER", "MODEL", "OPTIONS", "SHARDS", "TEXTS", "SIZE", "HITS", "RUNS", "LAST USED")]
    rows += [
        (
            e["producer"][:12],
            str(e["model"]),
            _options(e["options"]),
            str(e["shards"]),
            f"{e['rows']:,}",
            size_text(e["bytes"]),
            f"{e['hits']:,}",
            str(e["runs"]),
            (e["last_used"] or "-")[:19],
        )
        for e in entries
    ]
    return table_text(rows)


@cli.group("cache", invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@store_option
@redis_option("unused")
@log_level_option
@click.pass_context
@reports_errors
def cache_cmd(ctx: click.Context, store: Path, as_json: bool, redis_url: str | None) -> None:
    """The store's vector cache: per model and options, the texts it holds, its size, the rows runs
    took from it (hits) and when it was last used. It is derived data: `chunkq cache clean` frees it
    and costs only the time to encode those texts again."""
    del redis_url
    ctx.obj = store
    if ctx.invoked_subcommand is not None:
        return
    entries = cache_upkeep.summary(VectorCache(store))
    if as_json:
        click.echo(json.dumps(entries, indent=2))
    elif entries:
        click.echo(_table(entries))
    else:
        click.echo(f"the vector cache of {store} is empty")


@cache_cmd.command("clean")
@click.option("--older-than", "older_than", help="Only shards written longer ago than this: 3600, 12h, 30d.")
@click.option("--producer", "key", help="Only this producer's shards (its key, as `chunkq cache` lists it).")
@store_option
@redis_option("unused")
@log_level_option
@click.pass_context
@reports_errors
def cache_clean_cmd(
    ctx: click.Context, store: Path, older_than: str | None, key: str | None, redis_url: str | None
) -> None:
    """Remove the cache's shards (all, or those older than --older-than). A run that is looking the
    cache up meanwhile encodes the texts it can no longer read."""
    del redis_url
    if ctx.get_parameter_source("store") is click.core.ParameterSource.DEFAULT:
        store = ctx.obj  # `chunkq cache --store S clean`
    cache = VectorCache(store)
    if key is not None:
        matches = [p for p in cache.producers() if p.startswith(key)]
        if len(matches) != 1:
            raise ConfigError(f"--producer {key!r} names {len(matches)} producers of the cache, not one")
        key = matches[0]
    removed = cache_upkeep.clean(cache, None if older_than is None else age_seconds(older_than), key)
    click.echo(
        f"removed {removed['shards']} shard(s), {removed['rows']:,} texts, {removed['producers']} producer(s)"
    )


@cache_cmd.command("exports")
@click.option(
    "--clean", is_flag=True, help="Remove the exports no load here reads: stale, unfinished, damaged."
)
@click.option(
    "--all", "everything", is_flag=True, help="With --clean: every export (each is made again when loaded)."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@log_level_option
@reports_errors
def cache_exports_cmd(clean: bool, everything: bool, as_json: bool) -> None:
    """This host's OpenVINO exports (--backend openvino), in the user's cache, not the store: per
    model, the OpenVINO release that made it, its size and state. An upgrade of OpenVINO or
    optimum-intel in this Python leaves the earlier exports stale (never read again by it); --clean
    removes those, the unfinished and the damaged. One made by an OpenVINO this Python lacks may be
    another installation's: only --all removes it."""
    if everything and not clean:
        raise ConfigError("--all removes every export: give it with --clean")
    if clean:
        removed = ov_exports.clean(everything)
        click.echo(f"removed {removed['exports']} export(s), {size_text(removed['bytes'])}")
        return
    entries = ov_exports.summary()
    if as_json:
        click.echo(json.dumps(entries, indent=2))
        return
    if not entries:
        click.echo(f"no OpenVINO exports in {exports_dir()}")
        return
    rows = [("EXPORT", "MODEL", "MADE WITH", "SIZE", "AGE", "STATE")]
    rows += [
        (
            e["export"][:12],
            e["model"],
            " ".join(f"{name} {release}" for name, release in e["made_with"].items()) or "-",
            size_text(e["bytes"]),
            age_text(e["age_seconds"]),
            e["state"],
        )
        for e in entries
    ]
    click.echo(table_text(rows))
    click.echo(f"in {exports_dir()}")
