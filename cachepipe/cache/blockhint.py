"""Say when the items take much more of the disk than the capacity counts.

The hard cap counts file sizes (docs/guide/options.md, "Capacity and the filesystem"); the
filesystem gives each file whole blocks (``statvfs`` ``f_frsize``: 4 KiB on most ext4, XFS and
btrfs) and each folder one. For items of many small files that is several times their size: a
cache under its capacity fills the disk. Until the cap counts blocks, the cache says so once,
from the first items it reserves (:class:`BlockSample`): at :data:`SAMPLE_ITEMS` items, or once
they list 1% of the capacity, whichever comes first, a warning if they take
:data:`WARN_RATIO` times their size or more, with the capacity that would keep the disk under
the one given. The arithmetic is pure (:func:`in_blocks`); the sample logs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from ..catalog import Item
from ..sizes import format_size

__all__ = ["SAMPLE_ITEMS", "WARN_RATIO", "BlockSample", "in_blocks"]

log = logging.getLogger("cachepipe.cache")

SAMPLE_ITEMS = 256
"""Items sampled at most (their files' sizes summed once each, at reservation)."""

WARN_RATIO = 1.25
"""Blocks over listed bytes from which the cache warns (files of 16 KiB on 4 KiB blocks: 1.125)."""

BLOCK_RANGE = (512, 64 * 1024)
"""The block the sample rounds to, held to this range: ``f_frsize`` is the allocation unit on
ext4, XFS, btrfs and tmpfs, but on NFS (and some FUSE filesystems) the server's I/O size, up to
1 MiB, which says nothing of how the server stores a file."""


def in_blocks(sizes: Iterable[int], folders: int, block: int) -> int:
    """Bytes that files of ``sizes`` and ``folders`` folders take in whole ``block`` s: each file
    rounded up (an empty one: none), a block per folder."""
    return (sum(-(-size // block) for size in sizes) + folders) * block


class BlockSample:
    """The first items a cache reserves, in listed bytes and in blocks (see the module notes).

    Args:
        root: the cache folder (named in the warning).
        block: the filesystem's ``f_frsize`` (0: nothing sampled).
    """

    def __init__(self, root: str, block: int) -> None:
        self.root = root
        self.block = min(max(block, BLOCK_RANGE[0]), BLOCK_RANGE[1])
        self.sampling = block > 0  # read without the lock: once False, never True again
        self.items = self.files = self.listed = self.taken = 0
        self._lock = threading.Lock()

    def add(self, item: Item, capacity: int) -> None:
        """Count ``item`` (its files' sizes, its folder) under a cache of ``capacity`` bytes; once
        the sample is whole, warn if it takes :data:`WARN_RATIO` times its size or more."""
        taken = in_blocks((f.size for f in item.files), 0 if item.is_file else 1, self.block)
        with self._lock:
            if not self.sampling:
                return
            self.items += 1
            self.files += len(item.files)
            self.listed += item.size
            self.taken += taken
            if self.items < SAMPLE_ITEMS and self.listed * 100 < capacity:
                return
            self.sampling = False
            items, files, listed, taken = self.items, self.files, self.listed, self.taken
        ratio = taken / max(listed, 1)
        if ratio < WARN_RATIO:
            return
        log.warning(
            "%s: its first %d items (%d files, %s listed) take %s in the filesystem's blocks of %d bytes, %.1f times "
            "their size; the capacity counts file sizes, so the cache may take up to %.1f times its capacity of %s on "
            "this disk: give a capacity of %s to keep it within %s, or set min_free to keep room on the disk free",
            self.root,
            items,
            files,
            format_size(listed),
            format_size(taken),
            self.block,
            ratio,
            ratio,
            format_size(capacity),
            format_size(int(capacity / ratio)),
            format_size(capacity),
        )
