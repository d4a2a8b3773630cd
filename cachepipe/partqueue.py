"""The part queue: the bytes of started items not yet requested, cut into ranged GETs as the
download threads take them.

Invariant: parts are taken from the earliest started item (in hand-out order) with bytes not
yet requested, each cut when it is taken (:func:`~cachepipe.fetch_policy.item_part_size`), so
the item the consumers wait for is fetched over every thread. Bookkeeping only: the
:class:`~cachepipe.fetcher.Fetcher` holds one lock around every call and does the I/O.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .catalog import FileEntry
from .fetch_policy import HEAD_MIN_PART, item_part_size, items_ahead

__all__ = ["PartQueue", "Started"]

J = TypeVar("J")


@dataclass(eq=False)
class Started(Generic[J]):
    """An item in a :class:`PartQueue`: its bytes not yet requested, and its parts running."""

    job: J
    size: int  # the item's bytes
    turn: int  # its place in hand-out order: turn - served items are ahead of it
    todo: deque[tuple[FileEntry, str, int]]  # files (or their rest) not yet requested: entry, local path, next offset
    small: bool  # every file of at most HEAD_MIN_PART: its requests do not count against max_large_requests
    running: int = 0
    came: list[float] = field(default_factory=list)  # seconds each of its parts that came took (the fetcher's hedge_in)


class PartQueue(Generic[J]):
    """The bytes of started items not yet requested, cut into ranged GETs as download threads
    take them. Not thread-safe: the fetcher holds one lock around every call.

    Args:
        concurrency: download threads.
    """

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._started: deque[Started[J]] = deque()  # with bytes not yet requested, in the order they started

    def add(self, job: J, size: int, turn: int, files: Iterable[tuple[FileEntry, str]]) -> Started[J] | None:
        """Queue an item's files (those of 0 bytes need no request) in its turn: after the items
        of earlier turns, before those of later ones (an item restarted after a disk error or an
        ETag mismatch keeps its place). None if nothing is to fetch."""
        todo: deque[tuple[FileEntry, str, int]] = deque()
        small = True
        for f, local in files:
            if f.size:
                todo.append((f, local, 0))
                small = small and f.size <= HEAD_MIN_PART
        if not todo:
            return None
        started = Started(job, size, turn, todo, small)
        place = len(self._started)
        while place and self._started[place - 1].turn > turn:
            place -= 1
        self._started.insert(place, started)
        return started

    def head(self) -> Started[J] | None:
        """The earliest started item with bytes not yet requested, or None."""
        return self._started[0] if self._started else None

    def take(
        self, served: int, part_size: int, large: bool = True, fresh: int | None = None
    ) -> tuple[Started[J], FileEntry, str, int, int] | None:
        """The next part: from the earliest started item with bytes not yet requested, of
        :func:`item_part_size` for the items ahead of it now that count (:func:`items_ahead`;
        ``served``: see :meth:`cachepipe.broker.Broker.served`; ``fresh``: the items ready and
        never handed out, or None while the consumers outpace the items) and at most
        ``part_size`` bytes; None if every
        byte is requested, or if ``large`` is False and the next part is of an item with a file
        over :data:`HEAD_MIN_PART` (it waits for its turn: nothing later is taken before it)."""
        while self._started:
            started = self._started[0]
            if not started.todo:  # given up (see done)
                self._started.popleft()
                continue
            if not large and not started.small:
                return None
            f, local, start = started.todo[0]
            if started.small and f.size - start <= part_size:  # item_part_size would give at least the rest
                end = f.size
            else:
                ahead = items_ahead(started.turn - served, fresh)
                part = item_part_size(started.size, part_size, self.concurrency, ahead)
                end = min(f.size, start + part)
            if end == f.size:
                started.todo.popleft()
                if not started.todo:
                    self._started.popleft()
            else:
                started.todo[0] = (f, local, end)
            started.running += 1
            return started, f, local, start, end
        return None

    def done(self, started: Started[J], give_up: bool = False) -> bool:
        """A part of ``started`` ended (``give_up``: request no more of it, it failed). True if
        it was the item's last: nothing is running and nothing more will be requested."""
        started.running -= 1
        if give_up:
            started.todo.clear()
        return started.running == 0 and not started.todo
