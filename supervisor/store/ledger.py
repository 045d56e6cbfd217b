"""The run's ledger: one short record per finished chunk, in batches, so reading a run's history
costs a file per LEDGER_BATCH chunks instead of one per chunk (one GET each on an object store).

    <store>/runs/<run>/ledger/000000.jsonl   a batch of records, written whole, never changed
    <store>/runs/<run>/summary.json          counts and the rate's inputs as of the last batch

The supervisor writes numbered batches. The chunk outputs stay the truth: a reader that finds
committed outputs the ledger lacks reads those outputs' metadata one by one, says so, and, when no
process owns the run, adds them as a batch of its own (``rebuilt-<pid>-<time>.jsonl``). It takes no
lock for that (a reader must never make a starting run refuse): every file lands whole, and a chunk
recorded twice counts once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from itertools import islice
from typing import Any

from chunkq.jobs.compute.device_busy import Tally
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import RunLayout, atomic_write_bytes, atomic_write_json, read_json
from chunkq.jobs.contract.storage import list_with_mtime
from chunkq.supervisor.store.chunk_set import ChunkSet
from chunkq.supervisor.store.throughput import Span, Throughput, parse_time

log = logging.getLogger(__name__)

LEDGER_BATCH = 1000  # records a batch file holds at most
FLUSH_SECONDS = 30.0  # a smaller batch is written after this long, so a reader is never far behind
# What a record keeps of a chunk output's metadata: what status, report and the rate read.
RECORD_KEYS = (
    "chunk",
    "rows",
    "source",  # "cache": read from the vector cache at submit, not encoded
    "bad_rows",  # --allow-missing: the chunk's rows left out, each with its id and why
    "started_at",
    "finished_at",
    "seconds",
    "worker",
    "host",
    "pid",
    "device",
    "gpu",
    "attempt",
    "model_loaded_at",
    "model_load_seconds",
    "batch_size",
    "batch_tokens",
    "oom_backoffs",  # each halving the chunk's attempt made after an out-of-memory: size, error
    "startup",
    "rows_at",
    "busy",  # how busy the device was over the chunk (jobs.compute.device_busy)
)


def record_of(meta: Mapping[str, Any]) -> dict[str, Any]:
    return {key: meta.get(key) for key in RECORD_KEYS}


def _batches(layout: RunLayout) -> list[str]:
    return sorted(name for name, _ in list_with_mtime(layout.ledger) if name.endswith(".jsonl"))


def read_ledger(layout: RunLayout, manifest: RunManifest) -> Iterator[dict[str, Any]]:
    """Every record of this run, batch by batch. The ledger is derived (the outputs are the
    truth), so it sizes nothing it is not checked against: a damaged line, or a record of a chunk
    the run does not have or with rows that chunk does not hold, is skipped and said once."""
    skipped = 0
    for name in _batches(layout):
        # A reader's rebuild is one file of every record: read and parsed a batch at a time.
        with (layout.ledger / name).open("r", encoding="utf-8") as lines:
            while batch := list(islice(lines, LEDGER_BATCH)):
                for record in _parse_batch([line.strip() for line in batch if line.strip()]):
                    if _of_this_run(record, manifest):
                        yield record
                    else:
                        skipped += 1
    if skipped:
        log.warning("run %s: %d ledger record(s) not of this run's chunks skipped", layout.run_id, skipped)


def _of_this_run(record: Any, manifest: RunManifest) -> bool:
    if not isinstance(record, dict):
        return False
    chunk = record.get("chunk")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < manifest.chunks:
        return False
    return bool(record.get("rows") == manifest.chunk_rows(chunk))


def _parse_batch(lines: list[str]) -> list[Any]:
    """A batch's records: one JSON parse of the whole batch (a third of the time of a parse a
    line), a line at a time only where one is damaged."""
    try:
        return list(json.loads("[" + ",".join(lines) + "]"))
    except ValueError:
        pass
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


@dataclass
class Ledger:
    """The owner's writer: ``add`` records, ``flush`` writes a batch and the summary."""

    layout: RunLayout
    recorded: ChunkSet = field(default_factory=ChunkSet)
    pending: list[dict[str, Any]] = field(default_factory=list)
    throughput: Throughput = field(default_factory=Throughput)
    _next: int = 0
    _flushed_at: float = field(default_factory=time.monotonic)

    @classmethod
    def open(cls, layout: RunLayout, manifest: RunManifest) -> Ledger:
        """The ledger as the store holds it, ready to record what it lacks."""
        numbered = [int(name[:-6]) for name in _batches(layout) if name[:-6].isdigit()]
        ledger = cls(layout, _next=max(numbered, default=-1) + 1)
        for record in read_ledger(layout, manifest):
            if record["chunk"] not in ledger.recorded:
                ledger.recorded.add(record["chunk"])
                count_record(ledger.throughput, record)
        return ledger

    def add(self, meta: Mapping[str, Any]) -> None:
        record = record_of(meta)
        if record["chunk"] in self.recorded or not isinstance(record["chunk"], int):
            return
        self.recorded.add(record["chunk"])
        self.pending.append(record)
        count_record(self.throughput, record)

    def flush(self, force: bool = False, name: str | None = None) -> None:
        """Write the pending records as one batch once there are LEDGER_BATCH of them, FLUSH_SECONDS
        have passed, or ``force`` (the run settled); then the summary. ``name``: one file of that
        name for all of them (a reader's rebuild), instead of the owner's numbered batches."""
        due = len(self.pending) >= LEDGER_BATCH or time.monotonic() - self._flushed_at >= FLUSH_SECONDS
        if not self.pending or not (due or force):
            return
        while self.pending:
            size = len(self.pending) if name else LEDGER_BATCH
            batch, self.pending = self.pending[:size], self.pending[size:]
            lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in batch)
            atomic_write_bytes(self.layout.ledger / (name or f"{self._next:06d}.jsonl"), lines.encode())
            if not name:
                self._next += 1
        self._flushed_at = time.monotonic()
        t = self.throughput
        atomic_write_json(
            self.layout.summary,
            {
                "chunks_recorded": len(self.recorded),
                "rows_recorded": t.rows,
                "first_start": t.first_start.isoformat() if t.first_start else None,
                "last_end": t.last_end.isoformat() if t.last_end else None,
                "spans": None if t.spans is None else [span.to_json() for span in t.spans],
                "busy": t.busy.by_source,
                "ledger_batches": self._next,
                "updated_at": datetime.now(UTC).isoformat(),
            },
        )


def summarised(layout: RunLayout, done: int) -> Throughput | None:
    """The rate's inputs from ``summary.json`` when it covers exactly ``done`` chunks, else None:
    one small file instead of the whole ledger."""
    try:
        summary = read_json(layout.summary)
        if summary.get("chunks_recorded") != done or not summary.get("first_start"):
            return None
        spans = summary.get("spans")
        return Throughput(
            rows=int(summary["rows_recorded"]),
            first_start=parse_time(summary["first_start"]),
            last_end=parse_time(summary["last_end"]),
            # A summary from before spans were kept: the whole span, as it was counted then.
            spans=[Span.from_json(span) for span in spans] if isinstance(spans, list) else None,
            busy=Tally({str(k): [float(v[0]), float(v[1])] for k, v in (summary.get("busy") or {}).items()}),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def count_record(throughput: Throughput, record: Mapping[str, Any]) -> None:
    """Add a finished chunk's rows and times to a rate."""
    try:
        throughput.add(record)
    except (KeyError, TypeError, ValueError):
        pass  # a record without times (a damaged output) counts no rate


def stream_records(
    layout: RunLayout, manifest: RunManifest, done: Collection[int]
) -> Iterator[dict[str, Any]]:
    """A record for every chunk in ``done``, each once: from the ledger, and for what it lacks,
    from the chunk outputs themselves. Memory holds the chunks seen, never their records, so a
    reader of 10^6 chunks streams. When nobody owns the run, what had to be read from the outputs
    is added to the ledger, so the next reader need not read it again."""
    seen = bytearray(max(done, default=-1) + 1)  # a byte a chunk: 1 MB at 10^6, not ~60 MB of ints
    for record in read_ledger(layout, manifest):
        chunk = record["chunk"]
        if 0 <= chunk < len(seen) and not seen[chunk] and chunk in done:
            seen[chunk] = 1
            yield record
    read: list[dict[str, Any]] = []
    for index in sorted(i for i in done if not seen[i]):
        try:
            meta = read_json(layout.output_meta(index))
        except (OSError, ValueError):
            continue  # a damaged output is the assembler's to name
        read.append(meta)
        yield record_of(meta)
    _rebuild(layout, manifest, read)


def of_run(store: Any, run_id: str) -> Throughput:
    """A run's throughput from its committed chunk outputs (the ledger's summary where it covers
    them): for tools and benches that measure a run the way ``status`` reports it."""
    layout = RunLayout(store, run_id)
    return throughput_of(layout, load_manifest(layout), layout.done_chunks())


def throughput_of(layout: RunLayout, manifest: RunManifest, done: Collection[int]) -> Throughput:
    """The rate's inputs of the chunks in ``done``: ``summary.json`` when it covers them all (one
    small file), else the ledger (a file per LEDGER_BATCH chunks)."""
    throughput = summarised(layout, len(done))
    if throughput is not None and throughput.rows != manifest.rows_of(done):
        throughput = None  # a summary that counts rows these chunks do not hold: not trusted
    if throughput is None:
        throughput = Throughput()
        for record in stream_records(layout, manifest, done):
            count_record(throughput, record)
    return throughput


def _rebuild(layout: RunLayout, manifest: RunManifest, metas: list[dict[str, Any]]) -> None:
    """Record outputs the ledger lacks, when no process owns the run (an owner records them itself)."""
    from chunkq.supervisor.store.store_lock import StoreLock

    if not metas or StoreLock(layout.owner, "").live_holder() is not None:
        return
    ledger = Ledger.open(layout, manifest)
    for meta in metas:
        ledger.add(meta)
    name = f"rebuilt-{os.getpid()}-{time.time_ns()}.jsonl"
    try:
        ledger.flush(force=True, name=name)
    except OSError as exc:  # a read-only store: the next reader reads the outputs again
        log.debug("run %s: ledger not rebuilt (%s)", layout.run_id, exc)
        return
    # Routine after a stop (an owner records chunks a few at a time): nothing was lost or damaged.
    log.debug(
        "run %s: %d finished chunk(s) recorded in the ledger from their outputs", layout.run_id, len(metas)
    )
