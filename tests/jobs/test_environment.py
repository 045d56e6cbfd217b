"""Issue 66.7: one table of chunkq's environment variables. Every ``CHUNKQ_*`` name the product's
source reads, sets or mentions is declared (``jobs/contract/environment.py``, or a setting's own in
``settings.py`` and ``supervisor/run_options.py``), only those two places spell one as a string, and
docs/settings.md lists every one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from chunkq.jobs.contract import environment
from chunkq.jobs.contract.settings import ENV_PREFIX, schema
from chunkq.supervisor.run_options import RUN_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bCHUNKQ_[A-Z0-9_]*[A-Z0-9]\b")
SPELLERS = {ROOT / "jobs/contract/environment.py", ROOT / "jobs/contract/settings.py"}
STANDALONE = {ROOT / "queue_worker/devices/cuda_devices.py"}  # runs as a script, the standard library alone


def _sources() -> list[Path]:
    found = [p for d in ("jobs", "queue_worker", "supervisor") for p in (ROOT / d).rglob("*.py")]
    found += [p for d in ("cli", "tools", "sinks") for p in (ROOT / "chunkq" / d).rglob("*.py")]
    return [*found, ROOT / "chunkq" / "api.py", ROOT / "chunkq" / "__init__.py"]


def _declared() -> set[str]:
    settings = {meta.env_name(name) for name, meta, _ in (*schema(), *RUN_OPTIONS)}
    return set(environment.VARIABLES) | {name for name in settings if name is not None}


def test_every_variable_named_in_the_source_is_declared() -> None:
    declared = _declared()
    assert len(environment.VARIABLES) >= 20 and len(declared) >= 50
    undeclared = sorted(
        f"{path.relative_to(ROOT)}: {name}"
        for path in _sources()
        for name in set(NAME.findall(path.read_text()))
        if name not in declared and name + "_" != ENV_PREFIX
    )
    assert undeclared == []


def test_only_the_table_and_the_settings_spell_a_variable() -> None:
    spelt = []
    for path in _sources():
        if path in SPELLERS | STANDALONE:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                spelt.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert spelt == []


def test_the_settings_page_lists_every_variable() -> None:
    page = (ROOT / "docs" / "settings.md").read_text()
    assert sorted(name for name in _declared() if name not in page) == []
