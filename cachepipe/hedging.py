"""A part's request raced by a second one (a hedge): the first to end wins, the other's writes stop.

Invariant: once a :class:`Flight` is won, no write of the request that lost reaches the staging
file, so the part is counted done once (by the winner) and the file never changes after it is
published; and the request that lost holds the file open no longer (its descriptor now names
``/dev/null`` until it closes it), so an item acknowledged meanwhile frees its space at once,
even while that request waits for bytes that do not come. Both requests write the same bytes of
the same object version (each GET is conditional on the listed ETag where the store takes one)
at the same offsets, so either may win, and their writes may interleave before that. The
fetcher decides when to hedge (:func:`~cachepipe.fetch_policy.hedge_in`,
:mod:`cachepipe.lateparts`); this module only keeps the race fair.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Flight", "Racer", "Superseded", "Written"]

PWrite = Callable[[int, "bytes | memoryview", int], int]


class Written(Protocol):
    """A request's staging writer, as a race reads it (:class:`~cachepipe.downloads.StagingFile`)."""

    @property
    def written(self) -> int:
        """Bytes written so far from the part's start on."""
        ...


class Superseded(Exception):
    """Raised by a write of a request whose :class:`Flight` the other request won: the store's
    request ends there (its connection is dropped, not drained), and nothing is counted."""


class Racer:
    """One of a :class:`Flight`'s (at most two) requests."""

    def __init__(self, flight: Flight) -> None:
        self._flight = flight
        self._fd: int | None = None  # the staging file's descriptor this request writes through, while open

    def guard(self, pwrite: PWrite) -> PWrite:
        """``pwrite``, made under the flight's lock after checking that the other request has
        not won (else :class:`Superseded`)."""
        flight = self._flight

        def guarded(fd: int, data: bytes | memoryview, offset: int) -> int:
            with flight.lock:
                if flight.winner not in (None, self):
                    raise Superseded
                return pwrite(fd, data, offset)

        return guarded

    def watch(self, out: Written, fd: int) -> None:
        """``out`` is this request's staging writer now, through ``fd`` (a request retried writes
        anew): the first request's tells a hedge where to start (:meth:`Flight.written`). Close
        ``fd`` with :meth:`close`, not directly. If the other request has won already (this one
        opened the file after it ended: the item may be published meanwhile), ``fd`` names
        ``/dev/null`` at once, as :meth:`claim` would have made it."""
        with self._flight.lock:
            self._flight.watched[self] = out
            self._fd = fd
            if self.lost():
                self.let_go()

    def close(self, close: Callable[[int], None]) -> None:
        """Close the descriptor given to :meth:`watch` by ``close`` (under the flight's lock, so
        that the winner never points a descriptor number this request let go of, and another
        file may have since, at ``/dev/null``)."""
        with self._flight.lock:
            fd, self._fd = self._fd, None
            if fd is not None:
                close(fd)

    def claim(self) -> bool:
        """This request ended (written, or failed after its retries): True if it is the first to
        end, so it counts the part done (and the other request's descriptor, if still open, is
        pointed at ``/dev/null``); False if the other request won first."""
        flight = self._flight
        with flight.lock:
            if flight.winner is None:
                flight.winner = self
                for other in (flight.first, flight.hedge):
                    if other is not None and other is not self:
                        other.let_go()
            return flight.winner is self

    def let_go(self) -> None:
        """This request lost (under the flight's lock): its descriptor, if open, names ``/dev/null`` now."""
        if self._fd is not None:
            _let_go(self._fd)

    def lost(self) -> bool:
        """True once the other request won."""
        return self._flight.winner not in (None, self)


def _let_go(fd: int) -> None:
    """Make ``fd`` name ``/dev/null`` (one atomic ``dup2``): the file it named is no longer held
    open by it, while the number stays its owner's until that closes it."""
    null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.dup2(null, fd, inheritable=False)  # as the file it named was opened: O_CLOEXEC
    finally:
        os.close(null)


class Flight:
    """A part's request in flight, which a second request may race.

    Args:
        part: the part, as the fetcher keeps it (its item, file, path and range).
        began: when its first request started, :func:`time.perf_counter` seconds.
    """

    def __init__(self, part: Any, began: float) -> None:
        self.part = part
        self.began = began
        self.lock = threading.Lock()  # a write of either request, and the claim
        self.winner: Racer | None = None
        self.watched: dict[Racer, Written] = {}
        self.first = Racer(self)
        self.hedge: Racer | None = None  # the second request, once started
        self.took: float | None = None  # seconds the first request took, if it won

    def race(self) -> Racer:
        """The second request's :class:`Racer` (once: a part is hedged at most once)."""
        if self.hedge is not None:
            raise RuntimeError("a part is hedged once")
        self.hedge = Racer(self)
        return self.hedge

    def written(self) -> int:
        """Bytes the first request has written from the part's start on (0 before it opened)."""
        out = self.watched.get(self.first)
        return 0 if out is None else out.written

    @property
    def over(self) -> bool:
        """One request has won."""
        return self.winner is not None
