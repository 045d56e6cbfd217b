"""``chunkq cache exports``: this host's OpenVINO exports, listed and cleaned (jobs/compute/ov_exports.py).

Here, without OpenVINO, the folders are laid out as ov_backend.keep_export lays them out (a mark
written last, ``.KEY.PID`` while an export is written, ``KEY.lock`` beside); tests/jobs/test_openvino.py
lists and removes a real export where the extra is installed (make test-openvino)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chunkq.jobs.compute import ov_backend, ov_exports
from tests.helpers import run_cli


def _export(root: Path, name: str, mark: dict[str, str] | None, size: int = 4096) -> Path:
    folder = root / name
    (folder / "openvino").mkdir(parents=True)
    (folder / "openvino" / "openvino_model.bin").write_bytes(b"\0" * size)
    if mark is not None:
        (folder / ov_backend.EXPORTED_MARK).write_text(json.dumps(mark))
    (root / f"{name.lstrip('.').split('.')[0]}.lock").touch()
    return folder


@pytest.mark.skipif(ov_backend.missing() is None, reason="the command run from a Python without OpenVINO")
def test_stale_and_unfinished_exports_are_cleaned_and_current_ones_only_with_all(tmp_path: Path) -> None:
    root = tmp_path / "cache" / "chunkq" / "openvino"
    here = ov_backend.releases()  # what this environment has: OpenVINO absent, here
    model = "bundled:all-MiniLM-L6-v2@files:1234"
    _export(root, "a" * 32, {"model": model, "from": "/models/minilm", **here})  # by the releases here
    _export(root, "b" * 32, {"model": model, "openvino": "2025.0.0", "optimum-intel": "1.22.0"})
    _export(root, "c" * 32, None)  # no mark: unfinished
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    _export(root, f".{'d' * 32}.{int(dead.stdout)}", None)  # its exporter is gone
    _export(root, f".{'e' * 32}.{os.getpid()}", None)  # its exporter lives: never touched
    _export(root, "f" * 32, None)
    (root / ("f" * 32) / ov_backend.EXPORTED_MARK).write_text("[1, 2]")  # JSON, but no mark
    (tmp_path / "elsewhere").mkdir()
    (root / ("9" * 32)).symlink_to(tmp_path / "elsewhere")  # not chunkq's: left out, never followed
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}

    listed = run_cli("cache", "exports", "--json", **env)
    assert listed.returncode == 0, listed.stderr
    states = {e["export"].lstrip(".")[0]: e["state"] for e in json.loads(listed.stdout)}
    # b was made by an OpenVINO this Python lacks (another installation's, perhaps): not stale here.
    assert states == {
        "a": "current",
        "b": "for another installation",
        "c": "unfinished",
        "d": "unfinished",
        "e": "being written",
        "f": "damaged",
    }
    entries = {e["export"][0]: e for e in json.loads(listed.stdout)}
    assert entries["b"]["made_with"] == {"openvino": "2025.0.0", "optimum-intel": "1.22.0"}
    assert entries["a"]["model"] == "/models/minilm" and entries["a"]["identity"] == model
    assert entries["b"]["model"] == model and entries["a"]["bytes"] > 4096  # marked before "from"
    table = run_cli("cache", "exports", **env).stdout
    assert "openvino 2025.0.0 optimum-intel 1.22.0" in table and "being written" in table

    # c, d and f go; an exporter holds c's lock: the lock stays.
    with open(root / f"{'c' * 32}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        cleaned = run_cli("cache", "exports", "--clean", **env)
    assert cleaned.returncode == 0 and cleaned.stdout.startswith("removed 3 export(s), "), (
        cleaned.stdout
    )  # c d f
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted(
        [
            "a" * 32,
            "a" * 32 + ".lock",
            "b" * 32,
            "b" * 32 + ".lock",
            "9" * 32,
            "c" * 32 + ".lock",
            f".{'e' * 32}.{os.getpid()}",
            "e" * 32 + ".lock",
        ]
    )

    alone = run_cli("cache", "exports", "--all", **env)
    assert alone.returncode != 0 and "give it with --clean" in alone.stderr and (root / ("a" * 32)).is_dir()
    everything = run_cli("cache", "exports", "--clean", "--all", **env)
    assert everything.stdout.startswith("removed 2 export(s), "), everything.stdout  # a b
    left = [f".{'e' * 32}.{os.getpid()}", "9" * 32, "e" * 32 + ".lock"]
    assert sorted(p.name for p in root.iterdir()) == sorted(left)
    assert (tmp_path / "elsewhere").is_dir()


def test_an_export_made_by_other_releases_than_this_installations_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where this Python has OpenVINO, an export another release made is never read here: stale,
    removed by --clean, as one made by this release is not."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    installed = {"openvino": "2026.4.1", "optimum-intel": "2.2.0"}
    monkeypatch.setattr(ov_exports, "releases", lambda: installed)
    root = ov_backend.exports_dir()
    _export(root, "a" * 32, {"model": "m", **installed})
    _export(root, "b" * 32, {"model": "m", "openvino": "2025.0.0", "optimum-intel": "2.2.0"})
    assert [e["state"] for e in ov_exports.summary()] == ["current", "stale"]
    assert ov_exports.clean(everything=False)["exports"] == 1
    assert [e["export"][0] for e in ov_exports.summary()] == ["a"]


def test_an_exporter_whose_lock_file_was_cleaned_before_it_locked_holds_the_one_there_now(
    tmp_path: Path,
) -> None:
    """``--clean`` unlinks a lock file no one holds; an exporter that had opened it and not yet
    locked it then locked an unlinked file, which excluded no second exporter (the sixteenth
    session's hostile pass: two exports of one model at once)."""
    import threading

    from tests.helpers import wait_for

    path = tmp_path / f"key{ov_backend.LOCK_SUFFIX}"
    held, done = threading.Event(), threading.Event()

    def exporter() -> None:
        with ov_backend.export_lock(path):
            held.set()
            done.wait(30)

    with open(path, "a") as cleaner:
        fcntl.flock(cleaner, fcntl.LOCK_EX)  # as ov_exports holds it while it unlinks
        thread = threading.Thread(target=exporter, daemon=True)
        thread.start()

        def opened_twice() -> bool:
            fds = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
            return sum(1 for fd in fds if os.path.realpath(fd) == str(path)) >= 2

        wait_for(opened_twice, 30, "the exporter's open of the lock file")
        path.unlink()
    try:
        assert held.wait(30), "the exporter never took the lock"
        with open(path, "a") as second:  # a second exporter, now
            with pytest.raises(BlockingIOError):
                fcntl.flock(second, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        done.set()
        thread.join(30)


def test_a_folder_being_written_whose_pid_went_to_a_newer_process_is_unfinished(tmp_path: Path) -> None:
    """``.KEY.PID`` of an exporter that died, its pid since given to a process started after the
    folder's last change: it read "being written", so ``--clean`` never removed it."""
    root = tmp_path / "openvino"
    root.mkdir()
    folder = _export(root, f".{'f' * 32}.{os.getpid()}", None)
    assert ov_exports._unfinished_or_writing(folder) == ov_exports.WRITING  # this process wrote it
    an_hour_ago = os.stat(folder).st_mtime - 3600
    os.utime(folder, (an_hour_ago, an_hour_ago))  # last changed before this process began
    assert ov_exports._unfinished_or_writing(folder) == ov_exports.UNFINISHED
