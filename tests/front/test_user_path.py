"""The user's path (issue 16), end to end through the CLI with the real Redis and the real model:
model names, checks before acting, the store as the record, run ids and cleanup, export, several
inputs, and the Python API."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest
import redis

from chunkq.jobs.contract.run_files import RunLayout, read_json
from chunkq.supervisor.server.embedded_redis import free_port
from tests.helpers import (
    cli_env,
    make_texts,
    max_abs_diff,
    only_run,
    run_cli,
    start_cli,
    start_run_with_a_slow_chunk,
    stop_tree,
    wait_for,
    write_corpus,
)

pytestmark = pytest.mark.slow


def _no_chunkq_processes_under(root: Path) -> bool:
    """No valkey-server, pool or worker of a store under ``root`` is alive."""
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(root) in line and ("valkey" in line or "chunkq" in line):
            return False
    return True


def _plain(reference_model: Any, texts: list[str]) -> np.ndarray:
    return np.asarray(reference_model.encode(texts, batch_size=32, convert_to_numpy=True))


def test_two_files_one_run_listed_exported_cleaned_and_resumed_from_the_store(
    tmp_path: Path, reference_model: Any
) -> None:
    """The model name everyone types, two corpus files by glob, the default run id, status and runs
    without Redis, the three export formats, --outputs-only and the rerun that encodes nothing."""
    data = tmp_path / "data"
    data.mkdir()
    _, texts_a = make_texts(40, seed=1)
    _, texts_b = make_texts(25, seed=2)
    (data / "notes-a.txt").write_text("".join(t + "\n" for t in texts_a), encoding="utf-8")
    (data / "notes-b.txt").write_text("".join(t + "\n" for t in texts_b), encoding="utf-8")
    store = tmp_path / "store"
    args = ("run", str(data / "notes-*.txt"), "--store", str(store), "--chunk-size", "20")
    done = run_cli(*args, "--model", "all-MiniLM-L6-v2", "--max-jobs", "10")
    assert done.returncode == 0, done.stderr[-3000:]

    (run_id,) = [p.name for p in (store / "runs").iterdir()]
    assert run_id.startswith("notes-a-"), run_id  # the first file's name, then the fingerprint
    layout = RunLayout(store, run_id)
    manifest = read_json(layout.manifest)
    assert manifest["model"] == "bundled:all-MiniLM-L6-v2"  # resolved to the bundled copy, offline
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["notes-a.txt", "notes-b.txt"]
    assert all(len(i["sha256"]) == 64 for i in manifest["inputs"])
    ids = [json.loads(line) for line in (layout.result / "ids.jsonl").read_text().splitlines()]
    assert ids == [f"notes-a.txt:{i}" for i in range(1, 41)] + [f"notes-b.txt:{i}" for i in range(1, 26)]
    embeddings = np.load(layout.result / "embeddings.npy")
    assert max_abs_diff(embeddings, _plain(reference_model, texts_a + texts_b)) < 1e-5

    # The store is the record: the run's Redis is gone, status and runs read the store alone, and
    # status, report and runs agree on the run's rate.
    status = run_cli("status", run_id, "--store", str(store), "--json")
    assert status.returncode == 0, status.stderr
    snap = json.loads(status.stdout)
    assert snap["chunks_done"] == 4 and snap["live"] is False and snap["settled"] and snap["result_published"]
    report = run_cli("report", run_id, "--store", str(store), "--log-level", "WARNING")
    assert report.returncode == 0, report.stderr
    summary = json.loads((layout.root / "report" / "report.json").read_text())
    assert summary["rows_per_second"] == pytest.approx(snap["rows_per_second"], abs=0.051)  # rounded to 0.1
    (said,) = re.findall(r"([0-9,.]+) rows/s", done.stdout)  # what run itself printed at the end
    assert float(said.replace(",", "")) == pytest.approx(snap["rows_per_second"], abs=0.051)
    listing = run_cli("runs", "--store", str(store), "--json")
    (info,) = json.loads(listing.stdout)
    assert (info["run_id"], info["state"], info["rows_done"], info["model"]) == (
        run_id,
        "published",
        65,
        "bundled:all-MiniLM-L6-v2",
    )
    table = run_cli("runs", "--store", str(store)).stdout
    assert run_id in table and "published" in table and "65/65" in table

    # Export: each format holds the published float32 values exactly, with the ids, in order.
    parquet, npy, jsonl = tmp_path / "out.parquet", tmp_path / "out.npy", tmp_path / "out.jsonl"
    for fmt, out in (("parquet", parquet), ("npy", npy), ("jsonl", jsonl)):
        exported = run_cli("export", run_id, "--store", str(store), "--format", fmt, "--out", str(out))
        assert exported.returncode == 0, exported.stderr
        assert exported.stdout.startswith(f"65 rows x 384 of run {run_id} written to {out}"), exported.stdout
    table_pq = pq.read_table(parquet)
    assert str(table_pq.schema.field("embedding").type) == "fixed_size_list<element: float>[384]"
    assert table_pq.column("id").to_pylist() == ids
    from_parquet = np.stack(table_pq.column("embedding").to_numpy(zero_copy_only=False)).astype("<f4")
    assert from_parquet.tobytes() == embeddings.tobytes()
    assert np.load(npy).tobytes() == embeddings.tobytes()
    assert [json.loads(line) for line in (tmp_path / "out.ids.jsonl").read_text().splitlines()] == ids
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["id"] for r in rows] == ids
    assert np.asarray([r["embedding"] for r in rows], dtype="<f4").tobytes() == embeddings.tobytes()

    # The chunk outputs went at publish (the result holds their rows); clean --outputs-only frees
    # what else it may and leaves the result; the rerun sees it and encodes nothing.
    assert not list(layout.outputs.glob("*.npy")) and list(layout.outputs.glob("*.json"))
    before = info["bytes"]
    cleaned = run_cli("clean", run_id, "--store", str(store), "--outputs-only")
    assert cleaned.returncode == 0, cleaned.stderr
    after = json.loads(run_cli("runs", "--store", str(store), "--json").stdout)[0]
    assert after["bytes"] <= before and after["state"] == "published"
    again = run_cli(*args, "--model", "sentence-transformers/all-MiniLM-L6-v2")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "already complete" in again.stdout
    assert np.array_equal(np.load(layout.result / "embeddings.npy"), embeddings)
    assert not list(layout.outputs.glob("*.npy"))  # nothing was encoded again

    # Delete the whole run.
    deleted = run_cli("clean", run_id, "--store", str(store))
    assert deleted.returncode == 0 and not layout.root.exists(), deleted.stderr
    assert "no runs" in run_cli("runs", "--store", str(store)).stdout


def test_a_model_that_is_neither_a_folder_nor_cached_fails_before_anything_starts(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(5), "jsonl")
    cache = tmp_path / "hf-cache"
    result = run_cli(
        "run",
        str(corpus),
        "--model",
        "BAAI/bge-large-en-v1.5",
        cwd=tmp_path,
        HF_HUB_CACHE=str(cache),
        timeout=60,
    )
    assert result.returncode == 6, result.stderr
    assert "neither a local folder nor in the Hugging Face cache" in result.stderr
    assert "hf download BAAI/bge-large-en-v1.5" in result.stderr and "--model /path" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]  # no store, no Redis folder
    assert _no_chunkq_processes_under(tmp_path)


@pytest.mark.parametrize(
    ("corpus_text", "name", "exit_code", "says"),
    [
        (None, "nosuch.jsonl", 3, "nosuch.jsonl: no such file"),
        ('{"body": "no text field"}\n', "wrong.jsonl", 3, "wrong.jsonl:1: missing text field 'text'"),
        ("id,body\n1,x\n", "wrong.csv", 3, "header has no column 'text'"),
        ("x\n", "notes.docx", 3, "cannot tell the format"),
    ],
)
def test_run_checks_the_corpus_before_it_starts_or_writes_anything(
    tmp_path: Path, corpus_text: str | None, name: str, exit_code: int, says: str
) -> None:
    if corpus_text is not None:
        (tmp_path / name).write_text(corpus_text)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = run_cli("run", name, cwd=tmp_path, timeout=60)
    assert result.returncode == exit_code, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no chunkq-store, no redis/
    assert _no_chunkq_processes_under(tmp_path)


def test_submit_reaches_redis_and_checks_the_corpus_before_it_writes(
    tmp_path: Path, connection: redis.Redis, redis_url: str
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(30), "jsonl")
    store = tmp_path / "store"
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    result = run_cli("submit", str(corpus), "--store", str(store), "--redis-url", unreachable, timeout=60)
    assert result.returncode == 7, result.stderr
    assert not store.exists()

    keys = connection.dbsize()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 7}\n')
    refused = run_cli("submit", str(bad), "--store", str(store), CHUNKQ_REDIS_URL=redis_url)
    assert refused.returncode == 3 and "bad.jsonl:2: text field 'text' is int" in refused.stderr
    assert not store.exists() and connection.dbsize() == keys

    # The run id alone on stdout (for scripts), --json for the figures, --log-level after the name.
    submitted = run_cli(
        "submit", str(corpus), "--store", str(store), "--chunk-size", "10", "--log-level", "WARNING",
        CHUNKQ_REDIS_URL=redis_url, CHUNKQ_QUEUE="userpath",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    run_id = submitted.stdout.strip()
    assert run_id.startswith("c-") and "\t" not in run_id and (store / "runs" / run_id).is_dir()
    assert "INFO" not in submitted.stderr
    figures = run_cli(
        "submit", str(corpus), "--store", str(store), "--chunk-size", "10", "--json",
        CHUNKQ_REDIS_URL=redis_url, CHUNKQ_QUEUE="userpath",
    )  # fmt: skip
    assert json.loads(figures.stdout)["run_id"] == run_id and json.loads(figures.stdout)["in_flight"] == 3

    # A Redis that holds none of the run's jobs: they wait in the store, for a supervisor to queue.
    other = redis.Redis.from_url(redis_url, db=5)
    other.flushdb()
    status = run_cli(
        "status", run_id, "--store", str(store), "--redis-url", redis_url.rsplit("/", 1)[0] + "/5"
    )
    assert status.returncode == 0, status.stderr
    assert "0 queued, 3 waiting in the store" in status.stdout


def test_supervise_says_when_no_worker_takes_a_job_and_which_queue(
    tmp_path: Path, connection: redis.Redis, redis_url: str
) -> None:
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(10), "jsonl")
    store = tmp_path / "store"
    env = {"CHUNKQ_REDIS_URL": redis_url, "CHUNKQ_QUEUE": "nobody-listens"}
    run_id = run_cli("submit", str(corpus), "--store", str(store), **env).stdout.strip()
    log = tmp_path / "supervise.log"
    proc = start_cli(
        log, "supervise", run_id, "--store", str(store), "--poll", "0.1", "--warn-idle", "0.5", **env
    )
    try:
        wait_for(lambda: b"no worker has taken a job" in log.read_bytes(), 60, "the idle warning")
        # While it supervises, the run is in flight: clean refuses it and names the owner.
        refused = run_cli("clean", run_id, "--store", str(store))
        assert refused.returncode == 10 and "in use by pid" in refused.stderr, refused.stderr
        assert (store / "runs" / run_id / "manifest.json").is_file()
        listed = json.loads(run_cli("runs", "--store", str(store), "--json").stdout)
        assert listed[0]["state"] == "in flight"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
    finally:
        stop_tree(proc) if proc.poll() is None else None
    text = log.read_text()
    assert "from queue 'nobody-listens'" in text and "0 worker(s) listen on it" in text
    # With Redis, clean also refuses a run whose jobs are still queued there.
    queued = run_cli("clean", run_id, "--store", str(store), CHUNKQ_REDIS_URL=redis_url)
    assert queued.returncode == 6 and "1 chunk(s) are queued or running" in queued.stderr


def test_duplicate_ids_across_files_name_both_places(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "a.jsonl", ["x1", "x2"], ["one", "two"], "jsonl")
    b = write_corpus(tmp_path / "b.jsonl", ["x3", "x1"], ["three", "four"], "jsonl")
    result = run_cli("run", str(a), str(b), "--store", str(tmp_path / "store"), timeout=120)
    assert result.returncode == 3, result.stderr
    assert "x1" in result.stderr and "a.jsonl:1" in result.stderr and "b.jsonl:2" in result.stderr


def test_the_python_api_embeds_texts_and_runs_a_corpus(tmp_path: Path, reference_model: Any) -> None:
    script = tmp_path / "use_api.py"
    script.write_text(
        "import json, os, sys\n"
        "import numpy as np\n"
        "import chunkq\n"
        # Issue 21.11: the caller's umask is the caller's; chunkq sets modes on what it creates.
        "os.umask(0o022)\n"
        "calls, real_umask = [], os.umask\n"
        "os.umask = lambda mask: calls.append(oct(mask)) or real_umask(mask)\n"
        "texts = [line.rstrip('\\n') for line in open(sys.argv[1], encoding='utf-8')]\n"
        "vectors = chunkq.embed(texts, chunk_size=15, max_jobs=10)\n"
        "np.save(sys.argv[2], vectors)\n"
        "result = chunkq.run(sys.argv[1], store=sys.argv[3], chunk_size=15, max_jobs=10)\n"
        "print(json.dumps({'rows': result.rows, 'dim': result.dim, 'run_id': result.run_id,\n"
        "                  'same': bool(np.array_equal(result.embeddings(), vectors)),\n"
        "                  'ids': result.ids()[:2], 'rate': result.rows_per_second}))\n"
        "empty = chunkq.embed([])\n"
        "complaints = []\n"
        "for call in (lambda: chunkq.embed('a string'), lambda: chunkq.embed(['a'], chunk_size='5')):\n"
        "    try:\n"
        "        call()\n"
        "    except chunkq.ConfigError as exc:\n"
        "        complaints.append(str(exc))\n"
        "print(json.dumps({'empty': [empty.shape, str(empty.dtype)], 'complaints': complaints,\n"
        "                  'umask_calls': calls, 'umask': oct(real_umask(0o022))}))\n"
        "try:\n"
        "    chunkq.run(sys.argv[1], store=sys.argv[3], no_such_option=1)\n"
        "except chunkq.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    _, texts = make_texts(33, seed=4)
    corpus = tmp_path / "texts.txt"
    corpus.write_text("".join(t + "\n" for t in texts), encoding="utf-8")
    out = tmp_path / "vectors.npy"
    done = subprocess.run(
        [sys.executable, str(script), str(corpus), str(out), str(tmp_path / "store")],
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures, api_edges, complaint = done.stdout.strip().splitlines()[-3:]
    numbers = json.loads(figures)
    edges = json.loads(api_edges)
    assert edges["empty"] == [[0, 384], "float32"]  # issue 21.15: embed([]) is an empty matrix
    assert "takes a list of texts or a corpus path; 'a string' is neither" in edges["complaints"][0]
    assert edges["complaints"][1] == "chunk_size must be a positive integer, got '5'"
    assert edges["umask_calls"] == [] and edges["umask"] == "0o22", edges
    loose = {
        str(p): oct(p.stat().st_mode & 0o777)
        for p in [tmp_path / "store", *(tmp_path / "store").rglob("*")]
        if p.stat().st_mode & 0o077
    }
    assert not loose, loose  # owner-only by the modes chunkq sets, under the caller's umask 022
    assert (numbers["rows"], numbers["dim"], numbers["same"], numbers["ids"]) == (33, 384, True, ["1", "2"])
    assert numbers["run_id"].startswith("texts-") and numbers["rate"] > 0
    assert "unknown option(s): no_such_option" in complaint
    assert max_abs_diff(np.load(out), _plain(reference_model, texts)) < 1e-5


def test_status_shows_a_running_chunkq_run_live_without_being_given_redis(tmp_path: Path) -> None:
    proc, log, _, _ = start_run_with_a_slow_chunk(tmp_path, seed=31, seconds=6, chunk=0)
    store = tmp_path / "store"
    try:
        run_id = only_run(store).run_id
        during = run_cli("status", run_id, "--store", str(store), "--json")
        assert during.returncode == 0, during.stderr
        snap = json.loads(during.stdout)
        assert snap["live"] is True and snap["chunks_running"] >= 1 and not snap["settled"]
        assert proc.wait(timeout=180) == 0, log.read_text()[-3000:]
    finally:
        stop_tree(proc) if proc.poll() is None else None
    after = json.loads(run_cli("status", run_id, "--store", str(store), "--json").stdout)
    assert after["live"] is False and after["settled"]  # the run's Redis is gone; the store remains
    assert not (store / "redis" / "url").exists()


def _pty_run(argv: list[str]) -> tuple[int, int]:
    """``argv`` in a new pseudo-terminal, as a user's shell starts it: (pid, the terminal's fd)."""
    import pty

    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes the command
        os.execv(argv[0], argv)  # noqa: S606 - argv is this test's own command line
    return pid, fd


def _read_until(fd: int, seen: bytearray, wanted: bytes, seconds: float) -> None:
    import select

    deadline = time.monotonic() + seconds
    while wanted not in seen:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(
                f"no {wanted!r} in {seconds} s; the terminal showed: {bytes(seen)[-2000:]!r}"
            )
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the terminal closed: the command ended
                raise AssertionError(
                    f"the command ended without {wanted!r}: {bytes(seen)[-2000:]!r}"
                ) from None


def test_ctrl_c_in_a_terminal_says_what_happens_and_a_second_one_stops_without_a_traceback(
    tmp_path: Path,
) -> None:
    """Issue 24.2, in a real pseudo-terminal (the live progress bar, ^C typed as a terminal sends
    it): the first Ctrl+C says the workers finish their chunk and that a second one stops at once;
    the second stops with exit 130, one line, no traceback; the run resumes afterwards."""
    corpus = write_corpus(tmp_path / "c.jsonl", *make_texts(800, seed=3), "jsonl")
    store = tmp_path / "store"
    chunkq = str(Path(sys.executable).parent / "chunkq")
    pid, fd = _pty_run([chunkq, "run", str(corpus), "--store", str(store), "--chunk-size", "400"])
    seen = bytearray()
    try:
        wait_for(lambda: any(store.glob("runs/*/logs/run.log")), 60, "the run's log")
        (log,) = store.glob("runs/*/logs/run.log")
        wait_for(lambda: b"(400 rows)" in log.read_bytes(), 90, "a worker to take a chunk")
        os.write(fd, b"\x03")
        _read_until(fd, seen, b"press Ctrl+C again to stop now", 30)
        os.write(fd, b"\x03")
        _read_until(fd, seen, b"chunkq: interrupted", 60)
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 130
    text = bytes(seen).decode(errors="replace")
    assert "Traceback" not in text and "SystemExit" not in text, text
    resumed = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "400")
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_a_few_texts_are_embedded_in_process_with_a_runs_own_results(
    tmp_path: Path, reference_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 37.4: `chunkq.embed` of one query started Redis, a pool and a store (41.9 s at load 12).
    Up to IN_PROCESS_TEXTS texts are encoded in the caller's process: the same values as a run,
    for float32 and for int8 (ranges from the texts, as a run's calibration of up to 1,000)."""
    import numpy as np

    import chunkq
    from chunkq import api

    _, texts = make_texts(12, seed=44)
    queries = [*texts, "a query"]
    monkeypatch.setattr(api, "run", lambda *a, **k: pytest.fail("a few texts went through a run"))
    inline = chunkq.embed(queries, prompt="query: ", truncate_dim=128, normalize=True)
    plain = reference_model.encode(queries, prompt="query: ", truncate_dim=128, normalize_embeddings=True)
    assert inline.shape == (13, 128) and max_abs_diff(inline, plain) <= 1e-5
    codes = chunkq.embed(queries, output_dtype="int8")
    # A run's int8: its texts' fp32 embeddings quantized on ranges computed from up to 1,000 of them
    # (test_models' int8 run holds a run to this same definition).
    from sentence_transformers import quantize_embeddings

    from chunkq.jobs.compute.quantize import ranges_of

    wide = reference_model.encode(queries)
    expected = quantize_embeddings(
        wide, precision="int8", ranges=np.asarray(ranges_of(wide), dtype=np.float32)
    )
    assert codes.dtype == np.int8 and int(np.abs(codes.astype(int) - expected.astype(int)).max()) <= 1
    assert api.IN_PROCESS_TEXTS == 1000
    with pytest.raises(chunkq.ConfigError, match="isolated=False takes encoding options only"):
        chunkq.embed(["x"], isolated=False, chunk_size=5)
    # A text a run refuses is refused here too, in the same words whichever path the list takes
    # (an empty text gave a vector here, and a run's refusal named its temporary file).
    for isolated in (None, True):
        with pytest.raises(chunkq.CorpusError, match=r"^chunkq.embed, text 2: text is empty$"):
            chunkq.embed(["fine", " "], isolated=isolated)
