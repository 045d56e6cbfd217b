"""The run manifest: what a run is (corpus, options, chunking) and the arithmetic of its chunks.

It is the authority of the job contract: submit writes it before any job exists, workers refuse a
job whose spec differs from it (``spec_mismatch``), and assembly and ``assemble --verify`` check
every chunk output and the published result against it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chunkq.jobs.contract.defaults import DEFAULT_KIND, DEFAULT_OUTPUT_DTYPE, DEFAULT_PRIORITY
from chunkq.jobs.contract.errors import DamagedRunError, RunNotFoundError
from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.jobs.contract.specs import BATCHING, ChunkSpec, EncodeOptions, without_batching


@dataclass(frozen=True)
class RunManifest:
    """A parsed ``runs/<run>/manifest.json``; chunk sizes are derived, not listed, so it stays small."""

    data: dict[str, Any]

    @property
    def run_id(self) -> str:
        return str(self.data["run_id"])

    @property
    def rows(self) -> int:
        """The rows its chunks hold: the corpus's, or with a plan its distinct texts not yet cached
        followed by those read from the cache."""
        return int(self.data["rows"])

    @property
    def plan(self) -> dict[str, Any] | None:
        """How a run with the vector cache on maps its corpus onto its chunks (supervisor.submit.plan):
        ``corpus_rows``, ``encode_rows`` (chunks first), ``cached_rows`` (chunks after them, their
        outputs read from the cache at submit), ``duplicate_rows``, ``producer``, ``identity``
        (each corpus row is its chunk row: no duplicate, no hit) and ``parts`` (the row map)."""
        plan = self.data.get("plan")
        return plan if isinstance(plan, dict) else None

    @property
    def rows_are_corpus_rows(self) -> bool:
        """Whether a chunk's rows are the corpus's own, in order (no duplicate folded, no cached
        text left out, no window): then a chunk's row positions are corpus rows."""
        return bool((self.plan or {}).get("identity", True))

    def chunk_label(self, index: int) -> str:
        """A chunk as messages name it: its corpus rows where they are its own, else how many texts
        it holds (positions in the run's plan of distinct texts are no corpus rows)."""
        rows = self.chunk_rows(index)
        if self.rows_are_corpus_rows:
            first = self.first_row(index)
            return f"chunk {index} (rows {first}-{first + rows - 1})"
        return f"chunk {index} ({rows} distinct text(s) of the run)"

    @property
    def corpus_rows(self) -> int:
        """The rows of the corpus, and of a whole result."""
        plan = self.plan
        return int(plan["corpus_rows"]) if plan is not None else self.rows

    @property
    def _encode_rows(self) -> int:
        plan = self.plan
        return int(plan["encode_rows"]) if plan is not None else self.rows

    @property
    def encode_chunks(self) -> int:
        """The chunks of texts to encode; those after them hold texts read from the cache."""
        return -(-self._encode_rows // self.chunk_size)

    @property
    def chunk_size(self) -> int:
        return int(self.data["chunk_size"])

    @property
    def chunks(self) -> int:
        return int(self.data["chunks"])

    @property
    def fingerprint(self) -> str:
        return str(self.data["fingerprint"])

    @property
    def queue(self) -> str:
        """The RQ queue the run's chunk jobs go to: its own (jobs/queue/run_queues.py), or, for a
        run submitted before runs had one, the pools' queue."""
        return str(self.data.get("run_queue") or self.data["queue"])

    @property
    def pool_queue(self) -> str:
        """The queue the pools that serve the run listen on (``--queue``)."""
        return str(self.data["queue"])

    @property
    def priority(self) -> int:
        return int(self.data.get("priority") or DEFAULT_PRIORITY)

    @property
    def job_timeout(self) -> int:
        return int(self.data["job_timeout"])

    @property
    def output_dtype(self) -> str:
        return str(self.options.get("output_dtype", DEFAULT_OUTPUT_DTYPE))

    @property
    def ranges(self) -> list[list[float]] | None:
        """int8/uint8's per-dimension [minimums, maximums], computed once for the run at submit."""
        calibration = self.data.get("calibration")
        return calibration.get("ranges") if isinstance(calibration, dict) else None

    # Chunks come in two runs of equal sizes: those to encode, then (with a plan) those read from
    # the cache; every chunk of each is full but its last.
    def first_row(self, index: int) -> int:
        encode = self.encode_chunks
        if index < encode:
            return index * self.chunk_size
        return self._encode_rows + (index - encode) * self.chunk_size

    def chunk_rows(self, index: int) -> int:
        end = self._encode_rows if index < self.encode_chunks else self.rows
        return min(self.chunk_size, end - self.first_row(index))

    def rows_of(self, chunks: Collection[int]) -> int:
        """Rows in ``chunks`` (indices of this run): every chunk is full but the last of each run."""
        lasts = {self.encode_chunks - 1, self.chunks - 1}
        return len(chunks) * self.chunk_size - sum(
            self.chunk_size - self.chunk_rows(last) for last in lasts if last >= 0 and last in chunks
        )

    def chunk_spec(self, store: Path, index: int) -> ChunkSpec:
        return ChunkSpec(
            run_id=self.run_id,
            index=index,
            first_row=self.first_row(index),
            rows=self.chunk_rows(index),
            model=str(self.data["model"]),
            store=str(store),
            options=EncodeOptions.from_dict({**self.chunk_options, **self.batching}),
        )

    @property
    def batching(self) -> dict[str, Any]:
        """The batch settings of the latest command that submitted the run (``specs.BATCHING``): a
        resumed run's chunks are queued with them, its earlier ones were encoded with the run's."""
        batching = self.data.get("batching")
        options = self.chunk_options
        return dict(batching) if isinstance(batching, dict) else {k: options.get(k) for k in BATCHING}

    @property
    def model(self) -> str:
        return str(self.data["model"])

    @property
    def kind(self) -> str:
        """The run's model kind (jobs.kinds); runs from before kinds are dense."""
        return str(self.data["options"].get("kind", DEFAULT_KIND))

    @property
    def unit_length(self) -> bool | None:
        """Whether each row's vector is unit length, as submit knew it from the model's files; None
        where it could not tell, or for a run from before it was recorded."""
        value = self.data.get("unit_length")
        return value if isinstance(value, bool) else None

    @property
    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = self.data["options"]
        return options

    @property
    def chunk_options(self) -> dict[str, Any]:
        """The options chunks are encoded and stored with: the run's, or with a plan float32 at the
        model's full dimension (what the cache keeps), the result derived from them at assembly."""
        options: dict[str, Any] = self.data.get("chunk_options", self.options)
        return options

    @property
    def chunk_dtype(self) -> str:
        return str(self.chunk_options.get("output_dtype", DEFAULT_OUTPUT_DTYPE))

    def spec_mismatch(self, spec: ChunkSpec) -> str:
        """How a chunk spec differs from what this manifest says the chunk is, or "" when it agrees.

        Only the store may differ: it is the same root seen from another host.
        """
        if not 0 <= spec.index < self.chunks:
            return f"chunk {spec.index} is not one of the run's {self.chunks} chunks"
        mine = self.chunk_spec(Path(spec.store), spec.index).to_dict()
        given = spec.to_dict()
        # A job queued before a resume changed --batch-size keeps the batches it was queued with.
        mine["options"], given["options"] = (
            without_batching(mine["options"]),
            without_batching(given["options"]),
        )
        diffs = [
            f"{key}: job {given.get(key)!r}, manifest {value!r}"
            for key, value in mine.items()
            if key != "store" and given.get(key) != value
        ]
        return "; ".join(diffs)

    @property
    def model_identity(self) -> str | None:
        """The bytes of the model the run was submitted with (jobs.compute.model_identity), fixed then: every
        chunk must be encoded by exactly them. None: not known at submit (its files were not on the
        submitting host, or the run is older than the record), and then its chunks must agree."""
        identity = self.data.get("model_identity")
        return str(identity) if identity else None

    def producer(self) -> dict[str, Any]:
        """What a chunk output records of what produced it; assembly compares it with the manifest."""
        return producer_record(self.fingerprint, self.model, self.chunk_options, self.model_identity)


def producer_record(
    run_fingerprint: str, model: str, options: dict[str, Any], model_identity: str | None
) -> dict[str, Any]:
    """What an output records of what produced it (``RunManifest.producer``), for submit's writer of
    cached outputs before the manifest exists, and for the run's own check."""
    record = {"run_fingerprint": run_fingerprint, "model": model, "options": options}
    return {**record, "model_identity": model_identity} if model_identity else record


def load_manifest(layout: RunLayout, splitting: bool = False) -> RunManifest:
    """The run's manifest; with ``splitting``, the manifest so far of a run still being split where
    there is no other yet (what a worker checks a chunk against: the chunks written until then)."""
    data: Any = None
    for path in (layout.manifest, layout.splitting, layout.manifest)[: 3 if splitting else 1]:
        try:
            data = read_json(path)  # the split may end between two looks: then the manifest is there
            break
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            continue
        except (
            ValueError,
            UnicodeDecodeError,
        ) as exc:  # torn or truncated: a disk that filled, a copy cut short
            raise damaged(layout, f"not JSON: {exc}") from None
    else:
        raise RunNotFoundError(
            f"run {layout.run_id} not found in store {layout.store} (no {layout.manifest.name}); "
            "`chunkq runs` lists the store's runs"
        )
    if not isinstance(data, dict):
        raise damaged(layout, f"a JSON {type(data).__name__}, not an object")
    return RunManifest(data)


def damaged(layout: RunLayout, why: str) -> DamagedRunError:
    """Issue 51.10: one line naming the file, and what to do (the command that removes the run)."""
    return DamagedRunError(
        f"run {layout.run_id}: {layout.manifest} is damaged ({why}); the run cannot be read: "
        f"`chunkq clean {layout.run_id}` removes it, and the command that made it starts it again"
    )
