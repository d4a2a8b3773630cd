"""File-marker acks: consumers that do not speak HTTP acknowledge an item on disk.

- Folder items (``items: folders``): create ``<item>/.done`` (an empty file: 0 bytes under the
  cap), or delete the item folder.
- Single-file items (``items: files``): delete the file. There is no marker file: a
  ``<file>.done`` beside it could collide with another object's name and would be left behind.

The daemon watches each cache directory through inotify (watchdog) and calls
:meth:`cachepipe.Pipeline.ack` with the item's path, usually well within a second.

Provenance: an event is processed some time after it happened (inotify, watchdog's queue), so
"a ``.done`` exists and the item is handed out now" does not prove a consumer made it. A marker
acknowledges only the hand-out it was made for: at each hand-out the daemon records the lease
and what ``<item>/.done`` was then (:class:`HandOuts`); a marker event acknowledges that lease
(never a later one) and only if the ``.done`` is not one that was there at hand-out. So a
``.done`` that is one of the item's own files (a dataset that ships one, listed in the catalog
or present when the item was published) never acknowledges it: ack such an item over the API
or by deleting it. A marker left by a consumer whose lease expired does not acknowledge the
next consumer's hand-out either. Deleting an item acknowledges the lease recorded at its
hand-out too.

:func:`acked_by` is the pure policy (which event acknowledges which item), :func:`marker_counts`
the pure provenance rule; :class:`HandOuts` records hand-outs; :class:`MarkerWatcher` does the
watching.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath
from typing import Literal

from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver, ObservedWatch

__all__ = ["MARKER", "HandOut", "HandOuts", "MarkerWatcher", "acked_by", "marker_counts", "marker_identity"]

log = logging.getLogger("cachepipe.service.markers")

MARKER = ".done"
STATE_DIR = ".cachepipe"  # the cache's own state folder: never an item
Kind = Literal["created", "deleted"]
# Kernel-side filter: no IN_MODIFY, so downloads writing into staging cost no events.
_EVENTS = [FileCreatedEvent, DirCreatedEvent, FileDeletedEvent, DirDeletedEvent, FileMovedEvent, DirMovedEvent, FileClosedEvent]


def acked_by(root: Path, path: str, kind: Kind, is_directory: bool, items: str) -> tuple[Path, str] | None:
    """The item a filesystem event acknowledges, as ``(item path, "marker" | "deleted")``, or None.

    Args:
        root: the cache directory.
        path: the path the event is about.
        kind: ``"created"`` (also a file closed after writing, or moved into place) or
            ``"deleted"`` (also moved away).
        is_directory: whether ``path`` is a directory.
        items: the pipeline's ``items`` setting, ``"folders"`` or ``"files"``.
    """
    try:
        rel = PurePosixPath(Path(path).relative_to(root).as_posix())
    except ValueError:
        return None
    parts = rel.parts
    if not parts or parts[0] == STATE_DIR or ".." in parts:
        return None
    if items == "folders":
        if kind == "created" and not is_directory and len(parts) == 2 and parts[1] == MARKER:
            return root / parts[0], "marker"
        if kind == "deleted" and is_directory and len(parts) == 1:
            return root / parts[0], "deleted"
        return None
    if kind == "deleted" and not is_directory:
        return root.joinpath(*parts), "deleted"
    return None


MarkerId = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns) of a marker file


def marker_identity(item: Path) -> MarkerId | None:
    """Which ``<item>/.done`` exists now (device, inode, change time), or None if none does."""
    try:
        st = os.lstat(item / MARKER)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


@dataclasses.dataclass(frozen=True)
class HandOut:
    """What the daemon knew when it handed an item out.

    Attributes:
        lease: the lease the item was handed out under.
        shipped: ``.done`` is one of the item's own files (it came with the dataset).
        before: the ``<item>/.done`` that existed at hand-out (:func:`marker_identity`), if any.
    """

    lease: str
    shipped: bool
    before: MarkerId | None


def marker_counts(handout: HandOut | None, now: MarkerId | None) -> bool:
    """Whether the marker ``now`` (the ``.done`` seen when its event is processed) is a
    consumer's acknowledgement of ``handout``: it exists, the item does not ship a ``.done`` of
    its own, and it is not the one that existed when the item was handed out."""
    return handout is not None and now is not None and not handout.shipped and now != handout.before


class HandOuts:
    """The hand-outs of every served pipeline, by absolute item path (thread-safe).

    The daemon records one at each hand-out (:meth:`record`, before the consumer learns the
    path), forgets it once the item is acknowledged or released, and asks :meth:`lease_for`
    which lease a marker or deletion event acknowledges.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[Path, HandOut] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_path)

    def record(self, path: Path, lease: str, files: Iterable[str], look: bool = True) -> None:
        """Item ``path`` (with ``files``, relative) was just handed out under ``lease``. With
        ``look`` False (no marker watch: a file-system call saved per item), the ``.done`` there
        at hand-out is not looked up: a watch started later by a reload counts any it sees."""
        handout = HandOut(lease, MARKER in files, marker_identity(path) if look else None)
        with self._lock:
            self._by_path[path] = handout

    def forget(self, path: Path, lease: str | None = None) -> None:
        """The hand-out of ``path`` ended (acknowledged or released); with ``lease``: only that one."""
        with self._lock:
            handout = self._by_path.get(path)
            if handout is not None and (lease is None or handout.lease == lease):
                del self._by_path[path]

    def forget_under(self, root: Path) -> None:
        """Every hand-out of the pipeline cached in ``root`` ended (it closed or was rebuilt)."""
        with self._lock:
            for path in [p for p in self._by_path if root in p.parents]:
                del self._by_path[path]

    def lease_for(self, item: Path, how: str) -> tuple[str | None, str]:
        """(the lease an event acknowledges, or None; why not, for the log).

        ``how`` is ``"marker"`` (judged by :func:`marker_counts` on the ``.done`` there now) or
        ``"deleted"`` (the item is gone: it acknowledges the lease recorded at its hand-out).
        """
        with self._lock:
            handout = self._by_path.get(item)
        if handout is None:
            return None, "not handed out"
        if how != "marker":
            return handout.lease, ""
        if handout.shipped:
            return None, f"{MARKER} is one of the item's own files (ack it over the API or by deleting it)"
        if marker_counts(handout, marker_identity(item)):
            return handout.lease, ""
        return None, f"this {MARKER} was there before the item was handed out"


class _Handler(FileSystemEventHandler):
    def __init__(self, root: Path, items: str, act: Callable[[Path, str], None]) -> None:
        self.root, self.items, self.act = root, items, act

    def dispatch(self, event: FileSystemEvent) -> None:
        kinds: list[tuple[Kind, str]] = []
        if event.event_type in ("created", "closed"):
            kinds.append(("created", os.fsdecode(event.src_path)))
        elif event.event_type == "deleted":
            kinds.append(("deleted", os.fsdecode(event.src_path)))
        elif event.event_type == "moved":
            kinds.append(("deleted", os.fsdecode(event.src_path)))
            if event.dest_path:
                kinds.append(("created", os.fsdecode(event.dest_path)))
        for kind, path in kinds:
            hit = acked_by(self.root, path, kind, event.is_directory, self.items)
            if hit is None:
                continue
            item, how = hit
            # Act only on what is still true: a stale event must not ack a later hand-out.
            if how == "marker" and not os.path.lexists(item / MARKER):
                continue
            if how == "deleted" and os.path.lexists(item):
                continue
            self.act(item, how)


class MarkerWatcher:
    """One inotify observer watching the cache directories of several pipelines.

    Args:
        on_ack: called from the observer thread as ``on_ack(name, item_path, how)`` for every
            event that acknowledges an item (``how``: ``"marker"`` or ``"deleted"``).
    """

    def __init__(self, on_ack: Callable[[str, Path, str], None]) -> None:
        self._on_ack = on_ack
        self._observer: BaseObserver | None = None
        self._watches: dict[str, ObservedWatch] = {}
        self._lock = threading.Lock()

    def start(self) -> None:
        observer = Observer()
        observer.name = "cachepipe-markers"
        observer.start()
        self._observer = observer

    def watch(self, name: str, root: Path, items: str) -> None:
        """Watch ``root`` (which must exist) for pipeline ``name``; replaces an earlier watch."""
        self.unwatch(name)
        if self._observer is None:
            raise RuntimeError("MarkerWatcher.watch() before start()")
        handler = _Handler(Path(os.path.abspath(root)), items, lambda item, how: self._on_ack(name, item, how))
        watch = self._observer.schedule(handler, str(root), recursive=True, event_filter=_EVENTS)
        with self._lock:
            self._watches[name] = watch

    def unwatch(self, name: str) -> None:
        with self._lock:
            watch = self._watches.pop(name, None)
        if watch is not None and self._observer is not None:
            try:
                self._observer.unschedule(watch)
            except KeyError:
                pass  # the emitter already stopped (its directory was deleted)

    def stop(self) -> None:
        """Stop watching; joins the observer's threads."""
        observer, self._observer = self._observer, None
        with self._lock:
            self._watches.clear()
        if observer is not None:
            observer.stop()
            observer.join()
