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

import psutil

from chunkq.jobs.compute.ov_backend import EXPORTED_MARK, exports_dir, releases
from chunkq.jobs.contract.storage import remove_tree

CURRENT, STALE, UNFINISHED, WRITING = "current", "stale", "unfinished", "being written"
LOCK_SUFFIX = ".lock"


def summary() -> list[dict[str, Any]]:
    """Per export folder: its name, model, the releases that made it, its state, bytes and age."""
    root, here = exports_dir(), releases()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir(), key=lambda p: p.name.lstrip(".")):
        if folder.name.endswith(LOCK_SUFFIX) or not folder.is_dir():
            continue
        try:
            mark = json.loads((folder / EXPORTED_MARK).read_text())
        except (OSError, ValueError):
            mark = None
        made_with = {name: str(mark.get(name, "unknown")) for name in here} if mark else {}
        state = _state(folder, mark is not None and made_with == here)
        size, made = _size_and_time(folder)
        out.append(
            {
                "export": folder.name,
                "model": str(mark.get("from") or mark.get("model") or "unknown") if mark else "-",
                "identity": str(mark.get("model", "")) if mark else "",
                "made_with": made_with,
                "state": state,
                "bytes": size,
                "age_seconds": round(max(0.0, time.time() - made), 1),
            }
        )
    return out


def clean(everything: bool) -> dict[str, int]:
    """Remove the stale and unfinished exports, or with ``everything`` the current ones too (a run
    that loads one meanwhile may fail that chunk's attempt, which is retried and exports again).
    Never an export being written."""
    removed = {"exports": 0, "bytes": 0}
    for entry in summary():
        if entry["state"] == WRITING or (entry["state"] == CURRENT and not everything):
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


def _state(folder: Path, marked_by_these_releases: bool) -> str:
    if folder.name.startswith("."):  # ov_backend.keep_export's ".NAME.PID" (or one removed here)
        pid = folder.name.rsplit(".", 1)[-1]
        return WRITING if pid.isdigit() and psutil.pid_exists(int(pid)) else UNFINISHED
    if not (folder / EXPORTED_MARK).is_file():
        return UNFINISHED
    return CURRENT if marked_by_these_releases else STALE


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
