"""``faiss:PATH``: a FAISS index file of the result (``--index``: a FAISS factory string, ``Flat`` by
default; ``HNSW32``, ``IVF4096,PQ64``, ...), inner product where the run's vectors are unit length
(so its scores are cosines), L2 otherwise, and ``PATH.ids.jsonl`` beside it: the id of each of the
index's rows, in order (FAISS ids are those row numbers). An index that must be trained is trained on
a sample of the run (``TRAIN_ROWS``, spread over it). The index is built whole in memory and both
files are put in place by rename: a killed export leaves the files as they were (what it was
building is removed by the next export to that path), a second export replaces them (an index
cannot hold a row twice). Only an index chunkq wrote is replaced: any other file at PATH, or at its
ids' path, only with ``--force``; a folder, or a path inside the store, never.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.redaction import redacted
from chunkq.jobs.contract.storage import private_open, remove_leftovers_beside, temp_beside
from chunkq.sinks.rows import Rows

# FAISS says at INFO, at every import, which CPU builds it tried ("Could not load library with AVX512
# support due to: ModuleNotFoundError..."): six lines of noise before an export's own.
logging.getLogger("faiss.loader").setLevel(logging.WARNING)

TRAIN_ROWS = 100_000  # at most this many rows train an IVF or PQ index, taken evenly over the run


FAISS_MAGIC = b"I"  # every index FAISS writes starts with a fourcc of its type: IxF2, IxFI, IHNf, IwPQ...


def ids_path_of(path: Path) -> Path:
    return path.with_name(path.name + ".ids.jsonl")


def written_by_chunkq(path: Path) -> bool:
    """Whether ``path`` is an index an export wrote: a FAISS file with its ids beside it."""
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError:
        return False
    return len(magic) == 4 and magic.startswith(FAISS_MAGIC) and ids_path_of(path).is_file()


class FaissSink:
    whole = True  # built in memory, renamed into place at close

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        """``options``: ``index`` (a FAISS factory string, Flat by default), ``force``."""
        factory, force = str(options.get("index") or "Flat"), bool(options.get("force"))
        self.path = Path(url[len("faiss:") :]).expanduser()
        if not self.path.name or not self.path.parent.is_dir():
            raise ConfigError(f"--to {redacted(url)}: expected faiss:PATH, a file in an existing folder")
        self.url, self.force = url, force
        self.label = f"--to {redacted(url)}"
        self.ids_path = ids_path_of(self.path)
        self.factory = factory
        self.blocks: list[np.ndarray[Any, Any]] = []
        self.ids: list[str] = []

    def writes_to(self) -> list[str]:
        return [str(self.path), str(self.ids_path)]

    def open(self, rows: Rows) -> None:
        if self.path.is_dir():
            raise ConfigError(f"{self.label}: {self.path} is a folder; give the index file's path in it")
        ours = written_by_chunkq(self.path)
        for path in (self.path, self.ids_path):
            if path.exists() and not ours and not self.force:
                raise ConfigError(
                    f"{self.label}: {path} exists and is not an index chunkq wrote (one with its "
                    ".ids.jsonl beside it); give another path, or --force to replace it"
                )
        if rows.columns:
            raise ConfigError("an index file holds vectors only: --columns is for a table")
        if rows.kind != "dense":
            raise ConfigError(
                f"a FAISS index holds dense vectors; run {rows.run_id} is {rows.kind}: export it to "
                "lancedb:// or postgresql:// (or as Parquet)"
            )
        if rows.dtype not in ("float32", "float16"):
            raise ConfigError(f"a FAISS index holds float vectors; this run's are {rows.dtype}")
        self.rows = rows

    def columns(self) -> set[str]:
        return set()

    def held(self) -> None:
        return None  # an index file is built whole, for one run

    def prepare(self) -> None:
        pass

    def write(self, ids: list[str], vectors: np.ndarray[Any, Any], columns: dict[str, list[Any]]) -> None:
        self.blocks.append(np.asarray(vectors, dtype=np.float32))
        self.ids += ids

    def close(self) -> dict[str, Any]:
        import faiss

        vectors = np.concatenate(self.blocks) if self.blocks else np.empty((0, self.rows.dim), np.float32)
        metric = faiss.METRIC_INNER_PRODUCT if self.rows.normalized else faiss.METRIC_L2
        try:
            index = faiss.index_factory(self.rows.dim, self.factory, metric)
        except RuntimeError as exc:
            raise ConfigError(
                f"--index {self.factory!r}: FAISS cannot build it: {str(exc).splitlines()[0]}"
            ) from None
        if not index.is_trained:
            step = max(1, len(vectors) // TRAIN_ROWS)
            self._train(index, vectors[::step])
        index.add(vectors)
        ids_path = self.ids_path
        for path in (self.path, ids_path):
            remove_leftovers_beside(path)  # what a killed export left building (27-307 MB seen)
        tmp, ids_tmp = temp_beside(self.path), temp_beside(ids_path)
        try:
            faiss.write_index(index, str(tmp))
            with private_open(ids_tmp, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in self.ids)
        except BaseException:  # a full disk, or a kill's exception: nothing half-built is left
            tmp.unlink(missing_ok=True)
            ids_tmp.unlink(missing_ok=True)
            raise
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

    def _train(self, index: Any, sample: np.ndarray[Any, Any]) -> None:
        """Train on ``sample``; a run too small for the index is said with the rows it needs."""
        try:
            index.train(sample)
        except RuntimeError as exc:
            said = str(exc)
            needed = re.search(r"at least as large as number of clusters \((\d+)\)", said)
            wants = f"at least {needed.group(1)} rows to train" if needed else "more rows to train"
            detail = said.strip().splitlines()[-1] if not needed else ""
            raise ConfigError(
                f"--index {self.factory!r} needs {wants}, and run {self.rows.run_id} has {self.rows.rows}"
                + (f" (FAISS: {detail})" if detail else "")
                + "; choose a smaller index (Flat, HNSW32, or IVF with fewer lists)"
            ) from None

    def abort(self) -> None:
        self.blocks.clear()
