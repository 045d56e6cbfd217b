"""The published result's two forms, and how each is read and checked (``writer.py`` writes them).

    result/manifest.json                 the commit marker: rows, dim, checksums, the form
    result/embeddings.npy, ids.jsonl     one file each, when the embeddings fit in one shard
    result/shards-<tag>/000000.npy       ordered shards of at most ``shard_bytes`` of embeddings,
    result/shards-<tag>/000000.ids.jsonl each with its ids; the manifest lists them in order with
                                         their rows and checksums ("shards", "shard_dir")

A result larger than one shard is sharded so that no process needs local scratch beyond one shard:
on an object store each shard is uploaded (one multipart upload) as soon as it is whole, while
assembly goes on. The shard folder's name is new at every assembly and only the manifest, written
last, names it: readers never see a half-made set, an older result stays readable until the new
manifest replaces its own, and shards that no manifest names (an assembly that died, or lost its
lock) are removed by the next one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkq.jobs import kinds
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.manifest import RunManifest
from chunkq.jobs.contract.ragged import OFFSETS, SCHEMAS
from chunkq.jobs.contract.run import ResultManifest
from chunkq.jobs.contract.run_files import (
    RunLayout,
    read_json,
    read_npy_header,
)
from chunkq.jobs.contract.specs import storage_dtype
from chunkq.jobs.contract.storage import (
    is_local,
    list_with_mtime,
)
from chunkq.supervisor.result import ragged as ragged_result
from chunkq.supervisor.result.result_names import SHARD_DIR, SINGLE

# A ragged result's arrays (``ragged.py``), uploaded before the manifest as SINGLE's are.
RAGGED_FILES = tuple(f"{name}.npy" for name in (OFFSETS, *sorted({n for s in SCHEMAS.values() for n in s})))
WINDOW_COLUMNS = ("window", "char_start", "char_end", "tokens")  # a windowed result's id fields, after id
TEXTS = ("texts.npy", "texts.ids.jsonl")  # --long-texts window --pool: a vector per text, beside the windows


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def shard_bytes(value: int | str) -> int:
    """A shard size in bytes from ``1073741824``, ``1GiB``, ``512MB``, ``64k``...; ConfigError
    for anything else or under a kilobyte (a shard per few rows is a mistake, not a choice)."""
    match = _SIZE.fullmatch(str(value))
    if match is None:
        raise ConfigError(f"shard size {value!r}: give bytes, or a number with kB, MB, GB, KiB, MiB or GiB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])
    if size < 1024:
        raise ConfigError(f"shard size {value!r}: at least 1 KiB")
    return size


def shard_names(index: int) -> tuple[str, str]:
    """The embeddings and ids file names of shard ``index``."""
    return f"{index:06d}.npy", f"{index:06d}.ids.jsonl"


@dataclass(frozen=True)
class ResultPart:
    """One embeddings file and its ids, a run of rows in the result's order."""

    embeddings: Path
    ids: Path
    rows: int
    embeddings_sha256: str
    ids_sha256: str


def describe_left_out(rows: list[dict[str, Any]], shown: int = 5) -> str:
    """Rows left out of a result under --allow-missing, in one line: how many, and the first few by
    id with why."""
    named = "; ".join(f"{r.get('id')!r}: {r.get('reason')}" for r in rows[:shown])
    more = f"; and {len(rows) - shown} more (result/manifest.json lists all)" if len(rows) > shown else ""
    return f"{len(rows)} row(s) left out: {named}{more}"


def result_parts(layout: RunLayout, result: dict[str, Any]) -> list[ResultPart]:
    """The files a result manifest names, in row order; ValueError when it names them wrongly (a
    manifest edited to point outside its result folder is refused, never followed)."""
    folder = layout.result
    shards = result.get("shards")
    if shards is None:
        embeddings, ids = SINGLE
        return [
            ResultPart(
                folder / embeddings,
                folder / ids,
                int(result["rows"]),
                str(result.get("embeddings_sha256")),
                str(result.get("ids_sha256")),
            )
        ]
    shard_dir = result.get("shard_dir")
    if not isinstance(shard_dir, str) or not SHARD_DIR.fullmatch(shard_dir):
        raise ValueError(f"shard_dir {shard_dir!r} is not a shard folder's name")
    if not isinstance(shards, list) or not shards:
        raise ValueError("its shard list is empty or not a list")
    parts = []
    for index, shard in enumerate(shards):
        rows = shard.get("rows") if isinstance(shard, dict) else None
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"shard {index} has no row count")
        embeddings, ids = shard_names(index)
        parts.append(
            ResultPart(
                folder / shard_dir / embeddings,
                folder / shard_dir / ids,
                rows,
                str(shard.get("embeddings_sha256")),
                str(shard.get("ids_sha256")),
            )
        )
    return parts


def _declared_shape(part: ResultPart) -> tuple[tuple[int, ...], str, int]:
    """The shape and dtype a shard's header declares, and the bytes the file must then hold."""
    with part.embeddings.open("rb") as fh:
        shape, fortran, dtype = read_npy_header(fh)
        data_offset = fh.tell()
    rows_bytes = dtype.itemsize
    for n in shape:
        rows_bytes *= n
    return shape, dtype.str + (" Fortran-ordered" if fortran else ""), data_offset + rows_bytes


def result_disagreement(layout: RunLayout, published: ResultManifest, manifest: RunManifest) -> list[str]:
    """How the result manifest disagrees with the run's manifest or its own files' headers (cheap:
    no hashing). An edited result manifest keeps checksums that still match its files, so only the
    run manifest can tell that its rows, model or options are not the run's."""
    if published.unreadable:
        return [published.unreadable]
    result = published.fields
    problems = [
        f"result/manifest.json says {key} {result.get(key)!r}, the run's manifest {value!r}"
        for key, value in (
            ("fingerprint", manifest.fingerprint),
            ("model", manifest.model),
            ("options", manifest.options),
            ("corpus_rows", manifest.corpus_rows),
            ("dtype", manifest.output_dtype),
        )
        if result.get(key) != value
    ]
    missing = result.get("missing") or []
    try:
        expected_rows = manifest.corpus_rows - sum(int(m["rows"]) for m in missing)
        expected_rows -= len(result.get("bad_rows") or [])  # left out under --allow-missing
    except (TypeError, KeyError, ValueError):
        return [*problems, "result/manifest.json lists missing chunks it cannot describe"]
    if result.get("rows") != expected_rows or bool(result.get("complete")) == bool(missing):
        problems.append(
            f"result/manifest.json says {result.get('rows')!r} rows (complete: {result.get('complete')!r}), "
            f"the run's manifest and its missing chunks make {expected_rows}"
        )
    if kinds.get(manifest.kind).ragged:
        return [*problems, *ragged_result.problems(layout, result, expected_rows, checksums=False)]
    # The dtype the run's manifest asks for: the result manifest's own word could be edited.
    expected_dtype = storage_dtype(manifest.output_dtype).str
    try:
        parts = result_parts(layout, result)
    except (KeyError, TypeError, ValueError) as exc:
        return [*problems, f"result/manifest.json lists its files wrongly: {exc}"]
    if sum(part.rows for part in parts) != expected_rows:
        problems.append(f"its shards hold {sum(p.rows for p in parts)} rows, expected {expected_rows}")
    for part in parts:
        name = result_name(layout, part.embeddings)
        try:
            shape, dtype, size = _declared_shape(part)
            actual = part.embeddings.stat().st_size
        except (OSError, ValueError) as exc:
            problems.append(f"{name} unreadable: {exc}")
            continue
        if shape != (part.rows, result.get("dim")) or dtype != expected_dtype:
            expected = f"({part.rows}, {result.get('dim')!r}) {expected_dtype}"
            problems.append(f"{name} holds {shape} {dtype}, expected {expected}")
        elif actual != size:  # a truncated or grown file: seen without reading it
            problems.append(f"{name} is {actual} bytes, its header makes {size}")
    return problems


def result_name(layout: RunLayout, path: Path) -> str:
    """A result file's name as the manifest's reader knows it: relative to result/."""
    return str(path.relative_to(layout.result)) if is_local(path) else path.name


def _chunk_count(layout: RunLayout) -> int:
    try:
        return int(read_json(layout.manifest)["chunks"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0  # a run whose manifest cannot be read: what the outputs hold is all there is to say


def rebuild_advice(layout: RunLayout) -> str:
    """What publishes a damaged result again: assembly from the chunk outputs while they are there,
    else the command that made the run, which encodes the chunks again from their inputs."""
    chunks = {name.split(".")[0] for name, _ in list_with_mtime(layout.outputs) if name.endswith(".npy")}
    if chunks and len(chunks) >= _chunk_count(layout):
        return f"`chunkq assemble {layout.run_id}` publishes it again from the chunk outputs"
    if chunks:  # assemble would list every chunk left to encode (a hostile pass followed it)
        return (
            "some of its chunks have no output: the command that made the run (chunkq run, or submit "
            "with a pool) encodes them and publishes it"
        )
    return (
        "its chunk outputs were freed once it was published: the command that made the run (chunkq "
        "run, or submit with a pool) encodes its chunks again from their inputs and publishes it again"
    )
