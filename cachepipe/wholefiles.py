"""Files written whole: the temporary file a writer fills beside its target, locked while it is
written (:func:`open_temp`: a second writer of the same target waits, a killed writer's file is
reused), a locked temporary file of a unique name (:func:`open_unique_temp`), the removal of one
that a killed writer left (:func:`remove_unlocked`: its lock is free), and a full disk's bare
error given the name of what was written (:func:`naming`).
:func:`cachepipe.state.atomic_write` (state files, local manifests) and a local destination's
``put`` (:mod:`cachepipe.stores.localwrites`) write through them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import tempfile
from collections.abc import Callable, Iterator

__all__ = ["NO_LOCKS", "naming", "open_temp", "open_unique_temp", "remove_unlocked"]

# flock's refusals that say the file cannot be locked there, not that another holds it: a mount
# without a lock daemon (ENOLCK), a filesystem without flock (EOPNOTSUPP, EINVAL), NFS's
# exclusive lock on a descriptor open for reading only (EBADF, flock(2): NFS emulates flock
# with byte-range locks)
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF})


def open_temp(temp: str, unique: Callable[[], str], mode: int = 0o666) -> tuple[int, str]:
    """Open the temporary file ``temp`` (beside the file it will be renamed to) for writing,
    locked (``flock``): its descriptor and its name. The caller truncates it (it may hold what a
    killed writer wrote), writes, renames it over its target and then closes it.

    The name is the same at every write of a target, so the file a killed writer left (a SIGKILL
    leaves it; an exception removes it) is reused by the next write, not left for good; a second
    writer of the same target at the same time waits for the first, instead of truncating and
    writing into the file the first one is about to rename. On a filesystem without locks
    (:data:`NO_LOCKS`) a file of the name ``unique()`` is created instead, which a killed writer
    leaves (and ``temp``, opened to be locked, is removed: no writer there uses it)."""
    while True:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(temp, follow_symlinks=False)):
                return fd, temp  # locked, and still the file of that name (a writer before may have renamed or removed it)
        except FileNotFoundError:
            pass
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_LOCKS:
                raise
            with contextlib.suppress(FileNotFoundError):  # opened to lock (made, if need be): no writer's here
                os.unlink(temp)
            temp = unique()  # no locks on this filesystem
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), temp
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def open_unique_temp(folder: str, prefix: str, suffix: str = "") -> tuple[int, str, bool]:
    """Create a file of a unique name ``<prefix><random><suffix>`` in ``folder`` (mode 0o600), for
    writing, locked (``flock``) while the caller holds its descriptor: its descriptor, its name,
    and whether it is locked (False on a filesystem without locks, :data:`NO_LOCKS`). The caller
    removes it, then closes the descriptor.

    A writer killed before it removed the file leaves it locked by no one:
    :func:`remove_unlocked` of its name, run by a later writer, removes it. The file is locked
    before it is returned, and it is still the file of that name then (one that such a removal
    took between its creation and its lock is made again), so a live writer's file is never
    removed."""
    while True:
        fd, path = tempfile.mkstemp(suffix, prefix, folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return fd, path, True
        except FileNotFoundError:
            pass  # removed between its creation and its lock, as a dead writer's: made again
        except OSError as exc:
            if exc.errno in NO_LOCKS:
                return fd, path, False
            os.close(fd)
            raise
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def remove_unlocked(path: str) -> bool:
    """Remove the regular file ``path`` if no process holds its ``flock`` (the temporary file of a
    writer that was killed, from :func:`open_temp` or :func:`open_unique_temp`): whether it was
    removed. A file a live writer holds locked is left, and so is one gone already, one this
    process may not open or remove (another user's, in a shared folder; a read-only
    filesystem's), a symbolic link or another kind of file, and any file on a filesystem
    without locks (:data:`NO_LOCKS`: no writer can be told from a dead one).

    The file is opened for writing (nothing is written): NFS refuses an exclusive lock on a
    descriptor open for reading only (``EBADF``), and every removal there failed on it. A file
    on which another process holds a lease (``F_SETLEASE``: Samba's kernel oplocks, the kernel
    NFS server's delegations, for a client that reads it) refuses that open (``EAGAIN``): it is
    in use, and kept (the open asks its holder to give the lease up, as any writer's does).

    Raises:
        OSError: another error of the ``open``, ``flock`` or ``unlink`` (an I/O error).
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a link, a pipe, a device: not a file a writer made
            return False
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, PermissionError, BlockingIOError):  # BlockingIOError: another's lease, a reader's
        return False
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EROFS):  # replaced meanwhile; a read-only filesystem
            return False
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno == errno.EWOULDBLOCK or exc.errno in NO_LOCKS:  # a live writer's; no locks here
                return False
            raise
        try:  # locked by this process: a writer that locks it now finds it gone (or renamed) and makes another
            if not os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False)):
                return False  # renamed into place, or replaced by a new writer's, since it was opened
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            return False
        except OSError as exc:
            if exc.errno == errno.EROFS:  # a read-only filesystem: nothing is written there either
                return False
            raise
        return True
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming(what: str) -> Iterator[None]:
    """Raise an :class:`OSError` of the block that names no file (a write's or an ``fsync``'s on
    a full disk: a bare ``[Errno 28]``) again with its errno, saying ``what``: ``"<strerror>:
    <what>"``. Its subclasses, and errors that name a file, go through as they are."""
    try:
        yield
    except OSError as exc:
        if type(exc) is not OSError or exc.filename is not None:
            raise
        raise OSError(exc.errno, f"{exc.strerror or exc}: {what}") from exc
