"""What a model is, read from its files without loading it: dimension, maximum sequence length,
named prompts, whether it brings its own code, the revision in the cache. ``chunkq model`` shows it,
and submit checks a run's options against it before anything starts (an unknown prompt name, a
truncation above the model's dimension, remote code not allowed)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chunkq.jobs import kinds
from chunkq.jobs.compute.model_refs import hub_reachable, model_folder
from chunkq.jobs.contract.defaults import DEFAULT_KIND
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import EncodeOptions


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
    kinds: tuple[str, ...] = ()  # every kind its files can be run as (kind first); () where unknown
    positions: int | None = None  # the longest input its position embeddings take (None: not said)
    static: bool = False  # a StaticEmbedding model: every token read, no length to set

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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


STATIC = "StaticEmbedding"  # sentence-transformers' token lookup and mean: no positions, no truncation


def static_embedding(folder: Path) -> bool:
    """Whether the model's first module is a StaticEmbedding (model2vec-style): it reads every token
    of a text, so it has no maximum length and no positions."""
    modules = _modules(folder)
    return bool(modules) and modules[0][0].endswith(STATIC)


def _safetensors_shape(path: Path, tensor: str) -> list[int] | None:
    """A tensor's shape from a safetensors file's header (its first bytes), the weights unread."""
    try:
        with path.open("rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size)) if 0 < size < (1 << 26) else {}
    except (OSError, ValueError):
        return None
    shape = (header.get(tensor) or {}).get("shape") if isinstance(header, dict) else None
    return [int(n) for n in shape] if isinstance(shape, list) else None


def _dimension(folder: Path) -> int | None:
    """The output dimension the module list gives: the last Dense layer's, else the pooling's, else
    a static embedding's width."""
    dim = None
    for kind, path in _modules(folder):
        config = _json(path / "config.json") or {}
        if kind.endswith(STATIC):
            weights = path / "model.safetensors"
            # sentence-transformers saves "embedding.weight"; model2vec's own folders (which
            # sentence-transformers loads as they are) keep "embeddings"
            shape = _safetensors_shape(weights, "embedding.weight")
            shape = shape or _safetensors_shape(weights, "embeddings")
            dim = shape[1] if shape and len(shape) == 2 else dim
        elif kind.endswith("Pooling"):
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
def _labels(folder: Path) -> int | None:
    """A cross-encoder's scores per pair: its classifier's labels (config.json)."""
    config = _json(folder / "config.json") or {}
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or None
    return int(labels) if isinstance(labels, int) else None


def _architectures(folder: Path) -> list[str]:
    return [str(a) for a in (_json(folder / "config.json") or {}).get("architectures") or []]


def _kind(folder: Path, st_config: dict[str, Any]) -> str:
    """What the model's files say it is: sentence-transformers' own "model_type" where it wrote
    one; else, for a checkpoint transformers saved (no module list), what sentence-transformers
    builds from it: a sequence classifier is a cross-encoder (as sentence-transformers 2-4 saved
    them), a Stanford ColBERT or a "...ForRetrieval" model multi-vector; else a dense model."""
    model_type = st_config.get("model_type")
    # sentence-transformers' model_type is the class that loads it: the first kind that class loads
    by_class = {k.model_class: k.name for k in reversed(kinds.KINDS.values()) if k.built_on is None}
    if isinstance(model_type, str) and model_type in by_class:
        return by_class[model_type]
    if (folder / "modules.json").is_file():
        return DEFAULT_KIND
    architectures = _architectures(folder)
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "cross"
    if any(a == "HF_ColBERT" or a.endswith("ForRetrieval") for a in architectures):
        return "multivector"
    return DEFAULT_KIND


def _vocabulary(folder: Path) -> int | None:
    """A sparse model's space: its transformer's vocabulary (one dimension a token)."""
    transformer = next((path for kind, path in _modules(folder) if "Transformer" in kind), folder)
    size = (_json(transformer / "config.json") or {}).get("vocab_size")
    return int(size) if isinstance(size, int) and not isinstance(size, bool) else None


def _takes_images(folder: Path) -> bool:
    """Whether the model encodes images: a module configured for the image modality (sentence-
    transformers 6), an older CLIPModel module, or a transformers config with a vision tower."""
    for kind, path in _modules(folder) or [("", folder)]:
        if kind.endswith("CLIPModel"):
            return True
        modalities = (_json(path / "sentence_bert_config.json") or {}).get("modality_config") or {}
        if isinstance(modalities, dict) and "image" in modalities:
            return True
        if "vision_config" in (_json(path / "config.json") or {}):
            return True
    return False


def _kinds(folder: Path, kind: str) -> tuple[str, ...]:
    """The kinds a run may give this model: the one its files say; a dense model that takes images
    as image too; a masked-LM checkpoint without a module list as sparse too (sentence-transformers
    builds SPLADE pooling on its own head, no weight made up). Any other kind would be built with
    weights the files do not hold (jobs.compute.load_check)."""
    found = [kind, *(k.name for k in kinds.KINDS.values() if k.built_on == kind)]
    if kind == DEFAULT_KIND and _takes_images(folder):
        found.append("image")
    raw = not (folder / "modules.json").is_file()
    if kind == DEFAULT_KIND and raw and any(a.endswith("ForMaskedLM") for a in _architectures(folder)):
        found.append("sparse")
    return tuple(found)


# Models that number positions from the padding index + 1 (RoBERTa and its descendants): their
# last usable position is max_position_embeddings - pad_token_id - 1 (transformers'
# create_position_ids_from_input_ids).
_OFFSET_POSITIONS = ("roberta", "xlm-roberta", "camembert", "longformer", "mpnet", "bart", "mbart")


def _positions(folder: Path) -> int | None:
    """The most tokens the model's position embeddings take (its text tower's, for CLIP-like ones)."""
    transformer = next((path for kind, path in _modules(folder) if kind.endswith("Transformer")), folder)
    config: dict[str, Any] = _json(transformer / "config.json") or {}
    text_config = config.get("text_config")
    config = text_config if isinstance(text_config, dict) else config
    positions = config.get("max_position_embeddings")
    if not isinstance(positions, int) or isinstance(positions, bool):
        return None
    pad = config.get("pad_token_id")
    if config.get("model_type") in _OFFSET_POSITIONS and isinstance(pad, int):
        return positions - pad - 1
    return positions


def _remote_code(folder: Path) -> bool:
    config = _json(folder / "config.json") or {}
    custom_modules = any(
        isinstance(m, dict) and not str(m.get("type", "")).startswith("sentence_transformers.")
        for m in _json(folder / "modules.json") or []
    )
    return bool(config.get("auto_map")) or custom_modules


# Where a kind's dimension is in the model's files (jobs.kinds.contract.Kind.dim_source).
_DIM_SOURCES = {"dimension": _dimension, "labels": _labels, "vocabulary": _vocabulary}


def describe(ref: str, revision: str | None = None) -> ModelInfo:
    """What chunkq can tell of ``ref`` from its files on this host (no torch, no download)."""
    folder, found_revision = model_folder(ref, revision)
    if folder is None:
        return ModelInfo(ref, None, None, None)
    st_config = _json(folder / "config_sentence_transformers.json") or {}
    kind = _kind(folder, st_config)
    prompts = st_config.get("prompts")
    prompts = prompts if isinstance(prompts, dict) else {}
    return ModelInfo(
        ref=ref,
        folder=str(folder),
        dim=_DIM_SOURCES[kinds.get(kind).dim_source](folder),
        max_seq_length=None if static_embedding(folder) else _max_seq_length(folder),
        prompts={str(k): str(v) for k, v in prompts.items()},
        default_prompt_name=st_config.get("default_prompt_name") or None,
        remote_code=_remote_code(folder),
        revision=found_revision,
        normalizes=any(kind.endswith("Normalize") for kind, _ in _modules(folder)),
        pooling=_pooling(folder),
        kind=kind,
        kinds=_kinds(folder, kind),
        positions=None if static_embedding(folder) else _positions(folder),
        static=static_embedding(folder),
    )


MODEL_FILES = ("modules.json", "config.json")  # sentence-transformers' module list; transformers' config


# A tokenizer's vocabulary, in the files transformers' tokenizers read it from (a fast tokenizer's
# tokenizer.json; WordPiece's vocab.txt; BPE's vocab.json; a SentencePiece or tiktoken model).
_VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "vocab.json")
_VOCABULARY_SUFFIXES = (".model", ".tiktoken", ".spm")


def _holds_a_model(info: ModelInfo) -> None:
    if info.folder is None:
        return
    folder = Path(info.folder)
    if not any((folder / name).is_file() for name in MODEL_FILES):
        # Said here: each worker's load failed in turn and the run ended "no device left to run
        # workers on" (a project folder given as --model, seen in a session).
        raise ConfigError(
            f"model {info.ref}: the folder {info.folder} holds no model (neither modules.json, as "
            "sentence-transformers saves one, nor config.json, as transformers does); give the folder "
            "the model was saved in"
        )
    for tokenizer in _tokenizer_folders(folder):
        if not _has_vocabulary(tokenizer):
            # transformers builds a tokenizer of its special tokens alone: every word became [UNK]
            # and every row nearly the same vector, published with exit 0 (a hostile pass).
            raise ConfigError(
                f"model {info.ref}: {tokenizer} holds no tokenizer vocabulary (none of "
                f"{', '.join(_VOCABULARY_FILES)}, or a SentencePiece model): its tokenizer would read every "
                "word as unknown; copy the model's tokenizer files into it"
            )


def _tokenizer_folders(folder: Path) -> list[Path]:
    """The folders a transformer module of the model reads its tokenizer from (the model's own for a
    checkpoint transformers saved); none where its config names a tokenizer elsewhere."""
    modules = _modules(folder)
    found = [path for kind, path in modules if kind.endswith("Transformer")] if modules else [folder]
    return [
        path
        for path in found
        if not (_json(path / "sentence_bert_config.json") or {}).get("tokenizer_name_or_path")
    ]


def _has_vocabulary(folder: Path) -> bool:
    if any((folder / name).is_file() for name in _VOCABULARY_FILES):
        return True
    return folder.is_dir() and any(p.suffix in _VOCABULARY_SUFFIXES for p in folder.iterdir())


def check_options(info: ModelInfo, options: EncodeOptions) -> None:
    """ConfigError when ``options`` cannot work with the model: said before anything starts."""
    _holds_a_model(info)
    if info.kinds and options.kind not in info.kinds:
        takes = " or ".join(info.kinds)
        raise ConfigError(
            f"--kind {options.kind}: model {info.ref} is a {info.kind} model by its files, run as {takes}; "
            f"as {options.kind} it would run with weights it does not have (random: other rows at every "
            "load). Leave --kind out, or give a model of that kind"
        )
    if options.max_seq_length is not None and info.static:
        raise ConfigError(
            f"--max-seq-length {options.max_seq_length}: model {info.ref} is a static-embedding model, "
            "which averages every token of a text and truncates none; leave --max-seq-length out"
        )
    if options.max_seq_length is not None and info.positions is not None:
        if options.max_seq_length > info.positions:
            raise ConfigError(
                f"--max-seq-length {options.max_seq_length} is above model {info.ref}'s {info.positions} "
                "positions: every input that long would fail; give at most that"
            )
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
            f"model {info.ref} brings its own Python code (its config.json's auto_map, or a module "
            "its modules.json names outside sentence-transformers); "
            "run it only if you trust it, with --trust-remote-code (pools must allow it too)"
        )


def load_tokenizer(model_folder: str | Path) -> Any:
    """The model's fast tokenizer, with the truncation and padding its file may carry turned off."""
    from tokenizers import Tokenizer

    path = Path(model_folder) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{model_folder}: no tokenizer.json, so its texts cannot be cut into windows")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer
