"""What a daemon keeps in ``jobs.root`` beside the job folders: its lock, and the retention of
the manifests jobs plan from (``root/.manifests``).

One daemon per root. :class:`RootLock` is an ``flock`` on ``root/.daemon`` held for the
daemon's life (the file holds ``"pid host socket"``); a second daemon on the same root (two
``cachepipe serve`` of one configuration with another socket, a new one started while the old
one still drains) is refused at its start, naming the root and the first. Two daemons there
would each give their jobs all of ``jobs.capacity`` (the disk's cap twice over), and each
remove what it thinks no job of its own needs (an emptied job folder the other opens again,
a manifest the other's job plans from). Where the root cannot be locked so (an NFS mount
without a lock daemon: ``ENOLCK``; a filesystem without ``flock``) the daemon starts and says
so in a warning: a second daemon there is not refused.

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
deleted and at the daemon's start; each removal is logged at INFO with the digest and why. A job
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

__all__ = ["MANIFEST_NAME", "RootLock", "unneeded"]

log = logging.getLogger("cachepipe.service")

LOCK = ".daemon"  # in jobs.root: the daemon's lock (no job is named so: a job name starts with a letter or digit)
MANIFEST_NAME = re.compile(r"([0-9a-f]{32})\.json\.gz")  # root/.manifests/DIGEST.json.gz
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)


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
            if exc.errno not in _NO_LOCKS:
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
