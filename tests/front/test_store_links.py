"""The store is a closed world (issue 21.9): nothing chunkq writes, replaces or deletes is reached
through a symbolic link that leaves it. Each link below is one a user or another process could make."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.storage import StoreLinkError
from chunkq.supervisor.result.assemble import assemble
from chunkq.tools.run_list import clean
from tests.helpers import run_cli


def _moved_out(folder: Path, elsewhere: Path) -> None:
    """Move ``folder`` out of the store and leave a link to it in its place."""
    shutil.move(folder, elsewhere)
    folder.symlink_to(elsewhere, target_is_directory=True)


@pytest.mark.slow
def test_clean_outputs_only_never_deletes_through_a_linked_outputs_folder(
    encoded_run: Any, tmp_path: Path
) -> None:
    layout, _, _ = encoded_run
    assemble(Run.of(layout))
    elsewhere = tmp_path / "elsewhere"
    _moved_out(layout.outputs, elsewhere)
    (elsewhere / "unrelated.npy").write_bytes(b"someone else's")
    before = sorted(p.name for p in elsewhere.iterdir())
    with pytest.raises(StoreLinkError, match="outputs is a symbolic link"):
        clean(layout, outputs_only=True)
    assert sorted(p.name for p in elsewhere.iterdir()) == before  # every .npy still there

    cli = run_cli("clean", layout.run_id, "--outputs-only", "--store", str(layout.store))
    assert cli.returncode == 6, cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1 and "symbolic link" in cli.stderr


@pytest.mark.slow
def test_a_linked_run_folder_is_neither_cleaned_nor_reported_as_freed(
    encoded_run: Any, tmp_path: Path
) -> None:
    layout, _, _ = encoded_run
    elsewhere = tmp_path / "run-elsewhere"
    _moved_out(layout.root, elsewhere)
    cli = run_cli("clean", layout.run_id, "--store", str(layout.store))
    assert cli.returncode == 6 and "freed" not in cli.stdout, (cli.stdout, cli.stderr)
    assert (elsewhere / "manifest.json").is_file()


@pytest.mark.slow
def test_assembly_never_replaces_a_linked_result(encoded_run: Any, tmp_path: Path) -> None:
    layout, _, _ = encoded_run
    elsewhere = tmp_path / "result-elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    layout.result.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(StoreLinkError, match="result is a symbolic link"):
        assemble(Run.of(layout))
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]
    assert not list(layout.store.glob("runs/*/.result.tmp-*"))


def test_a_linked_runs_folder_or_redis_folder_is_refused(tmp_path: Path) -> None:
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.supervisor.server.store_redis import embedded_redis_dir

    store = tmp_path / "store"
    store.mkdir()
    (tmp_path / "other").mkdir()
    (store / "runs").symlink_to(tmp_path / "other", target_is_directory=True)
    (store / "redis").symlink_to(tmp_path / "other", target_is_directory=True)
    with pytest.raises(StoreLinkError, match="runs is a symbolic link"):
        RunLayout(store, "r").manifest  # noqa: B018 - the path itself is refused
    with pytest.raises(StoreLinkError, match="redis is a symbolic link"):
        embedded_redis_dir(store)
