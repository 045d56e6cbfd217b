"""What a ``chunkq run`` or ``submit`` asks for, built and checked before anything is started.

One builder for the command line and the Python API. Every check that can fail without touching
the store or Redis runs here — the corpus files exist, are readable, have a known format and a
valid first row; the model loads on this host without a network — so a failed check leaves no
files, no keys and no processes behind.
"""

from __future__ import annotations

import difflib
import glob
import logging
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import redis

from chunkq.jobs import kinds
from chunkq.jobs.compute import ov_backend
from chunkq.jobs.compute.model_info import check_options, describe
from chunkq.jobs.compute.model_refs import check_model, default_model
from chunkq.jobs.compute.models import check_precision
from chunkq.jobs.compute.ov_quantize import missing_quantized
from chunkq.jobs.contract.addresses import parse_redis, redis_port_zero, shown
from chunkq.jobs.contract.defaults import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_KIND,
    DEFAULT_PRECISION,
    DEFAULT_QUEUE,
    DEFAULT_SHARD_BYTES,
    STALE_AFTER_SECONDS,
    WARN_IDLE_SECONDS,
)
from chunkq.jobs.contract.errors import ChunksFailedError, ConfigError, CorpusError, StoreError
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.settings import PoolSettings
from chunkq.jobs.contract.specs import BATCH_TOKENS_OFF, INT8, OPENVINO, EncodeOptions
from chunkq.jobs.contract.storage import is_local, open_store
from chunkq.jobs.queue.redis_clients import connect
from chunkq.jobs.queue.run_queues import MAX_PRIORITY
from chunkq.queue_worker.devices.gpus import choose
from chunkq.supervisor.corpus.records import CorpusOptions, detect_format, read_corpus
from chunkq.supervisor.local_run import RunOutcome, RunRequest
from chunkq.supervisor.result.published import shard_bytes
from chunkq.supervisor.run_options import SUBMIT, WATCH, run_option_names
from chunkq.supervisor.submit.identity import SubmitRequest
from chunkq.supervisor.submit.windows import LONG_TEXTS, POOLS
from chunkq.supervisor.watch.retry import RetryPolicy
from chunkq.supervisor.watch.supervise import WatchSettings, failure_report

log = logging.getLogger(__name__)
_GLOB_CHARS = frozenset("*?[")
_ENCODE_NAMES = {"normalize": "normalize_embeddings"}  # the CLI's short name for a field
POOL_NAMES = frozenset(f.name for f in fields(PoolSettings))
WATCH_NAMES = run_option_names(WATCH)


def _matches(text: str) -> list[Path]:
    """The files a glob pattern names: on this machine, or in an object store (``s3://b/c/*.parquet``)."""
    where = open_store(text) if "://" in text else Path(text)
    if is_local(where):
        return sorted(Path(m) for m in glob.glob(text, recursive=True) if Path(m).is_file())
    remote: Any = where
    protocol = text.partition("://")[0]
    names = sorted(m for m in remote.fs.glob(remote.path) if remote.fs.isfile(m))
    return [open_store(f"{protocol}://{name}") for name in names]


def _identity_key(path: Path) -> str:
    return str(path.resolve()) if is_local(path) else str(path)


def _inside(path: Path, store: Path | None) -> bool:
    if store is None or not is_local(store) or not is_local(path):
        return False
    return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(store))


def expand_corpora(patterns: Sequence[str | Path], store: Path | None = None) -> tuple[Path, ...]:
    """The files named, with glob patterns expanded (sorted); a pattern that matches nothing, or a
    file named twice, is an error. A pattern may be an fsspec URL (``s3://b/c/*.parquet``): the
    corpus is then read where it is, streaming. What a pattern matches inside ``store`` is left out
    (``data/**/*.jsonl`` with the store in ``data/store`` matched its ledger's files); a file named
    there is refused."""
    if not patterns:
        raise CorpusError("no corpus given")
    found: list[Path] = []
    for pattern in patterns:
        text = str(pattern)
        path = open_store(text) if "://" in text else Path(text)
        if _GLOB_CHARS & set(text) and not path.exists():
            matches = _matches(text)
            kept = [m for m in matches if not _inside(m, store)]
            if not kept:
                inside = f" (only inside the store {store}, which is chunkq's)" if matches else ""
                raise CorpusError(f"{text}: no file matches this pattern{inside}")
            if len(kept) < len(matches):
                log.info("%s: %d file(s) inside the store %s left out", text, len(matches) - len(kept), store)
            found.extend(kept)
        else:
            if _inside(path, store):
                raise CorpusError(f"{text} is inside the store {store}, which is chunkq's; not a corpus")
            found.append(path)
    counts = Counter(_identity_key(p) for p in found)
    twice = sorted({str(p) for p in found if counts[_identity_key(p)] > 1})
    if twice:
        raise CorpusError(f"{', '.join(twice)}: named more than once")
    return tuple(found)


def check_corpora(paths: Sequence[Path], options: CorpusOptions) -> None:
    """Each file exists, is readable, and its first record has the fields the run needs: its head
    is read, nothing more."""
    for path in paths:
        next(iter(read_corpus(path, options)), None)


def positive_int(name: str, value: Any) -> int:
    """``value`` if it is a positive integer; else a ConfigError naming the option (from the API,
    ``chunk_size="5"`` would otherwise fail as a bare TypeError deep inside)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def corpus_format(paths: Sequence[Path], given: str | None) -> str:
    formats = {detect_format(path, given) for path in paths}
    if len(formats) > 1:
        raise CorpusError(
            f"the corpus files have different formats ({', '.join(sorted(formats))}); "
            "one run reads one format: convert them, or run each format on its own"
        )
    return formats.pop()


ENCODE_NAMES = frozenset({f.name for f in fields(EncodeOptions)} | set(_ENCODE_NAMES))


def encode_options_of(encode: dict[str, Any]) -> EncodeOptions:
    """EncodeOptions from keywords as the API and submit take them (``normalize`` too; None: default).
    A batch size given without a token budget is what the user wants on a GPU too: batches by count
    (``--batch-tokens off``), where the GPU's default is a budget (``token_batches.for_device``)."""
    given = {_ENCODE_NAMES.get(k, k): v for k, v in encode.items() if v is not None}
    if "batch_size" in given and "batch_tokens" not in given:
        given["batch_tokens"] = BATCH_TOKENS_OFF
    return EncodeOptions(**given)


def encode_options_for(model: str, encode: dict[str, Any]) -> EncodeOptions:
    """EncodeOptions for ``model``, checked against its files; the kind, when not given, is what its
    files say (``chunkq model`` shows it)."""
    options = encode_options_of(encode)
    info = describe(model, options.revision)
    if encode.get("kind") is None:
        options = replace(options, kind=info.kind)
    kinds.check_options(options)
    check_options(info, options)
    if options.precision == INT8 and (why := missing_quantized(info.folder, model)) is not None:
        raise ConfigError(why)  # said here, not by each worker's load
    return options


def check_kind(options: EncodeOptions, corpus: CorpusOptions, long_texts: str) -> None:
    """A cross-encoder reads pairs, and only it does; windows are for texts that are vectors."""
    pairs = kinds.get(options.kind).pairs
    if pairs != (corpus.pair_field is not None):
        raise ConfigError(
            "a cross-encoder scores pairs: give --pair-field (the passage beside --text-field)"
            if pairs
            else f"--pair-field is for a cross-encoder (--kind cross); this model's kind is {options.kind}"
        )
    if options.kind != DEFAULT_KIND and long_texts != LONG_TEXTS[0]:
        raise ConfigError(
            f"--long-texts {long_texts} is for dense models; this model's kind is {options.kind}"
        )
    if options.backend == OPENVINO:
        if long_texts == LONG_TEXTS[-1]:
            raise ConfigError(
                "--backend openvino gives no token vectors for --long-texts late; leave one out"
            )
        ov_backend.require()  # here, before the run starts, not in each worker


def submit_request(
    corpora: Sequence[str | Path],
    store: Path,
    model: str | None = None,
    *,
    fmt: str | None = None,
    text_field: str = CorpusOptions.text_field,
    id_field: str = CorpusOptions.id_field,
    pair_field: str | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    run_id: str | None = None,
    queue: str = DEFAULT_QUEUE,
    priority: int | None = None,
    job_timeout: int | None = None,
    queue_window: int | None = None,
    cache: bool | None = None,
    long_texts: str = LONG_TEXTS[0],
    window_tokens: int | None = None,
    window_stride: int | None = None,
    pool: str = POOLS[0],
    accept_unidentified_code: bool = False,
    **encode: Any,
) -> SubmitRequest:
    """A checked SubmitRequest; ``encode`` takes EncodeOptions' fields (``normalize`` too)."""
    paths = expand_corpora(corpora, store)
    options = CorpusOptions(
        format=corpus_format(paths, fmt), text_field=text_field, id_field=id_field, pair_field=pair_field
    )
    check_corpora(paths, options)
    positive_int("chunk_size", chunk_size)
    if job_timeout is not None:
        positive_int("job_timeout", job_timeout)
    if priority is not None and not 1 <= priority <= MAX_PRIORITY:
        raise ConfigError(f"--priority {priority}: from 1 to {MAX_PRIORITY}")
    if long_texts not in LONG_TEXTS:
        raise ConfigError(f"long_texts {long_texts!r}: one of {', '.join(LONG_TEXTS)}")
    if pool not in POOLS or (pool != POOLS[0] and long_texts == LONG_TEXTS[0]):
        raise ConfigError(
            f"pool {pool!r}: one of {', '.join(POOLS)}, and only with --long-texts window or late"
        )
    for name, value in (("window_tokens", window_tokens), ("window_stride", window_stride)):
        if value is not None and long_texts == LONG_TEXTS[0]:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} is for --long-texts window or late; without it texts are truncated")
    model = check_model(model) if model else default_model()
    encode_options = encode_options_for(model, encode)
    check_kind(encode_options, options, long_texts)
    if encode_options.allow_missing and pool != POOLS[0]:
        raise ConfigError(
            f"--allow-missing with --pool {pool}: a text whose windows are all left out would have no "
            "vector of its own; leave --pool out, or drop the rows a run without --allow-missing names"
        )
    if accept_unidentified_code and not encode_options.trust_remote_code:
        raise ConfigError("--accept-unidentified-code is for a model run with --trust-remote-code")
    if accept_unidentified_code and cache:
        raise ConfigError(
            "--cache with --accept-unidentified-code: code chunkq cannot identify is not in the cache's "
            "key, so such a run neither reads nor fills the cache; leave --cache out"
        )
    return SubmitRequest(
        corpus=paths[0] if len(paths) == 1 else paths,
        store=store,
        model=model,
        corpus_options=options,
        chunk_size=chunk_size,
        encode=encode_options,
        run_id=run_id,
        queue=queue,
        priority=priority,
        job_timeout=job_timeout,
        queue_window=queue_window,
        cache=cache,
        long_texts=long_texts,
        window_tokens=window_tokens,
        window_stride=window_stride,
        pool=pool,
        accept_unidentified_code=accept_unidentified_code,
    )


def watch_settings(
    poll: float = WatchSettings.poll_seconds,
    max_attempts: int = RetryPolicy.max_attempts,
    allow_partial: bool = False,
    metrics_port: int | None = None,
    wait: bool = False,
    warn_idle: float = WARN_IDLE_SECONDS,
    stale_after: float = STALE_AFTER_SECONDS,
    queue_window: int | None = None,
    shard_size: int | str = DEFAULT_SHARD_BYTES,
    keep_outputs: bool = False,
) -> WatchSettings:
    return WatchSettings(
        poll_seconds=poll,
        policy=RetryPolicy(max_attempts=max_attempts),
        allow_partial=allow_partial,
        metrics_port=metrics_port,
        wait_for_owner=wait,
        warn_idle=warn_idle,
        stale_after=stale_after,
        window=None if queue_window is None else positive_int("queue_window", queue_window),
        shard_bytes=shard_bytes(shard_size),
        keep_outputs=keep_outputs,
    )


# What chunkq run decides for its pool itself, from its own options and its embedded Redis.
RUN_DECIDES_FOR_THE_POOL = (
    "queue",
    "store",
    "preload",
    "precision",
    "name",
    "metrics_port",
    "allowed_models",
    "trust_remote_code",  # from the run's own --trust-remote-code
)
# The run's submit options, its queue (every command's --queue), EncodeOptions' own field names and
# "format", which the API takes for the CLI's fmt.
_SUBMIT_NAMES = run_option_names(SUBMIT) | {"queue", "format"} | {f.name for f in fields(EncodeOptions)}
RUN_NAMES = _SUBMIT_NAMES | WATCH_NAMES  # with the pool's: every keyword chunkq.run takes
_POOL_NAMES = POOL_NAMES - {*RUN_DECIDES_FOR_THE_POOL, "redis_url", "log_level"}


def _with_a_guess(name: str, known: list[str]) -> str:
    """``name``, and the option meant where one is close (chunksize: chunk_size), as the CLI says."""
    close = difflib.get_close_matches(name, known, n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name


def build_run_request(
    corpora: Sequence[str | Path], *, store: Path, redis_url: str | None = None, **options: Any
) -> RunRequest:
    """A checked RunRequest from ``chunkq run``'s options by their Python names."""

    def take(names: frozenset[str]) -> dict[str, Any]:
        return {k: options.pop(k) for k in list(options) if k in names}

    watch, submit, pool = take(WATCH_NAMES), take(_SUBMIT_NAMES), take(_POOL_NAMES)
    if options:
        known = sorted(RUN_NAMES | _POOL_NAMES | {"store", "redis_url"})
        named = [_with_a_guess(name, known) for name in sorted(options)]
        raise ConfigError(f"unknown option(s): {', '.join(named)}")
    if "format" in submit:
        submit["fmt"] = submit.pop("format")
    settings = watch_settings(**watch)
    request = replace(submit_request(corpora, store, **submit), queue_window=settings.window)
    metrics_port = watch.get("metrics_port")  # the run's; its pool's on the next port (docs/operations.md)
    pool["metrics_port"] = None if metrics_port is None else (metrics_port + 1 if metrics_port else 0)
    if metrics_port:
        check_metrics_ports(metrics_port)
    pool_settings = replace(PoolSettings(), **{k: v for k, v in pool.items() if v is not None})
    # The devices its pool will use, or why it cannot use the host's GPUs: said now, and handed to
    # the pool rather than surveyed again there.
    devices = choose(pool_settings.gpus, pool_settings.min_free_memory, pool_settings.busy_gpus)
    encode = request.encode
    if encode.backend == OPENVINO:  # its workers must be CPU workers
        check_precision(encode.precision, "cuda" if devices else "cpu", encode.backend)
    elif encode.precision != DEFAULT_PRECISION and not devices:
        check_precision(encode.precision, "cpu")
    if redis_url:
        reach_redis(redis_url)
    return RunRequest(
        submit=replace(request, calibrate_on=devices[0].uuid if devices else ""),
        redis_url=redis_url,
        pool=pool_settings,
        devices=tuple(devices),
        watch=settings,
    )


def check_metrics_ports(port: int) -> None:
    """``chunkq run --metrics-port P`` serves the run's metrics on P and its pool's on P+1: both must
    be free before anything starts."""
    from chunkq.queue_worker.processes.metrics import check_listenable

    if port >= 65535:
        raise ConfigError(
            f"--metrics-port {port}: chunkq run serves its pool's metrics on the next port, {port + 1}, "
            "past the last one (65535); give 65534 or less, or 0 for any free ports"
        )
    check_listenable(port)
    try:
        check_listenable(port + 1)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (chunkq run serves its pool's metrics on --metrics-port + 1)") from None


def check_redis_url(url: str) -> None:
    """ConfigError, in one line without the password, for a URL Redis's client cannot read (a
    password's "/" or "@" not percent-encoded makes its rest a port: ``Port could not be cast``)."""
    if parse_redis(url) is None:  # its client's own message would quote the part it could not read
        raise ConfigError(
            "the Redis address given is not a URL Redis can read (not shown: it may hold a password); write "
            "it redis://USER:PASSWORD@HOST:PORT/DB with the password's special characters "
            "percent-encoded (/ as %2F, @ as %40, : as %3A, # as %23, ? as %3F, % as %25, a space as %20), "
            "and only the query parameters its client takes (db, socket_timeout, ...)"
        )
    if redis_port_zero(url):  # its client reads port 0 as none, and connects to 6379: another server
        raise ConfigError(
            f"{shown(url)}: port 0 is no Redis server's port (its client would connect to 6379 instead); "
            "give the port the server listens on, or leave --redis-url out to use the store's own Redis"
        )


def reach_redis(url: str) -> redis.Redis:
    """A connection that has answered a PING: a run or submit that cannot reach Redis stops before
    it writes anything."""
    check_redis_url(url)
    connection = connect(url)
    connection.ping()
    return connection


def finished_result(outcome: RunOutcome, request: RunRequest) -> dict[str, Any]:
    """The published result manifest of a run that ``supervisor.local_run.run`` returned, or the error."""
    if outcome.outcome is None:
        published = Run.open(request.submit.store, outcome.submitted.run_id).result
        if published is None or published.unreadable:
            raise StoreError(f"run {outcome.submitted.run_id}: no readable result is published")
        return dict(published.fields)
    watched = outcome.outcome
    if watched.quarantined and not watched.partial:
        raise ChunksFailedError(failure_report(watched.quarantined, watched.snapshot.run_id))
    if watched.result is None:
        why = "the worker pool exited" if outcome.pool_died else "it stopped"
        if outcome.pool_said:
            why += f" ({outcome.pool_said})"
        if outcome.forgotten:
            why += "; nothing was done, so the run is not kept,"
        raise ChunksFailedError(f"run {outcome.submitted.run_id}: {why} before the run finished")
    return watched.result
