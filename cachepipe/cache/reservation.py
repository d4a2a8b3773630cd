"""Reservation: room under the capacity, and claims on names (one copy of an item at a time).

A download's bytes are reserved (from its listed size) before it starts, waiting for room
(acks) while they do not fit, and never beyond :attr:`~.core.Cache.limit` (an item that would
never fit is refused as oversize, not waited for). A recovered (or shelved) item that would
otherwise never leave a waiting download room is dropped for it; with retention, the policy
picks retained items to evict. A download may be asked back while it waits (``withdrawn``):
then nothing is reserved, claimed or dropped for it.

:class:`_Reservation` is a base class of :class:`~.core.Cache` (see :mod:`.acks` for why the
cache is built of parts): it works under the cache's lock on the ledger, the claims and the
recovered items, and drops or deletes through :class:`~.acks._Acks` below it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from ..catalog import Item
from ..config import Share
from ..errors import ConfigError, OversizeError
from ..retention import RetentionPolicy
from .acks import _Acks
from .fulldisk import Room, room_now
from .room import held_in, room_at

__all__: list[str] = []

log = logging.getLogger("cachepipe.cache")


def _never() -> bool:
    return False


def _capacity_bytes(capacity: int | Share, root: Path, usage: Room | None = None) -> int:
    """``capacity`` in bytes for a cache at ``root``: a share of the space free on its filesystem
    and held under ``root`` (the cache's own items are its room, not taken from it: a cache
    opened again over the items it kept has the size it had), or the bytes given. Bytes beyond
    the filesystem's size are held to the room there, the space free and what ``root`` holds
    (logged, naming both): not to the filesystem's size, which what else lives there (another
    tenant's files, blocks kept for root) makes a cap reached only by filling the disk. A
    capacity within the filesystem's size is kept as given: the space others hold may come back;
    so is any on a filesystem that reports no size (ramfs: :func:`~.fulldisk.no_room`).
    ``usage``: :func:`~.fulldisk.room_now` of ``root``, read already by :meth:`~.core.Cache.open`
    (None: read here, the free space after the walk of ``root``: see :func:`~.room.room_at`)."""
    if isinstance(capacity, Share):
        return int(room_at(root, [root], caches=True, free=None if usage is None else usage.bytes) * capacity.fraction)
    live = usage is None
    if usage is None:
        usage = room_now(root)
    if capacity <= usage.total or usage.total == 0:  # 0: a filesystem that reports no size (ramfs): nothing to hold it to
        return capacity
    held = held_in(root)
    if live:  # the free space read after the walk, as for a share: bytes written meanwhile count once
        usage = room_now(root)
    log.warning(
        "capacity %d bytes exceeds the size of the filesystem of %s (%d bytes): held to the room there, %d bytes: "
        "%d bytes free and %d bytes that it holds (taken again at each open); an item larger than what that leaves "
        "for items is refused as oversize; lower the capacity or give it as a share like '80%%'",
        capacity,
        root,
        usage.total,
        usage.bytes + held,
        usage.bytes,
        held,
    )
    return min(capacity, usage.bytes + held)


class _Reservation(_Acks):
    """Room and claims (see the module notes): a base of :class:`~.core.Cache`."""

    def set_capacity(self, capacity: int | Share, at_least: int = 0, listed: int | None = None) -> int:
        """Change the capacity now; returns it in bytes. Shrinking deletes nothing: downloads
        wait until acknowledgements bring the cache under the new cap.

        Raises:
            ConfigError: the new capacity leaves no room beside foreign files and the state
                budget, or less than ``at_least`` bytes (what the largest item still to be
                fetched takes, :meth:`charge`, which would fail; ``listed``: its listed size).
        """
        new = _capacity_bytes(capacity, self.root)
        beside = self.foreign + self.overhead
        if beside >= new:
            raise ConfigError(f"capacity {new} bytes leaves no room beside {beside} bytes of other files and state")
        if new - beside < at_least:
            size = f"{at_least} bytes" if listed in (None, at_least) else f"{listed} bytes listed, {at_least} in whole blocks"
            raise ConfigError(
                f"capacity {new} bytes leaves {new - beside} bytes for items beside {beside} bytes of other files and "
                f"state, less than the largest item planned ({size}), which would fail (on_oversize='raise'): "
                f"give at least {at_least + beside} bytes, or on_oversize='skip' to skip such items"
            )
        with self._cond:
            self.ledger.capacity = new
            self._cond.notify_all()
        return new

    def reserve(self, size: int, name: str = "") -> bool:
        """Block until ``size`` bytes fit under the capacity and reserve them.

        Returns False (reserving nothing) if the cache is closed meanwhile.

        Raises:
            OversizeError: ``size`` is over :attr:`limit`, now or while it waits (the state budget
                of a streamed listing grows as names are listed, or the capacity was lowered):
                it would never fit, so it is not waited for. ``name`` names it in the error.
        """
        got = self._reserve(size, name, leftovers=False)
        return bool(got)

    def _reserve(
        self,
        size: int,
        name: str,
        leftovers: bool,
        withdrawn: Callable[[], bool] = _never,
        listed: int | None = None,
        starving: Callable[[], bool] = _never,
        run: int = 0,
        patient: Callable[[], bool] = _never,
        then: int | Callable[[], int] | None = None,
    ) -> bool | str | None:
        """:meth:`reserve`; with ``leftovers``, the wait ends too when a recovered (or shelved)
        item is in the way (:meth:`_in_the_way`, ``urgent`` while ``starving()``): its name is
        returned, to drop. None: ``withdrawn()`` was true before it reserved (nothing reserved).
        ``listed``: the item's listed size, where ``size`` is its charge (:meth:`charge`), for
        the oversize error.

        ``run``: bytes beyond ``size`` to wait for too (up to an eighth of :attr:`limit`) while
        ``patient()`` (the consumers have items enough ready), so that a full cache starts its
        downloads in runs, not one per ack (see :meth:`acquire`). ``patient()`` is read each
        time the wait is woken; whoever makes it false calls :meth:`wake_run` after.

        ``then``: the charge of the planner's next item, set as :meth:`expect` does in the lock
        round that reserves this one (None: left as it is)."""
        ledger = self.ledger
        with self._cond:
            try:
                while not self._closed:
                    fits = ledger.fits(size)
                    wanted = size + min(run, ledger.limit // 8)
                    if fits and (wanted == size or ledger.fits(wanted) or not patient()):
                        break
                    if not fits and size > ledger.limit:
                        raise self._oversize(name, size if listed is None else listed, size)
                    if withdrawn():  # before dropping anything for it
                        return None
                    if leftovers and not fits:  # the waiter that force_room() means (a plain reserve leaves it be)
                        leftover = self._in_the_way(size, starving())
                        self._forced = False
                        if leftover is not None:
                            return leftover
                    self._wanting = size
                    if run:  # the planner's (one thread): a plain reserve waiting beside it leaves its flag be
                        self._waiting_run, self._run_wanted = fits, wanted
                    self._cond.wait()
            finally:
                if run:
                    self._waiting_run = False
                if self._wanting:  # a streamed listing may wait for the room it left to this one
                    self._wanting = 0
                    self._cond.notify_all()
            if self._closed:
                return False
            if withdrawn():  # asked back when the room it now fits in was freed (see acquire)
                return None
            ledger.reserve(size)
            if then is not None:
                self._expect(then)
            return True

    def expect(self, size: int | Callable[[], int]) -> None:
        """Say that the planner's next item takes ``size`` bytes (0: none is known yet): it is
        planned, and its reservation comes next. A streamed listing's budget
        (:meth:`~cachepipe.cache.Cache.note_listed`) leaves that room, as it does for a
        download waiting for room; else an ack that freed room while the planner was between
        two reservations went to the budget's next block, and the next item, wanting more than
        the room left, could wait for ever beside a consumer that held the rest. A reservation
        (:meth:`acquire`, :meth:`acquire_many`) sets it too, in the same round of the lock, to
        its ``then``. A callable is read, the lock held, each time the listing asks: the next
        item is one the listing may queue meanwhile (the first of the plan's next run, not
        queued yet when the run's last item was reserved); it takes no lock but a listing's."""
        with self._cond:
            self._expect(size)

    def _expect(self, size: int | Callable[[], int]) -> None:
        """:meth:`expect`, the lock held."""
        before, self._expected = self._expected, size
        if callable(size) or callable(before) or size < before:  # a callable may read lower
            self._cond.notify_all()

    def _ahead(self) -> int:
        """The room a growing state budget leaves to planned items: what the download waiting
        for room wants, or what the planner's next item takes (:meth:`expect`)."""
        expected = self._expected
        return max(self._wanting, expected() if callable(expected) else expected)

    def unreserve(self, size: int, name: str | None = None, left: int = 0) -> None:
        """Release a reservation (and the claim on ``name``) of an item that will not be published;
        ``left`` bytes of it could not be deleted and count as foreign until the next open."""
        number = self._number(name) if name is not None and self._policy is not None else None
        with self._cond:
            self.ledger.release(size)
            self.ledger.foreign += left
            if name is not None:
                self._claimed.discard(name)
                if self._policy is not None and number is not None:
                    self._policy.forget(number)
            self._cond.notify_all()

    def claim(self, name: str) -> bool:
        """Block until no copy of ``name`` is on disk or on its way (an earlier epoch's copy was
        acked and deleted), then claim it for a download. False if the cache closed meanwhile.

        The claim ends when the item is evicted, dropped or discarded.
        """
        with self._cond:
            while not self._closed and name in self._claimed:
                self._cond.wait()
            if self._closed:
                return False
            self._claimed.add(name)
            return True

    def _claim_or_adopt(self, name: str, withdrawn: Callable[[], bool] = _never) -> Path | bool | None:
        """:meth:`claim`, except that an earlier copy that is :meth:`shelve` d while we wait is
        handed over instead (its path): it is the copy this step wants. None: ``withdrawn()``
        was true when it would wait."""
        with self._cond:
            while not self._closed and name in self._claimed:
                recovered = self._recovered.pop(name, None)
                if recovered is not None:
                    return recovered
                if withdrawn():
                    return None
                self._cond.wait()
            if self._closed:
                return False
            self._claimed.add(name)
            return True

    def acquire(
        self,
        item: Item,
        tick: int = 0,
        starving: Callable[[], bool] = _never,
        extra: int = 0,
        withdrawn: Callable[[], bool] = _never,
        run: int = 0,
        patient: Callable[[], bool] = _never,
        then: int | Callable[[], int] | None = None,
    ) -> Path | bool | None:
        """Make room for the step at ``tick`` reading ``item``.

        Returns the item's path if it is on disk already (recovered at open, or retained): hand
        it out, no download. True: its space is reserved (and its name claimed): download it.
        False: the cache closed meanwhile. None: ``withdrawn()`` was true before anything was
        reserved, when it was about to wait, or once woken (:meth:`wake`), or once room was
        freed: nothing is reserved, claimed or dropped for it (a node plans a waiting lane's
        step first, see :meth:`.lanequeues.LaneQueues.withdraw`; a lane that consumes asks for the
        download back before it frees the room, which the download must not take then).

        Without retention this waits for any earlier copy of the item to be gone (:meth:`claim`)
        and for space (:meth:`reserve`), after dropping recovered items that would otherwise
        never leave it room, or while ``starving()`` whose room it needs now (:meth:`_in_the_way`;
        a node's lane that begins to wait wakes it to look). With retention, the policy picks
        retained items to evict; when it prefers to wait for an ack instead, the wait is
        re-checked every 0.25 s against ``starving()`` (a consumer blocked on this very step),
        the one case of a timed wait here. While no item is pinned, no ack can come: the
        policy's rules are waived as :meth:`force_room` waives them (a node's lanes read out of
        the plan's order, and the steps that would read the retained items first cannot be
        planned before this one; before, the download waited for a lane's give-back to force
        room, 5 s by default). ``extra``: bytes reserved beside the item's own (the
        ``prepare`` hook's output).

        ``run`` (without retention): once the item fits, wait on for ``run`` bytes more while
        ``patient()`` (the consumers have items enough ready, so the room is not needed now):
        in a full cache each ack frees one item's room, and a download started per ack costs
        its wake-ups, its request and its publishing alone, where a run of them shares them
        (:meth:`acquire_many`). Whoever makes ``patient()`` false calls :meth:`wake_run`.

        ``then`` (without retention): the charge of the planner's next item, known once this
        one's space is reserved, in the same round of the lock (see :meth:`expect`).
        """
        with self._cond:
            recovered = self._recovered.pop(item.name, None)
        if recovered is not None:
            return recovered
        policy = self._policy
        if policy is None:
            claimed = self._claim_or_adopt(item.name, withdrawn)
            if claimed is not True:
                return claimed  # the earlier copy was shelved meanwhile (a path), the cache closed, or withdrawn
            try:
                charge = self.charge(item, extra)
                while isinstance(
                    got := self._reserve(charge, item.name, True, withdrawn, item.size, starving, run, patient, then), str
                ):
                    log.info("dropping %s, an earlier owner's item not due yet, to make room for %s", got, item.name)
                    self.drop(got, gone_ok=True)  # another download waiting for room may have dropped it meanwhile
            except BaseException:
                self.unreserve(0, item.name)  # the claim
                raise
            if got is None:
                self.unreserve(0, item.name)  # withdrawn: the claim
            return got
        return self._acquire_retained(policy, item, tick, starving, withdrawn)

    def acquire_many(
        self,
        items: Sequence[tuple[Item, int]],
        withdrawn: Callable[[], bool] = _never,
        then: int | Callable[[], int] | None = None,
    ) -> int:
        """:meth:`acquire` ``(item, extra)`` in order, for as many as need no wait, in one lock
        round: each fits now, no copy of it is on disk or on its way, and no retention policy or
        recovered item is involved. Returns how many were reserved and claimed (0: call
        :meth:`acquire` for the next, which waits or decides; so too if ``withdrawn()``, the
        first item asked back, as :meth:`acquire`'s). The planner's next item (:meth:`expect`)
        is then the first one not reserved, or, all of them reserved, one of ``then`` bytes
        (None: left as it is)."""
        if self._policy is not None:
            return 0
        ledger, claimed = self.ledger, self._claimed
        with self._cond:
            if self._closed or self._recovered or withdrawn():
                return 0
            for count, (item, extra) in enumerate(items):
                charge = self.charge(item, extra)
                if item.name in claimed or not ledger.fits(charge):
                    self._expect(charge)
                    return count
                claimed.add(item.name)
                ledger.reserve(charge)
            if then is not None:
                self._expect(then)
            return len(items)

    def _acquire_retained(
        self, policy: RetentionPolicy, item: Item, tick: int, starving: Callable[[], bool], withdrawn: Callable[[], bool]
    ) -> Path | bool | None:
        ledger = self.ledger
        charge = self.charge(item)  # no extra: retain='auto' takes no unpack or prepare (config)
        idx = self._number(item.name)
        if idx is None:
            raise KeyError(f"item {item.name!r} is not in the plan given to use_retention()")
        while True:
            victims: list[tuple[str, int]] = []
            with self._cond:
                while not victims:
                    if self._closed:
                        return False
                    if charge > ledger.limit:  # it would never fit: not waited for (as in _reserve)
                        raise self._oversize(item.name, item.size, charge)
                    if policy.is_pinned(idx):  # an earlier step's copy is still out: one copy at a time
                        if withdrawn():
                            return None
                        self._cond.wait()
                        continue
                    if policy.on_fetch(idx, tick):
                        return self.item_path(item)  # retained: still reserved and claimed
                    if item.name in self._claimed:  # its earlier copy is being deleted (acked, not kept): wait
                        if withdrawn():
                            return None
                        self._cond.wait()
                        continue
                    if withdrawn():  # before reserving or evicting anything for it (see acquire)
                        return None
                    free = ledger.free
                    if free >= charge:
                        ledger.reserve(charge)
                        self._claimed.add(item.name)
                        policy.on_admit(idx, tick)
                        return True
                    if free + ledger.reaping >= charge:  # victims being deleted make room: no more
                        self._cond.wait()
                        continue
                    forced, self._forced = self._forced, False
                    # nothing pinned: no ack can free room, so waiting for one ends only when a
                    # node's lane forces it (the steps that read the retained items first wait
                    # behind this download): evict as forced now (see the method's notes)
                    forced = forced or not policy.pinned_bytes
                    chosen = policy.choose_victims(charge - free - ledger.reaping, idx, tick, urgent=starving(), forced=forced)
                    if chosen is None:
                        self._wanting = charge
                        try:
                            self._cond.wait(0.25)
                        finally:
                            self._wanting = 0
                        continue
                    for victim in chosen:
                        name = self._names[victim]
                        victims.append((name, self.record.dropping(name)))
            for name, size in victims:
                self._delete(name, size, dropped=True)

    def _oversize(self, name: str, listed: int, charge: int) -> OversizeError:
        """The error for item ``name`` of ``listed`` bytes that takes ``charge`` (beyond :attr:`limit`)."""
        ledger = self.ledger
        return OversizeError(name, listed, ledger.capacity, ledger.foreign + ledger.overhead, taken=charge, block=self.block)

    def shortfall(self) -> int:
        """Bytes that a download waiting for room lacks beyond the free space and the deletions
        under way (0: none waits, or it will fit). A hint for a caller that can free space some
        other way (a node gives back steps planned ahead, see :meth:`.lanequeues.LaneQueues.give_back`)."""
        with self._cond:
            if not self._wanting:
                return 0
            return max(0, self._wanting - self.ledger.free - self.ledger.reaping)

    def wake(self) -> None:
        """Wake the downloads that wait in :meth:`acquire`, to check their ``withdrawn()`` again."""
        with self._cond:
            self._cond.notify_all()

    def wake_run(self, patient: Callable[[], bool]) -> None:
        """Wake the download that waits for room for a run beyond its own item (:meth:`acquire`'s
        ``run``) if ``patient()`` (its own) is false now, to read it again (the flag read without
        the lock first: called per item handed out)."""
        if self._waiting_run and not patient():
            with self._cond:
                self._cond.notify_all()

    def wake_starving(self) -> None:
        """A consumer began to wait with nothing ready (the broker's ``on_starve``): wake the
        download that waits for room, if recovered items are kept, to judge them again as
        ``urgent`` (:meth:`_in_the_way`). Before, it judged them only when woken otherwise: one
        that began to wait before the consumer did (an earlier owner's items kept ahead in the
        plan, the consumer holding the one before it) waited beside them for ever, the consumer
        waiting for it (``stress_pipeline.py --mode files``, seed 189). Read without the lock first."""
        if self._recovered and self._wanting:
            with self._cond:
                self._cond.notify_all()

    def force_room(self) -> None:
        """Let the download that waits for room make it without waiting for acks, once: a node's
        lane has waited for it and no other room can be made (its consumers do not follow the
        plan's order, and may wait for this download). With retention, it evicts retained items
        that the policy would keep for an earlier step (``choose_victims(forced=True)``);
        without, it drops a recovered (or shelved) item even if acks would make room later."""
        with self._cond:
            self._forced = True
            self._cond.notify_all()

    def _in_the_way(self, size: int, urgent: bool = False) -> str | None:
        """A recovered item (reused from an earlier owner, or shelved by a node's lane that moved
        away, not handed out yet) to drop so that ``size`` bytes can ever fit, or None; under
        the lock. Recovered items are handed out only when the plan reaches them, after the step
        that waits for room: if the room that every other reservation will free is not enough,
        waiting would never end, or after :meth:`force_room`. It is checked while that step
        waits (a lane shelves its items after the planner, woken by the lane's move, reached the
        step). The last recovered name goes first (names are recovered in sorted order: for a
        listing-ordered plan, the one needed last).

        ``urgent``: a consumer is blocked with nothing ready (the fetcher's ``starving``): the
        room the other reservations free is not waited for where dropping recovered items makes
        it now, as retention evicts for such a step (``choose_victims(urgent=True)``). The items
        in hand may be held by consumers that wait for this very step (a node's DDP rank holds
        its item until the other rank has taken its own): before, a node's lane that had moved
        back (its consumer restarted from a checkpoint) waited beside the items it shelved until
        the give-back forced room (5 s; ``stress_node.py --mode hazard``)."""
        if not self._recovered:
            return None
        held = sum(self.record.published[name] for name in self._recovered)
        ledger = self.ledger
        coming = ledger.free + ledger.reaping  # room without an ack
        now = urgent and coming < size <= coming + held  # dropping recovered items makes the room now
        if ledger.room_beside(held) >= size and not self._forced and not now:
            return None
        return next(reversed(self._recovered))
