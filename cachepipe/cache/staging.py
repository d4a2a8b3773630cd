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
import os
from pathlib import Path

from ..catalog import Item
from ..errors import VerificationError
from ..fscalls import RELEASING, FileCalls, rename_new
from ..removal import rmtree

__all__ = ["Staging", "matches", "rename_new", "verify"]


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
        costs a few hundred microseconds on some disks: better in the download threads).

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


def matches(path: Path, item: Item) -> bool:
    """True when ``path`` holds exactly the item's files with the listed sizes."""
    try:
        if item.is_file:
            return path.is_file() and not path.is_symlink() and path.stat().st_size == item.size
        expected = {f.rel: f.size for f in item.files}
        found = {}
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                p = Path(dirpath, name)
                found[p.relative_to(path).as_posix()] = p.lstat().st_size
        return found == expected
    except OSError:
        return False
