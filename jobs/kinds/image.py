"""image: a vector per image, as a multimodal ``SentenceTransformer.encode`` (CLIP, SigLIP and the
like) gives it for images. The corpus's text column holds each image's path or URL (a local
path, http(s)://, or an object store's s3://, gs://, az:// where the worker can reach it); the
worker reads it, bounded in size and time (jobs.contract.row_files), and decodes it. An image that is
missing, too large or cannot be decoded is a bad row, named with its reason, never a zero vector:
the chunk fails, or under ``--allow-missing`` the row is left out of the result and listed there.
A text run of the same model gives vectors in the same space.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chunkq.jobs.compute import token_batches
from chunkq.jobs.contract.row_files import RowReadError, read_row_file
from chunkq.jobs.contract.specs import BATCH_TOKENS_OFF, EncodeOptions
from chunkq.jobs.kinds.contract import Kind, OnRows, matrix_rows, with_bad_rows


def read_image(ref: str) -> Any:
    """The image at ``ref`` decoded (PIL); an OSError or ValueError says why it cannot be. The read
    is bounded in size and time, and only a regular file or a URL is read (jobs.contract.row_files)."""
    from PIL import Image

    image = Image.open(io.BytesIO(read_row_file(ref)))
    image.load()  # decode now: a truncated file fails here, on this row, not inside a batch
    return image


def _reason(exc: Exception) -> str:
    if isinstance(exc, RowReadError):
        return str(exc)
    if type(exc).__name__ == "UnidentifiedImageError":  # its message names a BytesIO, not the file
        return "not an image any decoder here recognises"
    return f"{type(exc).__name__}: {exc}"


READERS = 16  # rows read at once: a URL waits on its server, so a slow one holds up only itself


def _read_all(refs: list[str]) -> tuple[dict[int, Any], dict[int, str]]:
    """Each row's image, or why it has none; read in threads, each read bounded (jobs.contract.row_files)."""

    def one(ref: str) -> tuple[Any, str | None]:
        try:
            return read_image(ref), None
        except Exception as exc:  # any failure to read or decode is this row's, with its reason
            return None, f"{ref}: {_reason(exc)}"

    images: dict[int, Any] = {}
    bad: dict[int, str] = {}
    with ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="chunkq-image") as pool:
        for i, (image, why) in enumerate(pool.map(one, refs)):
            if why is None:
                images[i] = image
            else:
                bad[i] = why
    return images, bad


def encode(model: Any, texts: list[str], options: EncodeOptions, on_rows: OnRows) -> Any:
    images, bad = _read_all(texts)
    if bad and not options.allow_missing:  # refused now, before any image is encoded
        with_bad_rows(None, bad, options, "image(s) cannot be read")
    good = sorted(images)

    def batches() -> Iterator[list[int]]:  # the readable images' rows, in batches of --batch-size
        done = 0
        for batch in token_batches.plan_fixed([1] * len(good), options.batch_size):
            yield [good[j] for j in batch]
            done += len(batch)
            if on_rows is not None:
                on_rows(done)

    out = matrix_rows(
        len(texts),
        batches(),
        lambda rows: model.encode(
            [images[i] for i in rows],
            batch_size=len(rows),
            normalize_embeddings=options.normalize_embeddings,
            truncate_dim=options.truncate_dim,
            convert_to_numpy=True,
            show_progress_bar=False,
        ),
        width=0 if good else int(model.get_embedding_dimension() or 0),  # every image bad: the model's
    )
    return with_bad_rows(out, bad, options, "image(s) cannot be read")


def warm_up(model: Any, lengths: list[int]) -> None:
    from PIL import Image

    images = [Image.new("RGB", (224, 224), (i * 40 % 256, 90, 160)) for i in range(len(lengths))]
    model.encode(images, batch_size=len(images), show_progress_bar=False)


def refuse(options: EncodeOptions) -> str | None:
    if options.late_chunking or options.max_active_dims or options.role:
        return "an image has no windows, active dimensions or query role"
    if options.batch_tokens not in (None, BATCH_TOKENS_OFF):
        return "images are batched by count (--batch-size), not by tokens"
    return None


KIND = Kind(
    name="image",
    model_class="SentenceTransformer",
    reference="SentenceTransformer.encode(images) (a multimodal model: CLIP, SigLIP)",
    row="a vector per image (path or URL)",
    rows_are="image embeddings",
    encode=encode,
    warm_up=warm_up,
    refuse=refuse,
    cached=False,
    reads_rows=True,
    by_tokens=False,
)
