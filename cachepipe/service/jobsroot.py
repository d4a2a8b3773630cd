"""What a daemon keeps in ``jobs.root`` beside the job folders: its lock, and the retention of
the manifests jobs plan from (``root/.manifests``).

One daemon per root. :class:`RootLock` is an ``flock`` on ``root/.daemon`` held for the
daemon's life (the file holds ``"pid host socket"``); a second daemon on the same root (two
``cachepipe serve`` of one configuration with another socket, a new one started while the old
one still drains) is refused at its start, naming the root and the first. Two daemons there
would each give their jobs all of ``jobs.capacity`` (the disk's cap twice over), and each
remove what it thinks no job of its own needs (an emptied job folder the other opens again,
a manifest the other's job plans from). Where the root cannot be locked so (an NFS mount
without a lock daemon: ``ENOLCK``; a filesystem without ``flock``: :data:`NO_LOCKS`) the daemon
starts and says so in a warning: a second daemon there is not refused. :func:`held_by` tells
who holds it, without taking it (``serve --check``).

The lock files are opened for reading and writing: NFS emulates ``flock`` with byte-range
locks (the server's, so a daemon on another host sees them), and refuses an exclusive one on a
descriptor open for reading only (``EBADF``, flock(2); a shared one, as :func:`held_by`'s, needs
only reading). It gives each open its own lock, as ``flock`` does (its owner is the open file,
not the process): two threads' opens exclude each other there too.

Retention. Every manifest given to the daemon (``PUT /v1/manifests``) or listed by it
(``POST /v1/manifests``, node mode's every distributed run) is ``root/.manifests/DIGEST.json.gz``,
outside any job's capacity (tens to hundreds of MB for a large dataset). One is *named* while
a registered job plans from it (its spec's ``catalog``), while a registration of it is under
way, or while a job folder under ``root`` was last registered with it: the daemon notes that
(``root/.manifests/jobs/NAME`` holds the digest, written when the job registers), since the
job registered again after a restart names its manifest by digest and would be refused
without it (409). The others are removed (:func:`unneeded`) once they are older than
``jobs.manifest_grace`` (default a day: a node's ranks list or upload one when their dataset is
made, and register the job at its first iteration, after the model is set up), when a job is
deleted and at the daemon's start, holding :class:`ManifestsLock` exclusively (skipped while a
manifest is written there); each removal is logged at INFO with the digest and why. A job
folder without a note (of a cachepipe before the notes, 2026-12-01, or one that could not be
written; a job registered without a catalog notes an empty one) may plan from any of them: while
there is one, none is removed. A note whose job folder is gone (removed by hand) names nothing
once it is older than the grace too (a dropped job's lanes register it again at once: its drop
renews the note).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..cache.lock import UNKNOWN_OWNER, _locker
from ..wholefiles import NO_LOCKS

__all__ = ["MANIFEST_NAME", "NO_LOCKS", "ManifestsLock", "RootLock", "held_by", "unneeded"]

log = logging.getLogger("cachepipe.service")

LOCK = ".daemon"  # in jobs.root: the daemon's lock (no job is named so: a job name starts with a letter or digit)
MANIFEST_NAME = re.compile(r"([0-9a-f]{32})\.json\.gz")  # root/.manifests/DIGEST.json.gz
MANIFESTS_LOCK = ".lock"  # in root/.manifests: the lock of its writers and of what removes files there; never removed


def unneeded(written: Mapping[str, float], named: Iterable[str], now: float, grace: float) -> list[str]:
    """The digests of the manifests to remove: of ``written`` (digest -> when its file was last
    written, seconds since the epoch), those no job names and written at least ``grace`` seconds
    before ``now``, sorted."""
    keep = set(named)
    return sorted(d for d, when in written.items() if d not in keep and now - when >= grace)


class RootLock:
    """The daemon's lock on ``jobs.root`` (see the module notes).

    Args:
        root: ``jobs.root``.
        socket_path: the daemon's socket, written in the lock file for a second daemon's error.
    """

    def __init__(self, root: Path, socket_path: str) -> None:
        self.root, self.socket_path = root, socket_path
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock (it is held until :meth:`release`, or the process ends).

        Raises:
            OSError: ``EADDRINUSE``, another live daemon holds it (its pid, host and socket
                named); or ``root`` cannot be made or written (permissions, a read-only filesystem).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _holder(fd)
            os.close(fd)
            raise OSError(
                errno.EADDRINUSE,
                f"jobs.root {str(self.root)!r} is in use by another cachepipe daemon ({other}): one daemon per jobs.root "
                "(two would each give their jobs all of jobs.capacity, and remove folders and manifests the other's "
                "jobs use); stop that one first, or give this one another jobs.root",
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_LOCKS:
                raise
            log.warning(
                "jobs.root %s: cannot be locked (%s; an NFS mount without a lock daemon?): a second daemon on it "
                "would not be refused",
                self.root,
                exc.strerror,
            )
            return
        self._fd = fd
        line = f"{os.getpid()} {socket.gethostname()} {self.socket_path}\n".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, line, 0)
            os.fsync(fd)  # on NFS, to the server now: a daemon on another host reads it there (not at our close)
        except OSError as exc:  # a full disk: held all the same, a second daemon is told of the kernel's pid
            log.info("%s: the lock is held without this daemon's pid in it (%s)", path, exc.strerror)

    def release(self) -> None:
        """Empty the lock file and let the lock go (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError as exc:
            log.warning("%s: could not empty the daemon's lock file (%s); released all the same", self.root / LOCK, exc)
        finally:
            os.close(fd)


def _holder(fd: int) -> str:
    """``"pid N on HOST, socket PATH"`` of the daemon that holds the lock file open as ``fd``, as
    its line says; the pid the kernel lists for the lock where it has none; else "another process"."""
    fields = os.pread(fd, 4096, 0).decode(errors="replace").split(maxsplit=2)
    if fields and fields[0].isdigit():
        where = f" on {fields[1]}" if len(fields) > 1 else ""
        return f"pid {fields[0]}{where}" + (f", socket {fields[2].strip()}" if len(fields) > 2 else "")
    pid = _locker(fd)
    return UNKNOWN_OWNER if pid is None else f"pid {pid} on {socket.gethostname()}"


def held_by(root: Path) -> str | None:
    """Who holds the daemon's lock on ``root`` (``"pid N on HOST, socket PATH"``, as a second
    daemon's error names it), told by a shared lock tried without waiting and let go at once (a
    descriptor open for reading does for that, on NFS too; nothing is made); None where no live
    daemon holds it, and where that cannot be told (no lock file, an unreadable one, no locks
    there). A daemon that starts in the very moment the shared lock is held is refused as by
    another process (exit 1; systemd starts it again)."""
    try:
        fd = os.open(root / LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _holder(fd)
    except OSError:  # NO_LOCKS, or another refusal: a check says nothing it cannot tell
        return None
    finally:
        os.close(fd)  # lets the shared lock go, where it was taken
    return None


class ManifestsLock:
    """The lock of ``root/.manifests`` (an open of it; close it, or use it as a context manager).
    Its writers (an upload, a listing) hold it shared (:meth:`share`) while their temporary files
    there are theirs; what removes files there (a killed writer's temporary files, the manifests
    no job names) takes it exclusively, without waiting (:meth:`alone`).

    It is an ``flock`` on the file :data:`MANIFESTS_LOCK` in the folder (made for it, opened for
    reading and writing, so NFS locks it exclusively too: see the module notes; never removed),
    and on the folder itself where that can be locked: a daemon of before 2026-12-01 locks the
    folder only, and beside this one on a root (where the root's lock does not refuse it: a build
    before that lock, a root whose ``.daemon`` cannot be opened) it must see this one's writers,
    and this one its. NFS does not lock a folder exclusively (such a daemon removes nothing there):
    the file's lock alone then.

    Args:
        folder: ``root/.manifests`` (it exists).

    Raises:
        OSError: the folder cannot be opened.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.unopened: OSError | None = None  # why the lock file could not be opened (then it is not locked)
        self._dir = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._file: int | None = None
        try:
            self._file = os.open(folder / MANIFESTS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:  # another user's file, a full disk: a writer's own error says why, if it fails
            self.unopened = exc
        except BaseException:
            os.close(self._dir)
            raise

    def alone(self) -> bool | None:
        """Take the lock exclusively, without waiting: True if taken (no writer, of this daemon or
        of another on the root, is under way), False if one is (nothing is held then). None where
        that cannot be known: the lock file cannot be locked (a mount without locks, :data:`NO_LOCKS`)
        or opened (:attr:`unopened`: another user's file, a full disk).

        Raises:
            OSError: another error of ``flock``.
        """
        if self._file is None:
            return None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                raise
            return None
        try:
            fcntl.flock(self._dir, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a writer of a daemon that locks the folder only
            fcntl.flock(self._file, fcntl.LOCK_UN)
            return False
        except OSError as exc:
            if exc.errno not in NO_LOCKS:
                fcntl.flock(self._file, fcntl.LOCK_UN)
                raise
        return True

    def share(self) -> None:
        """Hold the lock shared, as a writer: waits while it is held exclusively. Where the file or
        the folder cannot be locked (:data:`NO_LOCKS`), that one is not.

        Raises:
            OSError: another error of ``flock``.
        """
        for fd in (self._file, self._dir):
            if fd is None:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
            except OSError as exc:
                if exc.errno not in NO_LOCKS:
                    raise

    def close(self) -> None:
        """Let the lock go (closes both descriptors)."""
        if self._file is not None:
            os.close(self._file)
        os.close(self._dir)

    def __enter__(self) -> ManifestsLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
