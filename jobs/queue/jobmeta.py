"""The job contract: what a chunk's RQ job carries in its meta, one name per key.

Written by submit (run, chunk, rows, first row, attempt), the worker (who runs it; the error class
and first 500 characters of the error when it fails), the pool and supervisor (abandoned), and the
supervisor's retry policy (retry_at, quarantined, quarantine_reason, the next attempt). Read by the
supervisor, the dashboard's users and ``chunkq status``. Nothing else belongs in it.
"""

from __future__ import annotations

from typing import Any

from chunkq.jobs.contract.errors import OTHER

RUN_ID = "run_id"
CHUNK = "chunk"
ROWS = "rows"
FIRST_ROW = "first_row"
ATTEMPT = "attempt"  # 1-based, for the chunk's whole life: each attempt has its own number (and record)
ROUND = "round"  # the attempt that began the current round (1; a new round after a quarantine is lifted)
WORKER, HOST, DEVICE, GPU = "worker", "host", "device", "gpu"
ERROR_CLASS = "error_class"  # one of jobs.contract.errors' classes
ERROR = "error"
ERROR_CHARS = 500
RETRY_AT = "retry_at"  # epoch seconds before which the next attempt waits (back-off)
QUARANTINED = "quarantined"
QUARANTINE_REASON = "quarantine_reason"
RETRY_STATE = (QUARANTINED, QUARANTINE_REASON, RETRY_AT)  # cleared when a user submits again
# What one attempt says of how it ended: cleared before each attempt, so a chunk's fate follows its
# latest attempt (a killed pool's chunk was quarantined with the error of an earlier one).
ATTEMPT_STATE = (ERROR_CLASS, ERROR)
# --allow-missing: rows of the chunk left out (id and why), so the dashboard's job page names them
BAD_ROWS = "bad_rows"
BAD_ROWS_SHOWN = 20  # more are counted, and all are in the output's metadata and the result manifest


def initial(run_id: str, chunk: int, rows: int, first_row: int) -> dict[str, Any]:
    return {RUN_ID: run_id, CHUNK: chunk, ROWS: rows, FIRST_ROW: first_row, ATTEMPT: 1}


def failed(meta: dict[str, Any], error_class: str, error: str) -> None:
    meta[ERROR_CLASS] = error_class
    meta[ERROR] = error[:ERROR_CHARS]


def attempt(meta: dict[str, Any]) -> int:
    """The attempt number, 1-based. A value that is not a positive integer (the meta was written by
    someone else) counts as the first attempt: a damaged job is retried, never a supervisor crash."""
    value = meta.get(ATTEMPT, 1)
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def in_round(meta: dict[str, Any]) -> int:
    """The attempt's number within its round (1-based): what the retry limit counts."""
    began = meta.get(ROUND, 1)
    began = began if isinstance(began, int) and not isinstance(began, bool) and began >= 1 else 1
    return max(1, attempt(meta) - began + 1)


def next_attempt(meta: dict[str, Any], new_round: bool = False) -> None:
    """Number the chunk's next attempt, clear what the last one said (and start a round of attempts
    anew, ``new_round``: after a quarantine lifted or a submit again)."""
    following = attempt(meta) + 1
    meta[ATTEMPT] = following
    if new_round:
        meta[ROUND] = following
    for key in ATTEMPT_STATE:
        meta.pop(key, None)


def retry_at(meta: dict[str, Any]) -> float | None:
    """When the next attempt may start (epoch seconds), or None if unset or unreadable."""
    value = meta.get(RETRY_AT)
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def error_class(meta: dict[str, Any]) -> str:
    return str(meta.get(ERROR_CLASS, OTHER))


def quarantined(meta: dict[str, Any]) -> bool:
    return bool(meta.get(QUARANTINED))
