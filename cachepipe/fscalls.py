"""The file-system calls that stage, write and publish each item, in sets (:class:`FileCalls`).

- :data:`RELEASING`: the standard library's (:func:`os.open` and the rest), which let the
  process's other threads run during each call. Used where a call may wait for a server (a
  network or FUSE file system, or one this module does not know).
- :data:`HOLDING`: the same calls through the C library by :class:`ctypes.PyDLL`, which keeps
  the interpreter's lock during each call. Used for a cache on a memory file system (tmpfs,
  ramfs; :func:`file_calls_for`), where such a call never waits for a device and takes a few
  microseconds. There, letting go of the lock costs more than the call: another thread takes
  it, and the caller waits until that thread lets it go. For many tiny items, the calls that
  stage, write and publish an item (a folder item's mkdir; open, write, close; rename) handed
  the lock on between the producer's, the download threads' and the consumer's work (``benchmarks/README.md``, "File
  calls that keep the interpreter's lock").
- :class:`WhileQuick`: for a cache on a local disk (:data:`LOCAL_FILESYSTEMS`), the calls of
  :data:`HOLDING` while they stay quick, and those of :data:`RELEASING` for a pause after they
  were not (:func:`held_too_long`). On a journaled ext4 such a call takes a few microseconds,
  as on tmpfs; but it can wait for the device (the journal, writeback), and while a call that
  keeps the lock waits, every thread of the process waits with it. The rule bounds that to
  about 70 ms of the lock kept in slow calls per pause, plus the one call that ends it, and 2%
  of the time in the long run
  (``benchmarks/README.md``, "File calls on a disk keep the lock while they are quick").

A cache whose path passes a file system not known to be local, at a folder above it or at a
link on the way (a disk mounted under an NFS home; a link kept on NFS to a local disk), uses
:data:`RELEASING` whatever its own file system (:func:`lookups_stay_local`): a call that keeps
the lock looks its path up from ``/``.

A nested item's publish (a name with a ``/``) renames through :data:`RELEASING` on every file
system: its target's parent folders may be anything a user put under the cache directory (a
mount), and a lookup there may wait for a server. (A symbolic link in place of one is refused:
:func:`cachepipe.cache.staging.make_folders`.)

The deletion of an acknowledged item keeps using :mod:`os` on every file system: on tmpfs,
holding the lock through a batch of deletions was slower in the same benchmark (while the
consumer's thread deletes, the producer's threads run).

Every set takes paths as strings, makes every descriptor non-inheritable, raises :class:`OSError`
as :mod:`os` does (the subclass for the error number, with the path) and retries a call that a
signal interrupted (but close). :data:`HOLDING` is None where the C library lacks a call it needs
(``renameat2``: glibc 2.28 or later); then :data:`RELEASING` is used.

The risk of :data:`HOLDING`: a call that does wait stops every thread of the process meanwhile.
On a memory file system that is the kernel reclaiming memory for the write (a cgroup at its
memory limit, tmpfs pages swapped out), when the process's other threads would be slow too.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, NamedTuple

from .filesystems import (
    LINK_HOPS,
    LOCAL_FILESYSTEMS,
    MEMORY_FILESYSTEMS,
    filesystem_at,
    filesystem_type,
    filesystems_walked,
    lookups_stay_local,
    paths_walked,
)

__all__ = [
    "HOLDING",
    "HOLD_DEBT_DRAIN",
    "HOLD_DEBT_MAX_S",
    "HOLD_MAX_WRITE",
    "HOLD_MEAN_MAX_S",
    "HOLD_PAUSE_MAX_S",
    "HOLD_PAUSE_S",
    "HOLD_SLOW_S",
    "LINK_HOPS",
    "LOCAL_FILESYSTEMS",
    "MEMORY_FILESYSTEMS",
    "RELEASING",
    "FileCalls",
    "WhileQuick",
    "file_calls_for",
    "filesystem_at",
    "filesystem_type",
    "filesystems_walked",
    "holding_function",
    "lookups_stay_local",
    "paths_walked",
    "rename_new",
    "sync_folder",
]

log = logging.getLogger(__name__)

HOLD_MAX_WRITE = 64 * 1024
"""Bytes: a larger write through :data:`HOLDING` lets the interpreter's lock go, as
:func:`os.pwrite` does (copying it takes long enough for other threads to run meanwhile)."""

HOLD_SLOW_S = 0.001
"""Seconds: on a disk (:class:`WhileQuick`), a call that keeps the interpreter's lock for longer
is slow; its time is added to the lock's debt (:func:`lock_debt`)."""

HOLD_DEBT_MAX_S = 0.05
"""Seconds: on a disk (:class:`WhileQuick`), when the lock's debt (the time it was kept in slow
calls, less what was forgiven) exceeds this, the calls let the lock go for a pause
(:func:`pause_after`): one call of over 50 ms does it, or slow ones close together."""

HOLD_DEBT_DRAIN = 0.02
"""Seconds of debt forgiven per second (:func:`lock_debt`): the share of the process's time that
slow calls may keep the lock in the long run. On a journaled ext4 with many tiny items, calls
of 1-25 ms (the journal's commits, writeback) took about 1.2% of the time
(``benchmarks/README.md``)."""

HOLD_MEAN_MAX_S = 50e-6
"""Seconds: on a disk (:class:`WhileQuick`), calls keep the interpreter's lock while the mean of
the recent ones (:func:`recent_mean`) stays under this; letting it go costs a hand-over between
threads, tens of microseconds."""

HOLD_MEAN_WEIGHT = 1 / 64
"""The weight of each new call in :class:`WhileQuick`'s recent mean (about the last 64 calls);
a call counts there as at most 4 x :data:`HOLD_MEAN_MAX_S`, so that one rare slow call (a
journal's commit, a block read) does not decide alone (the debt does that)."""

HOLD_PAUSE_S = 10.0
"""Seconds a disk's calls let the interpreter's lock go after they were found slow, before
:class:`WhileQuick` keeps it again; doubled, up to :data:`HOLD_PAUSE_MAX_S`, when they are found
slow again within as long after that (:func:`pause_after`)."""

HOLD_PAUSE_MAX_S = 640.0
"""Seconds: the longest pause of :class:`WhileQuick`."""

_RENAME_NOREPLACE = 1  # <linux/fs.h>
_AT_FDCWD = ctypes.c_int(-100)  # <fcntl.h>; a C int already: ctypes converts a negative int by a caught OverflowError


class FileCalls(NamedTuple):
    """One set of the calls made per item; each behaves as its :mod:`os` namesake.

    Attributes:
        open: ``open(path, flags, mode)``, as :func:`os.open`; returns a file descriptor.
        pwrite: ``pwrite(fd, data, offset)``, as :func:`os.pwrite`; returns the bytes written.
        close: ``close(fd)``, as :func:`os.close`.
        rename_new: ``rename_new(src, dst)``, as :func:`rename_new`.
        mkdir: ``mkdir(path, mode)``, as :func:`os.mkdir`.
    """

    open: Callable[[str, int, int], int]
    pwrite: Callable[[int, bytes | memoryview, int], int]
    close: Callable[[int], None]
    rename_new: Callable[[str, str], None]
    mkdir: Callable[[str, int], None]


def _function(lib: ctypes.CDLL, name: str, argtypes: list[Any] | None, restype: Any) -> Any:
    """The C function ``name`` of ``lib`` with its argument and result types, or None.

    ``argtypes`` None, for a call whose arguments are all ints that fit a C int and paths as
    bytes: ctypes passes a Python int as a C ``int`` and bytes as a ``char *`` by itself.
    An ``argtypes`` entry converts each argument by its type's ``from_param`` first: about 1,000
    instructions for an int (an ``isinstance`` through ctypes' metaclass, and an argument
    object), more than the call's own part in user space. Without it nothing checks the
    arguments' types: the callers here pass bytes (:func:`_encoded`) and such ints."""
    func = getattr(lib, name, None)
    if func is not None:
        func.argtypes, func.restype = argtypes, restype
    return func


_renameat2 = _function(ctypes.CDLL(None, use_errno=True), "renameat2", None, ctypes.c_int)  # lets the lock go


_FS_ENCODING, _FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


def _encoded(path: str) -> bytes:
    raw = path.encode(_FS_ENCODING, _FS_ERRORS)  # os.fsencode of a str, without its call
    if 0 in raw:  # a NUL byte (an int needle: a bytes one costs a caught TypeError per test)
        raise ValueError("embedded null byte")
    return raw


def _rename_by(call: Callable[..., int] | None, src: str, dst: str) -> None:
    """:func:`rename_new` by ``call``, a binding of ``renameat2``: one ``RENAME_NOREPLACE``
    call, or where the kernel or the file system lacks it (or ``call`` is None) a check, then
    :func:`os.rename`."""
    if call is not None:
        while call(_AT_FDCWD, _encoded(src), _AT_FDCWD, _encoded(dst), _RENAME_NOREPLACE) != 0:
            code = ctypes.get_errno()
            if code in (errno.EINVAL, errno.ENOSYS):  # the file system, or the kernel (before 3.15), lacks it
                break
            if code != errno.EINTR:
                raise OSError(code, os.strerror(code), src, None, dst)
        else:
            return
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst)
    os.rename(src, dst)


def rename_new(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst``, which must not exist (a plain rename would replace a file, or
    an empty folder, in the way).

    One ``renameat2(RENAME_NOREPLACE)`` where the kernel, libc and file system have it (the
    check and the rename are one atomic step, one system call); elsewhere a check, then a
    rename.

    Raises:
        FileExistsError: ``dst`` exists; nothing was renamed.
        OSError: the rename failed.
    """
    _rename_by(_renameat2, src, dst)


def sync_folder(path: str) -> None:
    """``fsync`` the folder ``path``: the names created, renamed or removed in it are on disk when
    it returns (a file's own ``fsync`` makes its bytes durable, not its name). A file system that
    cannot sync a folder (``EINVAL``: some FUSE and network ones) is let be: it gives no such
    promise to keep.

    Raises:
        OSError: ``path`` cannot be opened, or its sync failed (``EIO``).
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


def _open(path: str, flags: int, mode: int = 0o777) -> int:
    return os.open(path, flags, mode)


def _pwrite(fd: int, data: bytes | memoryview, offset: int) -> int:
    return os.pwrite(fd, data, offset)


def _close(fd: int) -> None:
    os.close(fd)


def _mkdir(path: str, mode: int = 0o777) -> None:
    os.mkdir(path, mode)


# each looks up its os function when called, so that a test's fault injector at that boundary sees it
RELEASING = FileCalls(_open, _pwrite, _close, rename_new, _mkdir)
"""The standard library's calls: other threads run during each."""


def holding_function(name: str, argtypes: list[Any] | None, restype: Any) -> Any:
    """The C library's function ``name`` through :class:`ctypes.PyDLL` (the interpreter's lock
    is kept during each call; ``errno`` saved for :func:`ctypes.get_errno`), with its argument
    and result types (``argtypes`` None: see :func:`_function`); None where the C library lacks it."""
    libc = _holding_libc()
    return None if libc is None else _function(libc, name, argtypes, restype)


@functools.cache
def _holding_libc() -> ctypes.PyDLL | None:
    """The C library through :class:`ctypes.PyDLL`, loaded once (None where it cannot be)."""
    try:
        return ctypes.PyDLL(None, use_errno=True)
    except OSError:
        return None


def _c_functions() -> SimpleNamespace | None:
    """The C library's functions behind :data:`HOLDING` (:func:`holding_function`); None where
    one is missing."""
    functions = SimpleNamespace(
        # no argtypes where every argument is a path or fits a C int (see _function); pwrite's
        # count and offset are 64-bit
        open=holding_function("open", None, ctypes.c_int),
        pwrite=holding_function("pwrite", [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int64], ctypes.c_ssize_t),
        close=holding_function("close", None, ctypes.c_int),
        renameat2=holding_function("renameat2", None, ctypes.c_int),
        mkdir=holding_function("mkdir", None, ctypes.c_int),
    )
    if None in vars(functions).values() or ctypes.sizeof(ctypes.c_ssize_t) != 8:
        return None
    return functions


# module-level and looked up at each call, so that a test's fault injector can wrap them
_held: Any = _c_functions()


def _failed(path: str | None = None) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code), path)


def _open_held(path: str, flags: int, mode: int = 0o777) -> int:
    raw = _encoded(path)
    while (fd := _held.open(raw, flags | os.O_CLOEXEC, mode)) < 0:  # os.open makes every descriptor non-inheritable
        if ctypes.get_errno() != errno.EINTR:
            raise _failed(path)
    return int(fd)


def _pwrite_held(fd: int, data: bytes | memoryview, offset: int) -> int:
    if len(data) > HOLD_MAX_WRITE:
        return os.pwrite(fd, data, offset)
    raw = data if isinstance(data, bytes) else bytes(data)
    while (wrote := _held.pwrite(fd, raw, len(raw), offset)) < 0:
        if ctypes.get_errno() != errno.EINTR:
            raise _failed()
    return int(wrote)


def _close_held(fd: int) -> None:
    if _held.close(fd) != 0:  # not retried, as os.close: on Linux the descriptor is closed by then
        raise _failed()


def _rename_new_held(src: str, dst: str) -> None:
    _rename_by(_held.renameat2, src, dst)


def _mkdir_held(path: str, mode: int = 0o777) -> None:
    raw = _encoded(path)
    while _held.mkdir(raw, mode) != 0:
        if ctypes.get_errno() != errno.EINTR:
            raise _failed(path)


HOLDING = None if _held is None else FileCalls(_open_held, _pwrite_held, _close_held, _rename_new_held, _mkdir_held)
"""Calls that keep the interpreter's lock (None where the C library lacks one): for a cache on a
memory file system, and behind :class:`WhileQuick` on a local disk."""


def recent_mean(mean: float, took: float) -> float:
    """The recent mean of calls' seconds (``mean`` before), after a call that took ``took``
    seconds (:data:`HOLD_MEAN_WEIGHT`; the call counted as at most 4 x :data:`HOLD_MEAN_MAX_S`)."""
    return mean + (min(took, 4 * HOLD_MEAN_MAX_S) - mean) * HOLD_MEAN_WEIGHT


def lock_debt(debt: float, took: float, elapsed: float) -> float:
    """The lock's debt (seconds) after a call that took ``took`` seconds, ``elapsed`` seconds
    after the call before it ended: ``debt`` before, less :data:`HOLD_DEBT_DRAIN` per second
    elapsed (not below 0), plus ``took`` if the call was slow (over :data:`HOLD_SLOW_S`)."""
    return max(0.0, debt - elapsed * HOLD_DEBT_DRAIN) + (took if took > HOLD_SLOW_S else 0.0)


def held_too_long(mean: float, debt: float) -> bool:
    """Whether calls whose recent mean is ``mean`` seconds (:func:`recent_mean`), and the lock's
    debt ``debt`` seconds (:func:`lock_debt`), should let the interpreter's lock go for a while
    (:class:`WhileQuick`)."""
    return debt > HOLD_DEBT_MAX_S or mean > HOLD_MEAN_MAX_S


def pause_after(pause: float, held_for: float) -> float:
    """Seconds to let the interpreter's lock go after calls were found slow, where ``pause`` was
    the previous pause (0: none) and calls have kept the lock ``held_for`` seconds since it
    ended: twice ``pause`` (at most :data:`HOLD_PAUSE_MAX_S`) if that is under
    :data:`HOLD_PAUSE_S`, else :data:`HOLD_PAUSE_S`."""
    return min(2 * pause, HOLD_PAUSE_MAX_S) if pause and held_for < HOLD_PAUSE_S else HOLD_PAUSE_S


class WhileQuick:
    """:data:`HOLDING`'s calls while they are quick, :data:`RELEASING`'s for a pause after they
    were not; its :attr:`calls` are the set, for one cache on a local disk.

    Each call that keeps the lock is timed by ``clock`` (seconds, default :func:`time.monotonic`)
    and counted in the recent mean (:func:`recent_mean`: too many moderately slow calls) and in
    the lock's debt (:func:`lock_debt`: the time kept in slow ones). When either is too high
    (:func:`held_too_long`), the calls let the lock go for a pause (:func:`pause_after`), and
    both start again from 0 after it. So a pause begins once the lock was kept at most about
    70 ms in slow calls (50 ms of debt, and 19 calls of under 1 ms at the clipped mean), plus the
    one call that ends it. A write larger than :data:`HOLD_MAX_WRITE` lets the lock go anyway
    and is not timed. Updates of the mean and the debt from several threads may overwrite each
    other now and then: they are a guide, not a count; a pause begins once however many threads
    find it due.
    """

    def __init__(self, held: FileCalls, releasing: FileCalls = RELEASING, clock: Callable[[], float] = time.monotonic) -> None:
        self._held, self._releasing, self._clock = held, releasing, clock
        self._mean = 0.0  # seconds: the recent calls' weighted mean
        self._debt = 0.0  # seconds: the lock's debt
        self._last = -math.inf  # clock time the last timed call ended
        self._released_until = -math.inf  # clock time until which calls let the lock go
        self._pause = 0.0  # seconds: the last pause (0: none yet)
        self._pausing = threading.Lock()  # one thread begins a pause; taken only then
        self.calls = FileCalls(self._open, self._pwrite, self._close, self._rename_new, self._mkdir)

    def _run(self, held: Callable[..., Any], releasing: Callable[..., Any], *args: Any) -> Any:
        start = self._clock()
        if start < self._released_until:
            return releasing(*args)
        try:
            return held(*args)
        finally:
            end = self._clock()
            self._mean = recent_mean(self._mean, end - start)
            self._debt = lock_debt(self._debt, end - start, end - self._last)
            self._last = end
            if held_too_long(self._mean, self._debt):
                self._begin_pause(start, end)

    def _begin_pause(self, start: float, end: float) -> None:
        """Let the lock go from ``end`` for a pause, unless another thread began one since this
        call (made at ``start``) found the lock kept."""
        with self._pausing:
            if self._released_until > start:
                return
            mean, debt = self._mean, self._debt
            self._pause = pause_after(self._pause, start - self._released_until)
            self._released_until, self._mean, self._debt = end + self._pause, 0.0, 0.0
        log.debug(
            "file calls let the interpreter's lock go for %.0f s: the last took %.2f ms; the lock's debt %.1f ms, "
            "the recent calls' mean %.0f us",
            self._pause,
            (end - start) * 1e3,
            debt * 1e3,
            mean * 1e6,
        )

    def _open(self, path: str, flags: int, mode: int = 0o777) -> int:
        return int(self._run(self._held.open, self._releasing.open, path, flags, mode))

    def _pwrite(self, fd: int, data: bytes | memoryview, offset: int) -> int:
        if len(data) > HOLD_MAX_WRITE:
            return self._releasing.pwrite(fd, data, offset)
        return int(self._run(self._held.pwrite, self._releasing.pwrite, fd, data, offset))

    def _close(self, fd: int) -> None:
        self._run(self._held.close, self._releasing.close, fd)

    def _rename_new(self, src: str, dst: str) -> None:
        self._run(self._held.rename_new, self._releasing.rename_new, src, dst)

    def _mkdir(self, path: str, mode: int = 0o777) -> None:
        self._run(self._held.mkdir, self._releasing.mkdir, path, mode)


def file_calls_for(fstype: str) -> FileCalls:
    """The calls to make per item in a cache on a file system of type ``fstype`` (as
    ``/proc/self/mountinfo`` names it; "" if unknown), where the C library has
    :data:`HOLDING`: it on a memory file system; on another local one, a new
    :class:`WhileQuick`'s (one per cache: its own recent mean); else :data:`RELEASING`."""
    if HOLDING is None or fstype not in LOCAL_FILESYSTEMS:
        return RELEASING
    return HOLDING if fstype in MEMORY_FILESYSTEMS else WhileQuick(HOLDING).calls
