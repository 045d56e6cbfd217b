"""Where a run's seconds before its first row went, and after its last chunk.

From the store alone: the command's marks (``supervisor/store/start_marks.py``: its process start, imports
and options, Redis, the pool, the chunks queued), then the first chunk's worker (its process start,
model loaded, warmed up and ready), the first chunk's start and its first batch's rows (the chunk's
first ``rows_at`` sample); after the last chunk, the result's ``assembled_at``. Each mark is seconds
since the earliest one known: the command's start where ``chunkq run`` created the run, else the
first worker's process start (a run submitted with ``chunkq submit`` to a pool started apart)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.supervisor.store import start_marks
from chunkq.supervisor.store.throughput import parse_time

COMMAND_STEPS = {  # the command's marks, as the report names them
    start_marks.COMMAND_STARTED: "command started",
    start_marks.OPTIONS_READY: "imports done, options checked",
    start_marks.REDIS_READY: "Redis up",
    start_marks.POOL_STARTED: "pool started",
    start_marks.CHUNKS_QUEUED: "corpus split, chunks queued",
}
FIRST_ROWS = "first rows encoded"


def _epoch(value: Any) -> float | None:
    try:
        return parse_time(value).timestamp() if value else None
    except (TypeError, ValueError):
        return None


def _command_marks(layout: RunLayout) -> list[tuple[str, float]]:
    try:
        marks = read_json(layout.start_marks)
    except (OSError, ValueError):
        return []  # a run not made by `chunkq run` (or before it kept them)
    return [
        (COMMAND_STEPS[k], float(marks[k])) for k in COMMAND_STEPS if isinstance(marks.get(k), int | float)
    ]


def _worker_marks(first: dict[str, Any]) -> list[tuple[str, float | None]]:
    given = first.get("startup")
    startup: dict[str, Any] = given if isinstance(given, dict) else {}
    started = _epoch(first.get("started_at"))
    sampled = first.get("rows_at")
    samples: list[Any] = sampled if isinstance(sampled, list) else []
    rows_at = next((float(t) for t, n in samples if n > 0), None) if started is not None else None
    return [
        ("first worker process started", _epoch(startup.get("process_started_at"))),
        ("its model loaded", _epoch(first.get("model_loaded_at"))),
        ("its warm-up done, ready for a chunk", _epoch(startup.get("ready_at"))),
        ("first chunk started", started),
        (FIRST_ROWS, None if rows_at is None or started is None else started + rows_at),
    ]


def breakdown(run: Run, first: dict[str, Any] | None, last_end: datetime | None) -> dict[str, Any]:
    """``marks``: [step, seconds since the first mark], in time order; ``first_row_seconds``: the
    first rows' mark; ``from``: what the marks count from; ``warm_up_seconds`` of that worker;
    ``last_chunk_to_result_seconds``: from the last chunk's end to the result being written."""
    known = _command_marks(run.layout)
    if first is not None:
        known += [(name, at) for name, at in _worker_marks(first) if at is not None]
    published = None if run.result is None else _epoch(run.result.assembled_at)
    if not known:
        return {"marks": [], "first_row_seconds": None, "from": None, "last_chunk_to_result_seconds": None}
    origin_name, origin = min(known, key=lambda mark: mark[1])
    marks = sorted(((name, round(at - origin, 3)) for name, at in known), key=lambda mark: mark[1])
    startup = (first or {}).get("startup")
    warm_up = startup.get("warm_up_seconds") if isinstance(startup, dict) else None
    return {
        "from": origin_name,
        "marks": marks,
        "first_row_seconds": next((at for name, at in marks if name == FIRST_ROWS), None),
        "warm_up_seconds": warm_up,
        "model_load_seconds": (first or {}).get("model_load_seconds"),
        "last_chunk_to_result_seconds": (
            None if published is None or last_end is None else round(published - last_end.timestamp(), 3)
        ),
    }


def describe(figures: dict[str, Any]) -> str:
    """One line for the report's table: each step's mark, in seconds."""
    return "; ".join(f"{name} {at:.2f} s" for name, at in figures["marks"]) or "-"
