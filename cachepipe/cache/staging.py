"""Staging areas and the checks before publish: downloads are written under
``.cachepipe/staging/N`` (same file system as the items) and verified against the listing;
the cache then publishes an item by one atomic rename (:meth:`cachepipe.cache.Cache.publish`).

Invariant: a consumer only ever sees a complete item: nothing under an item's own path is
written but by that rename (:func:`rename_new`, which never replaces anything in its place),
and a staged item is renamed only once every file is known to hold its listed size: each of
its parts counted whole as written (:func:`cachepipe.downloads.get_part`), or :func:`verify`.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

from ..catalog import Item
from ..errors import VerificationError
from ..fscalls import RELEASING, FileCalls, rename_new
from ..removal import in_use, rmtree

__all__ = ["Staging", "clear", "in_folders", "make_folders", "matches", "matches_sizes", "rename_new", "verify"]

log = logging.getLogger("cachepipe.cache")


class Staging:
    """Numbered staging areas under ``root`` (emptied by the cache at open and close)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = str(root)  # strings, not Path objects: paths are made once per item
        self._numbers = itertools.count(1)  # next() is atomic in CPython: no lock needed

    def path(self, prefix: str = "") -> str:
        """A fresh path under the staging root (``prefix`` ``"x"``: items moved aside to be deleted)."""
        return f"{self._root}/{prefix}{next(self._numbers)}"

    def stage(self, item: Item, part_size: int | None = None, calls: FileCalls = RELEASING) -> str:
        """Create the staging area for ``item``: its folders and empty files.

        With ``part_size``, only the files that are empty or that several parts write into
        are created; the downloader creates a one-part file as it writes it (a file creation
        costs a millisecond on an ext4 without a journal once many items were deleted, which
        scans past the inodes freed in the last minutes: better in the download threads).

        ``calls`` makes the item's own folder (the cache's :attr:`~cachepipe.cache.Cache.file_calls`).

        Returns the staging path (a directory, or a file for single-object items), a string: a
        :class:`~pathlib.Path` per item costs a few microseconds, and the path is only joined and
        passed to system calls.
        """
        path = self.path()
        try:
            if item.is_file:
                if part_size is None or item.size == 0 or item.size > part_size:
                    with open(path, "wb"):
                        pass
                return path
            calls.mkdir(path, 0o777)
            made = {path}
            for f in item.files:
                target = f"{path}/{f.rel}"
                parent = target.rpartition("/")[0]
                if parent not in made:
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
                if part_size is None or f.size == 0 or f.size > part_size:
                    with open(target, "wb"):
                        pass
        except OSError:
            rmtree(path)
            raise
        return path


def clear(root: Path) -> None:
    """Make the staging folder ``root`` anew, empty, deleting what an earlier owner left there
    (and what an earlier open set aside beside it, ``<root>.N``). A folder that cannot be
    deleted, on NFS one holding a file still open (a removed open file stays in its folder as
    ``.nfsXXXX`` until it is closed, and its removal is refused with ``EBUSY``), is renamed
    aside to ``<root>.N`` instead, logged: counted with the state folder, deleted by a later open.

    Raises:
        OSError: it could be neither deleted nor renamed aside (or failed otherwise than as a
            file still open does, :func:`~cachepipe.removal.in_use`), or not made.
    """
    for old in [*root.parent.glob(f"{root.name}.*"), root]:
        try:
            rmtree(old)  # an entry removed meanwhile is no error (NFS's .nfsXXXX at its last close)
        except OSError as exc:
            if not in_use(exc):
                raise
            if old != root:
                log.debug("could not delete %s yet (%s): a later open tries again", old, exc)
                continue
            aside = next(path for n in itertools.count(1) if not (path := root.with_name(f"{root.name}.{n}")).exists())
            os.rename(root, aside)
            log.warning(
                "could not delete %s (%s): set aside as %s, deleted by a later open (a file of it still open? NFS keeps "
                "a removed file that is open as .nfsXXXX in its folder until it is closed)",
                root,
                exc,
                aside,
            )
    root.mkdir()


def verify(staged: str | Path, item: Item) -> None:
    """Check every staged file's size against the listing.

    Raises:
        VerificationError: a file's size differs from the listing.
    """
    base = os.fspath(staged)
    for f in item.files:
        actual = os.stat(f"{base}/{f.rel}" if f.rel else base).st_size
        if actual != f.size:
            raise VerificationError(errno.EIO, f"{f.key}: got {actual} bytes, listing says {f.size}")


def make_folders(root: str, name: str) -> None:
    """Make the folders above the nested item ``name`` (a name with a ``/``) under ``root``,
    each a real folder: one ``lstat`` per folder, and a ``mkdir`` for each missing one.

    Raises:
        FileExistsError: one of them is not a folder (a symbolic link, which no download
            makes, or a file): the item would be published through it, outside the cache
            directory. Its message names it (its ``filename`` too; ``filename2`` is None).
            Nothing under or beyond it is made or touched.
        OSError: a folder could not be made.
    """
    path = root
    for part in name.split("/")[:-1]:
        path = f"{path}/{part}"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path)
                continue
            except FileExistsError:  # made meanwhile, by another (a cache has one owner): what is it?
                st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode):
            raise FileExistsError(errno.EEXIST, f"{path} is not a folder (a symbolic link or a file)", path)


def in_folders(root: str, name: str) -> bool:
    """True when every folder above item ``name`` under ``root`` is a real folder (always for a
    name without a ``/``): its path passes no symbolic link, so what is found or deleted there
    is in the cache directory. One ``lstat`` per folder above it."""
    path = root
    for part in name.split("/")[:-1]:
        path = f"{path}/{part}"
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
        except OSError:  # missing, or cannot be looked at: nothing of the item is there
            return False
    return True


def matches(path: str | os.PathLike[str], item: Item) -> bool:
    """True when ``path`` holds exactly the item's files with the listed sizes: see
    :func:`matches_sizes`."""
    return matches_sizes(path, item.size if item.is_file else {f.rel: f.size for f in item.files})


def matches_sizes(path: str | os.PathLike[str], expected: int | Mapping[str, int]) -> bool:
    """True when ``path`` holds exactly what ``expected`` says: a regular file of that many bytes
    (an int: a single-file item), or a folder of exactly these files, ``{rel: size}`` (a folder
    item, :meth:`cachepipe.catalog.Catalog.file_sizes`). A symbolic link anywhere under it, or at
    ``path`` itself, which no download makes, is no match; the folders above a nested item's path
    are the caller's to check, :func:`in_folders`. One ``lstat`` per file, and one of a folder
    item's own path."""
    try:
        st = os.lstat(path)
        if isinstance(expected, int):
            return stat.S_ISREG(st.st_mode) and st.st_size == expected
        if not stat.S_ISDIR(st.st_mode):  # a link to a folder: scandir would follow it
            return False
        found = 0
        folders = [(os.fspath(path), "")]
        while folders:
            folder, rel = folders.pop()
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        folders.append((entry.path, f"{rel}{entry.name}/"))
                    elif entry.is_symlink() or expected.get(f"{rel}{entry.name}") != entry.stat(follow_symlinks=False).st_size:
                        return False
                    else:
                        found += 1
        return found == len(expected)
    except OSError:
        return False
