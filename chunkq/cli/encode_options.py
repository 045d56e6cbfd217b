"""The options of a run's corpus, model and encoding (``submit``, ``run``) and of its watch
(``supervise``, ``run``), generated from the run options' schema (``supervisor/run_options.py``)."""

from __future__ import annotations

import click

from chunkq.cli.common import queue_option, store_option
from chunkq.cli.settings_options import F, run_option_flag, run_options
from chunkq.supervisor.run_options import SUBMIT, WATCH

QUEUE_WINDOW_OPTION = run_option_flag("queue_window")
SHARD_SIZE_OPTION = run_option_flag("shard_size")
KEEP_OUTPUTS_OPTION = run_option_flag("keep_outputs")


def submit_options(func: F) -> F:
    func = store_option(queue_option(run_options(SUBMIT)(func)))
    # Text, not click.Path: a corpus may be an fsspec URL (s3://bucket/corpus/*.parquet).
    return click.argument("corpus", nargs=-1, required=True)(func)


def watch_options(func: F) -> F:
    return run_options(WATCH)(func)
