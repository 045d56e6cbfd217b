"""Shared helpers for the tests: corpora, CLI runs, bounded waits."""

from __future__ import annotations

import csv
import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.contract.run import Run
from chunkq.queue_worker.worker_args import WORKER_MODULE
from tests import warm_forks

WORDS = (
    "alpha beta gamma delta river mountain queue worker chunk embed vector model sentence graph cloud rain "
    "sun tree ocean lantern copper violet harbor meadow engine signal archive orbit"
).split()


CLI = [sys.executable, "-m", "chunkq.cli"]
WORKER = [sys.executable, "-m", WORKER_MODULE]


def make_texts(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """``n`` (ids, texts) of varied lengths, deterministic per seed."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choices(WORDS, k=rng.randint(2, 60))) for _ in range(n)]
    ids = [f"doc-{seed}-{i}" for i in range(n)]
    return ids, texts


def write_corpus(path: Path, ids: list[str], texts: list[str], fmt: str) -> Path:
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as fh:
            for rid, text in zip(ids, texts, strict=True):
                fh.write(json.dumps({"id": rid, "text": text}) + "\n")
    elif fmt == "csv":
        with open(path, "w", encoding="utf-8", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["id", "text"])
            writer.writerows(zip(ids, texts, strict=True))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": ids, "text": texts}), path, row_group_size=17)
    elif fmt == "txt":
        path.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    else:
        raise ValueError(fmt)
    return path


# cli_env(**CHUNKQS_OWN_THREADS): a command whose workers take the threads chunkq gives them (conftest.py
# sets one for the suite). Like CHUNKQ_LOG_LEVEL, these variables given as "" are left unset.
CHUNKQS_OWN_THREADS = {"OMP_NUM_THREADS": "", "MKL_NUM_THREADS": ""}
_UNSET_WHEN_EMPTY = {"CHUNKQ_LOG_LEVEL", *CHUNKQS_OWN_THREADS}


def cli_env(forks: bool = True, **extra: str) -> dict[str, str]:
    """The environment of a chunkq command in a test: offline, logging at INFO on the terminal
    (what most tests read; the tests of the quiet default pass CHUNKQ_LOG_LEVEL="" to drop it), and
    its workers forked by this test process's standing fork server (tests/warm_forks.py; pass
    CHUNKQ_FORK_SERVER_SOCKET="" for a pool's own). ``forks=False``: a command that starts no pool,
    which needs no server started for it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", CHUNKQ_LOG_LEVEL="INFO")
    env.pop("CHUNKQ_REDIS_URL", None)
    if forks and warm_forks.SOCKET_ENV not in extra and warm_forks.SOCKET_ENV not in env:
        env[warm_forks.SOCKET_ENV] = warm_forks.standing_socket()
    env.update(extra)
    return {k: v for k, v in env.items() if v != "" or k not in _UNSET_WHEN_EMPTY}


def _starts_a_pool(args: tuple[str, ...]) -> bool:
    """Whether the command is one that starts a pool (its subcommand, after --log-level's value)."""
    command = args[2:3] if args[:1] == ("--log-level",) else args[:1]
    return command in (("run",), ("pool",))


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 240, forks: bool | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """``chunkq ARGS``; ``forks=False``: a run or pool refused before it starts, which needs no
    standing fork server started for it (see cli_env)."""
    return subprocess.run(
        [*CLI, *args],
        cwd=cwd,
        env=cli_env(forks=_starts_a_pool(args) if forks is None else forks, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Wait until ``predicate()`` holds, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


def start_cli(log: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    """A long-running ``chunkq`` command in the background, its output in ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [*CLI, *args],
            env=cli_env(forks=_starts_a_pool(args), **env),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def family(pid: int) -> list[Any]:
    """Every process ``pid`` started (psutil.Process each, itself not included), with the workers a
    fork server forked for a pool among them: a standing one is no descendant, their title names
    their pool (worker_args.worker_title)."""
    import psutil

    try:
        tree = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    marks = [f"[pool {p}]" for p in (pid, *(c.pid for c in tree))]
    known = {c.pid for c in tree}
    for proc in psutil.process_iter():
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if proc.pid not in known and WORKER_MODULE in title and any(m in title for m in marks):
            tree.append(proc)
    return tree


def stop_tree(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process and everything it started (workers run in their own sessions)."""
    import psutil

    children = family(proc.pid)
    for p in children:
        try:
            p.kill()
        except psutil.Error:
            pass
    proc.kill()
    proc.wait(timeout=30)
    psutil.wait_procs(children, timeout=30)


def worker_processes(pool: subprocess.Popen[bytes]) -> list[Any]:
    """The live worker processes a pool has started (psutil.Process each), forked or not."""
    import psutil

    found = []
    for child in family(pool.pid):
        try:
            if WORKER_MODULE in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:  # exited between the listing and the look (a zombie not yet reaped)
            continue
    return found


@contextmanager
def signal_handlers_restored() -> Iterator[None]:
    """An in-process worker installs RQ's SIGTERM/SIGINT handlers; give pytest its own back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


@contextmanager
def stopped_when(predicate: Callable[[], bool], timeout: float, what: str) -> Iterator[None]:
    """Run the body (an in-process worker or pool) with this process sent SIGTERM, as a pool or
    batch system would, from a thread once ``predicate()`` holds; pytest's handlers come back after."""

    def stop() -> None:
        wait_for(predicate, timeout, what)
        os.kill(os.getpid(), signal.SIGTERM)

    helper = threading.Thread(target=stop, daemon=True)
    helper.start()
    try:
        with signal_handlers_restored():
            yield
    finally:
        helper.join(timeout=10)


def only_run(store: Path) -> Any:
    """The RunLayout of the one run in ``store``."""
    from chunkq.jobs.contract.run_files import RunLayout

    (run_dir,) = (store / "runs").iterdir()
    return RunLayout(store, run_dir.name)


def result_matches(layout: Any, texts: list[str], reference_model: Any) -> bool:
    """The published result equals a plain in-process encode of ``texts`` (CPU: within 1e-5)."""
    return max_abs_diff(np.load(layout.result / "embeddings.npy"), reference_model.encode(texts)) <= 1e-5


def failure_counts(store: Path, run_id: str, redis_url: str) -> dict[str, int]:
    """A run's failed attempts as each view counts them (issue 65.2, one truth for failures):
    `status --json`, `report`, the run queue's failed registry (the dashboard's) and `rq info`."""
    import re

    import redis
    from rq.registry import FailedJobRegistry
    from rq.serializers import JSONSerializer

    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout

    status = run_cli("status", run_id, "--store", str(store), "--json")
    report = run_cli("report", run_id, "--store", str(store))
    queue = load_manifest(RunLayout(store, run_id)).queue
    connection = redis.Redis.from_url(redis_url)
    registry = FailedJobRegistry(queue, connection=connection, serializer=JSONSerializer).count
    info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "-u", redis_url, "-S", "json", queue],
        capture_output=True, text=True, timeout=60, check=False, env=cli_env(forks=False),
    )  # fmt: skip
    said = re.search(r"(\d+) failed attempt\(s\)", report.stdout)
    listed = re.search(r"\b(\d+) failed\b", info.stdout)
    assert status.returncode == 0 and said and listed, (
        status.stderr + report.stdout + info.stdout + info.stderr
    )
    return {
        "status": len(json.loads(status.stdout)["failed_attempts"]),
        "report": int(said.group(1)),
        "registry": registry,
        "rq info": int(listed.group(1)),
    }


def start_run_with_a_slow_chunk(
    tmp_path: Path,
    seed: int,
    seconds: float,
    chunk: int = 0,
    store: Path | None = None,
    rows: int = 60,
    extra: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], Path, tuple[str, ...], list[str]]:
    """``chunkq run`` in the background over ``rows`` texts in chunks of 20 (and ``extra`` options),
    whose chunk ``chunk`` takes ``seconds`` longer on its first attempt; returns once that chunk has
    started: (process, its log, the run's arguments, the texts)."""
    ids, texts = make_texts(rows, seed=seed)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    args = ("run", str(corpus), "--chunk-size", "20", "--store", str(store or tmp_path / "store"), *extra)
    faults = json.dumps([{"kind": "slow", "chunks": [chunk], "attempts": [1], "seconds": seconds}])
    log = tmp_path / "run.log"
    proc = start_cli(log, *args, CHUNKQ_FAULTS=faults)
    try:
        # Taken (RQ logs the job's id) is not yet started: the fault says when the chunk runs.
        def started() -> bool:
            said = log.read_text(errors="replace")
            return f"__c{chunk:06d}" in said and "FAULT slow: this chunk takes" in said

        wait_for(started, 180, f"chunk {chunk} started")
    except BaseException:
        proc.kill()
        raise
    return proc, log, args, texts


def _write_manifest(
    store: Path,
    run_id: str,
    chunks: int,
    chunk_size: int,
    rows: int,
    options: Any = None,
    model: str | None = None,
) -> Any:
    """A run manifest as submit writes it (without Redis); the RunManifest."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.manifest import RunManifest
    from chunkq.jobs.contract.run_files import RunLayout, atomic_write_json
    from chunkq.jobs.contract.specs import EncodeOptions, fingerprint

    options = (options or EncodeOptions()).to_dict()
    model = model or BUNDLED_MODEL
    identity = {"model": model, "options": options, "chunk_size": chunk_size, "run_id": run_id}
    data = {
        "format_version": 1,
        "run_id": run_id,
        "fingerprint": fingerprint(identity),
        "identity": identity,
        "model": model,
        "options": options,
        "chunk_size": chunk_size,
        "rows": rows,
        "chunks": chunks,
        "queue": "default",
        "job_timeout": 600,
    }
    atomic_write_json(RunLayout(store, run_id).manifest, data)
    return RunManifest(data)


def write_test_run(
    store: Path, run_id: str, index: int, rows: int, seed: int, options: Any = None, model: str | None = None
) -> tuple[Any, list[str]]:
    """Chunk ``index`` of a run of ``rows``-row chunks, its input and a run manifest written as
    submit writes them (without Redis): (its ChunkSpec as the manifest says, its texts). The job
    refuses a spec that differs from the manifest, so job tests need one."""
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout, write_chunk_input

    ids, texts = make_texts(rows, seed=seed)
    layout = RunLayout(store, run_id)
    write_chunk_input(layout, index, list(zip(ids, texts, strict=True)))
    chunks = index + 1
    if layout.manifest.is_file():
        chunks = max(chunks, load_manifest(layout).chunks)
    manifest = _write_manifest(store, run_id, chunks, rows, chunks * rows, options, model)
    return manifest.chunk_spec(store, index), texts


def _finished_chunks(
    store: Path, run_id: str, rows: int, chunk_size: int, options: Any, texts: str = "text"
) -> Iterator[tuple[Any, int, int, dict[str, Any]]]:
    """A run's manifest, then each chunk's input (ids ``r0``, ``r1``...) as workers found it:
    (RunLayout, chunk index, rows, the metadata a worker writes with its output) per chunk."""
    from datetime import UTC, datetime

    from chunkq.jobs.contract.run_files import RunLayout, write_chunk_input

    chunks = -(-rows // chunk_size)
    manifest = _write_manifest(store, run_id, chunks, chunk_size, rows, options)
    layout = RunLayout(store, run_id)
    for index in range(chunks):
        first, n = manifest.first_row(index), manifest.chunk_rows(index)
        write_chunk_input(layout, index, [(f"r{i}", f"{texts} {i}") for i in range(first, first + n)])
        now = datetime.now(UTC).isoformat()
        meta = {"run_id": run_id, "chunk": index, "first_row": first, **manifest.producer()}
        meta |= {"worker": "w", "pid": 1, "host": "h", "device": "cpu", "seconds": 0.1}
        meta |= {"started_at": now, "finished_at": now}
        yield layout, index, n, meta


def write_encoded_run(
    store: Path,
    run_id: str,
    rows: int,
    chunk_size: int,
    dim: int,
    seed: int = 0,
    output_dtype: str = "float32",
    texts: str = "text",
) -> Any:
    """A finished run as workers leave it, without a model: the manifest, each chunk's input (ids
    ``r0``, ``r1``..., texts ``{texts} 0``...) and a committed output of random float32 rows that
    assembly accepts. Its RunLayout. For assembly and result tests of any size and dimension."""
    from chunkq.jobs.contract.run_files import RunLayout, write_output
    from chunkq.jobs.contract.specs import EncodeOptions

    rng = np.random.default_rng(seed)
    options = EncodeOptions(output_dtype=output_dtype)
    for layout, index, n, meta in _finished_chunks(store, run_id, rows, chunk_size, options, texts):
        vectors = rng.standard_normal((n, dim), dtype=np.float32)
        write_output(layout, index, vectors.astype(output_dtype), meta, output_dtype)
    return RunLayout(store, run_id)


def write_ragged_run(
    store: Path,
    kind: str,
    rows: int = 200,
    chunk_size: int = 20,
    seed: int = 0,
    entries: int | None = None,
    dim: int | None = None,
) -> Any:
    """A finished ragged run as workers leave it, without a model: rows of 0 to 12 random entries
    each, or ``entries`` (sparse: over ``dim`` or 1,000 dimensions; multivector: vectors of 8). Its
    RunLayout."""
    from chunkq.jobs.contract.ragged import SCHEMAS, Ragged, write_ragged_output
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.contract.specs import EncodeOptions

    run_id = f"{kind}-run"
    rng = np.random.default_rng(seed)
    dim = dim or {"sparse": 1000, "multivector": 8}[kind]
    for layout, index, n, meta in _finished_chunks(store, run_id, rows, chunk_size, EncodeOptions(kind=kind)):
        per_row = []
        for _ in range(n):
            k = int(rng.integers(0, 13)) if entries is None else entries
            if kind == "sparse":
                per_row.append({"indices": np.sort(rng.choice(dim, k, replace=False)).astype(np.int32),
                                "values": rng.random(k, dtype=np.float32)})  # fmt: skip
            else:
                per_row.append({"vectors": rng.standard_normal((k, dim), dtype=np.float32)})
        write_ragged_output(layout, index, Ragged.of_rows(per_row, SCHEMAS[kind], dim), meta, kind)
    return RunLayout(store, run_id)


def run_in_process(
    tmp_path: Path, store: Any, connection: Any, ids: list[str], texts: list[str], name: str, **kw: Any
) -> tuple[Any, Any, int]:
    """Submit ``texts`` as ``name``.jsonl, encode every chunk in this process with the real job
    function, assemble: (layout, manifest, rows a worker encoded, not read from the vector cache)."""
    from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.result.assemble import assemble
    from chunkq.supervisor.result.reader import check_published
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit

    corpus = write_corpus(tmp_path / f"{name}.jsonl", ids, texts, "jsonl")
    encode = kw.pop("encode", EncodeOptions())
    chunk_size = kw.pop("chunk_size", 10)
    model = kw.pop("model", BUNDLED_MODEL)
    request = SubmitRequest(
        corpus, store, model, CorpusOptions("jsonl"), chunk_size=chunk_size, encode=encode, **kw
    )
    layout = RunLayout(store, submit(request, connection).run_id)
    manifest = load_manifest(layout)
    encoded = 0
    for index in range(manifest.chunks):
        out = embed_chunk(manifest.chunk_spec(layout.store, index).to_dict())
        encoded += 0 if out["skipped"] else int(out["rows"])
    assemble(Run.of(layout))
    assert check_published(layout, manifest) == []
    return layout, manifest, encoded


def result_of(layout: Any) -> tuple[np.ndarray[Any, Any], list[str]]:
    """A published single-file result: (embeddings, ids), from a filesystem or an object store."""
    ids = [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()]
    return np.load(io.BytesIO((layout.result / "embeddings.npy").read_bytes()), allow_pickle=False), ids


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's -o size=) at ``mount``: a disk that fills. Skipped where mounting
    is not allowed, failed under CI (which runs as root)."""
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if made.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot mount a tmpfs under CI: {made.stderr}")
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}); CI runs this as root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` until ``leave`` bytes are free; the filler file, which frees it again."""
    filler = disk / "filler"
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(filler, "ab") as fh:
        fh.write(b"\0" * max(0, free - leave))
    return filler


def queued(connection: Any, pool_queue: str) -> int:
    """Jobs waiting for the pools of ``pool_queue``: in its runs' own queues (jobs/queue/run_queues.py)
    and in its own."""
    from chunkq.jobs.queue.enqueue import chunk_queue
    from chunkq.jobs.queue.run_queues import listed

    names = [name for name, _ in listed(connection, pool_queue)] + [pool_queue]
    return sum(chunk_queue(connection, name).count for name in names)
