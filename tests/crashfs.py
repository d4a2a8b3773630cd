"""A file-system fault injector at the system-call boundary, for crash-point tests.

:class:`CrashFs` interposes on the ``os`` functions that change a file system (``write``,
``pwrite``, ``rename``, ``replace``, ``unlink``, ``rmdir``, ``mkdir``, ``ftruncate``, ``fsync``, and ``open``
with ``O_CREAT``), and on the ``renameat2`` that publishes an item (:func:`cachepipe.fscalls.rename_new`,
logged as a ``rename``), and on the C library's functions that :data:`cachepipe.fscalls.HOLDING`
calls for a cache on tmpfs or a local disk (named as their ``os`` namesakes), for calls made by the thread that
entered it. cachepipe's cache, journal and
deletions reach the disk only through these (the journal's atomic rewrite too), so every state
change of the cache directory is one numbered *mutation*. A :class:`Fault` picks one of them:

- ``crash``: the world stops before it, as with ``kill -9``: it and every later mutation raise
  :class:`Crashed` (a ``BaseException``, so no handler of the code under test swallows it);
- ``torn``: a ``write`` puts only the first half of its bytes on disk, then the world stops;
- ``enospc`` / ``eio``: that one call fails with the error (a ``write`` of several bytes first
  writes half of them, as a filling disk does), and the code under test goes on;
- ``short``: a ``write`` of several bytes writes half and returns that count.

Run an operation sequence once without a fault to count its mutations (:attr:`CrashFs.count`),
then once per mutation and fault kind: that explores every crash point, not a sample.

An ``fsync`` of the owner's is a mutation like the others (counted, and failed or crashed at), but
it only checks its descriptor (``fstat``) instead of flushing: a simulated crash is a process's,
whose writes the page cache keeps with or without it, and on a disk each one waited for a
journal commit (a quarter of an exploration's time there).
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from cachepipe import fscalls

KINDS = ("crash", "torn", "enospc", "eio", "short")
WRITE_ONLY = {"torn", "short"}  # kinds that only apply to a write of at least 2 bytes


def _unflushed(fd: int) -> None:
    """``fsync`` without the flush: a bad descriptor still raises (``EBADF``)."""
    os.fstat(fd)


class Crashed(BaseException):
    """The simulated process died at this mutation."""


@dataclass(frozen=True)
class Fault:
    at: int  # the number of the mutation (0-based) it hits
    kind: str  # one of KINDS


class CrashFs:
    """Context manager: while active, the calling thread's mutations are counted and ``fault``
    (if any) is injected. ``log`` lists ``(number, call, argument)`` of each mutation seen."""

    _NAMES = ("write", "pwrite", "rename", "replace", "unlink", "rmdir", "mkdir", "ftruncate", "fsync", "open", "close")

    def __init__(self, fault: Fault | None = None) -> None:
        self.fault = fault
        self.count = 0
        self.stopped = False
        self.hit: tuple[str, str] | None = None  # the call the fault hit, and its argument
        self.log: list[tuple[int, str, str]] = []
        self._saved: dict[str, object] = {}
        self._owner = 0
        self._fds: set[int] = set()  # descriptors the owner opened and has not closed
        self._native = None  # the real renameat2 while entered (see _wrap_c)
        self._held = None  # fscalls._held while entered (see _wrap_held)

    def __enter__(self) -> CrashFs:
        self._owner = threading.get_ident()
        for name in self._NAMES:
            real = getattr(os, name)
            self._saved[name] = real
            setattr(os, name, self._wrap(name, real))
        self._native = fscalls._renameat2
        if self._native is not None:  # the publish rename's system call, made through ctypes
            fscalls._renameat2 = self._wrap_c("rename", self._native)
        self._held = fscalls._held
        if self._held is not None:  # the C functions behind fscalls.HOLDING (a cache on tmpfs or a local disk)
            fscalls._held = self._wrap_held(self._held)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(os, name, real)
        self._saved.clear()
        if self._native is not None:
            fscalls._renameat2 = self._native
        if self._held is not None:
            fscalls._held = self._held

    def _wrap_c(self, name: str, real, counts=lambda _args: True):
        """A C library function as libc has it (-1 and ``errno`` on failure), each call one
        mutation named as its ``os`` namesake (``renameat2``: ``rename``); ``counts(args)``
        False: this call changes nothing (an ``open`` without ``O_CREAT``)."""

        def label(args) -> str:
            if name == "pwrite":
                return f"fd {args[0]}"
            return os.fsdecode(args[1] if name == "rename" else args[0])

        def call(*args):
            if threading.get_ident() != self._owner:
                return real(*args)
            if name == "close":
                self._fds.discard(args[0])
                return real(*args)
            if not counts(args):
                got = real(*args)
            else:
                try:
                    got = self._mutate(name, lambda *_: real(*args), (label(args),), {})
                except OSError as exc:
                    ctypes.set_errno(exc.errno or errno.EIO)
                    return -1
            if name == "open" and got >= 0:
                self._fds.add(got)
            return got

        return call

    def _wrap_held(self, held):
        """The C library's functions behind ``fscalls.HOLDING`` (:meth:`_wrap_c`)."""
        return SimpleNamespace(
            open=self._wrap_c("open", held.open, lambda args: args[1] & os.O_CREAT),
            pwrite=self._wrap_c("pwrite", held.pwrite),
            close=self._wrap_c("close", held.close),
            renameat2=self._wrap_c("rename", held.renameat2),
            mkdir=self._wrap_c("mkdir", held.mkdir),
        )

    def _wrap(self, name: str, real):
        def call(*args, **kwargs):
            if threading.get_ident() != self._owner:
                return real(*args, **kwargs)
            if name == "close":
                self._fds.discard(args[0])
                return real(*args, **kwargs)
            if name == "open" and not (len(args) > 1 and args[1] & os.O_CREAT):
                fd = real(*args, **kwargs)  # opening an existing file changes nothing
            else:
                fd = self._mutate(name, _unflushed if name == "fsync" else real, args, kwargs)
            if name == "open":
                self._fds.add(fd)
            return fd

        return call

    def _mutate(self, name, real, args, kwargs):
        if self.stopped:
            raise Crashed(f"{name} after the crash")
        number = self.count
        self.count += 1
        arg = str(args[0]) if name != "write" else f"fd {args[0]}: {bytes(args[1])[:40]!r}"
        self.log.append((number, name, arg))
        fault = self.fault
        if fault is None or fault.at != number or (fault.kind in WRITE_ONLY and name != "write"):
            return real(*args, **kwargs)
        self.hit = (name, arg)
        data = bytes(args[1]) if name == "write" else b""
        half = data[: len(data) // 2]
        if fault.kind == "crash":
            self.stopped = True
            raise Crashed(f"crash at mutation {number}: {name} {arg}")
        if fault.kind == "torn":
            if half:
                real(args[0], half)
            self.stopped = True
            raise Crashed(f"torn write at mutation {number}: {arg}")
        if fault.kind == "short":
            return real(args[0], half)
        if half:  # enospc / eio on a write: the part that fit is on disk
            real(args[0], half)
        code = errno.ENOSPC if fault.kind == "enospc" else errno.EIO
        raise OSError(code, f"{os.strerror(code)} (injected at mutation {number}: {name})")

    def close_all(self) -> None:
        """Close what the owner left open, as the kernel does for a process that died (this also
        releases its ``flock``)."""
        close = self._saved.get("close", os.close)
        for fd in sorted(self._fds):
            try:
                close(fd)
            except OSError:
                pass
        self._fds.clear()

    def applies(self, kind: str, number: int) -> bool:
        """Whether ``kind`` makes sense at mutation ``number`` of a counted (fault-free) run."""
        if kind not in WRITE_ONLY:
            return True
        _n, name, arg = self.log[number]
        return name == "write" and not arg.endswith("b''")
