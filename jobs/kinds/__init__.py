"""Model kinds: what a run's model is and what a row of its result holds (docs/kinds.md).

Each kind is one module here behind one small contract (``contract.Kind``): the sentence-transformers
class that loads it, how a chunk's rows are encoded to a float32 matrix (row i for input row i), the
warm-up a fresh worker runs once, the options that mean nothing for it, and what the rest of the
house would otherwise switch on by name (what its dimension is, how a vector store takes its rows,
whether its rows are pairs). Everything around a kind (chunks, recycling, OOM back-off, retries,
resume, the manifest, the vector cache, verified assembly, shards, export, status) is written once
and knows a kind only through ``get``. Adding a kind is one module and one line in ``KINDS``; one
of your own is one module that defines ``KIND``, named in ``CHUNKQ_KINDS`` (comma-separated dotted
module paths) wherever chunkq runs: the command, its pool and the workers.

Built: ``dense`` (``SentenceTransformer.encode``), ``cross`` (``CrossEncoder.predict`` over pairs),
``sparse`` (``SparseEncoder``, CSR), ``multivector`` (``MultiVectorEncoder``, a token matrix per
text; both stored ragged, ``contract/ragged.py``) and ``image`` (a multimodal model's ``encode``
of images read from paths or URLs).

Imports ``contract/`` and, for batches and late chunking, ``compute/``; never the job function.
"""

from __future__ import annotations

import importlib
import os

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.kinds import cross, dense, image, multivector, sparse
from chunkq.jobs.kinds.contract import Kind

KINDS: dict[str, Kind] = {
    k.name: k for k in (dense.KIND, cross.KIND, sparse.KIND, multivector.KIND, image.KIND)
}


def _added() -> list[str]:
    """Register the kinds of the modules ``CHUNKQ_KINDS`` names; what was wrong with any, said by
    ``get`` (an import of this module never fails for it)."""
    problems, name = [], environment.KINDS
    for path in (p.strip() for p in os.environ.get(environment.KINDS, "").split(",")):
        if not path:
            continue
        try:
            kind = getattr(importlib.import_module(path), "KIND", None)
        except Exception as exc:
            problems.append(f"{name}: module {path} does not import ({type(exc).__name__}: {exc})")
            continue
        if not isinstance(kind, Kind):
            problems.append(f"{name}: module {path} defines no KIND (a jobs.kinds.contract.Kind)")
        elif kind.name in KINDS:
            problems.append(f"{name}: {path} names kind {kind.name!r}, which is already a kind")
        elif kind.built_on is not None and kind.built_on not in KINDS:
            problems.append(f"{name}: {path}'s kind is built on {kind.built_on!r}, no kind")
        else:
            KINDS[kind.name] = kind
    return problems


_NOT_ADDED = _added()


def get(name: str) -> Kind:
    """The kind called ``name``; ConfigError naming the kinds there are."""
    if name in KINDS:
        return KINDS[name]
    why = f" ({'; '.join(_NOT_ADDED)})" if _NOT_ADDED else ""
    raise ConfigError(f"kind {name!r}: one of {', '.join(KINDS)}{why}")


def check_options(options: EncodeOptions) -> None:
    """ConfigError where ``options`` ask of the run's kind what it cannot do."""
    kind = get(options.kind)
    why = kind.refuse(options)
    if options.backend not in kind.backends:
        runs = ", ".join(k.name for k in KINDS.values() if options.backend in k.backends)
        why = f"--backend {options.backend} runs {runs} models here"
    elif options.rounds and not kind.rounds:
        why = f"--precision {options.precision} on {options.backend} is for dense models; run it in fp32"
    if options.allow_missing and not (kind.reads_rows or options.late_chunking):
        why = "--allow-missing is for rows that name what to read (--kind image) or late-chunking windows"
    if why:
        raise ConfigError(f"--kind {options.kind}: {why}")
