"""How chunkq writes a size in a message, a table or an error: one way everywhere."""

from __future__ import annotations


def size_text(n: float) -> str:
    """``n`` bytes as people read them: 512 B, 3.4 KiB, 1.2 GiB (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""  # not reached: TiB ends the loop
