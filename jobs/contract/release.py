"""Which chunkq this is: the installed distribution's version, or, for a tree run without an install
(``PYTHONPATH=. python -m chunkq``, as the GPU tier runs on a host with its own torch), the version
its pyproject.toml says. A run's log and ``chunkq --version`` name it."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

DISTRIBUTION = "chunkq"


def chunkq_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    # jobs/contract/release.py: jobs/ is a top-level folder of the tree, beside pyproject.toml
    # (chunkq/jobs links to it).
    project = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        return f"{tomllib.loads(project.read_text())['project']['version']} (not installed: {project.parent})"
    except (OSError, KeyError, ValueError):
        return "unknown (not installed)"
