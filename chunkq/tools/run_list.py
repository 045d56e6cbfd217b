"""The runs of a store, read from the store alone: ``chunkq runs`` and ``chunkq clean``.

A run's state comes from its files: a published result (whole or partial), a live owner (a
supervisor or ``chunkq run`` renews ``owner.json``), quarantined chunks recorded in ``failures/``,
or chunks still to do. Redis, when given, adds what only it knows: jobs queued or running.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import redis

from chunkq.jobs.contract import errors
from chunkq.jobs.contract.defaults import DEFAULT_CHUNK_SIZE
from chunkq.jobs.contract.errors import ChunkqError, ConfigError, DamagedRunError, StoreError
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import MANIFEST_NAME, RunLayout
from chunkq.jobs.contract.specs import EncodeOptions, chunk_job_id, chunk_job_prefix
from chunkq.jobs.contract.storage import is_local, remove_leftovers_beside, remove_tree
from chunkq.jobs.queue.enqueue import LIVE_STATUSES, job_statuses
from chunkq.supervisor.result.assemble import free_outputs
from chunkq.supervisor.result.planned_rows import corpus_rows_of, savings
from chunkq.supervisor.result.reader import result_problems
from chunkq.supervisor.store.attempts import failed_attempts
from chunkq.supervisor.store.store_lock import StoreLock

PUBLISHED, PARTIAL, DAMAGED, IN_FLIGHT, FAILED, QUARANTINED, INCOMPLETE, DAMAGED_RUN = (
    "published",
    "partial",
    "damaged result",
    "in flight",
    "failed",  # chunks quarantined for their input: the corpus must be fixed
    "quarantined",  # chunks quarantined for a cause outside the run: `chunkq supervise RUN` retries them
    "incomplete",
    "damaged manifest",  # the run cannot be read: `chunkq clean RUN` removes it
)


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    state: str
    rows: int
    rows_done: int
    chunks: int
    model: str
    created_at: str
    bytes: int  # what the run's folder takes in the store
    corpus: str = ""  # the first corpus file (its name), "+N" for more, and its format
    options: str = ""  # the encode options that differ from the defaults, "key=value" each
    cache: dict[str, Any] | None = None  # what the vector cache saved (planned_rows.savings)

    @property
    def age_seconds(self) -> float | None:
        try:
            return (datetime.now(UTC) - datetime.fromisoformat(self.created_at)).total_seconds()
        except ValueError:  # a manifest without its creation time (written by hand, or by a test)
            return None

    def to_json(self) -> dict[str, Any]:
        age = self.age_seconds
        return {**asdict(self), "age_seconds": None if age is None else round(age)}


def run_ids(store: Path) -> list[str]:
    runs = store / "runs"
    if not runs.is_dir():
        return []
    return sorted(p.name for p in runs.iterdir() if (p / MANIFEST_NAME).is_file())


def folder_bytes(path: Path) -> int:
    return bytes_below(path)[0]


def bytes_below(path: Path) -> tuple[int, int]:
    """The bytes of the files below ``path``, and of those the bytes a link outside it also holds
    (the vector cache links a result's shards), which deleting ``path`` leaves on the disk; the
    second is 0 on an object store."""
    if not is_local(path):
        fs = path.fs  # type: ignore[attr-defined]
        return int(fs.du(path.path, total=True)), 0  # type: ignore[attr-defined]
    total, folders = 0, [str(path)]
    linked: dict[tuple[int, int], list[int]] = {}  # (device, inode) -> [size, links, links below path]
    while folders:  # scandir's entries carry their type: one lstat a file, none a folder
        try:
            entries = os.scandir(folders.pop())
        except FileNotFoundError:
            continue
        with entries:
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                        continue
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                total += st.st_size
                if st.st_nlink > 1:
                    linked.setdefault((st.st_dev, st.st_ino), [st.st_size, st.st_nlink, 0])[2] += 1
    return total, sum(size for size, links, below in linked.values() if below < links)


def owner_of(layout: RunLayout) -> dict[str, Any] | None:
    """The live process that supervises the run (pid, host, since), or None."""
    return StoreLock(layout.owner, f"run {layout.run_id}").live_holder()


# A result up to this size is read whole against its checksums whenever a command looks at it
# (status, runs): ~0.3 s here. A larger one is checked by its files' headers and sizes there, and
# byte for byte by `assemble --verify` and every export.
LOOK_VERIFIES_BYTES = 256 << 20


def checked_at_a_look(layout: RunLayout) -> bool:
    """Whether a look at the run reads its result whole (see LOOK_VERIFIES_BYTES)."""
    return folder_bytes(layout.result) <= LOOK_VERIFIES_BYTES


def state_of(run: Run, checksums: bool | None = None, own: StoreLock | None = None) -> tuple[str, int]:
    """(state, rows done) from the store. A result is checked against its run and its files'
    headers and sizes (a truncated or missing shard shows), and with ``checksums`` byte for byte
    (None: where it is small enough, ``checked_at_a_look``). ``own``: the run's lock when the caller
    holds it (then no one else has the run in flight)."""
    layout, manifest, result = run.layout, run.manifest, run.result
    if checksums is None:
        checksums = result is not None and checked_at_a_look(layout)
    damaged = result is not None and bool(result_problems(run, checksums))
    if result is not None and not damaged:
        return (PUBLISHED if result.complete else PARTIAL), int(result.fields["rows"])
    done = layout.done_chunks(manifest.chunks)
    rows_done = corpus_rows_of(layout, manifest, done)
    if damaged:
        return DAMAGED, rows_done
    if not (own is not None and own.held) and owner_of(layout) is not None:
        return IN_FLIGHT, rows_done
    last: dict[int, str] = {}
    for attempt in failed_attempts(layout):  # oldest first: each chunk's latest attempt wins
        if attempt.chunk not in done:
            last[attempt.chunk] = attempt.error_class if attempt.quarantined else ""
    classes = {c for c in last.values() if c}
    if not classes:
        return INCOMPLETE, rows_done
    # Issue 53.3: a run whose quarantine a new supervisor lifts (a model allowed, a GPU fixed) is not
    # failed; one whose input is at fault is.
    return (FAILED if errors.BAD_INPUT in classes else QUARANTINED), rows_done


def describe_run(store: Path, run_id: str) -> RunInfo:
    run = Run.open(store, run_id)
    layout, manifest = run.layout, run.manifest
    state, rows_done = state_of(run)
    return RunInfo(
        run_id=run_id,
        state=state,
        rows=manifest.corpus_rows,  # the run's rows, as every command counts them
        rows_done=rows_done,
        chunks=manifest.chunks,
        model=str(manifest.data.get("model", "?")),
        created_at=str(manifest.data.get("created_at")),
        bytes=folder_bytes(layout.root),
        corpus=_corpus(manifest),
        options=_options(manifest),
        cache=savings(manifest.plan),
    )


def _corpus(manifest: RunManifest) -> str:
    inputs = manifest.data.get("inputs") or [manifest.data.get("corpus") or {}]
    name = str(inputs[0].get("path", "?")).rstrip("/").rsplit("/", 1)[-1]
    more = f" +{len(inputs) - 1}" if len(inputs) > 1 else ""
    fmt = (manifest.data.get("corpus") or {}).get("format")
    return f"{name}{more}" + (f" ({fmt})" if fmt else "")


def _options(manifest: RunManifest) -> str:
    """What sets this run apart from a run of the same corpus and model with the defaults."""
    defaults = EncodeOptions().to_dict()
    differ = {k: v for k, v in manifest.options.items() if defaults.get(k, None) != v}
    if manifest.chunk_size != DEFAULT_CHUNK_SIZE:
        differ["chunk_size"] = manifest.chunk_size
    long_texts = (manifest.data.get("identity") or {}).get("long_texts")
    if isinstance(long_texts, dict):  # --long-texts window|late, and how the windows were cut
        differ.pop("late_chunking", None)  # said by long_texts=late
        differ.update(
            {f"long_texts.{k}" if k != "mode" else "long_texts": v for k, v in long_texts.items() if v}
        )
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in sorted(differ.items()))


def chunks_done(store: Path) -> tuple[int, int, int]:
    """(chunks done, chunks, runs) over the store's runs: a published run's chunks are all done,
    another's are its committed outputs. What the dashboard's finished counts cannot show, since
    the supervisor deletes a finished job from Redis once the store holds its output."""
    done = total = runs = 0
    for run_id in run_ids(store):
        layout = RunLayout(store, run_id)
        try:
            manifest = load_manifest(layout)
        except (OSError, ValueError, ChunkqError):
            continue  # a run being submitted, or damaged: `chunkq runs` names it
        runs += 1
        total += manifest.chunks
        published = layout.result_manifest.is_file()
        done += manifest.chunks if published else len(layout.done_chunks(manifest.chunks))
    return done, total, runs


def list_runs(store: Path) -> list[RunInfo]:
    """Every run of the store, newest first; one whose manifest is damaged is listed as such, and
    never keeps the others from being listed."""
    return sorted((_listed(store, r) for r in run_ids(store)), key=lambda i: i.created_at, reverse=True)


def _listed(store: Path, run_id: str) -> RunInfo:
    try:
        return describe_run(store, run_id)
    except DamagedRunError:
        layout = RunLayout(store, run_id)
        written = datetime.fromtimestamp(layout.manifest.stat().st_mtime, UTC).isoformat()
        return RunInfo(run_id, DAMAGED_RUN, 0, 0, 0, "?", written, folder_bytes(layout.root))


def live_jobs(connection: redis.Redis, manifest: RunManifest) -> list[int]:
    """Chunks of the run that Redis holds as queued or running."""
    ids = [chunk_job_id(manifest.run_id, i) for i in range(manifest.chunks)]
    statuses = job_statuses(connection, ids)
    return [i for i, status in enumerate(statuses) if status in LIVE_STATUSES]


def live_jobs_named(connection: redis.Redis, run_id: str) -> list[str]:
    """Jobs of the run Redis holds as queued or running, found by name (the manifest that says how
    many chunks it has is damaged)."""
    prefix = f"rq:job:{chunk_job_prefix(run_id)}"
    ids = [key.decode()[len("rq:job:") :] for key in connection.scan_iter(match=f"{prefix}*", count=1000)]
    ids = [i for i in ids if ":" not in i]  # a job's hash, not its dependents' or results' keys
    return [
        i for i, status in zip(ids, job_statuses(connection, ids), strict=True) if status in LIVE_STATUSES
    ]


class Cleaned(NamedTuple):
    freed: int  # bytes the disk got back
    held: int  # bytes of the deleted files that links elsewhere in the store still hold


def clean(layout: RunLayout, outputs_only: bool, connection: redis.Redis | None = None) -> Cleaned:
    """Free a run's per-chunk outputs (``outputs_only``: only once its whole result is published)
    or delete the run; the bytes freed, and those the vector cache's links still hold. A run in
    flight is refused: its owner lock is taken for the duration, and with Redis, no job of the run
    may be queued or running."""
    try:
        manifest: RunManifest | None = load_manifest(layout)
    except DamagedRunError:
        if outputs_only:
            raise  # what is left of it cannot be checked against a result: the whole run goes
        manifest = None
    # The command that frees space must work on a full disk: the lock then is an empty file.
    again = f"run `chunkq clean {layout.run_id}` again once it has finished"  # clean has no --wait
    with StoreLock(layout.owner, f"run {layout.run_id}", blank_on_full_disk=True, wait_hint=again) as lock:
        lock.acquire()  # RunLockedError, naming the supervisor, while one watches the run
        if connection is not None:
            busy = live_jobs(connection, manifest) if manifest else live_jobs_named(connection, layout.run_id)
            if busy:
                raise ConfigError(
                    f"run {layout.run_id} is in flight: {len(busy)} chunk(s) are queued or running in "
                    "Redis; wait for it to finish (or stop its workers) and clean it then"
                )
        if not outputs_only or manifest is None:  # (outputs_only of a damaged run was refused above)
            total, held = bytes_below(layout.root)
            freed = total - held
            remove_tree(layout.root)  # the lock file goes with it: nobody can take the run meanwhile
            return Cleaned(freed, held)
        # Every byte of the result is checked first: its chunk outputs are what could rebuild it.
        state, _ = state_of(Run(layout, manifest), checksums=True, own=lock)
        if state != PUBLISHED:
            raise StoreError(
                f"run {layout.run_id} is {state}: its chunk outputs are all there is until a whole, "
                "intact result is published; `chunkq assemble RUN` (or the same run command) publishes "
                "one, then clean (or delete the whole run without --outputs-only)"
            )
        return Cleaned(_free_outputs(layout), 0)


def _free_outputs(layout: RunLayout) -> int:
    """Delete the chunk embeddings (.npy); their metadata stays, so ``report`` and ``status`` still
    tell the run's story, and a rerun sees the published result and does nothing. What a killed
    assembly left half-built goes too."""
    freed = 0
    if is_local(layout.root):
        before = folder_bytes(layout.root)
        remove_leftovers_beside(layout.result)
        freed += before - folder_bytes(layout.root)
    freed += free_outputs(layout)
    remove_tree(layout.damaged_outputs)
    return freed
