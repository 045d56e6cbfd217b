"""Run and chunk specs: the JSON that travels through Redis and the store."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from chunkq.jobs.errors import ConfigError

FORMAT_VERSION = 1
DEFAULT_PRECISION = "fp32"
PRECISIONS = (DEFAULT_PRECISION, "fp16", "bf16")
BATCH_TOKENS_AUTO = "auto"  # --batch-tokens auto: the budget tunes itself (jobs.token_batches)
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


def chunk_job_id(run_id: str, index: int) -> str:
    """The deterministic RQ job id of one chunk: resubmitting finds the same job."""
    return f"{validate_run_id(run_id)}__c{index:06d}"


@dataclass(frozen=True)
class EncodeOptions:
    """How a chunk is encoded; part of a run's identity."""

    batch_size: int = 32
    normalize_embeddings: bool = False
    max_seq_length: int | None = None
    precision: str = DEFAULT_PRECISION
    batch_tokens: int | str | None = None  # token-budget batches: padded tokens per batch, or "auto"

    def __post_init__(self) -> None:
        if (
            self.batch_tokens is not None
            and self.batch_tokens != BATCH_TOKENS_AUTO
            and (
                not isinstance(self.batch_tokens, int)
                or isinstance(self.batch_tokens, bool)
                or self.batch_tokens < 1
            )
        ):
            raise ConfigError(f"batch tokens must be a positive integer or 'auto', got {self.batch_tokens!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch size must be a positive integer, got {self.batch_size!r}")
        if self.max_seq_length is not None and (
            not isinstance(self.max_seq_length, int) or self.max_seq_length < 1
        ):
            raise ConfigError(f"max_seq_length must be a positive integer, got {self.max_seq_length!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["batch_tokens"] is None:  # absent, so runs made before it existed keep their fingerprint
            del data["batch_tokens"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EncodeOptions:
        return cls(**data)


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
        options = EncodeOptions.from_dict(data.pop("options", {}))
        return cls(options=options, **data)


def canonical_json(data: Any) -> str:
    """JSON with sorted keys and no spaces: stable input for fingerprints."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def fingerprint(data: Any) -> str:
    """A sha256 hex digest of the canonical JSON of ``data``."""
    return hashlib.sha256(canonical_json(data).encode()).hexdigest()
