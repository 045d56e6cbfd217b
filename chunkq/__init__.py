"""chunkq: embed large corpora with sentence-transformers; nothing is lost when a process dies.

    import chunkq
    vectors = chunkq.embed(["first text", "second text"])          # a float32 numpy array
    result = chunkq.run("data/*.jsonl", store="chunkq-store")      # paths, rows, rows/s

Both run the machinery of ``chunkq run`` on this machine (see ``chunkq.api``).
The command line is ``chunkq`` (or ``python -m chunkq``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from chunkq.jobs.contract.errors import ChunkqError, ChunksFailedError, ConfigError, CorpusError

if TYPE_CHECKING:
    from chunkq.api import RunResult, embed, run

__all__ = ["ChunkqError", "ChunksFailedError", "ConfigError", "CorpusError", "RunResult", "embed", "run"]
_API = frozenset({"RunResult", "embed", "run"})


def __getattr__(name: str) -> Any:
    # The API on first use: every chunkq process imports this package (a pool, its fork server, each
    # worker), and the front door's imports (the supervisor, submit, the watch) cost them 0.3 s of
    # CPU each for nothing.
    if name in _API:
        from chunkq import api

        return getattr(api, name)
    raise AttributeError(f"module 'chunkq' has no attribute {name!r}")
