"""``chunkq quantize``: an int8 OpenVINO copy of a model, calibrated on texts of the user's own, for
``chunkq run --backend openvino --precision int8`` (jobs/compute/ov_quantize.py). Offline: the
calibration texts come from a corpus file, not a dataset on the Hub."""

from __future__ import annotations

import itertools
from pathlib import Path

import click

from chunkq.cli.common import redis_option
from chunkq.cli.group import command
from chunkq.jobs.compute import ov_backend
from chunkq.jobs.compute.model_info import describe
from chunkq.jobs.compute.ov_quantize import CALIBRATION_TEXTS, quantize
from chunkq.jobs.contract.errors import ConfigError
from chunkq.supervisor.corpus.records import CorpusOptions, detect_format, read_corpus


@command("quantize")
@click.argument("model")
@click.argument("corpus", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The new model folder.")
@click.option(
    "--texts",
    type=click.IntRange(min=1),
    default=CALIBRATION_TEXTS,
    show_default=True,
    help="Texts to calibrate on, from the start of CORPUS (give a file of a sample of yours).",
)
@click.option("--text-field", default=CorpusOptions.text_field, show_default=True, help="The text's field.")
@redis_option("unused")
def quantize_cmd(
    model: str, corpus: Path, out: Path, texts: int, text_field: str, redis_url: str | None
) -> None:
    """Copy MODEL (a folder, a name in the Hugging Face cache, or the bundled model) to --out with an
    int8 OpenVINO model added, calibrated on texts of CORPUS (JSON Lines, CSV or Parquet). Run it
    with `chunkq run ... --model OUT --backend openvino --precision int8`; it rounds (the run
    records its agreement with fp32)."""
    del redis_url
    ov_backend.require()
    folder = describe(model).folder
    if folder is None:
        raise ConfigError(f"model {model}: no files on this host to quantize")
    options = CorpusOptions(detect_format(corpus, None), text_field=text_field)
    sample = [row.text for row in itertools.islice(read_corpus(corpus, options), texts) if row.text]
    made = quantize(folder, sample, out)
    click.echo(f"int8 model of {model} calibrated on {len(sample)} texts: {made}")
    click.echo(f"run it: chunkq run CORPUS --model {out} --backend openvino --precision int8")
