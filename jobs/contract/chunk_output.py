"""A chunk output read back and checked, its arrays read once.

In two steps, so that assembly reads each output once: ``output_meta`` checks the metadata (the
commit marker) against the run, reading no array; ``output_arrays`` then reads each array's bytes
once and checks them from those same bytes (checksum, dtype, shape, finite values) before handing
the arrays over. ``verify_output`` is both (a worker's check that a chunk is already done).
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np

from chunkq.jobs.contract.defaults import DEFAULT_OUTPUT_DTYPE
from chunkq.jobs.contract.errors import StoreWriteError
from chunkq.jobs.contract.ragged import OFFSETS, SCHEMAS, entry_shape
from chunkq.jobs.contract.run_files import RunLayout, non_finite_rows, read_json, read_npy_header
from chunkq.jobs.contract.specs import OUTPUT_DTYPES

ROWS = "rows"  # a dense output's matrix among the arrays ``output_arrays`` returns


def npy_from_bytes(raw: bytes) -> np.ndarray[Any, Any]:
    """The array a whole .npy file's bytes hold, read-only over those bytes (no second copy)."""
    fh = io.BytesIO(raw)
    shape, fortran, dtype = read_npy_header(fh)
    array = np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape)), offset=fh.tell())
    return array.reshape(shape, order="F" if fortran else "C")


def not_ours(path: Path, exc: OSError) -> StoreWriteError:
    """A chunk output this process may not read is not damaged: it is set aside for nothing and
    encoded again as another user's file (the hostile pass, on a store shared by two users: "output
    is damaged; moved"). The store must be fixed, as when it refuses a write."""
    return StoreWriteError(
        f"cannot read {path}: {exc.strerror or exc}; the store's files must be readable by this user "
        "(one user runs a store's commands): fix their owner or mode and run the same command again"
    )


def read_checked_npy(path: Path, digest: Any) -> tuple[np.ndarray[Any, Any] | None, str]:
    """The array in ``path``, read once and hashed from the bytes read, or (None, why): missing,
    unreadable, not an array, or not the bytes ``digest`` says."""
    try:
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() != digest:
            return None, f"{path.name} checksum does not match its metadata"
        return npy_from_bytes(raw), ""
    except FileNotFoundError:
        return None, f"{path.name} missing"
    except PermissionError as exc:
        raise not_ours(path, exc) from exc
    except (OSError, ValueError) as exc:
        return None, f"{path.name} unreadable: {exc}"


def producer_mismatch(meta: dict[str, Any], producer: dict[str, Any]) -> str:
    """How a chunk output's record of what produced it differs from the run's, or "" if it agrees."""
    diffs = [key for key, value in producer.items() if meta.get(key) != value]
    if not diffs:
        return ""
    if "run_fingerprint" not in meta:
        return "it records no run fingerprint (written by an older chunkq, or not by chunkq)"
    return f"it was produced with {' and '.join(diffs)} other than the run manifest's"


def output_meta(
    layout: RunLayout, index: int, producer: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """A chunk output's metadata if it commits an output of this run and chunk (and, given
    ``producer``, ``RunManifest.producer()``, one the run's options produced); else (None, why)."""
    meta_path, npy_path = layout.output_meta(index), layout.output_npy(index)
    if not meta_path.is_file():
        return None, "output metadata missing"
    try:
        meta = read_json(meta_path)
    except PermissionError as exc:
        raise not_ours(meta_path, exc) from exc
    except (OSError, ValueError) as exc:
        return None, f"output metadata unreadable: {exc}"
    if not isinstance(meta, dict):
        return None, "output metadata is not a JSON object"
    if not all(isinstance(meta.get(k), int) and not isinstance(meta.get(k), bool) for k in ("rows", "dim")):
        return None, "output metadata gives no whole rows and dimension"
    if meta.get("run_id") != layout.run_id or meta.get("chunk") != index:
        return None, f"{npy_path.name} belongs to run {meta.get('run_id')} chunk {meta.get('chunk')}"
    why = producer_mismatch(meta, producer) if producer is not None else ""
    return (None, f"{npy_path.name}: {why}") if why else (meta, "")


def output_arrays(
    layout: RunLayout,
    index: int,
    meta: dict[str, Any],
    expected_rows: int,
    producer: dict[str, Any] | None = None,
) -> tuple[dict[str, np.ndarray[Any, Any]] | None, str]:
    """A chunk output's arrays by name, each file read once and checked from the bytes read:
    ``rows`` (a dense output's matrix), or a ragged output's ``offsets`` and entry arrays. (None,
    why) when one is missing, does not match its checksum, or holds what the metadata does not say."""
    npy_path = layout.output_npy(index)
    first, why = read_checked_npy(npy_path, meta.get("sha256"))
    if first is None:
        return None, why
    if "arrays" in meta:  # a ragged output: the .npy holds its row offsets
        return ragged_arrays(layout, index, first, meta, expected_rows)
    why = _array_problem(npy_path.name, first, meta, expected_rows, producer)
    return (None, why) if why else ({ROWS: first}, "")


def ragged_arrays(
    layout: RunLayout, index: int, offsets: np.ndarray[Any, Any], meta: dict[str, Any], expected_rows: int
) -> tuple[dict[str, np.ndarray[Any, Any]] | None, str]:
    """A ragged chunk output's offsets (already read and checked against their checksum) and entry
    arrays by name, each read once and checked; (None, why) when one is wrong."""
    schema = SCHEMAS.get(str(meta.get("dtype")))
    if schema is None or not isinstance(meta["arrays"], dict) or set(meta["arrays"]) != set(schema):
        return None, f"ragged output of kind {meta.get('dtype')!r} names arrays {meta.get('arrays')!r}"
    if offsets.ndim != 1 or offsets.dtype != np.int64 or len(offsets) != expected_rows + 1:
        return None, f"offsets hold {offsets.shape} {offsets.dtype}, expected ({expected_rows + 1},) int64"
    if meta.get("rows") != expected_rows:
        return None, f"its metadata says {meta.get('rows')} rows, expected {expected_rows}"
    entries = int(offsets[-1]) if len(offsets) else 0
    if offsets[0] != 0 or bool(np.any(np.diff(offsets) < 0)) or meta.get("entries") != entries:
        return None, "offsets do not rise from 0 to its entries"
    arrays = {OFFSETS: offsets}
    for name, dtype in schema.items():
        path = layout.output_array(index, name)
        array, why = read_checked_npy(path, meta["arrays"][name])
        if array is None:
            return None, why
        shape = entry_shape(name, entries, int(meta.get("dim") or 0))
        if array.shape != shape or array.dtype != np.dtype(dtype):
            return None, f"{path.name} holds {array.shape} {array.dtype}, expected {shape} {np.dtype(dtype)}"
        if array.dtype.kind == "f" and not bool(np.isfinite(array).all()):
            return None, f"{path.name} has NaN or infinite values"
        if name == "indices" and entries and (int(array.min()) < 0 or int(array.max()) >= int(meta["dim"])):
            return None, f"{path.name} indexes outside 0..{int(meta['dim']) - 1}"
        arrays[name] = array
    return arrays, ""


def verify_output(
    layout: RunLayout, index: int, expected_rows: int, producer: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, str]:
    """Check a chunk output against its metadata and, given ``producer`` (``RunManifest.producer()``),
    against the run: return (meta, "") if whole and the run's, else (None, reason)."""
    meta, why = output_meta(layout, index, producer)
    if meta is None:
        return None, why
    arrays, why = output_arrays(layout, index, meta, expected_rows, producer)
    return (meta, "") if arrays is not None else (None, why)


def _array_problem(
    name: str,
    array: np.ndarray[Any, Any],
    meta: dict[str, Any],
    expected_rows: int,
    producer: dict[str, Any] | None,
) -> str:
    """What is wrong with a chunk output's array (its dtype, shape or values), or ""."""
    output_dtype = str(((producer or {}).get("options") or {}).get("output_dtype", DEFAULT_OUTPUT_DTYPE))
    expected = np.dtype(OUTPUT_DTYPES.get(output_dtype, "<f4"))
    if array.ndim != 2 or array.dtype != expected:
        shape = f"{name} has shape {array.shape} and dtype {array.dtype}"
        return f"{shape}, expected 2-D {expected} ({output_dtype})"
    if array.shape[0] != expected_rows or meta.get("rows") != expected_rows:
        return f"{name} has {array.shape[0]} rows, expected {expected_rows}"
    if meta.get("dim") != array.shape[1]:
        return f"{name} has dimension {array.shape[1]}, metadata says {meta.get('dim')}"
    if bad := len(non_finite_rows(array)):
        return f"{name} has {bad} row(s) of NaN or infinite values"
    return ""
