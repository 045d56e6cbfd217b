"""Run and chunk specs: the JSON that travels through Redis and the store."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from chunkq.jobs.contract.defaults import (
    DEFAULT_BACKEND,
    DEFAULT_BATCH_SIZE,
    DEFAULT_KIND,
    DEFAULT_OUTPUT_DTYPE,
    DEFAULT_PRECISION,
)
from chunkq.jobs.contract.errors import ConfigError, TamperedJobError

if TYPE_CHECKING:
    import numpy as np

FORMAT_VERSION = 1
INT8 = "int8"  # a quantized OpenVINO model's (jobs.compute.ov_quantize), by name only
TORCH_PRECISIONS = (DEFAULT_PRECISION, "fp16", "bf16")  # what a model on PyTorch is cast to (a pool's)
PRECISIONS = (*TORCH_PRECISIONS, INT8)
OPENVINO = "openvino"
BACKENDS = (DEFAULT_BACKEND, OPENVINO)  # sentence-transformers' own backend= (ONNX measured slower here)
BATCH_TOKENS_AUTO = "auto"  # --batch-tokens auto: the budget tunes itself (jobs.compute.token_batches)
BATCH_TOKENS_OFF = "off"  # --batch-tokens off: --batch-size batches, on a GPU too
BATCH_TOKENS_WORDS = (BATCH_TOKENS_AUTO, BATCH_TOKENS_OFF)
# RQ job ids allow letters, digits, '_' and '-'; '__' is kept free to separate run and chunk.
_RUN_ID_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]|_(?!_)){0,79}")  # fullmatch: `$` would let "ab\n" in


def validate_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is safe as a path component and an RQ job id prefix, else raise."""
    if not isinstance(run_id, str) or not _RUN_ID_RE.fullmatch(run_id) or run_id.endswith("_"):
        raise ConfigError(
            f"invalid run id {run_id!r}: use 1-80 letters, digits, '-' or single '_', "
            "starting with a letter or digit"
        )
    return run_id


CHUNK_NAME_WIDTH = 6  # digits of a chunk index in file names and job ids; more digits still parse


def chunk_name(index: int) -> str:
    """A chunk's index as file names and job ids spell it: 000042."""
    return f"{index:0{CHUNK_NAME_WIDTH}d}"


def chunk_job_prefix(run_id: str) -> str:
    """What every chunk job id of a run starts with (the chunk's name follows)."""
    return f"{validate_run_id(run_id)}__c"


def chunk_job_id(run_id: str, index: int) -> str:
    """The deterministic RQ job id of one chunk: resubmitting finds the same job."""
    return chunk_job_prefix(run_id) + chunk_name(index)


# What a chunk output may be stored as: the name a user gives (sentence-transformers' precisions,
# and float16) -> the numpy dtype of the stored array. binary/ubinary pack 8 dimensions a byte.
OUTPUT_DTYPES = {
    "float32": "<f4",
    "float16": "<f2",
    "int8": "|i1",
    "uint8": "|u1",
    "binary": "|i1",
    "ubinary": "|u1",
}
PACKED_DTYPES = frozenset({"binary", "ubinary"})


def storage_dtype(output_dtype: str) -> np.dtype[Any]:
    """The numpy dtype a result of ``output_dtype`` is stored in."""
    import numpy as np  # here: the pool and most commands read specs and never need numpy

    return np.dtype(OUTPUT_DTYPES[output_dtype])


CALIBRATED_DTYPES = frozenset({"int8", "uint8"})  # need per-dimension ranges, one set for the run
# --model-kwargs: keys passed to transformers' from_pretrained that tune how a model runs and cannot
# make it load or execute anything else, each with the values it may take.
MODEL_KWARGS = {
    "attn_implementation": ("eager", "sdpa", "flash_attention_2"),
    "dtype": ("auto", "float32", "float16", "bfloat16"),
    "torch_dtype": ("auto", "float32", "float16", "bfloat16"),
}
ROLES = (None, "query", "document")  # --role: plain encode, or the model's query/document routing
_NEW_FIELD_DEFAULTS = {  # left out of to_dict when unset, so older runs keep their fingerprint
    "batch_tokens": None,
    "prompt": None,
    "prompt_name": None,
    "truncate_dim": None,
    "output_dtype": DEFAULT_OUTPUT_DTYPE,
    "trust_remote_code": False,
    "revision": None,
    "model_kwargs": None,
    "late_chunking": False,
    "kind": DEFAULT_KIND,
    "role": None,
    "max_active_dims": None,
    "allow_missing": False,
    "backend": DEFAULT_BACKEND,
}


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _positive(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def batch_tokens_value(value: str) -> int | str:
    """--batch-tokens as given: a number of tokens (1 or more), 'auto' or 'off'."""
    if value in BATCH_TOKENS_WORDS:
        return value
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise ConfigError(f"{value!r}: give a number of tokens (1 or more), 'auto' or 'off'")


def model_kwargs_value(text: str) -> dict[str, str] | None:
    """--model-kwargs as given: a JSON object, checked by ``check_model_kwargs``."""
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"not JSON: {exc}") from exc
    return check_model_kwargs(kwargs)


def check_model_kwargs(kwargs: Any) -> dict[str, str] | None:
    """``kwargs`` if every key is one chunkq passes and every value one it may take; else ConfigError."""
    if kwargs is None or kwargs == {}:
        return None
    if not isinstance(kwargs, dict):
        raise ConfigError(f"model kwargs must be a JSON object, got {kwargs!r}")
    for key, value in kwargs.items():
        if key not in MODEL_KWARGS:
            raise ConfigError(
                f"model kwarg {key!r} is not passed (allowed: {', '.join(sorted(MODEL_KWARGS))}): "
                "a job's options come through Redis, so only keys that cannot load other code are taken"
            )
        if value not in MODEL_KWARGS[key]:
            raise ConfigError(f"model kwarg {key}={value!r}: one of {', '.join(MODEL_KWARGS[key])}")
    return dict(sorted(kwargs.items()))


# Every option says whether it changes a vector (a row of a result): the vector cache keys by exactly
# those (jobs.compute.vector_cache), so an option added later cannot be left out of the key by mistake: the
# class below refuses to exist with a field that does not say.
# How a chunk is cut into batches: how fast it is encoded, not what (within fp32 rounding). Not part of
# a run's identity: the same command with another --batch-size resumes the run, and the chunks queued
# from then on use the new value (RunManifest.batching).
BATCHING = ("batch_size", "batch_tokens")


def without_batching(options: dict[str, Any]) -> dict[str, Any]:
    """Options as they decide a chunk's vectors: the batch settings left out."""
    return {k: v for k, v in options.items() if k not in BATCHING}


CHANGES_VECTOR = "changes_vector"


_VECTOR = {CHANGES_VECTOR: True}
_NOT_VECTOR = {CHANGES_VECTOR: False}


@dataclass(frozen=True)
class EncodeOptions:
    """How a chunk is encoded, and how its model is loaded; part of a run's identity."""

    batch_size: int = field(default=DEFAULT_BATCH_SIZE, metadata=_NOT_VECTOR)
    normalize_embeddings: bool = field(default=False, metadata=_VECTOR)
    max_seq_length: int | None = field(default=None, metadata=_VECTOR)
    precision: str = field(default=DEFAULT_PRECISION, metadata=_VECTOR)
    # token-budget batches: padded tokens per batch, "auto", "off" (--batch-size batches); None: the
    # device decides (jobs.compute.token_batches.for_device: auto on a GPU, --batch-size batches on the CPU)
    batch_tokens: int | str | None = field(default=None, metadata=_NOT_VECTOR)
    prompt: str | None = field(default=None, metadata=_VECTOR)  # prepended to every text (E5's "passage: ")
    prompt_name: str | None = field(default=None, metadata=_VECTOR)  # a named prompt (None: its default)
    # Matryoshka: keep the first N dimensions. Not a vector's: derived at assembly from the full one.
    truncate_dim: int | None = field(default=None, metadata=_NOT_VECTOR)
    output_dtype: str = field(
        default=DEFAULT_OUTPUT_DTYPE, metadata=_NOT_VECTOR
    )  # OUTPUT_DTYPES, derived likewise
    # the model's own Python code may run (a pool must allow it too)
    trust_remote_code: bool = field(default=False, metadata=_VECTOR)
    revision: str | None = field(default=None, metadata=_VECTOR)  # the hub revision (branch, tag, commit)
    model_kwargs: dict[str, str] | None = field(default=None, metadata=_VECTOR)  # MODEL_KWARGS only
    # rows are late-chunking windows (jobs.compute.late), pooled from one pass over their segment
    late_chunking: bool = field(default=False, metadata=_VECTOR)
    kind: str = field(default=DEFAULT_KIND, metadata=_VECTOR)  # the model's kind (jobs.kinds)
    # "query" or "document": the model's encode_query / encode_document (its prompts, its router's task)
    role: str | None = field(default=None, metadata=_VECTOR)
    max_active_dims: int | None = field(default=None, metadata=_VECTOR)  # sparse: the N largest values
    # image: a row that cannot be read is left out rather than fail its chunk; the rows read are as ever
    allow_missing: bool = field(default=False, metadata=_NOT_VECTOR)
    # the runtime that runs the model (BACKENDS): OpenVINO's vectors are its own, so the cache keys it
    backend: str = field(default=DEFAULT_BACKEND, metadata=_VECTOR)

    def __post_init__(self) -> None:
        if (
            self.batch_tokens is not None
            and self.batch_tokens not in BATCH_TOKENS_WORDS
            and (
                not isinstance(self.batch_tokens, int)
                or isinstance(self.batch_tokens, bool)
                or self.batch_tokens < 1
            )
        ):
            raise ConfigError(
                f"batch tokens must be a positive integer, 'auto' or 'off', got {self.batch_tokens!r}"
            )
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch size must be a positive integer, got {self.batch_size!r}")
        _positive("max_seq_length", self.max_seq_length)
        _positive("truncate_dim", self.truncate_dim)
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("backend", self.backend, BACKENDS)
        if self.precision == INT8 and self.backend != OPENVINO:
            raise ConfigError("--precision int8 runs an int8 OpenVINO model: give --backend openvino too")
        _one_of("output dtype", self.output_dtype, tuple(OUTPUT_DTYPES))
        if self.prompt is not None and self.prompt_name is not None:
            raise ConfigError("give --prompt or --prompt-name, not both")
        for name in ("prompt", "prompt_name", "revision"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a string, got {value!r}")
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {', '.join(map(str, ROLES[1:]))}, got {self.role!r}")
        _positive("max_active_dims", self.max_active_dims)
        if not isinstance(self.kind, str) or not self.kind:
            raise ConfigError(f"kind must be a name, got {self.kind!r}")
        if not isinstance(self.late_chunking, bool):
            raise ConfigError(f"late_chunking must be true or false, got {self.late_chunking!r}")
        if not isinstance(self.trust_remote_code, bool):
            raise ConfigError(f"trust_remote_code must be true or false, got {self.trust_remote_code!r}")
        object.__setattr__(self, "model_kwargs", check_model_kwargs(self.model_kwargs))

    @property
    def calibrated(self) -> bool:
        return self.output_dtype in CALIBRATED_DTYPES

    def load_key(self) -> tuple[Any, ...]:
        """What decides how the model is loaded (beside its name, device and precision)."""
        kwargs = tuple(sorted((self.model_kwargs or {}).items()))
        return (self.trust_remote_code, self.revision, kwargs, self.backend)

    @property
    def rounds(self) -> bool:
        """A precision asked for by name on a backend that runs it on the CPU (OpenVINO's bf16, int8):
        what it costs in accuracy a run measures on its own texts (jobs.compute.agreement)."""
        return self.backend != DEFAULT_BACKEND and self.precision != DEFAULT_PRECISION

    @property
    def default_load(self) -> bool:
        """The model loads as its class loads it by name alone (``SentenceTransformer(name)``,
        ``CrossEncoder(name)``): what a preload or the fork server's copy is."""
        plain = not self.trust_remote_code and self.revision is None and not self.model_kwargs
        return plain and self.backend == DEFAULT_BACKEND

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for name, default in _NEW_FIELD_DEFAULTS.items():
            if data[name] == default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncodeOptions:
        return cls(**_known_fields(cls, data, "options"))


_UNSAID = [f.name for f in fields(EncodeOptions) if CHANGES_VECTOR not in f.metadata]
if _UNSAID:  # pragma: no cover - fails at import, for whoever adds an option
    raise TypeError(
        f"EncodeOptions field(s) {_UNSAID} must say whether they change a vector (_VECTOR or _NOT_VECTOR)"
    )


def vector_options(options: EncodeOptions) -> dict[str, Any]:
    """Every option that changes a vector, by name, whatever its value: the cache's key."""
    return {f.name: getattr(options, f.name) for f in fields(EncodeOptions) if f.metadata[CHANGES_VECTOR]}


@dataclass(frozen=True)
class ChunkSpec:
    """Everything a worker needs to encode one chunk. Paths are derived, never carried."""

    run_id: str
    index: int
    first_row: int
    rows: int
    model: str
    store: str
    options: EncodeOptions = field(default_factory=EncodeOptions)

    def __post_init__(self) -> None:
        validate_run_id(self.run_id)
        for name in ("index", "first_row", "rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"chunk spec field {name} must be a non-negative integer, got {value!r}")

    @property
    def job_id(self) -> str:
        return chunk_job_id(self.run_id, self.index)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["options"] = self.options.to_dict()
        data["format_version"] = FORMAT_VERSION
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ChunkSpec:
        data = dict(data)
        version = data.pop("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise ConfigError(f"chunk spec format {version} is not supported (expected {FORMAT_VERSION})")
        options = data.pop("options", {})
        if not isinstance(options, dict):
            raise TamperedJobError(f"chunk spec options must be an object, got {options!r}")
        return cls(options=EncodeOptions.from_dict(options), **_known_fields(cls, data, "spec"))


def _known_fields(kind: type, data: dict[str, Any], what: str) -> dict[str, Any]:
    """``data`` if it names only ``kind``'s fields; else TamperedJobError naming the others (a job
    comes through Redis: one written by someone else, or by a newer chunkq, must not fail raw)."""
    known = {f.name for f in fields(kind)}
    foreign = sorted(set(data) - known)
    if foreign:
        raise TamperedJobError(
            f"chunk {what} has field(s) this chunkq does not know: {', '.join(map(repr, foreign))} "
            "(a job edited in Redis, or queued by a newer chunkq); refused"
        )
    return data


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no spaces: stable input for fingerprints."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(data: Any) -> str:
    """A sha256 hex digest of the canonical JSON of ``data``."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()
