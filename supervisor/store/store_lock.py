"""One owner per run, and per embedded server: a lock file in the store, whatever Redis each uses.

The supervisor's Redis lock (``lock.py``) lives in the run's Redis: two ``chunkq run`` of one run
each start their own embedded server and never see each other's (seen: two servers appending to
one append-only file, 43 encodes for 25 chunks). This lock lives in the store they share.

The file names its holder (pid, host, start time, a random token). A thread renews it (its mtime)
every RENEW_SECONDS for as long as it is held, whatever the holder is busy with. It is stale, and
taken over with a warning, when its holder on this host is gone (or its pid now belongs to a younger
process); a live holder on this host is never stale, however old the file. A holder on another host
is taken over only when the file has not been renewed for STALE_SECONDS. A holder that was paused
(SIGSTOP, a frozen VM) while another host took over finds someone else's token when it wakes: it
never renews or removes that lock, and ``check`` (the fencing test before anything is published)
raises LockLostError. On a filesystem the file is created exclusively; an object store has no
exclusive create, so there two owners starting in the same second could both win (documented in docs/runs.md).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import socket
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

from chunkq.jobs.contract.run_files import atomic_write_json, read_json
from chunkq.jobs.contract.storage import is_local, private_dirs
from chunkq.supervisor.store.run_lock import RunLockedError

log = logging.getLogger(__name__)


class LockLostError(RunLockedError):
    """Another process took the lock over while this one was paused; it must not publish anything."""


STALE_SECONDS = 60.0  # a lock not renewed for this long belongs to a holder that died elsewhere
RENEW_SECONDS = 10.0
WAIT_POLL_SECONDS = 0.5
WAIT_HINT = "run the same command with --wait"  # the commands that take an owner's lock have --wait


class StoreLock:
    """``acquire`` / ``renew`` / ``release`` of one owner file; ``what`` says what it guards."""

    def __init__(
        self, path: Path, what: str, blank_on_full_disk: bool = False, wait_hint: str = WAIT_HINT
    ) -> None:
        """``blank_on_full_disk``: on a full disk, hold the lock as an empty file (for a command that
        frees space, which must work then) rather than fail. ``wait_hint``: how the command that
        holds this lock can be told to wait (a refusal's last words)."""
        self.path, self.what, self.wait_hint = path, what, wait_hint
        self.blank_on_full_disk = blank_on_full_disk
        self.blank: int | None = None  # the inode of the empty file held on a full disk
        self.token = secrets.token_hex(8)
        self.held = False
        self.lost = ""  # whose lock we found in place of ours, once it happened
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self.took_over: str = ""  # whose stale lock acquire() took over, described, or ""

    def _mine(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started_at": datetime.now(UTC).isoformat(),
            "process_started": psutil.Process().create_time(),
            "token": self.token,
        }

    def _create(self) -> bool:
        """Create the file if nobody holds it; True when it is ours."""
        data = (json.dumps(self._mine(), indent=2) + "\n").encode()
        if is_local(self.path):
            private_dirs(self.path.parent)
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                return False
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(data)
            except OSError as exc:
                if exc.errno == errno.ENOSPC and self.blank_on_full_disk:
                    return self._hold_blank()
                self.path.unlink(missing_ok=True)  # a half-written lock would read as a stranger's
                exc.filename = exc.filename or str(self.path)  # a full disk names the file
                raise
            return True
        if self.path.exists():
            return False
        atomic_write_json(self.path, json.loads(data))
        return bool(read_json(self.path).get("token") == self.token)

    def _hold_blank(self) -> bool:
        """A full disk took the holder's words but not the file (``chunkq clean``, the
        command that frees space, could not start): the empty file, created exclusively, is the lock.
        Others read it as held until it is STALE_SECONDS old; it is ours while its inode is the one
        we created."""
        try:
            with open(self.path, "r+b") as fh:
                fh.truncate(0)  # whatever part of the holder's words reached the disk
            self.blank = os.stat(self.path).st_ino
        except OSError:
            self.path.unlink(missing_ok=True)
            raise
        log.warning("%s: the store is full; holding the lock as an empty %s", self.what, self.path.name)
        return True

    def holder(self) -> dict[str, Any] | None:
        try:
            data: dict[str, Any] = read_json(self.path)
            return data
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # half written or damaged: judged by its age alone

    def live_holder(self) -> dict[str, Any] | None:
        """Who holds the lock now (pid, host, since), or None when nobody does or its holder died."""
        holder = self.holder()
        return holder if holder is not None and not self._stale(holder) else None

    def _stale(self, holder: dict[str, Any]) -> str:
        """Why the holder no longer holds the lock, or "" while it may."""
        if holder.get("host") == socket.gethostname() and holder.get("pid"):
            try:
                proc = psutil.Process(int(holder["pid"]))
                if proc.status() == psutil.STATUS_ZOMBIE:  # killed, not yet reaped (the hostile pass)
                    return f"pid {holder['pid']} has exited"
                if proc.create_time() > float(holder.get("process_started", 0)) + 1:
                    return f"pid {holder['pid']} now belongs to another process"
                return ""  # alive on this host: paused or busy, never stale, however old the file
            except psutil.NoSuchProcess:
                return f"pid {holder['pid']} has exited"
            except (psutil.Error, ValueError, TypeError):
                pass
        try:
            age = time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return "it is gone"
        if age > STALE_SECONDS:
            return f"not renewed for {age:.0f} s"
        return ""

    def acquire(self, wait: bool = False) -> None:
        """Take the lock; without ``wait``, refuse at once naming its holder."""
        announced = False
        self._a_file_or_nothing()
        while not self._create():
            holder = self.holder()
            if holder is None:
                continue  # released between our try and our look
            why = self._stale(holder)
            if why:
                log.warning("%s: taking over the lock of %s (%s)", self.what, _describe(holder), why)
                self.took_over = f"{_describe(holder)} ({why})"
                self.path.unlink(missing_ok=True)
                continue
            if not wait:
                if not holder:  # its words unreadable: judged by its age alone
                    raise RunLockedError(
                        f"{self.what}: its lock file {self.path} cannot be read (half written, or "
                        f"damaged); it is taken over once it is {STALE_SECONDS:.0f} s old: run the same "
                        "command again then, or remove the file if no chunkq process uses the run"
                    )
                who = _describe(holder)
                raise RunLockedError(
                    f"{self.what} is in use by {who}; wait for it to finish, or {self.wait_hint}"
                )
            if not announced:
                log.warning("%s is in use by %s; waiting for it", self.what, _describe(holder))
                announced = True
            time.sleep(WAIT_POLL_SECONDS)
        self.held = True
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_while_held, name="lock-renewer", daemon=True)
        self._renewer.start()

    def _a_file_or_nothing(self) -> None:
        """RunLockedError for a lock path that is no lock file: a folder waited a minute, then failed
        as an internal error; a link to nothing made the wait spin silently."""
        if not is_local(self.path):
            return
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            kind = "a link to nothing" if os.path.islink(self.path) else "not a file"
            raise RunLockedError(
                f"{self.what}: its lock file {self.path} is {kind}; remove it, if no chunkq process "
                "uses it, and run the same command again"
            )

    def _renew_while_held(self) -> None:
        while not self._stop.wait(RENEW_SECONDS):
            if not self._renew():
                return

    def _still_ours(self) -> bool:
        """Whether the lock file still carries our token; once it does not, ``lost`` says whose it is."""
        if self.lost:
            return False
        if self._blank_is_ours():
            return True
        holder = self.holder()
        if (holder or {}).get("token") == self.token:
            return True
        self.lost = _describe(holder) if holder else "nobody (the lock file is gone)"
        log.error("%s: the lock is no longer ours; it is held by %s", self.what, self.lost)
        return False

    def _renew(self) -> bool:
        """Show the lock is alive (its mtime) if it is still ours; False once it is not."""
        if not self._still_ours():
            return False
        try:
            if is_local(self.path):
                os.utime(self.path)
            else:
                self.path.touch()
        except OSError as exc:
            log.warning("%s: cannot renew the lock (%s)", self.what, exc)
        return True

    def check(self) -> None:
        """The fencing test: raise LockLostError unless the lock file still carries our token.
        Called before anything is published, and on each of the supervisor's looks; renewing is
        the thread's, so a look only reads."""
        if self.held and not self._still_ours():
            raise LockLostError(
                f"{self.what}: another process took the lock over while this one was paused or cut "
                f"off ({self.lost}); this one stops without publishing anything"
            )

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        if self.held and (self._blank_is_ours() or (self.holder() or {}).get("token") == self.token):
            self.path.unlink(missing_ok=True)
        self.held = False

    def _blank_is_ours(self) -> bool:
        """Whether the empty file held on a full disk is still the one we created."""
        try:
            return self.blank is not None and os.stat(self.path).st_ino == self.blank
        except OSError:
            return False

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "an unreadable lock file"
    return f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('started_at')}"
