"""What a model is, as bytes: the identity a run records at submit, that every worker checks the model
it loaded against, and that keys the vector cache. Never the model's name: a folder's weights can be
replaced under the same path, and two paths can hold the same files.

- A local folder: the sha256 of every file's relative name and bytes, the folder walked through
  links (a linked file or subfolder is read where it points, as a load reads it), dot-named files
  included (``modules.json`` may name a module folder ``.pooling``). Left out only
  ``.git``: version control's records, which no load opens and ``git status`` rewrites; a path a
  load would read under it is refused (``model_reads``).
- A model in the Hugging Face cache: its snapshot's commit, which the hub derives from the files,
  while every file of the snapshot is still the blob its link names (``hub_snapshot``); a snapshot
  edited in place is identified by its bytes instead, as a folder is.
- What the load reads beyond those files: a path its configs name outside the folder is refused
  before the run (``model_reads``); the code a ``--trust-remote-code`` model runs is listed by
  watching its load (``model_code``) and added as ``+code:<digest>``.

A folder is hashed once per process for as long as its files are unchanged; "unchanged" is each
file's device, inode, size, modification and change time (``FolderStamp``). The change time cannot
be set back by a user, and a file replaced under its name has another inode, so a copy that keeps
the old size and modification time (``cp -p``, ``rsync -t``) is still seen.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chunkq.jobs.compute import hub_snapshot, model_code, model_reads
from chunkq.jobs.compute.model_refs import model_folder, resolve_model
from chunkq.jobs.contract.errors import ConfigError

if TYPE_CHECKING:
    from chunkq.jobs.compute.models import LoadedModel
    from chunkq.jobs.contract.specs import ChunkSpec

log = logging.getLogger(__name__)

# (relative name, device, inode, size, mtime ns, ctime ns) of every file, and the folder's real path.
FolderStamp = tuple[Any, ...]


@dataclass(frozen=True)
class Identity:
    """A model's identity and the stamp of the files it was read from (to notice a change later)."""

    value: str  # "files:<sha256>" or "hub:<repo>@<commit>", then "+code:<digest>" for code it brings
    stamp: FolderStamp
    code: Any = None  # jobs.compute.model_code.Listing: what a load of code it brings read


def model_files(folder: Path) -> list[tuple[str, Path]]:
    """Every file a load may read, by name relative to ``folder``, sorted; linked folders followed
    under every name that reaches them (a link that points at one of two checkpoints is hashed as
    what it points at now), a link back up to a folder above it skipped (it would never end);
    ``.git`` folders left out."""
    found: list[tuple[str, Path]] = []
    above: dict[str, set[str]] = {str(folder): {os.path.realpath(folder)}}
    for top, dirs, files in os.walk(folder, followlinks=True):
        chain = above.get(top, {os.path.realpath(top)})
        kept = []
        for name in sorted(d for d in dirs if d not in model_reads.UNREAD_FOLDERS):
            real = os.path.realpath(os.path.join(top, name))
            if real not in chain:
                above[os.path.join(top, name)] = chain | {real}
                kept.append(name)
        dirs[:] = kept
        for name in files:
            path = Path(top) / name
            if path.is_file():
                found.append((path.relative_to(folder).as_posix(), path))
    return sorted(found)


def folder_stamp(folder: Path, files: list[tuple[str, Path]]) -> FolderStamp:
    """What changes whenever any byte of ``files`` can have changed (see the module's docstring)."""
    stamps = []
    for name, path in files:
        st = path.stat()  # through links: the file a load reads
        stamps.append((name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return (os.path.realpath(folder), *stamps)


_DIGESTS: dict[FolderStamp, str] = {}  # a folder's identity, for as long as its stamp holds


def _field(data: bytes) -> bytes:
    """A field as the digest takes it: its length, then its bytes (a name and a file's bytes can
    then never be read as another split of the same stream)."""
    return len(data).to_bytes(8, "little") + data


def _digest(files: list[tuple[str, Path]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(_field(name.encode("utf-8", "surrogateescape")))
        digest.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return f"files:{digest.hexdigest()}"


def identify(ref: str, revision: str | None = None) -> Identity | None:
    """``ref``'s identity on this host, or None when its files are not here (a hub model not in the
    cache: the workers fetch it, and each records what it loaded). ConfigError, in one line, when
    its load would read what the identity cannot cover."""
    folder, commit = model_folder(ref, revision)
    if folder is None:
        return None
    files = model_files(folder)
    stamp = folder_stamp(folder, files)
    if stamp not in _DIGESTS:
        model_reads.check(ref, folder, files)  # before the bytes: a refusal costs no hashing
        if commit and hub_snapshot.intact(folder, files):
            # The commit, and which blob each file of the snapshot is: a download completed later
            # under the same commit, or a link moved to another blob, is another listing.
            value = f"hub:{resolve_model(ref)}@{commit}:{hub_snapshot.listing(folder, files)[:16]}"
        else:
            if commit:
                log.warning(
                    "model %s: its snapshot %s no longer holds the hub's files (edited in place); "
                    "identified by its bytes, so nothing encoded from the hub's files is reused",
                    ref,
                    commit[:12],
                )
            value = _digest(files)
        if folder_stamp(folder, model_files(folder)) != stamp:
            # Written to while it was read: neither the old bytes nor the new. A run must not be
            # fixed to a half-copied folder.
            raise ConfigError(f"model {ref}: its files changed while chunkq read them; try again")
        _DIGESTS[stamp] = value
    return Identity(_DIGESTS[stamp], stamp)


def covered_paths(ref: str, revision: str | None = None) -> set[str]:
    """The real paths of the files the identity hashes (what a load may read without a listing)."""
    folder, _ = model_folder(ref, revision)
    return set() if folder is None else {os.path.realpath(path) for _, path in model_files(folder)}


def current_stamp(ref: str, revision: str | None = None) -> FolderStamp | None:
    """The stamp ``ref``'s files have now (None: not on this host); cheap: a stat per file."""
    folder, _ = model_folder(ref, revision)
    return None if folder is None else folder_stamp(folder, model_files(folder))


def model_identity(ref: str, revision: str | None = None) -> str | None:
    """``identify``'s value alone: what a manifest and the cache record."""
    found = identify(ref, revision)
    return None if found is None else found.value


def short(identity: str | None) -> str:
    """An identity as a message shows it: its kind and 12 characters of its hash or commit (with a
    hub snapshot's listing and the module code's digest, where they are part of it)."""
    if identity is None:
        return "unknown (its files were not on the submitting host)"
    files, *code = identity.split("+")
    if files.startswith("files:"):
        shown = files[: len("files:") + 12]
    else:
        name, _, rest = files.partition("@")
        commit, _, listing = rest.partition(":")
        shown = f"{name}@{commit[:12]}" + (f" (files {listing[:8]})" if listing else "")
    return shown + "".join(
        f" + its code {c.removeprefix('code:')[:8]}" if c.startswith("code:") else f" + {c}" for c in code
    )


def check_loaded(
    chunk: ChunkSpec, expected: str | None, loaded: LoadedModel, run_code: Any = None, run_canary: Any = None
) -> str | None:
    """The identity an output of ``loaded`` records; ConfigError unless ``loaded`` was built from the
    bytes the run was submitted with (``expected``, the manifest's; None: not known at submit) and,
    for a model that brings its own code, runs the code the run's load read (``run_code``, the
    manifest's listing). A run's rows come from one model."""
    mine = loaded.identity_value
    _same_behaviour(chunk, loaded, run_canary)
    if expected is None or mine == expected:
        return mine
    same_files = mine is not None and model_code.files_part(mine) == model_code.files_part(expected)
    if same_files and model_code.accepted_unidentified(expected):
        return expected  # the run accepted code it cannot identify: its files are what it compares
    if same_files and loaded.code is not None:
        differs = loaded.code.differences(run_code)
        shown = "; ".join(differs[:3]) + (f" (and {len(differs) - 3} more)" if len(differs) > 3 else "")
        raise ConfigError(
            f"chunk {chunk.job_id}: model {chunk.model} runs other code on this host than run "
            f"{chunk.run_id} was submitted with ({shown or 'its listing differs'}); refused rather than "
            f"mix two codes' rows. Give this host the run's code, or start the run again with the code "
            f"as it is (`chunkq clean {chunk.run_id}`, then submit or run again)"
        )
    raise ConfigError(
        f"chunk {chunk.job_id}: model {chunk.model} on this host is {short(mine)}, but run {chunk.run_id} "
        f"was submitted with {short(expected)}; refused rather than mix two models' rows. Give this "
        f"host the run's files, or start the run again with the model as it is (`chunkq clean "
        f"{chunk.run_id}`, then submit or run again)"
    )


def _same_behaviour(chunk: ChunkSpec, loaded: LoadedModel, run_canary: Any) -> None:
    """ConfigError where a model that brings its own code gives this host's load other vectors of
    the canary texts than the submit's did (on another device too: cosine ``SAME_BEHAVIOUR_COSINE``):
    its code read something here that chunkq cannot list (an environment variable, a file its
    native code opened), and this host's rows would not be the run's."""
    canary = loaded.code.canary if loaded.code is not None else None
    moved = model_code.canary_difference(canary, run_canary)
    if moved is None or moved[1] >= model_code.SAME_BEHAVIOUR_COSINE:
        return
    raise ConfigError(
        f"chunk {chunk.job_id}: model {chunk.model} behaves differently on this host than when run "
        f"{chunk.run_id} was submitted (chunkq's canary texts: cosine {moved[1]:.4f}), though the code "
        "it lists is the same: an environment variable or a file its native code reads differs here; "
        "refused rather than mix two behaviours' rows. Give this host the submitting host's "
        "environment, or start the run again"
    )
