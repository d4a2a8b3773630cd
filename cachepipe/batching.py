"""How ``for item in Client(...)`` takes and gives back items in batches: how many per request
(:func:`iter_batch`, by the pace of the loop's body, :class:`LoopPace`), how long a batch is
kept (:data:`HOLD`), which items are acknowledged at once (:data:`ACK_AT_ONCE`), and the most
items one request may carry (:data:`MAX_BATCH`, which the daemon enforces too). Policy only:
:class:`~cachepipe.client.Client` does the requests.
"""

from __future__ import annotations

import time

__all__ = ["ACK_AT_ONCE", "HOLD", "ITER_MOST", "ITER_WINDOW", "MAX_BATCH", "LoopPace", "iter_batch"]


MAX_BATCH = 1024
"""The most items one request takes or acknowledges (the daemon refuses more)."""

ITER_WINDOW = 0.005
"""Seconds of the loop body's work that one batch of ``for item in Client(...)`` covers (see
:func:`iter_batch`)."""

ITER_MOST = 64
"""The most items ``for item in Client(...)`` takes in one request."""

ACK_AT_ONCE = 1024 * 1024
"""The iterator acknowledges an item of this many bytes or more as soon as the loop moves on, not
with the next batch: its space goes back to the producer at once."""


def iter_batch(body_seconds: float | None, window: float = ITER_WINDOW, most: int = ITER_MOST) -> int:
    """How many items ``for item in Client(...)`` takes in one request, for a loop whose body
    spends ``body_seconds`` per item (a moving average; None before the first item): as many as
    it gets through in ``window`` seconds, from 1 to ``most``. A loop that reads a large item or
    trains on it takes one at a time; one that only lists paths takes up to ``most``, paying a
    request (and the daemon's lock rounds and journal write) once per batch instead of once per
    item."""
    if body_seconds is None:
        return 1
    if body_seconds <= 0:
        return most
    return max(1, min(most, int(window / body_seconds)))


HOLD = 4 * ITER_WINDOW
"""Seconds the iterator keeps a batch: one not used up by then (the loop's body slowed down) is
ended when the loop next moves on, its items moved past acknowledged and the others given back."""


class LoopPace:
    """The iterator's measure of its loop's body: :meth:`started` as it yields an item,
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
