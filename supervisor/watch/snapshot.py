"""Where a run stands at one look: the ``Snapshot`` the tracker fills from Redis and the store,
or ``store_snapshot`` from the store alone (``chunkq status`` without Redis), and the rate and time
left that both derive the same way.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout
from chunkq.jobs.contract.specs import chunk_job_id
from chunkq.supervisor.result.assemble import Failure
from chunkq.supervisor.result.planned_rows import corpus_rows_of, savings
from chunkq.supervisor.store.attempts import FailedAttempt, failed_attempts
from chunkq.supervisor.store.ledger import throughput_of
from chunkq.supervisor.store.store_lock import StoreLock
from chunkq.supervisor.store.throughput import Throughput


@dataclass
class Snapshot:
    """One look at a run; ``to_json`` is what ``chunkq status --json`` prints."""

    run_id: str
    chunks: int
    rows: int  # the rows its chunks hold (distinct texts): what is encoded, what the rate counts
    chunks_done: int = 0
    rows_done: int = 0  # in published chunk outputs
    rows_encoding: int = 0  # encoded by running chunks, not yet published (their workers' reports)
    encoding_since: float | None = None  # epoch seconds the earliest running chunk started encoding
    chunks_queued: int = 0
    chunks_running: int = 0
    chunks_retrying: int = 0
    chunks_quarantined: int = 0
    chunks_waiting: int = 0  # in the store, not yet in Redis: queued in order as the window frees
    lost: list[int] = field(default_factory=list)  # had a job in Redis, now neither a job nor an output
    stale: list[int] = field(default_factory=list)
    gone: dict[int, str] = field(default_factory=dict)  # running, their worker and its pool gone: why
    stranded: list[int] = field(default_factory=list)  # dequeued by a worker that died before starting it
    unlisted: list[int] = field(
        default_factory=list
    )  # queued by their job, in no queue list (a deleted list)
    failures: list[Failure] = field(default_factory=list)
    rows_per_second: float | None = None
    eta_seconds: float | None = None
    device_busy: dict[str, Any] | None = None  # how busy the chunks kept their devices (compute/device_busy)
    result_published: bool = False
    live: bool = True  # False: read from the store alone, so what runs and what waits is unknown
    # The run's rows as every command shows them: its result's (its corpus's, or its windows),
    # duplicates and texts from the vector cache included; done: those its finished chunks give.
    corpus_rows: int = 0  # 0: as its chunks' rows (a run without duplicates, cache hits or windows)
    corpus_rows_done: int = 0

    def __post_init__(self) -> None:
        self.corpus_rows = self.corpus_rows or self.rows

    queue: str = ""
    idle_seconds: float | None = None  # chunks wait and no worker has taken one for this long (warn_idle+)
    starting: bool = False  # chunks wait, none has started yet, and it is not yet worth a warning
    own_pool_seconds: float | None = None  # chunkq started the pool itself, this long ago (run, the API)
    owned: bool = True  # a process supervises the run (False: stopped; nothing happens until resumed)
    cache: dict[str, Any] | None = None  # what the vector cache saved (planned_rows.savings); None: not used

    @property
    def settled(self) -> bool:
        """Every chunk is either done or quarantined: nothing more will happen by itself."""
        return self.chunks_done + self.chunks_quarantined == self.chunks

    @property
    def quarantined(self) -> list[Failure]:
        return [f for f in self.failures if f.quarantined]

    def to_json(self) -> dict[str, Any]:
        """``status --json``: ``rows`` and ``rows_done`` are the run's rows as every command counts
        them (its corpus's, or its windows); ``chunk_rows`` and ``chunk_rows_done`` what its chunks
        hold, the distinct texts encoded or read from the cache (``rows`` said 494 of a
        500-row run with 6 repeated texts)."""
        data = asdict(self)
        data["chunk_rows"], data["chunk_rows_done"] = data.pop("rows"), data.pop("rows_done")
        data["chunk_rows_encoding"] = data.pop("rows_encoding")
        data["rows"], data["rows_done"] = self.corpus_rows, self.corpus_rows_done
        data["settled"] = self.settled
        return data


def set_rate(snap: Snapshot, throughput: Throughput, watching_since: datetime | None = None) -> None:
    """The run's rows/s (supervisor.store.throughput) and, while chunks remain and it runs, the time they
    will take. A stopped run's rate is the rate while it ran, not one that falls while nothing runs.
    Rows the running chunks have encoded count, so the rate does not fall between two chunks.
    ``watching_since``: when the run's owner began to watch it (a resumed run's time starts there)."""
    going = not snap.settled and snap.owned
    since = None if snap.encoding_since is None else datetime.fromtimestamp(snap.encoding_since, UTC)
    snap.rows_per_second = throughput.rows_per_second(
        running=going,
        encoding=snap.rows_encoding if going else 0,
        resumed_at=since,
        watching_since=watching_since,
    )
    snap.device_busy = throughput.busy.figure()
    if snap.rows_per_second and going:
        left = max(snap.rows - snap.rows_done - snap.rows_encoding, 0)
        snap.eta_seconds = left / snap.rows_per_second


def store_snapshot(layout: RunLayout, manifest: RunManifest) -> Snapshot:
    """Where a run stands from the store alone, as ``chunkq status`` shows it without Redis: the
    chunks done and their rate, the failures recorded and the chunks quarantined."""
    snap = Snapshot(manifest.run_id, manifest.chunks, manifest.rows, live=False, cache=savings(manifest.plan))
    snap.owned = StoreLock(layout.owner, "").live_holder() is not None
    done = layout.done_chunks(manifest.chunks)
    snap.rows_done = manifest.rows_of(done)
    snap.corpus_rows, snap.corpus_rows_done = manifest.corpus_rows, corpus_rows_of(layout, manifest, done)
    throughput = throughput_of(layout, manifest, done)
    snap.chunks_done = len(done)
    last: dict[int, FailedAttempt] = {}
    for attempt in failed_attempts(layout):
        if attempt.chunk not in done:
            last[attempt.chunk] = attempt
    snap.failures = [
        Failure(
            chunk=a.chunk,
            first_row=manifest.first_row(a.chunk),
            rows=manifest.chunk_rows(a.chunk),
            job_id=chunk_job_id(manifest.run_id, a.chunk),
            error_class=a.error_class,
            attempt=a.attempt,
            error=a.error,
            traceback="",
            quarantined=a.quarantined,
            reason=a.reason,
            label=manifest.chunk_label(a.chunk),
        )
        for a in sorted(last.values(), key=lambda a: a.chunk)
    ]
    snap.chunks_quarantined = len(snap.quarantined)
    snap.chunks_retrying = len(snap.failures) - snap.chunks_quarantined
    snap.result_published = layout.result_manifest.is_file()
    set_rate(snap, throughput)
    return snap
