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
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.manifest import RunManifest, load_manifest
from chunkq.jobs.models import resolve_model
from chunkq.jobs.run_files import RunLayout, read_chunk_input, read_json
from chunkq.supervisor.attempts import FailedAttempt, by_class, failed_attempts, to_json
from chunkq.supervisor.ledger import stream_records, throughput_of
from chunkq.supervisor.throughput import PAUSE_SECONDS, Throughput, parse_time

log = logging.getLogger(__name__)

LENGTH_SAMPLE = 20_000  # texts whose token length is measured for the histogram
LENGTH_SAMPLE_CHUNKS = 200  # chunk inputs read for that sample: a run's size must not decide the cost
LABELLED_CHUNKS = 300  # up to this many chunks, each is drawn and numbered; above, lanes are binned
TIMELINE_BINS = 1500  # columns of a binned lane: about a pixel each in the figure, at any chunk count
RATE_BINS = 200  # rows finished per slice of the run's span, before the rate's window smooths them
RATE_WINDOW_CHUNKS = 2.0  # the rate is taken over at least this many chunk durations (a chunk's rows
# arrive at once when it finishes: a shorter window shows each arrival as a spike, not a rate)


@dataclass
class Lane:
    """One worker process's row of the timeline, in seconds since the run's first chunk started."""

    device: str
    pid: int
    worker: str
    first_start: float
    last_end: float = 0.0
    load: tuple[float, float] | None = None  # (seconds at which its model was loaded, load seconds)
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
    batches: Counter[int] = field(default_factory=Counter)  # chunks per batch size (or token budget) used

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
        return sorted({a.chunk for a in self.failures if a.quarantined})

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
        if labelled:
            lane.chunks.append((start, end, int(record["chunk"])))
        lo, hi = (min(int(t / span * TIMELINE_BINS), TIMELINE_BINS - 1) for t in (max(start, 0.0), end))
        lane.busy[lo : hi + 1] = True
        self.rate[min(int(end / span * RATE_BINS), RATE_BINS - 1)] += int(record["rows"])
        self.devices.add(lane.device)
        self.chunk_seconds += max(end - start, 0.0)
        self.chunks_done += 1
        limit = record.get("batch_tokens") or record.get("batch_size")
        if limit is not None:  # ledgers written before the batch was recorded have none
            self.batches[int(limit)] += 1

    def rate_curve(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], float]:
        """(times, rows per second over the window ending at each, the window in seconds): the window
        spans RATE_WINDOW_CHUNKS mean chunk durations, at least 1/30 of the run."""
        width = self.span / RATE_BINS
        mean_chunk = self.chunk_seconds / max(1, self.chunks_done)
        window = max(RATE_WINDOW_CHUNKS * mean_chunk, self.span / 30, width)
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
    facts = RunFacts(manifest, throughput_of(layout, done), failures=failed_attempts(layout))
    labelled = len(done) <= LABELLED_CHUNKS
    for record in stream_records(layout, done):
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


def summary(facts: RunFacts, lengths: list[int], limit: int | None, unit: str) -> dict[str, Any]:
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
        "failed_attempts": len(facts.failures),
        "failures_by_class": by_class(facts.failures),
        "batches": _batches(facts),
        "failures": to_json(facts.failures),
        "quarantined_chunks": facts.quarantined,
        "model_load_seconds_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "model_loads": len(loads),
        "length_unit": unit,
        "length_sample": len(lengths),
        "truncation_point": limit,
        "truncated_in_sample": truncated,
    }


def _batches(facts: RunFacts) -> dict[str, Any]:
    """What the run asked for and what its chunks ran at: below the request after out-of-memory
    back-offs (in the chunk, or learned from earlier chunks)."""
    options = facts.manifest.options
    unit = "batch_tokens" if options.get("batch_tokens") is not None else "batch_size"
    return {
        "unit": unit,
        "requested": options.get(unit),
        "chunks_at": {str(size): count for size, count in sorted(facts.batches.items(), reverse=True)},
    }


def _device(meta: dict[str, Any]) -> str:
    return f"GPU {meta['gpu']}" if meta.get("gpu") is not None else str(meta["device"])


def _plot(facts: RunFacts, lengths: list[int], limit: int | None, unit: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; PNG only
    import matplotlib.pyplot as plt

    fig, (ax_lanes, ax_rate, ax_len) = plt.subplots(3, 1, figsize=(12, 11), height_ratios=(3, 1.3, 1.3))
    t0, span = facts.t0, facts.span
    lanes = sorted(facts.lanes.values(), key=lambda lane: (lane.device, lane.first_start))
    lane_of_worker: dict[str, int] = {}
    bin_seconds = span / TIMELINE_BINS
    for y, lane in enumerate(lanes):
        lane_of_worker[lane.worker] = y
        for start, end, chunk in lane.chunks:
            size = 10 if facts.chunks_done <= 50 else 7
            ax_lanes.text((start + end) / 2, y, str(chunk), ha="center", va="center", fontsize=size)
        # One artist a lane, of at most TIMELINE_BINS bars: a 10^6-chunk run draws like a small one.
        ax_lanes.broken_barh(
            lane.spans(bin_seconds), (y - 0.3, 0.6), facecolors="tab:blue", edgecolors="white", linewidth=0.3
        )
        if lane.load is not None:
            loaded, seconds = lane.load
            ax_lanes.barh(y, seconds, left=loaded - seconds, height=0.6, color="tab:gray")
        ax_lanes.plot([lane.last_end], [y], marker="|", color="black", markersize=12)  # the process ends
    for attempt in facts.failures:
        # A process that never finished a chunk has no lane of its own: its failures sit below the lanes.
        row = lane_of_worker.get(attempt.worker, -1)
        x = (attempt.when - t0).total_seconds()
        ax_lanes.plot([x], [row], marker="x", color="tab:red", markersize=9)
        ax_lanes.annotate(
            attempt.error_class,
            (x, row),
            fontsize=9,
            color="tab:red",
            xytext=(3, 5),
            textcoords="offset points",
        )
    labels = [f"{lane.device} pid {lane.pid}" for lane in lanes]
    ax_lanes.set_yticks(range(len(lanes)), labels, fontsize=9 if len(lanes) <= 40 else 6)
    ax_lanes.set_xlabel("seconds since the first chunk started")
    ax_lanes.set_title(
        f"run {facts.manifest.run_id}: chunks (blue), model loads (grey), failed attempts (red x), "
        "process end (|)"
    )

    times, rates, window = facts.rate_curve()
    ax_rate.plot(times, rates, color="tab:blue", drawstyle="steps-post")
    ax_rate.fill_between(times, rates, step="post", alpha=0.3, color="tab:blue")
    overall = facts.throughput.rows_per_second(running=False)
    if overall:
        ax_rate.axhline(
            overall, color="black", linestyle="--", linewidth=1, label=f"run: {overall:,.1f} rows/s"
        )
        ax_rate.legend(loc="lower right", fontsize=9)
    ax_rate.set_ylabel(f"rows / s (last {window:.3g} s)")
    ax_rate.set_xlabel("seconds since the first chunk started")

    ax_len.hist(lengths, bins=50, color="tab:green")
    if limit is not None:
        ax_len.axvline(limit, color="tab:red", linestyle="--", label=f"truncation at {limit} {unit}")
        ax_len.legend()
    ax_len.set_xlabel(f"text length ({unit}, sample of {len(lengths)})")
    ax_len.set_ylabel("texts")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
        f"| failed attempts | {s['failed_attempts']} ({classes}) |",
        f"| {batches['unit'].replace('_', ' ')} | requested {batches['requested']}; chunks ran at "
        f"{', '.join(f'{size} ({n})' for size, n in batches['chunks_at'].items()) or '-'} |",
        f"| quarantined chunks | {len(s['quarantined_chunks'])} {s['quarantined_chunks'] or ''} |",
        f"| model loads | {s['model_loads']} (mean {s['model_load_seconds_mean']} s) |",
        f"| truncated texts (sample of {s['length_sample']}) | {s['truncated_in_sample']} "
        f"longer than {s['truncation_point']} {s['length_unit']} |",
        "",
    ]
    return "\n".join(lines)


def write_report(layout: RunLayout, out: Path) -> dict[str, Any]:
    """Write ``report.png``, ``report.md`` and ``report.json`` under ``out``; return the summary."""
    import json

    facts = gather(layout)
    lengths, limit, unit = _token_lengths(layout, facts.manifest)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "report.png"
    _plot(facts, lengths, limit, unit, png)
    numbers = summary(facts, lengths, limit, unit)
    (out / "report.md").write_text(_markdown(numbers, png), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers
