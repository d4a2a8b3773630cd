"""A cache directory whose disk is full when its cache opens: the check made before the
listing (:func:`no_room`), and the error that says so (:func:`full_disk`): which disk, what
holds it, what to do.

At open nothing of the cache's own can make room yet (its items are freed by acks, once it runs),
so a full disk there is another writer's, or the cache's own items kept from before. The cache
raises the error at once (:class:`~cachepipe.Pipeline` ``open`` fails with it); the daemon
(:mod:`cachepipe.service.roomwait`) waits for room instead and opens the pipeline then, as a
running cache waits for room for its items.

Only the checks and the message: nothing here writes or deletes.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import NamedTuple

from ..filesystems import filesystem_at, mount_at
from ..sizes import format_size
from .room import held_in

__all__ = ["FULL_ERRNOS", "ROOT_RESERVES", "Room", "full_disk", "mount_point", "no_room", "room_now", "said_full"]

FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a write refused for want of room: the disk (or its inodes) full, or a quota."""

ROOT_RESERVES = frozenset({"ext2", "ext3", "ext4"})
"""File system types whose free blocks not available (``f_bfree - f_bavail``) are kept for root
(``mkfs.ext4 -m``, 5% by default). Elsewhere they are the file system's own: btrfs counts the
room of its metadata chunks as free, which no file's data gets, not even root's."""


class Room(NamedTuple):
    """What the filesystem of a path has free: ``bytes`` and ``inodes`` (-1: the filesystem does
    not count them) as ``df`` shows them available (``f_bavail``, ``f_favail``: not the blocks
    reserved for root, which ext4 does not all give even to root), of ``total`` bytes in blocks of
    ``block`` bytes. The same measure as the capacity's share of the disk (``shutil.disk_usage``).
    ``reserved``: bytes free but not available (``f_bfree - f_bavail``: ext4's blocks reserved
    for root, 5% by default; btrfs's room in its metadata chunks), neither available nor any
    file's."""

    bytes: int
    inodes: int
    total: int
    block: int
    reserved: int = 0


def room_now(path: str | os.PathLike[str]) -> Room:
    """:class:`Room` of the filesystem that holds ``path`` (one ``statvfs``); ``total`` 0 where
    the filesystem reports no size (:func:`no_room`)."""
    st = os.statvfs(path)
    inodes = st.f_favail if st.f_files else -1
    reserved = max(st.f_bfree - st.f_bavail, 0) * st.f_frsize
    return Room(st.f_bavail * st.f_frsize, inodes, st.f_blocks * st.f_frsize, st.f_frsize, reserved)


def no_room(room: Room) -> bool:
    """Whether a filesystem with ``room`` (:func:`room_now`) is full for this process: less
    than one block free, or no inode (a state file's rewrite needs both). Never one that
    reports no size (``total`` 0: ramfs, a FUSE filesystem that answers no ``statfs``), which
    counts no room rather than having none: its writes say when it is full."""
    return room.total > 0 and (room.bytes < room.block or room.inodes == 0)


def mount_point(path: str | os.PathLike[str]) -> str:
    """The folder the filesystem holding ``path`` (an existing one) is mounted at, as this
    process's mounts list it (:func:`~cachepipe.filesystems.mount_at`: a bind mount's own point,
    a btrfs subvolume's mount); where they cannot be read, the highest folder above it, links
    resolved, on the same device."""
    point = mount_at(os.fspath(path))[0]
    if point:
        return point
    path = os.path.realpath(path)
    device = os.stat(path).st_dev
    while True:
        parent = os.path.dirname(path)
        if parent == path or os.stat(parent).st_dev != device:
            return path
        path = parent


def full_disk(given: str | os.PathLike[str], root: str | os.PathLike[str], exc: OSError | None = None) -> OSError | None:
    """The error to raise, chained to ``exc``, when the cache directory ``root`` (``given`` as
    the user wrote it) cannot be opened because its disk is full: ``exc`` a write refused for
    want of room (:data:`FULL_ERRNOS`), or None when :func:`no_room` said so before anything
    failed. Its errno is ``exc``'s (``ENOSPC`` without one); it names the filesystem and its
    mount point, what it has free, what the cache holds there and what the other files hold, the
    file that could not be written, and what to do. None when ``exc`` is another error."""
    if exc is not None and exc.errno not in FULL_ERRNOS:
        return None
    code = errno.ENOSPC if exc is None or exc.errno is None else exc.errno
    probe = os.path.abspath(root)
    while not os.path.exists(probe):  # the cache directory not made yet: its nearest folder
        probe = os.path.dirname(probe)
    try:
        room, point = room_now(probe), mount_point(probe)
        held = held_in(root) if os.path.isdir(root) else 0
    except OSError as again:  # removed meanwhile, or not ours to look at: the error as it came
        return None if exc is None else OSError(code, f"cache_dir {os.fspath(given)!r}: {exc.strerror} ({again})")
    said = os.strerror(code)  # "No space left on device", "Disk quota exceeded": what a full disk says elsewhere
    failed = ""  # the write that failed, where one did
    if exc is not None and exc.filename:
        failed = f"; could not write {exc.filename!r}"
    elif exc is not None and exc.strerror and exc.strerror != said:  # named by wholefiles.naming, or another text
        failed = f"; {exc.strerror.removeprefix(said + ': ')}"
    others = max(room.total - room.bytes - room.reserved - held, 0)  # blocks kept for root, or by btrfs, are no file's
    holds = f"the cache holds {format_size(held)} of it, other files {format_size(others)}"
    if room.reserved and filesystem_at(probe) in ROOT_RESERVES:
        holds += f", and {format_size(room.reserved)} is reserved for root (not free to other users)"
    elif room.reserved:
        holds += f", and {format_size(room.reserved)} is kept back by the filesystem (counted free, given to no file)"
    if code == errno.EDQUOT:
        why = f"this user's disk quota on the filesystem mounted at {point!r} is used up ({said}){failed}; {holds}"
        todo = "free some of this user's files there, raise the quota, or give a cache_dir on another filesystem"
    else:
        inodes = ", and no inode" if room.inodes == 0 else ""
        free = f"{format_size(room.bytes)} free of {format_size(room.total)}{inodes}"
        why = f"its disk is full ({said}): the filesystem mounted at {point!r} has {free}{failed}; {holds}"
        todo = "free space there, or give a cache_dir on another filesystem"
    return OSError(code, f"cache_dir {os.fspath(given)!r}: {why}; {todo}")


@contextlib.contextmanager
def said_full(given: str | os.PathLike[str], root: str | os.PathLike[str]) -> Iterator[None]:
    """Raise a write of the block refused for want of room as :func:`full_disk` of the cache
    directory ``root`` (chained); any other error goes through as it is."""
    try:
        yield
    except OSError as exc:
        error = full_disk(given, root, exc)
        if error is None:
            raise
        raise error from exc
