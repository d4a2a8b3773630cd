"""The cache facade: one owner's view of a size-capped cache directory, over its parts.

Layout::

    cache_dir/
      .cachepipe/lock          flock'ed by the owner; holds "pid host"            (lock.py)
      .cachepipe/journal       publishes, acks, drops, the position (state.py)    (record.py)
      .cachepipe/catalog       the saved listing (resume only)                    (state.py)
      .cachepipe/staging/N     downloads in progress (removed on open and close)  (staging.py)
      .cachepipe/staging/xN    items moved aside to be deleted                    (eviction.py)
      <item>/...               published items

:class:`Cache` holds one condition variable over the parts: the :class:`~.ledger.Ledger`
(bytes by owner; pure), the :class:`~.record.Record` (what is published, acked and consumed,
journaled before it is believed), the :class:`~.staging.Staging` areas and the
:class:`~.eviction.Eviction` (the only code that deletes items). It adds what needs them
together: waiting for room, claims (one copy of an item at a time), recovery at open, and the
retention policy's hooks.

Invariant (the hard cap): the bytes of regular files under ``cache_dir`` never exceed the
capacity. Space is reserved (from listed sizes) before a download starts and released only
after the files are deleted. cachepipe's own state files have a budget reserved up front.
Bytes found at open that cachepipe does not manage ("foreign") count against the capacity and
are never deleted.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from .. import state
from ..catalog import Catalog, Item
from ..config import Share
from ..errors import CacheRemovedError, ConfigError, OversizeError
from ..fscalls import RELEASING, FileCalls, file_calls_for, filesystem_at, lookups_stay_local, rename_new
from ..removal import delete_tree, tree_bytes
from ..retention import RetentionPolicy
from .eviction import REAP_MIN_BYTES, Eviction
from .ledger import Ledger
from .lock import STATE_DIR, OwnerLock, unusable_dir
from .record import Record
from .recovery import check_resume, of_same_data, sort_leftovers
from .staging import Staging, verify

__all__ = ["STATE_DIR", "Cache"]

log = logging.getLogger("cachepipe.cache")


def _never() -> bool:
    return False


def _capacity_bytes(capacity: int | Share, free: int, total: int) -> int:
    """``capacity`` in bytes on a filesystem of ``free`` and ``total`` bytes: a share of its free
    space, or the bytes given, held to its size (no item larger can ever fit)."""
    return int(free * capacity.fraction) if isinstance(capacity, Share) else min(capacity, total)


class Cache:
    """A size-capped cache directory owned by one pipeline at a time.

    Use: :meth:`open` (lock, clean staging, read the journal), :meth:`recover` (with the catalog:
    reuse published items, drop stale ones, reserve the state budget), then acquire / stage /
    publish / evict, and :meth:`close`.

    Args:
        root: the cache directory (created if missing).
        capacity: bytes, or a :class:`~cachepipe.config.Share` of the filesystem's free space,
            resolved by :meth:`open`.
    """

    def __init__(self, root: Path, capacity: int | Share) -> None:
        self._given = root  # as the user wrote it, for the error messages
        # absolute and normal (".." taken lexically, as the daemon names the paths acked to it)
        self.root = Path(os.path.abspath(root))
        self.state_dir = self.root / STATE_DIR
        self.staging_root = self.state_dir / "staging"
        self.catalog_path = self.state_dir / "catalog"
        self._root = str(self.root)
        self.prefix = self._root.rstrip("/") + "/"  # what every item's path starts with
        self._capacity_spec = capacity
        self.ledger = Ledger()
        self.record = Record(self.state_dir / "journal")
        self._staging = Staging(self.staging_root)
        self._eviction = Eviction(self.root, self._staging, self._reaped)
        # the calls that write and publish items (:func:`~cachepipe.fscalls.file_calls_for`
        # the file system that holds the cache, chosen by open; :data:`~cachepipe.fscalls.RELEASING`
        # where a lookup of the cache's path passes a file system not known to be local)
        self.file_calls: FileCalls = RELEASING
        self._lock = OwnerLock(self.state_dir / "lock", self.root)
        self.rebuilt = False  # the journal was unreadable and state was rebuilt from disk
        self._replay = state.Replay()
        self._recovered: dict[str, Path] = {}  # published items found at open, not yet handed out
        self._claimed: set[str] = set()  # names with files on disk or on their way: one copy at a time
        # published items under REAP_MIN_BYTES, deleted in place: name -> the names of its files
        # directly under it (None: the item is one file; empty: more than 4, or some deeper, so
        # the folder is listed to delete it)
        self._small: dict[str, tuple[str, ...] | None] = {}
        # items this owner published (downloaded) and has not handed out yet: nobody has had their
        # path, so no consumer can have left a marker in them (see first_hand_out)
        self._fresh: set[str] = set()
        self._policy: RetentionPolicy | None = None  # retain="auto": which acked items stay
        self._names: Sequence[str] = ()  # the policy's item i is _names[i]; found by _names.index()
        self._cond = threading.Condition()
        self._closed = False
        self._acks_deleting = 0  # calls of evict_many deleting (or waiting to): close waits for them
        self._wanting = 0  # bytes the latest download waiting for room asks for (0: none waits)
        self._forced = False  # force_room(): the next choice of retention victims waives the policy's rules
        self._identity: tuple[tuple[int, int], ...] = ()  # (st_dev, st_ino) of root and state_dir, taken by open

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

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Take the ownership lock, delete staging leftovers, resolve the capacity, read the journal.

        Raises:
            CacheLockedError: another live process owns the directory.
            OSError: the directory cannot be created or taken (:func:`~.lock.unusable_dir`: a
                read-only filesystem, permission denied, a file on its path), naming ``cache_dir``.
        """
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except OSError as exc:
            error = unusable_dir(self._given, exc)
            if error is None:
                raise
            raise error from exc
        try:
            if self.staging_root.exists():
                shutil.rmtree(self.staging_root)
            self.staging_root.mkdir()
            self._identity = tuple(_identity(path) for path in (self._root, str(self.state_dir)))
            fstype = filesystem_at(self._root)
            self._eviction.open_deleters(fstype)
            # calls that keep the interpreter's lock only where no lookup waits for a server on the way
            self.file_calls = file_calls_for(fstype) if lookups_stay_local(self._root) else RELEASING
            usage = shutil.disk_usage(self.root)
            self.ledger.capacity = _capacity_bytes(self._capacity_spec, usage.free, usage.total)
            if not isinstance(self._capacity_spec, Share):
                if self._capacity_spec > usage.total:  # no item larger than the filesystem can ever fit: said at once
                    log.warning(
                        "capacity %d bytes exceeds the size of the filesystem of %s (%d bytes): the cache holds at most "
                        "that, and an item larger than it is refused as oversize; lower the capacity or give it as a "
                        "share like '80%%'",
                        self._capacity_spec,
                        self.root,
                        usage.total,
                    )
                # the tree walked only where it can matter: a capacity over the free space
                elif self.capacity > usage.free and self.capacity > (room := usage.free + tree_bytes(self.root)):
                    log.warning(
                        "capacity %d bytes exceeds the space available to %s (%d bytes): downloads will meet a full "
                        "disk, and in-order delivery can wait on space held by later items; lower the capacity or "
                        "give it as a share like '80%%'",
                        self.capacity,
                        self.root,
                        room,
                    )
            try:
                self._replay = state.load(self.record.journal.path)
            except state.StateCorrupt as exc:
                log.warning("%s; rebuilding the cache state from the files on disk", exc)
                self._replay, self.rebuilt = state.Replay(), True
        except BaseException:
            self._lock.release()
            raise

    def removed(self) -> CacheRemovedError | None:
        """The error to stop with if this cache's directory or its state directory was removed,
        or replaced by another, since :meth:`open`; else None (two ``stat`` calls; None before
        :meth:`open`, and when a ``stat`` fails otherwise, e.g. denied)."""
        if not self._identity:
            return None
        for path, known in zip((self._root, str(self.state_dir)), self._identity, strict=True):
            try:
                now = _identity(path)
            except (FileNotFoundError, NotADirectoryError):
                what = "was removed"
            except OSError:
                return None
            else:
                if now == known:
                    continue
                what = "was replaced by another directory"
            return CacheRemovedError(
                f"{path} {what} while the pipeline was open: its items, journal and lock are gone, so the pipeline "
                "stopped; open it again to start over"
            )
        return None

    def saved_catalog(self, source: str, mode: str) -> Catalog | None:
        """The listing saved by an earlier owner for this source, if any and readable."""
        try:
            return state.load_catalog(self.catalog_path, source, mode)
        except state.StateCorrupt as exc:
            log.warning("%s; listing the source again", exc)
            return None

    def save_catalog(self, source: str, mode: str, catalog: Catalog) -> None:
        state.save_catalog(self.catalog_path, source, mode, catalog)

    def recover(self, items: Catalog, resume: bool, plan: str = "") -> tuple[tuple[int, int], set[tuple[int, str]]]:
        """Reconcile the disk with the journal and the catalog.

        Items the journal says are published (or were being published) and whose files match the
        catalog are reused; other leftovers of ours are deleted. With ``resume``, the position in
        the plan and the acks beyond it are kept (those steps are not delivered again), provided
        the plan (``plan``: its configuration as JSON) is the one they refer to; otherwise a new
        pass starts. If the journal was unreadable, items whose folder matches the catalog exactly
        are reused and everything else is left alone as foreign. If the reused items leave the
        cache over its capacity (a smaller one than before), some are dropped until it is not.

        Returns:
            ``(cursor, acked)``: the first unconsumed ``(epoch, index)`` of the plan, and the
            ``(epoch, name)`` pairs acknowledged beyond it.

        Raises:
            ConfigError: ``resume`` with a different plan, or after a streamed pass that stopped
                before its listing ended (its plan is unknown), or foreign files and the state
                budget leave no room under the capacity.
        """
        replay = self._replay
        check_resume(replay, resume, plan, self._root)
        record, ledger = self.record, self.ledger
        reuse, stale = sort_leftovers(self.root, replay, self.rebuilt, items, of_same_data(replay.plan, plan))
        for name in stale:
            log.info("removing stale cached item %s", name)
            self._eviction.remove(name)
        for name, size in reuse.items():
            record.published[name] = size
            if name in replay.versions:
                record.versions[name] = replay.versions[name]
            self._recovered[name] = self.root / name
            self._claimed.add(name)
        if resume:
            record.start(replay.pass_no, replay.cursor, replay.acked, plan)
        else:
            record.start(replay.pass_no + 1, (0, 0), set(), plan)
        ledger.reserved = sum(record.published.values())
        state_files = tree_bytes(self.state_dir)
        record.budget = self.journal_budget(items)
        ledger.overhead = state_files + record.budget
        ledger.foreign = tree_bytes(self.root) - ledger.reserved - state_files
        ledger.check_room(self._root)
        self._replay = state.Replay()
        while self._recovered and ledger.over_capacity():
            name = next(reversed(self._recovered))
            log.info("dropping %s, an earlier owner's item: the cache is over its capacity of %d bytes", name, self.capacity)
            self.drop(name)
        return record.cursor, set(record.acked)

    @staticmethod
    def journal_budget(items: Catalog) -> int:
        """Bytes the journal may take in a pass over ``items`` (reserved against the capacity by
        :meth:`recover`). A step writes at most four lines (I or J, P, A, C); a compacted journal
        holds at most two per item (P or R, A); the versions of J and R are budgeted only if
        ``items`` has ETags. Compacting at half the budget keeps it under it at all times."""
        return journal_budget_of(items.name_bytes, len(items), versions=items.tagged)

    def has_leftovers(self) -> bool:
        """True if the journal read at open names items on disk (or could not be read): then
        :meth:`recover` needs the whole catalog to decide which of them to keep."""
        replay = self._replay
        return self.rebuilt or bool(replay.published or replay.publishing or replay.acked)

    def note_listed(self, names: Sequence[str], sizes: Sequence[int] = (), plain: Sequence[bool] = ()) -> list[int]:
        """Budget journal space for items listed after :meth:`recover` (a listing that streams
        while downloads run): the same share per name that :meth:`recover` budgets, in one
        round of the lock for a run of names. Returns, for each of the first names (at least
        one, unless the cache closed), :attr:`limit` once that name is counted: the largest
        item that fits beside the state budget then. Blocks until the first name's space is
        free (items are acked), so that the ledger never exceeds the capacity; the names
        after it are counted while their space is free now, and the others are left to the
        next call (the caller's items queued meanwhile can be acked). With ``sizes`` (bytes of
        each name's item), a name after the first whose item would not fit the limit is left to
        the next call too, so that the caller decides about that item first (refusing it) before
        its name is counted. A reservation that the larger budget leaves no room for raises
        instead of waiting (see :meth:`reserve`). ``plain``: for each name, True if its item has
        no version (no ETags: its journal lines are budgeted without one); names beyond it are
        budgeted with a version.

        Raises:
            ConfigError: the state budget alone would reach the capacity with the first name.
            TypeError: ``names`` is one name (a string), not a sequence of them.
        """
        if isinstance(names, str):  # its characters would each be budgeted as a name
            raise TypeError(f"note_listed takes a sequence of item names, not one name: {names!r}")
        ledger = self.ledger
        step, versioned = state.EVENT_OVERHEAD, state.EVENT_OVERHEAD + state.VERSION_OVERHEAD
        grows = [
            2 * (4 * len(name.encode("utf-8", "surrogateescape")) + (step if i < len(plain) and plain[i] else versioned))
            for i, name in enumerate(names)
        ]
        limits: list[int] = []
        with self._cond:
            if grows:
                ledger.check_room(self._root, ledger.overhead + grows[0])
                # Wait for room (acks) rather than count space the reserved items already hold: the
                # ledger never exceeds the capacity. Reservations waiting for room re-check the limit.
                while not self._closed and not ledger.fits(grows[0]):
                    self._cond.wait()
            if grows and not self._closed:
                # the largest item beside the budget, and the room left, with the names so far counted
                limit, free = ledger.limit - grows[0], ledger.free - grows[0]
                limits.append(limit)
                for i in range(1, len(grows)):
                    grow = grows[i]
                    if grow > free or limit - grow <= 0 or (i < len(sizes) and sizes[i] > limit - grow):
                        break  # for the next call, with that name first: it raises, waits, or refuses the item
                    limit, free = limit - grow, free - grow
                    limits.append(limit)
                counted = sum(grows[: len(limits)])
                self.record.budget += counted
                ledger.overhead += counted
            self._cond.notify_all()
        return limits

    def set_plan(self, plan: str) -> None:
        """Record the plan (its configuration as JSON) once it is known, for a later ``resume``."""
        with self._cond:
            self.record.set_plan(plan)

    def advance(self, epoch: int, index: int) -> None:
        """Record that every step of the plan before ``(epoch, index)`` is consumed. A position
        not after the current one is ignored: consumers acking in parallel report positions out
        of order, and the acks a later position made implicit are already pruned."""
        with self._cond:
            self.record.advance(epoch, index)

    def interrupt(self) -> None:
        """Wake every thread blocked in :meth:`reserve`; from now on it returns False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self, keep: bool = False) -> None:
        """Interrupt waiters, wait for acks being deleted (by other threads), delete staging and
        (unless ``keep``) published items; unlock.

        Kept items stay in the journal and are reused by the next owner. Call only once no
        thread writes into staging any more.
        """
        self.interrupt()
        with self._cond:  # acks journaled before: their files go while the cache is still ours
            self._cond.wait_for(lambda: not self._acks_deleting)
        self._eviction.stop()  # deletes what acks moved aside; from now on deletions run here
        if not self._lock.held:
            return
        removed = self.removed()
        if removed is not None:  # what is at its path now is not ours (another owner's, maybe): touch nothing
            log.warning("closing without deleting anything: %s", removed)
            self.record.close()
            self._lock.release()
            return
        try:
            if not keep and self.record.journal.is_open:  # else recovery never finished: the next open decides
                for name in list(self.record.published):
                    self.drop(name)
            try:
                shutil.rmtree(self.staging_root)
            except FileNotFoundError:
                pass
            except OSError as exc:  # not fatal: the next open removes staging leftovers
                log.warning("could not remove staging %s: %s", self.staging_root, exc)
        finally:
            self.record.close()
            self._lock.release()

    # ---- room ------------------------------------------------------------------------
    def set_capacity(self, capacity: int | Share, at_least: int = 0) -> int:
        """Change the capacity now; returns it in bytes. Shrinking deletes nothing: downloads
        wait until acknowledgements bring the cache under the new cap.

        Raises:
            ConfigError: the new capacity leaves no room beside foreign files and the state
                budget, or less than ``at_least`` bytes (the largest item still to be fetched,
                which would fail).
        """
        usage = shutil.disk_usage(self.root)
        new = _capacity_bytes(capacity, usage.free, usage.total)
        beside = self.foreign + self.overhead
        if beside >= new:
            raise ConfigError(f"capacity {new} bytes leaves no room beside {beside} bytes of other files and state")
        if new - beside < at_least:
            raise ConfigError(
                f"capacity {new} bytes leaves {new - beside} bytes for items beside {beside} bytes of other files and "
                f"state, less than the largest item planned ({at_least} bytes), which would fail (on_oversize='raise'): "
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

    def _reserve(self, size: int, name: str, leftovers: bool, withdrawn: Callable[[], bool] = _never) -> bool | str | None:
        """:meth:`reserve`; with ``leftovers``, the wait ends too when a recovered (or shelved)
        item is in the way (:meth:`_in_the_way`): its name is returned, to drop. None:
        ``withdrawn()`` was true before it reserved (nothing reserved)."""
        ledger = self.ledger
        with self._cond:
            try:
                while not self._closed and not ledger.fits(size):
                    if size > ledger.limit:
                        raise OversizeError(name, size, ledger.capacity, ledger.foreign + ledger.overhead)
                    if withdrawn():  # before dropping anything for it
                        return None
                    if leftovers:  # the waiter that force_room() means (a plain reserve leaves it be)
                        leftover = self._in_the_way(size)
                        self._forced = False
                        if leftover is not None:
                            return leftover
                    self._wanting = size
                    self._cond.wait()
            finally:
                self._wanting = 0
            if self._closed:
                return False
            if withdrawn():  # asked back when the room it now fits in was freed (see acquire)
                return None
            ledger.reserve(size)
            return True

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
        never leave it room (:meth:`_in_the_way`). With retention, the policy picks
        retained items to evict; when it prefers to wait for an ack instead, the wait is
        re-checked every 0.25 s against ``starving()`` (a consumer blocked on this very step),
        the one case of a timed wait here. ``extra``: bytes reserved beside the item's own (the
        ``prepare`` hook's output).
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
                while isinstance(got := self._reserve(item.size + extra, item.name, True, withdrawn), str):
                    log.info("dropping %s, an earlier owner's item not due yet, to make room for %s", got, item.name)
                    self.drop(got)
            except BaseException:
                self.unreserve(0, item.name)  # the claim
                raise
            if got is None:
                self.unreserve(0, item.name)  # withdrawn: the claim
            return got
        return self._acquire_retained(policy, item, tick, starving, withdrawn)

    def acquire_many(self, items: Sequence[tuple[Item, int]], withdrawn: Callable[[], bool] = _never) -> int:
        """:meth:`acquire` ``(item, extra)`` in order, for as many as need no wait, in one lock
        round: each fits now, no copy of it is on disk or on its way, and no retention policy or
        recovered item is involved. Returns how many were reserved and claimed (0: call
        :meth:`acquire` for the next, which waits or decides; so too if ``withdrawn()``, the
        first item asked back, as :meth:`acquire`'s)."""
        if self._policy is not None:
            return 0
        ledger, claimed = self.ledger, self._claimed
        with self._cond:
            if self._closed or self._recovered or withdrawn():
                return 0
            for count, (item, extra) in enumerate(items):
                if item.name in claimed or not ledger.fits(item.size + extra):
                    return count
                claimed.add(item.name)
                ledger.reserve(item.size + extra)
            return len(items)

    def _acquire_retained(
        self, policy: RetentionPolicy, item: Item, tick: int, starving: Callable[[], bool], withdrawn: Callable[[], bool]
    ) -> Path | bool | None:
        ledger = self.ledger
        idx = self._number(item.name)
        if idx is None:
            raise KeyError(f"item {item.name!r} is not in the plan given to use_retention()")
        while True:
            victims: list[tuple[str, int]] = []
            with self._cond:
                while not victims:
                    if self._closed:
                        return False
                    if item.size > ledger.limit:  # it would never fit: not waited for (as in _reserve)
                        raise OversizeError(item.name, item.size, ledger.capacity, ledger.foreign + ledger.overhead)
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
                    if free >= item.size:
                        ledger.reserve(item.size)
                        self._claimed.add(item.name)
                        policy.on_admit(idx, tick)
                        return True
                    if free + ledger.reaping >= item.size:  # victims being deleted make room: no more
                        self._cond.wait()
                        continue
                    forced, self._forced = self._forced, False
                    chosen = policy.choose_victims(item.size - free - ledger.reaping, idx, tick, urgent=starving(), forced=forced)
                    if chosen is None:
                        self._wanting = item.size
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

    def force_room(self) -> None:
        """Let the download that waits for room make it without waiting for acks, once: a node's
        lane has waited for it and no other room can be made (its consumers do not follow the
        plan's order, and may wait for this download). With retention, it evicts retained items
        that the policy would keep for an earlier step (``choose_victims(forced=True)``);
        without, it drops a recovered (or shelved) item even if acks would make room later."""
        with self._cond:
            self._forced = True
            self._cond.notify_all()

    def _in_the_way(self, size: int) -> str | None:
        """A recovered item (reused from an earlier owner, or shelved by a node's lane that moved
        away, not handed out yet) to drop so that ``size`` bytes can ever fit, or None; under
        the lock. Recovered items are handed out only when the plan reaches them, after the step
        that waits for room: if the room that every other reservation will free is not enough,
        waiting would never end, or after :meth:`force_room`. It is checked while that step
        waits (a lane shelves its items after the planner, woken by the lane's move, reached the
        step). The last recovered name goes first (names are recovered in sorted order: for a
        listing-ordered plan, the one needed last)."""
        if not self._recovered:
            return None
        held = sum(self.record.published[name] for name in self._recovered)
        if self.ledger.room_beside(held) >= size and not self._forced:
            return None
        return next(reversed(self._recovered))

    # ---- staging and publish ---------------------------------------------------------
    def stage(self, item: Item, part_size: int | None = None) -> str:
        """Create the staging area for ``item``; its path (see :meth:`.staging.Staging.stage`)."""
        return self._staging.stage(item, part_size, self.file_calls)

    def item_path(self, item: Item) -> Path:
        """Where ``item`` is (or will be) published."""
        return self.root / item.name

    def publish(self, staged: str | Path, item: Item, reserved: int | None = None, verified: bool = False) -> str:
        """Verify sizes (unless ``verified``), then atomically rename the staged item into place:
        journal the intent ("I", or "J" with the item's version), rename (never over anything in
        the way), journal the result ("P"; an intent that came to nothing, "D").

        Args:
            reserved: the bytes reserved for it, released at eviction (default: its listed size).

        Returns:
            The item's path, a string (as :meth:`stage`'s).

        Raises:
            VerificationError: a file's size differs from the listing.
            FileExistsError: something not managed by this cache is in the way.
            OSError: the intent could not be journaled (a full disk), or the rename failed:
                nothing was published.
        """
        if not verified:
            verify(staged, item)
        (got,) = self.publish_many([(staged, item, item.size if reserved is None else reserved)])
        if isinstance(got, OSError):
            raise got
        return got

    def publish_many(self, staged: Sequence[tuple[str | Path, Item, int]]) -> list[str | OSError]:
        """:meth:`publish` for each ``(staged path, item, bytes reserved)`` whose files are
        verified, under one lock round, the intents journaled by one write.

        Returns, for each in order, its published path or why it was not published
        (``FileExistsError``: something not managed by this cache is in the way; another
        ``OSError``: the rename failed).

        Raises:
            OSError: the intents could not be journaled (a full disk): nothing was published.
        """
        got: list[str | OSError] = []
        done: list[tuple[str, int]] = []  # (name, bytes reserved) renamed into place
        with self._cond, self._eviction.folders:
            self.record.publishing_many([(item.name, item.version) for _staged, item, _size in staged])
            for path, item, size in staged:
                final = f"{self._root}/{item.name}"
                try:
                    if "/" in item.name:  # a nested single-file item: its folders; the lookup may leave
                        os.makedirs(final.rpartition("/")[0], exist_ok=True)  # this file system: let the lock go
                        rename_new(os.fspath(path), final)
                    else:
                        self.file_calls.rename_new(os.fspath(path), final)  # never over anything in the way
                except FileExistsError as exc:
                    self.record.dropped(item.name)  # its intent withdrawn: what is in the way is not ours
                    got.append(
                        FileExistsError(
                            errno.EEXIST,
                            f"cannot publish item {item.name!r}: {exc.filename2 or exc.filename} exists "
                            "and is not managed by cachepipe",
                        )
                    )
                    continue
                except OSError as exc:  # nothing renamed: the next open finds nothing of it in place
                    self.record.not_renamed(item.name)
                    got.append(exc)
                    continue
                done.append((item.name, size))
                if item.size < REAP_MIN_BYTES:
                    self._small[item.name] = None if item.is_file else _flat_names(item)
                self._fresh.add(item.name)
                got.append(final)
            self.record.published_many(done)
        return got

    def first_hand_out(self, name: str) -> bool:
        """Whether this is the first hand-out of published item ``name`` since this owner
        downloaded it: True once, False after (and for items recovered at open, or kept by
        retention after an ack). The daemon's marker watch looks for a stale ``.done`` only in
        the others (:mod:`cachepipe.service.markers`)."""
        try:
            self._fresh.remove(name)  # one atomic step: a name is handed out to one consumer at a time
        except KeyError:
            return False
        return True

    def discard(self, staged: str | Path, size: int, name: str) -> None:
        """Delete a staging area, release its reservation and the claim on ``name``. Bytes that
        could not be deleted (logged, not raised) count as foreign until the next open clears
        staging, as for an acknowledged item that could not be deleted."""
        self.unreserve(size, name, left=delete_tree(staged))  # one lock round: never counted twice

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

    def evict_many(self, acks: Sequence[tuple[str, int, int]]) -> None:
        """:meth:`evict` for each ``(name, epoch, tick)``, the acks journaled by one write: all
        of them, or (on an error) none. Only a few threads delete their batches at once, as many as
        suit the cache's file system (:func:`.eviction.deleters_for`); the others wait, their
        acks journaled already.

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
            for (name, _epoch, tick), number in zip(acks, numbers, strict=True):
                if policy is not None and number is not None and policy.on_ack(number, tick):
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

    def shelve(self, name: str, epoch: int = 0, tick: int = 0) -> None:
        """A published item that its consumer moved away from before reading it, and that a later
        step will ask for again (a node's lane that restarted from an earlier position): without
        retention it stays on disk, to be handed to the :meth:`acquire` that reaches it, like an
        item recovered at open (and dropped like one when its room is needed first); with
        retention it is acknowledged as of ``tick`` and the policy decides.

        Raises:
            KeyError: ``name`` is not a published item of this cache.
        """
        if self._policy is not None:
            self.evict(name, epoch, tick)
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

    def drop(self, name: str) -> None:
        """Delete a published item that was not acknowledged (closing, a leftover in the way, or a
        retention victim): its files go first, then the journal records it (see :meth:`_delete`)."""
        with self._cond:
            size = self.record.dropping(name)
            self._recovered.pop(name, None)
        self._delete(name, size, dropped=True)

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
            self._cond.notify_all()  # wakes claim() and reserve()
        if not in_place:
            self._eviction.finish(aside, size, left)

    def _reaped(self, size: int, left: int) -> None:
        """An item's files are deleted: release its ``size``; ``left`` bytes could not be deleted
        and count as foreign (on disk, not ours to reuse) until the staging area is cleared."""
        with self._cond:
            self.ledger.reaped(size, left)
            self._cond.notify_all()  # wakes reserve()

    # ---- retention -------------------------------------------------------------------
    def use_retention(self, policy: RetentionPolicy, names: Sequence[str], tick: int) -> None:
        """Keep acknowledged items by ``policy`` (its item ``i`` is ``names[i]``). Items recovered
        at open become retained items as if acknowledged just before the step at ``tick`` (the
        first one not consumed), so one that this step reads is kept too; the policy drops
        the others it would not keep.

        ``names`` is searched with ``names.index(name)`` for each item fetched or acknowledged:
        a :class:`~cachepipe.catalog.Names` view does that by binary search, with no index of
        the whole catalog in memory."""
        self._policy, self._names = policy, names
        tick -= 1  # a next use is one strictly after the tick: the step at ``tick`` is one
        with self._cond:
            numbered = [(name, self._number(name)) for name in self._recovered]
            recovered = [(name, number) for name, number in numbered if number is not None]
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


def journal_budget_of(name_bytes: int, count: int, versions: bool = True) -> int:
    """:meth:`Cache.journal_budget` of ``count`` items whose names take ``name_bytes`` bytes
    (UTF-8) in all: for a caller that sizes a cache before it has a catalog (``cachepipe map``).
    ``versions``: whether their publishes journal a version (items with ETags; default True)."""
    step = state.EVENT_OVERHEAD + (state.VERSION_OVERHEAD if versions else 0)
    return 2 * (4 * name_bytes + step * count) + 256


def _identity(path: str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``path``: which directory it is, whatever its name."""
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _flat_names(item: Item) -> tuple[str, ...]:
    """The names of a folder item's files, if they are at most 4 (kept in memory while it is
    published: a sample's media and caption, say) and each is directly under it; else ()."""
    names = tuple(f.rel for f in item.files)
    return () if len(names) > 4 or any("/" in name for name in names) else names
