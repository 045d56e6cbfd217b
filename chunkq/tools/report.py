"""``chunkq report RUN``: a PNG of the run's timeline and a markdown summary, from the store alone.

The store's chunk metadata says which process did each chunk, when, on which device, and when that
process loaded its model; the supervisor's failure records (``failures/``) say when and where
attempts failed, and of which class. The figure has three panels: a timeline with one lane per
worker process (grouped by device), throughput over time, and the text lengths in tokens with the
model's truncation point.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.compute import device_busy
from chunkq.jobs.contract.errors import ABANDONED
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import BATCH_TOKENS_AUTO, BATCH_TOKENS_OFF
from chunkq.supervisor.result.planned_rows import corpus_rows_of, describe_savings, savings
from chunkq.supervisor.result.published import describe_left_out
from chunkq.supervisor.store.attempts import by_class, to_json
from chunkq.supervisor.store.throughput import PAUSE_SECONDS
from chunkq.tools import first_row
from chunkq.tools.run_facts import (
    TIMELINE_BINS,
    Lane,
    RunFacts,
    _token_lengths,
    gather,
)

log = logging.getLogger(__name__)

MIN_BAR_SHARE = 0.004  # a bar this share of the timeline at least: a 0.01 s model load stays visible
LENGTH_AXIS_QUANTILE = 0.995  # a long tail past this is cut from the length histogram's axis
LONG_TAIL = 1.5  # ... when the longest text is this many times the quantile (the count beyond is said)
LANE_PIXELS = 1000  # the timeline's width in the PNG (12 inches at 100 dpi, less the axis labels)
LABELLED_FAILURES = 30  # up to this many failed attempts, each is labelled with its chunk and class


def summary(
    facts: RunFacts, lengths: list[int], limit: int | None, unit: str, run: Run | None = None
) -> dict[str, Any]:
    m = facts.manifest
    layout = None if run is None else run.layout
    published = len(facts.done)  # encoded and read from the vector cache alike
    running = published + len(facts.quarantined) < m.chunks
    ran = facts.throughput.seconds(running) or 0.0  # pauses of a stopped run not counted
    rate = facts.throughput.rows_per_second(running)
    loads = [lane.load[1] for lane in facts.lanes.values() if lane.load is not None]
    truncated = sum(1 for n in lengths if limit is not None and n > limit)
    return {
        "run_id": m.run_id,
        # The run's rows as every command counts them (its corpus's, or its windows); what its
        # chunks hold beside them: distinct texts encoded ("1350 of 1350" of 1,500).
        "rows": m.corpus_rows,
        "chunks": m.chunks,
        "rows_done": facts.throughput.rows if layout is None else corpus_rows_of(layout, m, facts.done),
        "rows_encoded": facts.throughput.rows,
        "chunks_done": published,
        "chunks_encoded": facts.chunks_done,
        "worker_processes": len(facts.lanes),  # that encoded a chunk of the result (as the summary counts)
        # workers whose attempt was cut off (killed, hung, their pool gone): each once
        "worker_deaths": len({(f.host, f.worker) for f in facts.failures if f.error_class == ABANDONED}),
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
        if run is None
        else first_row.breakdown(run, facts.first, facts.throughput.last_end),
        "phases": _phases(layout),  # the commands' own: wall and CPU seconds (supervisor/store/phases.py)
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


def _truncated_line(s: dict[str, Any]) -> str:
    """A static-embedding model reads a text of any length: nothing is cut ("0 longer than None
    tokens" said so badly)."""
    if s["truncation_point"] is None:
        return "| truncated texts | none: the model reads a text of any length |"
    return (
        f"| truncated texts (sample of {s['length_sample']}) | {s['truncated_in_sample']} "
        f"longer than {s['truncation_point']} {s['length_unit']} |"
    )


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


def describe_halvings(halvings: list[dict[str, Any]], shown: int = 5) -> str:
    """'3 in 2 chunk(s): chunk 4 on GPU 0, w1 (32 -> 16 -> 8; 2 by the NVML assert), ...'"""
    total = sum(h["halvings"] for h in halvings)
    parts = []
    for h in halvings[:shown]:
        assert_note = f"; {h['by_nvml_assert']} by the NVML assert" if h["by_nvml_assert"] else ""
        parts.append(f"chunk {h['chunk']} on {h['where']} ({' -> '.join(map(str, h['sizes']))}{assert_note})")
    more = f", and {len(halvings) - shown} more chunk(s)" if len(halvings) > shown else ""
    return f"{total} in {len(halvings)} chunk(s): {', '.join(parts)}{more}"


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


def labelled_chunks(
    chunks: list[tuple[float, float, int]], seconds: float, fontsize: float
) -> list[tuple[float, float, int]]:
    """The chunks whose bar is wide enough for their number at ``fontsize`` on a timeline of
    ``seconds``: a label on every chunk of a long run overlapped into an unreadable strip."""
    per_second = LANE_PIXELS / max(seconds, 1e-9)
    char = fontsize * 0.75  # a digit's width in pixels at 100 dpi, roughly
    return [c for c in chunks if (c[1] - c[0]) * per_second >= char * len(str(c[2])) + 2]


def _lanes(ax: Any, facts: RunFacts, left: float) -> None:
    """One lane per worker process: its start-up, model load, chunks, failed attempts and end."""
    span = facts.span
    lanes = _with_failed_only_lanes(facts)
    lane_of_worker = {lane.worker: y for y, lane in enumerate(lanes)}
    bin_seconds = span / TIMELINE_BINS
    least = (span - left) * MIN_BAR_SHARE
    size = 10 if facts.chunks_done <= 50 else 7
    for y, lane in enumerate(lanes):
        for start, end, chunk in labelled_chunks(lane.chunks, span - left, size):
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


def _phases(layout: RunLayout | None) -> dict[str, Any] | None:
    try:
        return read_json(layout.phases) if layout is not None and layout.phases.is_file() else None
    except (OSError, ValueError):
        return None  # a figure lost, never the report


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
        f"| worker processes | {s['worker_processes']} encoded its chunks, {s['worker_deaths']} died |",
        f"| devices | {', '.join(s['devices'])} |",
        f"| wall time (first chunk start to last chunk end) | {s['wall_seconds']} s |",
        f"| time it ran (pauses over {PAUSE_SECONDS:.0f} s left out) | {s['ran_seconds']} s |",
        f"| throughput | {_or_dash(s['rows_per_second'], ' rows/s')} |",
        f"| device busy over the chunks | {device_busy.describe(s['device_busy'])} |",
        f"| failed attempts | {s['failed_attempts']} ({classes}) |",
        f"| {batches['unit'].replace('_', ' ')} | requested {batches['requested']}; chunks ran at "
        f"{', '.join(f'{size} ({n})' for size, n in batches['chunks_at'].items()) or '-'} |",
        f"| quarantined chunks | {len(s['quarantined_chunks'])} {s['quarantined_chunks'] or ''} |",
        f"| start-up before the first chunk | {_or_dash(s['startup_seconds'], ' s')} |",
        *(
            [
                f"| before the first row (seconds since {s['first_row']['from']}) | "
                f"{first_row.describe(s['first_row'])} |",
                f"| last chunk done to result written | {s['first_row']['last_chunk_to_result_seconds']} s |",
            ]
            if s.get("first_row") and s["first_row"]["marks"]
            else []
        ),
        *(
            [
                "| the command's phases, seconds (CPU seconds) | "
                + "; ".join(
                    f"{k} {v['seconds']:.2f} ({v['cpu_seconds']:.2f})" for k, v in s["phases"].items()
                )
                + " |"
            ]
            if s.get("phases")
            else []
        ),
        f"| model loads | {s['model_loads']} (mean {_or_dash(s['model_load_seconds_mean'], ' s')}) |",
        _truncated_line(s),
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
            f"| vector cache | {describe_savings(saved, planned=s['chunks_done'] < s['chunks'])} |",
            f"| worker time the cached and repeated texts would have taken (estimate) | "
            f"{saved['encode_seconds_saved']} s of encoding; a whole command saves less (start-up and "
            "model load are paid either way: BENCHMARKS.md, vector cache) |",
        ]
    lines.append("")
    return "\n".join(lines)


def _or_dash(value: Any, unit: str) -> str:
    """A figure the run has not got (no chunk encoded: all from the cache) reads "-", not "None"."""
    return "-" if value is None else f"{value}{unit}"


def write_report(run: Run, out: Path) -> dict[str, Any]:
    """Write ``report.png``, ``report.md`` and ``report.json`` under ``out``; return the summary."""
    import json

    facts = gather(run)
    lengths, limit, unit = _token_lengths(run.layout, facts.manifest)
    out.mkdir(parents=True, exist_ok=True)
    png = out / "report.png"
    _plot(facts, lengths, limit, unit, png)
    numbers = summary(facts, lengths, limit, unit, run)
    (out / "report.md").write_text(_markdown(numbers, png), encoding="utf-8")
    (out / "report.json").write_text(json.dumps(numbers, indent=2) + "\n", encoding="utf-8")
    return numbers
