"""The writes of a destination on the local filesystem (``file://`` or a plain path, through the
fsspec backend's :meth:`~cachepipe.stores.fsspec.FsspecStore.put` and ``delete``), which fsspec's
own ``put`` and ``rm`` do not make safe: a file appears whole or not at all, and what a delete
empties is removed and made durable; the temporary files that killed uploads left are removed
(:func:`remove_stale_temps`).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import uuid
from collections.abc import Sequence
from typing import BinaryIO

from ..fscalls import sync_folder
from ..wholefiles import open_temp, remove_unlocked
from .base import TEMP_SUFFIX, read_local

__all__ = ["delete_local", "put_local", "remove_stale_temps"]

log = logging.getLogger("cachepipe.stores.localwrites")


def put_local(src: BinaryIO, path: str, where: str) -> None:
    """Copy the file ``src`` (from :func:`~cachepipe.stores.base.open_local`, its read errors
    :class:`~cachepipe.errors.LocalFileError`) to ``path`` (``where``) on a local filesystem: to ``<path>.cachepipe.tmp``
    beside it, ``fsync``-ed and renamed over it once whole, so that a reader never sees part of it.
    The rename reaches the disk with its folder's next ``fsync`` (:meth:`~cachepipe.stores.fsspec.FsspecStore.sync`).

    The temporary file's name is the same at every put of ``path``, so one that a killed upload
    left (a SIGKILL leaves it; an exception removes it) is overwritten by the next put of that
    path, or removed by the next ``cachepipe map`` over the destination (:func:`remove_stale_temps`),
    not left for good. It is locked (``flock``) while it is written: a second put of the
    same path at the same time waits for the first. On a filesystem without locks (``NO_LOCKS``) the
    name is made unique instead (``<path>.cachepipe-<id>.tmp``), and a killed upload leaves it
    (:func:`~cachepipe.wholefiles.open_temp`)."""
    fd, temp = open_temp(path + TEMP_SUFFIX, lambda: f"{path}.cachepipe-{uuid.uuid4().hex[:12]}.tmp")
    try:
        os.ftruncate(fd, 0)  # what a killed upload wrote
        with open(fd, "wb", closefd=False) as dst:
            while chunk := read_local(src, where):
                dst.write(chunk)
        os.fsync(fd)  # its bytes on disk before its name: after a power cut the name holds all of them
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    finally:
        os.close(fd)


def delete_local(root: str, keys: Sequence[str], within: str) -> None:
    """Remove the files ``keys`` under the folder ``root`` (one already gone is no error), then
    the folders this leaves empty, deepest first, up to ``root/within`` (kept), then ``fsync``
    each folder whose entries changed (:func:`~cachepipe.fscalls.sync_folder`)."""
    stop = os.path.join(root, within).rstrip("/") if within else root
    emptied: set[str] = set()
    for key in keys:
        path = os.path.join(root, key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        emptied.add(os.path.dirname(path))
    changed = set(emptied)
    for deepest in sorted(emptied, key=len, reverse=True):  # deepest first: a parent empties after its children
        folder = deepest
        while folder != stop and folder.startswith(stop + "/"):
            try:
                os.rmdir(folder)
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):  # still holds files; removed already
                    break
                raise
            changed.discard(folder)
            folder = os.path.dirname(folder)
            changed.add(folder)
    for folder in sorted(changed):
        if os.path.isdir(folder):
            sync_folder(folder)


def remove_stale_temps(root: str) -> list[str]:
    """Remove the temporary files (``*.cachepipe.tmp``) under the folder ``root`` that no
    :func:`put_local` holds locked: those that killed uploads left. Return their paths relative
    to ``root``. A file that a live upload writes (its ``flock`` is held) is kept; so is every
    one on a filesystem without locks (``NO_LOCKS``: no writer can be told from a dead one, see
    :func:`~cachepipe.wholefiles.remove_unlocked`). A ``root`` not made yet holds none; a folder
    under it that cannot be listed (another user's) is passed over, with a warning: this is
    housekeeping, which a folder the destination's writes never use must not fail.

    Raises:
        OSError: an error of the removal of a file (an I/O error).
    """

    def failed(exc: OSError) -> None:
        if not isinstance(exc, FileNotFoundError):  # a folder removed meanwhile holds none
            log.warning("not looking for temporary files that killed uploads left in %s: %s", exc.filename, exc)

    removed: list[str] = []
    for folder, _, files in os.walk(root, onerror=failed):
        temps = [os.path.join(folder, name) for name in files if name.endswith(TEMP_SUFFIX)]
        removed.extend(os.path.relpath(path, root) for path in temps if remove_unlocked(path))
    return removed
