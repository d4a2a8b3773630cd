"""The ownership lock of a cache directory: one owner at a time, in any process on the host.

Invariant: while :meth:`OwnerLock.acquire` holds, no other process holds the ``flock`` on
``.cachepipe/lock``; the kernel releases it when the owner closes it or dies (``kill -9``
included), so a crashed owner never blocks the next one.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from ..errors import CacheLockedError

__all__ = ["OwnerLock"]


class OwnerLock:
    """``flock`` on ``path``, which holds ``"pid host"`` of the owner while held.

    Args:
        path: the lock file (created if missing).
        root: the cache directory, for the error message.
    """

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CacheLockedError: another live process holds it (naming its pid and host).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CacheLockedError(str(self.root), f"pid {owner}" if owner[:1].isdigit() else owner) from None
        self._fd = fd  # held from here: release() closes it whatever happens next
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Clear the owner line and release the lock (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing releases the flock
