"""What a model's load reads beyond the files its identity hashed, decided before the run.

The identity (``model_identity``) hashes every file in the model's folder (links followed). A load
can also read what the folder's files *name*: ``modules.json`` names each module's folder and
class, a config can name a file by path (``weight_map`` of a sharded checkpoint,
``tokenizer_name_or_path``, ...) or another model by hub id, ``auto_map`` and a module's ``type``
name code. Everything a JSON file of the folder names is checked here, whatever its key is called:

- a path, resolved as the kernel resolves it (links followed, then ``..``), from the file's own
  folder, the model's, or, for a key that names a path, the working directory the load runs in:
  where it exists on this host it must be a file (or folder) the identity hashed, else the model is
  refused (a file under ``.git``, outside the folder, reached through ``lnk/..``, a folder named
  ``x:`` that makes a value look like a URL: each seen to change vectors unseen). A path that does
  not exist here cannot be read here (old tokenizer configs carry their author's paths); every
  worker runs the same check on its own host, in its own working directory, before it loads;
- another model named by hub id (``org/name``) under a key a loader reads, or present in this host's
  hub cache: refused, its files are not this folder's;
- code from another hub repository (``repo--module.Class``) is refused: it is not in this folder;
- a class from outside sentence-transformers (``modules.json``'s types, a router's, ``auto_map``)
  loads only under ``--trust-remote-code``, and such a load is watched for the code it runs
  (``model_code``).

Two keys are exempt: ``_name_or_path`` and ``name_or_path``, which transformers overwrites with the
path it loads from and never opens (``tests/jobs/test_model_reads.py`` loads a model whose keys name
another model and checks the vectors). ``tokenizer.json`` is not searched: the tokenizers library
reads that one file, and its vocabulary is tokens ("/", "~", "x/y") that only look like paths.
What the identity cannot see, the docs say (docs/cache.md).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.errors import ConfigError

UNREAD_FOLDERS = frozenset({".git"})  # no load opens them; `git status` rewrites .git/index
LOADER_SET_KEYS = frozenset({"_name_or_path", "name_or_path"})  # set from the load path, never opened
TOKEN_DATA = frozenset({"tokenizer.json"})  # one self-contained file: tokens, not paths
# A key under which loaders read a path or a model by name, whatever file it is in.
_PATH_KEY = re.compile(r"(?i)(path|file|dir|folder|model|tokenizer|repo)")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9]")


class _Covered:
    """The real paths the identity hashed: its files, and every folder they are in."""

    def __init__(self, folder: Path, files: list[tuple[str, Path]]) -> None:
        self.folder = folder
        self.files = {os.path.realpath(path) for _, path in files}
        self.dirs = {os.path.realpath(folder)}
        for name, _ in files:
            parts = Path(name).parts[:-1]
            for depth in range(1, len(parts) + 1):
                self.dirs.add(os.path.realpath(folder.joinpath(*parts[:depth])))

    def holds(self, path: str) -> bool:
        """Whether a load that opens ``path`` reads only what was hashed: the file itself, or every
        file below the folder (an empty folder holds nothing to read)."""
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            return real in self.files
        if real in self.dirs:
            return True
        seen: set[str] = set()
        for top, dirs, files in os.walk(real, followlinks=True):
            if os.path.realpath(top) in seen:  # a link back up: read once
                dirs[:] = []
                continue
            seen.add(os.path.realpath(top))
            dirs[:] = [d for d in dirs if d not in UNREAD_FOLDERS]
            if any(os.path.realpath(os.path.join(top, f)) not in self.files for f in files):
                return False
        return True


def check(ref: str, folder: Path, files: list[tuple[str, Path]]) -> None:
    """Refuse (ConfigError, one line) what the identity of ``folder`` could not cover."""
    covered = _Covered(folder, files)
    for name, path in files:
        if not name.endswith(".json") or Path(name).name in TOKEN_DATA:
            continue
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError, RecursionError):
            continue  # not a config a load could parse either: the load says so itself
        for keys, value in _strings(data):
            if keys and keys[-1] in LOADER_SET_KEYS:
                continue
            where = f"model {ref}: {name} {'.'.join(keys) or 'value'}"
            _check_code(where, value, keys)
            # sentence-transformers joins modules.json's paths to the model's folder, never to the
            # working directory ("." is the folder itself: a model2vec folder's one module)
            _check_path(where, value, keys, path.parent, covered, cwd=name != "modules.json")
        if name == "modules.json" and isinstance(data, list):
            _check_modules(ref, data)


def _strings(data: Any, keys: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every string in a JSON value with the keys that lead to it (list positions as "[i]"); a
    walk of its own, not recursion, so a config nested thousands deep is read too."""
    stack: list[tuple[tuple[str, ...], Any]] = [(keys, data)]
    while stack:
        at, value = stack.pop()
        if isinstance(value, str):
            yield at, value
        elif isinstance(value, dict):
            stack.extend(((*at, str(k)), v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend(((*at, f"[{i}]"), v) for i, v in reversed(list(enumerate(value))))


def _candidates(value: str, keys: tuple[str, ...], base: Path, folder: Path, cwd: bool = True) -> list[str]:
    """Where a load could open ``value``: as given (absolute, ``~/``), from the config's folder, the
    model's, and, under a key that names a path (``cwd``), the working directory."""
    if not value or len(value) > 4096 or "\0" in value:
        return []
    named = os.path.expanduser(value) if value.startswith("~/") else value
    if os.path.isabs(named):
        return [named]
    found = [os.path.join(base, named), os.path.join(folder, named)]
    if cwd and keys and _PATH_KEY.search(keys[-1]):
        found.append(os.path.abspath(named))
    return found


def _check_path(
    where: str, value: str, keys: tuple[str, ...], base: Path, covered: _Covered, cwd: bool = True
) -> None:
    for candidate in _candidates(value, keys, base, covered.folder, cwd):
        try:
            exists = os.path.exists(candidate) and os.path.realpath(candidate) != os.sep
        except (OSError, ValueError):
            continue
        if exists and not covered.holds(candidate):
            raise ConfigError(
                f"{where} names {value!r}, which is not among the model's files as chunkq identifies "
                "them (outside its folder, under .git, or reached through a link and '..'); a load "
                "must read nothing else: copy it into the folder and name it by a plain relative path"
            )
    if keys and _PATH_KEY.search(keys[-1]) and _HUB_ID.fullmatch(value) and not os.path.exists(value):
        raise ConfigError(
            f"{where} names {value!r}, another model by its hub name, whose files are not this "
            "folder's; copy what it names into the folder and name it by a relative path"
        )
    if _HUB_ID.fullmatch(value) and _in_hub_cache(value):
        raise ConfigError(f"{where} names {value!r}, a model in this host's hub cache, not this folder")


def _in_hub_cache(repo: str) -> bool:
    from chunkq.jobs.compute.model_refs import hub_cache

    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    folder = f"models--{repo.replace('/', '--')}"
    caches = {hub_cache() or constants.HF_HUB_CACHE, constants.HF_HUB_CACHE}
    return any(os.path.isdir(os.path.join(cache, folder)) for cache in caches if cache)


def _check_code(where: str, value: str, keys: tuple[str, ...]) -> None:
    if "--" in value and ("auto_map" in keys or (keys and keys[-1] in ("type", "class", "module_type"))):
        raise ConfigError(
            f"{where} takes code from another repository ({value!r}); chunkq identifies a model by "
            "its folder's bytes: put that code in the folder and name it without the repository"
        )


def _check_modules(ref: str, modules: list[Any]) -> None:
    """Each module's folder: relative and not under .git (a linked one is read where it points)."""
    for module in modules:
        if not isinstance(module, dict):
            continue
        path = str(module.get("path", ""))
        parts = Path(path).parts
        if os.path.isabs(path) or ".." in parts:
            raise ConfigError(
                f"model {ref}: modules.json puts module {module.get('name')!r} at {path!r}; a "
                "module's path must be relative, a folder inside the model's folder"
            )
        if UNREAD_FOLDERS & set(parts):
            raise ConfigError(
                f"model {ref}: modules.json puts module {module.get('name')!r} at {path!r}, under "
                "version control's records, which chunkq does not read as the model; move it"
            )


def no_working_directory_imports() -> None:
    """Take the working directory off this process's import path (``python -m`` puts it first): a
    model's code must not import a file that happens to lie where the worker was started (hostile
    pass: ``./cwdhelper.py`` changed a trust-remote-code model's vectors unseen). For worker
    processes only: a user's own process keeps its path as it set it."""
    here = os.getcwd()
    sys.path[:] = [entry for entry in sys.path if entry not in ("", ".", here)]
