"""Which file systems a path is on, and which ones a lookup of it walks through, read from
``/proc/self/mountinfo``.

:mod:`cachepipe.fscalls` chooses a cache's calls by these answers (:func:`filesystem_at`: keep
the interpreter's lock on a memory or local file system; :func:`lookups_stay_local`: never where
a folder above the cache, or a link on the way to it, is on a file system not known to be
local); eviction, the daemon's markers and its host checks ask them too. Reading the mounts and
walking a path's folders and links is all this module does: it stages, writes and deletes
nothing. The parsers (:func:`filesystem_type`, :func:`filesystems_walked`) take the text of
``mountinfo`` as an argument, so that they are tested with any mounts.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterable, Iterator

__all__ = [
    "LINK_HOPS",
    "LOCAL_FILESYSTEMS",
    "MEMORY_FILESYSTEMS",
    "filesystem_at",
    "filesystem_type",
    "filesystems_walked",
    "lookups_stay_local",
    "mount_at",
    "mount_of",
    "paths_walked",
]

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "rootfs"})
"""File system types that keep files in memory only (as ``/proc/self/mountinfo`` names them)."""

LOCAL_FILESYSTEMS = MEMORY_FILESYSTEMS | {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "zfs", "overlay"}
"""File system types whose lookups of a path never wait for a server (memory, or a local
device): not NFS, SMB, FUSE, Ceph and the like, nor a type this does not know."""

_OCTAL = re.compile(r"\\([0-7]{3})")  # mountinfo writes a space in a path as \040


def _mounts(mountinfo: str) -> Iterator[tuple[str, str, str]]:
    """``(device, mount point, type)`` of each mount in the text of ``/proc/self/mountinfo``, in
    the order mounted."""
    for line in mountinfo.split("\n"):
        fields, _, tail = line.partition(" - ")
        parts, types = fields.split(" "), tail.split(" ")
        if len(parts) >= 5 and types[0]:
            yield parts[2], _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), parts[4]), types[0]


def _up(path: str) -> Iterator[str]:
    """``path`` (absolute, normal), then each folder above it, up to ``/``."""
    while True:
        yield path
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent


def mount_of(path: str, mountinfo: str, device: str = "") -> tuple[str, str]:
    """``(mount point, type)`` of the mount that holds ``path`` (absolute, links resolved), from
    the text of ``/proc/self/mountinfo``: of the mounts at ``path`` or a folder above it, the
    longest whose device is ``device`` (``"major:minor"`` of the path's ``st_dev``), else the
    longest of any device (the last mounted of equals); ``("", "")`` if none holds it. Where a
    mount hides a longer one (mounted later on a folder above it), only the device tells them
    apart; a btrfs subvolume's own device is listed nowhere, so its mount's point is the longest."""
    points: dict[str, tuple[str, str]] = {}
    for dev, point, fstype in _mounts(mountinfo):
        points[point] = (dev, fstype)  # the last mounted on a point
    held = [(folder, *points[folder]) for folder in _up(path) if folder in points]  # longest first
    for folder, dev, fstype in held:
        if device and dev == device:
            return folder, fstype
    return (held[0][0], held[0][2]) if held else ("", "")


def filesystem_type(path: str, mountinfo: str, device: str = "") -> str:
    """The type of the file system that holds ``path``: :func:`mount_of`'s; "" if none does."""
    return mount_of(path, mountinfo, device)[1]


def filesystems_walked(walked: Iterable[str], mountinfo: str) -> frozenset[str]:
    """The types of the file systems mounted at any of the paths ``walked`` (absolute, normal)
    or at a folder above one, "/" included, from the text of ``/proc/self/mountinfo``: those a
    lookup that walks them passes through. One hidden by a later mount on the same point counts
    too (more, never fewer)."""
    points: dict[str, set[str]] = {}
    for _device, point, fstype in _mounts(mountinfo):
        points.setdefault(point, set()).add(fstype)
    kinds: set[str] = set()
    seen: set[str] = set()
    for path in walked:
        for folder in _up(path):
            if folder in seen:  # and every folder above it
                break
            seen.add(folder)
            kinds |= points.get(folder, set())
    return frozenset(kinds)


def _mountinfo() -> str:
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        return f.read()


def mount_at(root: str) -> tuple[str, str]:
    """:func:`mount_of` the folder ``root``, from this process's mounts (``("", "")`` where they
    cannot be read)."""
    try:
        mountinfo = _mountinfo()
        dev = os.stat(root).st_dev
    except OSError:
        return "", ""
    return mount_of(os.path.realpath(root), mountinfo, f"{os.major(dev)}:{os.minor(dev)}")


def filesystem_at(root: str) -> str:
    """The type of the file system of the folder ``root`` (:func:`mount_at`; "" where the mounts
    cannot be read)."""
    return mount_at(root)[1]


LINK_HOPS = 40
"""The most symbolic links one lookup follows (Linux's limit); :func:`paths_walked` stops there."""


def paths_walked(path: str) -> list[str]:
    """Every path a lookup of ``path`` walks, in order, each absolute: its folders one after the
    other from ``/``, and where one is a symbolic link, the link itself, then its target's (up
    to :data:`LINK_HOPS` links; ``..`` goes up from where the walk is). A folder that does not
    exist is walked as a plain one.

    Raises:
        OSError: a step could not be read as a link or not (``ENAMETOOLONG``, ``EACCES``...), or
            the working folder of a relative ``path`` is gone.
    """
    walked: list[str] = []
    # not normalised as abspath does: ".." after a link is its target's parent
    whole = path if path.startswith("/") else os.path.join(os.getcwd(), path)
    here, todo, hops = "/", [p for p in whole.split("/") if p], 0
    while todo:
        name = todo.pop(0)
        if name in (".", ".."):
            here = os.path.dirname(here) if name == ".." else here
            continue
        step = os.path.join(here, name)
        walked.append(step)
        target = None
        if hops < LINK_HOPS:
            try:
                target = os.readlink(step)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOENT, errno.ENOTDIR):  # not a link; not there
                    raise
        if target is None:
            here = step
        else:
            hops += 1
            here = "/" if target.startswith("/") else here
            todo[:0] = [p for p in target.split("/") if p]
    return walked


def lookups_stay_local(root: str, mountinfo: str | None = None) -> bool:
    """Whether a lookup of a path under the folder ``root`` walks through local file systems
    only (:data:`LOCAL_FILESYSTEMS`): those mounted at each path it walks
    (:func:`paths_walked`: its folders, and the links it follows on the way) or above one
    (:func:`filesystems_walked`; ``mountinfo``: the text of ``/proc/self/mountinfo``, read if
    None). A call that keeps the interpreter's lock looks its path up from ``/``: a folder or a
    link on a network mount (a local disk mounted under an NFS home, a link kept on NFS to a
    local disk) may wait for its server there, and every thread with it. False where the mounts
    or the walk cannot be read."""
    try:
        walked = paths_walked(root) or ["/"]
        return filesystems_walked(walked, _mountinfo() if mountinfo is None else mountinfo) <= LOCAL_FILESYSTEMS
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return False
