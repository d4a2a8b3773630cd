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

Ticks order the steps: a sequence index (:class:`SequenceFuture`) or a plan's
``Step.tick`` (:class:`PlanFuture`). Policies:

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
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from .plan import tick as plan_tick
from .plan_split import RUN

__all__ = [
    "LRU",
    "NEVER",
    "Belady",
    "NextUse",
    "NoRetention",
    "PlanFuture",
    "RetentionPolicy",
    "SequenceFuture",
    "SimResult",
    "belady_min",
    "compulsory_bytes",
    "is_placeholder",
    "make_policy",
    "run",
    "simulate",
]

NEVER = (1 << 63) - 1  #: the next use of an item that is not read again
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
    """

    def __init__(self, plan: EpochShares, horizon: int = 2) -> None:
        if horizon < 1:
            raise ValueError(f"horizon {horizon!r}: expected at least 1 epoch")
        self.plan, self.horizon = plan, horizon
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

    def on_ack(self, item: int, tick: int) -> bool:
        """The step ``tick`` of ``item`` is acknowledged. True: keep the files (retained, or
        still pinned by a later step); False: delete them now.

        Raises:
            KeyError: ``item`` is not pinned.
        """
        if not self._pins[item]:
            raise KeyError(f"item {item} is not pinned: acknowledged twice, or never fetched")
        self._pins[item] -= 1
        if self._pins[item]:
            return True
        self.pinned_bytes -= self.sizes[item]
        if self._retain(item, tick):
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

    def _retain(self, item: int, tick: int) -> bool:
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

    def _retain(self, item: int, tick: int) -> bool:
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

    def _retain(self, item: int, tick: int) -> bool:
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

    def on_ack(self, item: int, tick: int) -> bool:
        keep = super().on_ack(item, tick)
        if not self._pins[item] and self._pkey[item] >= 0:
            self._pkey[item] = -1
            self._pinned_items -= 1
        return keep

    def forget(self, item: int) -> None:
        super().forget(item)
        if not self._pins[item] and self._pkey[item] >= 0:
            self._pkey[item] = -1
            self._pinned_items -= 1

    def _retain(self, item: int, tick: int) -> bool:
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


# ---- simulation ----------------------------------------------------------------------
@dataclass(frozen=True)
class SimResult:
    """What a simulated run downloaded.

    Attributes:
        bytes: total bytes downloaded.
        per_step: bytes downloaded for each step (0: read from disk).
        lead: for each downloaded step, how many steps ahead of the consumer its download
            started (0: the consumer was already waiting for it); -1 for steps read from disk.
            With a fast network, a small lead puts the download on the consumer's critical path.
    """

    bytes: int
    per_step: array[int]
    lead: array[int]


def run(
    policy: str | RetentionPolicy,
    sequence: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    prefetch: int | None = None,
    reserve: int = 0,
    ticks: Sequence[int] | None = None,
) -> SimResult:
    """Replay ``sequence`` through a cache of ``capacity`` bytes run by ``policy`` (a name, or
    an instance whose future uses the same ticks: positions, or ``ticks`` if given, e.g. the
    ``Step.tick`` of a plan's steps with a :class:`PlanFuture`).

    The fetcher runs as far ahead as the capacity (and ``prefetch`` steps, if given) allows,
    as a fast network would let it; when it must wait, the consumer acknowledges its next
    step. This is the worst case for retention, since pinned items take the most room.

    Raises:
        ValueError: an item does not fit in ``capacity``.
    """
    if prefetch is not None and prefetch < 1:
        raise ValueError(f"prefetch {prefetch!r}: expected at least 1 step, or None")
    sizes = sizes if isinstance(sizes, array) else array("q", sizes)
    if isinstance(policy, str):
        policy = make_policy(policy, sizes, SequenceFuture(sequence), reserve=reserve)  # type: ignore[arg-type]
    n = len(sequence)
    at = range(n) if ticks is None else ticks
    per_step = array("q", [0]) * n
    lead = array("q", [-1]) * n
    free, c, p = capacity, 0, 0
    while c < n:
        while p < n and (prefetch is None or p - c < prefetch):
            x = sequence[p]
            if not policy.on_fetch(x, at[p]):
                size = sizes[x]
                if size > free:
                    victims = policy.choose_victims(size - free, x, at[p], urgent=p == c)
                    if victims is None:
                        if p == c:
                            raise ValueError(f"item {x} of {size} bytes does not fit in capacity {capacity} (free {free})")
                        break
                    free += sum(sizes[v] for v in victims)
                    if size > free:
                        raise RuntimeError(f"{policy.name}: victims free {free} bytes, item {x} needs {size}")
                free -= size
                per_step[p] = size
                lead[p] = p - c
                policy.on_admit(x, at[p])
            p += 1
        x = sequence[c]
        if not policy.on_ack(x, at[c]):
            free += sizes[x]
        c += 1
    return SimResult(sum(per_step), per_step, lead)


def simulate(
    policy: str | RetentionPolicy,
    sequence: Sequence[int],
    sizes: Sequence[int],
    capacity: int,
    *,
    prefetch: int | None = None,
    reserve: int = 0,
) -> int:
    """Bytes downloaded by :func:`run`."""
    return run(policy, sequence, sizes, capacity, prefetch=prefetch, reserve=reserve).bytes


def belady_min(sequence: Sequence[int], sizes: Sequence[int], capacity: int) -> int:
    """Bytes downloaded by offline Belady MIN without prefetch (each item fetched when read,
    then kept until it is the cached item with the farthest next use). With equal sizes this
    is the minimum any cache of ``capacity`` can achieve on ``sequence``; with variable sizes
    it is MIN's heuristic (the exact optimum is NP-hard).

    Raises:
        ValueError: an item does not fit in ``capacity``.
    """
    nxt = SequenceFuture(sequence)
    keys: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    used = total = 0
    for t, x in enumerate(sequence):
        size = sizes[x]
        if x in keys:
            del keys[x]
            used -= size
        else:
            total += size
            while used + size > capacity:
                if not heap:
                    raise ValueError(f"item {x} of {size} bytes does not fit in capacity {capacity}")
                negkey, v = heapq.heappop(heap)
                if keys.get(v) == -negkey:
                    del keys[v]
                    used -= sizes[v]
        key = nxt.next_use(x, t)
        if key != NEVER:
            keys[x] = key
            heapq.heappush(heap, (-key, x))
            used += size
    return total


def compulsory_bytes(sequence: Sequence[int], sizes: Sequence[int]) -> int:
    """Bytes of the distinct items of ``sequence``: a lower bound for any cache."""
    return sum(sizes[x] for x in set(sequence))
