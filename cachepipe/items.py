"""What items handed out in-process and by the daemon share: their path-like behaviour, and how
the iterators take them (:func:`iter_batch`)."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["ACK_AT_ONCE", "HOLD", "ITER_MOST", "ITER_WINDOW", "LoopPace", "PathItem", "iter_batch"]

ITER_WINDOW = 0.005
"""Seconds of the loop body's work that one batch of the iterator covers (see :func:`iter_batch`)."""

ITER_MOST = 64
"""The most items the iterator takes at once."""

ACK_AT_ONCE = 1024 * 1024
"""The daemon client's iterator acknowledges an item of this many bytes or more as soon as the
loop moves on, not with the next batch: its space goes back to the producer at once."""


def iter_batch(body_seconds: float | None, window: float = ITER_WINDOW, most: int = ITER_MOST) -> int:
    """How many items the iterator takes from the queue at once, for a loop whose body spends
    ``body_seconds`` per item (a moving average; None before the first item): as many as it gets
    through in ``window`` seconds, from 1 to ``most``. A loop that reads a large item or trains
    on it takes one at a time; one that only lists paths takes up to ``most``, paying the
    queue's lock, wake-ups and journal writes once per batch instead of once per item."""
    if body_seconds is None:
        return 1
    if body_seconds <= 0:
        return most
    return max(1, min(most, int(window / body_seconds)))


HOLD = 4 * ITER_WINDOW
"""Seconds the daemon client's iterator keeps a batch: one not used up by then (the loop's body
slowed down) is ended early, its items moved past acknowledged and the others given back, so that
their leases do not wait on the loop."""


class LoopPace:
    """An iterator's measure of its loop's body: :meth:`started` as it yields an item,
    :meth:`ended` when the loop asks for the next; :meth:`batch` is :func:`iter_batch` for the
    moving average (a weight of 1/4 for the newest) of the seconds the body spent per item."""

    __slots__ = ("_at", "seconds")

    def __init__(self) -> None:
        self.seconds: float | None = None
        self._at = 0.0

    def started(self) -> None:
        self._at = time.monotonic()

    def ended(self) -> None:
        spent = time.monotonic() - self._at
        self.seconds = spent if self.seconds is None else self.seconds + (spent - self.seconds) / 4

    def batch(self) -> int:
        return iter_batch(self.seconds)


class PathItem(os.PathLike[str]):
    """An item usable wherever a path is: ``open(item / "text.txt")``, ``os.fspath(item)``.

    Subclasses set ``path`` (a :class:`~pathlib.Path`) and add their own attributes.
    """

    __slots__ = ()
    path: Path

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __str__(self) -> str:
        return str(self.path)
