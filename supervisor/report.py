"""``chunkq report RUN``: a PNG of the run's timeline and a markdown summary, from the store alone.

The store's chunk metadata says which process did each chunk, when, on which device, and when that
process loaded its model; the supervisor's failure records (``failures/``) say when and where
attempts failed, and of which class. The figure has three panels: a timeline with one lane per
worker process (grouped by device), throughput over time, and the text lengths in tokens with the
model's truncation point.
"""

from __future__ import annotations

import logging
import random
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from chunkq.jobs.manifest import RunManifest, load_manifest
from chunkq.jobs.models import resolve_model
from chunkq.jobs.store import RunLayout, read_chunk_input, read_json
from chunkq.supervisor.attempts import FailedAttempt, by_class, failed_attempts, to_json
from chunkq.supervisor.ledger import records
from chunkq.supervisor.throughput import of_outputs, parse_time

log = logging.getLogger(__name__)

LENGTH_SAMPLE = 20_000  # texts whose token length is measured for the histogram
LENGTH_SAMPLE_CHUNKS = 200  # chunk inputs read for that sample: a run's size must not decide the cost
LABELLED_CHUNKS = 300  # above this many chunks, bars carry no chunk numbers (they would not be legible)


@dataclass
class RunFacts:
    manifest: RunManifest
    outputs: list[dict[str, Any]]
    failures: list[FailedAttempt] = field(default_factory=list)

    @property
    def quarantined(self) -> list[int]:
        return sorted({a.chunk for a in self.failures if a.quarantined})

    @property
    def processes(self) -> dict[tuple[str, int], list[dict[str, Any]]]:
        lanes: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
        for meta in self.outputs:
            lanes[(str(meta["host"]), int(meta["pid"]))].append(meta)
        return lanes


def gather(layout: RunLayout) -> RunFacts:
    """What the store says of a run: a record of each finished chunk (from the ledger, a file per
    LEDGER_BATCH chunks) and every failed attempt (no Redis needed)."""
    manifest = load_manifest(layout)
    found, _ = records(layout, layout.done_chunks())
    return RunFacts(manifest, [found[i] for i in sorted(found)], failed_attempts(layout))


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
    throughput = of_outputs(facts.outputs)
    running = len(facts.outputs) + len(facts.quarantined) < m.chunks
    wall = throughput.seconds(running) or 0.0
    rate = throughput.rows_per_second(running)
    rows_done = throughput.rows
    loads = [float(o["model_load_seconds"]) for o in facts.outputs if "model_load_seconds" in o]
    per_process = {key: metas[0].get("model_load_seconds") for key, metas in facts.processes.items()}
    truncated = sum(1 for n in lengths if limit is not None and n > limit)
    return {
        "run_id": m.run_id,
        "rows": m.rows,
        "chunks": m.chunks,
        "rows_done": rows_done,
        "chunks_done": len(facts.outputs),
        "worker_processes": len(facts.processes),
        "devices": sorted({_device(o) for o in facts.outputs}),
        "wall_seconds": round(wall, 2),
        "rows_per_second": round(rate, 1) if rate else None,
        "failed_attempts": len(facts.failures),
        "failures_by_class": by_class(facts.failures),
        "failures": to_json(facts.failures),
        "quarantined_chunks": facts.quarantined,
        "model_load_seconds_mean": round(sum(loads) / len(loads), 2) if loads else None,
        "model_loads": sum(1 for v in per_process.values() if v is not None),
        "length_unit": unit,
        "length_sample": len(lengths),
        "truncation_point": limit,
        "truncated_in_sample": truncated,
    }


def _device(meta: dict[str, Any]) -> str:
    return f"GPU {meta['gpu']}" if meta.get("gpu") is not None else str(meta["device"])


def _plot(facts: RunFacts, lengths: list[int], limit: int | None, unit: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; PNG only
    import matplotlib.pyplot as plt

    fig, (ax_lanes, ax_rate, ax_len) = plt.subplots(3, 1, figsize=(12, 11), height_ratios=(3, 1.3, 1.3))
    t0 = of_outputs(facts.outputs).first_start or datetime.now(UTC)
    lanes = sorted(
        facts.processes.values(), key=lambda metas: (_device(metas[0]), parse_time(metas[0]["started_at"]))
    )
    lane_of_worker: dict[str, int] = {}
    labelled = len(facts.outputs) <= LABELLED_CHUNKS
    for y, metas in enumerate(lanes):
        first = metas[0]
        lane_of_worker[str(first["worker"])] = y
        spans = []
        for meta in metas:
            start = (parse_time(meta["started_at"]) - t0).total_seconds()
            length = (parse_time(meta["finished_at"]) - parse_time(meta["started_at"])).total_seconds()
            spans.append((start, length))
            if labelled:
                ax_lanes.text(start + length / 2, y, str(meta["chunk"]), ha="center", va="center", fontsize=6)
        # One artist a lane, not one a chunk: a 100,000-chunk run draws as fast as a small one.
        ax_lanes.broken_barh(spans, (y - 0.3, 0.6), facecolors="tab:blue", edgecolors="white", linewidth=0.3)
        if first.get("model_loaded_at") and first.get("model_load_seconds") is not None:
            load = float(first["model_load_seconds"])
            end = (parse_time(first["model_loaded_at"]) - t0).total_seconds()
            ax_lanes.barh(y, load, left=end - load, height=0.6, color="tab:gray")
        last_end = max((parse_time(m["finished_at"]) - t0).total_seconds() for m in metas)
        ax_lanes.plot([last_end], [y], marker="|", color="black", markersize=12)  # the process recycles/exits
    for attempt in facts.failures:
        # A process that never finished a chunk has no lane of its own: its failures sit below the lanes.
        row = lane_of_worker.get(attempt.worker, -1)
        x = (attempt.when - t0).total_seconds()
        ax_lanes.plot([x], [row], marker="x", color="tab:red", markersize=9)
        ax_lanes.annotate(
            attempt.error_class,
            (x, row),
            fontsize=7,
            color="tab:red",
            xytext=(3, 5),
            textcoords="offset points",
        )
    labels = [f"{_device(metas[0])} pid {metas[0]['pid']}" for metas in lanes]
    ax_lanes.set_yticks(range(len(lanes)), labels, fontsize=7)
    ax_lanes.set_xlabel("seconds since the first chunk started")
    ax_lanes.set_title(
        f"run {facts.manifest.run_id}: chunks (blue), model loads (grey), failed attempts (red x), "
        "process end (|)"
    )

    finished = sorted(
        ((parse_time(m["finished_at"]) - t0).total_seconds(), int(m["rows"])) for m in facts.outputs
    )
    if finished:
        width = max(1.0, finished[-1][0] / 30)
        buckets: Counter[int] = Counter()
        for t, rows in finished:
            buckets[int(t // width)] += rows
        xs = sorted(buckets)
        ax_rate.bar([x * width for x in xs], [buckets[x] / width for x in xs], width=width, align="edge")
    ax_rate.set_ylabel("rows / s")
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
        f"| throughput | {s['rows_per_second']} rows/s |",
        f"| failed attempts | {s['failed_attempts']} ({classes}) |",
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
