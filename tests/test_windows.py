"""Issue 33 (first part): long texts planned as windows on the model's own tokenizer."""

from __future__ import annotations

import itertools
import random

import pytest

from chunkq.jobs.errors import ConfigError
from chunkq.jobs.models import BUNDLED_MODEL, resolve_model
from chunkq.supervisor.windows import default_size, load_tokenizer, windows
from tests.helpers import WORDS


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return load_tokenizer(resolve_model(BUNDLED_MODEL))


def _long_text(words: int, seed: int) -> str:
    rng = random.Random(seed)
    # Punctuation, long words cut into several tokens and runs of white space, as real text has.
    pieces = [rng.choice([*WORDS, "embeddings", "tokenization,", "re-ranking.", "x"]) for _ in range(words)]
    return "".join(p + rng.choice([" ", "  ", "\n", " "]) for p in pieces).strip()


def test_a_text_that_fits_is_one_window_of_the_whole_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "a short text about copper harbors"
    (only,) = windows(text, tokenizer, 64)
    assert (only.char_start, only.char_end) == (0, len(text))
    assert only.tokens == len(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize(("size", "overlap"), [(64, None), (50, 0), (32, 31), (128, 40)])
def test_windows_cover_every_character_in_order_with_the_overlap_asked(  # type: ignore[no-untyped-def]
    tokenizer, size: int, overlap: int | None
) -> None:
    text = _long_text(900, seed=size)
    got = windows(text, tokenizer, size, overlap)
    want_overlap = size // 4 if overlap is None else overlap
    assert len(got) > 1 and [w.number for w in got] == list(range(len(got)))
    assert got[0].char_start == 0 and got[-1].char_end == len(text)
    for before, after in itertools.pairwise(got):
        assert before.char_start < after.char_start <= before.char_end  # in order, no gap
        if want_overlap == 0:
            assert after.char_start == before.char_end  # tiled exactly
        shared = len(tokenizer.encode(text[after.char_start : before.char_end], add_special_tokens=False).ids)
        # The overlap asked, and at most the rest of a word more: windows start on a word's start
        # (less only where no word starts late enough, so as never to cut one).
        assert min(want_overlap, before.tokens - 4) <= shared <= want_overlap + 4
    whole = tokenizer.encode(text, add_special_tokens=False)
    for window in got:
        span = tokenizer.encode(text[window.char_start : window.char_end], add_special_tokens=False).ids
        inside = [
            token
            for token, (start, end) in zip(whole.ids, whole.offsets, strict=True)
            if start >= window.char_start and end <= window.char_end
        ]
        assert window.tokens == len(span) <= size
        assert span == inside  # the span re-tokenises to the text's own tokens: no word was cut


def test_the_default_window_is_the_models_length_less_its_special_tokens_and_prompt(  # type: ignore[no-untyped-def]
    tokenizer,
) -> None:
    assert default_size(tokenizer, 256) == 254  # [CLS] and [SEP]
    assert default_size(tokenizer, 256, prompt="query: ") == 254 - 2
    with pytest.raises(ConfigError, match="no room"):
        default_size(tokenizer, 2)
    with pytest.raises(ConfigError, match="less than a window"):
        windows("text", tokenizer, 8, overlap=8)


def test_a_run_with_windows_gives_a_row_per_window_equal_to_a_plain_encode_of_its_span(  # type: ignore[no-untyped-def]
    tmp_path, store, connection, reference_model
) -> None:
    import pyarrow.parquet as pq

    from chunkq.tools.export import export
    from tests.helpers import max_abs_diff, result_of, run_in_process

    texts = [_long_text(120, seed=1), "a short one", _long_text(70, seed=2), "x"]
    ids = ["long-1", "short", "long-2", "last"]
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, ids, texts, "w", long_texts="window", window_tokens=32, cache=False
    )
    matrix, rows = result_of(layout)
    spans = [texts[ids.index(r["id"])][r["char_start"] : r["char_end"]] for r in rows]
    assert [r["id"] for r in rows][:2] == ["long-1", "long-1"] and rows[-1]["id"] == "last"
    assert encoded == len(rows) == manifest.plan["windows"]["windows"]  # --no-cache: every window
    assert manifest.plan["windows"]["windowed"] == 2 and manifest.plan["windows"]["texts"] == 4
    assert max_abs_diff(matrix, reference_model.encode(spans)) <= 1e-5
    (short,) = [i for i, r in enumerate(rows) if r["id"] == "short"]
    assert (rows[short]["char_start"], rows[short]["char_end"]) == (0, len("a short one"))
    assert max_abs_diff(matrix[short : short + 1], reference_model.encode(["a short one"])) <= 1e-5
    for text_id in ("long-1", "long-2"):
        mine = [r for r in rows if r["id"] == text_id]
        assert [r["window"] for r in mine] == list(range(len(mine))) and len(mine) > 1
        assert all(r["tokens"] <= 32 for r in mine)
    out = tmp_path / "w.parquet"
    export(layout, "parquet", out)
    table = pq.read_table(out)
    assert table.column_names == ["id", "window", "char_start", "char_end", "tokens", "embedding"]
    assert table.column("char_end").to_pylist() == [r["char_end"] for r in rows]


@pytest.mark.slow
def test_windows_with_the_cache_encode_each_distinct_window_once(  # type: ignore[no-untyped-def]
    tmp_path, store, connection, reference_model
) -> None:
    from tests.helpers import max_abs_diff, result_of, run_in_process

    text = _long_text(90, seed=3)
    texts, ids = [text, "between", text], ["a", "b", "c"]
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, ids, texts, "wc", long_texts="window", window_tokens=40
    )
    matrix, rows = result_of(layout)
    per_text = manifest.plan["windows"]["windows"] // 2
    assert encoded == per_text + 1 and len(rows) == 2 * per_text + 1
    spans = [texts[ids.index(r["id"])][r["char_start"] : r["char_end"]] for r in rows]
    assert max_abs_diff(matrix, reference_model.encode(spans)) <= 1e-5
    _, _, again = run_in_process(
        tmp_path, store, connection, ids, texts, "wc", long_texts="window", window_tokens=40, chunk_size=7
    )
    assert again == 0  # every window from the cache


@pytest.mark.slow
def test_a_windowed_run_killed_midway_resumes_and_equals_an_uninterrupted_one(  # type: ignore[no-untyped-def]
    tmp_path, tokenizer, reference_model
) -> None:
    import json

    import psutil

    from chunkq.jobs.run_files import RunLayout
    from tests.helpers import max_abs_diff, only_run, result_of, run_cli, start_cli, wait_for, write_corpus

    texts = [_long_text(80, seed=20 + i) for i in range(5)]
    ids = [f"t{i}" for i in range(5)]
    corpus = write_corpus(tmp_path / "w.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    args = ("run", str(corpus), "--chunk-size", "6", "--store", str(store), "--long-texts", "window")
    args += ("--window-tokens", "32")
    log = tmp_path / "run.log"
    faults = json.dumps([{"kind": "slow", "chunks": [1], "attempts": [1], "seconds": 60}])
    killed = start_cli(log, *args, CHUNKQ_FAULTS=faults)
    try:
        wait_for(lambda: "__c000001" in log.read_text(errors="replace"), 180, "chunk 1 started")
        family = psutil.Process(killed.pid).children(recursive=True)
        killed.kill()  # SIGKILL mid-run: chunk 0 done, chunk 1 in hand
        killed.wait(timeout=30)
        psutil.wait_procs(family, timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
    layout: RunLayout = only_run(store)
    assert not layout.result_manifest.exists()
    again = run_cli(*args, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    matrix, rows = result_of(layout)
    planned = [(i, w) for i, text in zip(ids, texts, strict=True) for w in windows(text, tokenizer, 32)]
    assert [(r["id"], r["window"], r["char_start"], r["char_end"]) for r in rows] == [
        (i, w.number, w.char_start, w.char_end) for i, w in planned
    ]
    spans = [texts[ids.index(i)][w.char_start : w.char_end] for i, w in planned]
    assert max_abs_diff(matrix, reference_model.encode(spans)) <= 1e-5


def test_pooled_vectors_per_text_are_the_token_weighted_mean_of_its_windows(  # type: ignore[no-untyped-def]
    tmp_path, store, connection
) -> None:
    import json

    import numpy as np

    from chunkq.jobs.manifest import load_manifest
    from chunkq.supervisor.result import check_published
    from tests.helpers import result_of, run_in_process

    texts, ids = [_long_text(100, seed=4), "short text", _long_text(60, seed=5)], ["a", "b", "c"]
    for pool in ("weighted", "mean"):
        layout, _, _ = run_in_process(
            tmp_path, store, connection, ids, texts, "p", long_texts="window", window_tokens=32, pool=pool
        )
        matrix, rows = result_of(layout)
        pooled = np.load(layout.result / "texts.npy")
        pooled_ids = [json.loads(x) for x in (layout.result / "texts.ids.jsonl").read_text().splitlines()]
        assert pooled_ids == ids and pooled.shape == (3, matrix.shape[1])
        for n, text_id in enumerate(ids):
            mine = [i for i, r in enumerate(rows) if r["id"] == text_id]
            weights = np.array(
                [rows[i]["tokens"] if pool == "weighted" else 1 for i in mine], dtype=np.float64
            )
            by_hand = (matrix[mine].astype(np.float64) * weights[:, None]).sum(0) / weights.sum()
            by_hand /= np.linalg.norm(by_hand)  # all-MiniLM-L6-v2 ends in a Normalize module
            assert np.abs(pooled[n] - by_hand).max() <= 1e-5
        assert len(rows) > 3  # some texts were cut
    (layout.result / "texts.npy").write_bytes((layout.result / "texts.npy").read_bytes()[:-4] + b"\0\0\0\0")
    assert check_published(layout, load_manifest(layout)) == [
        "texts.npy does not match the checksum in result/manifest.json"
    ]


@pytest.mark.slow
def test_the_python_api_returns_the_windows_rows_and_their_mapping(reference_model) -> None:  # type: ignore[no-untyped-def]
    import chunkq
    from tests.helpers import max_abs_diff

    texts = [_long_text(90, seed=6), "a short text"]
    got = chunkq.embed(texts, long_texts="window", window_tokens=32, pool="mean")
    assert isinstance(got, chunkq.api.Windowed)
    assert [w["text"] for w in got.windows][-1] == 1 and got.windows[0]["text"] == 0
    assert len(got.windows) == len(got.embeddings) > 2
    spans = [texts[w["text"]][w["char_start"] : w["char_end"]] for w in got.windows]
    assert max_abs_diff(got.embeddings, reference_model.encode(spans)) <= 1e-5
    assert got.texts is not None and got.texts.shape == (2, got.embeddings.shape[1])
    assert max_abs_diff(got.texts[1:], reference_model.encode(["a short text"])) <= 1e-5
