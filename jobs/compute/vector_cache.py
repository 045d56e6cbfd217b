"""The store's vector cache: float32 vectors of texts already encoded, keyed by the text's bytes and
everything that makes its vector. Derived data: deleting it loses nothing but time.

    <store>/cache/<producer>/producer.json              what made the vectors: the model's identity
                                                        (its files' hash or hub commit) and options
    <store>/cache/<producer>/shards/<name>.hashes.npy   N x 16 bytes: sha256 of each text, truncated
    <store>/cache/<producer>/shards/<name>.vectors.npy  N x dim float32, the same order
    <store>/cache/<producer>/shards/<name>.json         the commit marker, written last: rows, dim,
                                                        checksums (the hashes whole, the vectors per
                                                        block of BLOCK_ROWS), run, encode seconds
    <store>/cache/<producer>/usage/<run>-<stamp>.json   each run's look-ups: rows hit, rows written
    <store>/cache/<producer>/damaged/                   shards that failed a check, never read again

A shard is written once, by one run's assembly, under a name no other writer uses, and never
changed: two runs writing at once add two shards and touch nothing of each other's. A look-up reads
each shard's hashes (16 bytes a text, one request a shard) and joins them with the corpus's
(supervisor.submit.plan), so its cost is bytes, not a request per text. Vectors are read by block, each
block checked against its checksum before any row of it is used; a shard that fails any check is
moved to ``damaged/`` (deleted, on an object store) and its texts are encoded again. This module
is the only reader and writer of ``cache/``: submit, assembly and ``chunkq cache`` go through it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs import kinds
from chunkq.jobs.compute import ov_backend
from chunkq.jobs.contract.release import releases
from chunkq.jobs.contract.run_files import atomic_write_json, read_json, save_npy_atomic
from chunkq.jobs.contract.specs import OPENVINO, EncodeOptions, fingerprint, vector_options
from chunkq.jobs.contract.storage import (
    is_local,
    list_dirs,
    list_names,
    no_links_below,
    open_store,
    private_dirs,
    publish_file,
)

log = logging.getLogger(__name__)

# Part of every producer key: a change to how vectors are made or kept starts afresh. 2: every option
# that changes a vector is in the key (format 1 left out --role). 3: tokenizers and torch are in the
# key, and whole releases of the others (format 2 kept major.minor of two libraries).
CACHE_FORMAT = 3
HASH_BYTES = 16  # 128 bits: at 10^9 texts a collision has odds of about 10^-21
BLOCK_ROWS = 1024  # vectors checked a block at a time: a hit reads and verifies one block, not the shard
ORPHAN_SECONDS = 3600  # a shard's files without their marker this long after: a writer that died
SHARD_BYTES = 256 << 20  # vectors a shard holds at most; a run writes as many shards as it needs


def _copied(source: Path, target: Path) -> Path:
    with source.open("rb") as src, target.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    return target


class CacheDamage(Exception):
    """A cache shard failed a check; it has been set aside."""


def block_digests(vectors: np.ndarray[Any, Any]) -> list[str]:
    """The sha256 of each BLOCK_ROWS rows of a shard's float32 ``vectors``, as its marker keeps them."""
    rows = np.ascontiguousarray(vectors, dtype="<f4")
    return [
        hashlib.sha256(rows[i : i + BLOCK_ROWS].tobytes()).hexdigest()
        for i in range(0, len(rows), BLOCK_ROWS)
    ]


def text_hashes(texts: Iterable[str]) -> np.ndarray[Any, Any]:
    """Each text's key: the first HASH_BYTES of the sha256 of its UTF-8 bytes, as an (n,) 'S16'
    array (fixed-width bytes compare and sort as the hashes do)."""
    digests = b"".join(
        hashlib.sha256(t.encode("utf-8", "surrogatepass")).digest()[:HASH_BYTES] for t in texts
    )
    return np.frombuffer(digests, dtype=f"S{HASH_BYTES}").copy()


# The libraries that turn a model's files into vectors, and how much of each release is in the key.
# sentence-transformers, transformers and tokenizers whole: their releases change which
# tokens a text becomes and how they are pooled (sentence-transformers 6 reads a model's maximum
# length from its tokenizer's config, where 5 read sentence_bert_config.json), and a patch release
# can fix a tokeniser's normalisation, which moves a vector by far more than any tolerance. torch by
# major.minor: a minor release can change which attention kernel runs by default; its patch releases
# move an fp32 vector by ~1e-7, 100x below the 1e-5 a CPU result is held to and below what the batch a
# row lands in moves it on a GPU (up to 3e-4), so a vector from the previous patch release is as
# good as one encoded again, and re-encoding the store after each patch release would buy nothing.
VECTOR_LIBRARIES = {"sentence-transformers": 3, "transformers": 3, "tokenizers": 3, "torch": 2}


@functools.cache
def _library_versions() -> tuple[tuple[str, str], ...]:
    return tuple(releases(VECTOR_LIBRARIES).items())


def library_versions() -> dict[str, str]:
    """This process's releases of VECTOR_LIBRARIES (read once: importlib.metadata parses each
    package's metadata, 6 ms a call, which every chunk's output records)."""
    return dict(_library_versions())


def producer(model: str, model_identity: str, options: EncodeOptions) -> dict[str, Any]:
    """What decides a text's vector, beside the text: the model's identity (the hash of its files or
    its hub commit, never only its name), every option that changes a vector (the options say which
    they are: ``specs.vector_options``: the backend and precision among them) and the releases of the
    libraries that compute it (OpenVINO's too, for its backend)."""
    libraries = library_versions()
    if options.backend == OPENVINO:
        libraries = {**libraries, **ov_backend.releases()}
    return {
        "cache_format": CACHE_FORMAT,
        "model": model,
        "model_identity": model_identity,
        "options": vector_options(options),
        "libraries": libraries,
    }


def producer_key(described: dict[str, Any]) -> str:
    """The folder name of a producer's vectors: its description's fingerprint (model and options)."""
    return fingerprint({k: v for k, v in described.items() if k != "model"})[:32]


@dataclass(frozen=True)
class Shard:
    """One committed shard: its marker's contents and where its files are."""

    folder: Path
    name: str
    meta: dict[str, Any]

    @property
    def rows(self) -> int:
        return int(self.meta["rows"])

    @property
    def dim(self) -> int:
        return int(self.meta["dim"])

    def path(self, suffix: str) -> Path:
        return self.folder / f"{self.name}{suffix}"


class VectorCache:
    """The cache of one store, seen through one producer (``key``) or all of them."""

    def __init__(self, store: str | Path, key: str | None = None) -> None:
        self.store = open_store(store)
        self.root = no_links_below(self.store, self.store / "cache")
        self.key = key

    def _dir(self, *parts: str) -> Path:
        if self.key is None:
            raise ValueError("no producer chosen")
        return no_links_below(self.store, self.root.joinpath(self.key, *parts))

    # --- reading -------------------------------------------------------------------------------

    def shards(self) -> list[Shard]:
        """The producer's committed shards, oldest first; an unreadable marker sets its shard aside."""
        folder = self._dir("shards")
        found = []
        for name in sorted(list_names(folder)):
            if not name.endswith(".json"):
                continue
            stem = name[: -len(".json")]
            try:
                meta = read_json(folder / name)
                if not isinstance(meta, dict) or meta.get("producer") != self.key:
                    raise ValueError("it is not a shard of this producer")
                int(meta["rows"]), int(meta["dim"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                self.set_aside(Shard(folder, stem, {}), f"marker unreadable: {exc}")
                continue
            found.append(Shard(folder, stem, meta))
        return sorted(found, key=lambda s: (str(s.meta.get("created_at", "")), s.name))

    def hashes(self, shard: Shard) -> np.ndarray[Any, Any]:
        """A shard's text hashes, checked whole against its marker; CacheDamage if they are not."""
        path = shard.path(".hashes.npy")
        try:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != shard.meta.get("hashes_sha256"):
                raise ValueError("the hashes do not match their checksum")
            array: np.ndarray[Any, Any] = np.load(io.BytesIO(data), allow_pickle=False)
            if array.shape != (shard.rows,) or array.dtype != np.dtype(f"S{HASH_BYTES}"):
                raise ValueError(f"the hashes have shape {array.shape} and dtype {array.dtype}")
        except (OSError, ValueError) as exc:
            raise self.set_aside(shard, str(exc)) from exc
        return array

    def vectors(self, shard: Shard, positions: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The float32 rows at ``positions`` (ascending) of a shard, each block they fall in read once
        and checked against its checksum first; CacheDamage (the shard set aside) if one is not."""
        digests = shard.meta.get("blocks") or []
        block_rows = int(shard.meta.get("block_rows", BLOCK_ROWS))
        row_bytes = shard.dim * 4
        out = np.empty((len(positions), shard.dim), dtype=np.float32)
        try:
            with shard.path(".vectors.npy").open("rb") as fh:
                header = _npy_data_offset(fh, (shard.rows, shard.dim))
                blocks = positions // block_rows
                for block in np.unique(blocks):
                    first = int(block) * block_rows
                    rows = min(block_rows, shard.rows - first)
                    fh.seek(header + first * row_bytes)
                    data = fh.read(rows * row_bytes)
                    if int(block) >= len(digests) or hashlib.sha256(data).hexdigest() != digests[int(block)]:
                        raise ValueError(f"block {int(block)} does not match its checksum")
                    array = np.frombuffer(data, dtype="<f4").reshape(rows, shard.dim)
                    where = np.flatnonzero(blocks == block)
                    out[where] = array[positions[where] - first]
        except (OSError, ValueError) as exc:
            raise self.set_aside(shard, str(exc)) from exc
        if not np.isfinite(out).all():
            raise self.set_aside(shard, "it holds NaN or infinite values")
        return out

    def set_aside(self, shard: Shard, why: str) -> CacheDamage:
        """Move a damaged shard to ``damaged/`` (marker first, so no reader takes it meanwhile)."""
        if shard.meta.get("until_published") and not shard.path(".json").exists():
            log.info("vector cache: shard %s went as its run published; its texts are encoded", shard.name)
            return CacheDamage(f"cache shard {shard.name}: replaced by its run's result")
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        target = self._dir("damaged")
        for suffix in (".json", ".hashes.npy", ".vectors.npy"):
            path = shard.path(suffix)
            try:
                if is_local(path):
                    if path.exists():
                        publish_file(path, target / f"{shard.name}-{stamp}{suffix}")
                else:
                    path.unlink()
            except (FileNotFoundError, OSError):
                continue
        log.warning(
            "vector cache: shard %s of %s is damaged (%s); set aside, its texts are encoded again",
            shard.name,
            self.key,
            why,
        )
        return CacheDamage(f"cache shard {shard.name}: {why}")

    # --- writing -------------------------------------------------------------------------------

    def check_canary(self, canary: list[list[float]]) -> float | None:
        """For a model that brings its own code: its vectors of ``model_code.CANARY_TEXTS`` now,
        against those kept when this producer's cache was first filled (kept now where none is):
        None while they agree within ``SAME_CACHE_DIFF``, else how far they moved. What its code
        read that chunkq cannot list (an environment variable, a file native code opened) shows
        here, and no vector its earlier behaviour made is served."""
        from chunkq.jobs.compute import model_code

        path = self._dir("canary.json")
        if not path.is_file():
            atomic_write_json(path, {"texts": list(model_code.CANARY_TEXTS), "vectors": canary})
            return None
        try:
            kept = read_json(path).get("vectors")
        except (OSError, ValueError, AttributeError):
            kept = None
        moved = model_code.canary_difference(canary, kept)
        if moved is None:  # damaged or of another shape: trust nothing the cache holds for it
            return float("inf")
        return moved[0] if moved[0] > model_code.SAME_CACHE_DIFF else None

    def describe(self, described: dict[str, Any]) -> None:
        """Write producer.json once: what made this producer's vectors, for ``chunkq cache``."""
        path = self._dir("producer.json")
        if not path.is_file():
            atomic_write_json(path, described)

    def write(
        self,
        hashes: np.ndarray[Any, Any],
        vectors: np.ndarray[Any, Any],
        run_id: str,
        encode_seconds: float,
    ) -> list[str]:
        """Add ``vectors`` (float32, one row per hash) as shards of at most SHARD_BYTES; the names written."""
        if not len(hashes):
            return []
        per_shard = max(BLOCK_ROWS, SHARD_BYTES // max(1, vectors.shape[1] * 4) // BLOCK_ROWS * BLOCK_ROWS)
        names = []
        for start in range(0, len(hashes), per_shard):
            part = slice(start, start + per_shard)
            share = encode_seconds * min(per_shard, len(hashes) - start) / len(hashes)
            names.append(self._write_shard(hashes[part], vectors[part], run_id, share))
        return names

    def _write_shard(
        self, hashes: np.ndarray[Any, Any], vectors: np.ndarray[Any, Any], run_id: str, seconds: float
    ) -> str:
        name = self._new_name(run_id)
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        save_npy_atomic(self._dir("shards") / f"{name}.vectors.npy", vectors)
        self._commit(name, hashes, int(vectors.shape[1]), block_digests(vectors), run_id, seconds)
        return name

    def link_shard(
        self,
        hashes: np.ndarray[Any, Any],
        vectors_npy: Path,
        dim: int,
        blocks: list[str],
        run_id: str,
        seconds: float,
        until_published: bool = False,
    ) -> str:
        """Add a shard whose vectors are a file already written and checked (a published result's
        float32 ``.npy``, its checksums per BLOCK_ROWS rows ``blocks``) under a second name, a hard
        link: one copy on disk serves the result and the cache, and either may be deleted without
        the other losing a byte. A store where a link cannot be made (another filesystem, an object
        store) gets a copy. ``until_published``: a finished chunk's output, serving while its run
        goes on, forgotten when the run's result takes its place (``forget_early``). The name."""
        name = self._new_name(run_id)
        target = self._dir("shards") / f"{name}.vectors.npy"
        if is_local(target):
            private_dirs(Path(target).parent)
        try:
            if not is_local(target) or not is_local(vectors_npy):
                raise OSError("not a filesystem")
            os.link(vectors_npy, target)
        except OSError:  # a copy, made aside and moved (or uploaded) into place whole
            with tempfile.TemporaryDirectory(prefix="chunkq-cache-") as scratch:
                publish_file(_copied(vectors_npy, Path(scratch) / "vectors.npy"), target)
        self._commit(name, hashes, dim, blocks, run_id, seconds, until_published)
        return name

    def forget_early(self, run_id: str) -> int:
        """Remove the shards of ``run_id``'s finished chunks (``link_shard(until_published=True)``),
        by any supervisor of it, the marker first: the run's result serves their rows now. A reader
        that found one before it went encodes its texts (``set_aside``). How many went."""
        gone = 0
        for shard in self.shards():
            if shard.meta.get("run_id") == run_id and shard.meta.get("until_published"):
                for suffix in (".json", ".hashes.npy", ".vectors.npy"):
                    with contextlib.suppress(FileNotFoundError):
                        shard.path(suffix).unlink()
                gone += 1
        return gone

    def _new_name(self, run_id: str) -> str:
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        return f"{run_id[:40]}-{stamp}-{secrets.token_hex(4)}"

    def _commit(
        self,
        name: str,
        hashes: np.ndarray[Any, Any],
        dim: int,
        blocks: list[str],
        run_id: str,
        seconds: float,
        until_published: bool = False,
    ) -> None:
        """The shard's hashes, then its marker, the commit: readers see it whole or not at all."""
        folder = self._dir("shards")
        hashes = np.ascontiguousarray(hashes, dtype=f"S{HASH_BYTES}")
        hashes_sha = save_npy_atomic(folder / f"{name}.hashes.npy", hashes)
        atomic_write_json(
            folder / f"{name}.json",
            {
                "producer": self.key,
                "rows": len(hashes),
                "dim": dim,
                "hashes_sha256": hashes_sha,
                "block_rows": BLOCK_ROWS,
                "blocks": blocks,
                "run_id": run_id,
                "encode_seconds": round(seconds, 3),
                "created_at": datetime.now(UTC).isoformat(),
                **({"until_published": True} if until_published else {}),
            },
        )

    def record_use(self, run_id: str, **counts: int) -> None:
        """One file per run's look-up (no file is shared, so concurrent runs never contend)."""
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
        atomic_write_json(
            self._dir("usage", f"{run_id[:60]}-{stamp}.json"),
            {"run_id": run_id, "at": datetime.now(UTC).isoformat(), **counts},
        )

    # --- the whole cache -----------------------------------------------------------------------

    def producers(self) -> Iterator[str]:
        yield from sorted(list_dirs(self.root))


def _npy_data_offset(fh: Any, shape: tuple[int, int]) -> int:
    """Where a float32 .npy file's data starts, once its header says ``shape`` C-ordered <f4."""
    version = np.lib.format.read_magic(fh)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    found, fortran, dtype = read(fh)
    if tuple(found) != shape or fortran or dtype != np.dtype("<f4"):
        raise ValueError(f"the vectors hold {tuple(found)} {dtype}, the marker says {shape} <f4")
    return int(fh.tell())


def cache_enabled(requested: bool | None, options: EncodeOptions) -> bool:
    """``--cache``/``--no-cache`` as given, else on for float outputs (quantized runs ask for it);
    never for a ragged kind (sparse vectors: the cache holds rows of one width), nor for images
    (a row's text is where the image is, not what it is)."""
    kind = kinds.KINDS.get(options.kind)
    if kind is not None and not kind.cached:
        return False
    return requested if requested is not None else options.output_dtype in ("float32", "float16")
