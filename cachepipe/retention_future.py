"""The future access order that retention reads (:mod:`cachepipe.retention`), as next-use lookups:
the tick of an item's next read after a given tick. Ticks order the steps: a sequence index
(:class:`SequenceFuture`) or a plan's ``Step.tick`` (:class:`PlanFuture`, which looks a few
epochs ahead and answers with a placeholder beyond them). Pure bookkeeping, no I/O; re-exported by
:mod:`cachepipe.retention`.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from .plan import tick as plan_tick
from .plan_split import RUN

__all__ = ["NEVER", "EpochShares", "NextUse", "PlanFuture", "SequenceFuture", "is_placeholder"]

# Final, not a setting: the ticks' encoding fixes it (after every epoch << 32 | index), and retention_policies and
# retention compare with it under their own names, so a value set on one module would not be the others'
NEVER: Final = (1 << 63) - 1  #: the next use of an item that is not read again
_ITEM_BITS = 32
_ITEM_MASK = (1 << _ITEM_BITS) - 1


class NextUse(Protocol):
    """The future access order, as next-use lookups."""

    def next_use(self, item: int, tick: int) -> int:
        """The tick of the next read of ``item`` strictly after ``tick``, :data:`NEVER` if there
        is none, or a placeholder (see :func:`is_placeholder`) if it is beyond what is known."""
        ...


def is_placeholder(key: int) -> bool:
    """True for a next use that is only known to come after the end of epoch ``key >> 32``
    (index part ``0xFFFFFFFF``, which no step has)."""
    return key != NEVER and key & _ITEM_MASK == _ITEM_MASK


class SequenceFuture:
    """Next uses in a finite sequence of item indices (ticks are positions), from one backward
    pass: 8 bytes per step. Answers for the ticks at which ``item`` is read (the only ones a
    policy asks about); never a placeholder."""

    def __init__(self, sequence: Sequence[int]) -> None:
        n = len(sequence)
        nxt = array("q", [NEVER]) * n
        last: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            x = sequence[i]
            nxt[i] = last.get(x, NEVER)
            last[x] = i
        self._next = nxt
        self._sequence = sequence

    def next_use(self, item: int, tick: int) -> int:
        if self._sequence[tick] != item:
            raise ValueError(f"step {tick} reads item {self._sequence[tick]}, not {item}")
        return self._next[tick]


class EpochShares(Protocol):
    """What :class:`PlanFuture` reads of a plan (:class:`~cachepipe.plan.Plan`, or a node's
    merged :class:`~cachepipe.lanes.NodePlan`)."""

    n_items: int

    def share(self, epoch: int) -> array[int]: ...

    def done(self, epoch: int) -> bool: ...


class PlanFuture:
    """Next uses in a :class:`~cachepipe.plan.Plan`, looking ``horizon`` epochs ahead.

    A share holds an item at most once per epoch, so the next read of an item after a tick in
    epoch ``e`` is later in ``e``, or at its index in the first of epochs ``e+1 .. e+horizon``
    whose share holds it. Not found: :data:`NEVER` if the plan ends first, else a placeholder
    for "after epoch ``e+horizon``" (such items are evicted first; :class:`Belady` looks again
    when the placeholder is reached). Keeps ``horizon + 3`` epochs of index arrays (4 bytes
    per catalog item each).

    ``unread``: ``(epoch, item)`` steps that are consumed without a read (acknowledged before a
    restart: the resumed pass skips them); a next use is never one of them. A retained item
    whose next use were such a step would keep it as its key once the fetcher passed it, and
    :class:`Belady` never evicts an item needed before the step it fetches.
    """

    def __init__(self, plan: EpochShares, horizon: int = 2, unread: Iterable[tuple[int, int]] = ()) -> None:
        if horizon < 1:
            raise ValueError(f"horizon {horizon!r}: expected at least 1 epoch")
        self.plan, self.horizon = plan, horizon
        self._unread = frozenset(unread)
        self._where: OrderedDict[int, array[int]] = OrderedDict()
        self._lock = threading.Lock()  # guards _where: prepare() runs outside the cache's lock, lookups under it

    def where(self, epoch: int, pause: Callable[[], None] | None = None) -> array[int]:
        """For each catalog item, its index in the plan's share of ``epoch``, or -1 (cached);
        ``pause`` as for :meth:`prepare`."""
        with self._lock:
            got = self._where.get(epoch)
            if got is not None:
                self._where.move_to_end(epoch)
                return got
        got = array("i", [-1]) * self.plan.n_items
        share = self.plan.share(epoch)
        for start in range(0, len(share), RUN):
            for j, x in enumerate(share[start : start + RUN], start):
                got[x] = j
            if pause is not None:
                pause()
        with self._lock:
            got = self._where.setdefault(epoch, got)  # computed twice at once: either will do
            if len(self._where) > self.horizon + 3:  # a lane two epochs behind the latest still finds its own
                self._where.popitem(last=False)
        return got

    def prepare(self, epoch: int, pause: Callable[[], None] | None = None) -> None:
        """Compute the lookups needed while reading ``epoch`` (call it outside any lock when
        the plan enters an epoch: one epoch takes about a second per million items). ``pause``
        is called every few hundred items (see :func:`cachepipe.plan.permutation`)."""
        for e in range(epoch + 1, epoch + 1 + self.horizon):
            if self.plan.done(e):
                return
            self.where(e, pause)

    def next_use(self, item: int, tick: int) -> int:
        key = self._next_step(item, tick)
        while self._unread and key != NEVER and not is_placeholder(key) and (key >> _ITEM_BITS, item) in self._unread:
            key = self._next_step(item, key)
        return key

    def _next_step(self, item: int, tick: int) -> int:
        """The tick of the next step that reads ``item`` after ``tick``, unread or not."""
        epoch, index = tick >> 32, tick & _ITEM_MASK
        # index _ITEM_MASK: the end of the epoch (the tick before its next's first step; -1 before epoch 0)
        share = self.plan.share(epoch) if index != _ITEM_MASK and not self.plan.done(epoch) else None
        if share is not None and (index >= len(share) or share[index] != item):
            j = self.where(epoch)[item]  # not the item's own read: it may come later this epoch
            if j > index:
                return plan_tick(epoch, j)
        for e in range(epoch + 1, epoch + 1 + self.horizon):
            if self.plan.done(e):
                return NEVER
            j = self.where(e)[item]
            if j >= 0:
                return plan_tick(e, j)
        return NEVER if self.plan.done(epoch + 1 + self.horizon) else plan_tick(epoch + self.horizon, _ITEM_MASK)
