"""File-marker acks: consumers that do not speak HTTP acknowledge an item on disk.

- Folder items (``items: folders``): create ``<item>/.done`` (an empty file: 0 bytes under the
  cap), or delete the item folder.
- Single-file items (``items: files``): delete the file. There is no marker file: a
  ``<file>.done`` beside it could collide with another object's name and would be left behind.

The daemon watches each cache directory through inotify (watchdog) and calls
:meth:`cachepipe.Pipeline.ack` with the item's path, usually well within a second. A marker
carries no lease: it acknowledges whoever holds the item now, so ``lease_timeout`` must exceed
the time a consumer needs. A marker for an item that is not handed out (its lease expired and
it went back to the queue, or a source folder that ships a ``.done`` file) is ignored.

:func:`acked_by` is the pure policy (which event acknowledges which item);
:class:`MarkerWatcher` does the watching.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
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

__all__ = ["MARKER", "acked_by", "MarkerWatcher"]

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
