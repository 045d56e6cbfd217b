"""A tripwire: RQ's pickle serializer refuses to load anything in a chunkq process.

chunkq passes ``JSONSerializer`` everywhere, but RQ falls back to pickle wherever a serializer is
not passed (``Worker.all()``, a worker's current job, code we did not write such as rq-dashboard).
Anyone who can write to Redis controls those bytes, and unpickling them runs their code. Replacing
``DefaultSerializer.loads`` turns any such path into a clear error instead of a code execution.
"""

from __future__ import annotations

from typing import Any

from chunkq.jobs.contract.errors import ChunkqError
from chunkq.jobs.queue.rq_api import DefaultSerializer


class PickleRefusedError(ChunkqError):
    """Something asked RQ to unpickle data from Redis."""


def _refuse(data: bytes, /, *args: Any, **kwargs: Any) -> Any:
    raise PickleRefusedError(
        f"refused to unpickle {len(data)} bytes from Redis: chunkq reads only JSON "
        "(data written with RQ's default pickle serializer, or by someone who should not write to Redis)"
    )


def forbid_pickle() -> None:
    """Make RQ's pickle serializer refuse to load, in this process, from now on. Idempotent."""
    DefaultSerializer.loads = _refuse
