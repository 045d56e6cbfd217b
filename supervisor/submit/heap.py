"""The heap a corpus's split freed, given back to the system before the run is watched.

The split holds blocks of rows and grows its hash tables; once it is done, C's allocator (glibc)
keeps what they freed for the process's next allocations instead of returning it: at 10^6 rows,
41 MB of the supervisor's 75 MB heap was free and kept for the whole watch (``malloc_stats``).
``malloc_trim`` hands it back; elsewhere (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any


@functools.cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name) if name else None


def give_back_free_heap() -> bool:
    """Return the heap C's allocator holds free to the system; whether anything could be asked."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim(0)
    return True
