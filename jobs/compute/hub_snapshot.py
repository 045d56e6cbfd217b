"""Whether a Hugging Face cache snapshot still holds the hub's files.

A snapshot is ``<repo>/snapshots/<commit>/``: every file a link to ``<repo>/blobs/<name>``, where
the name is the file's hash as the hub computed it: git's blob sha1 for a small file (configs,
tokenizer, modules.json), the sha256 of the bytes for a file kept in LFS (weights). The commit
names the files only while each is still the blob its link names. An editor or ``sed -i`` replaces
the link with a file; writing through the link (``save_pretrained`` into the snapshot) changes the
blob under its name. Both are seen here: a file that is not a link into ``blobs/``, or a blob whose
bytes no longer give its name. Checking reads every byte once, as a local folder's identity does;
the caller keeps the answer for as long as the files' stamps hold.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_SHA1_HEX, _SHA256_HEX = 40, 64


def intact(snapshot: Path, files: list[tuple[str, Path]]) -> bool:
    """Every file of ``snapshot`` is a link into its repository's ``blobs/`` whose bytes give the
    blob's name."""
    blobs = os.path.realpath(snapshot.parent.parent / "blobs")
    for _name, path in files:
        if not path.is_symlink():
            return False
        target = os.path.realpath(path)
        if os.path.dirname(target) != blobs:
            return False
        if _blob_hash(Path(target), len(os.path.basename(target))) != os.path.basename(target):
            return False
    return True


def _blob_hash(path: Path, length: int) -> str | None:
    """The hash a blob of this name length is named by; None for a name of neither length."""
    if length == _SHA1_HEX:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(b"blob %d\0" % path.stat().st_size)
    elif length == _SHA256_HEX:
        digest = hashlib.sha256()
    else:
        return None
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def listing(snapshot: Path, files: list[tuple[str, Path]]) -> str:
    """A digest of which blob each file of the snapshot is (its name, its blob's name)."""
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(f"{name}\0{os.path.basename(os.path.realpath(path))}\n".encode())
    return digest.hexdigest()
