"""Issue 44.3: the GPU tier runs the tree without installing it (``PYTHONPATH=. python -m chunkq``,
with the GPU host's own torch), and every run failed at once there: ``PackageNotFoundError: No
package metadata was found for chunkq``. Here the tree runs the same way: an interpreter that sees
every dependency this venv has, but no chunkq distribution and no editable install."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers import cli_env, make_texts, write_corpus

REPO = Path(__file__).resolve().parents[2]


def _uninstalled(tmp_path: Path) -> tuple[list[str], dict[str, str], Path]:
    """A command line and environment in which chunkq is a copy of the tree alone (its packages and
    pyproject.toml, as the device tool copies a checkout; no egg-info): ``python -S`` (no site, so
    no .pth file and no editable finder) with a folder linking to every installed package but
    chunkq's own files on the path; and the tree's folder."""
    tree = tmp_path / "tree"
    for name in ("chunkq", "jobs", "queue_worker", "supervisor"):
        shutil.copytree(REPO / name, tree / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tree / "pyproject.toml")
    site = Path(sysconfig.get_paths()["purelib"])
    shadow = tmp_path / "site-packages"
    shadow.mkdir()
    for entry in site.iterdir():
        if entry.name.lower().startswith(("chunkq", "__editable__")) or entry.suffix == ".pth":
            continue
        (shadow / entry.name).symlink_to(entry)
    env = cli_env(PYTHONPATH=f"{tree}:{shadow}")
    return [sys.executable, "-S", "-m", "chunkq"], env, tree


@pytest.mark.slow
def test_the_tree_runs_without_being_installed(tmp_path: Path) -> None:
    command, env, tree = _uninstalled(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-S", "-c", "import importlib.metadata as m; m.version('chunkq')"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "PackageNotFoundError" in probe.stderr  # the environment is what the GPU host's is
    shown = subprocess.run(
        [*command, "--version"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert shown.returncode == 0 and f"0.1.0 (not installed: {tree})" in shown.stdout, shown.stderr
    ids, texts = make_texts(12, seed=3)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    done = subprocess.run(
        [*command, "run", str(corpus), "--store", str(store), "--chunk-size", "6"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (store / "runs").iterdir()
    assert json.loads((run / "result" / "manifest.json").read_text())["rows"] == 12
