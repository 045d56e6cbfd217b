"""How chunkq writes a size in a message, a table or an error, and reads a span of time: one way
everywhere."""

from __future__ import annotations

import re

_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*", re.IGNORECASE)
_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
DURATION_FORMS = "seconds, or a number with s, m (min), h, d or w: 600, 10m, 12h, 30d"


def duration_seconds(text: str) -> float | None:
    """``text`` as seconds: a number, or one with s, m/min, h, d or w; None where it is neither."""
    match = _DURATION.fullmatch(str(text))
    return None if match is None else float(match.group(1)) * _SECONDS[(match.group(2) or "").lower()]


def size_text(n: float) -> str:
    """``n`` bytes as people read them: 512 B, 3.4 KiB, 1.2 GiB (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # not reached: TiB ends the loop
