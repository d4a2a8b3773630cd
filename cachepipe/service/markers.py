"""File-marker acks: consumers that do not speak HTTP acknowledge an item on disk.

- Folder items (``items: folders``): write the item's lease into ``<item>/.done`` (or create it
  empty), or delete the item folder.
- Single-file items (``items: files``): delete the file. There is no marker file: a
  ``<file>.done`` beside it could collide with another object's name and would be left behind.

The daemon watches, through inotify (:mod:`cachepipe.service.inotify`), each cache directory and
each item it has handed out (:class:`MarkerWatcher`), and calls :meth:`cachepipe.Pipeline.ack`
with the item's path, usually well within a second. The calls that add a watch (under a cache
directory on a local file system: :func:`hold_under`) and remove one keep the interpreter's lock.

A marker is judged once it is complete: when its writer closes it, when it is moved into place,
when it is touched, or when it is made as a link (a regular file just created is not judged
then: its writer may not have written it yet). What it holds (:func:`read_marker`) says whose
it is, and whether it acknowledges the hand-out it was made for (:func:`marker_counts`): that
pure policy, :func:`acked_by` (which event acknowledges which item) and the record of hand-outs
(:class:`HandOuts`) are in :mod:`cachepipe.service.marker_policy`, and importable from here.
:class:`MarkerWatcher` does the watching.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable

from ..errors import ConfigError
from ..filesystems import LOCAL_FILESYSTEMS, filesystem_at, lookups_stay_local
from .inotify import IN_Q_OVERFLOW, Event, Inotify
from .marker_policy import (
    MARKER,
    MARKER_BYTES,  # noqa: F401 - importable from here, as before
    STATE_DIR,  # noqa: F401 - importable from here, as before
    HandOut,
    HandOuts,
    Kind,
    MarkerId,  # noqa: F401 - importable from here, as before
    Verdict,
    acked_by,
    marker_counts,
    marker_identity,
    read_marker,
)

__all__ = [
    "MARKER",
    "HandOut",
    "HandOuts",
    "MarkerWatcher",
    "Verdict",
    "acked_by",
    "hold_under",
    "marker_counts",
    "marker_identity",
    "read_marker",
]

log = logging.getLogger("cachepipe.service.markers")

# What each watch asks the kernel for: a cache directory and a single-file item's folder, a
# child deleted or moved away; a handed-out item folder, a file complete in it (closed after
# writing, moved in, or touched: Python's Path.touch() of a file that exists is a utime alone, an
# IN_ATTRIB), or created: a link is complete when made, a regular file is judged when its
# writer closes it (it may not have written its lease yet: _Events.on_event). The kernel's
# constants (<sys/inotify.h>), a stable ABI.
_IN_ATTRIB, _IN_CLOSE_WRITE, _IN_MOVED_FROM, _IN_MOVED_TO, _IN_CREATE, _IN_DELETE = 0x4, 0x8, 0x40, 0x80, 0x100, 0x200
_IN_ONLYDIR = 0x01000000
_GONE = _IN_DELETE | _IN_MOVED_FROM | _IN_ONLYDIR
_MADE = _IN_CREATE | _IN_CLOSE_WRITE | _IN_MOVED_TO | _IN_ATTRIB
_MARKER = _MADE | _IN_ONLYDIR
_ANY = _IN_DELETE | _IN_MOVED_FROM | _MADE

READ_EVERY = 0.05
"""Seconds the marker watcher lets events gather between two reads (so the latency it adds to a
marker's acknowledgement), unless a read returned at least ``_LONG_READ`` events."""
_LONG_READ = 256

LOOK_AFTER = 0.25
"""Seconds after its hand-out that an item's own watch is added (:meth:`MarkerWatcher.follow`),
if it is still handed out then. A consumer that acknowledges over the API soon after taking its
items (a batch acked with the next) costs no watch; a marker made (or an item deleted) before
the watch is added is found by a look right after adding it."""


_held_under: dict[str, tuple[bytes, bytes | None]] = {}  # cache directory -> (it, it + "/" or None), encoded: see hold_under


def hold_under(root: str, fstype: str | None, items: str = "folders") -> None:
    """Add watches on the cache directory ``root`` (absolute and normal), and on the folder items
    right in it (``items`` "folders"), keeping the interpreter's lock if its file system (type
    ``fstype``, as ``/proc/self/mountinfo`` names it) is local, and its lookups pass no other kind
    of file system above it (the caller's check, :func:`~cachepipe.filesystems.lookups_stay_local`):
    there the item just handed out is in the kernel's cache. ``fstype`` None: no longer watched.
    Any other folder under ``root`` (a nested item's, a single-file item's subfolder) may be
    anything a user put there (a link, a mount), as in :mod:`cachepipe.fscalls`: its watch is
    added by a call that lets the lock go, since its lookup may wait for a server (NFS, FUSE)
    and would stop every thread of the daemon meanwhile."""
    if fstype in LOCAL_FILESYSTEMS:
        _held_under[root] = (os.fsencode(root), os.fsencode(root.rstrip("/") + "/") if items == "folders" else None)
    else:
        _held_under.pop(root, None)


def _holds(path: bytes) -> bool:
    """Whether the watch of ``path`` is added keeping the interpreter's lock (:func:`hold_under`)."""
    for top, prefix in list(_held_under.values()):  # a copy: another thread may register one
        if path == top or (prefix is not None and path.startswith(prefix) and b"/" not in path[len(prefix) :]):
            return True
    return False


class _Events:
    """The events of one inotify watch of a :class:`MarkerWatcher` (called in its thread)."""

    def __init__(self, watcher: MarkerWatcher, served: _Watched, directory: str) -> None:
        self.watcher, self.served, self.directory = watcher, served, directory.rstrip("/") + "/"

    def on_event(self, event: Event) -> None:
        if not event.name or not event.mask & _ANY:
            return
        name = os.fsdecode(event.name)
        path = self.directory + name
        if event.mask & _ANY == _IN_CREATE and (name != MARKER or _being_written(path)):
            return  # a file a consumer writes: judged once closed (IN_CLOSE_WRITE), if it is a marker
        kind: Kind = "created" if event.mask & _MADE else "deleted"
        self.watcher.judge(self.served, path, kind, event.is_directory)


def _being_written(path: str) -> bool:
    """Whether a file just created at ``path`` is one a writer may still be writing (a regular
    file of one name: it is judged when closed); a link, a hard link to a file made before, or a
    folder is complete when made (or ``path`` is gone: nothing to judge)."""
    try:
        st = os.lstat(path)
    except OSError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _own_folder(served: _Watched, item: str) -> str:
    """The folder an item's own watch is on: a folder item's own, else the folder its file is in
    (the cache directory's for a top-level file, which needs no watch of its own)."""
    return item if served.items == "folders" else os.path.dirname(item)


@dataclasses.dataclass
class _Watched:
    """A watched cache directory: its pipeline, its ``items`` setting, its own watch."""

    name: str
    root: str  # absolute and normal
    items: str
    wd: int
    id: int


class MarkerWatcher:
    """Watches what can acknowledge an item, through one inotify instance
    (:class:`~cachepipe.service.inotify.Inotify`) read by one thread in batches
    (:data:`READ_EVERY`): each cache directory (an item folder, or a top-level file item,
    deleted or moved away) and, from :data:`LOOK_AFTER` after its hand-out (:meth:`follow`;
    added by a second thread, with a look for what came before) to its end (:meth:`unfollow`),
    each handed-out item: its folder (a ``.done`` made in it) or, for a single-file item in a
    subfolder, that subfolder (the file deleted or moved away). Nothing else is watched:
    downloads into staging, publishes, the evictions of items not handed out and the items
    acknowledged sooner cost the daemon no event.

    Args:
        on_ack: called from the watcher's threads as ``on_ack(name, item_path, how, looked)`` for
            every event that acknowledges an item (``how``: ``"marker"`` or ``"deleted"``), and
            for what the look finds when an item's own watch is added (``looked`` True: no event
            was seen, the ``.done`` or the deletion may be older than the hand-out).
    """

    def __init__(self, on_ack: Callable[[str, str, str, bool], None]) -> None:
        self._on_ack = on_ack
        self._inotify: Inotify | None = None
        self._lock = threading.Lock()  # _served, _followed; taken before Inotify's own lock, never after
        self._ids = itertools.count(1)
        self._served: dict[str, _Watched] = {}  # by pipeline name
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # item path (a string, as every path here: making and hashing a Path for each follow,
        # unfollow and event was a quarter of the daemon's CPU per item) -> pipeline, its watch
        self._followed: dict[str, tuple[str, int | None, int]] = {}
        self._due: dict[str, float] = {}  # followed items whose own watch is not added yet -> when it is due (in that order)
        self._due_added = threading.Condition(self._lock)  # _due gained its first item: the due thread may sleep untimed
        self._due_thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the watcher's thread.

        Raises:
            ConfigError: this system has no inotify (it is Linux's): marker acks are unavailable.
        """
        if not sys.platform.startswith("linux"):
            raise ConfigError(
                f"markers: true needs Linux's inotify, and this system is {sys.platform!r}; set "
                "markers: false and acknowledge items over the API"
            )
        inotify = Inotify()
        self._inotify = inotify
        self._stopping.clear()
        self._thread = threading.Thread(target=self._read, args=(inotify,), name="cachepipe-markers", daemon=True)
        self._thread.start()
        self._due_thread = threading.Thread(target=self._add_when_due, name="cachepipe-markers-due", daemon=True)
        self._due_thread.start()

    def _read(self, inotify: Inotify) -> None:
        """The watcher's thread: read the events queued, dispatch them, then let the next ones
        gather for :data:`READ_EVERY` seconds (unless this read was long: more are waiting): a
        thread woken for each event takes the interpreter's lock from the request threads each
        time (read in batches, the daemon's CPU per item fell 4-8%, ``benchmarks/README.md``).
        An event whose handling fails is logged and the watch goes on."""
        while not self._stopping.is_set():
            try:
                events = inotify.read()
            except OSError as exc:
                log.error("the marker watch stopped: %s; items are acknowledged over the API or by their lease", exc)
                return
            for event in events:
                try:
                    if event.mask & IN_Q_OVERFLOW:
                        self.overflowed()
                    else:
                        inotify.handle(event)
                except Exception:  # a defect: logged, the other events still count
                    log.exception("handling the marker event %r failed", event)
            if len(events) < _LONG_READ:
                self._stopping.wait(READ_EVERY)

    def _add_when_due(self) -> None:
        """The thread that adds items' own watches when they are due (:meth:`_add_due`): it
        waits on :attr:`_due_added` until the next is due, or without a timeout while none is
        (:meth:`follow` wakes it)."""
        while not self._stopping.is_set():
            try:
                wait = self._add_due()
            except Exception:  # a defect: logged, and the watches due are tried again shortly
                log.exception("adding the handed-out items' marker watches failed")
                wait = READ_EVERY
            with self._lock:
                if self._stopping.is_set():
                    return
                if wait is None and not self._due:
                    self._due_added.wait()
                elif wait is not None:
                    self._due_added.wait(wait)

    def _add_due(self) -> float | None:
        """Add the own watch of each followed item whose time has come (:data:`LOOK_AFTER`
        after its hand-out), then look for what may have acknowledged it before: a ``.done`` in
        a folder item, a single-file item deleted (judged as the event would be). Returns the
        seconds until the next is due; None if none is."""
        now = time.monotonic()
        due_now: list[tuple[_Watched, str, bool]] = []
        wait = None
        with self._lock:
            while self._due:
                item, due = next(iter(self._due.items()))  # the earliest: they are due in the order followed
                if due > now:
                    wait = due - now
                    break
                del self._due[item]
                served = self._served.get(self._followed[item][0])
                if served is not None and self._inotify is not None:
                    due_now.append((served, item, self._add_watch(self._inotify, served, item)))
        for served, item, added in due_now:  # what acknowledged it before its watch was there
            try:
                if added and served.items == "folders":
                    self.judge(served, f"{item}/{MARKER}", "created", False, looked=True)
                else:  # a single file, or a folder whose watch failed (gone: ENOENT; the watch limit): deleted?
                    self.judge(served, item, "deleted", served.items == "folders", looked=True)
            except Exception:  # a defect (or the ack's journal write failed): logged, the others still count
                log.exception("looking for an acknowledgement of %s failed", item)
        return wait

    def _require(self) -> Inotify:
        if self._inotify is None:
            raise RuntimeError("MarkerWatcher used before start() or after stop()")
        return self._inotify

    def watch(self, name: str, root: str | os.PathLike[str], items: str) -> None:
        """Watch ``root`` (which must exist) for pipeline ``name``; replaces an earlier watch.

        Raises:
            OSError: the watch cannot be added (``fs.inotify.max_user_watches`` reached).
        """
        self.unwatch(name)
        inotify = self._require()
        top = os.path.abspath(root)
        hold_under(top, filesystem_at(top) if lookups_stay_local(top) else "", items)
        with self._lock:
            id_ = next(self._ids)
            served = _Watched(name, top, items, -1, id_)
            path = os.fsencode(top)
            served.wd = inotify.add(path, _GONE, _Events(self, served, top).on_event, id_, hold=_holds(path))
            self._served[name] = served

    def unwatch(self, name: str) -> None:
        """Stop watching pipeline ``name``'s cache directory and its handed-out items."""
        with self._lock:
            served = self._served.pop(name, None)
            if served is None or self._inotify is None:
                return
            if all(other.root != served.root for other in self._served.values()):
                hold_under(served.root, None)
            ended = [(wd, id_) for path, (owner, wd, id_) in self._followed.items() if owner == name and wd is not None]
            self._followed = {path: got for path, got in self._followed.items() if got[0] != name}
            self._due = {path: due for path, due in self._due.items() if path in self._followed}
            self._inotify.remove([(served.wd, served.id), *ended])

    def follow(self, name: str, item: str, markers: bool = True, at_once: bool = False) -> None:
        """Item ``item`` (its absolute, normal path) of pipeline ``name`` was just handed out:
        watch what can acknowledge it, from :data:`LOOK_AFTER` seconds on if it is still handed
        out then (:meth:`_add_due`; what acknowledged it before is found by a look), so that an
        item acknowledged over the API soon after costs no watch. A watch that cannot be added
        (the watch limit) is logged: the item is then acknowledged over the API or by its lease.
        ``markers=False`` (its consumer acknowledges over the API): a folder item gets no watch of
        its own, only the cache directory's, which sees it deleted; a single-file item's
        subfolder is watched as ever (its watch sees nothing but deletions). ``at_once``: the
        watch is added now, with no look (an item handed out while markers were off: a
        ``.done`` already in it is not known to be this hand-out's)."""
        with self._lock:
            served = self._served.get(name)
            if served is None or item in self._followed or self._inotify is None:
                return
            self._followed[item] = (name, None, 0)
            if _own_folder(served, item) == served.root or (not markers and served.items == "folders"):
                return  # the root's watch sees it go
            if at_once:
                self._add_watch(self._inotify, served, item)
                return
            if not self._due:  # else the due thread waits for an earlier one, due before this
                self._due_added.notify()
            self._due[item] = time.monotonic() + LOOK_AFTER

    def _add_watch(self, inotify: Inotify, served: _Watched, item: str) -> bool:
        """Add the own watch of followed item ``item`` of ``served`` (under :attr:`_lock`): its
        folder for a folder item (a ``.done`` made), else the subfolder it is in (it deleted).
        False if it cannot be added: the item stays followed without one (the cache directory's
        watch still sees a folder item or a top-level file deleted); logged unless its folder is
        gone (ENOENT: the item was deleted, which acknowledges it)."""
        folder = _own_folder(served, item)
        id_ = next(self._ids)
        mask = _MARKER if served.items == "folders" else _GONE
        path = os.fsencode(folder)
        try:
            wd = inotify.add(path, mask, _Events(self, served, folder).on_event, id_, hold=_holds(path))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                what, how = (
                    (f"a .done in {item}", "over the API or by deleting it")
                    if served.items == "folders"
                    else (f"the deletion of {item}", "over the API or let its lease expire")  # a file in a subfolder
                )
                log.warning("%s: %s is not watched (cannot watch %s: %s): acknowledge it %s", served.name, what, folder, exc, how)
            return False
        self._followed[item] = (served.name, wd, id_)
        return True

    def unfollow(self, item: str) -> None:
        """The hand-out of ``item`` ended (acknowledged or released): stop watching it."""
        with self._lock:
            got = self._followed.pop(item, None)
            self._due.pop(item, None)
            if got is not None and got[1] is not None and self._inotify is not None:
                self._inotify.remove([(got[1], got[2])])

    def judge(self, served: _Watched, path: str, kind: Kind, is_directory: bool, looked: bool = False) -> None:
        """An event at ``path`` in a watched folder of ``served`` (``looked``: what a look
        found, no event): acknowledge the item it names (:func:`acked_by`) if that item is
        handed out and the event is still true."""
        hit = acked_by(served.root, path, kind, is_directory, served.items)
        if hit is None:
            return
        item, how = hit
        with self._lock:
            if self._followed.get(item, ("",))[0] != served.name:
                return  # not handed out (our own evictions): no file-system call
        # Act only on what is still true: a stale event must not ack a later hand-out.
        if how == "marker" and not os.path.lexists(f"{item}/{MARKER}"):
            return
        if how == "deleted" and os.path.lexists(item):
            return
        self._on_ack(served.name, item, how, looked)

    @staticmethod
    def overflowed() -> None:
        log.warning(
            "the kernel's inotify queue overflowed: marker events were lost; an item whose marker was missed "
            "stays leased until it is acknowledged over the API, deleted again, or its lease expires"
        )

    def stop(self) -> None:
        """Stop watching; joins the watcher's threads (its inotify instance is closed)."""
        with self._lock:
            inotify, self._inotify = self._inotify, None
            self._served.clear()
            self._followed.clear()
            self._due.clear()
            self._stopping.set()
            self._due_added.notify_all()  # wakes the due thread
        if inotify is not None:
            inotify.wake()  # the watcher's thread, if it waits for events; else it sees _stopping
        for thread in (self._thread, self._due_thread):
            if thread is not None:
                thread.join()
        self._thread = self._due_thread = None
        if inotify is not None:
            inotify.close()  # no thread reads it now
