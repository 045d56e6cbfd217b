"""How chunkq writes a size in a message, a table or an error, and reads a span of time: one way
everywhere."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from chunkq.jobs.contract.errors import ConfigError

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DURATION_FORMS = "seconds, or a number with s, m (min), h, d or w: 600, 10m, 12h, 30d"


def duration_seconds(text: str) -> float | None:
    """``text`` as seconds: a number, or one with s, m/min, h, d or w; None where it is neither."""
    match = _DURATION.fullmatch(str(text))
    return None if match is None else float(match.group(1)) * _SECONDS[(match.group(2) or "").lower()]


def age_text(seconds: float | None) -> str:
    """A span of seconds, rounded to its largest unit: 42 s, 5 min, 3 h, 12 d; "?" for None."""
    if seconds is None:
        return "?"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def table_text(rows: Sequence[tuple[str, ...]]) -> str:
    """Rows of cells as a table for the terminal: each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def size_text(n: float) -> str:
    """``n`` bytes as people read them: 512 B, 3.4 KiB, 1.2 GiB (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # not reached: TiB ends the loop


def parse_size(text: str) -> int:
    """'8GiB', '512M', '0' -> bytes. A size is a finite number of bytes, not below zero."""
    units = {
        "": 1,
        "k": 2**10,
        "kb": 2**10,
        "kib": 2**10,
        "m": 2**20,
        "mb": 2**20,
        "mib": 2**20,
        "g": 2**30,
        "gb": 2**30,
        "gib": 2**30,
        "t": 2**40,
        "tb": 2**40,
        "tib": 2**40,
    }
    raw = text.strip().lower()
    number = raw.rstrip("kmgtib")
    try:
        value = float(number) * units[raw[len(number) :]]
    except (ValueError, KeyError):
        raise ConfigError(f"cannot read the size {text!r} (use e.g. 8GiB, 512MiB)") from None
    if not math.isfinite(value):
        raise ConfigError(f"cannot read the size {text!r}: not a finite number (use e.g. 8GiB, 512MiB)")
    if value < 0:
        raise ConfigError(f"{text!r} is below zero (0: none)")
    return int(value)


def size_value(text: str) -> str:
    """A size option checked where it is given (``PoolSettings``' ``parse``)."""
    parse_size(text)
    return text.strip()
