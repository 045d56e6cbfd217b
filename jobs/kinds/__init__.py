"""Model kinds: what a run's model is and what a row of its result holds (shared/DESIGN.md "Kinds").

Each kind is one module here behind one small contract (``contract.Kind``): the sentence-transformers
class that loads it, how a chunk's rows are encoded to a float32 matrix (row i for input row i), the
warm-up a fresh worker runs once, and the options that mean nothing for it. Everything around a
kind (chunks, recycling, OOM back-off, retries, resume, the manifest, the vector cache, verified
assembly, shards, export, status) is written once and knows a kind only through ``get``. Adding a
kind is one module and one line in ``KINDS``.

Built: ``dense`` (``SentenceTransformer.encode``), ``cross`` (``CrossEncoder.predict`` over pairs),
``sparse`` (``SparseEncoder``, CSR), ``multivector`` (``MultiVectorEncoder``, a token matrix per
text; both stored ragged, ``contract/ragged.py``) and ``image`` (a multimodal model's ``encode``
of images read from paths or URLs).

Imports ``contract/`` and, for batches and late chunking, ``compute/``; never the job function.
"""

from __future__ import annotations

from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions
from chunkq.jobs.kinds import cross, dense, image, multivector, sparse
from chunkq.jobs.kinds.contract import Kind

KINDS: dict[str, Kind] = {
    k.name: k for k in (dense.KIND, cross.KIND, sparse.KIND, multivector.KIND, image.KIND)
}


def get(name: str) -> Kind:
    """The kind called ``name``; ConfigError naming the kinds there are."""
    if name in KINDS:
        return KINDS[name]
    raise ConfigError(f"kind {name!r}: one of {', '.join(KINDS)}")


def check_options(options: EncodeOptions) -> None:
    """ConfigError where ``options`` ask of the run's kind what it cannot do."""
    kind = get(options.kind)
    why = kind.refuse(options)
    if options.allow_missing and not (kind.reads_rows or options.late_chunking):
        why = "--allow-missing is for rows that name what to read (--kind image) or late-chunking windows"
    if why:
        raise ConfigError(f"--kind {options.kind}: {why}")
