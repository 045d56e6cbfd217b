"""The ``chunkq`` command group and the decorator every subcommand is made with."""

from __future__ import annotations

import logging
from collections.abc import Callable

import click

from chunkq.cli.common import (
    configure_logging,
    log_level_option,
    reports_errors,
)
from chunkq.cli.help_sections import SectionedCommand
from chunkq.cli.settings_options import F
from chunkq.jobs.contract.release import chunkq_version
from chunkq.jobs.contract.settings import PoolSettings


def current_log_level() -> str:
    return logging.getLevelName(logging.getLogger().getEffectiveLevel())


@click.group()
@log_level_option
@click.version_option(version=chunkq_version(), prog_name="chunkq")
def cli() -> None:
    """chunkq: embed large corpora with sentence-transformers; nothing is lost when a process dies.

    Start with `chunkq run CORPUS`; `chunkq runs` lists what the store holds.
    """
    if not logging.getLogger().handlers:
        configure_logging(PoolSettings.log_level)


def command(name: str) -> Callable[[F], click.Command]:
    """A subcommand that takes --log-level after its name too, and reports errors in one line."""

    def decorate(func: F) -> click.Command:
        return cli.command(name, cls=SectionedCommand)(log_level_option(reports_errors(func)))

    return decorate
