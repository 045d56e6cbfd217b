"""Assembly: verify every chunk output and publish one ordered embedding matrix, whole or not at all.

The matrix is appended to one chunk at a time, so memory stays flat in the corpus
size. The result is built in a local directory under a temporary name; on a filesystem store it is
renamed into place only when whole, on an object store its files are uploaded and its manifest, the
commit marker that readers look for, is uploaded last.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from chunkq.jobs.errors import AssemblyError, BadInputError
from chunkq.jobs.manifest import RunManifest, load_manifest
from chunkq.jobs.storage import exchange_dirs, is_local, private_dirs, private_open, publish_file, remove_tree
from chunkq.jobs.store import (
    RunLayout,
    atomic_write_json,
    file_sha256,
    load_npy,
    read_chunk_input,
    read_json,
    verify_output,
)
from chunkq.supervisor.progress import Failure

log = logging.getLogger(__name__)


RESULT_FILES = {"embeddings.npy": "embeddings_sha256", "ids.jsonl": "ids_sha256"}


def _npy_shape(path: Path) -> tuple[tuple[int, ...], str]:
    """The shape and dtype an .npy file's header declares, read without loading the array."""
    with path.open("rb") as fh:
        version = np.lib.format.read_magic(fh)
        read = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, _fortran, dtype = read(fh)
    return tuple(shape), dtype.str


def result_disagreement(layout: RunLayout, result: Any, manifest: RunManifest) -> list[str]:
    """How the result manifest disagrees with the run's manifest or its own embeddings.npy header
    (cheap: no hashing). An edited result manifest keeps checksums that still match its files, so
    only the run manifest can tell that its rows, model or options are not the run's."""
    if not isinstance(result, dict):
        return ["result/manifest.json is not a JSON object"]
    problems = [
        f"result/manifest.json says {key} {result.get(key)!r}, the run's manifest {value!r}"
        for key, value in (
            ("fingerprint", manifest.fingerprint),
            ("model", manifest.model),
            ("options", manifest.options),
            ("corpus_rows", manifest.rows),
        )
        if result.get(key) != value
    ]
    missing = result.get("missing") or []
    try:
        expected_rows = manifest.rows - sum(int(m["rows"]) for m in missing)
    except (TypeError, KeyError, ValueError):
        return [*problems, "result/manifest.json lists missing chunks it cannot describe"]
    if result.get("rows") != expected_rows or bool(result.get("complete")) == bool(missing):
        problems.append(
            f"result/manifest.json says {result.get('rows')!r} rows (complete: {result.get('complete')!r}), "
            f"the run's manifest and its missing chunks make {expected_rows}"
        )
    embeddings = layout.result / "embeddings.npy"
    try:
        shape, dtype = _npy_shape(embeddings)
    except (OSError, ValueError) as exc:
        return [*problems, f"embeddings.npy unreadable: {exc}"]
    if shape != (expected_rows, result.get("dim")) or dtype != "<f4":
        problems.append(
            f"embeddings.npy holds {shape} {dtype}, expected ({expected_rows}, {result.get('dim')!r}) <f4"
        )
    return problems


def result_damage(layout: RunLayout, result: dict[str, Any]) -> list[str]:
    """What in the published result does not match its manifest's checksums (empty: intact)."""
    problems = []
    for name, key in RESULT_FILES.items():
        path = layout.result / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif file_sha256(path) != result.get(key):
            problems.append(f"{name} does not match the checksum in result/manifest.json")
    return problems


def read_result_manifest(layout: RunLayout) -> Any:
    """The published result's manifest.json, parsed; None when there is none, {} when unreadable."""
    path = layout.result / "manifest.json"
    try:
        return read_json(path) if path.is_file() else None
    except (OSError, ValueError):
        return {}


def check_published(layout: RunLayout, manifest: RunManifest, checksums: bool = True) -> list[str]:
    """Everything wrong with the published result (empty: whole, intact and this run's)."""
    return result_problems(layout, read_result_manifest(layout), manifest, checksums)


def result_problems(
    layout: RunLayout, result: Any, manifest: RunManifest, checksums: bool = True
) -> list[str]:
    """``check_published`` for a result manifest already read (``read_result_manifest``)."""
    if result is None:
        return [f"no result is published in {layout.result}"]
    problems = result_disagreement(layout, result, manifest)
    if problems or not checksums:
        return problems
    return result_damage(layout, result)


def published_result(layout: RunLayout, manifest: RunManifest) -> dict[str, Any] | None:
    """The published result manifest if a whole, intact one exists for this very run, else None.

    Its files are checked against the run's manifest and the result manifest's checksums: a damaged
    result is never vouched for; it is assembled again from the chunk outputs.
    """
    result = read_result_manifest(layout)
    if result is None:
        return None
    if isinstance(result, dict) and result.get("fingerprint") == manifest.fingerprint:
        if not result.get("complete", True):
            return None  # partial: a rerun tries the missing chunks again
    damage = result_problems(layout, result, manifest)
    if damage:
        log.warning(
            "run %s: the published result is damaged (%s); assembling it again from the chunk outputs",
            manifest.run_id,
            "; ".join(damage),
        )
        return None
    return dict(result)


class Verified(NamedTuple):
    """What the result needs of one verified chunk output."""

    dim: int
    worker: str
    device: str
    seconds: float

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Verified:
        try:
            seconds = float(meta.get("seconds") or 0.0)
        except (TypeError, ValueError):
            seconds = 0.0
        return cls(int(meta["dim"]), str(meta.get("worker")), str(meta.get("device")), seconds)


def _verify_all(layout: RunLayout, manifest: RunManifest, skip: set[int]) -> tuple[list[Verified], list[str]]:
    """Each chunk output whole and the run's, all of one dimension. A bad output is set aside, so
    the next run encodes it again; its problem is listed either way."""
    # Only what the result needs of each output (its dimension, who and how long): a run of 10^5
    # chunks must not hold 10^5 metadata dicts.
    metas: dict[int, Verified] = {}
    problems = []
    producer = manifest.producer()
    for index in range(manifest.chunks):
        if index in skip:
            continue
        meta, why = verify_output(layout, index, manifest.chunk_rows(index), producer)
        if meta is None:
            problems.append(_set_aside_because(layout, manifest, index, why))
        else:
            metas[index] = Verified.of(meta)
    # The dimension the model gives is the one most chunks have: a lone output of another dimension
    # is the odd one out, not the healthy chunks around it.
    dims = Counter(m.dim for m in metas.values())
    if len(dims) > 1:
        dim, _ = dims.most_common(1)[0]
        for index in [i for i, m in metas.items() if m.dim != dim]:
            why = f"dimension {metas.pop(index).dim}, while {dims[dim]} other chunk(s) have {dim}"
            problems.append(_set_aside_because(layout, manifest, index, why))
    return list(metas.values()), problems


def _set_aside_because(layout: RunLayout, manifest: RunManifest, index: int, why: str) -> str:
    first, rows = manifest.first_row(index), manifest.chunk_rows(index)
    aside = set_aside(layout, index)
    again = f"; moved to {aside}, the next run encodes it again" if aside else ""
    return f"chunk {index} (rows {first}-{first + rows - 1}): {why}{again}"


def set_aside(layout: RunLayout, index: int) -> str:
    """Move a chunk's damaged output out of the way (kept for a look, never read again), so the
    next run counts the chunk as not done and encodes it again; where it went, or "" if nothing."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S%f")
    moved = ""
    for path in (layout.output_meta(index), layout.output_npy(index)):  # the commit marker first
        if path.exists():
            target = layout.damaged_outputs / f"{path.stem}-{stamp}{path.suffix}"
            if is_local(path):
                publish_file(path, target)
            else:
                _move_remote(path, target)
            moved = str(layout.damaged_outputs)
    if moved:
        log.warning(
            "run %s: chunk %d's output is damaged; moved to %s, to be encoded again",
            layout.run_id,
            index,
            moved,
        )
    return moved


def _move_remote(path: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        local = Path(scratch) / path.name
        local.write_bytes(path.read_bytes())
        publish_file(local, target)
    path.unlink()


def _write_result(
    layout: RunLayout, manifest: RunManifest, tmp: Path, dim: int, skip: set[int], total: int
) -> dict[str, Any]:
    # Plain appends, not a memory map: dirty pages of a map count as the process's resident memory
    # until written back, which made assembly's peak RSS grow with the matrix.
    header = {
        "descr": np.lib.format.dtype_to_descr(np.dtype("<f4")),
        "fortran_order": False,
        "shape": (total, dim),
    }
    written = 0
    with (
        private_open(tmp / "embeddings.npy", "wb") as matrix,
        private_open(tmp / "ids.jsonl", "w", encoding="utf-8") as ids_out,
    ):
        np.lib.format.write_array_header_1_0(matrix, header)
        for index in range(manifest.chunks):
            if index in skip:
                continue
            rows = manifest.chunk_rows(index)
            ids, _ = read_chunk_input(layout, index)
            if len(ids) != rows:
                raise BadInputError(f"chunk {index}: input holds {len(ids)} rows, the manifest says {rows}")
            block = np.ascontiguousarray(load_npy(layout.output_npy(index)), dtype="<f4")
            if block.shape != (rows, dim):
                raise BadInputError(
                    f"chunk {index}: output has shape {block.shape}, expected ({rows}, {dim})"
                )
            matrix.write(block.data)
            written += rows
            ids_out.writelines(json.dumps(rid, ensure_ascii=False) + "\n" for rid in ids)
        if written != total:
            raise BadInputError(f"assembled {written} rows, the manifest expects {total}")
        for fh in (matrix, ids_out):
            fh.flush()
            os.fsync(fh.fileno())
    return {
        "embeddings_sha256": file_sha256(tmp / "embeddings.npy"),
        "ids_sha256": file_sha256(tmp / "ids.jsonl"),
    }


def _publish(built: Path, result: Path) -> None:
    """Put a whole result directory in place; readers trust it only once its manifest.json exists."""
    if is_local(result):
        if not result.exists():
            os.rename(built, result)
        elif exchange_dirs(built, result):  # in one step: readers see the old result or the new one
            shutil.rmtree(built)
        else:  # no exchange here: the shortest window, the old result renamed aside first
            old = result.with_name(f".result.old-{os.getpid()}")
            os.rename(result, old)
            os.rename(built, result)
            shutil.rmtree(old)
        return
    (result / "manifest.json").unlink(missing_ok=True)  # uncommit a stale result before replacing its files
    remove_tree(result)
    for name in ("embeddings.npy", "ids.jsonl", "manifest.json"):
        publish_file(built / name, result / name)


def assemble(
    layout: RunLayout, missing: list[Failure] | None = None, fence: Callable[[], None] | None = None
) -> dict[str, Any]:
    """Verify every chunk and publish ``result/``; raise AssemblyError naming every problem.

    ``missing`` (``--allow-partial``) leaves those chunks out; the result manifest then says
    ``complete: false`` and lists their row ranges and errors, so a partial result is never silent.
    ``fence`` raises if this process no longer owns the run (``StoreLock.check``): it is called
    just before the result is put in place, so a supervisor that lost its lock never publishes.
    """
    manifest = load_manifest(layout)
    existing = published_result(layout, manifest)
    if existing is not None:
        return existing
    skip = {f.chunk: f for f in missing or []}
    metas, problems = _verify_all(layout, manifest, set(skip))
    if problems:
        raise AssemblyError(manifest.run_id, problems)
    if not metas:
        raise AssemblyError(manifest.run_id, ["no chunk of the run has an output"])
    dim = metas[0].dim
    total = manifest.rows - sum(f.rows for f in skip.values())
    if is_local(layout.root):
        tmp = layout.root / f".result.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        private_dirs(tmp)
    else:
        tmp = Path(tempfile.mkdtemp(prefix=f"chunkq-result-{manifest.run_id}-"))
    try:
        digests = _write_result(layout, manifest, tmp, dim, set(skip), total)
        missing_rows = [
            {
                "chunk": f.chunk,
                "first_row": f.first_row,
                "rows": f.rows,
                "error_class": f.error_class,
                "error": f.error,
            }
            for f in skip.values()
        ]
        result = {
            **manifest.data,
            **digests,
            "complete": not skip,
            "corpus_rows": manifest.rows,
            "rows": total,
            "missing": missing_rows,
            "dim": dim,
            "dtype": "float32",
            "assembled_at": datetime.now(UTC).isoformat(),
            "workers": sorted({m.worker for m in metas}),
            "devices": sorted({m.device for m in metas}),
            "encode_seconds": round(sum(m.seconds for m in metas), 3),
        }
        atomic_write_json(tmp / "manifest.json", result)
        if fence is not None:
            fence()
        _publish(tmp, layout.result)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if skip:
        log.warning(
            "run %s: published a PARTIAL result: %d of %d rows; %d chunk(s) missing",
            manifest.run_id,
            total,
            manifest.rows,
            len(skip),
        )
    log.info("run %s: published %d x %d embeddings in %s", manifest.run_id, total, dim, layout.result)
    return result
