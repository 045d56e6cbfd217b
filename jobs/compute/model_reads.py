"""What a model's load reads beyond its folder's files, decided before the run (issue 51.1).

The identity (``model_identity``) hashes every file in the model's folder. A load can also read
what the folder's files *name*: ``modules.json`` names each module's folder and class, a config can
name a file by path, ``auto_map`` and a module's ``type`` can name code in another repository or
in an installed package. Whatever is named is checked here, whatever its key is called:

- a path that leaves the folder (absolute, ``~``, or ``..`` past the top) and exists on this host
  is refused: the identity cannot cover a file any process on the host may change. A path that does
  not exist here cannot be read here (old tokenizer configs carry their author's paths); every
  worker runs this same check on its own host before it loads;
- a module folder under ``.git`` (which the identity leaves out) or outside the folder is refused;
- code from another hub repository (``repo--module.Class``) is refused: it is not in this folder;
- a module class from an installed package other than sentence-transformers is named with that
  package's release, which becomes part of the identity.

Two keys are exempt: ``_name_or_path`` and ``name_or_path``, which transformers overwrites with the
path it loads from and never opens (``tests/test_wrong_results.py`` loads a model whose keys name
another model and checks the vectors). ``tokenizer.json`` is not searched for paths: the tokenizers
library reads that one file, and its vocabulary is tokens ("/", "~") that only look like paths.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.errors import ConfigError

UNREAD_FOLDERS = frozenset({".git"})  # no load opens them; `git status` rewrites .git/index
LOADER_SET_KEYS = frozenset({"_name_or_path", "name_or_path"})  # set from the load path, never opened
TOKEN_DATA = frozenset({"tokenizer.json"})  # one self-contained file: tokens, not paths
CONFIG_BYTES = 16 << 20  # a JSON file larger than this is data (a vocabulary), not a config
OWN_CODE = ("sentence_transformers.", "torch.")  # their releases are in the vector cache's key


def check(ref: str, folder: Path, files: list[tuple[str, Path]]) -> list[str]:
    """Refuse (ConfigError, one line) what the identity of ``folder`` could not cover; return the
    releases of installed packages whose module classes the load uses ("name==release"), sorted."""
    root = os.path.realpath(folder)
    code: set[str] = set()
    for name, path in files:
        if not name.endswith(".json") or Path(name).name in TOKEN_DATA:
            continue
        if path.stat().st_size > CONFIG_BYTES:
            continue
        try:
            data = json.loads(path.read_bytes())
        except (ValueError, UnicodeDecodeError):
            continue  # not a config a load could parse either: the load says so itself
        for keys, value in _strings(data):
            _check_value(ref, name, keys, value, folder, root)
        if name == "modules.json" and isinstance(data, list):
            code |= _modules(ref, folder, data)
    return sorted(code)


def _strings(data: Any, keys: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], str]]:
    """Every string in a JSON value with the keys that lead to it (list positions as "[i]")."""
    if isinstance(data, str):
        yield keys, data
    elif isinstance(data, dict):
        for key, value in data.items():
            yield from _strings(value, (*keys, str(key)))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _strings(value, (*keys, f"[{i}]"))


def _as_path(value: str) -> str | None:
    """``value`` as the path a load would open, or None where it cannot name one."""
    if not value or len(value) > 4096 or "\n" in value or "\0" in value or "://" in value:
        return None
    return os.path.expanduser(value)


def _exists(path: str) -> bool:
    try:
        return os.path.exists(path) and os.path.realpath(path) != os.path.realpath(os.sep)
    except (OSError, ValueError):
        return False


def _inside(path: str, folder: Path, root: str) -> bool:
    """Whether ``path`` is in the folder: below it as named, or where the folder really is (a link
    inside the folder is followed by the identity, so what it points at is covered)."""
    named, real = os.path.normpath(path), os.path.realpath(path)
    top = os.path.normpath(folder)
    return any(p == t or p.startswith(t + os.sep) for p, t in ((named, top), (real, root)))


def _check_value(ref: str, name: str, keys: tuple[str, ...], value: str, folder: Path, root: str) -> None:
    where = f"model {ref}: {name} {'.'.join(keys) or 'value'}"
    if keys and keys[-1] in LOADER_SET_KEYS:
        return
    if "auto_map" in keys and "--" in value:
        raise ConfigError(
            f"{where} takes code from another repository ({value!r}); chunkq identifies a model by "
            "its folder's bytes: put that code in the folder and name it without the repository"
        )
    named = _as_path(value)
    if named is None or not (os.path.isabs(named) or ".." in Path(named).parts):
        return
    full = named if os.path.isabs(named) else os.path.join(folder, os.path.dirname(name), named)
    if _exists(full) and not _inside(full, folder, root):
        raise ConfigError(
            f"{where} names {value!r}, outside the model's folder; chunkq identifies a model by the "
            "bytes in its folder, so a load must read nothing outside it: copy what it names into "
            "the folder and name it by a relative path"
        )


def _modules(ref: str, folder: Path, modules: list[Any]) -> set[str]:
    """Check each module's folder and class; the releases of installed packages whose classes load."""
    code: set[str] = set()
    for module in modules:
        if not isinstance(module, dict):
            continue
        path, kind = str(module.get("path", "")), str(module.get("type", ""))
        parts = Path(path).parts
        if os.path.isabs(path) or ".." in parts:  # a linked module folder is read where it points
            raise ConfigError(
                f"model {ref}: modules.json puts module {module.get('name')!r} at {path!r}; a "
                "module's path must be relative, a folder inside the model's folder"
            )
        if UNREAD_FOLDERS & set(parts):
            raise ConfigError(
                f"model {ref}: modules.json puts module {module.get('name')!r} at {path!r}, under "
                "version control's records, which chunkq does not read as the model; move it"
            )
        if "--" in kind:
            raise ConfigError(
                f"model {ref}: modules.json loads module {module.get('name')!r} from another "
                f"repository ({kind!r}); put its code in the model's folder"
            )
        release = _package_release(kind, folder)
        if release is not None:
            code.add(release)
    return code


def _package_release(class_path: str, folder: Path) -> str | None:
    """ "name==release" of the installed package a module class is imported from; None for
    sentence-transformers' own classes and for code in the model's folder (hashed with it)."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version
    from importlib.util import find_spec

    top = class_path.split(".", 1)[0]
    if not top or class_path.startswith(OWN_CODE):
        return None
    if find_spec(top) is None:
        return None  # not installed: the load takes it from the folder's own files, or fails
    names = packages_distributions().get(top) or [top]
    try:
        return f"{names[0]}=={version(names[0])}"
    except PackageNotFoundError:
        origin = getattr(find_spec(top), "origin", None) or top
        raise ConfigError(
            f"module class {class_path} is imported from {origin}, which no installed package "
            "owns, so chunkq cannot say which code made a vector; install it as a package"
        ) from None
