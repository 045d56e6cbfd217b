"""Which run a submission is: the request, its corpus files read once for their checksums (refused
if written to meanwhile), the identity and fingerprint that name the run, and the model's bytes it
is fixed to. Nothing is written here; ``submit/submission.py`` creates the run.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from chunkq.jobs.compute import code_probe, model_code
from chunkq.jobs.compute.model_identity import model_identity, short
from chunkq.jobs.compute.vector_cache import cache_enabled
from chunkq.jobs.contract.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_QUEUE
from chunkq.jobs.contract.errors import (
    ConfigError,
    ModelChangedError,
    RunConflictError,
)
from chunkq.jobs.contract.manifest import RunManifest, load_manifest
from chunkq.jobs.contract.run_files import (
    RunLayout,
)
from chunkq.jobs.contract.specs import BATCHING, EncodeOptions, fingerprint, validate_run_id, without_batching
from chunkq.supervisor.corpus.files import describe_inputs, labels
from chunkq.supervisor.corpus.records import (
    CorpusOptions,
    Record,
    check_regular_file,
    read_corpus,
)
from chunkq.supervisor.submit.windows import (
    LONG_TEXTS,
    POOLS,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SubmitRequest:
    """What the user asked for; the identity fields decide the run id."""

    corpus: Path | tuple[Path, ...]  # one file, or several read in this order as one corpus
    store: Path
    model: str
    corpus_options: CorpusOptions
    chunk_size: int = DEFAULT_CHUNK_SIZE
    encode: EncodeOptions = field(default_factory=EncodeOptions)
    run_id: str | None = None
    queue: str = DEFAULT_QUEUE
    # its turns at shared workers (jobs/queue/run_queues.py); None: the default, or a resumed run's own
    priority: int | None = None
    job_timeout: int | None = None  # seconds per chunk; default scales with the chunk size
    queue_window: int | None = None  # jobs in Redis at once (enqueue.window_size); the rest wait in the store
    cache: bool | None = None  # the vector cache and in-run deduplication; None: on for float outputs
    long_texts: str = LONG_TEXTS[0]  # "window"/"late": long texts cut into windows, a result row each
    window_tokens: int | None = None  # None: the model's maximum length less special tokens and prompt
    window_stride: int | None = None  # None: a quarter of a window
    pool: str = POOLS[0]  # with windows: a vector per text as well (mean, or weighted by tokens)
    # --accept-unidentified-code: a --trust-remote-code model whose code is not identified; no cache
    accept_unidentified_code: bool = False
    # CUDA_VISIBLE_DEVICES for an int8/uint8 run's calibration (jobs/calibrate.py): "" the CPU, a GPU's
    # UUID (chunkq run: its pool's devices); None: what CUDA finds (chunkq submit: pools run elsewhere)
    calibrate_on: str | None = None

    def __post_init__(self) -> None:
        # A late run's rows are late rows (jobs.compute.late): its workers must encode them so.
        if self.encode.late_chunking != (self.long_texts == "late"):
            object.__setattr__(self, "encode", replace(self.encode, late_chunking=self.long_texts == "late"))

    @property
    def cached(self) -> bool:
        # Code not identified is not in the cache's key: its vectors are never served nor kept.
        return cache_enabled(self.cache, self.encode) and not self.accept_unidentified_code

    @property
    def windowed(self) -> bool:
        return self.long_texts in ("window", "late")

    @property
    def planned(self) -> bool:
        """The run's chunks are planned (supervisor.submit.plan): with the cache, or with windows."""
        return self.cached or self.windowed

    def timeout(self) -> int:
        return self.job_timeout or max(600, 2 * self.chunk_size)

    @property
    def corpora(self) -> tuple[Path, ...]:
        return self.corpus if isinstance(self.corpus, tuple) else (self.corpus,)


def _identity(req: SubmitRequest, inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """What makes two submissions the same run: the files' contents and order, not their names."""
    checksums = [i["sha256"] for i in inputs]
    return {
        "corpus_sha256": checksums[0] if len(checksums) == 1 else checksums,
        "format": req.corpus_options.format,
        "text_field": req.corpus_options.text_field,
        "id_field": req.corpus_options.id_field,
        **({"pair_field": req.corpus_options.pair_field} if req.corpus_options.pair_field else {}),
        "chunk_size": req.chunk_size,
        "model": req.model,
        "options": without_batching(req.encode.to_dict()),  # how fast is no part of what
        # Only where they are on, so runs without them keep the fingerprint they had before.
        **({"vector_cache": True} if req.cached else {}),
        **(
            {
                "long_texts": {
                    "mode": req.long_texts,
                    "tokens": req.window_tokens,
                    "overlap": req.window_stride,
                    "pool": req.pool,
                }
            }
            if req.windowed
            else {}
        ),
    }


def default_run_id(corpus: Path, run_fingerprint: str) -> str:
    """The corpus file's name and a short fingerprint: ``notes-3fa2c1d0e9b4``; runs of different
    files are told apart at a glance, runs of one file with other options by the fingerprint."""
    stem = re.sub(r"[^A-Za-z0-9-]+", "-", corpus.stem).strip("-")[:40] or "run"
    return f"{stem}-{run_fingerprint[:12]}"


def read_inputs(req: SubmitRequest) -> Iterator[Record]:
    """The records of every corpus file in order. Row-number ids of several files are prefixed
    with the file's name (``a.jsonl:3``) so that they stay unique across files."""
    for path, label in zip(req.corpora, labels(req.corpora), strict=True):
        yield from read_corpus(path, req.corpus_options, number_prefix=f"{label}:" if label else "")


def conflict(manifest: RunManifest, identity: dict[str, Any]) -> RunConflictError:
    theirs = manifest.data.get("identity", {})
    diffs = [
        f"{key}: stored {theirs.get(key)!r}, given {value!r}"
        for key, value in identity.items()
        if theirs.get(key) != value
    ]
    return RunConflictError(
        f"run {manifest.run_id} already exists with a different corpus or options ("
        + "; ".join(diffs)
        + "); choose another --run-id or omit it to get one derived from the corpus and options"
    )


def same_model(manifest: RunManifest, now: str | None, canary: list[list[float]] | None = None) -> None:
    """Refuse to go on with (or answer for) a run whose model's files are not the bytes it was
    submitted with: its chunks so far and its result are the old model's. ``canary``: the vectors
    of the model's canary texts now (a model that brings its own code), which must be the run's."""
    then = manifest.model_identity
    moved = model_code.canary_difference(canary, manifest.data.get("model_canary"))
    if moved is not None and moved[0] > model_code.SAME_CACHE_DIFF:
        raise ModelChangedError(
            f"run {manifest.run_id}: model {manifest.model} behaves differently than when the run was "
            f"submitted (its vectors of chunkq's canary texts moved by up to {moved[0]:.3g}) though the "
            "files its code reads are the same: something chunkq cannot see changed (an environment "
            f"variable, a file its native code reads). To encode with it as it is now: `chunkq clean "
            f"{manifest.run_id}` and the same command again"
        )
    if then is None or now is None or then == now:
        return
    raise ModelChangedError(
        f"run {manifest.run_id}: model {manifest.model} has changed since the run was submitted (its "
        f"files were {short(then)}, they are now {short(now)}); what the run holds is the old model's. "
        f"To encode with the model as it is now: `chunkq clean {manifest.run_id}` and the same command "
        "again, or keep that run and give this one --run-id NAME; or put the old files back to go on"
    )


@dataclass(frozen=True)
class Identified:
    """A request's corpus read once for its checksums: which run it is, and why."""

    run_id: str
    inputs: list[dict[str, Any]]
    identity: dict[str, Any]
    fingerprint: str
    model_identity: str | None  # the model's bytes (jobs.compute.model_identity); None: not on this host
    manifest: RunManifest | None = None  # the run's manifest, where identify read it already
    model_code: list[dict[str, str]] | None = None  # what the model's own code read (model_code.Listing)
    model_canary: list[list[float]] | None = None  # its vectors of model_code.CANARY_TEXTS at submit


def identify(req: SubmitRequest) -> Identified:
    """Check the corpus files and hash them: the run id, before anything is written or locked."""
    if req.chunk_size < 1:
        raise ConfigError(f"--chunk-size must be at least 1, got {req.chunk_size}")
    for path in req.corpora:
        check_regular_file(path)  # readable: its head was read (request.check_corpora)
    inputs = describe_inputs(req.corpora)
    identity = _identity(req, inputs)
    run_fingerprint = fingerprint(identity)
    run_id = (
        validate_run_id(req.run_id)
        if req.run_id is not None
        else default_run_id(req.corpora[0], run_fingerprint)
    )
    model, listing = code_identity(req, model_identity(req.model, req.encode.revision))
    code = listing.to_json() if listing is not None else None
    canary = listing.canary if listing is not None else None
    found = Identified(run_id, inputs, identity, run_fingerprint, model, model_code=code, model_canary=canary)
    return _begun_earlier(req, found)


LOAD_OPTIONS = ("trust_remote_code", "revision", "model_kwargs", "kind")  # what decides how a model loads


def code_identity(req: SubmitRequest, files: str | None) -> tuple[str | None, model_code.Listing | None]:
    """The model's identity with the code it brings (``--trust-remote-code``: a probe's listing,
    jobs.compute.model_code), and that listing (its canary too) for the manifest; a model that brings
    none as it is."""
    if files is None or not req.encode.trust_remote_code:
        return files, None
    if req.accept_unidentified_code:
        return model_code.with_code(files, None), None
    options = {k: v for k, v in req.encode.to_dict().items() if k in LOAD_OPTIONS}
    listing = code_probe.probe(req.model, options)
    if listing.unidentified:
        raise ConfigError(
            f"model {req.model}: chunkq cannot identify the code it runs: {listing.unidentified[0]}"
            f"{f' (and {len(listing.unidentified) - 1} more)' if len(listing.unidentified) > 1 else ''}; "
            f"give {model_code.ACCEPT_FLAG} to run it all the same (its files alone are compared, and "
            "no vector cache is used)"
        )
    return model_code.with_code(files, listing), listing


def _earlier_forms(req: SubmitRequest, identity: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """The identities the same command's run may have been begun under, newest first, each with why:
    with its batch settings (part of the identity until they were taken out); and, only where the
    cache was not asked for by name (``--cache`` means a run that uses it), without the vector cache
    (a run made with ``--no-cache``, or before the cache existed), which then goes on without it."""
    batching = {k: v for k, v in req.encode.to_dict().items() if k in BATCHING}
    with_batching = {**identity, "options": {**identity["options"], **batching}}
    forms = [(with_batching, "with its batch settings in its identity")]
    if req.cache is None and "vector_cache" in identity and not req.windowed:
        for form in (identity, with_batching):
            before = {k: v for k, v in form.items() if k != "vector_cache"}
            forms.append((before, "without the vector cache; it goes on without it"))
    return forms


def _begun_earlier(req: SubmitRequest, identified: Identified) -> Identified:
    """The run this command is: this release's, else the one the same command began under an
    earlier release, so that it resumes rather than start again. A manifest read here is the run's
    for the steps after (``Identified.manifest``), not read again."""
    read: dict[str, RunManifest | None] = {}
    for form, why in [(identified.identity, ""), *_earlier_forms(req, identified.identity)]:
        form_fingerprint = fingerprint(form)
        run_id = (
            validate_run_id(req.run_id)
            if req.run_id is not None
            else default_run_id(req.corpora[0], form_fingerprint)
        )
        if run_id not in read:
            layout = RunLayout(req.store, run_id)
            read[run_id] = load_manifest(layout) if layout.manifest.is_file() else None
        found = read[run_id]
        if found is not None and found.fingerprint == form_fingerprint:
            if why:
                log.info("run %s was submitted %s", run_id, why)
            return replace(
                identified, run_id=run_id, identity=form, fingerprint=form_fingerprint, manifest=found
            )
    found = read[identified.run_id]  # another run under this --run-id: prepare says how they differ
    return identified if found is None else replace(identified, manifest=found)
