"""A served pipeline whose cache's disk was full when it opened: it waits for room, and opens then.

:class:`~cachepipe.Pipeline` ``open`` fails at once on a full disk (:func:`cachepipe.cache.fulldisk.full_disk`:
a library's caller decides); the daemon instead starts, serves the others, answers status and
health (``waiting for room``), and opens that pipeline once another writer frees room, as a
running cache waits for room for its items. :class:`RoomWait` is that wait: one thread
(``cachepipe-room-NAME``) that looks at the filesystem's free space every :data:`LOOK_EVERY`
seconds and tries the open again once the disk is no longer full, and after a try that still
found too little room, only when the room has grown since (above the less of what that try
began with and what it left: room another writer freed while it ran is not taken for room it
saw) and no sooner than :data:`RETRY_AFTER` seconds after it, doubled after each such try up to
:data:`MOST_APART` (a try may list the source: not once per look, nor once per file another
writer frees); after a try that met a quota used up (``EDQUOT``), which the free space does not
show (nor a quota raised since), at those times whatever the room, while the disk is not full;
quietly (the daemon said once that it waits); a stop ends it at once, closing a
pipeline it is opening (which aborts that open's listing). An open that fails otherwise is
tried again every :data:`RETRY_AFTER` seconds (the store not answering, the source empty:
what a start failing so exits 1 for, and systemd starts again), the pipeline down meanwhile
(a try that finds the disk full again makes it wait for room again);
one refused by its settings or its data as listed (what a start exits 78 for) stays down until
a reload, as a reload's failed open does.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable

from ..cache.fulldisk import FULL_ERRNOS, Room, no_room, room_now
from ..errors import ConfigError, OversizeError, UnsafeKeyError
from ..pipeline import Pipeline

__all__ = ["LOOK_EVERY", "MOST_APART", "RETRY_AFTER", "RoomWait", "is_full_disk"]

log = logging.getLogger("cachepipe.service")

LOOK_EVERY = 0.5
"""Seconds between two looks at the free space of a full cache's filesystem (one ``statvfs``)."""

RETRY_AFTER = 5.0
"""Seconds before an open that failed otherwise than for room is tried again (systemd's
``RestartSec`` in the unit: what a start failing so would have waited); and the least time
between two tries that found the disk full."""

MOST_APART = 60.0
"""Seconds between two tries that found the disk full, at most: the time after such a try
doubles from :data:`RETRY_AFTER` to this."""


_PERMANENT = (ConfigError, UnsafeKeyError, OversizeError)
"""Failures of an open that a start exits 78 for (``cachepipe.service.main``: systemd does not
start it again): the pipeline stays down until a reload. Any other is tried again."""


def is_full_disk(exc: BaseException) -> bool:
    """Whether ``exc``, raised by a pipeline's open, is its cache's disk (or quota) full."""
    return isinstance(exc, OSError) and exc.errno in FULL_ERRNOS


class RoomWait:
    """Open a pipeline once the filesystem of ``root`` has room.

    Args:
        name: the pipeline's name (the thread's name, the log).
        root: its cache directory (or, before it is made, a folder above it).
        make: a new, unopened :class:`Pipeline` for each try.
        open_: opens it (the daemon's open: its marker watch, then ``Pipeline.open``).
        opened: called with the open pipeline, in the thread; returns False if it was not taken
            (the daemon stops): then it is closed here.
        failed: called with an error of the settings or the data as listed (:data:`_PERMANENT`):
            the pipeline stays down.
        retrying: called with another error (the store not answering, the source empty for a
            while...), in the thread; the open is tried again after :data:`RETRY_AFTER` seconds,
            whatever the room then.
        full: called with the error of a try that found the disk full (:func:`is_full_disk`),
            in the thread: the pipeline waits for room (again, after a ``retrying``).
    """

    def __init__(
        self,
        name: str,
        root: str | os.PathLike[str],
        make: Callable[[], Pipeline],
        open_: Callable[[Pipeline], object],
        opened: Callable[[Pipeline], bool],
        failed: Callable[[BaseException], None],
        retrying: Callable[[BaseException], None],
        full: Callable[[OSError], None],
    ) -> None:
        self.name, self.root = name, os.path.abspath(root)  # its nearest existing folder is looked at: one there is
        self._make, self._open, self._opened, self._failed = make, open_, opened, failed
        self._retrying, self._full = retrying, full
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _opening and the stop's close of it
        self._opening: Pipeline | None = None
        self._thread = threading.Thread(target=self._run, name=f"cachepipe-room-{name}", daemon=True)
        # the room of the last try that found too little (None: no try since the wait began): the less of
        # what it began with and what was left after it (room another writer freed meanwhile is no room it saw)
        self._last: Room | None = None
        self._quota = False  # the last such try met a quota used up (EDQUOT), which the free space does not show
        self._apart = RETRY_AFTER  # seconds after a try that found the disk full before the next (doubles)
        self._not_before = 0.0  # monotonic time before which no try is made after one that found the disk full

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the wait at once: a pipeline being opened is closed (its listing aborted); joins
        the thread. Idempotent."""
        with self._lock:
            self._stop.set()
            opening = self._opening
        if opening is not None:
            opening.close()  # returns once its open has failed
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()

    def _room(self) -> Room | None:
        probe = self.root
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        try:
            return room_now(probe)
        except OSError:
            return None

    def _grew(self, now: Room | None) -> bool:
        """Whether to try the open again: the disk is no longer full, the first time (room freed
        since the open failed, even before this wait began, is not missed); then, once the time
        apart from the last failed try has passed, whenever the room is more than that try had (in
        bytes, or in inodes where none was left), or, where that try met a quota used up (which
        the free space does not show: a quota raised shows nowhere), whenever the disk is not full."""
        last = self._last
        if now is None or time.monotonic() < self._not_before:
            return False  # not to be looked at now: looked at again next time
        if last is None or self._quota:
            return not no_room(now)
        return now.bytes > last.bytes or (last.inodes == 0 and now.inodes > 0)

    def _run(self) -> None:
        said = ""  # the last failure other than for room, as logged
        again = False  # an open that failed otherwise: tried again after RETRY_AFTER, whatever the room
        while not self._stop.wait(LOOK_EVERY):
            now = self._room()
            if not (again or self._grew(now)):
                continue
            again, before = False, now  # the room this try begins with
            try:
                with self._lock:
                    if self._stop.is_set():
                        return
                    pipe = self._opening = self._make()  # its checks of the settings raise here
                self._open(pipe)
            except BaseException as exc:  # noqa: BLE001 - any failure: a full disk waits on, the others are said
                with self._lock:
                    self._opening = None
                    stopped = self._stop.is_set()
                if stopped:
                    return  # closed by stop() while it opened
                if isinstance(exc, OSError) and is_full_disk(exc):
                    self._last, self._quota = _less(before, self._room()), exc.errno == errno.EDQUOT
                    self._not_before = time.monotonic() + self._apart
                    log.debug("%s: still no room to open on, tried again in %g s at the soonest: %s", self.name, self._apart, exc)
                    self._apart = min(self._apart * 2, MOST_APART)
                    self._full(exc)
                    continue
                if isinstance(exc, _PERMANENT) or not isinstance(exc, Exception):
                    self._failed(exc)
                    return
                # what a start failing so exits 1 for, and systemd starts again: tried again
                error = f"{type(exc).__name__}: {exc}"
                (log.debug if error == said else log.warning)(
                    "pipeline %s: its open failed, tried again every %g s: %s", self.name, RETRY_AFTER, error
                )
                said, self._last, again = error, None, True
                self._retrying(exc)
                if self._stop.wait(RETRY_AFTER):
                    return
                continue
            with self._lock:
                self._opening = None
                keep = not self._stop.is_set() and self._opened(pipe)
            if not keep:
                pipe.close()
            return


def _less(one: Room | None, other: Room | None) -> Room | None:
    """The lesser of two measures of the same filesystem's room (either may be None: not read)."""
    if one is None or other is None:
        return other if one is None else one
    return other._replace(bytes=min(one.bytes, other.bytes), inodes=min(one.inodes, other.inodes))
