"""``chunkq rerank``: a cross-encoder's scores for one query against a few passages, in this process
(what ``chunkq.embed`` of (query, passage) pairs does: ``CrossEncoder.predict``), best first. A run is
for a corpus of pairs (``chunkq run --kind cross --pair-field``); reranking a search's top k is
interactive, and a run's start-up (a server, a pool, a worker) would cost seconds per query."""

from __future__ import annotations

import json
from pathlib import Path

import click

from chunkq.cli.common import redis_option
from chunkq.cli.group import command
from chunkq.jobs.contract.errors import ConfigError
from chunkq.supervisor.corpus.records import CorpusOptions, detect_format, read_corpus

RERANK_MOST = 10_000  # passages scored at once in this process: a reranker's top k, not a corpus


@command("rerank")
@click.argument("query")
@click.argument("passages", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option(
    "--model", required=True, help="A cross-encoder: a local folder or a name in the Hugging Face cache."
)
@click.option(
    "--text-field", default=CorpusOptions.text_field, show_default=True, help="The passage's field."
)
@click.option("--id-field", default=CorpusOptions.id_field, show_default=True, help="The passage's id field.")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show the best N only.")
@click.option("--json", "as_json", is_flag=True, help="Print [{id, score, text}] as JSON.")
@redis_option("unused")
def rerank_cmd(
    query: str,
    passages: Path,
    model: str,
    text_field: str,
    id_field: str,
    top: int | None,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Score QUERY against each passage of PASSAGES (JSON Lines, CSV or Parquet; a row number is the
    id where the field is absent) with a cross-encoder, best first."""
    import chunkq

    del redis_url
    options = CorpusOptions(detect_format(passages, None), text_field=text_field, id_field=id_field)
    rows = list(read_corpus(passages, options))
    if len(rows) > RERANK_MOST:
        raise ConfigError(
            f"{passages}: {len(rows):,} passages; rerank scores a search's top k (at most {RERANK_MOST:,}) "
            "in this process: for a corpus of pairs, `chunkq run --kind cross --pair-field ...`"
        )
    scores = chunkq.embed([(query, r.text) for r in rows], model=model, kind="cross", isolated=False)
    ranked = sorted(
        zip(scores.reshape(len(rows), -1)[:, -1].tolist(), rows, strict=True), key=lambda p: -p[0]
    )
    ranked = ranked[:top] if top else ranked
    if as_json:
        click.echo(json.dumps([{"id": r.id, "score": s, "text": r.text} for s, r in ranked], indent=2))
        return
    for score, row in ranked:
        click.echo(f"{score:10.4f}  {row.id}  {row.text[:80]}")
