"""Deleting cached items: the only code that removes an item's files from a cache directory.

An item of at least :data:`REAP_MIN_BYTES` is first renamed aside into staging (one atomic call:
its path is free when that returns), then deleted there by the reaper thread (unlinking a large
file takes the file system milliseconds: ext4 ~1.3 ms for 8 MiB), off the consumer's path. A
crash leaves it whole where it was, or in staging, which the cache clears at open. A smaller
item is deleted where it is (:meth:`Eviction.delete_in_place`: a single file by one unlink,
atomic too; a folder by :func:`~cachepipe.removal.rmtree`, without the rename: see
``benchmarks/README.md``, "Small folder items deleted in place"). Its ack ("A")
is journaled before, and a drop's "D" after, so a crash that cuts a folder's deletion short
leaves a partial folder that the next open finds acked, or not matching the listing, and
removes (``tests/test_crash_points.py`` crashes at every file-system call of it). Space is
released (``release(size, left)``) only once the files are gone; bytes that could not be
deleted are reported as ``left``.

A nested item (a name with a ``/``) is deleted only while every folder above it is a real folder
(:func:`.staging.in_folders`, one ``lstat`` each): a symbolic link put in place of one leads out
of the cache directory, and nothing is renamed, unlinked or removed through it (the item counts
as gone; its bytes, wherever they are now, are not ours).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ..filesystems import LOCAL_FILESYSTEMS, MEMORY_FILESYSTEMS
from ..removal import Reaper, delete_kept, in_use, left_after, left_at, rmtree, said_left
from .staging import Staging, in_folders

__all__ = ["REAP_MIN_BYTES", "Eviction", "deleters_for"]

log = logging.getLogger("cachepipe.cache")

REAP_MIN_BYTES = 1024 * 1024
"""Items at least this large are deleted by the reaper thread, off the consumer's path."""


def deleters_for(fstype: str) -> int:
    """How many threads may delete acknowledged items at once on a file system of type ``fstype``
    (as ``/proc/self/mountinfo`` names it; "" if unknown): 2 on a memory file system, else 4.

    Deleting a small item is a few short system calls with the interpreter's work between them,
    and each call hands the interpreter's lock on: the daemon's request threads (one per
    consumer connection; eight in the benchmark), all deleting at once, spent their time
    handing it to each other. On tmpfs two at once ran the daemon's batched hand-out fastest
    (one thread in the interpreter while the other is in the kernel); on a disk, where a
    deletion can wait for the file system's journal, four (benchmarks/README.md, "Deleters")."""
    return 2 if fstype in MEMORY_FILESYSTEMS else 4


class Eviction:
    """Deletes items of the cache at ``root``, moving them aside into ``staging`` first.

    Args:
        release: ``release(size, left)``, called once an item's deletion ended: ``size`` as given
            to :meth:`finish`, ``left`` the bytes that could not be deleted.
        hold: ``hold(change, left)``, the bytes of deleted items still on disk that the reaper
            tries again (:class:`~cachepipe.removal.Reaper`).
    """

    def __init__(
        self, root: Path, staging: Staging, release: Callable[[int, int], None], hold: Callable[[int, int], None]
    ) -> None:
        self.root = root
        self._root = str(root)
        self._staging = staging
        self._release = release
        self._reaper = Reaper(release, hold)
        self.folders = threading.Lock()  # parent folders of nested items: made by publish, removed here
        # held while a batch of acks is deleted: sized by open_deleters() for the file system
        self.deleters = threading.BoundedSemaphore(deleters_for(""))

    @property
    def block(self) -> int:
        """The cache's block, set at its open: bytes left by a failed deletion are counted in it."""
        return self._reaper.block

    @block.setter
    def block(self, block: int) -> None:
        self._reaper.block = block

    def open_deleters(self, fstype: str) -> None:
        """Let as many threads delete at once as suit the file system that holds the cache (its
        type, as :func:`~cachepipe.filesystems.filesystem_at` gives it; :func:`deleters_for`);
        called by the cache's open, before any item is handed out."""
        self.deleters = threading.BoundedSemaphore(deleters_for(fstype))
        # NFS (and FUSE) keep a removed file still open under another name in its folder until it is
        # closed: a single-file item is deleted in staging, where that name is found and held
        self._reaper.kept = fstype not in LOCAL_FILESYSTEMS

    def move_away(self, name: str) -> tuple[str, int]:
        """Free the path of item ``name``: rename it aside (or, if that fails, delete it in place).

        Returns ``(aside, left)``: where it was moved (``""`` if it was not), and the bytes left
        under its path if an in-place deletion failed (logged, not raised: the caller has
        already recorded the ack or drop).
        """
        if not self._reachable(name):
            return "", 0
        aside = self._staging.path("x")
        try:
            os.rename(f"{self._root}/{name}", aside)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.debug("could not move %s aside (%s): deleting it in place", name, exc)
            aside = ""
        try:
            if aside:
                self.remove_parents(name)
            else:
                aside = self.remove(name)  # moved aside after all if a file of it is still open
        except OSError as exc:
            left = left_at(f"{self._root}/{name}", self.block)
            said_left(name, left, exc)
            return aside, left
        return aside, 0

    def delete_in_place(self, name: str, files: tuple[str, ...] | None) -> bool:
        """Delete the small item ``name`` where it is, without the rename aside: a single-file
        item (``files`` None) by one unlink (atomic, as the rename is), a folder by :func:`rmtree`
        (``files``: the names of its files directly under it, unlinked without listing it). False
        if it could not be (the caller moves what is left away instead)."""
        if "/" in name and not in_folders(self._root, name):
            return False  # move_away says why
        if files is None and self._reaper.kept:
            return False  # a file still open would stay beside the items, uncounted (see open_deleters)
        try:
            if files is None:
                os.unlink(f"{self._root}/{name}")
            else:
                rmtree(f"{self._root}/{name}", files)
        except OSError:
            return False
        try:
            self.remove_parents(name)
        except OSError as exc:  # empty folders only: no bytes left
            log.warning("could not remove the empty folders of %s: %s", name, exc)
        return True

    def finish(self, aside: str, size: int, left: int) -> None:
        """Delete what :meth:`move_away` moved aside (by the reaper if ``size`` is large and the
        reaper runs; also if it is small and its deletion here failed: a file of it still open on
        NFS, which the reaper deletes once closed), then ``release(size, left)``."""
        if aside and size >= REAP_MIN_BYTES and self._reaper.put(aside, size):
            return
        if aside:
            where, _left, error = delete_kept(aside, self.block, self._reaper.kept)
            if error is not None:
                if in_use(error) and self._reaper.put(where, size):
                    return
                left += left_after(where, error, self.block)  # in staging: the next open clears what is left
        self._release(size, left)

    def remove(self, name: str) -> str:
        """Delete item ``name`` where it is (a stale leftover at open, or a failed rename). What
        cannot be deleted there, on NFS a file of it still open (a removed open file stays in its
        folder as ``.nfsXXXX`` until it is closed), is moved aside into staging instead, logged:
        at open counted with the state folder and deleted by a later open; after a failed rename
        deleted by :meth:`finish`. Returns where it was moved (``""``: not moved).

        Raises:
            OSError: it could be neither deleted nor moved aside (the deletion's error).
        """
        aside = ""
        if not self._reachable(name):
            return aside
        path = f"{self._root}/{name}"
        try:
            rmtree(path)
        except OSError as exc:
            if not in_use(exc):
                raise
            aside = self._staging.path("x")
            try:
                os.rename(path, aside)
            except OSError:
                raise exc from None
            log.warning(
                "could not delete %s (%s): moved aside to %s, deleted later (a file of it still open? NFS "
                "keeps a removed file that is open as .nfsXXXX in its folder until it is closed)",
                path,
                exc,
                aside,
            )
        self.remove_parents(name)
        return aside

    def _reachable(self, name: str) -> bool:
        """Whether item ``name``'s path passes only real folders of the cache (see the module
        notes); if not, logged: it is not deleted."""
        if "/" not in name or in_folders(self._root, name):
            return True
        log.warning("not deleting %s: a folder above it in %s is not a folder (a symbolic link or a file)", name, self._root)
        return False

    def remove_parents(self, name: str) -> None:
        """Nested single-file items: drop the folders that publish made for ``name``, if now empty."""
        if "/" not in name:
            return
        parent = (self.root / name).parent
        with self.folders:
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        break
                    raise
                parent = parent.parent

    def stop(self) -> None:
        """Delete everything handed to the reaper, then stop it; later deletions run inline."""
        self._reaper.stop()
