"""Files written whole: the temporary file a writer fills beside its target, locked while it is
written (:func:`open_temp`: a second writer of the same target waits, a killed writer's file is
reused), and a full disk's bare error given the name of what was written (:func:`naming`).
:func:`cachepipe.state.atomic_write` (state files, local manifests) and a local destination's
``put`` (:mod:`cachepipe.stores.localwrites`) write through them."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable, Iterator

__all__ = ["naming", "open_temp"]


def open_temp(temp: str, unique: Callable[[], str], mode: int = 0o666) -> tuple[int, str]:
    """Open the temporary file ``temp`` (beside the file it will be renamed to) for writing,
    locked (``flock``): its descriptor and its name. The caller truncates it (it may hold what a
    killed writer wrote), writes, renames it over its target and then closes it.

    The name is the same at every write of a target, so the file a killed writer left (a SIGKILL
    leaves it; an exception removes it) is reused by the next write, not left for good; a second
    writer of the same target at the same time waits for the first, instead of truncating and
    writing into the file the first one is about to rename. On a filesystem without locks
    (``ENOLCK``) a file of the name ``unique()`` is created instead, which a killed writer leaves
    (and ``temp``, opened to be locked, is removed: no writer there uses it)."""
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
            if exc.errno != errno.ENOLCK:
                raise
            with contextlib.suppress(FileNotFoundError):  # opened to lock (made, if need be): no writer's here
                os.unlink(temp)
            temp = unique()  # no locks on this filesystem
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode), temp
        except BaseException:
            os.close(fd)
            raise
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
