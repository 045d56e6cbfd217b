"""The per-process model cache: a model loaded once and kept across jobs (``model_refs.py`` says
which model a name means and where its files are)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from chunkq.jobs.compute import ov_backend
from chunkq.jobs.compute.load_check import refusing_untrained_weights
from chunkq.jobs.compute.model_refs import OFFLINE_ENV, resolve_model
from chunkq.jobs.compute.tokenized import length_limit
from chunkq.jobs.contract.defaults import DEFAULT_BACKEND, DEFAULT_PRECISION
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.specs import OPENVINO, EncodeOptions

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from chunkq.jobs.compute.model_identity import Identity

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: SentenceTransformer
    default_max_seq_length: int | None  # None: the model truncates nothing (a static embedding)
    load_seconds: float
    loaded_at: str  # ISO time the load finished, for the run report's timeline
    identity: Identity | None = None  # the bytes it was loaded from (None: its files are not here)

    @property
    def code(self) -> Any:
        """For a model that brings its own code: what its load read (jobs.compute.model_code.Listing)."""
        return self.identity.code if self.identity is not None else None

    @property
    def identity_value(self) -> str | None:
        """What the manifest and each output record of the model (None: its files are not here)."""
        return self.identity.value if self.identity is not None else None

    def set_length(self, limit: int | None) -> None:
        """Truncate at ``limit`` tokens (None: the model's own); a model that truncates nothing
        keeps reading every token. The cached model is shared by every run this process serves."""
        if self.default_max_seq_length is not None:
            self.model.max_seq_length = limit or self.default_max_seq_length


class _DefaultPromptNotice(logging.Filter):
    """sentence-transformers warns at every load of a model that has a default prompt, meant for a
    person at a prompt. chunkq applies that prompt exactly as a plain ``encode`` does, and
    ``chunkq model`` shows it: at ``--log-level warning`` the line was noise in every worker's log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Default prompt name is set to")


# Its module in sentence-transformers 6, and the one before it.
for _name in ("sentence_transformers.base.model", "sentence_transformers.SentenceTransformer"):
    logging.getLogger(_name).addFilter(_DefaultPromptNotice())


_cache: dict[tuple[Any, ...], LoadedModel] = {}
# Models loaded on the CPU in fp32 by a process that forks workers (queue_worker.processes.fork_server):
# a forked worker takes its copy instead of reading and building the model again.
# (model, its class): the model loaded on the CPU before workers fork, and the files it was loaded from
_templates: dict[tuple[str, str], tuple[Any, Identity | None]] = {}


def _torch_dtype(precision: str) -> Any:
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]


def check_precision(precision: str, device: str, backend: str = DEFAULT_BACKEND) -> None:
    """Half precisions run on GPUs only: on a CPU they are slower than fp32 and round worse; OpenVINO
    runs on the CPU, in fp32, bf16 or a quantized model's int8 (``ov_backend``)."""
    if backend == OPENVINO:
        ov_backend.check_precision(precision, device)
        return
    if precision != DEFAULT_PRECISION and not device.startswith("cuda"):
        raise ConfigError(
            f"--precision {precision} needs a GPU, and these workers run on the {device}: "
            f"leave --precision out (it is {DEFAULT_PRECISION}), or run where a GPU is"
        )


def get_model(ref: str, device: str, precision: str, options: EncodeOptions | None = None) -> LoadedModel:
    """Load ``ref`` on ``device`` in ``precision`` once per process; later calls reuse it for as long
    as its files are unchanged (a folder whose weights were replaced is loaded again: a process that
    lives long, like a notebook's ``chunkq.embed``, never serves the old model under the new files).
    ``options`` say how it loads: remote code, revision, model kwargs (the defaults if None)."""
    from chunkq.jobs.compute.model_identity import current_stamp  # it resolves references with this module

    options = options or EncodeOptions()
    key = _key(ref, device, precision, options)
    cached = _cache.get(key)
    if cached is not None:
        if cached.identity is None or current_stamp(ref, options.revision) == cached.identity.stamp:
            return cached
        log.warning("model %s: its files changed since this process loaded it; loading it again", ref)
        forget(ref, device, precision, options)
    check_precision(precision, device, options.backend)
    started = time.perf_counter()
    model, identity, forked = _load_identified(ref, device, options, precision)
    if precision != DEFAULT_PRECISION and options.backend == DEFAULT_BACKEND:
        model = model.to(_torch_dtype(precision))
    model.eval()
    loaded = LoadedModel(
        model,
        length_limit(model),
        time.perf_counter() - started,
        datetime.now(UTC).isoformat(),
        identity,
    )
    how = "took model %s from the fork server" if forked else "loaded model %s"
    runs_on = precision if options.backend == DEFAULT_BACKEND else f"{options.backend}, {precision}"
    log.info(how + " on %s (%s) in %.2f s", ref, device, runs_on, loaded.load_seconds)
    _cache[key] = loaded
    return loaded


LOAD_TRIES = 3  # loads of a folder that kept changing while it was read, before giving up


def _load_identified(
    ref: str, device: str, options: EncodeOptions, precision: str = DEFAULT_PRECISION
) -> tuple[Any, Identity | None, bool]:
    """The model, the identity of the files it was built from, and whether it was the fork server's
    copy. The files are identified before the load and their stamp checked after it: a folder
    written to meanwhile is loaded again, so the identity is always that of the bytes loaded."""
    from chunkq.jobs.compute.model_identity import current_stamp, identify

    for _ in range(LOAD_TRIES):
        identity = identify(ref, options.revision)
        # The fork server's copy was loaded the default way, from files that must still be these.
        template = _templates.pop((ref, _model_class(options.kind)), None) if options.default_load else None
        if template is not None and identity is not None and template[1] == identity:
            return template[0].to(device), identity, True
        model, code = _load_watched(ref, device, options, _Runtime(precision, identity))
        if identity is None:  # fetched from the hub by this load: what it fetched
            return model, _with_code(identify(ref, options.revision), code), False
        if current_stamp(ref, options.revision) == identity.stamp:
            return model, _with_code(identity, code), False
        log.warning("model %s: its files changed while it loaded; loading it again", ref)
    raise ConfigError(f"model {ref}: its files kept changing while chunkq loaded them; try again once copied")


# (model, how it loads, its class) -> what its loads in this process read beyond the shared environment:
# a module imported by an earlier load is not imported again, yet it is what this load runs.
_code_read: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class _Runtime:
    """What a load on a backend other than PyTorch needs: the precision it runs in, and the identity
    of the files its export is made from (None: fetched by this load, exported anew)."""

    precision: str = DEFAULT_PRECISION
    identity: Identity | None = None


def _load_watched(ref: str, device: str, options: EncodeOptions, runtime: _Runtime) -> tuple[Any, Any]:
    """The model and, for one that brings its own code (trust_remote_code), the listing of what its
    load and a warm-up input read (jobs.compute.model_code); None for any other model, whose code is
    the libraries' own."""
    if not options.trust_remote_code:
        return _load(ref, device, options, runtime), None
    # Imported before the watch, as the fork server imports it before any worker loads: the library
    # is the shared environment, exempt from the listing, so every load lists the same files however
    # its process started; and compiled from source under the watch it cost 3 s of each probe.
    import sentence_transformers  # noqa: F401

    from chunkq.jobs import kinds
    from chunkq.jobs.compute import model_code
    from chunkq.jobs.compute.model_identity import covered_paths

    def load_and_encode() -> tuple[Any, Any]:
        model = _load(ref, device, options, runtime)
        canary = model_code.canary_vectors(model, options.kind)
        if canary is None:
            kinds.get(options.kind).warm_up(model, [16])
        return model, canary

    covered = covered_paths(ref, options.revision)
    (model, canary), listing = model_code.record(load_and_encode, covered)
    model_code.watch_after_load(listing, covered)
    listing = replace(listing, canary=canary)
    key = (ref, options.load_key(), _model_class(options.kind))
    listing = _code_read[key] = model_code.merged(_code_read.get(key), listing)
    return model, listing


def late_code_reads(loaded: LoadedModel, store: Any) -> list[str]:
    """For a model that brings its own code: the files it read since the last call that its load did
    not, but for the store's (jobs.compute.model_code.LateReads); nothing for any other model."""
    if loaded.code is None:
        return []
    from chunkq.jobs.compute import model_code

    return model_code.late_reads(str(store))


def _with_code(identity: Identity | None, code: Any) -> Identity | None:
    if identity is None or code is None:
        return identity
    from chunkq.jobs.compute.model_code import with_code

    return replace(identity, value=with_code(identity.value, code), code=code)


def _model_class(kind: str) -> str:
    """The sentence-transformers class a kind loads with: an image run and a text run of one CLIP
    model share one loaded copy."""
    from chunkq.jobs import kinds

    return kinds.get(kind).model_class


def _key(ref: str, device: str, precision: str, options: EncodeOptions) -> tuple[Any, ...]:
    return (ref, device, precision, options.load_key(), _model_class(options.kind))


def holds(ref: str, device: str, precision: str, options: EncodeOptions) -> bool:
    """Whether this process has the model loaded already (``get_model`` would reuse it)."""
    return _key(ref, device, precision, options) in _cache


def forget(ref: str, device: str, precision: str, options: EncodeOptions | None = None) -> None:
    """Drop a model from this process's cache (a copy loaded for one use), freeing its memory."""
    _cache.pop(_key(ref, device, precision, options or EncodeOptions()), None)
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


def _load(
    ref: str, device: str, options: EncodeOptions | None = None, runtime: _Runtime | None = None
) -> SentenceTransformer:
    options, runtime = options or EncodeOptions(), runtime or _Runtime()
    path = resolve_model(ref)
    if os.path.isdir(path):
        # A local model must never reach for the hub (no network on many GPU hosts).
        os.environ.setdefault(OFFLINE_ENV, "1")
    import sentence_transformers
    from transformers.utils import logging as transformers_logging

    from chunkq.jobs import kinds

    # Its "Loading weights" bar would land in every worker's log, once per load.
    transformers_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    kwargs: dict[str, Any] = dict(options.model_kwargs or {})
    for name in ("dtype", "torch_dtype"):
        if kwargs.get(name) not in (None, "auto"):
            import torch

            kwargs[name] = getattr(torch, kwargs[name])
    class_name = kinds.get(options.kind).model_class
    backend: dict[str, Any] = {}
    if options.backend == OPENVINO:
        import torch

        ov_backend.require()
        kwargs.update(ov_backend.load_kwargs(runtime.precision, torch.get_num_threads()))
        backend = {"backend": OPENVINO}

    def make(where: str) -> Any:
        with refusing_untrained_weights(ref, class_name):
            return getattr(sentence_transformers, class_name)(
                where,
                device=device,
                trust_remote_code=options.trust_remote_code,
                revision=options.revision,
                model_kwargs=kwargs or None,
                **backend,
            )

    if options.backend == OPENVINO:
        identity = runtime.identity.value if runtime.identity else None
        return ov_backend.load(make, path, identity, runtime.precision)  # type: ignore[no-any-return]
    return make(path)  # type: ignore[no-any-return]


def load_template(ref: str, max_bytes: int) -> float:
    """Load ``ref`` on the CPU in fp32 for processes forked from this one; the seconds it took.

    Only for a process that forks workers and never runs the model itself: it must not start
    torch's OpenMP threads, which a forked child could not use (it hangs in its first parallel
    region), so the load runs single-threaded. A model whose weights exceed ``max_bytes`` is not
    kept (ConfigError): it would hold that much host memory for as long as the process lives.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        started = time.perf_counter()
        from chunkq.jobs.compute.model_info import describe

        kind = describe(ref).kind
        model, identity, _ = _load_identified(ref, "cpu", EncodeOptions(kind=kind))
        model.eval()
    finally:
        torch.set_num_threads(threads)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    if size > max_bytes:
        raise ConfigError(
            f"its weights take {size / 2**30:.1f} GiB, more than the {max_bytes / 2**30:.1f} GiB allowed"
        )
    _templates[(ref, _model_class(kind))] = (model, identity)
    return time.perf_counter() - started
