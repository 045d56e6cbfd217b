"""The files every chunkq process shares, which a model's code listing leaves out
(jobs/compute/model_code.py): the standard library, chunkq, the distributions chunkq requires with
theirs, the system's pseudo-file trees and the hub's token. Computed once a process, from the
installed distributions' RECORD files (0.2 s for this environment's 75).
"""

from __future__ import annotations

import csv
import os
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The system's pseudo-files, and its own libraries (libc, librt: the distribution's packages; a
# model's code that a user changes is not there).
SYSTEM_TREES = ("/proc", "/sys", "/dev", "/usr/lib", "/lib", "/lib64", "/usr/lib64")
_ENVIRONMENT: frozenset[str] | None = None


def _front_package() -> Any:
    """The ``chunkq`` package, loaded before any of its modules: where its files are, without this
    room importing the front door (tests/house/test_layers.py)."""
    return sys.modules[__name__.split(".")[0]]


def environment() -> frozenset[str]:
    """The real paths whose files are the shared environment's."""
    global _ENVIRONMENT
    if _ENVIRONMENT is None:
        roots = set(SYSTEM_TREES)
        roots |= _stdlib()
        roots |= {os.path.realpath(p) for p in _package_dirs(_front_package())}
        roots |= _distribution_roots(_requirements_closure())
        try:
            from huggingface_hub import constants

            roots.add(os.path.realpath(constants.HF_TOKEN_PATH))
        except ImportError:
            pass
        _ENVIRONMENT = frozenset(roots)
    return _ENVIRONMENT


def under(real: str, roots: frozenset[str]) -> bool:
    path = Path(real)
    return any(str(p) in roots for p in (path, *path.parents))


def _package_dirs(package: Any) -> Iterator[str]:
    """chunkq's folders: its own, and the layers its tree links in (jobs, queue_worker, supervisor)."""
    yield from package.__path__
    for layer in ("jobs", "queue_worker", "supervisor"):
        folder = os.path.join(package.__path__[0], layer)
        if os.path.isdir(folder):
            yield folder


def _stdlib() -> set[str]:
    """The standard library's folders (sites under them are not part of it)."""
    paths = sysconfig.get_paths()
    zipped = f"python{sys.version_info[0]}{sys.version_info[1]}.zip"  # on sys.path, seldom present
    found = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    return found | {os.path.realpath(os.path.join(sys.base_prefix, "lib", zipped))}


def _chunkq_requirements() -> list[str]:
    """chunkq's own requirements: from its installed metadata, or the tree's pyproject.toml when it
    runs from a checkout without an install (a GPU host carries the tree)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        return list(requires("chunkq") or [])
    except PackageNotFoundError:
        import tomllib

        pyproject = Path(_front_package().__path__[0]).resolve().parent / "pyproject.toml"
        try:
            return list(tomllib.loads(pyproject.read_text())["project"]["dependencies"])
        except (OSError, KeyError, ValueError):
            return []


def _requirements_closure() -> list[Any]:
    """The installed distributions chunkq requires, and theirs, without extras."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.requirements import InvalidRequirement, Requirement

    found: dict[str, Any] = {}
    todo = ["chunkq", *_chunkq_requirements()]  # its own metadata too (entry points are read at loads)
    while todo:
        try:
            req = Requirement(todo.pop())
        except InvalidRequirement:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        key = req.name.lower().replace("_", "-")
        if key in found:
            continue
        try:
            dist = distribution(req.name)
        except PackageNotFoundError:
            continue
        found[key] = dist
        todo.extend(dist.requires or [])
    return list(found.values())


def _distribution_roots(dists: list[Any]) -> set[str]:
    """Each distribution's top-level entries (a folder shared as a namespace: the entries below it)."""
    roots: set[str] = set()
    for dist in dists:
        below: dict[str, set[str]] = {}
        try:
            names = _recorded_files(dist)
        except (OSError, ValueError, csv.Error):  # its metadata damaged: its files count as anyone's
            continue
        for name in names:
            parts = name.split("/")
            if parts and parts[0] not in ("", ".."):
                below.setdefault(parts[0], set()).update(parts[1:2] if len(parts) > 2 else ())
        for top, entries in below.items():
            folder = Path(str(dist.locate_file(top)))
            shared = entries and not top.endswith((".dist-info", ".libs", ".data"))
            if shared and folder.is_dir() and not (folder / "__init__.py").exists():
                roots |= {os.path.realpath(folder / entry) for entry in entries}
            else:
                roots.add(os.path.realpath(folder))
    return roots


def _recorded_files(dist: Any) -> list[str]:
    """A distribution's files as its RECORD lists them (read as text: ``dist.files`` builds a path
    object per file, 1.3 s of CPU for torch's 15,000)."""
    record = dist.read_text("RECORD")
    if record is None:
        return [Path(str(f)).as_posix() for f in dist.files or []]
    return [row[0] for row in csv.reader(record.splitlines()) if row]
