"""Token-budget batches: texts sorted by length, cut into batches of at most N padded tokens.

A fixed batch size wastes a GPU on short texts and runs out of memory on long ones: 32 texts of 20
tokens and 32 of 512 differ 25-fold in work. With a budget, each batch holds as many texts as fit
``longest x count <= budget`` (at least one), so every batch is about the same size in tokens.

``auto`` (``--batch-tokens auto``, a GPU's default: ``for_device``) starts from AUTO_START_TOKENS,
or what the run learned on this kind of device, and doubles the budget after a chunk that ran
faster (in characters per second, a stand-in for tokens that costs nothing to count) than the last,
until it stops paying or an OOM halves it; the size that fitted after an OOM becomes a ceiling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np

from chunkq.jobs.compute import tokenized
from chunkq.jobs.compute.tokenized import length_limit
from chunkq.jobs.contract import environment
from chunkq.jobs.contract.specs import BATCH_TOKENS_AUTO, BATCH_TOKENS_OFF, EncodeOptions

AUTO_START_TOKENS = 8192
AUTO_GAIN = 1.05  # a budget is doubled again only while the last doubling paid at least 5 %


def token_lengths(model: Any, texts: list[str], max_length: int | None) -> list[int]:
    """Each text's length in tokens as the model sees it (special tokens in, truncated at
    ``max_length``; a static embedding's tokenizers.Tokenizer: without either, as its model reads)."""
    tokenizer = model.tokenizer
    if not callable(tokenizer):  # tokenizers.Tokenizer (StaticEmbedding): no special tokens, no limit
        return [len(found.ids) for found in tokenizer.encode_batch(texts, add_special_tokens=False)]
    limit = {"truncation": True, "max_length": max_length} if max_length else {}
    encoded = tokenizer(texts, add_special_tokens=True, **limit)
    return [len(ids) for ids in encoded["input_ids"]]


def plan(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices of the texts in each batch, longest first; every batch at most ``budget`` padded
    tokens (longest x count), and at least one text."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        longest = lengths[current[0]] if current else lengths[index]
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def plan_fixed(lengths: list[int], size: int) -> list[list[int]]:
    """Indices of the texts in batches of ``size``, longest first by tokens. sentence-transformers
    sorts by characters, which pads more: on real text of varied length (Python docstrings), 1,000
    texts in batches of 32 sorted by tokens pad to 1.07x their tokens, by characters to 1.38x."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [order[start : start + size] for start in range(0, len(order), size)]


def batches(lengths: list[int], limit: int, by_tokens: bool) -> list[list[int]]:
    """Batches of a chunk's rows: of at most ``limit`` padded tokens (``by_tokens``), or of ``limit`` rows."""
    return plan(lengths, limit) if by_tokens else plan_fixed(lengths, limit)


def each_batch(
    lengths: list[int], options: EncodeOptions, on_rows: Callable[[int], None] | None
) -> Iterator[list[int]]:
    """A chunk's batches by its options (a token budget or a batch size, as the back-off has it),
    longest first; ``on_rows`` told the rows done after each batch the caller has encoded."""
    by_tokens = isinstance(options.batch_tokens, int)
    limit = options.batch_tokens if isinstance(options.batch_tokens, int) else options.batch_size
    done = 0
    for batch in batches(lengths, limit, by_tokens):
        yield batch
        done += len(batch)
        if on_rows is not None:
            on_rows(done)


PIPELINE_ROWS = 256  # rows tokenised ahead, in a thread, while the model runs the rows before them
# Whether a chunk is tokenised ahead (``encode``'s ``ahead``): "1" always, "0" never; unset, where
# the model runs on a GPU. On the CPU it lost (MiniLM, 1,000 docstrings, 2 cores: 125 against 134
# rows/s with one torch thread, 239 against 248 with two): the forward takes the cores the thread
# would use, and slices pad a little more than the whole chunk. For bench/gpu.py's comparison.
AHEAD_ENV = environment.TOKENISE_AHEAD


def tokenise_ahead(model: Any) -> bool:
    """Whether ``model``'s chunks are tokenised ahead of its forward (AHEAD_ENV)."""
    import os

    said = os.environ.get(AHEAD_ENV, "")
    if said in ("0", "1"):
        return said == "1"
    return str(getattr(model, "device", "cpu")).startswith("cuda")


def encode(
    model: Any,
    texts: list[str],
    limit: int,
    encode_kwargs: dict[str, Any],
    by_tokens: bool = True,
    on_rows: Callable[[int], None] | None = None,
    ahead: bool = False,
) -> np.ndarray[Any, Any]:
    """Encode ``texts`` in batches cut from their token lengths, longest first: of at most ``limit``
    padded tokens (``by_tokens``), or of ``limit`` texts. Rows come back in input order.
    ``encode_kwargs``: what else ``model.encode`` is given (normalisation, prompt, truncation).
    ``on_rows``: called with the rows encoded so far after each batch (``chunk_progress``).

    The chunk is tokenised once (``tokenized``); where its features cannot be cut into batches,
    its lengths are counted first and each batch goes through ``model.encode``. With ``ahead``, it
    is tokenised PIPELINE_ROWS rows at a time in a thread of its own, each slice while the model
    runs the one before it (the tokenizer and the forward both leave Python's lock): on a GPU the
    CPU's tokenising no longer comes before the forward but beside it."""
    prompt = tokenized.prompt_of(model, encode_kwargs)
    if ahead and len(texts) > PIPELINE_ROWS:
        return _encode_ahead(model, texts, limit, encode_kwargs, by_tokens, on_rows, prompt)
    chunk = tokenized.features(model, texts, prompt) if texts else None
    out = _Rows(len(texts), on_rows)
    _encode_slice(model, texts, chunk, list(range(len(texts))), limit, encode_kwargs, by_tokens, prompt, out)
    return out.matrix()


class _Rows:
    """The chunk's rows as they come, in input order, and the progress they make."""

    def __init__(self, total: int, on_rows: Callable[[int], None] | None) -> None:
        self.total, self.on_rows, self.done = total, on_rows, 0
        self.out: np.ndarray[Any, Any] | None = None

    def put(self, rows: list[int], values: Any) -> None:
        values = np.asarray(values, dtype=np.float32)
        if self.out is None:
            self.out = np.empty((self.total, values.shape[1]), dtype=np.float32)
        self.out[rows] = values
        self.done += len(rows)
        if self.on_rows is not None:
            self.on_rows(self.done)

    def matrix(self) -> np.ndarray[Any, Any]:
        return self.out if self.out is not None else np.empty((0, 0), dtype=np.float32)


def _encode_slice(
    model: Any,
    texts: list[str],
    chunk: dict[str, Any] | None,
    rows: list[int],
    limit: int,
    encode_kwargs: dict[str, Any],
    by_tokens: bool,
    prompt: str | None,
    out: _Rows,
) -> None:
    """Encode ``texts``, the chunk's ``rows`` (``chunk``: their features alone)."""
    if chunk is not None:
        lengths = tokenized.lengths(chunk)
    else:
        # With the prompt before each text, as encode tokenises it: a long prompt counts too.
        lengths = token_lengths(model, [prompt + t for t in texts] if prompt else texts, length_limit(model))
    bags = tokenized.bagged(chunk)
    for batch in tokenized.in_order(len(texts), limit) if bags else batches(lengths, limit, by_tokens):
        if chunk is not None:
            values = tokenized.encode_batch(model, chunk, batch, lengths, encode_kwargs)
        else:
            values = model.encode(
                [texts[i] for i in batch],
                batch_size=len(batch),
                convert_to_numpy=True,
                show_progress_bar=False,
                **encode_kwargs,
            )
        out.put([rows[i] for i in batch], values)


def _encode_ahead(
    model: Any,
    texts: list[str],
    limit: int,
    encode_kwargs: dict[str, Any],
    by_tokens: bool,
    on_rows: Callable[[int], None] | None,
    prompt: str | None,
) -> np.ndarray[Any, Any]:
    """``encode`` with each slice tokenised in a thread while the model runs the slice before. The
    slices are cut from the chunk ordered by characters, longest first, so each holds texts of like
    length: cut in input order, a slice of 256 docstrings padded its batches to 1.47x their tokens,
    the whole chunk to 1.08x; ordered so, 1.14x."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    slices = [order[a : a + PIPELINE_ROWS] for a in range(0, len(order), PIPELINE_ROWS)]
    out = _Rows(len(texts), on_rows)

    def tokenise(rows: list[int]) -> tuple[list[str], dict[str, Any] | None]:
        part = [texts[i] for i in rows]
        return part, tokenized.features(model, part, prompt)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunkq-tokenise") as pool:
        pending = pool.submit(tokenise, slices[0])
        for k, rows in enumerate(slices):
            part, chunk = pending.result()
            if k + 1 < len(slices):
                pending = pool.submit(tokenise, slices[k + 1])
            _encode_slice(model, part, chunk, rows, limit, encode_kwargs, by_tokens, prompt, out)
    return out.matrix()


def next_auto_budget(
    learned: dict[str, Any], budget: int, chars_per_second: float, backed_off: bool
) -> dict[str, Any]:
    """What ``auto`` keeps for the next chunk on this kind of device, after one at ``budget``."""
    if backed_off:  # memory said no: never grow past what fitted
        return {"batch_tokens": budget, "ceiling": budget, "chars_per_second": chars_per_second}
    ceiling = learned.get("ceiling")
    previous = learned.get("chars_per_second")
    paid = previous is None or chars_per_second > float(previous) * AUTO_GAIN
    grow = paid and not learned.get("settled") and (ceiling is None or budget * 2 <= int(ceiling))
    return {
        "batch_tokens": budget * 2 if grow else budget,
        "ceiling": ceiling,
        "chars_per_second": chars_per_second,
        "settled": not grow,
    }


def for_device(options: EncodeOptions, device: str, by_tokens: bool = True) -> EncodeOptions:
    """The batches a chunk is encoded in on ``device``: a budget of tokens, ``auto``, or None
    (``--batch-size`` texts). ``by_tokens``: the kind's inputs have tokens (an image has none).

    Unless the run said (``--batch-tokens N|auto|off``), the device decides: on a GPU ``auto``, since
    a fixed count of texts leaves a large GPU waiting; on the CPU a batch's cost grows with its padded
    tokens whatever its shape, so sentence-transformers' own length-sorted batches of ``--batch-size``
    texts. A number of tokens is kept on either. The measurements behind both: BENCHMARKS.md,
    "Token-budget batches"."""
    asked = options.batch_tokens
    gpu = device.startswith("cuda")
    if not by_tokens or asked == BATCH_TOKENS_OFF or (asked in (None, BATCH_TOKENS_AUTO) and not gpu):
        chosen: int | str | None = None
    elif asked is None:
        chosen = BATCH_TOKENS_AUTO
    else:
        chosen = asked
    return options if chosen == asked else replace(options, batch_tokens=chosen)
