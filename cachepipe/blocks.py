"""What an item takes on the cache's filesystem: its files in whole blocks, and its folders
(pure: no I/O).

A filesystem gives each file whole allocation blocks (``statvfs`` ``f_frsize``: 4 KiB on most
ext4, XFS and btrfs), and each folder at least one. The capacity's ledger charges every item
:func:`footprint` of its files' sizes and the folders it makes, so that a cache of many small
files stays under its capacity in what ``du`` and the free space count, not only in the sizes
``ls -l`` shows. Read once by the cache at its open (:func:`clamp_block`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "BLOCK_MAX",
    "BLOCK_MIN",
    "LINK_INLINE",
    "clamp_block",
    "folders_above",
    "folders_made",
    "footprint",
    "link_charge",
    "round_up",
]

BLOCK_MIN = 512
"""The smallest block charged: what ``st_blocks`` counts in, and the smallest any Linux filesystem gives."""

BLOCK_MAX = 64 * 1024
"""The largest block charged. ``f_frsize`` is the allocation unit on ext4 (1-64 KiB), XFS (its
block, 4 KiB usually), btrfs (its sector, 4 KiB), tmpfs and overlayfs (the page size, or the
upper layer's); on NFS, and some FUSE filesystems, it is the server's preferred I/O size (up to
1 MiB), which says nothing of how the server stores a file: charging 1 MiB a file would cut a
cache of small files to a fraction of its capacity for nothing. Above this, the block is held
to it (the largest ext4 cluster of a usual mkfs, and the largest page size of Linux)."""


def clamp_block(frsize: int) -> int:
    """The block to charge files in, from a filesystem's ``f_frsize`` (0 or less: not reported):
    held to :data:`BLOCK_MIN` .. :data:`BLOCK_MAX` (see there for why)."""
    return min(max(frsize, BLOCK_MIN), BLOCK_MAX)


LINK_INLINE = 59
"""The longest target (bytes) of a symbolic link that takes no block: ext4 keeps a target of up
to 59 bytes in the inode (tmpfs up to 127, XFS and btrfs more); a longer one takes a block of
its own (a page of tmpfs), as a file of that size does."""


def link_charge(target: int, block: int) -> int:
    """What a symbolic link whose target is ``target`` bytes takes on a filesystem of ``block``
    -byte blocks: a block if the target is longer than :data:`LINK_INLINE`, else nothing (0
    ``block``: nothing, as for the files' sizes alone)."""
    return block if block > 0 and target > LINK_INLINE else 0


def round_up(size: int, block: int) -> int:
    """``size`` bytes in whole ``block`` s: 0 -> 0, 1 -> block, block -> block, block + 1 -> 2 blocks."""
    return -(-size // block) * block


def footprint(file_sizes: Iterable[int], folders: int, block: int) -> int:
    """Bytes that files of ``file_sizes`` and ``folders`` folders take on a filesystem of
    ``block`` -byte blocks: each file rounded up to whole blocks (an empty file: none), and one
    block per folder."""
    return sum(-(-size // block) for size in file_sizes) * block + folders * block


def folders_made(rels: Iterable[str], is_file: bool, name: str = "") -> int:
    """The folders an item makes: for a single-object item, those of its ``name`` (``a/b/x.bin``
    makes ``a`` and ``a/b``: publishing it makes them where they are missing, and its eviction
    removes them once empty), each counted though other items under it share it, since any of
    them may be the last to hold it (a folder uncounted took a block of the disk beyond the
    capacity for each such item: twice its capacity for a cache of small files each in its own
    folder); for a folder item, its own and one for each distinct folder among its files'
    relative paths (``a/b/x`` makes ``a`` and ``a/b``)."""
    if is_file:
        return name.count("/")
    return 1 + folders_above(rels)


def folders_above(paths: Iterable[str]) -> int:
    """The distinct folders among ``paths`` (``/``-separated): ``a/b/x`` and ``a/y`` have ``a``
    and ``a/b``."""
    seen: set[str] = set()
    for path in paths:
        cut = path.rfind("/")
        while cut > 0:
            folder = path[:cut]
            if folder in seen:
                break  # its parents were counted with it
            seen.add(folder)
            cut = folder.rfind("/")
    return len(seen)
