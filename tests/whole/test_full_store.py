"""Issue 51.7-51.10: a full or damaged store. Each is one line with its exit code, never a traceback,
a SIGBUS or a resume hint where nothing can resume; the command that frees space works on a full
disk; one damaged run keeps no command from the others."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, new_memmap, save_npy_atomic
from chunkq.queue_worker.exit_codes import EXIT_ASSEMBLY, EXIT_STORAGE
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import fill, make_texts, run_cli, tmpfs, write_corpus, write_encoded_run, write_ragged_run


def _one_line(done: object, code: int) -> str:
    stderr = getattr(done, "stderr", "")
    assert getattr(done, "returncode", None) == code, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("chunkq: ")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_a_full_disk_is_an_enospc_naming_the_file_for_every_way_chunkq_writes_arrays(tmp_path: Path) -> None:
    """51.7: numpy's own short write said "[Errno None] None" (an internal error); 51.8: a memory map
    over a sparse file met the full disk as SIGBUS, killing the process with no message."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        fill(disk, leave=64 << 10)
        with pytest.raises(OSError) as saved:
            save_npy_atomic(disk / "a.npy", np.zeros((1000, 384), np.float32))
        assert saved.value.errno == errno.ENOSPC and saved.value.filename == str(disk / "a.npy")
        with pytest.raises(OSError) as mapped:
            new_memmap(disk / "b.f32", np.float32, (1000, 384))  # before: a SIGBUS on the first write
        assert mapped.value.errno == errno.ENOSPC and mapped.value.filename == str(disk / "b.f32")


@pytest.mark.slow
def test_a_run_the_disk_cannot_hold_is_one_line_with_no_resume_hint_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """51.7: exit 70 and "run the same command to resume" though the run's folder was removed."""
    ids, texts = make_texts(300, seed=7)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    with tmpfs(tmp_path / "disk", "2m") as disk:
        fill(disk, leave=40 << 10)
        said = _one_line(
            run_cli("run", str(corpus), "--store", str(disk / "store"), "--chunk-size", "20"), 11
        )
    assert "No space left on device writing" in said and "nothing of it was kept" in said
    assert "resume" not in said and "finished chunk" not in said


@pytest.mark.slow
def test_assembly_on_a_nearly_full_disk_is_one_line_and_resumes_once_there_is_room(tmp_path: Path) -> None:
    """51.8: with ~2 MiB free when assembly starts, the process died of SIGBUS (exit 135) on every
    retry; now exit 11 in one line, and once room is made the same command publishes the result."""
    with tmpfs(tmp_path / "disk", "40m") as disk:
        layout = write_ragged_run(disk / "store", "sparse", rows=400, chunk_size=100, entries=4000, dim=30522)
        filler = fill(disk, leave=2 << 20)
        said = _one_line(run_cli("assemble", layout.run_id, "--store", str(layout.store)), EXIT_STORAGE)
        assert "No space left on device writing" in said and "run the same command" in said
        assert not layout.result.exists()
        filler.unlink()
        done = run_cli("assemble", layout.run_id, "--store", str(layout.store))
        assert done.returncode == 0, done.stderr
        assert run_cli("assemble", layout.run_id, "--store", str(layout.store), "--verify").returncode == 0


@pytest.mark.slow
def test_clean_frees_a_full_store(tmp_path: Path) -> None:
    """51.9: `chunkq clean RUN` failed writing its lock ("No space left on device writing
    .../owner.json") on the full disk it was meant to free."""
    with tmpfs(tmp_path / "disk", "2m") as disk:
        store = disk / "store"
        for run_id in ("a", "b"):
            assemble(Run.of(write_encoded_run(store, run_id, 200, 50, 64)))
        fill(disk)
        freed = run_cli("clean", "a", "--store", str(store), "--outputs-only")
        assert freed.returncode == 0 and "freed" in freed.stdout, freed.stderr
        gone = run_cli("clean", "b", "--store", str(store))
        assert gone.returncode == 0 and "freed" in gone.stdout, gone.stderr
        assert not (store / "runs" / "b").exists() and not RunLayout(store, "a").owner.exists()


@pytest.mark.slow
def test_a_truncated_manifest_is_one_line_in_every_command_and_clean_removes_the_run(tmp_path: Path) -> None:
    """51.10: runs, status, export, assemble --verify and clean all exit 70 (JSONDecodeError), and one
    damaged run broke `chunkq runs` for the whole store."""
    store = tmp_path / "store"
    for run_id in ("good", "bad"):
        assemble(Run.of(write_encoded_run(store, run_id, 20, 10, 4)))
    manifest = RunLayout(store, "bad").manifest
    manifest.write_bytes(manifest.read_bytes()[:100])
    ids, texts = make_texts(3, seed=1)
    corpus = write_corpus(tmp_path / "c.jsonl", ids, texts, "jsonl")
    listed = run_cli("runs", "--store", str(store))
    assert listed.returncode == 0, listed.stderr
    states = {line.split()[0]: line.split()[1:3] for line in listed.stdout.splitlines()[1:]}
    assert states == {"good": ["published", "20/20"], "bad": ["damaged", "manifest"]}
    for args in (
        ["status", "bad"],
        ["export", "bad", "--out", str(tmp_path / "x.parquet")],
        ["assemble", "bad", "--verify"],
        ["report", "bad"],
        ["clean", "bad", "--outputs-only"],
        ["run", str(corpus), "--run-id", "bad"],
    ):
        said = _one_line(run_cli(*args, "--store", str(store)), EXIT_ASSEMBLY)
        assert said == (
            f"chunkq: error: run bad: {manifest} is damaged (not JSON: Unterminated string starting "
            "at: line 4 column 18 (char 61)); the run cannot be read: `chunkq clean bad` removes it, "
            "and the command that made it starts it again"
        ), args
    cleaned = run_cli("clean", "bad", "--store", str(store))
    assert cleaned.returncode == 0, cleaned.stderr
    assert [p.name for p in (store / "runs").iterdir()] == ["good"]
    assert run_cli("status", "good", "--store", str(store)).returncode == 0


@pytest.mark.slow
def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    """Issue 63.5: LanceDB exited 6 with a Rust source path, FAISS left its half-written index, and
    a Parquet file's full disk said "the store keeps every finished chunk: run the same command to
    resume" of an export. Each is now exit 11, one line about the export, nothing of it left."""
    store = tmp_path / "store"
    assemble(Run.of(write_encoded_run(store, "big", 4000, 1000, 64, seed=2)))
    with tmpfs(tmp_path / "disk", "2m") as disk:
        fill(disk, leave=200 << 10)
        targets = {
            "lancedb": ["--to", f"lancedb://{disk}/db/docs"],
            "faiss": ["--to", f"faiss:{disk}/docs.faiss"],
            "parquet": ["--format", "parquet", "--out", str(disk / "docs.parquet")],
            "npy": ["--format", "npy", "--out", str(disk / "docs.npy")],
        }
        for name, args in targets.items():
            said = _one_line(run_cli("export", "big", "--store", str(store), *args), EXIT_STORAGE)
            assert "No space left on device" in said and "run the same export again" in said, (name, said)
            assert ".rs" not in said and "finished chunk" not in said and "resume" not in said, (name, said)
            left = sorted(p.name for p in disk.iterdir() if p.name not in ("filler", "db"))
            assert left == [], (name, left)
        tables = sorted(p.name for p in (disk / "db").iterdir() if p.suffix == ".lance")
        assert tables == []  # the table the export created, empty, went with it


def test_a_result_damaged_in_place_is_damaged_in_status_and_runs(tmp_path: Path) -> None:
    """Issue 63.5: a byte changed inside embeddings.npy (its size and header as they were) was
    "published" to status and runs; only export and assemble --verify noticed. A result this small
    is read whole at every look."""
    import json

    store = tmp_path / "store"
    layout = write_encoded_run(store, "hit", 300, 100, 16, seed=4)
    assemble(Run.of(layout))
    looked = run_cli("status", "hit", "--store", str(store), forks=False)
    assert "result published in" in looked.stdout and "every byte checked" in looked.stdout, looked.stdout
    assert looked.returncode == 0
    path = layout.result / "embeddings.npy"
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))
    status = run_cli("status", "hit", "--store", str(store), forks=False)
    assert "is DAMAGED" in status.stdout and "encodes its chunks again" in status.stdout, status.stdout
    assert status.returncode == 5, status.returncode
    looked = run_cli("status", "hit", "--store", str(store), "--json", forks=False)
    as_json = json.loads(looked.stdout)
    assert as_json["result_checked"]["every_byte"] and as_json["result_checked"]["problems"]
    assert looked.returncode == 5
    (listed,) = json.loads(run_cli("runs", "--store", str(store), "--json", forks=False).stdout)
    assert listed["state"] == "damaged result", listed


def test_a_truncated_ids_file_is_named_not_the_embeddings(tmp_path: Path) -> None:
    """Issue 63.5: ids.jsonl cut short was reported as "embeddings.npy ends before its row 3000"."""
    from chunkq.supervisor.result.reader import result_problems

    layout = write_encoded_run(tmp_path / "store", "cut", 300, 100, 16, seed=5)
    assemble(Run.of(layout))
    ids = layout.result / "ids.jsonl"
    lines = ids.read_bytes().splitlines(keepends=True)
    ids.write_bytes(b"".join(lines[:120]) + lines[120][:3])  # 120 whole lines, the 121st cut
    problems = result_problems(Run.of(layout))
    assert problems == ["ids.jsonl ends before its row 121"], problems
