"""This host's OpenVINO exports (``ov_backend`` makes them), looked after: what each holds and whether
this host's releases still read it (``chunkq cache exports``), and removing those no load here will
read again, or every one (``--clean``, ``--clean --all``). An export is derived data: removing one
costs the next load of its model an export (8-10 s for the bundled model here).

An export's folder is keyed by its model's identity and the OpenVINO and optimum-intel releases that
made it, so an upgrade leaves every earlier export behind, never read again: *stale*. A folder
without its mark is one an export left unfinished (``.NAME.PID`` while its process lives: *being
written*, never touched here).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import Any

from chunkq.jobs.compute.ov_backend import EXPORTED_MARK, LOCK_SUFFIX, exports_dir, releases
from chunkq.jobs.contract.process_clock import ran_since
from chunkq.jobs.contract.storage import remove_tree

CURRENT, STALE, UNFINISHED, WRITING = "current", "stale", "unfinished", "being written"
# Made by an OpenVINO this Python lacks: another installation on the host may read it; --all only.
ELSEWHERE = "for another installation"
DAMAGED, UNREADABLE = "damaged", "unreadable"  # a mark that is no mark; a folder chunkq may not read
REMOVED_BY_CLEAN = {STALE, UNFINISHED, DAMAGED}
REMOVED_BY_ALL = REMOVED_BY_CLEAN | {CURRENT, ELSEWHERE}


def summary() -> list[dict[str, Any]]:
    """Per export folder: its name, model, the releases that made it, its state, bytes and age.
    Links are not chunkq's (it makes folders) and are left out."""
    root, here = exports_dir(), releases()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir(), key=lambda p: p.name.lstrip(".")):
        if folder.name.endswith(LOCK_SUFFIX) or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            out.append(_entry(folder, here))
        except OSError:
            out.append(_described(folder, None, {}, UNREADABLE, 0, time.time()))
    return out


def _entry(folder: Path, here: dict[str, str]) -> dict[str, Any]:
    size, made = _size_and_time(folder)
    try:  # any other OSError: the folder is unreadable (summary)
        mark = json.loads((folder / EXPORTED_MARK).read_text())
    except FileNotFoundError:
        mark = None
    except ValueError:
        mark = DAMAGED
    if mark is not None and not isinstance(mark, dict):
        return _described(folder, None, {}, DAMAGED, size, made)
    made_with = {name: str(mark.get(name, "unknown")) for name in here} if mark else {}
    if folder.name.startswith(".") or mark is None:
        state = _unfinished_or_writing(folder)
    elif made_with == here:
        state = CURRENT
    else:
        state = ELSEWHERE if here.get("openvino") == "absent" else STALE
    return _described(folder, mark, made_with, state, size, made)


def _described(
    folder: Path, mark: dict[str, Any] | None, made_with: dict[str, str], state: str, size: int, made: float
) -> dict[str, Any]:
    return {
        "export": folder.name,
        "model": str(mark.get("from") or mark.get("model") or "unknown") if mark else "-",
        "identity": str(mark.get("model", "")) if mark else "",
        "made_with": made_with,
        "state": state,
        "bytes": size,
        "age_seconds": round(max(0.0, time.time() - made), 1),
    }


def clean(everything: bool) -> dict[str, int]:
    """Remove the stale and unfinished exports, or with ``everything`` the current ones too (a run
    that loads one meanwhile may fail that chunk's attempt, which is retried and exports again).
    Never an export being written."""
    removed = {"exports": 0, "bytes": 0}
    for entry in summary():
        if entry["state"] not in (REMOVED_BY_ALL if everything else REMOVED_BY_CLEAN):
            continue
        folder = exports_dir() / entry["export"]
        # Renamed first, in one step: a load that starts later finds no export and makes one.
        aside = folder.with_name(f".{_key(folder)}.{os.getpid()}.removed")
        try:
            os.replace(folder, aside)
        except OSError:
            continue  # gone meanwhile, or replaced by an exporter that finished
        remove_tree(aside)
        removed["exports"] += 1
        removed["bytes"] += entry["bytes"]
    _forget_unused_locks(exports_dir())
    return removed


def _unfinished_or_writing(folder: Path) -> str:
    if folder.name.startswith("."):  # ov_backend.keep_export's ".KEY.PID" (or one removed here)
        pid = folder.name.rsplit(".", 1)[-1]
        try:  # its writer made it, so ran before its last change (a pid given to another since: no)
            writing = pid.isdigit() and ran_since(int(pid), folder.stat().st_mtime)
        except OSError:
            writing = False
        return WRITING if writing else UNFINISHED
    return UNFINISHED  # no mark: never finished


def _size_and_time(folder: Path) -> tuple[int, float]:
    size, made = 0, 0.0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                stat = os.stat(os.path.join(dirpath, name))
                size, made = size + stat.st_size, max(made, stat.st_mtime)
    return size, made or time.time()


def _key(folder: Path) -> str:
    """The export's key, also for ``.KEY.PID`` and ``.KEY.PID.removed``."""
    return folder.name.lstrip(".").split(".")[0]


def _forget_unused_locks(root: Path) -> None:
    """The lock files of exports no longer there, unless an exporter holds one (it is exporting)."""
    if not root.is_dir():
        return
    keys = {_key(p) for p in root.iterdir() if not p.name.endswith(LOCK_SUFFIX)}
    for lock in root.glob(f"*{LOCK_SUFFIX}"):
        if _key(lock) in keys:
            continue
        try:
            with open(lock, "a") as held:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock.unlink()
        except OSError:
            pass  # held, or gone
