"""Linux inotify(7) through :mod:`ctypes`: one instance, watches shared by callbacks, events read
in batches (the marker watch's layer, :mod:`cachepipe.service.markers`).

The kernel's interface is small and stable (``<sys/inotify.h>``): ``inotify_init1`` makes an
instance (a file descriptor); ``inotify_add_watch`` adds the watch of a path, or extends it
(``IN_MASK_ADD``), and returns its descriptor, the same one for the same inode;
``inotify_rm_watch`` removes it; ``read`` returns packed ``struct inotify_event`` records; a
watch whose inode is deleted (or whose file system is unmounted) ends with ``IN_IGNORED``.
:class:`Inotify` adds what the marker watch needs above that: several callbacks on one watch,
each with its own mask; the watch removed with its last callback; each event handed to the
callbacks of its watch that asked for it; a wake-up for the thread that reads.

The calls that add and remove a watch keep the interpreter's lock where asked (``hold``), by
binding them through :class:`ctypes.PyDLL`: the daemon adds a watch at each hand-out and
removes it at each ack, from its request threads, and a call that lets the lock go hands it to
another thread each time (the daemon's batched hand-out served 1.48x the items with both calls
keeping it: ``benchmarks/README.md``, "The marker watch's calls keep the interpreter's lock").
Removing a watch is in memory; adding one looks its path up, which can wait for a server on a
network file system, so the caller says when it may keep the lock
(:func:`~cachepipe.service.markers.hold_under`).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import select
import struct
import threading
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import NamedTuple

from ..fscalls import holding_function

__all__ = ["IN_IGNORED", "IN_ISDIR", "IN_Q_OVERFLOW", "Event", "Inotify"]

# <sys/inotify.h>: the events that concern the callbacks are the low 12 bits of a mask.
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR, _IN_MASK_ADD = 0x4000, 0x8000, 0x40000000, 0x20000000
_EVENTS = 0xFFF

_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then len bytes of name
READ_SIZE = 65536
"""Bytes read at a time: a few thousand events (16 bytes each, and a name, padded)."""

Callback = Callable[["Event"], None]


class Event(NamedTuple):
    """One ``struct inotify_event``: ``name`` is the entry's name (bytes, no NUL) in the watched
    folder, empty for an event of the folder itself (or an overflow, whose ``wd`` is -1)."""

    wd: int
    mask: int
    cookie: int
    name: bytes

    @property
    def is_directory(self) -> bool:
        return bool(self.mask & IN_ISDIR)


@functools.cache
def _calls() -> SimpleNamespace:
    """The C library's inotify functions: ``add`` lets the interpreter's lock go, ``held_add``
    and ``held_rm`` keep it (bound once; ``errno`` saved for :func:`ctypes.get_errno`)."""
    libc = ctypes.CDLL(None, use_errno=True)
    init1, add = libc.inotify_init1, libc.inotify_add_watch
    init1.argtypes, init1.restype = [ctypes.c_int], ctypes.c_int
    add.argtypes, add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
    return SimpleNamespace(
        init1=init1,
        add=add,
        held_add=holding_function("inotify_add_watch", [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int),
        held_rm=holding_function("inotify_rm_watch", [ctypes.c_int, ctypes.c_uint32], ctypes.c_int),
    )


def _error(what: str, path: bytes | None = None) -> OSError:
    """The C library's ``errno`` as an :class:`OSError`, saying which limit a refusal is."""
    code = ctypes.get_errno()
    message = os.strerror(code)
    if code == errno.ENOSPC:
        message = "inotify watch limit reached (sysctl fs.inotify.max_user_watches)"
    elif code == errno.EMFILE and path is None:
        message = "inotify instance limit reached (sysctl fs.inotify.max_user_instances)"
    return OSError(code, f"{what}: {message}", None if path is None else os.fsdecode(path))


class Inotify:
    """One inotify instance, its watches and their callbacks.

    :meth:`add` and :meth:`remove` may be called from any thread; :meth:`read` and
    :meth:`handle` from one thread, which :meth:`wake` ends; :meth:`close` once that thread has
    stopped. After :meth:`close`, :meth:`add`, :meth:`remove`, :meth:`read` and :meth:`wake`
    raise :class:`RuntimeError` (its descriptors' numbers may be another file's by then, or the
    next instance's).

    Raises:
        OSError: the instance cannot be made (``fs.inotify.max_user_instances`` reached).
    """

    def __init__(self) -> None:
        fd = _calls().init1(os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            raise _error("inotify_init1")
        self.fd = fd
        try:
            self._wake_r, self._wake_w = os.pipe()  # not inherited by children (PEP 446)
        except BaseException:
            os.close(fd)
            raise
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN)
        self._poll.register(self._wake_r, select.POLLIN)
        self._lock = threading.Lock()
        self._watches: dict[int, dict[int, tuple[int, Callback]]] = {}  # wd -> callback id -> (its mask, it)
        self._closed = False

    def add(self, path: bytes, mask: int, callback: Callback, id_: int, hold: bool = False) -> int:
        """Watch ``path`` for the events of ``mask`` (and its flags, such as ``IN_ONLYDIR``),
        calling ``callback`` for each (:meth:`handle`) under ``id_`` (unique among the ids of
        this watch); a path already watched (the same inode) keeps its watch, which then reports
        the events of both masks. ``hold``: the call keeps the interpreter's lock. Returns the
        watch's descriptor.

        Raises:
            OSError: the kernel refused (the path is gone, not a folder for ``IN_ONLYDIR``, the
                watch limit), with its ``errno`` and ``path``.
        """
        call = _calls().held_add if hold else _calls().add
        with self._lock:  # a removal of the same watch cannot come between the kernel's and ours
            self._check_open()
            wd = call(self.fd, path, mask | _IN_MASK_ADD)
            if wd < 0:
                raise _error("inotify_add_watch", path)
            self._watches.setdefault(wd, {})[id_] = (mask, callback)
        return int(wd)

    def remove(self, callbacks: Iterable[tuple[int, int]]) -> None:
        """Remove each callback ``(wd, id)``, and the watch with its last one (keeping the
        interpreter's lock: a removal is in memory). A watch the kernel already ended (its
        folder deleted) or a callback removed before is passed over."""
        rm = _calls().held_rm
        with self._lock:
            self._check_open()
            for wd, id_ in callbacks:
                on_it = self._watches.get(wd)
                if on_it is None or on_it.pop(id_, None) is None or on_it:
                    continue
                del self._watches[wd]
                if rm(self.fd, wd) < 0 and ctypes.get_errno() != errno.EINVAL:  # EINVAL: ended by the kernel
                    raise _error("inotify_rm_watch")

    def read(self) -> list[Event]:
        """Wait for events and return those queued (at most :data:`READ_SIZE` bytes of them);
        ``[]`` once :meth:`wake` was called. An overflow of the kernel's queue is an event with
        ``IN_Q_OVERFLOW`` in its mask."""
        self._check_open()
        ready = self._poll.poll()
        if any(fd == self._wake_r for fd, _ in ready):
            return []
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:  # a spurious wake-up
            return []
        events, at = [], 0
        while at + _HEADER.size <= len(data):
            wd, mask, cookie, size = _HEADER.unpack_from(data, at)
            at += _HEADER.size
            events.append(Event(wd, mask, cookie, data[at : at + size].rstrip(b"\0")))
            at += size
        return events

    def handle(self, event: Event) -> None:
        """Call each callback of ``event``'s watch whose mask has one of its events; the kernel's
        end of a watch (``IN_IGNORED``) forgets it. The callbacks run outside the lock (they may
        add or remove watches). A callback that raises does not keep the others from the event:
        the first error is raised once all have run."""
        with self._lock:
            if event.mask & IN_IGNORED:
                self._watches.pop(event.wd, None)
                return
            on_it = list(self._watches.get(event.wd, {}).values())
        failed: Exception | None = None
        for mask, callback in on_it:
            if event.mask & mask & _EVENTS:
                try:
                    callback(event)
                except Exception as exc:  # noqa: BLE001 - raised after the others ran; the caller logs it
                    failed = failed or exc
        if failed is not None:
            raise failed

    def wake(self) -> None:
        """Make the thread waiting in :meth:`read`, or its next call, return ``[]``."""
        with self._lock:  # not after close: its number may be another file's
            self._check_open()
            os.write(self._wake_w, b"!")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("inotify instance used after close()")

    def close(self) -> None:
        """Close the instance (the kernel removes its watches); call once no thread reads it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._watches.clear()
            for fd in (self.fd, self._wake_r, self._wake_w):
                os.close(fd)
