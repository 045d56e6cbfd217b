"""Issue 33 (first part): long texts planned as windows on the model's own tokenizer."""

from __future__ import annotations

import itertools
import random

import pytest

from chunkq.jobs.compute.model_info import load_tokenizer
from chunkq.jobs.compute.model_refs import BUNDLED_MODEL, resolve_model
from chunkq.jobs.contract.errors import ConfigError
from chunkq.jobs.contract.run import Run
from chunkq.supervisor.submit.windows import default_size, windows
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

    from chunkq.sinks.files import export
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
    export(Run.of(layout), "parquet", out)
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

    from chunkq.jobs.contract.run_files import RunLayout
    from tests.helpers import (
        family,
        max_abs_diff,
        only_run,
        result_of,
        run_cli,
        start_cli,
        wait_for,
        write_corpus,
    )

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
        started = family(killed.pid)
        killed.kill()  # SIGKILL mid-run: chunk 0 done, chunk 1 in hand
        killed.wait(timeout=30)
        psutil.wait_procs(started, timeout=30)
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

    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.supervisor.result.reader import check_published
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


def _late_reference(model, text: str, segment: tuple[int, int], span: tuple[int, int]):  # type: ignore[no-untyped-def]
    """Late chunking written from the transformer's own forward pass (not sentence-transformers'
    encode): the segment's token embeddings, the mean of those whose characters lie in the window,
    unit length as the model's Normalize module makes its vectors."""
    import numpy as np
    import torch

    tokenizer, transformer = model.tokenizer, model[0].auto_model
    piece = text[segment[0] : segment[1]]
    enc = tokenizer(piece, return_offsets_mapping=True, return_tensors="pt")
    offsets = enc.pop("offset_mapping")[0].tolist()
    device = next(transformer.parameters()).device  # the GPU tier runs it on the GPU
    with torch.no_grad():
        hidden = (
            transformer(**{k: v.to(device) for k, v in enc.items()})
            .last_hidden_state[0]
            .float()
            .cpu()
            .numpy()
        )
    start, end = span[0] - segment[0], span[1] - segment[0]
    mine = [i for i, (a, b) in enumerate(offsets) if b > a and start <= a < end]
    vector = hidden[mine].mean(axis=0)
    return vector / np.linalg.norm(vector)


def test_late_windows_tile_segments_of_the_context_and_windows_within_them(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from chunkq.supervisor.submit.windows import late_windows

    text = _long_text(700, seed=8)
    pairs = list(late_windows(text, tokenizer, 100, 30, 5))
    segments = list(dict.fromkeys((s.char_start, s.char_end) for s, _ in pairs))
    assert len(segments) > 2 and segments[0][0] == 0 and segments[-1][1] == len(text)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segments))  # segments tile: no token twice
    assert [w.number for _, w in pairs] == list(range(len(pairs)))
    for segment, window in pairs:
        assert segment.char_start <= window.char_start < window.char_end <= segment.char_end
        assert segment.tokens <= 100 and window.tokens <= 30
    for (s1, w1), (s2, w2) in itertools.pairwise(pairs):
        assert w1.char_start < w2.char_start <= w1.char_end  # in order, every character covered
        if s1 != s2:
            assert w2.char_start == s2.char_start == w1.char_end == s1.char_end


@pytest.mark.slow
def test_late_chunking_equals_a_reference_from_the_models_token_embeddings(  # type: ignore[no-untyped-def]
    tmp_path, store, connection, reference_model
) -> None:
    import numpy as np

    from chunkq.supervisor.submit.windows import late_windows
    from tests.helpers import max_abs_diff, result_of, run_in_process

    tok = load_tokenizer(resolve_model(BUNDLED_MODEL))
    texts = [_long_text(400, seed=9), "a short one", _long_text(150, seed=10)]
    ids = ["long-1", "short", "long-2"]
    layout, manifest, encoded = run_in_process(
        tmp_path, store, connection, ids, texts, "late", long_texts="late", window_tokens=40, pool="weighted"
    )
    matrix, rows = result_of(layout)
    assert manifest.plan["windows"]["late"] is True and manifest.plan["windows"]["context"] == 254
    assert encoded == len(rows) == manifest.plan["windows"]["windows"] > 10
    want = []
    for r in rows:
        text = texts[ids.index(r["id"])]
        pairs = list(late_windows(text, tok, 254, 40, None))
        segment, window = pairs[r["window"]]
        assert (window.char_start, window.char_end) == (r["char_start"], r["char_end"])
        want.append(
            _late_reference(
                reference_model,
                text,
                (segment.char_start, segment.char_end),
                (window.char_start, window.char_end),
            )
        )
    assert max_abs_diff(matrix, np.array(want)) <= 1e-5
    # Not the windows encoded alone: each saw the words around it.
    alone = reference_model.encode([texts[ids.index(r["id"])][r["char_start"] : r["char_end"]] for r in rows])
    assert max_abs_diff(matrix, alone) > 0.05
    pooled = np.load(layout.result / "texts.npy")
    assert pooled.shape == (3, matrix.shape[1])
    assert np.abs(pooled[1] - matrix[next(i for i, r in enumerate(rows) if r["id"] == "short")]).max() <= 1e-6


def test_late_chunking_is_refused_for_a_model_that_cannot(  # type: ignore[no-untyped-def]
    tmp_path, store
) -> None:
    import json
    import shutil

    from chunkq.supervisor.request import submit_request
    from chunkq.supervisor.submit.submission import submit
    from tests.helpers import make_texts, write_corpus

    ids, texts = make_texts(4, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    with pytest.raises(ConfigError, match="late chunking needs windows shorter than the model's context"):
        submit(submit_request([corpus], store, long_texts="late", window_tokens=254), None)
    folder = tmp_path / "cls-model"
    shutil.copytree(resolve_model(BUNDLED_MODEL), folder)
    config = folder / "1_Pooling" / "config.json"
    pooling = json.loads(config.read_text())
    pooling.update(pooling_mode_mean_tokens=False, pooling_mode_cls_token=True)
    config.write_text(json.dumps(pooling))
    with pytest.raises(ConfigError, match="pools its tokens by cls, late chunking needs mean pooling"):
        submit(submit_request([corpus], store, model=str(folder), long_texts="late"), None)


@pytest.mark.slow
def test_a_late_window_without_a_token_is_named_and_left_out_under_allow_missing(  # type: ignore[no-untyped-def]
    tmp_path, store, connection
) -> None:
    """Issue 43.11: one text whose characters tokenize to nothing (zero-width spaces) quarantined its
    whole chunk as "a segment holds no token", naming no row. Now the chunk's error names the row by
    id; under --allow-missing its rows are left out and listed, every other row as a run without it
    gives, and the vector cache takes none of its zeros."""
    import json

    import numpy as np

    from chunkq.jobs.contract.errors import BadInputError
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout
    from chunkq.jobs.contract.specs import EncodeOptions
    from chunkq.jobs.embed import embed_chunk
    from chunkq.supervisor.corpus.records import CorpusOptions
    from chunkq.supervisor.submit.identity import SubmitRequest
    from chunkq.supervisor.submit.submission import submit
    from tests.helpers import max_abs_diff, result_of, run_in_process, write_corpus

    texts = [_long_text(120, seed=21), "\u200b\u200b\u200b", _long_text(60, seed=22)]
    ids = ["long", "blank", "other"]
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    request = SubmitRequest(corpus, store, BUNDLED_MODEL, CorpusOptions("jsonl"), long_texts="late")
    layout = RunLayout(store, submit(request, connection).run_id)
    with pytest.raises(BadInputError) as refused:
        embed_chunk(load_manifest(layout).chunk_spec(store, 0).to_dict())
    said = str(refused.value)
    assert "1 row(s) have no vector (id 'blank' window 0: its window holds no token" in said, said
    assert "its window holds no token" in said and "--allow-missing" in said
    kept, _, _ = run_in_process(
        tmp_path, store, connection, ids, texts, "kept", long_texts="late",
        encode=EncodeOptions(allow_missing=True),
    )  # fmt: skip
    without, _, _ = run_in_process(
        tmp_path, store, connection, [ids[0], ids[2]], [texts[0], texts[2]], "without", long_texts="late",
        cache=False,
    )  # fmt: skip
    got, got_ids = result_of(kept)
    want, want_ids = result_of(without)
    assert got_ids == want_ids and {r["id"] for r in got_ids} == {"long", "other"}
    assert max_abs_diff(got, want) <= 1e-6
    listed = json.loads(kept.result_manifest.read_text())["bad_rows"]
    assert [r["id"]["id"] for r in listed] == ["blank"]
    assert all(np.abs(v).sum() > 0 for v in got)
    from chunkq.jobs.compute.vector_cache import VectorCache

    cached = sum(s.rows for key in VectorCache(store).producers() for s in VectorCache(store, key).shards())
    assert cached == len(got_ids)  # the blank window's zeros never entered the cache
