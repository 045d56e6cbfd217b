"""Assembly: a verified, ordered result published whole, or a clear error naming every problem."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from chunkq.jobs.compute.model_refs import BUNDLED_MODEL
from chunkq.jobs.contract.errors import AssemblyError
from chunkq.jobs.contract.manifest import load_manifest
from chunkq.jobs.contract.run import Run
from chunkq.jobs.contract.run_files import RunLayout, file_sha256
from chunkq.jobs.embed import embed_chunk
from chunkq.supervisor.result.assemble import assemble
from tests.helpers import max_abs_diff, run_cli


def _reencode(layout: RunLayout, *indices: int) -> None:
    manifest = load_manifest(layout)
    for index in indices:
        embed_chunk(manifest.chunk_spec(layout.store, index).to_dict())


@pytest.mark.slow
def test_result_is_ordered_and_equals_plain_encode(encoded_run: Any, reference_model: Any) -> None:
    layout, ids, texts = encoded_run
    result = assemble(Run.of(layout))
    matrix = np.load(layout.result / "embeddings.npy")
    assert matrix.shape == (47, 384) and matrix.dtype == np.float32
    assert max_abs_diff(matrix, reference_model.encode(texts)) <= 1e-5
    lines = (layout.result / "ids.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == ids
    assert result["rows"] == 47 and result["dim"] == 384 and len(result["embeddings_sha256"]) == 64
    assert sorted(p.name for p in layout.result.iterdir()) == ["embeddings.npy", "ids.jsonl", "manifest.json"]
    assert not list(layout.root.glob(".result.tmp-*"))
    assert assemble(Run.of(layout)) == result  # assembling again returns the published result


@pytest.mark.slow
def test_missing_and_corrupt_chunks_are_all_named(encoded_run: Any) -> None:
    layout, _, _ = encoded_run
    layout.output_npy(1).unlink()
    layout.output_meta(3).unlink()
    npy = layout.output_npy(4)
    raw = bytearray(npy.read_bytes())
    raw[200] ^= 0x01
    npy.write_bytes(bytes(raw))
    with pytest.raises(AssemblyError) as caught:
        assemble(Run.of(layout))
    moved = f"; moved to {layout.damaged_outputs}, the next run encodes it again"
    assert caught.value.problems == [
        "chunk 1 (rows 10-19): 000001.npy missing" + moved,
        "chunk 3 (rows 30-39): output metadata missing" + moved,
        "chunk 4 (rows 40-46): 000004.npy checksum does not match its metadata" + moved,
    ]
    assert not layout.result.exists()
    assert layout.done_chunks() == {0, 2}  # set aside: none of them counts as done any more
    _reencode(layout, 1, 3, 4)
    assert assemble(Run.of(layout))["rows"] == 47


@pytest.mark.slow
def test_cli_assemble_fails_with_named_chunk_and_exit_code(encoded_run: Any) -> None:
    layout, _, _ = encoded_run
    layout.output_npy(2).write_bytes(b"\x93NUMPY garbage")
    result = run_cli("assemble", layout.run_id, "--store", str(layout.store))
    assert result.returncode == 5
    assert "chunk 2 (rows 20-29): 000002.npy checksum does not match" in result.stderr
    assert not layout.result.exists()


@pytest.mark.slow
def test_a_lone_output_of_another_dimension_is_set_aside_not_the_healthy_chunks(encoded_run: Any) -> None:
    """Issue 21.6: one self-consistent 383-dimension output (.npy and .json agree) among 384s."""
    layout, _, _ = encoded_run
    meta = json.loads(layout.output_meta(2).read_text())
    narrow = np.zeros((10, 383), dtype=np.float32)
    np.save(layout.output_npy(2), narrow)
    meta.update(dim=383, sha256=file_sha256(layout.output_npy(2)))
    layout.output_meta(2).write_text(json.dumps(meta))
    with pytest.raises(AssemblyError) as caught:
        assemble(Run.of(layout))
    assert caught.value.problems == [
        "chunk 2 (rows 20-29): dimension 383, while 4 other chunk(s) have 384; "
        f"moved to {layout.damaged_outputs}, the next run encodes it again"
    ]
    assert layout.done_chunks() == {0, 1, 3, 4}
    _reencode(layout, 2)
    assert assemble(Run.of(layout))["dim"] == 384


@pytest.mark.slow
def test_an_output_made_with_other_options_is_never_assembled(encoded_run: Any) -> None:
    """Issue 21.1: an output whose record of what produced it is not the run's manifest."""
    layout, _, _ = encoded_run
    meta = json.loads(layout.output_meta(1).read_text())
    meta["options"] = {**meta["options"], "max_seq_length": 3}
    layout.output_meta(1).write_text(json.dumps(meta))
    with pytest.raises(AssemblyError, match=r"chunk 1 .* produced with options other than the run manifest"):
        assemble(Run.of(layout))
    assert 1 not in layout.done_chunks()


@pytest.mark.slow
def test_verify_checks_the_result_manifest_against_the_runs(encoded_run: Any) -> None:
    """Issue 21.7: result/manifest.json edited to 46 rows and another model, checksums untouched."""
    layout, _, _ = encoded_run
    assemble(Run.of(layout), keep_outputs=True)  # repaired below from the chunk outputs
    store = str(layout.store)
    assert run_cli("assemble", layout.run_id, "--verify", "--store", store).returncode == 0
    path = layout.result / "manifest.json"
    result = json.loads(path.read_text())
    path.write_text(json.dumps({**result, "rows": 46, "model": "someone/else"}))

    verify = run_cli("assemble", layout.run_id, "--verify", "--store", store)
    assert verify.returncode == 5, verify.stderr
    assert "result/manifest.json says model 'someone/else'" in verify.stderr
    assert "says 46 rows" in verify.stderr and "every checksum matches" not in verify.stdout
    runs = run_cli("runs", "--store", store, "--json")
    assert '"published"' not in runs.stdout, runs.stdout
    refused = run_cli("export", layout.run_id, "--store", store, "--out", str(layout.store.parent / "x.npy"))
    assert (
        refused.returncode == 5 and f"`chunkq assemble {layout.run_id}` publishes it again" in refused.stderr
    )

    repaired = run_cli("assemble", layout.run_id, "--store", store)  # what export told the user to do
    assert repaired.returncode == 0, repaired.stderr
    assert json.loads(path.read_text())["model"] == BUNDLED_MODEL
    assert run_cli("assemble", layout.run_id, "--verify", "--store", store).returncode == 0


def test_a_supervisor_that_lost_its_lock_publishes_nothing(encoded_run: Any) -> None:
    """Issue 21.3: the fencing check runs after the result is built, just before it is put in place."""
    from chunkq.supervisor.store.store_lock import LockLostError

    layout, _, _ = encoded_run

    def lost() -> None:
        raise LockLostError("run r: another process took the lock over")

    with pytest.raises(LockLostError):
        assemble(Run.of(layout), fence=lost)
    assert not layout.result.exists() and not list(layout.root.glob(".result.tmp-*"))
    assert assemble(Run.of(layout), fence=lambda: None)["rows"] == 47


def test_assemble_beside_the_run_that_owns_it_says_so_and_its_advice_fits_the_outputs(tmp_path: Any) -> None:
    """A hostile pass: `chunkq assemble` of a run a live `chunkq run` owned listed every chunk it had
    yet to finish as "output metadata missing"; and a damaged result whose run had chunks without an
    output advised `chunkq assemble`, which could not publish it."""
    from chunkq.supervisor.result.published import rebuild_advice
    from chunkq.supervisor.store.store_lock import StoreLock
    from tests.helpers import write_encoded_run

    store = tmp_path / "store"
    layout = write_encoded_run(store, "owned", 40, 10, 4)
    with StoreLock(layout.owner, "run owned") as held:
        held.acquire()
        refused = run_cli("assemble", "owned", "--store", str(store))
    assert refused.returncode == 10, refused.stderr
    assert "run owned is in use by pid" in refused.stderr and "output metadata missing" not in refused.stderr
    assert "`chunkq assemble owned`" in rebuild_advice(layout)  # every chunk has its output
    layout.output_meta(3).unlink()
    layout.output_npy(3).unlink()
    assert rebuild_advice(layout).startswith(
        "some of its chunks have no output: the command that made the run"
    )
