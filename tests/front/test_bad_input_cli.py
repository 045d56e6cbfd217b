"""Malformed corpora through the real CLI: a clear message naming file and line, exit 3, and
nothing written to the store or Redis. (Reader-level cases live in test_corpus.py.)"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import redis

from tests.helpers import run_cli


def _write(path: Path, content: bytes | str) -> Path:
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


CASES = {
    "invalid-json": ("c.jsonl", '{"id": 1, "text": "a"}\n{"id": 2, "text": "b"\n', "c.jsonl:2: invalid JSON"),
    "missing-text": ("c.jsonl", '{"id": 1, "body": "a"}\n', "c.jsonl:1: missing text field 'text'"),
    "text-not-string": ("c.jsonl", '{"id": 1, "text": ["a"]}\n', "c.jsonl:1: text field 'text' is list"),
    "null-text": ("c.jsonl", '{"id": 1, "text": null}\n', "c.jsonl:1: text field 'text' is null"),
    "empty-text": ("c.jsonl", '{"id": 1, "text": ""}\n', "c.jsonl:1: text field 'text' is empty"),
    "empty-file": ("c.jsonl", "", "the corpus holds no texts"),
    "non-utf8": ("c.txt", b"ok\n\xc3\x28 broken\n", "c.txt:2: not valid UTF-8"),
    "duplicate-ids": (
        "c.jsonl",
        '{"id": 1, "text": "a"}\n{"id": 1, "text": "b"}\n',
        "c.jsonl:2: duplicate id '1'",
    ),
    "lone-surrogate-text": (
        "c.jsonl",
        '{"id": 1, "text": "ok"}\n{"id": 2, "text": "a\\ud800b"}\n',
        "c.jsonl:2: text field 'text' holds a lone surrogate (\\ud800 at character 1)",
    ),
    "lone-surrogate-id": (
        "c.jsonl",
        '{"id": "\\udfff", "text": "a"}\n',
        "c.jsonl:1: id 'id' holds a lone surrogate (\\udfff at character 0)",
    ),
    "nul-in-id": (  # issue 63.5: accepted, then PostgreSQL's CharacterNotInRepertoire at export
        "c.jsonl",
        '{"id": "ok", "text": "a"}\n{"id": "a\\u0000b", "text": "b"}\n',
        "c.jsonl:2: id 'id' holds a NUL character (\\u0000 at character 1)",
    ),
    # every bad row of the file in one refusal, the first first (a newcomer mended one per run)
    "several-bad-rows": (
        "c.jsonl",
        '{"id": 1, "text": "a"}\n{"id": 2, "text": }\n{"id": 3, "text": "c"}\n{"id": 4, "text": ""}\n',
        "c.jsonl:4: text field 'text' is empty",
    ),
    "csv-missing-column": ("c.csv", "id,body\n1,a\n", "c.csv:1: header has no column 'text'"),
    "csv-ragged": ("c.csv", "id,text\n1,a\n2,b,extra\n", "c.csv:3: 3 columns where the header has 2"),
    "over-long-line": (
        "c.jsonl",
        json.dumps({"text": "x" * (7 << 20)}) + "\n",
        "c.jsonl:1: line is over the limit",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_corpus_is_refused_cleanly(
    tmp_path: Path, case: str, redis_url: str, connection: redis.Redis
) -> None:
    name, content, message = CASES[case]
    corpus = _write(tmp_path / name, content)
    store = tmp_path / "store"
    result = run_cli(
        "submit", str(corpus), "--store", str(store), "--run-id", "bad", CHUNKQ_REDIS_URL=redis_url
    )
    assert result.returncode == 3, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (store / "runs" / "bad").exists()
    assert connection.dbsize() == 0  # nothing enqueued


def test_parquet_wrong_type_missing_file_directory(tmp_path: Path, redis_url: str) -> None:
    parquet = tmp_path / "c.parquet"
    pq.write_table(pa.table({"id": [1], "text": [1.5]}), parquet)
    (tmp_path / "dir.jsonl").mkdir()
    for corpus, message in (
        (parquet, "column 'text' has type double, expected string"),
        (tmp_path / "absent.jsonl", "absent.jsonl: no such file"),
        (tmp_path / "dir.jsonl", "dir.jsonl: is a directory"),
    ):
        result = run_cli("submit", str(corpus), "--store", str(tmp_path / "s"), CHUNKQ_REDIS_URL=redis_url)
        assert result.returncode == 3 and message in result.stderr, result.stderr


def test_corpus_changed_between_submit_and_resume_is_refused(tmp_path: Path, redis_url: str) -> None:
    corpus = _write(tmp_path / "c.jsonl", '{"id": 1, "text": "a"}\n')
    args = ("submit", str(corpus), "--store", str(tmp_path / "s"), "--run-id", "resume-me")
    assert run_cli(*args, CHUNKQ_REDIS_URL=redis_url).returncode == 0
    _write(corpus, '{"id": 1, "text": "changed"}\n')
    changed = run_cli(*args, CHUNKQ_REDIS_URL=redis_url)
    assert changed.returncode == 4 and "corpus_sha256: stored" in changed.stderr


@pytest.mark.parametrize("given", ["ab\n", ""])  # "": a hostile pass's, taken as no run id at all
def test_a_run_id_with_a_trailing_newline_is_refused_before_anything_is_written(
    tmp_path: Path, redis_url: str, connection: redis.Redis, given: str
) -> None:
    corpus = _write(tmp_path / "c.jsonl", '{"id": 1, "text": "a"}\n')
    store = tmp_path / "store"
    result = run_cli(
        "submit", str(corpus), "--store", str(store), "--run-id", given, CHUNKQ_REDIS_URL=redis_url
    )
    assert result.returncode == 6, result.stderr
    assert f"invalid run id {given!r}" in result.stderr and "Traceback" not in result.stderr
    assert not (store / "runs").exists() or not any((store / "runs").iterdir())
    assert connection.dbsize() == 0


@pytest.mark.slow  # a real pool, started and killed (the slow tier's definition, docs/development.md)
@pytest.mark.parametrize("case", ["empty-file", "invalid-json", "duplicate-ids"])
def test_a_run_whose_corpus_fails_later_than_its_first_row_leaves_nothing(tmp_path: Path, case: str) -> None:
    """``chunkq run`` with the embedded Redis splits the corpus while its pool starts; a bad row
    after the first (or no row) stops it with the pool killed, the server stopped and every file and
    folder it created removed: no store, no Redis files, no process left."""
    import psutil

    name, content, message = CASES[case]
    corpus = _write(tmp_path / name, content)
    store = tmp_path / "store"
    result = run_cli("run", str(corpus), "--store", str(store))
    assert result.returncode == 3 and message in result.stderr, result.stderr
    assert not store.exists()
    left = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        with contextlib.suppress(psutil.Error):
            if str(store) in " ".join(proc.info["cmdline"] or []) + str(proc.info["environ"] or ""):
                left.append(proc.info["cmdline"])
    assert left == []


@pytest.mark.slow  # a real pool, started and killed
def test_a_run_on_a_shared_redis_whose_corpus_fails_later_leaves_no_key(
    tmp_path: Path, redis_url: str, connection: redis.Redis
) -> None:
    """A hostile pass: a bad row at line 50,000 left the run's queue listed in Redis (the pools'
    sorted set of runs and RQ's list of queues) after its queued jobs were taken back."""
    corpus = _write(
        tmp_path / "c.jsonl", "".join(f'{{"id": {i}, "text": "t{i}"}}\n' for i in range(40)) + "{\n"
    )
    result = run_cli(
        "run", str(corpus), "--store", str(tmp_path / "store"), "--chunk-size", "2", "--redis-url", redis_url
    )
    assert result.returncode == 3 and "c.jsonl:41: invalid JSON" in result.stderr, result.stderr
    assert connection.keys("*c-*") == [] and connection.zcard("chunkq:run-queues:chunkq") == 0
    assert connection.smembers("rq:queues") <= {b"rq:queue:chunkq"}
