"""A model load that would give meaningless rows is refused, in one line, before a row is encoded.

Two libraries say so only in a log line, so the load is watched for them:
- transformers builds the weights a checkpoint lacks with random values and reports them: "Some
  weights of X were not initialized from the model checkpoint at P and are newly initialized: [...]"
  (transformers 4) or a "LOAD REPORT" whose MISSING rows "were newly initialized because missing
  from the checkpoint" (transformers 5, ``utils/loading_report.py``). A cross-encoder's classifier
  or a sparse model's masked-LM head built that way scores at random, differently at every load.
- sentence-transformers loads a model saved as another kind by converting it, with "Converting
  SentenceTransformer model P to SparseEncoder." (``base/model.py``): a dense model read as a sparse
  or multi-vector one, or as a cross-encoder, is not the model its author trained. From a bare
  checkpoint it builds what the kind lacks, at INFO: "No ColBERT checkpoint detected: added a
  randomly-initialised projection" (``multi_vector_encoder/model.py``), "No MLM architecture
  detected, using default Transformer + mean Pooling + SparseAutoEncoder" (``sparse_encoder``).
The run's kind comes from the model's files (``model_info.describe``) and a kind they contradict is
refused at submit; this is the check for whatever the files cannot show.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from chunkq.jobs.contract.errors import ConfigError

# The loggers read during a load, from which level, and what in them means the weights are not the
# checkpoint's.
WATCHED = {"transformers": logging.WARNING, "sentence_transformers": logging.INFO}
_FRESH = re.compile(r"newly initiali[sz]ed|randomly.initiali[sz]ed|No MLM architecture detected")
_CONVERTED = re.compile(r"^Converting (\w+) model .* to (\w+)\.$", re.DOTALL)
_MISSING = re.compile(r"^(\S+)\s*\|\s*\S*MISSING", re.MULTILINE)
_LISTED = re.compile(r"newly initiali[sz]ed: \[([^\]]*)\]")


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def _weights_named(message: str) -> str:
    listed = ",".join(_LISTED.findall(message)).split(",")
    found = _MISSING.findall(message) or [n.strip(" '\"") for n in listed]
    names = sorted({n for n in found if n})  # transformers' versions list them in different orders
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def problem(messages: list[str], ref: str, model_class: str) -> str | None:
    """Why a load that logged ``messages`` gives meaningless rows, or None."""
    for message in messages:
        converted = _CONVERTED.match(message.strip())
        if converted:
            return (
                f"model {ref} was saved as a {converted.group(1)}, not a {model_class}: its files "
                "say which kind it is (`chunkq model` shows it); leave --kind out, or give that kind"
            )
        if _FRESH.search(message):
            named = _weights_named(message)
            return (
                f"model {ref} lacks weights a {model_class} needs"
                + (f" ({named})" if named else "")
                + ", which would be random: it is not a model of this kind (`chunkq model` shows its "
                "kind); leave --kind out, or give a model trained for this one"
            )
    return None


@contextlib.contextmanager
def refusing_untrained_weights(ref: str, model_class: str) -> Iterator[None]:
    """Run a load; ConfigError after it if transformers or sentence-transformers said its rows would
    not be the trained model's. Their lines are let through for the load even where a user set the
    loggers quieter, since they decide whether the run may go on."""
    collect = _Collect()
    loggers = [logging.getLogger(name) for name in WATCHED]
    levels = [logger.level for logger in loggers]
    for logger, level in zip(loggers, WATCHED.values(), strict=True):
        logger.addHandler(collect)
        if logger.getEffectiveLevel() > level:
            logger.setLevel(level)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeHandler(collect)
            logger.setLevel(level)
    why = problem(collect.records, ref, model_class)
    if why:
        raise ConfigError(why)
