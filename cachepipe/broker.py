"""Hand-out of ready items: the ready queue, ordering, leases, acks and failures.

Pure bookkeeping under one condition variable; no disk or network. Each planned item has a
sequence number. ``ordered=True`` hands items out in sequence order: an item is handed out only
when every item before it was handed out, failed or skipped. A released item goes back to the
front. Consumers block in :meth:`Broker.take` and wake on :meth:`put`, :meth:`fail`,
:meth:`finish` or :meth:`close` (no polling).
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Generic, Literal, TypeVar

__all__ = ["Broker", "Closed", "Failed", "FailureKind", "Lease"]

T = TypeVar("T")

FailureKind = Literal["item", "oversize", "stream"]


class Closed(Exception):
    """Raised by :meth:`Broker.take` once the broker is closed."""


@dataclass(frozen=True, slots=True)
class Failed:
    """A planned item that could not be delivered; returned by :meth:`Broker.take` in its turn.

    ``kind`` says which policy applies: ``"item"`` (this item failed: ``on_error``),
    ``"oversize"`` (it can never fit: ``on_oversize``) or ``"stream"`` (listing or planning
    stopped here: nothing after it is known, so it is always raised, and taken again by every
    later take). ``trace``: the traceback ``error`` had when it was reported, to raise it again
    from (each raise adds the raiser's frames to the error's own).
    """

    seq: int
    name: str
    error: BaseException
    kind: FailureKind = "item"
    trace: TracebackType | None = None

    @property
    def reason(self) -> str:
        """Why, as text: the error's type and message."""
        return f"{type(self.error).__name__}: {self.error}"


@dataclass(slots=True)
class Lease(Generic[T]):
    """An item handed to a consumer, until it is acked, released or expires.

    Attributes:
        id: a token unique within the broker and unlike any other broker's (a random tag, a
            count, the turn): ack/release with an id must match the live lease.
        deadline: monotonic time at which the lease expires, or None (never).
    """

    seq: int
    name: str
    value: T
    id: str = ""
    deadline: float | None = None


OUTPACED = 1.0
"""A consumer outpaces the items when it waits for its next item longer than this many times
the time it took to come back for it after its last one (see :meth:`Broker.outpaced`): one
that needs ``c`` seconds per item, where the items come every ``T``, waits ``T - c``, so at 1,
a consumer more than twice as fast as the items. A consumer slower than the items waits only
while the first ones come, and less than that (bench_link's slow consumer, 0.25 s per item:
its longest wait after the first item under 120 ms in 6 of 8 quiet runs, 313 ms in one)."""


class Broker(Generic[T]):
    """Ready queue and leases for one pipeline.

    Args:
        ordered: hand out in sequence order (True) or as items become ready (False).
        lease_timeout: seconds after which an unacknowledged lease expires and its item is
            handed out again (at least once delivery for consumers that die); None: never.
        clock: the time, in seconds, for leases, waits and :meth:`outpaced` (default
            :func:`time.monotonic`; tests pass their own). Waits themselves sleep in real time.
    """

    def __init__(
        self, ordered: bool = True, lease_timeout: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._clock = clock
        self.ordered = ordered
        self.lease_timeout = lease_timeout
        self.redelivered = 0  # leases that expired and were handed out again
        self._ids = itertools.count(1)
        # a daemon restarted or a pipeline rebuilt hands the same items out again in the same order:
        # without it their leases had the same ids, and an ack of the old lease evicted the new one's item
        self._tag = os.urandom(4).hex()
        self._cond = threading.Condition()
        self._ready: list[tuple[int, str, T | Failed]] = []  # heap of (seq, name, value | Failed)
        self._resolved: set[int] = set()  # seqs handed out at least once, failed or skipped, above the frontier
        self._frontier = 0  # every seq below it is resolved
        self._leases: dict[str, Lease[T]] = {}
        self._begun = 0  # items begun, ever
        self._pending = 0  # begun (downloading) but not yet ready
        self._fresh = 0  # entries in _ready never handed out (not released ones)
        self._finished = False  # no more items will be planned
        self._stopped: Failed | None = None  # planning stopped (its failure taken): the stream ends with it, not None
        self._closed = False
        self.wait_seconds = 0.0  # total time consumers spent blocked in take()
        self._waiting = 0  # consumers blocked in take() right now
        # for outpaced(): the last hand-out (monotonic s), the wait going on (the first waiter's: when
        # it began, and how long after the last hand-out), and what the last wait that ended showed
        self._handed_at: float | None = None
        self._wait_began, self._wait_gap = 0.0, math.inf
        self._outpaced = False
        # called after each hand-out (a lease or a failure taken), outside the lock: the consumers moved
        # on, so an item may have fewer ahead of it now (served()); the fetcher's wake for its hedges
        self.on_hand_out: Callable[[], None] | None = None
        # called, outside the lock, when a take begins to wait with nothing ready (starving() is
        # true from then until it returns): the fetcher's wake for a download that waits for room
        # where dropping an earlier owner's item not due yet would make it (Cache.wake_starving)
        self.on_starve: Callable[[], None] | None = None

    # ---- producer side ---------------------------------------------------------------
    def begin(self) -> int:
        """Count an item the producer started fetching; return its turn: how many items were
        begun before it (``turn - served()`` of them are ahead of it, see :meth:`served`)."""
        return self.begin_many(1)

    def begin_many(self, count: int) -> int:
        """:meth:`begin` ``count`` items in one lock round; the first one's turn (the others'
        follow it)."""
        with self._cond:
            self._begun += count
            self._pending += count
            return self._begun - count

    def served(self) -> int:
        """How many begun items are no longer ahead of the consumers (handed out, or their
        failure returned). The item whose :meth:`begin` was the ``n``-th (from 0) has
        ``n - served()`` items ahead of it. Read without the lock: a hint for the fetcher."""
        return self._begun - self._pending - self._fresh

    def put(self, seq: int, name: str, value: T) -> None:
        """An item is ready to hand out (:meth:`put_many` of one: a subclass overrides that only)."""
        self.put_many([(seq, name, value)])

    def put_many(self, ready: Sequence[tuple[int, str, T]]) -> None:
        """Items ``(seq, name, value)`` are ready to hand out: one lock round, one wake-up."""
        with self._cond:
            self._pending -= len(ready)
            self._fresh += len(ready)
            for entry in ready:
                heapq.heappush(self._ready, entry)
            self._cond.notify_all()

    def fail(self, seq: int, name: str, error: BaseException, begun: bool = True, kind: FailureKind = "item") -> None:
        """An item failed (or, ``kind="stream"``, the planning of every step from ``seq`` on, or
        from the first after it not yet resolved: a skipped step is done); consumers see a
        :class:`Failed` in its turn."""
        with self._cond:
            if begun:
                self._pending -= 1
            if kind == "stream":  # in the turn of the first step not resolved: one skipped is done already
                seq = max(seq, self._frontier)
                while seq in self._resolved:
                    seq += 1
            self._fresh += 1
            heapq.heappush(self._ready, (seq, name, Failed(seq, name, error, kind, error.__traceback__)))
            self._cond.notify_all()

    def skip(self, seq: int) -> None:
        """An item will not be delivered (skipped by policy); ordering moves past it."""
        with self._cond:
            self._resolve(seq)
            self._cond.notify_all()

    def withdrawn(self, seq: int) -> bool:
        """Whether the planner wants planned step ``seq`` back, not begun, while the producer waits
        for its room (a node's lane waits for a step planned after it; read without the lock:
        :meth:`withdraw` decides). Never here."""
        return False

    def withdraw(self, seq: int) -> None:
        """The producer gave back step ``seq`` without beginning it, as :meth:`withdrawn` asked."""
        raise NotImplementedError("a pipeline's broker never asks for a step back")

    def finish(self) -> None:
        """The producer planned its last item."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def wait_ahead_below(self, limit: int) -> bool:
        """Block until fewer than ``limit`` items are ahead of the consumers (fetching, or
        ready and never handed out); False if the broker is closed meanwhile."""
        with self._cond:
            while not self._closed and self._pending + self._fresh >= limit:
                self._cond.wait()
            return not self._closed

    def room_ahead(self, limit: int) -> int:
        """How many more items may be begun before ``limit`` are ahead of the consumers
        (fetching, or ready and never handed out); 0 or less: none. Does not wait."""
        with self._cond:
            return limit - self._pending - self._fresh

    # ---- consumer side ---------------------------------------------------------------
    def take(self, timeout: float | None = None) -> Lease[T] | Failed | None:
        """Next item (a :class:`Lease`) or :class:`Failed`; None at the end of the stream (or, once
        a ``"stream"`` failure was taken, that failure again: the rest of the stream is unknown).

        Raises:
            TimeoutError: nothing became available within ``timeout`` seconds.
            Closed: the broker was closed.
        """
        got = self._take(timeout)
        if got is not None and self.on_hand_out is not None:
            self.on_hand_out()
        return got

    def _take(self, timeout: float | None) -> Lease[T] | Failed | None:
        """:meth:`take`, under the lock (without :attr:`on_hand_out`)."""
        start = self._clock()
        deadline = None if timeout is None else start + timeout
        began: float | None = None  # when this call began to wait, and how long after the last hand-out
        gap = math.inf
        with self._cond:
            try:
                while True:
                    if self._closed:
                        raise Closed
                    now = self._clock()
                    next_expiry = self._expire(now)
                    got = self._pop(now)
                    if got is not None:
                        if began is not None:
                            self._outpaced = now - began > OUTPACED * gap
                        self._handed_at = now
                        self._cond.notify_all()
                        return got
                    if self._finished and self._pending == 0 and not self._ready and next_expiry is None:
                        # outstanding leases without expiry do not hold the end; a stream that stopped
                        # ends with its failure, for every later take: not as if every item was delivered
                        return self._stopped
                    waits = [t - now for t in (deadline, next_expiry) if t is not None]
                    wait = min(waits) if waits else None
                    if deadline is not None and deadline - now <= 0:
                        raise TimeoutError(f"no item became ready within {timeout} s")
                    if began is None:
                        began, gap = now, (math.inf if self._handed_at is None else now - self._handed_at)
                        if not self._waiting:
                            self._wait_began, self._wait_gap = began, gap
                        self._waiting += 1  # until this take returns (counted off below): starving() reads it
                        if self.on_starve is not None and not self._ready:
                            self._cond.release()  # the hook takes the fetcher's and the cache's locks
                            try:
                                self.on_starve()
                            finally:
                                self._cond.acquire()
                            continue  # what changed meanwhile is read again before waiting
                    self._cond.wait(max(wait, 0.0) if wait is not None else None)
            finally:
                if began is not None:
                    self._waiting -= 1
                self.wait_seconds += self._clock() - start

    def take_many(self, count: int, timeout: float | None = None) -> list[Lease[T]] | Failed | None:
        """Up to ``count`` items: the next one as :meth:`take` (blocking), then those ready after
        it in turn, without waiting. A :class:`Failed` is returned alone, in its turn (one that
        follows items is left for the next call); None at the end of the stream.

        Raises:
            TimeoutError, Closed: as :meth:`take`.
        """
        first = self.take(timeout)
        if not isinstance(first, Lease):
            return first
        taken = [first]
        with self._cond:
            now = self._clock()
            while len(taken) < count and self._ready and not isinstance(self._ready[0][2], Failed):
                got = self._pop(now)
                if not isinstance(got, Lease):  # None: not its turn yet (a Failed is never next here)
                    break
                taken.append(got)
            self._cond.notify_all()
        if len(taken) > 1 and self.on_hand_out is not None:
            self.on_hand_out()
        return taken

    def _pop(self, now: float) -> Lease[T] | Failed | None:
        """The next item in turn, leased (or its failure), if one is ready; the caller notifies."""
        if not self._ready or (self.ordered and self._ready[0][0] > self._frontier and self._ready[0][0] not in self._resolved):
            return None
        seq, name, value = heapq.heappop(self._ready)
        if seq >= self._frontier and seq not in self._resolved:
            self._fresh -= 1
        self._resolve(seq)
        if isinstance(value, Failed):
            if value.kind == "stream":
                self._stopped = value
            return value
        expires = None if self.lease_timeout is None else now + self.lease_timeout
        lease = Lease(seq, name, value, f"{self._tag}-{next(self._ids):x}-{seq}", expires)
        self._leases[name] = lease
        return lease

    def _expire(self, now: float) -> float | None:
        """Re-queue expired leases; return the next expiry time among live leases, or None."""
        if self.lease_timeout is None:
            return None
        next_expiry = None
        for name, lease in list(self._leases.items()):
            if lease.deadline is None:
                continue
            if lease.deadline <= now:
                del self._leases[name]
                heapq.heappush(self._ready, (lease.seq, lease.name, lease.value))
                self.redelivered += 1
            elif next_expiry is None or lease.deadline < next_expiry:
                next_expiry = lease.deadline
        return next_expiry

    def ack(self, name: str, lease_id: str | None = None) -> Lease[T]:
        """End the lease on ``name``; returns it.

        Raises:
            KeyError: ``(name, why)``: ``name`` is not leased (``why`` ``"not leased"``), or
                ``lease_id`` is given and is not the live lease (``"another lease"``: it expired
                and the item went to another consumer).
        """
        return self.ack_many([(name, lease_id)])[0]

    def ack_many(self, names: Sequence[tuple[str, str | None]]) -> list[Lease[T]]:
        """End the leases on ``(name, lease_id)`` pairs, all or none; returns them in order.

        Raises:
            KeyError: one of them is not leased (as :meth:`ack`), or is given twice (``why``
                ``"twice"``); no lease was ended.
        """
        with self._cond:
            self._expire(self._clock())
            leases: list[Lease[T]] = []
            seen: set[str] = set()
            for name, lease_id in names:
                if name in seen:
                    raise KeyError(name, "twice")
                lease = self._live(name, lease_id)
                leases.append(lease)
                seen.add(name)
            for lease in leases:
                del self._leases[lease.name]
            self._cond.notify_all()
            return leases

    def restore(self, leases: Sequence[Lease[T]]) -> None:
        """Make ``leases`` (ended by :meth:`ack`) live again: the ack could not be recorded, so the
        consumer still holds the items (deadlines unchanged: they may expire as before)."""
        with self._cond:
            for lease in leases:
                self._leases[lease.name] = lease
            self._cond.notify_all()

    def release(self, name: str, lease_id: str | None = None) -> Lease[T]:
        """Give ``name`` back: it is handed out again before anything else. Raises like :meth:`ack`."""
        with self._cond:
            lease = self._pop_lease(name, lease_id)
            heapq.heappush(self._ready, (lease.seq, lease.name, lease.value))
            self._cond.notify_all()
            return lease

    def renew(self, name: str, lease_id: str | None = None) -> Lease[T]:
        """Extend a live lease by ``lease_timeout`` from now (a consumer still working). Raises like :meth:`ack`."""
        with self._cond:
            self._expire(self._clock())
            lease = self._live(name, lease_id)
            if self.lease_timeout is not None:
                lease.deadline = self._clock() + self.lease_timeout
            return lease

    def _pop_lease(self, name: str, lease_id: str | None) -> Lease[T]:
        self._expire(self._clock())
        lease = self._live(name, lease_id)
        del self._leases[name]
        return lease

    def _live(self, name: str, lease_id: str | None) -> Lease[T]:
        """The live lease on ``name`` (under the lock), if it is ``lease_id`` (when given).

        Raises:
            KeyError: ``(name, why)``, ``why`` ``"not leased"`` or ``"another lease"``.
        """
        lease = self._leases.get(name)
        if lease is None:
            raise KeyError(name, "not leased")
        if lease_id is not None and lease.id != lease_id:
            raise KeyError(name, "another lease")
        return lease

    def outpaced(self) -> bool:
        """Whether the consumers come back for items faster than the items come: the wait in
        :meth:`take` going on, or else the last one that ended, lasted longer than
        :data:`OUTPACED` times the time its consumer took to come back after the item handed
        out before (a consumer that reads fast comes back at once and waits; one slower than
        the items waits little, if at all). False until a consumer has waited after a hand-out.
        With several consumers, the wait going on is timed from the first of them to wait; if
        that one is served while others still wait, the wait is still timed from then, so it
        soon says True (every item ahead counts: the rule for a link that is the limit).
        Read without the lock: a hint for the fetcher (see
        :func:`cachepipe.fetch_policy.items_ahead`)."""
        if self._waiting and self._clock() - self._wait_began > OUTPACED * self._wait_gap:
            return True
        return self._outpaced

    def fresh(self) -> int:
        """Items ready and never handed out (read without the lock: a hint for the fetcher)."""
        return self._fresh

    def starving(self) -> bool:
        """A consumer is blocked in :meth:`take` with nothing ready (read without the lock: a hint)."""
        return self._waiting > 0 and not self._ready

    def patient(self, items: int) -> bool:
        """Whether the consumers need no new item soon: ``items`` or more are ready and never
        handed out, and no consumer waits (read without the lock: a hint). Only a hand-out makes
        it false while a consumer is not waiting already, and each calls :attr:`on_hand_out` after."""
        return self._fresh >= items and not self._waiting

    def leased(self) -> list[Lease[T]]:
        with self._cond:
            return list(self._leases.values())

    def counts(self) -> dict[str, int]:
        """Snapshot: ``ready`` (waiting for a consumer), ``handed`` (leased), ``pending`` (fetching)."""
        with self._cond:
            return {"ready": len(self._ready), "handed": len(self._leases), "pending": self._pending}

    def close(self) -> None:
        """Wake every waiter; further :meth:`take` calls raise :class:`Closed`."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- internals -------------------------------------------------------------------
    def _resolve(self, seq: int) -> None:
        if seq < self._frontier:
            return
        if seq == self._frontier:  # in turn (the common case): no need to note it
            self._frontier += 1
        else:
            self._resolved.add(seq)
        while self._frontier in self._resolved:
            self._resolved.discard(self._frontier)
            self._frontier += 1
