"""Where a run stands: chunk states from the store (the truth) and from Redis (the queue)."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, cast

import redis

from chunkq.jobs.compute import chunk_progress
from chunkq.jobs.contract.defaults import HEARTBEAT_SECONDS, STALE_AFTER_SECONDS
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import chunk_job_id, chunk_job_prefix
from chunkq.jobs.queue import jobmeta, worker_place
from chunkq.jobs.queue.enqueue import QUEUED_STATUSES, job_statuses
from chunkq.jobs.queue.queue_lists import ChunkQueueLists
from chunkq.supervisor.result.assemble import Failure
from chunkq.supervisor.result.planned_rows import corpus_rows_per_chunk, savings
from chunkq.supervisor.store.chunk_set import ChunkSet
from chunkq.supervisor.store.ledger import Ledger, throughput_of
from chunkq.supervisor.store.throughput import Throughput
from chunkq.supervisor.watch.snapshot import Snapshot, set_rate

if TYPE_CHECKING:
    from chunkq.jobs.queue.rq_api import Job

STRANDED_SECONDS = 10.0  # a live worker starts what it dequeued within milliseconds
CURSOR_MARGIN_SECONDS = 300.0
MIN_RECONCILE_SECONDS = 0.0  # small runs reconcile on every look: it costs a millisecond
RECONCILE_COST_FACTOR = 50.0  # a full reconcile takes at most ~2% of the supervisor's time


def _failure(job: Job, index: int, manifest: RunManifest) -> Failure:
    meta = job.meta
    try:
        result = job.latest_result()
        text = str((result.exc_string if result is not None else None) or job.exc_info or "")
    except Exception as exc:  # a job we cannot fully read still counts as failed
        text = f"(traceback unavailable: {exc})"
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return Failure(
        chunk=index,
        first_row=manifest.first_row(index),
        rows=manifest.chunk_rows(index),
        job_id=job.id,
        error_class=jobmeta.error_class(meta),
        attempt=jobmeta.attempt(meta),
        error=str(meta.get(jobmeta.ERROR) or (lines[-1] if lines else "(no traceback recorded)")),
        traceback=text,
        quarantined=jobmeta.quarantined(meta),
        reason=str(meta.get(jobmeta.QUARANTINE_REASON, "")),
        label=manifest.chunk_label(index),
    )


class Tracker:
    """Polls a run; a look costs what changed since the last one, not the run's size.

    Most looks are incremental: they read what RQ's finished and failed registries gained since the
    last look, the started registry and the intermediate list (bounded by the workers), and the
    statuses of chunks already known to have failed. A full reconcile (the store's listing and the
    status of every pending chunk) catches what no registry records, such as a job whose hash
    vanished; it runs on the first look and then at an interval that grows with its own measured
    cost, so its amortised share of a look stays flat at any run size.
    """

    def __init__(
        self,
        connection: redis.Redis,
        layout: RunLayout,
        manifest: RunManifest,
        min_reconcile_seconds: float = MIN_RECONCILE_SECONDS,
        records: bool = True,
        stale_after: float = STALE_AFTER_SECONDS,
    ) -> None:
        """``records``: the run's owner records finished chunks in the ledger; a one-off look
        (``chunkq status``) does not, and reads the rate from the summary instead of the ledger."""
        self.connection, self.layout, self.manifest = connection, layout, manifest
        self.min_reconcile_seconds = min_reconcile_seconds
        self.stale_after = stale_after
        self.pending = ChunkSet(manifest.chunks, full=True)
        self.rows_done = 0
        self.corpus_rows_done = 0
        self._corpus_counts = corpus_rows_per_chunk(layout, manifest)  # None: a chunk's rows are its own
        # What earlier looks recorded: their outputs are not read again.
        self.ledger = Ledger.open(layout, manifest) if records else None
        # The owner's looks began now: a stop before them is no part of the run's time (the rate).
        self.watching_since = datetime.now(UTC) if records else None
        self.failed_jobs: dict[int, Job] = {}
        self.in_redis: set[int] = set()  # pending chunks with a job in Redis, as far as the looks know
        self.waiting = ChunkSet()  # pending chunks with no job: the window queues the lowest next
        self.finished_jobs: list[str] = []  # jobs whose outputs this look counted: Redis may forget them
        self.full_looks = 0
        self._looked = False
        self._prefix = chunk_job_prefix(manifest.run_id)
        self._lists = ChunkQueueLists(connection, manifest.queue)
        self._finished_key = self._lists.finished_key
        self._failed_key = self._lists.failed_key
        self._cursors: dict[str, float] = {}
        self._failed: set[int] = set()
        self._unlisted_before: set[int] = set()  # found in no list by the last full look
        self._next_full = 0.0
        self._counted: list[int] = []  # chunks counted done since the last look: their reports go

    @property
    def throughput(self) -> Throughput:
        if self.ledger is None:
            return throughput_of(self.layout, self.manifest, _DoneChunks(self.pending, self.manifest.chunks))
        return self.ledger.throughput

    def _mark_done(self, indices: Iterable[int]) -> None:
        for index in indices:
            self._counted.append(index)
            self.pending.discard(index)
            self.in_redis.discard(index)
            self.rows_done += self.manifest.chunk_rows(index)
            self.corpus_rows_done += self._corpus_rows(index)
            if self.ledger is not None and index not in self.ledger.recorded:
                try:
                    self.ledger.add(read_json(self.layout.output_meta(index)))
                except (OSError, ValueError):
                    pass  # a damaged output is the assembler's to name; the rate does without it

    def reopen(self, indices: Iterable[int]) -> None:
        """Chunks counted done whose outputs were found damaged (and set aside): to be queued again."""
        for index in indices:
            if index in self.pending:
                continue
            self.pending.add(index)
            self.waiting.add(index)
            self.rows_done -= self.manifest.chunk_rows(index)
            self.corpus_rows_done -= self._corpus_rows(index)

    def _corpus_rows(self, index: int) -> int:
        counts = self._corpus_counts
        return int(counts[index]) if counts is not None else self.manifest.chunk_rows(index)

    def _job_id(self, index: int) -> str:
        return chunk_job_id(self.manifest.run_id, index)

    def _index(self, job_id: str) -> int | None:
        """The chunk index of one of this run's job ids, else None (queues may be shared by runs)."""
        tail = job_id[len(self._prefix) :]
        return int(tail) if job_id.startswith(self._prefix) and tail.isdigit() else None

    def _run_indices(self, job_ids: Iterable[bytes | str]) -> set[int]:
        found = set()
        for raw in job_ids:
            index = self._index(raw.decode() if isinstance(raw, bytes) else raw)
            if index is not None:
                found.add(index)
        return found

    def _pending_indices(self, job_ids: Iterable[bytes | str]) -> set[int]:
        return {i for i in self._run_indices(job_ids) if i in self.pending}

    def _forget(self, finished: set[int]) -> None:
        """Finished jobs whose outputs are counted: the supervisor deletes them from Redis."""
        self.finished_jobs += [self._job_id(i) for i in sorted(finished) if i not in self.pending]

    def _forget_failed_of_done(self, job_ids: Iterable[bytes | str]) -> None:
        """Jobs in the failed registry whose chunks are counted done: deleted with the finished."""
        self.finished_jobs += [
            self._job_id(i) for i in sorted(self._run_indices(job_ids)) if i not in self.pending
        ]

    def take_finished(self) -> list[str]:
        """The finished jobs counted since the last call, for the supervisor to delete from Redis."""
        taken, self.finished_jobs = self.finished_jobs, []
        return taken

    def take_waiting(self, room: int) -> list[int]:
        """The next ``room`` waiting chunks, in chunk order, as the supervisor queues them."""
        taken = self.waiting.take_lowest(room)
        self.in_redis.update(taken)
        return taken

    def poll(self, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        snap = Snapshot(
            self.manifest.run_id,
            self.manifest.chunks,
            self.manifest.rows,
            queue=self.manifest.pool_queue,
            cache=savings(self.manifest.plan),
        )
        if now >= self._next_full:
            started = time.monotonic()
            running, failed = self._full_look(snap)
            self.full_looks += 1
            self._next_full = now + max(
                self.min_reconcile_seconds, RECONCILE_COST_FACTOR * (time.monotonic() - started)
            )
        else:
            running, failed = self._incremental_look(snap)
        snap.chunks_running = len(running)
        snap.stale, silent = self._stale(sorted(running))
        # The first look checks every running chunk: a rerun meets the chunks its killed run had in hand.
        snap.gone = self._gone(silent if self._looked else sorted(set(running) - set(snap.stale)))
        self._looked = True
        counted, self._counted = self._counted, []
        if self.ledger is not None:  # the run's owner; a one-off look (chunkq status) writes nothing
            chunk_progress.forget(self.connection, self.manifest.run_id, counted)
        self._read_encoding(snap, sorted(running))
        self.failed_jobs = self._fetch(sorted(failed))
        snap.failures = [_failure(job, i, self.manifest) for i, job in sorted(self.failed_jobs.items())]
        snap.chunks_quarantined = len(snap.quarantined)
        snap.chunks_retrying = len(snap.failures) - snap.chunks_quarantined
        snap.chunks_done = self.manifest.chunks - len(self.pending)
        snap.chunks_waiting = len(self.waiting)
        snap.rows_done = self.rows_done
        snap.corpus_rows, snap.corpus_rows_done = self.manifest.corpus_rows, self.corpus_rows_done
        snap.result_published = self.layout.result_manifest.is_file()
        set_rate(snap, self.throughput, self.watching_since)
        return snap

    def _read_encoding(self, snap: Snapshot, running: list[int]) -> None:
        """Rows the running chunks have encoded so far (compute/chunk_progress), each at most its chunk's."""
        try:
            reports = chunk_progress.read(self.connection, self.manifest.run_id, running)
        except redis.ResponseError:  # the key is not a hash: written by someone else, so no report
            return
        snap.rows_encoding = sum(min(r.rows, self.manifest.chunk_rows(i)) for i, r in reports.items())
        snap.encoding_since = min((r.started for r in reports.values()), default=None)

    def _registry_tail(self, key: str) -> list[bytes]:
        """Members a registry gained since the last look (scores are now + a fixed TTL, so they grow
        with time); read from a margin before the last score seen, for clock skew between hosts."""
        since = self._cursors.get(key, 0.0) - CURSOR_MARGIN_SECONDS
        members = cast(
            list[tuple[bytes, float]], self.connection.zrangebyscore(key, since, "+inf", withscores=True)
        )
        if members:
            self._cursors[key] = max(self._cursors.get(key, 0.0), max(score for _, score in members))
        return [member for member, _ in members]

    def _set_cursors(self) -> None:
        for key in (self._finished_key, self._failed_key):
            last = cast(list[tuple[bytes, float]], self.connection.zrevrange(key, 0, 0, withscores=True))
            self._cursors[key] = last[0][1] if last else 0.0

    def _full_look(self, snap: Snapshot) -> tuple[set[int], set[int]]:
        finished = self._run_indices(self._registry_tail(self._finished_key))  # to forget, once counted
        self._set_cursors()  # before the scan: whatever lands during it is read by the next look
        done = [i for i in self.layout.done_indices(self.manifest.chunks) if i in self.pending]
        self._mark_done(done)
        # A job marked failed whose output is in the store (its worker lost Redis as it finished)
        # counts as done: it goes from RQ's failed registry too, where the dashboard showed it failed
        # for good (issue 65.2). A job of such a chunk still running is left alone.
        # So does one marked failed after its chunk was counted done (a chaos night's pool found its
        # worker gone, "lost Redis", once the output was in): the whole registry, not its tail, since
        # a supervisor started after it failed never reads that part of the tail.
        self._forget_failed_of_done(cast(list[bytes], self.connection.zrange(self._failed_key, 0, -1)))
        failed, running, finished_late, in_redis, waiting = set(), set(), set(), set(), ChunkSet()
        queued: list[int] = []
        for index, status in self._pending_statuses():
            if status in QUEUED_STATUSES:
                snap.chunks_queued += 1
                in_redis.add(index)
                if status == "queued":
                    queued.append(index)
            elif status == "started":
                running.add(index)
                in_redis.add(index)
            elif status == "failed":
                failed.add(index)
                in_redis.add(index)
            elif status == "finished" and self.layout.output_meta(index).is_file():
                finished_late.add(index)  # finished between the store listing and the status read
            else:
                waiting.add(index)  # no live job and no output: the window queues it in order
                if index in self.in_redis:
                    snap.lost.append(index)  # it had a job: a flushed or evicted Redis
        self.in_redis, self.waiting = in_redis, waiting
        self._mark_done(finished_late)
        self._forget(finished)
        self._failed = failed
        if snap.chunks_queued:
            snap.stranded = self._stranded()
            snap.unlisted = self._unlisted(queued)
            snap.chunks_queued -= len(snap.stranded)  # each chunk in one state: stranded, not queued
        return running, failed

    def _unlisted(self, queued: list[int]) -> list[int]:
        """Chunks whose job says queued but that neither the queue's list nor its intermediate list
        holds (the list was deleted, or evicted): no worker would ever take them. The lists and the
        statuses are read in one transaction; still, a worker starting a job takes it out of the
        intermediate list a moment before it marks it started, so only a chunk found so in two
        full looks in a row is named (one found in a single look was queued again as it was being
        taken, and run twice: seen under load)."""
        found = self._unlisted_once(queued)
        confirmed = sorted(set(found) & self._unlisted_before)
        self._unlisted_before = set(found)
        return confirmed

    def _unlisted_once(self, queued: list[int]) -> list[int]:
        job_ids = [self._job_id(i) for i in queued]
        held, statuses = self._lists.held_and_statuses(job_ids)
        return [
            index
            for index, job_id, status in zip(queued, job_ids, statuses, strict=True)
            if status == b"queued" and job_id not in held
        ]

    def _incremental_look(self, snap: Snapshot) -> tuple[set[int], set[int]]:
        # The started registry first: a chunk that finishes between the two reads is then in both
        # (and counted done), never in neither (its encoded rows gone from the display for a look).
        started = self._lists.started_ids()
        finished = self._run_indices(self._registry_tail(self._finished_key))
        self._mark_done(i for i in finished if i in self.pending and self.layout.output_meta(i).is_file())
        self._forget(finished)
        tail = self._registry_tail(self._failed_key)
        self._forget_failed_of_done(tail)
        gained = self._pending_indices(tail)
        self._failed = {i for i in self._failed | gained if i in self.pending}
        known = sorted(self._failed)
        statuses = job_statuses(self.connection, [self._job_id(i) for i in known])
        self._failed = {i for i, status in zip(known, statuses, strict=True) if status == "failed"}
        running = self._pending_indices(started)
        self.in_redis |= running | self._failed
        snap.chunks_queued = len(self.in_redis - running - self._failed)
        if snap.chunks_queued:
            snap.stranded = self._stranded()
            snap.chunks_queued -= len(snap.stranded)  # each chunk in one state: stranded, not queued
        return running, set(self._failed)

    def _pending_statuses(self) -> Iterator[tuple[int, str | None]]:
        """(index, job status) of every pending chunk, a block of them a round trip."""
        for block in self.pending.blocks():
            yield from zip(
                block, job_statuses(self.connection, [self._job_id(i) for i in block]), strict=True
            )

    def _fetch(self, indices: list[int]) -> dict[int, Job]:
        jobs = self._lists.fetch([self._job_id(i) for i in indices])
        return {i: job for i, job in zip(indices, jobs, strict=True) if job is not None}

    def _stranded(self) -> list[int]:
        """Queued chunks left in RQ's intermediate list: a worker took them and died before starting.

        RQ repairs these itself only in its ten-minute maintenance pass; the first-seen marks it
        keeps in Redis make this check survive a supervisor restart.
        """
        held = self._lists.taken_ids()
        stranded, limit = [], timedelta(seconds=STRANDED_SECONDS)
        for index in sorted(self._pending_indices(held)):
            job_id = self._job_id(index)
            first = self._lists.taken_since(job_id)
            if first is not None and datetime.now(UTC) - first > limit:
                stranded.append(index)
        return stranded

    def _stale(self, running: list[int]) -> tuple[list[int], list[int]]:
        """Started chunks whose worker stopped beating: it died or hangs, and no pool said so; and
        those that missed a beat or have none yet (looked at more closely by ``_gone``)."""
        if not running:
            return [], []
        beats = self._lists.heartbeats([self._job_id(i) for i in running])
        stale, silent, wall = [], [], time.time()
        for index, beat in zip(running, beats, strict=True):
            if beat is not None and wall - beat > self.stale_after:
                stale.append(index)
            elif beat is None or wall - beat > HEARTBEAT_SECONDS:
                silent.append(index)
        return stale, silent

    def _gone(self, silent: list[int]) -> dict[int, str]:
        """Of the silent chunks, those whose worker ran on this host and is gone with its pool: failed
        now, not once their heartbeat is stale (a rerun after ``kill -9`` on the user's own Redis
        waited 60 s for the chunk the killed run had in hand)."""
        ids = {self._job_id(i): i for i in silent}
        gone = worker_place.gone_workers(self.connection, list(ids))
        return {ids[job_id]: why for job_id, why in gone.items()}


class _DoneChunks(Collection[int]):
    """The chunks not pending, as a collection, without a set of them."""

    def __init__(self, pending: ChunkSet, chunks: int) -> None:
        self.pending, self.chunks = pending, chunks

    def __len__(self) -> int:
        return self.chunks - len(self.pending)

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and 0 <= index < self.chunks and index not in self.pending

    def __iter__(self) -> Iterator[int]:
        return (i for i in range(self.chunks) if i not in self.pending)
