"""What leaves the cache: acknowledgements, drops, shelving and giving up, with the retention
policy's hooks; and the cache's shared state, declared once for the parts of :class:`~.core.Cache`.

Invariant: an ack is journaled ("A") before its item's files go, so a crash after it deletes
again and never delivers again; a drop journals "D" once the files are moved aside; space is
released (:meth:`_Acks._reaped`) only after the files are deleted, by
:class:`~.eviction.Eviction`, the only code that deletes items. With retention, an acked item
that the policy keeps stays on disk, reserved and claimed, for a later step.

:class:`_Acks` is the lowest of the base classes of :class:`~.core.Cache` (``core.Cache`` <-
``publishing._Publishing`` <- ``reservation._Reservation`` <- ``acks._Acks``): every part works
under the one condition variable ``_cond`` over the ledger, the record and the claims, so they
are parts of one object rather than objects of their own; each module holds one concern, and a
part calls only the parts below it. The attributes are set by :meth:`~.core.Cache.__init__`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from ..blocks import round_up
from ..catalog import Item, Names
from ..fscalls import FileCalls
from ..retention import RetentionPolicy
from .eviction import Eviction
from .ledger import Ledger
from .record import Record
from .staging import Staging

__all__: list[str] = []


class _Counted(threading.Condition):
    """A condition that counts the threads in :meth:`wait` (``sleeping``), each from its call
    until it holds the lock again: read under the lock, it says whether a notify has anyone
    to wake beside a known waiter (:meth:`_Acks._room_freed`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = 0

    def wait(self, timeout: float | None = None) -> bool:
        self.sleeping += 1
        try:
            return super().wait(timeout)
        finally:
            self.sleeping -= 1


class _Acks:
    """The cache's state, and what leaves it (see the module notes): :class:`~.core.Cache`'s base."""

    # set by Cache.__init__, which says what each holds
    root: Path
    state_dir: Path
    staging_root: Path
    catalog_path: Path
    prefix: str
    ledger: Ledger
    block: int
    record: Record
    file_calls: FileCalls
    rebuilt: bool
    _root: str
    _staging: Staging
    _eviction: Eviction
    _recovered: dict[str, Path]
    _claimed: set[str]
    _small: dict[str, tuple[str, ...] | None]
    _fresh: set[str]
    _policy: RetentionPolicy | None
    _names: Sequence[str]
    _cond: _Counted
    _closed: bool
    _acks_deleting: int
    _wanting: int
    _expected: int | Callable[[], int]
    _waiting_run: bool
    _run_wanted: int
    _forced: bool

    # ---- the ledger, read ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Bytes (resolved by :meth:`open`)."""
        return self.ledger.capacity

    @property
    def foreign(self) -> int:
        """Bytes under the directory that cachepipe does not manage."""
        return self.ledger.foreign

    @property
    def overhead(self) -> int:
        """Bytes budgeted for cachepipe's own state files."""
        return self.ledger.overhead

    @property
    def used(self) -> int:
        """Bytes accounted under the cache directory: foreign + state budget + reserved items."""
        with self._cond:
            return self.ledger.used

    @property
    def limit(self) -> int:
        """The largest item that can ever fit: capacity minus foreign bytes and the state budget."""
        return self.ledger.limit

    def charge(self, item: Item, extra: int = 0) -> int:
        """What ``item`` takes on the cache's filesystem, the bytes the ledger reserves for it
        (:func:`~cachepipe.blocks.footprint`: its files in whole blocks of :attr:`block`, and a
        block per folder it makes), with ``extra`` bytes beside it (``unpack``/``prepare``'s
        output) rounded up to whole blocks. Every reservation, release and check of the item's
        room uses this one charge. The files' part is computed once per item and block
        (:meth:`~cachepipe.catalog.Item.footprint`)."""
        block = self.block
        charge = item.footprint(block)
        return charge + round_up(extra, block) if extra else charge

    def item_path(self, item: Item) -> Path:
        """Where ``item`` is (or will be) published."""
        return self.root / item.name

    # ---- acknowledge, drop -----------------------------------------------------------
    def evict(self, name: str, epoch: int = 0, tick: int = 0) -> None:
        """An acknowledged item (the step at ``tick`` of ``epoch``): record the ack, then delete its
        files and release its space, unless the retention policy keeps it for a later step.

        The ack is journaled before the files go: a crash after it re-deletes, never re-delivers.
        If the write fails (disk full), nothing changed: the caller sees the error and may retry.

        Raises:
            KeyError: ``name`` is not a published item of this cache.
            OSError: the ack could not be journaled; nothing changed.
        """
        self.evict_many([(name, epoch, tick)])

    def evict_many(self, acks: Sequence[tuple[str, int, int]], after: Sequence[int | None] | None = None) -> None:
        """:meth:`evict` for each ``(name, epoch, tick)``, the acks journaled by one write: all
        of them, or (on an error) none. Only a few threads delete their batches at once, as many as
        suit the cache's file system (:func:`.eviction.deleters_for`); the others wait, their
        acks journaled already.

        ``after``: with retention, for each ack the tick after which its item is next read, if
        the caller knows (see :meth:`.retention.RetentionPolicy.on_ack`), or None.

        Raises:
            KeyError: a name is not a published item of this cache, or is given twice; nothing changed.
            OSError: the acks could not be journaled; nothing changed.
        """
        policy = self._policy
        numbers = [self._number(name) if policy is not None else None for name, _epoch, _tick in acks]
        with self._cond:
            seen: set[str] = set()
            for name, _epoch, _tick in acks:
                if name not in self.record.published or name in seen:
                    raise KeyError(name)
                seen.add(name)
            self.record.ack(acks)
            kept = False
            gone: list[str] = []
            nexts = [None] * len(acks) if after is None else after
            for (name, _epoch, tick), number, since in zip(acks, numbers, nexts, strict=True):
                if policy is not None and number is not None and policy.on_ack(number, tick, since):
                    if self.record.keep(name):  # still on disk, kept for a later step
                        kept = True
                        continue
                    policy.forget(number)
                gone.append(name)
            doomed = list(zip(gone, self.record.unpublish_many(gone), strict=True))
            if self._recovered:
                for name in gone:
                    self._recovered.pop(name, None)
            if kept:
                self._cond.notify_all()
            if not doomed:
                return
            self._acks_deleting += 1
        try:
            with self._eviction.deleters:
                for name, size in doomed:
                    self._delete(name, size)
        finally:
            with self._cond:
                self._acks_deleting -= 1
                if self._closed and not self._acks_deleting:
                    self._cond.notify_all()  # wakes close() (only then: reserve()'s waiters have nothing new)

    def reach(self, name: str, tick: int) -> None:
        """The step at ``tick`` reads the copy of ``name`` that an earlier step pinned (a node's
        steps of one item share one copy, acknowledged once, by the last): with retention, the
        item's next use is from then on the one after ``tick`` (if later). Nothing without
        retention, or if the item is not pinned."""
        policy = self._policy
        if policy is None:
            return
        number = self._number(name)
        if number is None:
            return
        with self._cond:
            policy.reach(number, tick)

    def shelve(self, name: str, epoch: int = 0, tick: int = 0, after: int | None = None) -> None:
        """A published item that its consumer moved away from before reading it, and that a later
        step will ask for again (a node's lane that restarted from an earlier position): without
        retention it stays on disk, to be handed to the :meth:`acquire` that reaches it, like an
        item recovered at open (and dropped like one when its room is needed first); with
        retention it is acknowledged as of ``tick`` and the policy decides (``after``: as for
        :meth:`evict_many`).

        Raises:
            KeyError: ``name`` is not a published item of this cache.
        """
        if self._policy is not None:
            self.evict_many([(name, epoch, tick)], [after])
            return
        with self._cond:
            if name not in self.record.published:
                raise KeyError(name)
            self._recovered[name] = self.root / name
            self._cond.notify_all()

    def give_up(self, name: str, epoch: int = 0, tick: int = 0) -> None:
        """A published item, not handed out, whose step will be planned again later (a node's
        lane gave its room back to a lane that waits, see :meth:`.lanequeues.LaneQueues.give_back`):
        without retention it is dropped (downloaded again when its step comes); with retention
        it is acknowledged as of ``tick`` and the policy decides whether to keep it.

        Raises:
            KeyError: ``name`` is not a published item of this cache.
            OSError: with retention, the ack could not be journaled; nothing changed.
        """
        if self._policy is not None:
            self.evict(name, epoch, tick)
        else:
            self.drop(name)

    def drop(self, name: str, gone_ok: bool = False) -> None:
        """Delete a published item that was not acknowledged (closing, a leftover in the way, or a
        retention victim): its files go first, then the journal records it (see :meth:`_delete`).
        ``gone_ok``: an item no longer published (acknowledged or dropped by another thread since
        the caller listed it) is left as it is, not a ``KeyError``."""
        with self._cond:
            if gone_ok and name not in self.record.published:
                return
            size = self.record.dropping(name)
            self._recovered.pop(name, None)
            self._acks_deleting += 1  # close waits for it too (a node's lane giving room back while its job is deleted)
        try:
            self._delete(name, size, dropped=True)
        finally:
            with self._cond:
                self._acks_deleting -= 1
                if self._closed and not self._acks_deleting:
                    self._cond.notify_all()  # wakes close()

    def _delete(self, name: str, size: int, dropped: bool = False) -> None:
        """Move the item's files away (:meth:`.eviction.Eviction.move_away`); then, for a drop,
        journal "D" (an ack's "A" was journaled before); release the claim on its name; delete
        the files (by the reaper for large items) and release its space after. Files that
        cannot be deleted count as foreign until the next open removes them; nothing is raised.
        A small item (under :data:`.eviction.REAP_MIN_BYTES`) is deleted where it is instead,
        its space released in the same lock round: its "A" (or, for a drop, the "P" that the
        missing files no longer match) makes a deletion cut short by a crash one that the next
        open finishes.

        One item per lock round, also for a batch of acks: releasing a batch in one round made
        a whole pipeline slower on this VM's disk (benchmarks/README.md), and was level or
        undecided by the VM's noise when tried again (2026-11-29)."""
        in_place = name in self._small and self._eviction.delete_in_place(name, self._small[name])
        aside, left = ("", 0) if in_place else self._eviction.move_away(name)
        with self._cond:
            self._small.pop(name, None)
            self._fresh.discard(name)
            self._claimed.discard(name)
            self.ledger.reaping_started(size)
            if left:
                self.record.delete_failed(name)
            elif dropped:
                self.record.dropped(name)
            if in_place:
                self.ledger.reaped(size, 0)
            self._room_freed()  # wakes claim() and reserve()
        if not in_place:
            self._eviction.finish(aside, size, left)

    def _reaped(self, size: int, left: int) -> None:
        """An item's files are deleted: release its ``size``; ``left`` bytes could not be deleted
        and count as foreign (on disk, not ours to reuse) until the staging area is cleared."""
        with self._cond:
            self.ledger.reaped(size, left)
            self._room_freed()  # wakes reserve()

    def _held(self, change: int, left: int) -> None:
        """Bytes of deleted items still on disk, which the reaper tries again (on NFS, a file a
        consumer still holds open): ``change`` more of them (fewer, as they go); ``left`` of them
        count as foreign from now on (see :meth:`.ledger.Ledger.held`)."""
        with self._cond:
            self.ledger.held(change, left)
            self._room_freed()  # wakes reserve()

    def _room_freed(self) -> None:
        """Under the lock, after room was freed (or a claim released): wake every waiter, unless
        the only one is the download waiting for a run's room (:meth:`.reservation._Reservation.acquire`'s
        ``run``) and the run does not fit yet: then its wait goes on without a wake-up per ack.
        Exact: while that download waits its flag is set, and a thread counts as waiting from
        its ``wait`` call until it holds the lock again (:class:`_Counted`), so a waiter woken
        by another notify is still counted and any other waiter makes this one notify."""
        if self._waiting_run and self._cond.sleeping == 1 and not self.ledger.fits(self._run_wanted):
            return
        self._cond.notify_all()

    # ---- retention -------------------------------------------------------------------
    def use_retention(self, policy: RetentionPolicy, names: Names, tick: int) -> None:
        """Keep acknowledged items by ``policy`` (its item ``i`` is ``names[i]``). Items recovered
        at open become retained items as if acknowledged just before the step at ``tick`` (the
        first one not consumed), so one that this step reads is kept too; the policy drops
        the others it would not keep.

        ``names`` is searched with ``names.index(name)`` for each item fetched or acknowledged,
        by binary search, with no index of the whole catalog in memory; the recovered items
        with one :meth:`~cachepipe.catalog.Names.find_many`."""
        self._policy, self._names = policy, names
        tick -= 1  # a next use is one strictly after the tick: the step at ``tick`` is one
        with self._cond:
            asked = list(self._recovered)
            numbered = zip(asked, names.find_many(asked), strict=True)  # in one sweep
            recovered = [(name, number) for name, number in numbered if number >= 0]
            for name, number in recovered:
                del self._recovered[name]
                policy.on_admit(number, tick)
        for name, number in recovered:
            with self._cond:
                keep = policy.on_ack(number, tick)
            if not keep:
                self.drop(name)

    def _number(self, name: str) -> int | None:
        """The retention policy's number for item ``name``, or None if it is not in the plan."""
        try:
            return self._names.index(name)
        except ValueError:
            return None
