"""What ``chunkq report`` reads of a run, from the store alone: each worker process's lane (device,
chunks, model load, busy time binned), the rows encoded over time, the failed attempts, the
ledger's records and the token lengths of a sample of the texts. ``report.py`` summarises and
draws them.
"""

from __future__ import annotations

import logging
import math
import random
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute.model_refs import resolve_model
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input, read_json
from chunkq.supervisor.store.attempts import FailedAttempt, failed_attempts
from chunkq.supervisor.store.ledger import stream_records, throughput_of
from chunkq.supervisor.store.throughput import Throughput, parse_time

log = logging.getLogger(__name__)


LENGTH_SAMPLE = 20_000  # texts whose token length is measured for the histogram


LENGTH_SAMPLE_CHUNKS = 200  # chunk inputs read for that sample: a run's size must not decide the cost


LABELLED_CHUNKS = 300  # up to this many chunks, each is drawn and numbered; above, lanes are binned


TIMELINE_BINS = 1500  # columns of a binned lane: about a pixel each in the figure, at any chunk count


RATE_BINS = 200  # rows encoded per slice of the run's span, before the rate's window smooths them


RATE_WINDOW_SAMPLES = 2.0  # the rate is taken over at least this many gaps between a chunk's row


# samples (jobs.compute.chunk_progress: rows arrive a batch at a time, a shorter window shows each as a spike)
RATE_WINDOW_SHARE = 1 / 30  # and over at least this share of the run


@dataclass
class Lane:
    """One worker process's row of the timeline, in seconds since the run's first chunk started."""

    device: str
    pid: int
    worker: str
    first_start: float
    last_end: float = 0.0
    load: tuple[float, float] | None = None  # (seconds at which its model was loaded, load seconds)
    startup: tuple[float, float] | None = None  # (process start, ready to take a job), in seconds
    failed_only: bool = False  # a process that failed every attempt it made: no chunk of its own
    busy: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(TIMELINE_BINS, dtype=bool))
    chunks: list[tuple[float, float, int]] = field(default_factory=list)  # only while labelled

    def spans(self, bin_seconds: float) -> list[tuple[float, float]]:
        """(start, length) bars: each chunk when labelled, else the runs of busy bins."""
        if self.chunks:
            return [(start, end - start) for start, end, _ in self.chunks]
        edges = np.flatnonzero(np.diff(np.concatenate(([0], self.busy.astype(np.int8), [0]))))
        return [
            (lo * bin_seconds, (hi - lo) * bin_seconds)
            for lo, hi in zip(edges[::2], edges[1::2], strict=True)
        ]


@dataclass
class RunFacts:
    """What the report shows, gathered in one stream over the ledger: memory holds the plot's
    points (bins), one entry per worker process and the failed attempts, never a record per chunk."""

    manifest: RunManifest
    throughput: Throughput
    chunks_done: int = 0
    lanes: dict[tuple[str, int], Lane] = field(default_factory=dict)
    rate: np.ndarray[Any, Any] = field(default_factory=lambda: np.zeros(RATE_BINS))
    devices: set[str] = field(default_factory=set)
    failures: list[FailedAttempt] = field(default_factory=list)
    chunk_seconds: float = 0.0  # summed over finished chunks, for the rate's window
    sample_seconds: float = 0.0  # summed gaps between the row samples of each chunk, for the same
    samples: int = 0
    batches: Counter[int] = field(default_factory=Counter)  # chunks per batch size (or token budget) used
    by_tokens: bool = False  # a chunk ran by a token budget (asked, or a GPU's default)
    done: Collection[int] = ()  # the chunks published (a failure later recovered is not quarantined)
    startup_began: float | None = None  # when the run's first workers began starting (<= 0), seconds
    cached_chunks: int = 0  # chunks read from the vector cache at submit
    bad_rows: list[dict[str, Any]] = field(default_factory=list)  # rows left out (--allow-missing)
    halvings: list[dict[str, Any]] = field(default_factory=list)  # per chunk that backed off: where, sizes
    first: dict[str, Any] | None = None  # the record of the chunk that started first (tools.first_row)
    first_start: float = math.inf

    @cached_property
    def t0(self) -> datetime:
        return self.throughput.first_start or datetime.now(UTC)

    @cached_property
    def span(self) -> float:  # the throughput is the ledger's before the stream: read once, not a record
        """The timeline's width: first chunk start to last chunk end, pauses included."""
        t = self.throughput
        wall = (t.last_end - t.first_start).total_seconds() if t.first_start and t.last_end else 0.0
        return max(wall, 1e-3)

    @property
    def quarantined(self) -> list[int]:
        """Chunks quarantined and still without an output: a chunk recovered by a later run is done."""
        return sorted({a.chunk for a in self.failures if a.quarantined and a.chunk not in self.done})

    def seconds(self, moment: Any) -> float | None:
        """An ISO time as seconds since the first chunk started; None when absent or unreadable."""
        try:
            return (parse_time(moment) - self.t0).total_seconds() if moment else None
        except (TypeError, ValueError):
            return None

    def _startup(self, record: dict[str, Any], lane: Lane, start: float) -> None:
        """The lane's process start-up, and the run's: from the pool's start when the pool was
        started for this run (``chunkq run``), else from when the run was submitted."""
        startup = record.get("startup")
        if not isinstance(startup, dict):
            return  # written before start-up was recorded
        began, ready = self.seconds(startup.get("process_started_at")), self.seconds(startup.get("ready_at"))
        if lane.startup is None and began is not None and ready is not None:
            lane.startup = (began, ready)
        pool = self.seconds(startup.get("pool_started_at"))
        if startup.get("pool_for_run") != self.manifest.run_id:
            submitted = self.seconds(self.manifest.data.get("created_at"))
            pool = None if pool is None or submitted is None else max(pool, submitted)
        if pool is not None and pool <= min(start, 0.0):  # a later session's pool is its lanes' start-up
            self.startup_began = pool if self.startup_began is None else min(self.startup_began, pool)

    def _rows_in_time(self, record: dict[str, Any], start: float, end: float) -> None:
        """The chunk's rows in the rate's bins when they were encoded: at its samples, else spread."""
        rows, span = int(record["rows"]), self.span
        samples = record.get("rows_at")
        points: list[tuple[float, int]] = []
        if isinstance(samples, list) and samples:
            try:
                points = [(start + max(float(t), 0.0), min(max(int(n), 0), rows)) for t, n in samples]
            except (TypeError, ValueError):
                points = []
        if not points or points[-1][1] != rows:  # no samples (older outputs), or damaged: spread evenly
            steps = max(1, min(RATE_BINS, math.ceil((end - start) / span * RATE_BINS)))
            points = [
                (start + (end - start) * (k + 1) / steps, rows * (k + 1) // steps) for k in range(steps)
            ]
        else:
            self.sample_seconds += max(end - start, 0.0) / len(points)
            self.samples += 1
        before = 0
        for moment, total in points:
            bin_ = min(max(int(moment / span * RATE_BINS), 0), RATE_BINS - 1)
            self.rate[bin_] += max(total - before, 0)
            before = max(before, total)

    def add(self, record: dict[str, Any], labelled: bool) -> None:
        t0, span = self.t0, self.span
        start = (parse_time(record["started_at"]) - t0).total_seconds()
        end = (parse_time(record["finished_at"]) - t0).total_seconds()
        key = (str(record["host"]), int(record["pid"]))
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = Lane(_device(record), int(record["pid"]), str(record["worker"]), start)
        lane.first_start = min(lane.first_start, start)
        if (
            lane.load is None
            and record.get("model_loaded_at")
            and record.get("model_load_seconds") is not None
        ):
            loaded = (parse_time(record["model_loaded_at"]) - t0).total_seconds()  # once a process
            lane.load = (loaded, float(record["model_load_seconds"]))
        lane.last_end = max(lane.last_end, end)
        self._startup(record, lane, start)
        if start < self.first_start:
            self.first, self.first_start = record, start
        if labelled:
            lane.chunks.append((start, end, int(record["chunk"])))
        lo, hi = (min(int(t / span * TIMELINE_BINS), TIMELINE_BINS - 1) for t in (max(start, 0.0), end))
        lane.busy[lo : hi + 1] = True
        self._rows_in_time(record, start, end)
        self.devices.add(lane.device)
        self.chunk_seconds += max(end - start, 0.0)
        self.chunks_done += 1
        self.bad_rows += record.get("bad_rows") or []
        if record.get("oom_backoffs"):
            self.halvings.append(_halving(record))
        limit = record.get("batch_tokens") or record.get("batch_size")
        if limit is not None:  # ledgers written before the batch was recorded have none
            self.batches[int(limit)] += 1
        self.by_tokens = self.by_tokens or record.get("batch_tokens") is not None

    def rate_curve(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], float]:
        """(times, rows per second over the window ending at each, the window in seconds): the window
        spans RATE_WINDOW_SAMPLES mean gaps between row samples (a chunk's duration where a chunk
        has none), and at least RATE_WINDOW_SHARE of the run."""
        width = self.span / RATE_BINS
        unsampled = self.chunks_done - self.samples
        gap = (self.sample_seconds + self.chunk_seconds * unsampled / max(1, self.chunks_done)) / max(
            1, self.chunks_done
        )
        window = max(RATE_WINDOW_SAMPLES * gap, self.span * RATE_WINDOW_SHARE, width)
        bins = max(1, math.ceil(window / width))
        rows = np.convolve(self.rate, np.ones(bins))[: len(self.rate)]
        # Near the start the window reaches back before the first chunk: divide by what it covers.
        covered = np.minimum(np.arange(1, len(self.rate) + 1), bins) * width
        return (np.arange(1, len(self.rate) + 1) * width, rows / covered, bins * width)


def gather(run: Run) -> RunFacts:
    """What the store says of a run, read as a stream: the ledger (a file per LEDGER_BATCH chunks)
    twice, once for the run's span (or ``summary.json`` alone) and once to bin the timeline, and
    every failed attempt (no Redis needed)."""
    layout, manifest = run.layout, run.manifest
    done = layout.done_chunks(manifest.chunks)
    facts = RunFacts(
        manifest, throughput_of(layout, manifest, done), failures=failed_attempts(layout), done=done
    )
    labelled = len(done) <= LABELLED_CHUNKS
    for record in stream_records(layout, manifest, done):
        if record.get("source") == "cache":
            facts.cached_chunks += 1  # read from the vector cache at submit: no part of the timeline
            continue
        try:
            facts.add(record, labelled)
        except (KeyError, TypeError, ValueError):
            continue  # a record without times (a damaged output) has no place on the timeline
    return facts


def _token_lengths(layout: RunLayout, manifest: RunManifest) -> tuple[list[int], int | None, str]:
    """Token lengths of a sample of texts, the truncation point, and the unit ("tokens" or "words")."""
    rng = random.Random(0)  # noqa: S311 - a reproducible sample, not security
    sampled = min(manifest.chunks, LENGTH_SAMPLE_CHUNKS)
    per_chunk = max(1, LENGTH_SAMPLE // max(1, sampled))
    chunks = sorted(rng.sample(range(manifest.chunks), sampled))
    texts: list[str] = []
    for index in chunks:
        _, chunk_texts = read_chunk_input(layout, index)
        texts += chunk_texts[:per_chunk]
    limit: int | None = manifest.data.get("options", {}).get("max_seq_length")
    try:
        path = resolve_model(str(manifest.data["model"]))
        lengths = _count_tokens(Path(path), texts)
        if limit is None:
            limit = _model_max_seq_length(Path(path))
        return lengths, limit, "tokens"
    except Exception as exc:  # no tokenizer here (a hub model on an offline host): count words instead
        log.warning("no tokenizer for %s (%s); the histogram counts words", manifest.data["model"], exc)
        return [len(t.split()) for t in texts], None, "words"


def _count_tokens(path: Path, texts: list[str]) -> list[int]:
    """Token lengths, special tokens included. The model's ``tokenizer.json`` through the
    ``tokenizers`` library where it has one: no torch or transformers import (a report's memory),
    and no "sequence length is longer than the maximum" warning, since nothing is truncated here."""
    fast = path / "tokenizer.json"
    if fast.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(fast))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts, add_special_tokens=True)]
    from transformers import AutoTokenizer

    slow = AutoTokenizer.from_pretrained(path)
    return [len(ids) for ids in slow(texts, add_special_tokens=True)["input_ids"]]


def _model_max_seq_length(path: Path) -> int | None:
    config = path / "sentence_bert_config.json"
    if config.is_file():
        value = read_json(config).get("max_seq_length")
        return int(value) if value else None
    return None


def _halving(record: dict[str, Any]) -> dict[str, Any]:
    """A chunk's out-of-memory back-off, as the report shows it: where, from which sizes, and how
    many of them torch's allocator reported by its NVML assert (halved in the process all the same)."""
    steps = record["oom_backoffs"]
    fitted = record.get("batch_tokens") or record.get("batch_size")
    return {
        "chunk": record["chunk"],
        "where": f"{_device(record)}, {record.get('worker')}",
        "sizes": [
            int(next(v for k, v in step.items() if k in ("batch_size", "batch_tokens"))) for step in steps
        ]
        + ([int(fitted)] if fitted is not None else []),
        "halvings": len(steps),
        "by_nvml_assert": sum(1 for step in steps if step.get("report_failed")),
    }


def _device(meta: dict[str, Any]) -> str:
    return f"GPU {meta['gpu']}" if meta.get("gpu") is not None else str(meta["device"])
