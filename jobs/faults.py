"""Fault injection for tests and drills: makes the embed job fail the ways GPUs fail.

Off unless ``CHUNKQ_FAULTS`` holds a JSON list of rules; parsed once at import, so when it is off
the job pays one empty-tuple check. A worker with faults on says so loudly at start-up.

    CHUNKQ_FAULTS='[{"kind": "oom", "chunks": [3], "above_batch": 8},
                    {"kind": "cuda_fatal", "chunks": [5], "attempts": [1]},
                    {"kind": "sigkill", "probability": 0.1, "seed": 7}]'

Kinds: ``oom`` (raises torch's OutOfMemoryError while the batch size is above ``above_batch``),
``cuda_fatal`` (raises the illegal-memory-access RuntimeError), ``broken_context`` (the
after-error probe finds the context unusable), ``hang`` (ignores SIGALRM, as a hung CUDA call
would, and sleeps), ``sigkill`` (kills its own process), ``slow`` (takes ``seconds`` longer).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

from jobs.errors import ConfigError

ENV = "CHUNKQ_FAULTS"
KINDS = ("oom", "cuda_fatal", "broken_context", "hang", "sigkill", "slow")


@dataclass(frozen=True)
class Fault:
    kind: str
    chunks: frozenset[int] | None = None  # None: any chunk
    attempts: frozenset[int] | None = None  # None: any attempt (1-based)
    probability: float = 1.0
    seed: int = 0
    above_batch: int = 0  # oom: only while the batch size is above this
    seconds: float = 0.0  # slow: how long the chunk takes longer
    run_id: str | None = None

    def matches(self, run_id: str, chunk: int, attempt: int) -> bool:
        if self.run_id is not None and run_id != self.run_id:
            return False
        if self.chunks is not None and chunk not in self.chunks:
            return False
        if self.attempts is not None and attempt not in self.attempts:
            return False
        if self.probability >= 1.0:
            return True
        draw = random.Random(f"{self.seed}:{run_id}:{chunk}:{attempt}").random()  # noqa: S311 - not security
        return draw < self.probability


def parse(raw: str | None) -> tuple[Fault, ...]:
    """Rules from the JSON text of CHUNKQ_FAULTS; a malformed rule is refused, never ignored."""
    if not raw:
        return ()
    try:
        rules = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV} is not valid JSON: {exc}") from None
    if not isinstance(rules, list):
        raise ConfigError(f"{ENV} must be a JSON list of rules")
    return tuple(_rule(rule) for rule in rules)


def _rule(rule: Any) -> Fault:
    if not isinstance(rule, dict) or rule.get("kind") not in KINDS:
        raise ConfigError(f"{ENV}: each rule needs a kind out of {', '.join(KINDS)}; got {rule!r}")
    unknown = set(rule) - {
        "kind",
        "chunks",
        "attempts",
        "probability",
        "seed",
        "above_batch",
        "seconds",
        "run_id",
    }
    if unknown:
        raise ConfigError(f"{ENV}: unknown field(s) {sorted(unknown)} in {rule!r}")
    chunks, attempts = rule.get("chunks"), rule.get("attempts")
    return Fault(
        kind=rule["kind"],
        chunks=frozenset(int(c) for c in chunks) if chunks is not None else None,
        attempts=frozenset(int(a) for a in attempts) if attempts is not None else None,
        probability=float(rule.get("probability", 1.0)),
        seed=int(rule.get("seed", 0)),
        above_batch=int(rule.get("above_batch", 0)),
        seconds=float(rule.get("seconds", 0.0)),
        run_id=rule.get("run_id"),
    )


_FAULTS: tuple[Fault, ...] = parse(os.environ.get(ENV))


def reload() -> None:
    """Read the rules again: a worker forked by the fork server gets its environment after import."""
    global _FAULTS
    _FAULTS = parse(os.environ.get(ENV))


def active() -> bool:
    return bool(_FAULTS)


def inject(run_id: str, chunk: int, attempt: int, batch_size: int) -> None:
    """Called before each encode attempt; does nothing unless a rule matches."""
    if not _FAULTS:
        return
    for fault in _FAULTS:
        if fault.kind == "broken_context" or not fault.matches(run_id, chunk, attempt):
            continue
        if fault.kind == "oom" and batch_size > fault.above_batch:
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by {ENV}, batch size {batch_size})"
            )
        if fault.kind == "cuda_fatal":
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered (injected by {ENV})")
        if fault.kind == "slow":
            time.sleep(fault.seconds)  # a long chunk: something to kill a worker in the middle of
        if fault.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault.kind == "hang":
            # Like a hung CUDA call: RQ's SIGALRM job timeout cannot get it out.
            signal.signal(signal.SIGALRM, signal.SIG_IGN)
            while True:
                time.sleep(3600)


def probe_fails(run_id: str, chunk: int, attempt: int) -> bool:
    return any(f.kind == "broken_context" and f.matches(run_id, chunk, attempt) for f in _FAULTS)
