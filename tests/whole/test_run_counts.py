"""Issue 45.6: one definition of a run's rows, shown the same by every command. Before, the demo's run
said `500 x 384`, `status` `rows 494/494` (its distinct texts) and `runs` 500/500; a windowed run
1,586 / 1,520 / 1,586. A run's rows are its result's (the corpus's rows, or its windows); what the
vector cache and deduplication saved is said beside them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import make_texts, run_cli, write_corpus
from tests.jobs.test_windows import _long_text


def _counts(store: Path, run_id: str) -> tuple[str, str]:
    status = run_cli("status", run_id, "--store", str(store))
    runs = run_cli("runs", "--store", str(store), "--json")
    assert status.returncode == 0 and runs.returncode == 0, status.stderr + runs.stderr
    (row,) = [r for r in json.loads(runs.stdout) if r["run_id"] == run_id]
    done = re.search(r"rows ([\d,]+)/([\d,]+)", status.stdout)
    assert done, status.stdout
    return f"{done.group(1)}/{done.group(2)}", f"{row['rows_done']:,}/{row['rows']:,}"


@pytest.mark.slow
def test_a_runs_rows_are_counted_the_same_by_run_status_and_runs(tmp_path: Path) -> None:
    ids, texts = make_texts(40, seed=61)
    texts += texts[:10]  # 10 duplicates: 50 rows, 40 distinct texts
    ids += [f"dup-{i}" for i in range(10)]
    corpus = write_corpus(tmp_path / "dups.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "15", "--run-id", "dups")
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    assert "run dups: 50 x 384 embeddings, 40 row(s) encoded by 1 worker process(es) at " in said, said[
        -2000:
    ]
    assert "50 rows: 40 encoded, 0 from the vector cache, 10 repeating another row's text" in said
    assert _counts(store, "dups") == ("50/50", "50/50")
    # Issue 45.9: a run whose every text is cached encoded nothing, and says so.
    again = write_corpus(tmp_path / "again.jsonl", [f"a{i}" for i in range(50)], texts, "jsonl")
    cached = run_cli("run", str(again), "--store", str(store), "--chunk-size", "15", "--run-id", "again")
    said = cached.stdout + cached.stderr
    assert "run again: 50 x 384 embeddings, no row encoded: every text came from the vector cache" in said, (
        said
    )

    long = [_long_text(300, seed=s) for s in range(4)] + ["short text"] * 2
    corpus = write_corpus(tmp_path / "long.jsonl", [f"l{i}" for i in range(6)], long, "jsonl")
    args = ["--store", str(store), "--run-id", "windows", "--long-texts", "window", "--window-tokens", "40"]
    done = run_cli("run", str(corpus), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    windows = int(re.search(r"run windows: (\d+) x 384", done.stdout + done.stderr).group(1))  # type: ignore[union-attr]
    assert windows > 6
    assert _counts(store, "windows") == (f"{windows:,}/{windows:,}",) * 2
    # Issue 45.7: the runs and the cache's producers are told apart by what set them apart.
    late = run_cli("run", str(corpus), *args[:2], "--run-id", "late", "--long-texts", "late")
    assert late.returncode == 0, late.stderr[-3000:]
    listed = {
        r["run_id"]: r["options"] for r in json.loads(run_cli("runs", "--store", str(store), "--json").stdout)
    }
    assert 'long_texts="window"' in listed["windows"] and "long_texts.tokens=40" in listed["windows"]
    assert 'long_texts="late"' in listed["late"] and listed["dups"] == "chunk_size=15"
    producers = run_cli("cache", "--store", str(store)).stdout
    assert "late_chunking=True" in producers, producers


@pytest.mark.slow
def test_a_resumed_run_says_what_it_found_and_status_of_a_stopped_run_reads_as_no_damage(
    tmp_path: Path,
) -> None:
    """Issue 45.8: the rerun of a stopped run printed no "resuming"; `status` of the stopped run said
    `the ledger lacked 3 finished chunk(s); rebuilt it from their outputs`, which reads as damage."""
    import signal

    from tests.helpers import start_run_with_a_slow_chunk, wait_for

    proc, log, args, _ = start_run_with_a_slow_chunk(tmp_path, seed=62, seconds=600, chunk=2, rows=100)
    try:
        wait_for(lambda: len(list((tmp_path / "store").rglob("outputs/*.json"))) >= 2, 180, "two chunks done")
        proc.send_signal(signal.SIGINT)  # the drain: chunk 2 would take 600 s more
        wait_for(lambda: "Ctrl+C again" in log.read_text(errors="replace"), 60, "the drain's notice")
        proc.send_signal(signal.SIGINT)  # stop now: chunk 2 goes back to the queue
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    (run_dir,) = (tmp_path / "store" / "runs").iterdir()
    import shutil

    shutil.rmtree(run_dir / "ledger", ignore_errors=True)  # stopped before its owner recorded them
    status = run_cli("status", run_dir.name, "--store", str(tmp_path / "store"))
    assert "lacked" not in status.stdout + status.stderr and "rebuilt" not in status.stdout + status.stderr
    assert list((run_dir / "ledger").glob("*.jsonl")), "status recorded the finished chunks"
    done = len(list((run_dir / "outputs").glob("*.json")))
    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = done * 20
    said = f"resuming run {run_dir.name}: {done} of 5 chunk(s) were done ({rows} of 100 rows)"
    assert f"{said}; encoding the other {5 - done}" in resumed.stderr, resumed.stderr[-3000:]
    assert "Traceback" not in log.read_text(errors="replace")


@pytest.mark.slow
def test_every_command_gives_one_runs_figures_alike(tmp_path: Path) -> None:
    """Issue 53.3: one run with repeated texts, a worker killed mid-chunk (the injected fault), and
    every figure read from `run`'s summary, `status`, `status --json`, `runs`, `runs --json` and
    `report`: its rows (the corpus's), how many were encoded and repeated, the worker processes that
    encoded its chunks and those that died. Before: `--json` said rows 494 of a 500-row run, report
    "1350 of 1350" of 1,500, the summary 5 worker processes against the report's 6, and chunk labels
    were positions among the distinct texts."""
    ids, texts = make_texts(90, seed=62)
    texts += texts[:10]
    ids += [f"dup-{i}" for i in range(10)]
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    store = tmp_path / "store"
    fault = json.dumps([{"kind": "sigkill", "chunks": [2], "attempts": [1]}])
    done = run_cli("run", str(corpus), "--store", str(store), "--chunk-size", "20", "--run-id", "counts",
                   CHUNKQ_FAULTS=fault)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    summary = re.search(r"run counts: (\d+) x 384 embeddings, (\d+) row\(s\) encoded by (\d+) worker", said)
    assert summary, said[-2000:]
    rows, encoded, processes = (int(g) for g in summary.groups())
    assert (rows, encoded) == (
        100,
        90,
    ) and "100 rows: 90 encoded, 0 from the vector cache, 10 repeating" in said
    status = run_cli("status", "counts", "--store", str(store)).stdout
    as_json = json.loads(run_cli("status", "counts", "--store", str(store), "--json").stdout)
    listed = run_cli("runs", "--store", str(store)).stdout
    (row,) = json.loads(run_cli("runs", "--store", str(store), "--json").stdout)
    report_dir = tmp_path / "report"
    assert run_cli("report", "counts", "--store", str(store), "--out", str(report_dir)).returncode == 0
    numbers = json.loads((report_dir / "report.json").read_text())
    markdown = (report_dir / "report.md").read_text()
    assert "rows 100/100" in status and "100 rows: 90 encoded" in status
    assert (as_json["rows"], as_json["rows_done"], as_json["chunk_rows"]) == (100, 100, 90)
    assert as_json["cache"]["encoded"] == row["cache"]["encoded"] == 90
    assert re.search(r"counts\s+published\s+100/100", listed) and (row["rows"], row["rows_done"]) == (
        100,
        100,
    )
    assert (numbers["rows"], numbers["rows_done"], numbers["rows_encoded"]) == (100, 100, 90)
    assert "| rows done | 100 of 100 |" in markdown
    assert numbers["worker_processes"] == processes and numbers["worker_deaths"] == 1
    assert f"| worker processes | {processes} encoded its chunks, 1 died |" in markdown
    failures = (
        [a for a in as_json["failed_attempts"]] if "failed_attempts" in as_json else numbers["failures"]
    )
    assert [(f["chunk"], f["error_class"]) for f in failures] == [(2, "abandoned")]
    from chunkq.jobs.contract.manifest import load_manifest
    from chunkq.jobs.contract.run_files import RunLayout

    manifest = load_manifest(
        RunLayout(store, "counts")
    )  # repeated texts folded: chunk rows are no corpus rows
    assert manifest.chunk_label(2) == "chunk 2 (20 distinct text(s) of the run)"
