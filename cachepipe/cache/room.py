"""What a capacity given as a share of the disk is of, and the note of its size a cache leaves
when it closes.

A share (``"80%"``) is of the space free on the cache's filesystem and of what the cache
folders concerned hold already (a cache's own items are its room, not taken from it). What a
folder holds is a walk of its files, one ``lstat`` each: seconds for a million small files, in
every DataLoader worker at every pass, each of which measures the folders of all its siblings.
So a cache that closes walks its folder once and writes down what it holds, what deleting its
files and folders would free (``<folder>/.cachepipe/held``, with
the identity of its journal and the folder's change time then), and a measure of a cache
folder trusts the note while both are as it says. The next owner removes the note when its
recovery begins, before it changes anything (and rewrites the journal when it ends; an owner of
an earlier version, which leaves the note, does that too). A note
that cannot be read, or a folder without one (its owner is running, or was killed), is walked.
Only cache folders are measured so (a cache's own, a DataLoader worker's siblings'): files
written or deleted deeper into a folder after its cache closed change neither the journal nor
the folder's change time, so the note does not see them (one deleted so is counted as held and
as free both: a share that much larger).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from ..blocks import clamp_block
from ..removal import taken, tree_bytes
from .lock import STATE_DIR

__all__ = ["block_at", "drop_note", "held_in", "room_at", "write_note"]

log = logging.getLogger("cachepipe.cache")

NOTE = "held"  # in the state folder: "<bytes> <journal's st_ino> <st_size> <st_mtime_ns> <folder's st_mtime_ns>"
JOURNAL = "journal"
STAGING = "staging"  # downloads under way; what a close could not remove, the next open does first


def room_at(
    path: str | os.PathLike[str], held: Iterable[str | os.PathLike[str]], caches: bool = False, free: int | None = None
) -> int:
    """What a capacity given as a share of the disk is of, in bytes: the space free on the
    filesystem of ``path`` (or of its nearest existing parent, before it is made) and what the
    folders ``held`` hold (walked; with ``caches``, folders each of one cache: :func:`held_in`;
    0 for one not there). A cache's own files are its room, not taken from it: one opened again
    over what it kept has the size it had.

    The folders are walked first, then the free space is read: bytes that a download writes
    meanwhile (a live :meth:`~cachepipe.cache.Cache.set_capacity`, a sibling cache measured
    while it runs) are not free space then, so they count once (as held) or, written after the
    walk passed their file, not at all (a room smaller by them, never larger). Read the other
    way round, they counted as free and as held both: a share of the disk larger by their share.
    (Bytes deleted while the walk runs, after it counted them, still count as held and as free:
    the items a cache evicts during a live change of its capacity, at most.) ``free``: the free
    space, read already by a caller for whom nothing writes in the folders meanwhile (a cache
    at its open); None: read here, after the walk."""
    probe = _nearest(path)
    measure = held_in if caches else functools.partial(tree_bytes, allocated=True)
    walked = sum(measure(folder) for folder in held)
    return (shutil.disk_usage(probe).free if free is None else free) + walked


def block_at(path: str | os.PathLike[str]) -> int:
    """The block a cache at ``path`` counts files in (:func:`~cachepipe.blocks.clamp_block` of
    its filesystem's ``f_frsize``): read at ``path``, or before it is made at its nearest
    existing parent, on whose filesystem it will be."""
    return clamp_block(os.statvfs(_nearest(path)).f_frsize)


def _nearest(path: str | os.PathLike[str]) -> str:
    """``path`` (absolute), or its nearest existing parent where it does not exist yet."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    return probe


def held_in(folder: str | os.PathLike[str]) -> int:
    """The bytes the files and folders under the cache folder ``folder`` take from the disk
    (:func:`~cachepipe.removal.tree_bytes` with ``disk``: what deleting them would free; a
    folder takes nothing on tmpfs): as its cache noted when it closed, if its journal and the
    folder's change time are still as noted; else walked. Not the ledger's charges, which count
    a block for each folder whatever the filesystem: a share of the disk of those would count
    room that is not there."""
    block = block_at(folder)
    noted = _read_note(Path(folder), block)
    return tree_bytes(folder, disk=True, block=block) if noted is None else noted


def write_note(root: Path, block: int) -> None:
    """Note what the cache folder ``root`` holds now that its journal is written for the last
    time (at its close), measured as :func:`held_in` walks it (``block``: the cache's, for a
    file whose blocks are not reported): every file and folder under it but the note and
    staging (removed by the next open before it measures the folder, when its close could not);
    its lock with its owner's line, which a release blanks and does not cut
    (:meth:`~.lock.OwnerLock.release`), the size it keeps. The
    marks are taken first: a change while this measures makes the note one not trusted. Not
    fatal if it fails: the folder is walked instead."""
    state_dir = root / STATE_DIR
    path, spare = state_dir / NOTE, state_dir / f"{NOTE}.new"
    try:
        marks = _marks(root)
        skip = {f"{STATE_DIR}/{NOTE}", f"{STATE_DIR}/{spare.name}", f"{STATE_DIR}/{STAGING}"}
        held = tree_bytes(root, skip=skip, disk=True, block=block)
        spare.write_text(f"{held} {marks}\n")
        os.replace(spare, path)
    except OSError as exc:
        log.debug("could not note the size of %s (%s): it is walked when measured", root, exc)
        with contextlib.suppress(OSError):
            os.unlink(spare)


def drop_note(root: Path) -> None:
    """Remove the note of the cache folder ``root`` (its new owner, when its recovery begins,
    before it changes anything): a note must not outlive the state it describes, also where the
    journal is not rewritten after the folder changed (an owner stopped between deleting stale
    items at recovery and rewriting the journal). Not fatal if it fails: the marks remain."""
    try:
        os.unlink(root / STATE_DIR / NOTE)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.debug("could not remove the note of the size of %s (%s): its marks still say when it stands", root, exc)


def _marks(root: Path) -> str:
    """What changes when a later owner (of any version) or anyone else changes the cache folder
    ``root`` at its top or its journal: the journal's inode, size and change time, and the
    folder's change time (nanoseconds)."""
    journal, folder = os.stat(root / STATE_DIR / JOURNAL), os.stat(root)
    return f"{journal.st_ino} {journal.st_size} {journal.st_mtime_ns} {folder.st_mtime_ns}"


def _read_note(root: Path, block: int) -> int | None:
    """The bytes noted for the cache folder ``root`` (and what the note itself takes), or None:
    no note, one not readable, or one whose marks (:func:`_marks`) have changed since."""
    try:
        with open(root / STATE_DIR / NOTE) as file:
            note, own = file.read(), taken(os.fstat(file.fileno()), block)
        held, _, marks = note.strip().partition(" ")
        if marks != _marks(root) or int(held) < 0:
            return None
        return int(held) + own
    except (OSError, ValueError):
        return None
