"""What a run takes as a row's text, checked once for the corpus readers and ``chunkq.embed``
alike: not blank, at most MAX_TEXT_BYTES in UTF-8, valid Unicode."""

from __future__ import annotations

from chunkq.jobs.contract.errors import CorpusError

MAX_TEXT_BYTES = 1 << 20


def check_text(
    text: str, where: str, limit: int = MAX_TEXT_BYTES, field: str | None = None, escaped: bool = True
) -> str:
    """``text`` if a run takes it as a row's text: not blank, at most ``limit`` bytes in UTF-8, valid
    Unicode (``escaped``: it may hold a lone surrogate; checked then); else CorpusError at ``where``
    naming ``field``, the corpus field it was read from (None: a text given as it is)."""
    if not text.strip():
        raise CorpusError(f"{where}: {_named(field)} is empty")
    if _utf8_length_over(text, limit):
        raise CorpusError(f"{where}: text is over the limit of {limit} bytes")
    return unicode_checked(text, _named(field), where) if escaped else text


def _named(field: str | None) -> str:
    return "text" if field is None else f"text field {field!r}"


def _utf8_length_over(text: str, limit: int) -> bool:
    """Whether ``text`` takes more than ``limit`` bytes in UTF-8 (encoded only when its characters,
    1 to 4 bytes each, leave it in doubt)."""
    if len(text) > limit:
        return True
    return len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit


def unicode_checked(value: str, what: str, where: str) -> str:
    """``value`` if it can be written as UTF-8; JSON's ``"\\ud800"`` decodes to a lone surrogate,
    which cannot be, and would fail far from here (in the store, or in the tokenizer)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = value[exc.start]
        raise CorpusError(
            f"{where}: {what} holds a lone surrogate (\\u{ord(bad):04x} at character {exc.start}), "
            "which is not valid Unicode; fix or drop that escape"
        ) from None
    return value
