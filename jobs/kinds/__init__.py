"""Model kinds: what a run's model is and what a row of its result holds (shared/DESIGN.md "Kinds").

Each kind is one module here behind one small contract (``contract.Kind``): the sentence-transformers
class that loads it, how a chunk's rows are encoded to a float32 matrix (row i for input row i), the
warm-up a fresh worker runs once, and the options that mean nothing for it. Everything around a
kind (chunks, recycling, OOM back-off, retries, resume, the manifest, the vector cache, verified
assembly, shards, export, status) is written once and knows a kind only through ``get``. Adding a
kind is one module and one line in ``KINDS``.

Built: ``dense`` (``SentenceTransformer.encode``), ``cross`` (``CrossEncoder.predict`` over pairs),
``sparse`` (``SparseEncoder``, CSR) and ``multivector`` (``MultiVectorEncoder``, a token matrix per
text), the last two stored ragged (jobs.ragged). Not built yet (issue 34): ``image`` (rows that
are not texts).
"""

from __future__ import annotations

from chunkq.jobs.errors import ConfigError
from chunkq.jobs.kinds import cross, dense, multivector, sparse
from chunkq.jobs.kinds.contract import Kind
from chunkq.jobs.specs import EncodeOptions

KINDS: dict[str, Kind] = {k.name: k for k in (dense.KIND, cross.KIND, sparse.KIND, multivector.KIND)}
NOT_BUILT = ("image",)


def get(name: str) -> Kind:
    """The kind called ``name``; ConfigError naming the kinds there are."""
    if name in KINDS:
        return KINDS[name]
    if name in NOT_BUILT:
        raise ConfigError(f"kind {name!r} is not built yet; chunkq runs {', '.join(KINDS)}")
    raise ConfigError(f"kind {name!r}: one of {', '.join(KINDS)}")


def check_options(options: EncodeOptions) -> None:
    """ConfigError where ``options`` ask of the run's kind what it cannot do."""
    why = get(options.kind).refuse(options)
    if why:
        raise ConfigError(f"--kind {options.kind}: {why}")
