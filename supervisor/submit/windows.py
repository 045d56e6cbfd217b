"""Long texts cut into windows on the model's own tokenizer (the planning).

A text longer than a window is cut into windows of at most ``size`` tokens that overlap by
``overlap`` tokens, each an exact character span of the text: a window starts and ends on a word's
first token (never inside a word, so the span re-tokenises to the same tokens), the first starts at
character 0, the last ends at the text's end, and a window ends where the next token begins (the
white space between words belongs to the window before it), so together they cover every character
in order. The count a window records is its span re-tokenised, what an encode of it sees; a span
that re-tokenises longer than ``size`` (byte-level BPE tokenisers can differ at a cut) is cut again.

Only the tokenizer is read (``tokenizer.json`` through the ``tokenizers`` library): no torch, so
submit can plan windows without loading the model. ``--long-texts window`` feeds ``window_rows`` to
the run's plan (``submit/plan.py``): each window is a row of the run and of its result; assembly
pools a text's windows into one vector (``result/text_pooling.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from chunkq.jobs.compute import late
from chunkq.jobs.compute.model_info import describe, load_tokenizer
from chunkq.jobs.contract.defaults import DEFAULT_OVERLAP_SHARE
from chunkq.jobs.contract.errors import ConfigError

# truncate: what a plain encode does (the default); window: each window encoded alone; late: windows
# pooled from one pass over the segment of the model's context around them (jobs.compute.late)
LONG_TEXTS = ("truncate", "window", "late")
if TYPE_CHECKING:
    from chunkq.supervisor.submit.identity import SubmitRequest

LATE_WINDOWS_PER_SEGMENT = 4  # late chunking's default window: a quarter of the model's context
POOLS = ("none", "mean", "weighted")  # a vector per windowed text: none, the mean, or weighted by tokens


@dataclass(frozen=True)
class Window:
    """One window of a text: its number, its character span and its tokens (special ones excluded)."""

    number: int
    char_start: int
    char_end: int
    tokens: int


def default_size(tokenizer: Any, max_seq_length: int, prompt: str | None = None) -> int:
    """The model's maximum length less its special tokens and the prompt's tokens."""
    special = int(tokenizer.num_special_tokens_to_add(False))
    prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False).ids) if prompt else 0
    size = max_seq_length - special - prompt_tokens
    if size < 1:
        raise ConfigError(
            f"a window of {max_seq_length} tokens leaves no room after the special tokens and prompt"
        )
    return size


def _count(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


def windows(text: str, tokenizer: Any, size: int, overlap: int | None = None) -> list[Window]:
    """``text`` as windows of at most ``size`` tokens overlapping by ``overlap`` (default: a quarter
    of a window); one window, the whole text, when it fits."""
    if size < 1:
        raise ConfigError(f"window size {size}: at least 1 token")
    overlap = size // DEFAULT_OVERLAP_SHARE if overlap is None else overlap
    if not 0 <= overlap < size:
        raise ConfigError(f"window overlap {overlap}: from 0 to {size - 1} tokens (less than a window)")
    encoding = tokenizer.encode(text, add_special_tokens=False)
    offsets, words = encoding.offsets, encoding.word_ids
    n = len(offsets)
    if n <= size:
        return [Window(0, 0, len(text), n)]
    starts = [i for i in range(n) if i == 0 or words[i] is None or words[i] != words[i - 1]]

    def word_start_at_or_before(token: int, above: int) -> int:
        """The last word start in (above, token], or ``token`` when a word is longer than that."""
        at = bisect.bisect_right(starts, token) - 1
        return starts[at] if at >= 0 and starts[at] > above else token

    found: list[Window] = []
    first = 0
    while True:
        last = n if first + size >= n else word_start_at_or_before(first + size, first)
        char_start = 0 if first == 0 else offsets[first][0]
        char_end = len(text) if last == n else offsets[last][0]
        tokens = _count(tokenizer, text[char_start:char_end])
        while tokens > size and last - first > 1:  # re-tokenised longer: cut one word earlier
            last = word_start_at_or_before(last - 1, first)
            char_end = offsets[last][0]
            tokens = _count(tokenizer, text[char_start:char_end])
        found.append(Window(len(found), char_start, char_end, tokens))
        if last == n:
            return found
        first = _next_first(starts, first, last, overlap)


def _next_first(starts: list[int], first: int, last: int, overlap: int) -> int:
    """Where the window after [first, last) begins: the last word start that leaves ``overlap``
    tokens shared; where no word starts that late, the first word start after ``first`` (less
    overlap rather than a word cut in two); ``last`` without overlap."""
    if not overlap:
        return last
    at = bisect.bisect_right(starts, last - overlap) - 1
    if at >= 0 and starts[at] > first:
        return starts[at]
    after = bisect.bisect_right(starts, first)
    return starts[after] if after < len(starts) and starts[after] < last else last


class WindowRow(NamedTuple):
    """A window as a row of the run: its id an object (the text's id, the window's number, span and
    tokens), its text the window's span."""

    id: dict[str, Any]
    text: str


@dataclass
class WindowCounts:
    texts: int = 0
    windowed: int = 0  # texts cut into more than one window
    windows: int = 0


def window_rows(
    records: Iterable[Any],
    tokenizer: Any,
    size: int,
    overlap: int | None,
    counts: WindowCounts,
) -> Iterator[WindowRow]:
    """Each record's windows in order."""

    def cut(record: Any) -> Iterator[WindowRow]:
        for w in windows(record.text, tokenizer, size, overlap):
            meta = {"id": record.id, "window": w.number, "char_start": w.char_start, "char_end": w.char_end}
            yield WindowRow({**meta, "tokens": w.tokens}, record.text[w.char_start : w.char_end])

    return _rows_of(records, cut, counts)


def _rows_of(
    records: Iterable[Any],
    cut: Callable[[Any], Iterator[WindowRow]],
    counts: WindowCounts,
) -> Iterator[WindowRow]:
    for record in records:
        rows = list(cut(record))
        counts.texts += 1
        counts.windowed += len(rows) > 1
        counts.windows += len(rows)
        yield from rows


def late_windows(
    text: str, tokenizer: Any, context: int, size: int, overlap: int | None
) -> Iterator[tuple[Window, Window]]:
    """(segment, window) pairs: ``text`` cut into segments of at most ``context`` tokens that share
    nothing (each is one forward pass), each segment into windows of ``size`` tokens overlapping by
    ``overlap`` within it; spans are the text's characters, numbered across the text."""
    number = 0
    for segment in windows(text, tokenizer, context, 0):
        inner = text[segment.char_start : segment.char_end]
        for w in windows(inner, tokenizer, size, overlap):
            start = segment.char_start + w.char_start
            yield segment, Window(number, start, segment.char_start + w.char_end, w.tokens)
            number += 1


def late_rows(
    records: Iterable[Any],
    tokenizer: Any,
    context: int,
    size: int,
    overlap: int | None,
    counts: WindowCounts,
) -> Iterator[WindowRow]:
    """``window_rows`` for late chunking: each row's id the same object, its text the window's place
    in its segment and the segment (jobs.compute.late.row_text), which the worker encodes in one pass."""
    if size >= context:
        raise ConfigError(
            f"late chunking needs windows shorter than the model's context ({context} tokens of text), "
            f"got {size}; use --long-texts window, or a smaller --window-tokens"
        )

    def cut(record: Any) -> Iterator[WindowRow]:
        for segment, w in late_windows(record.text, tokenizer, context, size, overlap):
            meta = {"id": record.id, "window": w.number, "char_start": w.char_start, "char_end": w.char_end}
            text = record.text[segment.char_start : segment.char_end]
            span = (w.char_start - segment.char_start, w.char_end - segment.char_start)
            yield WindowRow({**meta, "tokens": w.tokens}, late.row_text(text, *span))

    return _rows_of(records, cut, counts)


def window_plan(req: SubmitRequest) -> tuple[Any, int, int | None, bool, int | None]:
    """(tokenizer, window tokens, overlap, whether pooled vectors are normalised, late chunking's
    context or None). --long-texts window: by default the model's maximum length less its special
    tokens and prompt; a larger window would be truncated, so it is refused. late: segments of that
    many tokens, windows of a quarter of it by default; a model that does not mean-pool is refused."""
    info = describe(req.model, req.encode.revision)
    if info.folder is None:
        raise ConfigError(
            f"model {req.model}: its files are not on this host; texts cannot be cut into windows"
        )
    tokenizer = load_tokenizer(info.folder)
    longest = req.encode.max_seq_length or info.max_seq_length
    if longest is None:
        raise ConfigError(f"model {req.model}: no maximum sequence length found; give --max-seq-length")
    name = req.encode.prompt_name or info.default_prompt_name
    prompt = req.encode.prompt or (info.prompts.get(name) if name else None)
    room = default_size(tokenizer, longest, prompt)
    if req.long_texts == "late":
        late.check_pooling(info.pooling, req.model)
        size = req.window_tokens or room // LATE_WINDOWS_PER_SEGMENT
        return tokenizer, size, req.window_stride, req.encode.normalize_embeddings or info.normalizes, room
    size = req.window_tokens or room
    if size > room:
        raise ConfigError(
            f"--window-tokens {size}: the model reads {room} tokens of text at most (its maximum length "
            f"{longest} less its special tokens and prompt); a larger window would be truncated"
        )
    return tokenizer, size, req.window_stride, req.encode.normalize_embeddings or info.normalizes, None
