"""Which chunkq this is: the installed distribution's version, or, for a tree run without an install
(``PYTHONPATH=. python -m chunkq``, as the GPU tier runs on a host with its own torch), the version
its pyproject.toml says. A run's log and ``chunkq --version`` name it."""

from __future__ import annotations

import importlib.metadata
import tomllib
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError
from pathlib import Path

DISTRIBUTION = "chunkq"


def chunkq_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except PackageNotFoundError:
        pass
    # jobs/contract/release.py: jobs/ is a top-level folder of the tree, beside pyproject.toml
    # (chunkq/jobs links to it).
    project = Path(__file__).resolve().parents[2] / "pyproject.toml"
    try:
        return f"{tomllib.loads(project.read_text())['project']['version']} (not installed: {project.parent})"
    except (OSError, KeyError, ValueError):
        return "unknown (not installed)"


def releases(parts_of: Mapping[str, int | None]) -> dict[str, str]:
    """Each installed distribution's release, "absent" where not installed: its first N parts where
    ``parts_of`` gives N (a local build's suffix, torch's "+cpu" or "+cu130", is then not part of
    it), whole where it gives None."""
    found = {}
    for name, parts in parts_of.items():
        try:
            release = importlib.metadata.version(name)  # looked up by its module: a test can stand in
        except PackageNotFoundError:
            found[name] = "absent"
            continue
        found[name] = release if parts is None else ".".join(release.split("+")[0].split(".")[:parts])
    return found
