"""A model folder's digest remembered across processes (``jobs.compute.digest_memo``): each new
process (a ``chunkq run``, its pool's fork server) read every byte of the weights again. Remembered
only under the same stamp as within a process, and only once the files have settled; the process's
own memory is cleared between steps here, so what carries the digest is the file on disk alone."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from chunkq.jobs.compute import digest_memo, model_identity
from chunkq.jobs.compute.model_identity import identify
from tests.tiny_models import tokenizer_source


def bundled_copy(folder: Path) -> Path:
    """The bundled model's folder with 1 MiB of other bytes as its weights: what the identity reads
    is the same, the hashing 90 times shorter (nothing here loads it)."""
    shutil.copytree(tokenizer_source(), folder, ignore=shutil.ignore_patterns("model.safetensors"))
    (folder / "model.safetensors").write_bytes(random.Random(0).randbytes(1 << 20))
    return folder


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "chunkq" / "model-digests"


def _later(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """The clock ``identify`` reads, ``seconds`` ahead: the files were written that long ago."""
    clock = SimpleNamespace(time_ns=lambda: time.time_ns() + int(seconds * 1e9))
    monkeypatch.setattr(model_identity, "time", clock)


def _fresh_identity(ref: str) -> str:
    """``ref``'s identity as a new process finds it: nothing of this one's memory."""
    model_identity._DIGESTS.clear()
    found = identify(ref)
    assert found is not None
    return found.value


def _unhashable(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(files: object) -> str:
        raise AssertionError("read the model's bytes again")

    monkeypatch.setattr(model_identity, "_digest", refuse)


def test_a_settled_models_digest_is_remembered_and_a_fresh_ones_is_not(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = str(bundled_copy(tmp_path / "model"))
    identity = _fresh_identity(model)
    assert not cache.exists() or not list(cache.iterdir())  # written just now: may change within its tick
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    assert _fresh_identity(model) == identity
    assert len(list(cache.glob("*.json"))) == 1
    _unhashable(monkeypatch)
    assert _fresh_identity(model) == identity  # recalled, not read


def test_a_file_rewritten_with_its_size_and_modification_time_is_hashed_again(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cp -p`` over the weights keeps their size and modification time; their change time moves,
    so the remembered digest is not this stamp's."""
    folder = bundled_copy(tmp_path / "model")
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    identity = _fresh_identity(str(folder))
    weights = folder / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    changed = _fresh_identity(str(folder))
    assert changed != identity
    _unhashable(monkeypatch)
    assert _fresh_identity(str(folder)) == changed
    assert len(list(cache.glob("*.json"))) == 2


def test_an_entry_that_is_not_the_stamps_is_not_believed(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A damaged entry, one for another stamp under this name, or a value that is no digest: the
    bytes are read again, and the entry rewritten."""
    model = str(bundled_copy(tmp_path / "model"))
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    identity = _fresh_identity(model)
    (entry,) = cache.glob("*.json")
    good = json.loads(entry.read_text())
    other = [*good["stamp"][:2], *good["stamp"][3:]]  # [0]: the host, [1]: the folder
    for bad in ("{", json.dumps({**good, "stamp": other}), json.dumps({**good, "digest": "files:0"})):
        entry.write_text(bad)
        assert _fresh_identity(model) == identity
        assert json.loads(entry.read_text()) == good


def test_a_cache_that_cannot_be_written_costs_the_hashing_not_the_identity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cache").write_text("a file where the cache folder would be")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = str(bundled_copy(tmp_path / "model"))
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    identity = _fresh_identity(model)
    assert identity.startswith("files:") and _fresh_identity(model) == identity


def test_another_host_sharing_the_home_folder_hashes_its_own_files(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster's nodes often share one home folder, and their local disks number devices and
    inodes alike: one node's entry is not another's."""
    model = str(bundled_copy(tmp_path / "model"))
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    identity = _fresh_identity(model)
    monkeypatch.setattr(digest_memo.socket, "gethostname", lambda: "another-node")
    _unhashable(monkeypatch)
    with pytest.raises(AssertionError, match="read the model's bytes again"):
        _fresh_identity(model)
    assert identity.startswith("files:")


def test_a_host_without_a_cache_folder_hashes_and_writes_nothing_where_it_was_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative XDG_CACHE_HOME is ignored (the XDG spec), and a user with no home folder (a
    container under an arbitrary uid) has no cache: nothing lands in the working directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", "relative-home")
    monkeypatch.chdir(tmp_path)
    model = str(bundled_copy(tmp_path / "model"))
    _later(monkeypatch, digest_memo.SETTLED_SECONDS + 1)
    identity = _fresh_identity(model)
    assert identity.startswith("files:") and _fresh_identity(model) == identity
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
