"""One schema for every setting: the pool's (jobs/contract/settings.py) and a run's
(supervisor/run_options.py). The command line, the Python API's keywords and docs/settings.md are generated
from them or checked against them here, so an option added by hand anywhere else fails a test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import pytest

from chunkq.cli import cli
from chunkq.jobs.contract.settings import flag, schema
from chunkq.supervisor.request import POOL_NAMES, RUN_DECIDES_FOR_THE_POOL, RUN_NAMES
from chunkq.supervisor.run_options import RUN_OPTIONS, SUBMIT, WATCH

ROOT = Path(__file__).resolve().parents[2]
EVERY_COMMANDS = {"store", "queue", "redis_url", "as_json", "help_all"}  # cli/common.py, --json, --help-all


def _options(command: str) -> dict[str, click.Option]:
    found = cli.commands[command].params  # type: ignore[attr-defined]
    return {
        p.name: p
        for p in found
        if isinstance(p, click.Option) and p.name and p.name not in ("log_level", "verbose")
    }


def _entries(receiver: str) -> list[tuple[str, Any, Any]]:
    return [o for o in RUN_OPTIONS if o[1].receiver == receiver]


def test_each_command_takes_exactly_the_schemas_options_with_their_flag_variable_and_default() -> None:
    pool = [(n, m, d) for n, m, d in schema() if m.cli]
    expected = {
        "run": _entries(SUBMIT) + _entries(WATCH) + [e for e in pool if e[0] not in RUN_DECIDES_FOR_THE_POOL],
        "submit": _entries(SUBMIT) + [o for o in RUN_OPTIONS if o[0] == "queue_window"],
        "supervise": _entries(WATCH),
        "pool": pool,
    }
    for command, entries in expected.items():
        options = _options(command)
        assert set(options) - EVERY_COMMANDS == {n for n, _, _ in entries}, command
        for name, meta, default in entries:
            option = options[name]
            assert flag(name, meta) in option.opts, (command, name, option.opts)
            assert option.envvar == meta.env_name(name), (command, name)
            if default is not None and not callable(default) and meta.kind != "list":
                assert option.default == default, (command, name, option.default)


def test_the_python_api_takes_every_option_by_its_schema_name() -> None:
    run_names = {name for name, _, _ in RUN_OPTIONS}
    assert run_names <= RUN_NAMES
    # What the API takes beyond the schema's names: the queue, the CLI's --format by its own name, and
    # EncodeOptions' field names.
    from dataclasses import fields

    from chunkq.jobs.contract.specs import EncodeOptions

    assert RUN_NAMES - run_names == {"queue", "format"} | (
        {f.name for f in fields(EncodeOptions)} - run_names
    )
    assert not run_names & POOL_NAMES - {"precision", "trust_remote_code", "metrics_port"}


def test_the_documentation_names_every_option_of_every_schema() -> None:
    readme = "\n".join(
        page.read_text() for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    pool = [(n, m) for n, m, _ in schema() if m.cli]
    missing = [
        flag(n, m) for n, m in pool + [(n, m) for n, m, _ in RUN_OPTIONS] if f"`{flag(n, m)}" not in readme
    ]
    assert missing == []


def test_spans_of_time_are_taken_as_the_docs_write_them() -> None:
    """Issue 53.4: `--recycle-after 10m` was refused (seconds only), though the docs write it so."""
    import click

    from chunkq.cli.settings_options import Seconds
    from chunkq.jobs.contract.units import duration_seconds

    seconds = Seconds(0)
    assert [seconds.convert(v, None, None) for v in ("600", "10m", "10min", "2h", "1.5d", 30)] == [
        600.0,
        600.0,
        600.0,
        7200.0,
        129600.0,
        30.0,
    ]
    for bad in ("10x", "-5", "m10"):
        with pytest.raises(click.BadParameter, match="give seconds, or a number with s, m"):
            seconds.convert(bad, None, None)
    assert duration_seconds("30d") == 30 * 86400 and duration_seconds("soon") is None
