"""``chunkq report RUN``: a PNG of the run's timeline and a markdown summary, from the store alone.

The store's chunk metadata says which process did each chunk, when, on which device, and when that
process loaded its model; the supervisor's failure records (``failures/``) say when and where
attempts failed, and of which class. The figure has three panels: a timeline with one lane per
worker process (grouped by device), throughput over time, and the text lengths in tokens with the
model's truncation point.
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

from chunkq.jobs.compute import device_busy
from chunkq.jobs.compute.models import resolve_model
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import RunLayout, read_chunk_input, read_json
from chunkq.jobs.contract.specs import BATCH_TOKENS_AUTO, BATCH_TOKENS_OFF
from chunkq.supervisor.result.planned_rows import describe_savings, savings
from chunkq.supervisor.result.published import describe_left_out
from chunkq.supervisor.store.ledger import stream_records, throughput_of
from chunkq.supervisor.store.throughput import PAUSE_SECONDS, Throughput, parse_time
from chunkq.supervisor.watch.attempts import FailedAttempt, by_class, failed_attempts, to_json
from chunkq.tools import first_row

log = logging.getLogger(__name__)

LENGTH_SAMPLE = 20_000  # texts whose token length is measured for the histogram
LENGTH_SAMPLE_CHUNKS = 200  # chunk inputs read for that sample: a run's size must not decide the cost
LABELLED_CHUNKS = 300  # up to this many chunks, each is drawn and numbered; above, lanes are binned
TIMELINE_BINS = 1500  # columns of a binned lane: about a pixel each in the figure, at any chunk count
RATE_BINS = 200  # rows encoded per slice of the run's span, before the rate's window smooths them
RATE_WINDOW_SAMPLES = 2.0  # the rate is taken over at least this many gaps between a chunk's row
# samples (jobs.compute.chunk_progress: rows arrive a batch at a time, a shorter window shows each as a spike)
RATE_WINDOW_SHARE = 1 / 30  # and over at least this share of the run
MIN_BAR_SHARE = 0.004  # a bar this share of the timeline at least: a 0.01 s model load stays visible
LENGTH_AXIS_QUANTILE = 0.995  # a long tail past this is cut from the length histogram's axis
LONG_TAIL = 1.5  # ... when the longest text is this many times the quantile (the count beyond is said)
LABELLED_FAILURES = 30  # up to this many failed attempts, each is labelled with its chunk and class


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


def gather(layout: RunLayout) -> RunFacts:
    """What the store says of a run, read as a stream: the ledger (a file per LEDGER_BATCH chunks)
    twice, once for the run's span (or ``summary.json`` alone) and once to bin the timeline, and
    every failed attempt (no Redis needed)."""
    manifest = load_manifest(layout)
    done = layout.done_chunks(manifest.chunks)
    facts = RunFacts(manifest, throughput_of(layout, done), failures=failed_attempts(layout), done=done)
    labelled = len(done) <= LABELLED_CHUNKS
    for record in stream_records(layout, done):
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


def summary(
    facts: RunFacts, lengths: list[int], limit: int | None, unit: str, layout: RunLayout | None = None
) -> dict[str, Any]:
    m = facts.manifest
    running = facts.chunks_done + len(facts.quarantined) < m.chunks
    ran = facts.throughput.seconds(running) or 0.0  # pauses of a stopped run not counted
    rate = facts.throughput.rows_per_second(running)
    loads = [lane.load[1] for lane in facts.lanes.values() if lane.load is not None]
    truncated = sum(1 for n in lengths if limit is not None and n > limit)
    return {
        "run_id": m.run_id,
        "rows": m.rows,
        "chunks": m.chunks,
        "rows_done": facts.throughput.rows,
        "chunks_done": facts.chunks_done,
        "worker_processes": len(facts.lanes),
        "devices": sorted(facts.devices),
        "wall_seconds": round(facts.span, 2),
        "ran_seconds": round(ran, 2),
        "rows_per_second": round(rate, 1) if rate else None,
        "device_busy": facts.throughput.busy.figure(),  # jobs.compute.device_busy: share, source, seconds
        "failed_attempts": len(facts.failures),
        "failures_by_class": by_class(facts.failures),
        "batches": _batches(facts),
        "failures": to_json(facts.failures),
        "quarantined_chunks": facts.quarantined,
        "model_load_seconds_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "startup_seconds": None if facts.startup_began is None else round(-facts.startup_began, 2),
        # where the seconds before the first row went, and after the last chunk (tools.first_row)
        "first_row": None
        if layout is None
        else first_row.breakdown(layout, facts.first, facts.throughput.last_end),
        "model_loads": len(loads),
        "length_unit": unit,
        "length_sample": len(lengths),
        "truncation_point": limit,
        "truncated_in_sample": truncated,
        "cache": _saved(facts),
        "windows": (facts.manifest.plan or {}).get("windows"),  # --long-texts window: texts cut, windows
        "rows_left_out": facts.bad_rows,  # --allow-missing: rows whose input could not be read, and why
        "oom_halvings": facts.halvings,  # each chunk that halved its batch after an out-of-memory
    }


def _saved(facts: RunFacts) -> dict[str, Any] | None:
    """What the vector cache saved: its rows, and the encode time they would have cost: what the
    cached vectors cost when they were made, and each duplicate at this run's seconds per row."""
    saved = savings(facts.manifest.plan)
    if saved is None:
        return None
    encoded = facts.throughput.rows
    per_row = (
        facts.chunk_seconds / encoded
        if encoded
        else (saved["cache_seconds_saved"] / saved["from_cache"] if saved["from_cache"] else 0.0)
    )
    seconds = saved["cache_seconds_saved"] + saved["deduplicated"] * per_row
    return {**saved, "chunks_from_cache": facts.cached_chunks, "encode_seconds_saved": round(seconds, 2)}


def _batches(facts: RunFacts) -> dict[str, Any]:
    """What the run asked for and what its chunks ran at: below the request after out-of-memory
    back-offs (in the chunk, or learned from earlier chunks)."""
    options = facts.manifest.options
    asked = options.get("batch_tokens")
    tokens = facts.by_tokens or asked not in (None, BATCH_TOKENS_OFF)
    unit = "batch_tokens" if tokens else "batch_size"
    requested = (asked or f"{BATCH_TOKENS_AUTO} (the GPU's default)") if tokens else options.get("batch_size")
    return {
        "unit": unit,
        "requested": requested,
        "chunks_at": {str(size): count for size, count in sorted(facts.batches.items(), reverse=True)},
    }


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


def describe_halvings(halvings: list[dict[str, Any]], shown: int = 5) -> str:
    """'3 in 2 chunk(s): chunk 4 on GPU 0, w1 (32 -> 16 -> 8; 2 by the NVML assert), ...'"""
    total = sum(h["halvings"] for h in halvings)
    parts = []
    for h in halvings[:shown]:
        assert_note = f"; {h['by_nvml_assert']} by the NVML assert" if h["by_nvml_assert"] else ""
        parts.append(f"chunk {h['chunk']} on {h['where']} ({' -> '.join(map(str, h['sizes']))}{assert_note})")
    more = f", and {len(halvings) - shown} more chunk(s)" if len(halvings) > shown else ""
    return f"{total} in {len(halvings)} chunk(s): {', '.join(parts)}{more}"


def _device(meta: dict[str, Any]) -> str:
    return f"GPU {meta['gpu']}" if meta.get("gpu") is not None else str(meta["device"])


def _plot(facts: RunFacts, lengths: list[int], limit: int | None, unit: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; PNG only
    import matplotlib.pyplot as plt

    fig, (ax_lanes, ax_rate, ax_len) = plt.subplots(3, 1, figsize=(12, 11), height_ratios=(3, 1.3, 1.3))
    began = [lane.startup[0] for lane in facts.lanes.values() if lane.startup is not None]
    left = min(facts.startup_began or 0.0, *began, 0.0)  # the timeline starts with the start-up
    right = max([facts.span, *((a.when - facts.t0).total_seconds() for a in facts.failures)])
    _lanes(ax_lanes, facts, left)
    _rates(ax_rate, facts, left)
    for ax in (ax_lanes, ax_rate):  # one time axis for both
        ax.set_xlim(left - (right - left) * 0.01, right + (right - left) * 0.03)
    _lengths(ax_len, lengths, limit, unit)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _lanes(ax: Any, facts: RunFacts, left: float) -> None:
    """One lane per worker process: its start-up, model load, chunks, failed attempts and end."""
    span = facts.span
    lanes = _with_failed_only_lanes(facts)
    lane_of_worker = {lane.worker: y for y, lane in enumerate(lanes)}
    bin_seconds = span / TIMELINE_BINS
    least = (span - left) * MIN_BAR_SHARE
    for y, lane in enumerate(lanes):
        for start, end, chunk in lane.chunks:
            size = 10 if facts.chunks_done <= 50 else 7
            ax.text((start + end) / 2, y, str(chunk), ha="center", va="center", fontsize=size)
        # One artist a lane, of at most TIMELINE_BINS bars: a 10^6-chunk run draws like a small one.
        ax.broken_barh(
            lane.spans(bin_seconds), (y - 0.3, 0.6), facecolors="tab:blue", edgecolors="white", linewidth=0.3
        )
        if lane.startup is not None:
            began, ready = lane.startup
            ax.barh(y, max(ready - began, least), left=began, height=0.6, color="lightgray", hatch="//")
        if lane.load is not None:
            loaded, seconds = lane.load
            ax.barh(y, max(seconds, least), left=loaded - seconds, height=0.6, color="dimgray")
        if not lane.failed_only:
            ax.plot([lane.last_end], [y], marker="|", color="black", markersize=12)  # the process ends
    if facts.startup_began is not None and facts.startup_began < 0:
        ax.axvspan(facts.startup_began, 0.0, color="gold", alpha=0.15, zorder=0)
        ax.text(
            facts.startup_began,
            len(lanes) - 0.45,
            f" start-up {-facts.startup_began:.1f} s",
            fontsize=9,
            va="top",
        )
    labelled = len(facts.failures) <= LABELLED_FAILURES
    for n, attempt in enumerate(facts.failures):
        y = lane_of_worker[attempt.worker]
        end = (attempt.when - facts.t0).total_seconds()
        tried = facts.seconds(attempt.started)
        if tried is not None:  # the failed attempt itself, where it ran
            ax.barh(y, max(end - tried, least), left=tried, height=0.6, color="tab:red", alpha=0.35)
        ax.plot([end], [y], marker="x", color="tab:red", markersize=9)
        if labelled:  # alternately above and below the lane, so neighbours do not overwrite each other
            ax.annotate(
                f"{attempt.chunk}: {attempt.error_class}",
                (end, y),
                fontsize=8,
                color="tab:red",
                xytext=(3, 7 if n % 2 == 0 else -13),
                textcoords="offset points",
            )
    labels = [
        f"{lane.device} {lane.worker} (failed only)" if lane.failed_only else f"{lane.device} pid {lane.pid}"
        for lane in lanes
    ]
    ax.set_yticks(range(len(lanes)), labels, fontsize=9 if len(lanes) <= 40 else 6)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds since the first chunk started")
    ax.set_title(
        f"run {facts.manifest.run_id}\nchunks (blue), start-up (hatched), model loads (dark grey), "
        "failed attempts (red, x at the failure, 'chunk: class'), process end (|)",
        fontsize=10,
    )


def _with_failed_only_lanes(facts: RunFacts) -> list[Lane]:
    """The lanes in device order, and one for each process that only ever failed (it published no
    chunk, so the ledger has no lane for it)."""
    lanes = sorted(facts.lanes.values(), key=lambda lane: (lane.device, lane.first_start))
    known = {lane.worker for lane in lanes}
    extra: dict[str, Lane] = {}
    for attempt in facts.failures:
        if attempt.worker not in known and attempt.worker not in extra:
            device = f"GPU {attempt.gpu}" if attempt.gpu is not None else attempt.device
            extra[attempt.worker] = Lane(device, 0, attempt.worker, 0.0, failed_only=True)
    return lanes + sorted(extra.values(), key=lambda lane: (lane.device, lane.worker))


def _rates(ax: Any, facts: RunFacts, left: float) -> None:
    """Rows per second as they were encoded (within chunks), zero through the start-up."""
    times, rates, window = facts.rate_curve()
    if left < 0:
        times, rates = np.concatenate(([left, 0.0], times)), np.concatenate(([0.0, 0.0], rates))
    ax.plot(times, rates, color="tab:blue", drawstyle="steps-post")
    ax.fill_between(times, rates, step="post", alpha=0.3, color="tab:blue")
    overall = facts.throughput.rows_per_second(running=False)
    if overall:
        ax.axhline(overall, color="black", linestyle="--", linewidth=1, label=f"run: {overall:,.1f} rows/s")
        ax.legend(loc="lower right", fontsize=9)
    ax.set_ylabel(f"rows / s (over {window:.3g} s)")
    ax.set_xlabel("seconds since the first chunk started")


def length_axis(lengths: list[int], limit: int | None) -> tuple[float, int]:
    """Where the length histogram's axis ends (the data's LENGTH_AXIS_QUANTILE, reaching the
    truncation point when it is near), and how many texts lie beyond it."""
    if not lengths:
        return 1.0, 0
    top = float(np.quantile(np.asarray(lengths), LENGTH_AXIS_QUANTILE))
    if max(lengths) <= LONG_TAIL * top:
        top = float(max(lengths))
    if limit is not None and limit <= LONG_TAIL * top:
        top = max(top, limit * 1.05)
    top = max(top, 1.0)
    return top, sum(1 for n in lengths if n > top)


def _lengths(ax: Any, lengths: list[int], limit: int | None, unit: str) -> None:
    top, beyond = length_axis(lengths, limit)
    # Short texts: a bin per length, else 50 bins (50 bins over 22 tokens leave gaps between lengths)
    bins: Any = np.arange(0, int(top) + 2) - 0.5 if top <= 50 else 50
    ax.hist([n for n in lengths if n <= top], bins=bins, range=(0, top), color="tab:green")
    if limit is not None and limit <= top:
        ax.axvline(limit, color="tab:red", linestyle="--", label=f"truncation at {limit} {unit}")
        ax.legend()
    elif limit is not None:
        ax.set_title(f"truncation at {limit} {unit}: beyond every text drawn", fontsize=9)
    if beyond:
        ax.text(0.99, 0.92, f"{beyond} longer than {top:.0f} (not drawn)", transform=ax.transAxes, ha="right")
    ax.set_xlim(0, top)
    ax.set_xlabel(f"text length ({unit}, sample of {len(lengths)})")
    ax.set_ylabel("texts")


def _markdown(s: dict[str, Any], png: Path) -> str:
    classes = ", ".join(f"{k}: {v}" for k, v in s["failures_by_class"].items()) or "none"
    batches = s["batches"]
    lines = [
        f"# chunkq run {s['run_id']}",
        "",
        f"![timeline]({png.name})",
        "",
        "| | |",
        "|---|---|",
        f"| rows done | {s['rows_done']} of {s['rows']} |",
        f"| chunks done | {s['chunks_done']} of {s['chunks']} |",
        f"| worker processes | {s['worker_processes']} |",
        f"| devices | {', '.join(s['devices'])} |",
        f"| wall time (first chunk start to last chunk end) | {s['wall_seconds']} s |",
        f"| time it ran (pauses over {PAUSE_SECONDS:.0f} s left out) | {s['ran_seconds']} s |",
        f"| throughput | {s['rows_per_second']} rows/s |",
        f"| device busy over the chunks | {device_busy.describe(s['device_busy'])} |",
        f"| failed attempts | {s['failed_attempts']} ({classes}) |",
        f"| {batches['unit'].replace('_', ' ')} | requested {batches['requested']}; chunks ran at "
        f"{', '.join(f'{size} ({n})' for size, n in batches['chunks_at'].items()) or '-'} |",
        f"| quarantined chunks | {len(s['quarantined_chunks'])} {s['quarantined_chunks'] or ''} |",
        f"| start-up before the first chunk | {s['startup_seconds']} s |",
        *(
            [
                f"| before the first row (seconds since {s['first_row']['from']}) | "
                f"{first_row.describe(s['first_row'])} |",
                f"| last chunk done to result written | {s['first_row']['last_chunk_to_result_seconds']} s |",
            ]
            if s.get("first_row") and s["first_row"]["marks"]
            else []
        ),
        f"| model loads | {s['model_loads']} (mean {s['model_load_seconds_mean']} s) |",
        f"| truncated texts (sample of {s['length_sample']}) | {s['truncated_in_sample']} "
        f"longer than {s['truncation_point']} {s['length_unit']} |",
    ]
    if s["windows"]:
        w = s["windows"]
        lines.append(
            f"| long texts as windows | {w['windowed']} of {w['texts']} texts cut; {w['windows']} windows "
            f"of at most {w['tokens']} tokens |"
        )
    if s["rows_left_out"]:
        lines.append(f"| rows left out (--allow-missing) | {describe_left_out(s['rows_left_out'])} |")
    if s["oom_halvings"]:
        lines.append(f"| out-of-memory halvings (in the process) | {describe_halvings(s['oom_halvings'])} |")
    if s["cache"] is not None:
        saved = s["cache"]
        lines += [
            f"| vector cache | {describe_savings(saved)} |",
            f"| worker time the cached and repeated texts would have taken (estimate) | "
            f"{saved['encode_seconds_saved']} s of encoding; a whole command saves less (start-up and "
            "model load are paid either way: BENCHMARKS.md, vector cache) |",
        ]
    lines.append("")
    return "\n".join(lines)


def write_report(layout: RunLayout, out: Path) -> dict[str, Any]:
    """Write ``report.png``, ``report.md`` and ``report.json`` under ``out``; return the summary."""
    import json

    facts = gather(layout)
    lengths, limit, unit = _token_lengths(layout, facts.manifest)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "report.png"
    _plot(facts, lengths, limit, unit, png)
    numbers = summary(facts, lengths, limit, unit, layout)
    (out / "report.md").write_text(_markdown(numbers, png), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers
