"""``faiss:PATH``: a FAISS index file of the result (``--index``: a FAISS factory string, ``Flat`` by
default; ``HNSW32``, ``IVF4096,PQ64``, ...), inner product where the run's vectors are unit length
(so its scores are cosines), L2 otherwise, and ``PATH.ids.jsonl`` beside it: the id of each of the
index's rows, in order (FAISS ids are those row numbers). An index that must be trained is trained on
a sample of the run (``TRAIN_ROWS``, spread over it). The index is built whole in memory and both
files are put in place by rename: a killed export leaves the files as they were, a second export
replaces them (an index cannot hold a row twice).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.errors import ConfigError
from chunkq.jobs.storage import private_open
from chunkq.sinks import Rows

TRAIN_ROWS = 100_000  # at most this many rows train an IVF or PQ index, taken evenly over the run


class FaissSink:
    def __init__(self, url: str, factory: str) -> None:
        self.path = Path(url[len("faiss:") :]).expanduser()
        if not self.path.name or not self.path.parent.is_dir():
            raise ConfigError(f"--to {url}: expected faiss:PATH, a file in an existing folder")
        self.factory = factory
        self.held: list[np.ndarray[Any, Any]] = []
        self.ids: list[str] = []

    def open(self, rows: Rows) -> None:
        if rows.columns:
            raise ConfigError("an index file holds vectors only: --columns is for a table")
        if rows.dtype not in ("float32", "float16"):
            raise ConfigError(f"a FAISS index holds float vectors; this run's are {rows.dtype}")
        self.rows = rows

    def write(self, ids: list[str], vectors: np.ndarray[Any, Any], columns: dict[str, list[Any]]) -> None:
        self.held.append(np.asarray(vectors, dtype=np.float32))
        self.ids += ids

    def close(self) -> dict[str, Any]:
        import faiss

        vectors = np.concatenate(self.held) if self.held else np.empty((0, self.rows.dim), np.float32)
        metric = faiss.METRIC_INNER_PRODUCT if self.rows.normalized else faiss.METRIC_L2
        try:
            index = faiss.index_factory(self.rows.dim, self.factory, metric)
        except RuntimeError as exc:
            raise ConfigError(
                f"--index {self.factory!r}: FAISS cannot build it: {str(exc).splitlines()[0]}"
            ) from None
        if not index.is_trained:
            step = max(1, len(vectors) // TRAIN_ROWS)
            index.train(vectors[::step])
        index.add(vectors)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        ids_path = self.path.with_name(self.path.name + ".ids.jsonl")
        ids_tmp = ids_path.with_name(f".{ids_path.name}.tmp-{os.getpid()}")
        faiss.write_index(index, str(tmp))
        with private_open(ids_tmp, "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in self.ids)
        # Two renames a moment apart: a kill between them leaves the new ids beside the old index
        # (as many rows when the run is the same); the next export puts both right.
        os.replace(ids_tmp, ids_path)
        os.replace(tmp, self.path)
        metric_name = "inner_product" if self.rows.normalized else "l2"
        return {
            "index": self.factory,
            "metric": metric_name,
            "index_rows": int(index.ntotal),
            "ids": str(ids_path),
        }

    def abort(self) -> None:
        self.held.clear()
