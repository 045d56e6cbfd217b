"""The Python API: ``chunkq.run(corpus, ...)`` and ``chunkq.embed(texts_or_path, ...)``.

The same machinery as ``chunkq run`` on this machine (embedded Redis unless ``redis_url``, a pool of
fresh worker processes, supervision, verified assembly), so a worker that dies loses nothing here
either. Options are ``chunkq run``'s, by their Python names: ``chunk_size``, ``batch_size``,
``precision``, ``gpus``, ``cpu_workers``, ``workers_per_gpu``, ``max_attempts``...
"""

from __future__ import annotations

import glob
import json
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkq.jobs import kinds
from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.model_refs import check_model, default_model, resolve_model
from chunkq.jobs.compute.quantize import stored_columns
from chunkq.jobs.contract.defaults import DEFAULT_STORE
from chunkq.jobs.contract.errors import AssemblyError, ConfigError, NonFiniteError, StoreError
from chunkq.jobs.contract.ragged import Ragged
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, load_npy
from chunkq.jobs.contract.specs import CALIBRATED_DTYPES, EncodeOptions, storage_dtype
from chunkq.jobs.contract.storage import is_local, open_store, private_open
from chunkq.jobs.kinds.cross import pair_text
from chunkq.supervisor.corpus.row_text import check_text
from chunkq.supervisor.request import ENCODE_NAMES, build_run_request, encode_options_for, finished_result
from chunkq.supervisor.result.reader import (
    PublishedResult,
    ShardedEmbeddings,
    checked_embeddings,
    open_result,
)
from chunkq.supervisor.watch.display import ProgressDisplay
from chunkq.supervisor.watch.snapshot import store_snapshot

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class RunResult:
    """A published run: where its files are and what it took."""

    run_id: str
    store: Path
    rows: int
    dim: int
    seconds: float  # this call, start to end (model loads and start-up included)
    workers: int
    rows_per_second: float | None  # the run's rate as status and report give it (supervisor.store.throughput)

    @property
    def result_dir(self) -> Path:
        return RunLayout(self.store, self.run_id).result

    def _opened(self, level: str = "window", run: Run | None = None) -> PublishedResult:
        """The published result, checked against the run (``run``: opened already) and against its
        files' headers and sizes (a missing, truncated or foreign file is refused in one line,
        StoreError); what is read of it is checked against its checksums as it is read."""
        try:
            return open_result(run or Run.open(self.store, self.run_id), level)
        except AssemblyError as exc:
            raise self._refused(exc) from None

    def _verified(self, opened: PublishedResult) -> None:
        """Every byte of ``opened`` read once against its checksums, before an array over a file
        is handed out whole (a memory map or ``np.load`` checks nothing of the bytes themselves)."""
        try:
            opened.verify()
        except AssemblyError as exc:
            raise self._refused(exc) from None

    def _refused(self, exc: AssemblyError) -> StoreError:
        return StoreError(
            f"run {self.run_id}: {exc.problems[0]}; `chunkq assemble RUN` publishes it "
            "again from the chunk outputs"
        )

    def embeddings(self, mmap: bool = True) -> np.ndarray | ShardedEmbeddings:
        """The result, row i for corpus row i: a memory-mapped array (read whole with ``mmap=False``),
        or for a sharded result a lazy view that reads a shard when a row of it is asked for
        (``np.asarray(view)`` reads them all). Every byte is checked against the result's checksums
        before it is handed out: a one-file result (at most a shard, 1 GiB) is read through once
        first, a shard as it is read."""
        opened = self._opened()
        parts = opened.parts
        if opened.ragged is not None:
            raise ConfigError(f"run {self.run_id} holds ragged rows, not a matrix: use .ragged()")
        if len(parts) > 1 or opened.manifest.shards is not None:
            return ShardedEmbeddings(parts, opened.dim, opened.dtype)
        if mmap and is_local(parts[0].embeddings):
            self._verified(opened)  # read through once, then mapped
            mapped: np.ndarray = load_npy(parts[0].embeddings)
            return mapped
        return checked_embeddings(parts[0])  # read whole once (from an object store too), checked

    def ragged(self) -> Ragged:
        """A ragged run's rows: a sparse run's vectors as CSR (``arrays["indices"]``,
        ``arrays["values"]``), a multivector run's token vectors (``arrays["vectors"]``); row i's
        entries are ``[offsets[i]:offsets[i + 1]]`` of each. One block is memory-mapped; a sharded
        result's shards are read and joined; every file checked against its checksum first."""
        from chunkq.supervisor.result import ragged as ragged_result

        opened = self._opened()
        if opened.ragged is None:
            raise ConfigError(f"run {self.run_id} holds a matrix, not ragged rows: use .embeddings()")
        self._verified(opened)
        arrays = ragged_result.load(self.result_dir)
        return Ragged(arrays.pop("offsets"), arrays, opened.dim)

    def export_to(
        self,
        url: str,
        index: str | None = None,
        columns: tuple[str, ...] = (),
        force: bool = False,
        column: str | None = None,
        level: str = "window",
    ) -> dict[str, Any]:
        """Write the result into a vector store, upserting by id (``chunkq export --to``):
        ``lancedb://PATH/TABLE``, ``faiss:PATH`` (``index``: a FAISS factory string, default Flat;
        ``force``: replace a file there that chunkq did not write), ``postgresql://USER@HOST:PORT/DB?
        table=T``; ``columns``: corpus fields copied beside each row; ``column``: the vector column's
        name (a second run of the corpus adds its own to the same table); ``level="document"``: a
        windowed run's vectors per text. A summary: rows, written, seconds, rows/s."""
        from chunkq.sinks import export_to

        options = {"index": index, "force": force, "column": column, "level": level}
        return export_to(Run.open(self.store, self.run_id), url, options, columns=tuple(columns))

    def ids(self) -> list[Any]:
        """Each row's id, in order: a string, or with ``long_texts="window"`` an object (the text's
        id, the window's number, ``char_start``, ``char_end``, ``tokens``)."""
        return [rid for ids in self._opened().ids() for rid in ids]  # each ids file checked

    def text_embeddings(self) -> np.ndarray | None:
        """With ``long_texts="window"`` and ``pool``: a vector per text (``texts.npy``), the texts in
        corpus order; None without ``pool``."""
        import numpy as np

        run = Run.open(self.store, self.run_id)
        if run.result is None or run.result.fields.get("texts") is None:
            return None
        blocks = [block for _, block in self._opened("document", run).batches()]  # each file checked
        return np.concatenate(blocks) if blocks else None


@dataclass(frozen=True)
class Windowed:
    """What ``embed(..., long_texts="window")`` returns: a row per window, and which text and span
    each is (``windows[i]``: ``text`` (its index in the texts given), ``window``, ``char_start``,
    ``char_end``, ``tokens``), and with ``pool`` a vector per text."""

    embeddings: np.ndarray
    windows: list[dict[str, Any]]
    texts: np.ndarray | None


def run(
    corpus: str | Path | Sequence[str | Path],
    model: str | None = None,
    *,
    store: str | Path = DEFAULT_STORE,
    redis_url: str | None = None,
    progress: bool = False,
    **options: Any,
) -> RunResult:
    """Embed ``corpus`` (a file, several, or a glob) into ``store``; resumes what the store holds.

    Raises a ChunkqError subclass (with the same message ``chunkq run`` prints) when the corpus is
    bad, settings cannot work or chunks were quarantined.
    """
    started = time.monotonic()
    corpora = [corpus] if isinstance(corpus, str | Path) else list(corpus)
    request = build_run_request(
        [str(c) for c in corpora], model=model, store=open_store(str(store)), redis_url=redis_url, **options
    )
    from chunkq.supervisor.local_run import run as run_locally

    # The store holds the user's texts: everything chunkq creates is owner-only, as under the CLI,
    # by the modes it sets; this process's umask is the caller's, shared by its threads.
    with ProgressDisplay(live=progress) as display:
        outcome = run_locally(request, display)
    result = finished_result(outcome, request)
    published = Run.open(request.submit.store, result["run_id"])
    return RunResult(
        run_id=result["run_id"],
        store=request.submit.store,
        rows=int(result["rows"]),
        dim=int(result["dim"]),
        seconds=time.monotonic() - started,
        workers=len(result.get("workers", ())),
        rows_per_second=store_snapshot(published.layout, published.manifest).rows_per_second,
    )


IN_PROCESS_TEXTS = 1000  # up to this many texts (one chunk's worth), embed encodes in the caller's process


def embed(
    texts_or_path: Iterable[str | tuple[str, str]] | str | Path,
    model: str | None = None,
    *,
    store: str | Path | None = None,
    isolated: bool | None = None,
    **options: Any,
) -> np.ndarray:
    """Embeddings of ``texts_or_path`` as an array (float32, or ``output_dtype``), row i for text
    (or corpus row) i.

    A list of texts, or a corpus path (file or glob) as ``chunkq run`` takes. Without ``store`` the
    work happens in a temporary store that is removed afterwards; give one to resume after a crash.

    Up to IN_PROCESS_TEXTS texts given as a list, with no ``store`` and only encoding options, are
    encoded in this process (``isolated=None``, the default): a query in milliseconds once the model
    is loaded, the same embeddings as a run. What that gives up: the fresh process (a CUDA fault
    lands in yours), resume, and the model stays loaded in this process for the next call.
    ``isolated=True`` always goes through a run (embedded Redis, a pool, a store); ``False``
    encodes in this process whatever the size.

    ``long_texts="window"`` or ``"late"`` (a run) returns a ``Windowed``: a row per window of each
    text, which text and character span each row is, and with ``pool="mean"`` or ``"weighted"`` a
    vector per text. ``"late"`` pools each window from one pass over the segment around it.

    A cross-encoder (``kind="cross"``, or a model whose files say so) takes (query, passage) pairs
    and returns a score per pair (a row of class scores for a classifier), as
    ``CrossEncoder.predict`` does. A sparse or multivector model returns a
    ``chunkq.jobs.contract.ragged.Ragged`` (``offsets`` and ``arrays``: CSR ``indices`` and
    ``values``, or token ``vectors``).
    """
    import numpy as np

    if isinstance(texts_or_path, str) and not _names_files(texts_or_path):
        raise ConfigError(
            f"chunkq.embed takes a list of texts or a corpus path; {texts_or_path[:60]!r} is neither a "
            "file nor a pattern that matches one (for one text, pass [text])"
        )
    if not isinstance(texts_or_path, str | Path) and store is None and isolated is not True:
        texts: list[str | tuple[str, str]] = list(texts_or_path)
        others = sorted(set(options) - ENCODE_NAMES)  # pool or watch settings: a run's
        if isolated is False or (not others and len(texts) <= IN_PROCESS_TEXTS):
            if others:
                raise ConfigError(f"isolated=False takes encoding options only, not {others}")
            return _embed_in_process(texts, model, options)
        texts_or_path = texts
    with tempfile.TemporaryDirectory(prefix="chunkq-") as scratch:
        if isinstance(texts_or_path, str | Path):
            corpus: str | Path = texts_or_path
        else:
            corpus = Path(scratch) / "texts.jsonl"
            written, paired = _write_texts(corpus, texts_or_path)
            if not written:
                return _empty(model, options)
            if paired:
                options = {**options, "pair_field": PAIR_FIELD}
        result = run(corpus, model, store=store or Path(scratch) / "store", **options)
        if options.get("long_texts") in ("window", "late"):
            return _windowed(result)  # type: ignore[return-value]
        if result._opened().ragged is not None:
            return result.ragged()  # type: ignore[return-value]
        return np.array(result.embeddings(mmap=False))


def _windowed(result: RunResult) -> Windowed:
    """A windowed run's rows with each window's text numbered as the texts were given (row order)."""
    import numpy as np

    numbers: dict[Any, int] = {}
    windows = []
    for rid in result.ids():
        number = numbers.setdefault(rid["id"], len(numbers))
        windows.append({"text": number, **{k: v for k, v in rid.items() if k != "id"}, "id": rid["id"]})
    return Windowed(np.array(result.embeddings(mmap=False)), windows, result.text_embeddings())


def _embed_in_process(texts: list[Any], model: str | None, given: dict[str, Any]) -> np.ndarray:
    """``texts`` encoded here as a run's worker encodes a chunk (same options, same batches, same
    checks), stored as the run would store them. int8/uint8 ranges come from these texts encoded in
    fp32, as a run's calibration does from up to 1,000 of its texts."""
    import numpy as np
    import torch

    from chunkq.jobs import kinds
    from chunkq.jobs.calibrate import ranges_here
    from chunkq.jobs.compute import models, quantize, token_batches
    from chunkq.jobs.contract.run_files import non_finite_rows
    from chunkq.jobs.embed import encode_texts

    name = check_model(model) if model else default_model()
    options = encode_options_for(name, given)
    if not texts:
        return _empty(name, options.to_dict())
    texts = _row_texts(texts, options.kind)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work = token_batches.for_device(options, device, kinds.get(options.kind).by_tokens)
    if work.batch_tokens == "auto":
        work = replace(work, batch_tokens=token_batches.AUTO_START_TOKENS)
    loaded = models.get_model(name, device, options.precision, options)
    embeddings = encode_texts(loaded, texts, work)
    if isinstance(embeddings, Ragged):
        return embeddings
    bad = non_finite_rows(embeddings)
    if len(bad):
        raise NonFiniteError(
            f"{len(bad)} of {len(texts)} text(s) gave NaN or infinite values (texts {list(bad[:5])})"
        )
    ranges = None
    if options.output_dtype in CALIBRATED_DTYPES:  # a run's calibration, from these texts
        same = options.precision == "fp32" and work.batch_tokens is None  # what calibration encodes
        ranges = quantize.ranges_of(embeddings) if same else ranges_here(name, options, texts, device)
    return np.asarray(quantize.convert(embeddings, options.output_dtype, ranges))


def _names_files(text: str) -> bool:
    return "://" in text or Path(text).exists() or bool(glob.glob(text, recursive=True))


def _empty(model: str | None, options: dict[str, Any]) -> np.ndarray:
    """The (0, columns) answer to no texts, in the dtype and width a run with ``options`` gives."""
    import numpy as np

    name = check_model(model) if model else default_model()
    encode = EncodeOptions(**{k: v for k, v in options.items() if k in EncodeOptions.__dataclass_fields__})
    dim = encode.truncate_dim or describe(name, encode.revision).dim
    if dim is None:  # its files do not say: ask the model itself
        from sentence_transformers import SentenceTransformer

        loaded = SentenceTransformer(resolve_model(name), device="cpu")
        # sentence-transformers 6 renamed it get_embedding_dimension (the old name warns, then goes)
        dim = int(getattr(loaded, "get_embedding_dimension", loaded.get_sentence_embedding_dimension)() or 0)
    columns = stored_columns(dim, encode.output_dtype)
    return np.empty((0, columns), dtype=storage_dtype(encode.output_dtype))


PAIR_FIELD = "passage"  # where embed writes a pair's second text in its temporary corpus


def _pair(item: Any, number: int) -> tuple[str, str] | None:
    """``item`` as a (query, passage) pair, None if it is a text; ConfigError if it is neither, and
    CorpusError if a text is one a run refuses as a corpus row (an empty one: a list of up to
    IN_PROCESS_TEXTS was encoded here where a longer one, through a run, was refused)."""
    if isinstance(item, str):
        check_text(item, f"chunkq.embed, text {number}")
        return None
    if isinstance(item, tuple | list) and len(item) == 2 and all(isinstance(p, str) for p in item):
        for part in item:
            check_text(part, f"chunkq.embed, text {number}")
        return item[0], item[1]
    raise ConfigError(f"text {number} is {type(item).__name__}, not a string or a (query, passage) pair")


def _row_texts(items: list[Any], kind: str) -> list[str]:
    """What a chunk's rows hold for ``kind``: the texts, or each pair as one row text."""
    pairs = [_pair(item, n) for n, item in enumerate(items, 1)]
    wants_pairs = kinds.get(kind).pairs
    if wants_pairs != (pairs[0] is not None) or any((p is None) != (pairs[0] is None) for p in pairs):
        want = "(query, passage) pairs" if wants_pairs else "texts"
        raise ConfigError(f"a {kind} model takes {want}, given {type(items[0]).__name__}s")
    return [item if pair is None else pair_text(*pair) for item, pair in zip(items, pairs, strict=True)]


def _write_texts(path: Path, texts: Iterable[Any]) -> tuple[int, bool]:
    """Write ``texts`` (or (query, passage) pairs) as a JSON Lines corpus: (how many, whether pairs)."""
    number, paired = 0, False
    with private_open(path, "w", encoding="utf-8") as fh:
        for number, item in enumerate(texts, 1):
            pair = _pair(item, number)
            paired = pair is not None
            row = {"text": item} if pair is None else {"text": pair[0], PAIR_FIELD: pair[1]}
            fh.write(json.dumps(row) + "\n")
    return number, paired


__all__ = ["RunResult", "Windowed", "embed", "run"]
