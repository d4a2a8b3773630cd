"""Retention across epochs (``retain="auto"``): which acknowledged items stay on disk, and which
to evict to make room for a download. Pure bookkeeping: the cache does the deleting.

A policy sees each item in one of three states:

- *pinned*: being downloaded, ready, or handed out, i.e. fetched for a step that is not yet
  acknowledged. Never a victim.
- *retained*: acknowledged and kept on disk for a later step. Evictable.
- absent: not on disk.

The calls, all made under the cache's lock (a policy is not thread-safe), in this order::

    fetcher reaches step t needing item x:
        if policy.on_fetch(x, t):          # x is on disk (retained, or pinned by an earlier step)
            hand out the copy on disk      # x is pinned again; no download
        else:
            while free < size[x]:
                victims = policy.choose_victims(size[x] - free, x, t, urgent=consumer_starving)
                if victims is None: wait for an ack (or for the consumer to starve), then retry
                else: delete each victim (the policy has already forgotten them)
            reserve size[x]; policy.on_admit(x, t); download
    consumer acknowledges step t of item x:
        if not policy.on_ack(x, t): delete x now        # else x stays on disk
    a download of x fails or is discarded:
        policy.forget(x)

Ticks order the steps: a sequence index (:class:`~cachepipe.retention_future.SequenceFuture`) or
a plan's ``Step.tick`` (:class:`~cachepipe.retention_future.PlanFuture`). Policies:

- ``belady`` (``auto``): Belady's MIN generalised to sizes. A download evicts the retained items
  whose next use is farthest. With prefetch, the decision is the one MIN would take when the
  step is actually read, so it *waits* (returns None) while a pinned item, which will be
  acknowledged before step ``t``, has a farther next use than every candidate: when that item is
  acknowledged it becomes the victim instead. It never evicts an item whose next use comes
  before ``t`` (the "do no harm" rule of Cao, Felten, Karlin and Li, 1995). ``reserve`` bytes
  are kept for prefetching: while fewer bytes are pinned, it evicts rather than waits, so that
  retention cannot shrink the prefetch window to nothing (which would put every download on the
  consumer's critical path). With equal sizes MIN is optimal (Belady 1966; Mattson et al.
  1970); with variable sizes the exact optimum is NP-hard and MIN is a heuristic.
- ``lru``: evict the least recently acknowledged retained item (for comparison).
- ``none``: evict every item when it is acknowledged.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Literal

from .retention_future import _ITEM_BITS, _ITEM_MASK, NEVER, NextUse, is_placeholder

__all__ = ["LRU", "Belady", "NoRetention", "RetentionPolicy", "make_policy"]


class RetentionPolicy:
    """Bookkeeping shared by the policies: pins and retained bytes. See the module notes.

    Args:
        sizes: bytes of each catalog item.
        future: next-use lookups (required by :class:`Belady`).
        reserve: bytes kept for prefetching (see :class:`Belady`).
    """

    name = "base"

    def __init__(self, sizes: Sequence[int], future: NextUse | None = None, *, reserve: int = 0) -> None:
        if reserve < 0:
            raise ValueError(f"reserve {reserve!r}: expected bytes >= 0")
        self.sizes = sizes if isinstance(sizes, array) else array("q", sizes)
        self.future = future
        self.reserve = reserve
        self._pins = array("I", [0]) * len(self.sizes)
        self.pinned_bytes = 0
        self.retained_bytes = 0

    # ---- the protocol ----------------------------------------------------------------
    def on_fetch(self, item: int, tick: int) -> bool:
        """The fetcher reached ``tick``, which reads ``item``. True: it is on disk and now
        pinned (hand it out, no download). False: download it (:meth:`choose_victims`, then
        :meth:`on_admit`)."""
        if self._pins[item]:
            self._pins[item] += 1
            self._pinned(item, tick)
            return True
        if self._release(item):
            self.retained_bytes -= self.sizes[item]
            self._pins[item] = 1
            self.pinned_bytes += self.sizes[item]
            self._pinned(item, tick)
            return True
        return False

    def on_admit(self, item: int, tick: int) -> None:
        """Space for ``item`` is reserved and its download starts: it is pinned.

        Raises:
            ValueError: ``item`` is already on disk (:meth:`on_fetch` said so).
        """
        if self._pins[item] or self._is_retained(item):
            raise ValueError(f"item {item} is already on disk: on_fetch() returned True for it")
        self._pins[item] = 1
        self.pinned_bytes += self.sizes[item]
        self._pinned(item, tick)

    def on_ack(self, item: int, tick: int, after: int | None = None) -> bool:
        """The step ``tick`` of ``item`` is acknowledged. True: keep the files (retained, or
        still pinned by a later step); False: delete them now.

        ``after``: the caller knows which steps are still to read the item (a node's lanes, one
        of which may have moved back over a step that shared its copy): its next use is the first
        after ``after``, whatever steps pinned or reached the copy (see :meth:`reach`), once no
        other pin holds it. None: the first after the latest of those steps.

        Raises:
            KeyError: ``item`` is not pinned.
        """
        if not self._pins[item]:
            raise KeyError(f"item {item} is not pinned: acknowledged twice, or never fetched")
        self._pins[item] -= 1
        if self._pins[item]:
            return True
        self.pinned_bytes -= self.sizes[item]
        if self._retain(item, tick, after):
            self.retained_bytes += self.sizes[item]
            return True
        return False

    def forget(self, item: int) -> None:
        """``item``'s files are gone without an ack (a failed or discarded download): drop one
        pin, or its retained state."""
        if self._pins[item]:
            self._pins[item] -= 1
            if not self._pins[item]:
                self.pinned_bytes -= self.sizes[item]
        elif self._release(item):
            self.retained_bytes -= self.sizes[item]

    def choose_victims(
        self, needed_bytes: int, item: int, tick: int, *, urgent: bool = False, forced: bool = False
    ) -> list[int] | None:
        """Retained items to delete so that ``needed_bytes`` more are free for ``item`` at
        ``tick``; ``[]`` if ``needed_bytes <= 0``. None: evict nothing and wait for an ack.
        The returned items are forgotten by the policy: the caller must delete them.

        ``urgent``: the consumer is blocked waiting for this step, so waiting for an ack is
        not an option (Belady then ignores its wait rule, not its "do no harm" rule).
        ``forced``: consumers do not follow the plan's order (a node's lane waits for this step
        while the lanes that would use the retained items first wait for it), so no rule holds
        the items back: Belady ignores both rules (it still takes the items used last first).
        """
        if needed_bytes <= 0:
            return []
        return self._victims(needed_bytes, item, tick, urgent or forced, forced)

    def is_pinned(self, item: int) -> bool:
        return self._pins[item] > 0

    def reach(self, item: int, tick: int) -> None:
        """The step at ``tick`` shares the pinned copy of ``item`` without a pin of its own (its
        copy is acknowledged once, after the last step that shares it): the item's next use is
        then after ``tick``, if that is later than the pin's. Nothing if ``item`` is not pinned."""
        if self._pins[item]:
            self._reach(item, tick)

    def is_retained(self, item: int) -> bool:
        return self._is_retained(item)

    # ---- per policy ------------------------------------------------------------------
    def _pinned(self, item: int, tick: int) -> None:
        """``item`` was pinned (again) for the step at ``tick``."""

    def _reach(self, item: int, tick: int) -> None:
        """A step at ``tick`` shares ``item``'s pinned copy (see :meth:`reach`)."""

    def _retain(self, item: int, tick: int, after: int | None = None) -> bool:
        """``item``, acknowledged at ``tick``, is no longer pinned: True to keep it (``after``:
        see :meth:`on_ack`)."""
        raise NotImplementedError

    def _release(self, item: int) -> bool:
        """Drop ``item`` from the retained set; False if it was not retained."""
        raise NotImplementedError

    def _is_retained(self, item: int) -> bool:
        raise NotImplementedError

    def _victims(self, needed: int, item: int, tick: int, urgent: bool, forced: bool = False) -> list[int] | None:
        raise NotImplementedError


class NoRetention(RetentionPolicy):
    """Evict on ack: nothing outlives its step (besides a later step already pinning it)."""

    name = "none"

    def _retain(self, item: int, tick: int, after: int | None = None) -> bool:
        return False

    def _release(self, item: int) -> bool:
        return False

    def _is_retained(self, item: int) -> bool:
        return False

    def _victims(self, needed: int, item: int, tick: int, urgent: bool, forced: bool = False) -> list[int] | None:
        return None


class LRU(RetentionPolicy):
    """Keep every acknowledged item; evict the least recently acknowledged first."""

    name = "lru"

    def __init__(self, sizes: Sequence[int], future: NextUse | None = None, *, reserve: int = 0) -> None:
        super().__init__(sizes, future, reserve=reserve)
        self._order: OrderedDict[int, None] = OrderedDict()

    def _retain(self, item: int, tick: int, after: int | None = None) -> bool:
        self._order[item] = None
        return True

    def _release(self, item: int) -> bool:
        if item not in self._order:
            return False
        del self._order[item]
        return True

    def _is_retained(self, item: int) -> bool:
        return item in self._order

    def _victims(self, needed: int, item: int, tick: int, urgent: bool, forced: bool = False) -> list[int] | None:
        victims, freed = [], 0
        for x in self._order:
            if freed >= needed:
                break
            victims.append(x)
            freed += self.sizes[x]
        if freed < needed:
            return None
        for x in victims:
            del self._order[x]
        self.retained_bytes -= freed
        return victims


class Belady(RetentionPolicy):
    """Belady's MIN with sizes, prefetch-aware (see the module notes). Needs ``future``.

    Two max-heaps of encoded ``(next use, item)`` with lazy deletion: the retained items, and
    the pinned ones keyed by their next use after their last pinned step. A lookup is
    O(log n); the heaps are compacted when stale entries outnumber live ones.
    """

    name = "belady"

    def __init__(self, sizes: Sequence[int], future: NextUse | None = None, *, reserve: int = 0) -> None:
        if future is None:
            raise ValueError("the belady policy needs the future access order (a SequenceFuture or PlanFuture)")
        super().__init__(sizes, future, reserve=reserve)
        n = len(self.sizes)
        self._rkey = array("q", [-1]) * n  # retained: next use; -1 not retained
        self._pkey = array("q", [-1]) * n  # pinned: next use after the last pinned step
        self._rheap: list[int] = []
        self._pheap: list[int] = []
        self._retained = 0
        self._pinned_items = 0
        self._placeholders: dict[int, list[int]] = {}  # epoch -> retained items known only as "after it"

    @staticmethod
    def _enc(key: int, item: int) -> int:
        return -((key << _ITEM_BITS) | item)

    def _top(self, heap: list[int], keys: array[int]) -> tuple[int, int] | None:
        """The valid entry of largest key (stale ones are dropped), not removed."""
        while heap:
            v = -heap[0]
            key, item = v >> _ITEM_BITS, v & _ITEM_MASK
            if keys[item] == key:
                return key, item
            heapq.heappop(heap)
        return None

    def _push(self, heap: list[int], keys: array[int], key: int, item: int, live: int) -> None:
        heapq.heappush(heap, self._enc(key, item))
        if len(heap) > 2 * live + 64:  # compact: drop stale entries
            heap[:] = [e for e in heap if keys[(-e) & _ITEM_MASK] == (-e) >> _ITEM_BITS]
            heapq.heapify(heap)

    def _pinned(self, item: int, tick: int) -> None:
        if self._pkey[item] < 0:
            self._pinned_items += 1
        key = self.future.next_use(item, tick)  # type: ignore[union-attr]
        self._pkey[item] = key
        self._push(self._pheap, self._pkey, key, item, self._pinned_items)

    def _reach(self, item: int, tick: int) -> None:
        key = self.future.next_use(item, tick)  # type: ignore[union-attr]
        if key > self._pkey[item]:
            if self._pkey[item] < 0:
                self._pinned_items += 1
            self._pkey[item] = key
            self._push(self._pheap, self._pkey, key, item, self._pinned_items)

    def on_ack(self, item: int, tick: int, after: int | None = None) -> bool:
        keep = super().on_ack(item, tick, after)
        if not self._pins[item] and self._pkey[item] >= 0:
            self._pkey[item] = -1
            self._pinned_items -= 1
        return keep

    def forget(self, item: int) -> None:
        super().forget(item)
        if not self._pins[item] and self._pkey[item] >= 0:
            self._pkey[item] = -1
            self._pinned_items -= 1

    def _retain(self, item: int, tick: int, after: int | None = None) -> bool:
        if after is not None:
            key = self.future.next_use(item, after)  # type: ignore[union-attr]
        else:
            key = self._pkey[item] if self._pkey[item] >= 0 else self.future.next_use(item, tick)  # type: ignore[union-attr]
        if key == NEVER:
            return False
        self._rkey[item] = key
        self._retained += 1
        self._push(self._rheap, self._rkey, key, item, self._retained)
        if is_placeholder(key):
            self._placeholders.setdefault(key >> 32, []).append(item)
        return True

    def _look_again(self, tick: int) -> None:
        """Retained items whose next use was "after epoch e" get a real one once ``tick`` is past
        epoch ``e``: as stale lower bounds they would sort as needed soon, and never be evicted."""
        for epoch in [e for e in self._placeholders if e < tick >> 32]:
            for x in self._placeholders.pop(epoch):
                if self._rkey[x] >= 0 and is_placeholder(self._rkey[x]) and self._rkey[x] >> 32 == epoch:
                    key = self.future.next_use(x, tick)  # type: ignore[union-attr]
                    self._rkey[x] = key
                    self._push(self._rheap, self._rkey, key, x, self._retained)
                    if is_placeholder(key):
                        self._placeholders.setdefault(key >> 32, []).append(x)

    def _release(self, item: int) -> bool:
        if self._rkey[item] < 0:
            return False
        self._rkey[item] = -1
        self._retained -= 1
        return True

    def _is_retained(self, item: int) -> bool:
        return self._rkey[item] >= 0

    def _victims(self, needed: int, item: int, tick: int, urgent: bool, forced: bool = False) -> list[int] | None:
        if self._placeholders:
            self._look_again(tick)
        may_wait = not urgent and self.pinned_bytes >= self.reserve
        pinned_top = self._top(self._pheap, self._pkey) if may_wait else None
        taken: list[tuple[int, int]] = []
        chosen: set[int] = set()
        freed = 0
        ok = True
        while freed < needed:
            top = self._top(self._rheap, self._rkey)
            if top is None:
                ok = False  # not enough retained bytes: only acks can free space
                break
            key, x = top
            if not forced and (key < tick or (pinned_top is not None and pinned_top[0] > key)):
                ok = False  # do no harm / a pinned item is the better victim once acked
                break
            heapq.heappop(self._rheap)
            if x in chosen:  # a second entry of one item (released, then retained again with the same key)
                continue
            chosen.add(x)
            taken.append(top)
            freed += self.sizes[x]
        if not ok:
            for key, x in taken:
                heapq.heappush(self._rheap, self._enc(key, x))
            return None
        for _key, x in taken:
            self._rkey[x] = -1
        self._retained -= len(taken)
        self.retained_bytes -= freed
        return [x for _key, x in taken]


_POLICIES: dict[str, type[RetentionPolicy]] = {"auto": Belady, "belady": Belady, "lru": LRU, "none": NoRetention}


def make_policy(
    name: Literal["auto", "belady", "lru", "none"], sizes: Sequence[int], future: NextUse | None = None, *, reserve: int = 0
) -> RetentionPolicy:
    """A policy by name (``"auto"`` is ``"belady"``).

    Raises:
        ValueError: an unknown name, or ``belady`` without ``future``.
    """
    try:
        cls = _POLICIES[name]
    except KeyError:
        raise ValueError(f"retention policy {name!r}: expected one of {sorted(_POLICIES)}") from None
    return cls(sizes, future, reserve=reserve)
