"""chunkq: embed large corpora with sentence-transformers; nothing is lost when a process dies.

    import chunkq
    vectors = chunkq.embed(["first text", "second text"])          # a float32 numpy array
    result = chunkq.run("data/*.jsonl", store="chunkq-store")      # paths, rows, rows/s

Both run the machinery of ``chunkq run`` on this machine (see ``chunkq.api``).
The command line is ``chunkq`` (or ``python -m chunkq``).
"""

from chunkq.api import RunResult, embed, run
from chunkq.jobs.contract.errors import ChunkqError, ChunksFailedError, ConfigError, CorpusError

__all__ = ["ChunkqError", "ChunksFailedError", "ConfigError", "CorpusError", "RunResult", "embed", "run"]
