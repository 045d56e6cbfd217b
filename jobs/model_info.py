"""What a model is, read from its files without loading it: dimension, maximum sequence length,
named prompts, whether it brings its own code, the revision in the cache. ``chunkq model`` shows it,
and submit checks a run's options against it before anything starts (an unknown prompt name, a
truncation above the model's dimension, remote code not allowed)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chunkq.jobs.errors import ConfigError
from chunkq.jobs.models import hub_reachable, resolve_model
from chunkq.jobs.specs import DEFAULT_KIND, EncodeOptions


@dataclass(frozen=True)
class ModelInfo:
    ref: str
    folder: str | None  # where its files were read; None when they are not on this host
    dim: int | None  # the sentence embedding's dimension (None: not found in its files)
    max_seq_length: int | None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    remote_code: bool = False  # it needs trust_remote_code (its config maps classes to its own code)
    revision: str | None = None  # the commit of the cached snapshot (hub models)
    normalizes: bool = False  # its module list ends in a Normalize module: its vectors are unit length
    pooling: str | None = None  # its Pooling module's mode ("mean", "cls", ...); None: it has none
    kind: str = DEFAULT_KIND  # what its files say it is (jobs.kinds): dense, cross, sparse, ...

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _folder(ref: str, revision: str | None) -> tuple[Path | None, str | None]:
    """The model's files on this host and, for the hub cache, the snapshot's commit."""
    path = resolve_model(ref)
    if os.path.isdir(os.path.expanduser(path)):
        return Path(os.path.expanduser(path)), None
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(path, revision=revision, local_files_only=True))
    except Exception:
        return None, None
    return snapshot, snapshot.name


def _pooling_dimension(config: dict[str, Any]) -> int | None:
    """A Pooling module's output: its input width times its modes. sentence-transformers 6 writes
    ``embedding_dimension`` and ``pooling_mode`` (a name or a list); before it,
    ``word_embedding_dimension`` and a ``pooling_mode_<name>`` flag per mode."""
    width = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if not isinstance(width, int) or isinstance(width, bool):
        return None
    mode = config.get("pooling_mode")
    if isinstance(mode, list):
        modes = len(mode)
    elif isinstance(mode, str):
        modes = 1
    else:
        modes = sum(1 for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
    return width * max(1, modes)


def _modules(folder: Path) -> list[tuple[str, Path]]:
    """(type, folder) of each module in the model's modules.json."""
    found = []
    for module in _json(folder / "modules.json") or []:
        if isinstance(module, dict):
            found.append((str(module.get("type", "")), folder / str(module.get("path", ""))))
    return found


def _dimension(folder: Path) -> int | None:
    """The output dimension the module list gives: the last Dense layer's, else the pooling's."""
    dim = None
    for kind, path in _modules(folder):
        config = _json(path / "config.json") or {}
        if kind.endswith("Pooling"):
            dim = _pooling_dimension(config) or dim
        elif kind.endswith("Dense") and isinstance(config.get("out_features"), int):
            dim = int(config["out_features"])
    return dim


UNSET_MODEL_MAX_LENGTH = 10**6  # transformers writes a huge number (int(1e30)) when a tokenizer has none


def _max_seq_length(folder: Path) -> int | None:
    """The length sentence-transformers truncates at, in its order: the Transformer module's
    ``max_seq_length`` (sentence_bert_config.json, written before version 6), else its tokenizer's
    ``model_max_length`` (what version 6 writes and reads), else the model's position embeddings."""
    transformer = next((path for kind, path in _modules(folder) if kind.endswith("Transformer")), folder)
    length = (_json(transformer / "sentence_bert_config.json") or {}).get("max_seq_length")
    if not isinstance(length, int):
        length = (_json(transformer / "tokenizer_config.json") or {}).get("model_max_length")
    if not isinstance(length, int) or length >= UNSET_MODEL_MAX_LENGTH:
        length = (_json(transformer / "config.json") or {}).get("max_position_embeddings")
    return int(length) if isinstance(length, int) and not isinstance(length, bool) else None


def _pooling(folder: Path) -> str | None:
    """The Pooling module's mode: ``pooling_mode`` (sentence-transformers 6), else the one
    ``pooling_mode_<name>_tokens`` flag set (earlier versions); several joined by "+"."""
    for kind, path in _modules(folder):
        if kind.endswith("Pooling"):
            config = _json(path / "config.json") or {}
            mode = config.get("pooling_mode")
            if mode is None:
                mode = [
                    k[len("pooling_mode_") :].removesuffix("_tokens").removesuffix("_token")
                    for k, v in config.items()
                    if k.startswith("pooling_mode_") and v is True
                ]
            return mode if isinstance(mode, str) else "+".join(map(str, mode)) or None
    return None


# config_sentence_transformers.json's "model_type" (sentence-transformers 5+) to chunkq's kind names.
_MODEL_TYPES = {
    "SentenceTransformer": "dense",
    "CrossEncoder": "cross",
    "SparseEncoder": "sparse",
    "MultiVectorEncoder": "multivector",
}


def _labels(folder: Path) -> int | None:
    """A cross-encoder's scores per pair: its classifier's labels (config.json)."""
    config = _json(folder / "config.json") or {}
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or None
    return int(labels) if isinstance(labels, int) else None


def _kind(folder: Path, st_config: dict[str, Any]) -> str:
    """What the model's files say it is: sentence-transformers' own "model_type" where it wrote
    one; else a sequence classifier without a module list is a cross-encoder (as sentence-transformers
    2-4 saved them); else a dense model."""
    model_type = st_config.get("model_type")
    if isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    architectures = (_json(folder / "config.json") or {}).get("architectures") or []
    classifier = any(str(a).endswith("ForSequenceClassification") for a in architectures)
    return "cross" if classifier and not (folder / "modules.json").is_file() else DEFAULT_KIND


def _remote_code(folder: Path) -> bool:
    config = _json(folder / "config.json") or {}
    custom_modules = any(
        isinstance(m, dict) and not str(m.get("type", "")).startswith("sentence_transformers.")
        for m in _json(folder / "modules.json") or []
    )
    return bool(config.get("auto_map")) or custom_modules


def describe(ref: str, revision: str | None = None) -> ModelInfo:
    """What chunkq can tell of ``ref`` from its files on this host (no torch, no download)."""
    folder, found_revision = _folder(ref, revision)
    if folder is None:
        return ModelInfo(ref, None, None, None)
    st_config = _json(folder / "config_sentence_transformers.json") or {}
    kind = _kind(folder, st_config)
    prompts = st_config.get("prompts")
    prompts = prompts if isinstance(prompts, dict) else {}
    return ModelInfo(
        ref=ref,
        folder=str(folder),
        dim=_labels(folder) if kind == "cross" else _dimension(folder),
        max_seq_length=_max_seq_length(folder),
        prompts={str(k): str(v) for k, v in prompts.items()},
        default_prompt_name=st_config.get("default_prompt_name") or None,
        remote_code=_remote_code(folder),
        revision=found_revision,
        normalizes=any(kind.endswith("Normalize") for kind, _ in _modules(folder)),
        pooling=_pooling(folder),
        kind=kind,
    )


_FOLDER_DIGESTS: dict[tuple[Any, ...], str] = {}


def model_identity(ref: str, revision: str | None = None) -> str | None:
    """What the model is, whatever it is called: a hub model's snapshot commit (content-addressed),
    else the sha256 of its folder's files (names and bytes); None when its files are not on this host.
    A folder's digest is kept per process, keyed by its files' sizes and modification times."""
    folder, found_revision = _folder(ref, revision)
    if folder is None:
        return None
    if found_revision:
        return f"hub:{resolve_model(ref)}@{found_revision}"
    files = sorted(
        (path.relative_to(folder).as_posix(), path)
        for path in folder.rglob("*")
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    )
    stamp = (str(folder), *((name, path.stat().st_size, path.stat().st_mtime_ns) for name, path in files))
    if stamp not in _FOLDER_DIGESTS:
        digest = hashlib.sha256()
        for name, path in files:
            digest.update(name.encode() + b"\0")
            with path.open("rb") as fh:
                while block := fh.read(1 << 20):
                    digest.update(block)
            digest.update(b"\0")
        _FOLDER_DIGESTS[stamp] = f"files:{digest.hexdigest()}"
    return _FOLDER_DIGESTS[stamp]


def check_options(info: ModelInfo, options: EncodeOptions) -> None:
    """ConfigError when ``options`` cannot work with the model: said before anything starts."""
    if options.revision is not None:
        if info.folder is not None and info.revision is None:
            raise ConfigError(f"--revision applies to hub models; {info.ref} is a local folder")
        if info.folder is None and not hub_reachable():
            raise ConfigError(
                f"revision {options.revision!r} of model {info.ref} is not in the Hugging Face cache: "
                f"`hf download {info.ref} --revision {options.revision}` where there is a network"
            )
    if options.prompt_name is not None and options.prompt_name not in info.prompts:
        known = ", ".join(f"{k!r}" for k in sorted(info.prompts)) or "none"
        raise ConfigError(
            f"model {info.ref} has no prompt named {options.prompt_name!r} (its prompts: {known}); "
            "give one of them, or the text itself with --prompt"
        )
    if options.truncate_dim is not None and info.dim is None:
        raise ConfigError(
            f"--truncate-dim {options.truncate_dim} cannot be checked: model {info.ref}'s dimension is not "
            "in its files (`chunkq model` shows what is); leave it out, or truncate the result instead"
        )
    if options.truncate_dim is not None and info.dim is not None and options.truncate_dim > info.dim:
        raise ConfigError(
            f"--truncate-dim {options.truncate_dim} is above model {info.ref}'s dimension {info.dim}"
        )
    if info.remote_code and not options.trust_remote_code:
        raise ConfigError(
            f"model {info.ref} brings its own Python code (its config.json maps classes to it); "
            "run it only if you trust it, with --trust-remote-code (pools must allow it too)"
        )
