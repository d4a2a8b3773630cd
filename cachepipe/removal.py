"""Deleting cached items: a link-safe ``rmtree``, and the reaper thread that deletes acknowledged
items off the consumer's path.

Unlinking a large file costs the file system time (ext4 frees its extents: about 1.3 ms for
8 MiB on the project VM, more for a multi-GB video). An acknowledgement of an item of 1 MiB or
more (``cache.REAP_MIN_BYTES``) therefore only renames it aside (one call; its path is gone when
``ack`` returns) and the reaper deletes it; its space is released only once the files are gone,
so the cap holds on disk throughout. Smaller items are deleted in place.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import NamedTuple

from .blocks import link_charge, round_up

__all__ = [
    "Reaper",
    "delete_kept",
    "delete_tree",
    "in_use",
    "left_after",
    "left_at",
    "retry_delay",
    "rmtree",
    "said_left",
    "taken",
    "tree_bytes",
]

log = logging.getLogger("cachepipe.cache")


def delete_tree(path: str | os.PathLike[str], block: int = 0) -> int:
    """:func:`rmtree` ``path``; if that fails, log it and return the bytes left under it (0 if
    it is gone; with ``block``, in whole blocks: see :func:`tree_bytes`). The caller counts them
    as foreign until the next open clears staging."""
    try:
        rmtree(path)
    except OSError as exc:
        return left_after(path, exc, block)
    return 0


def left_after(path: str | os.PathLike[str], exc: OSError, block: int = 0) -> int:
    """The bytes left at ``path`` (:func:`left_at`) after its deletion failed with ``exc``,
    logged: counted as foreign until the next open clears staging."""
    left = left_at(path, block)
    said_left(path, left, exc)
    return left


def said_left(path: str | os.PathLike[str], left: int, exc: OSError | None = None) -> None:
    """Log that ``left`` bytes at ``path`` could not be deleted (``exc``: why), and count as
    foreign until the next open (an ERROR: the caller that asked for the deletion is gone)."""
    why = f": {exc}" if exc is not None else ""
    log.error("could not delete %s (%d bytes left, counted as foreign until the next open)%s", path, left, why)


def left_at(path: str | os.PathLike[str], block: int = 0) -> int:
    """What is left at ``path`` (a deletion failed) takes, as the ledger charges an item: a
    folder a block (with ``block``) and what is under it (:func:`tree_bytes`), a file its size
    (in whole blocks of ``block``), nothing if it is gone."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        return block + tree_bytes(path, block=block)
    if stat.S_ISREG(st.st_mode):
        return round_up(st.st_size, block) if block > 0 else st.st_size
    return 0


def in_use(exc: OSError) -> bool:
    """Whether a deletion failed as it does on NFS where a file is still open: a removed file
    that is open stays in its folder as ``.nfsXXXX`` until it is closed, so its folder's
    removal fails with ``ENOTEMPTY`` and that file's with ``EBUSY`` (worth trying again later)."""
    return exc.errno in (errno.ENOTEMPTY, errno.EBUSY)


def tree_bytes(
    root: str | os.PathLike[str], skip: Container[str] = (), allocated: bool = False, block: int = 0, disk: bool = False
) -> int:
    """Total size in bytes of the files under ``root`` (symlinks never followed, and counted as
    nothing but with ``block`` or ``disk``, below; a folder that cannot be listed, or an entry
    removed while this walks, as nothing), except the entries whose path relative to ``root``
    (``/``-separated) is in ``skip``: a cache's items already measured, say. With
    ``allocated``, a file with holes (a download whose parts came out of order) counts the
    bytes the disk gave it (``st_blocks``), if fewer and not none: what it takes from the free
    space. With ``block`` (bytes, above 0), what the files take in whole blocks of it, a block
    for each folder under ``root`` (not ``root`` itself) and for each symbolic link whose target
    is too long for its inode (:func:`~cachepipe.blocks.link_charge`), as the cache's ledger
    charges its items (:func:`~cachepipe.blocks.footprint`). One ``lstat`` per file (and link)
    counted and none per folder (``os.scandir`` tells folders and links apart from the
    directory itself). With ``disk``, instead, what the files, folders and links take from the
    disk (:func:`taken`: each at the bytes the disk gave it; a folder takes none on tmpfs, a
    block or more on ext4; a link its ``st_blocks``), one ``lstat`` per folder too: what
    deleting them would free, for a share of the disk.

    Raises:
        OSError: a file listed that cannot be measured (but for one removed meanwhile), as the
            walk with ``os.walk`` and ``lstat`` before it did.
    """
    total = 0
    folders = [(os.fspath(root), "")]
    while folders:
        folder, rel = folders.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue  # removed while we walked, or not a folder (a file: as os.walk, nothing)
        with entries:
            for entry in _listed(entries):
                name = f"{rel}{entry.name}"
                if name in skip:
                    continue
                try:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append((entry.path, f"{name}/"))
                        total += taken(entry.stat(follow_symlinks=False), 0) if disk else block
                    elif entry.is_symlink():
                        if disk or block > 0:  # a target too long for the inode takes a block (link_charge)
                            st = entry.stat(follow_symlinks=False)
                            total += st.st_blocks * 512 if disk else link_charge(st.st_size, block)
                    else:
                        st = entry.stat(follow_symlinks=False)
                        if disk:
                            total += taken(st, block)
                            continue
                        given = st.st_blocks * 512  # 0 on file systems that do not say (or keep small files inline)
                        size = given if allocated and 0 < given < st.st_size else st.st_size
                        total += -(-size // block) * block if block > 0 else size
                except FileNotFoundError:
                    continue  # removed while we walked (any other error is raised: the total would be wrong)
    return total


def taken(st: os.stat_result, block: int) -> int:
    """What the file or folder of ``st`` takes from the disk: the bytes it was given
    (``st_blocks``); where none are reported for a file that has bytes (a filesystem that does
    not say, or keeps small files inline), its size in whole ``block`` s (0: its size)."""
    if st.st_blocks or not st.st_size or stat.S_ISDIR(st.st_mode):
        return st.st_blocks * 512
    return -(-st.st_size // block) * block if block > 0 else st.st_size


def _listed(entries: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
    """The entries of a folder being listed; the rest of them left out if its listing fails
    part way (as ``os.walk`` does)."""
    while True:
        try:
            yield next(entries)
        except (StopIteration, OSError):
            return


def rmtree(path: str | os.PathLike[str], names: Sequence[str] = ()) -> None:
    """Delete ``path`` and everything under it; a file or a symlink is unlinked (a link is never
    followed, also if it replaces a folder while this runs); nothing if it does not exist.

    The folder is opened once with ``O_NOFOLLOW`` and its entries are removed relative to that
    descriptor (as :func:`shutil.rmtree` does, with fewer calls for the flat folders items are).

    Args:
        names: entries expected directly under ``path`` (a small item's files, by name, none
            with a ``/``): unlinked first, then the folder is removed without being listed (4
            system calls for a one-file folder instead of 13). Whatever else is there (a
            folder in place of a name, a file the consumer added) is then found by listing it.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        try:
            os.unlink(path)  # a file, or a link (ELOOP: O_NOFOLLOW met a symlink)
        except FileNotFoundError:
            pass
        return
    try:
        if names and _unlink_names(fd, names):
            try:
                os.rmdir(path)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
        _empty(fd)
    finally:
        os.close(fd)
    os.rmdir(path)


def _unlink_names(dir_fd: int, names: Sequence[str]) -> bool:
    """Unlink each of ``names`` in the folder ``dir_fd`` (never through a link: a name is the last
    component); False if one is a folder now (the caller lists the folder instead)."""
    for name in names:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            continue  # the consumer removed it
        except OSError as exc:
            if exc.errno in (errno.EISDIR, errno.EPERM):  # a folder in its place (EPERM: POSIX's unlink of a folder)
                return False
            raise
    return True


def _empty(fd: int) -> None:
    """Delete everything in the folder open as ``fd``: files and links unlinked (never
    followed), folders with :func:`_rmtree_at`. An entry gone between the listing and its
    deletion is gone, as wanted, not an error: on NFS a removed file still open stays listed
    as ``.nfsXXXX`` until its last close, when the client removes it (``shutil.rmtree`` raised
    ``FileNotFoundError`` for it)."""
    with os.scandir(fd) as entries:
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    _rmtree_at(fd, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=fd)
            except FileNotFoundError:
                continue


def _rmtree_at(dir_fd: int, name: str) -> None:
    """``shutil.rmtree(name, dir_fd=dir_fd)``, as :func:`rmtree`: links are unlinked, never
    followed, and an entry removed meanwhile is no error (:func:`_empty`)."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        _empty(fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


KEPT_PREFIXES = (".nfs", ".fuse_hidden")
"""How a removed file still open is named while it stays listed in its folder (NFS, FUSE)."""


def delete_kept(path: str, block: int = 0, look: bool = False) -> tuple[str, int, OSError | None]:
    """:func:`rmtree` ``path``: ``(where, left, why)``, ``where`` what is left is (``path``, or
    the file's new name), ``left`` its bytes (:func:`left_at`; 0: all gone), ``why`` the error
    (None: all gone). With ``look`` (a file system that may keep a removed open file, not a
    local one), a regular file's unlink that succeeded is looked after: NFS renames a removed
    file that a process on this client still holds open to ``.nfsXXXX`` in its folder (FUSE to
    ``.fuse_hidden*``) until it is closed, so its bytes stay on disk; found (one listing of the
    folder, by its inode), it is left as a deletion refused as in use (``EBUSY``, :func:`in_use`)."""
    st = None
    if look:
        try:
            st = os.lstat(path)
        except OSError:
            pass
    try:
        rmtree(path)
    except OSError as exc:
        return path, left_at(path, block), exc
    if st is not None and stat.S_ISREG(st.st_mode) and (kept := _kept_copy(path, st)) is not None:
        return kept, left_at(kept, block), OSError(errno.EBUSY, "removed while a process holds it open", kept)
    return path, 0, None


def _kept_copy(path: str, st: os.stat_result) -> str | None:
    """The path under which the file that was at ``path`` (``st``: its ``lstat`` before its
    unlink) stays in its folder, still open (:data:`KEPT_PREFIXES`), or None."""
    try:
        entries = os.scandir(os.path.dirname(path) or ".")
    except OSError:  # the folder cannot be listed: nothing found
        return None
    with entries:
        for entry in _listed(entries):
            try:
                if entry.name.startswith(KEPT_PREFIXES) and entry.stat(follow_symlinks=False).st_ino == st.st_ino:
                    return entry.path
            except OSError:  # gone meanwhile (closed)
                continue
    return None


RETRY_FIRST = 0.025
"""Seconds from a deletion that left a path (see :class:`Reaper`) to its first try again."""

RETRY_SECONDS = 1.0
"""The longest wait between two tries again of a path that a deletion left (see :func:`retry_delay`)."""

RETRY_SHARE = 0.25
"""At most this share of the reaper's time goes to tries again: after a round of them that took
``t`` seconds, the next starts ``t / RETRY_SHARE`` seconds after it started, at the earliest."""


def retry_delay(tries: int) -> float:
    """Seconds from a held path's last try (``tries`` tries again so far; 0: the deletion that
    left it) to its next: :data:`RETRY_FIRST`, doubled at each try, at most :data:`RETRY_SECONDS`.
    A file closed soon after its item's acknowledgement (a consumer that closes it at its next
    step) frees its room within a few hundredths of a second; one held open longer is tried once
    a second."""
    return min(RETRY_FIRST * 2.0 ** min(tries, 64), RETRY_SECONDS)


SAID_ONE_BY_ONE = 3
"""Paths still held when the reaper stops are each logged as an error up to this many; more are
said in one error line (with the first), each at debug level."""


class _Held(NamedTuple):
    """A path a deletion left, to try again: its bytes still counted, its tries again so far,
    and when (``time.monotonic()``) the next is due."""

    left: int
    tries: int
    due: float


class Reaper:
    """One thread that deletes paths handed to :meth:`put`, in order, and then calls
    ``release(size, left)``: ``size`` as given to :meth:`put`, ``left`` the bytes still on disk
    under the path, counted as foreign (0, unless the deletion failed and there is no ``hold``,
    below: the error is logged, as the caller is gone).

    A deletion that leaves bytes because a file of the item is still open (:func:`in_use`: a
    removed open file stays in its folder until it is closed, NFS's ``.nfsXXXX``, whose removal
    is refused with ``EBUSY``, FUSE's ``.fuse_hidden*``) is tried again while the reaper runs:
    first after :data:`RETRY_FIRST`, then twice as long after each try, at most
    :data:`RETRY_SECONDS` (:func:`retry_delay`; each path on its own schedule, and at most
    :data:`RETRY_SHARE` of the reaper's time in tries again: a round over many held paths is
    followed by a rest three times its length). Its bytes are counted by ``hold(change, left)`` (``change`` more bytes held,
    still on disk; ``left`` of them foreign from now on), called before the item's ``release``:
    ``hold(held, 0)`` when they are left, ``hold(-freed, 0)`` as a later try frees them (their
    room comes back without a reopen), and ``hold(-held, held)`` for what is still there when
    :meth:`stop` tried once more.

    Args:
        release: called in the reaper thread after each deletion.
        hold: called in the reaper thread for what deletions left, as above (None: what a
            deletion left counts as foreign at once, ``release(size, left)``, not tried again).
        block: the cache's block (bytes left counted in whole blocks: :func:`tree_bytes`).

    Attribute ``kept``: the file system may keep a removed open file listed under another name
    (NFS, FUSE): a file's unlink is looked after (:func:`delete_kept`), and the file held so.
    """

    def __init__(
        self, release: Callable[[int, int], None], hold: Callable[[int, int], None] | None = None, block: int = 0
    ) -> None:
        self._release = release
        self._hold = hold
        self.block = block
        # the cache's file system may keep a removed open file listed (not a local one: NFS, FUSE):
        # a file's deletion is looked after (delete_kept)
        self.kept = False
        self._queue: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._held: dict[str, _Held] = {}  # path -> its bytes still counted, tries, next: to try again (reaper thread only)
        self._told = False  # the first deletion left for later is logged as a warning, the others at debug

    def put(self, path: str, size: int) -> bool:
        """Queue ``path`` for deletion; False (nothing queued) once :meth:`stop` was called."""
        with self._lock:
            if self._stopped:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="cachepipe-reaper", daemon=True)
                self._thread.start()
            self._queue.put((path, size))
            return True

    def stop(self) -> None:
        """Delete everything queued, try once more what was left, then end the thread (idempotent)."""
        with self._lock:
            self._stopped = True
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        rested = 0.0  # no round of tries again before then (RETRY_SHARE)
        while True:
            wait = None
            if self._held:
                wait = max(0.0, max(rested, min(h.due for h in self._held.values())) - time.monotonic())
            try:
                job = self._queue.get(timeout=wait)
            except queue.Empty:  # time to try again what was left
                pass
            else:
                if job is None:
                    break
                self._take(*job)
            start = time.monotonic()
            if self._held and start >= rested and self._retry(start):
                rested = start + (time.monotonic() - start) / RETRY_SHARE
        self._retry()
        for path, held in self._held.items():
            if len(self._held) <= SAID_ONE_BY_ONE:
                said_left(path, held.left)
            else:
                log.debug("could not delete %s (%d bytes left)", path, held.left)
            if self._hold is not None:
                self._hold(-held.left, held.left)
        if len(self._held) > SAID_ONE_BY_ONE:  # one line, not one per path: a consumer may hold hundreds
            first, left = next(iter(self._held)), sum(h.left for h in self._held.values())
            log.error(
                "could not delete %d paths at the reaper's stop (%d bytes left, counted as foreign until the next open; "
                "files of them still open? first: %s; the others are logged at debug level)",
                len(self._held),
                left,
                first,
            )
        self._held.clear()

    def _take(self, path: str, size: int) -> None:
        """Delete ``path``, then release ``size``; what is left of it is held, to try again."""
        path, left, error = delete_kept(path, self.block, self.kept)
        hold = self._hold
        if error is not None and (hold is None or not in_use(error)):
            said_left(path, left, error)
            self._release(size, left)
            return
        if error is not None and hold is not None:  # in use: tried again even with nothing left (the file closed meanwhile)
            held = min(left, size)
            self._held[path] = _Held(held, 0, time.monotonic() + retry_delay(0))
            self._tell(path, held, error)
            hold(held, 0)  # before the release: never counted as free while on disk
        self._release(size, 0)

    def _retry(self, now: float | None = None) -> bool:
        """Try again to delete each path that a deletion left whose try is due at ``now`` (None:
        every one), releasing what that frees; whether one was tried."""
        tried = False
        for path, held in list(self._held.items()):
            if now is not None and held.due > now:
                continue
            tried = True
            where, left, error = delete_kept(path, self.block, self.kept)
            left = min(left, held.left)
            tries = held.tries + 1
            del self._held[path]
            waited = retry_delay(held.tries)
            if error is not None:  # where: a file removed again but still open, under its new name
                self._held[where] = _Held(left, tries, time.monotonic() + retry_delay(tries))
                if waited < RETRY_SECONDS:  # while the waits grow: a few lines a path, not one a second
                    log.debug("could not delete %s at try %d again, %g s after the one before: %s", path, tries, waited, error)
            else:
                log.debug("deleted %s at try %d again, %g s after the one before", path, tries, waited)
            if left < held.left and self._hold is not None:
                self._hold(left - held.left, 0)
        return tried

    def _tell(self, path: str, held: int, error: OSError) -> None:
        """Log that ``path`` is left to delete later (the first time as a warning)."""
        level = logging.DEBUG if self._told else logging.WARNING
        self._told = True
        log.log(
            level,
            "could not delete %s yet (%d bytes left, still counted; tried again after %g s, then up to every %g s: "
            "a file of it still open? NFS keeps a removed file that is open as .nfsXXXX in its folder until it is "
            "closed): %s",
            path,
            held,
            RETRY_FIRST,
            RETRY_SECONDS,
            error,
        )
