"""The cache facade: one owner's view of a size-capped cache directory, over its parts.

Layout::

    cache_dir/
      .cachepipe/lock          flock'ed by the owner; holds "pid host"            (lock.py)
      .cachepipe/journal       publishes, acks, drops, the position (state.py)    (record.py)
      .cachepipe/catalog       the saved listing (resume only)                    (state.py)
      .cachepipe/staging/N     downloads in progress (removed on open and close)  (staging.py)
      .cachepipe/staging/xN    items moved aside to be deleted                    (eviction.py)
      .cachepipe/staging.N     a staging an open could not delete (a file in it still open on
                               NFS): set aside, deleted by a later open           (staging.py)
      <item>/...               published items

:class:`Cache` holds one condition variable over the parts: the :class:`~.ledger.Ledger`
(bytes by owner; pure), the :class:`~.record.Record` (what is published, acked and consumed,
journaled before it is believed), the :class:`~.staging.Staging` areas and the
:class:`~.eviction.Eviction` (the only code that deletes items). It adds what needs them
together, in base classes of its own, one concern each (see :mod:`.acks` for why they are parts
of one object): waiting for room and claims, one copy of an item at a time
(:mod:`.reservation`); staging and the atomic publish (:mod:`.publishing`); acks, drops and the
retention policy's hooks (:mod:`.acks`). This module is its lifecycle: the open, recovery at
open (what to reuse is decided by :mod:`.recovery`), the journal's budget, and the close.

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
from collections.abc import Sequence
from pathlib import Path

from .. import state
from ..blocks import BLOCK_MIN, clamp_block, folders_above, round_up
from ..catalog import Catalog
from ..config import Share
from ..errors import CacheRemovedError
from ..filesystems import lookups_stay_local, mount_at
from ..fscalls import RELEASING, file_calls_for
from ..removal import rmtree, tree_bytes
from .acks import _Counted
from .eviction import Eviction
from .fulldisk import full_disk, no_room, room_now, said_full
from .ledger import Ledger
from .lock import LOCK, STATE_DIR, OwnerLock, unusable_dir
from .publishing import _Publishing
from .record import Record
from .recovery import check_resume, of_same_data, sort_leftovers
from .reservation import _capacity_bytes
from .room import JOURNAL, NOTE, STAGING, drop_note, held_in, write_note
from .staging import Staging
from .staging import clear as clear_staging

__all__ = ["STATE_DIR", "Cache"]

log = logging.getLogger("cachepipe.cache")


class Cache(_Publishing):
    """A size-capped cache directory owned by one pipeline at a time.

    Use: :meth:`open` (lock, clean staging, read the journal), :meth:`recover` (with the catalog:
    reuse published items, drop stale ones, reserve the state budget), then acquire / stage /
    publish / evict, and :meth:`close`.

    Args:
        root: the cache directory (created if missing).
        capacity: bytes, or a :class:`~cachepipe.config.Share` of the filesystem's free space
            and of what ``root`` holds, resolved by :meth:`open`.
    """

    def __init__(self, root: Path, capacity: int | Share) -> None:
        self._given = root  # as the user wrote it, for the error messages
        # absolute and normal (".." taken lexically, as the daemon names the paths acked to it)
        self.root = Path(os.path.abspath(root))
        self.state_dir = self.root / STATE_DIR
        self.staging_root = self.state_dir / STAGING
        self.catalog_path = self.state_dir / "catalog"
        self._root = str(self.root)
        self.prefix = self._root.rstrip("/") + "/"  # what every item's path starts with
        self._capacity_spec = capacity
        self.ledger = Ledger()
        # the filesystem's allocation block (read by open): every item is charged its files in
        # whole blocks of it, and a block per folder (:meth:`charge`)
        self.block = BLOCK_MIN
        # the journal's budget in bytes, which the ledger counts rounded up to whole blocks (the
        # journal is one file): a streamed listing's names grow it (note_listed)
        self._budget_bytes = 0
        self.record = Record(self.state_dir / JOURNAL)
        self._staging = Staging(self.staging_root)
        self._eviction = Eviction(self.root, self._staging, self._reaped, self._held)
        # the calls that write and publish items (:func:`~cachepipe.fscalls.file_calls_for`
        # the file system that holds the cache, chosen by open; :data:`~cachepipe.fscalls.RELEASING`
        # where a lookup of the cache's path passes a file system not known to be local)
        self.file_calls = RELEASING
        self._lock = OwnerLock(self.state_dir / LOCK, self.root)
        self.rebuilt = False  # the journal was unreadable and state was rebuilt from disk
        self._replay = state.Replay()
        self._recovered = {}  # published items found at open, not yet handed out
        self._claimed = set()  # names with files on disk or on their way: one copy at a time
        # published items under REAP_MIN_BYTES, deleted in place: name -> the names of its files
        # directly under it (None: the item is one file; empty: more than 4, or some deeper, so
        # the folder is listed to delete it)
        self._small = {}
        # items this owner published (downloaded) and has not handed out yet: nobody has had their
        # path, so no consumer can have left a marker in them (see first_hand_out)
        self._fresh = set()
        self._policy = None  # retain="auto": which acked items stay
        self._names = ()  # the policy's item i is _names[i]; found by _names.index()
        self._cond = _Counted()
        self._closed = False
        self._acks_deleting = 0  # calls of evict_many and drop deleting (or waiting to): close waits for them
        self._wanting = 0  # bytes the latest download waiting for room asks for (0: none waits)
        self._expected = 0  # the charge of the item the planner reserves next, or how to read it (expect)
        self._waiting_run = False  # that download fits, and waits for room for a run after it (acquire's run)
        self._run_wanted = 0  # the bytes it waits to fit: its own and the run's
        self._forced = False  # force_room(): the next choice of retention victims waives the policy's rules
        self._identity: tuple[tuple[int, int], ...] = ()  # (st_dev, st_ino) of root and state_dir, taken by open

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Take the ownership lock, delete staging leftovers, resolve the capacity, read the journal.

        Raises:
            CacheLockedError: another live process owns the directory.
            OSError: the directory cannot be created or taken (:func:`~.lock.unusable_dir`: a
                read-only filesystem, permission denied, a file on its path), naming ``cache_dir``;
                or its disk is full (``ENOSPC``, ``EDQUOT``: :func:`~.fulldisk.full_disk`, which
                names the disk and what holds it), also checked before the listing when the
                journal names no item of an earlier owner (recovery might free room).
        """
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        except OSError as exc:
            error = unusable_dir(self._given, exc) or full_disk(self._given, self.root, exc)
            if error is None:
                raise
            raise error from exc
        full: OSError | None = None
        try:
            here, fstype = mount_at(self._root)  # its mount point and filesystem type, from one read of the mounts
            if crossed := _off_the_mount(self._given, here, self.staging_root):
                raise crossed
            clear_staging(self.staging_root)
            try:
                self._replay = state.load(self.record.journal.path)
            except state.StateCorrupt as exc:
                log.warning("%s; rebuilding the cache state from the files on disk", exc)
                self._replay, self.rebuilt = state.Replay(), True
            usage = room_now(self._root)  # the one statvfs of an open (nothing of this cache writes yet)
            self.block = self._eviction.block = clamp_block(usage.block)
            # before the listing, which may take minutes; not where recovery may free room (leftovers)
            if not self.has_leftovers() and no_room(usage) and (full := full_disk(self._given, self.root)):
                raise full
            self._identity = tuple(_identity(path) for path in (self._root, str(self.state_dir)))
            self._eviction.open_deleters(fstype)
            # calls that keep the interpreter's lock only where no lookup waits for a server on the way
            self.file_calls = file_calls_for(fstype) if lookups_stay_local(self._root) else RELEASING
            self.ledger.capacity = _capacity_bytes(self._capacity_spec, self.root, usage)  # beyond the filesystem: held, logged
            spec = self._capacity_spec
            # within the filesystem's size, kept as given (the space others hold may come back), but said when over
            # the room there now: the tree walked only where it can matter, a capacity over the free space
            if (
                not isinstance(spec, Share)
                and usage.bytes < spec <= usage.total
                and spec > (room := usage.bytes + held_in(self.root))
            ):
                log.warning(
                    "capacity %d bytes exceeds the space available to %s (%d bytes): downloads will meet a full "
                    "disk, and in-order delivery can wait on space held by later items; lower the capacity or "
                    "give it as a share like '80%%'",
                    self.capacity,
                    self.root,
                    room,
                )
        except OSError as exc:
            self._lock.release()
            error = None if exc is full else full_disk(self._given, self.root, exc)
            if error is None:
                raise
            raise error from exc
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
        with said_full(self._given, self.root):
            state.save_catalog(self.catalog_path, source, mode, catalog)

    def recover(
        self, items: Catalog, resume: bool, plan: str = "", reusable: bool = True
    ) -> tuple[tuple[int, int], set[tuple[int, str]]]:
        """Reconcile the disk with the journal and the catalog.

        Items the journal says are published (or were being published) and whose files match the
        catalog are reused (unless ``reusable`` is False: this owner transforms its items before
        hand-out, ``prepare`` or ``unpack``, and one found as listed has not been through that);
        other leftovers of ours are deleted. With ``resume``, the position in
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
            OSError: the disk is full when the journal is rewritten for the pass (:func:`~.fulldisk.full_disk`).
        """
        replay = self._replay
        check_resume(replay, resume, plan, self._root)
        drop_note(self.root)  # this owner changes the folder from now on: before the journal says so, below
        record, ledger = self.record, self.ledger
        reuse, stale = sort_leftovers(
            self.root, replay, self.rebuilt, items, reusable and of_same_data(replay.plan, plan), block=self.block
        )
        for name in stale:
            log.info("removing stale cached item %s", name)
            self._eviction.remove(name)
        for name, size in reuse.items():
            record.published[name] = size
            if name in replay.versions:
                record.versions[name] = replay.versions[name]
            self._recovered[name] = self.root / name
            self._claimed.add(name)
        with said_full(self._given, self.root):  # the journal's rewrite
            if resume:
                record.start(replay.pass_no, replay.cursor, replay.acked, plan)
            else:
                record.start(replay.pass_no + 1, (0, 0), set(), plan)
        ledger.reserved = sum(record.published.values())
        block = self.block
        # in whole blocks, as the items are charged: the state folder itself, its files and folders,
        # and the journal's budget (the journal grows into it)
        state_files = block + tree_bytes(self.state_dir, block=block)
        self._budget_bytes = self.journal_budget(items)
        record.budget = round_up(self._budget_bytes, block)
        ledger.overhead = state_files + record.budget
        # the reused items matched their sizes: their charge is reserved, with the folders above
        # a nested single-object item (folders_made), which the walk meets: not foreign as well
        walked = tree_bytes(self.root, skip={*reuse, STATE_DIR}, block=block)
        ledger.foreign = max(0, walked - folders_above(reuse) * block)
        ledger.check_room(self._root)
        self._replay = state.Replay()
        while self._recovered and ledger.over_capacity():
            name = next(reversed(self._recovered))
            log.info("dropping %s, an earlier owner's item: the cache is over its capacity of %d bytes", name, self.capacity)
            self.drop(name)
        return record.cursor, set(record.acked)

    def state_before_recover(self) -> int:
        """What :meth:`recover` will count of the state files (beside the journal's budget),
        told before it runs, for the plan's judgement of which items fit: the state folder and
        what it holds now (the lock, staging), and the journal as one block, the header of a
        pass, which is what a rewritten journal naming no item takes on the usual blocks.

        Left out, so that the plan (which a resume must match) is the same from one open to the
        next: the journal as it is now (as large as the last pass left it) and its temporary
        file that a process killed while it compacted the journal left (``.journal.tmp``, which
        the rewrite reuses and renames), which recovery rewrites; the note of the folder's size,
        which it removes; a staging set aside because a file in it was still open (``staging.N``,
        :func:`.staging.clear`), which a later open deletes; and the saved listing (``catalog``), which only a pass with
        ``resume=True`` writes, so a pass run without it and then resumed would be planned
        beside a listing it did not have (counted, its item at the limit was left out, and the
        resume was refused for a plan of other items). Recovery counts more than this where the
        journal names items it reuses or, resumed, that were acknowledged, and the saved listing:
        an item near the limit is skipped in its turn."""
        block = self.block
        listing = self.catalog_path.name
        skip = {JOURNAL, state.temp_name(JOURNAL), NOTE, listing, state.temp_name(listing)}
        skip.update(path.name for path in self.state_dir.glob(f"{STAGING}.*"))  # set aside: deleted by a later open
        return block + tree_bytes(self.state_dir, skip=skip, block=block) + block

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
        free (items are acked), so that the ledger never exceeds the capacity, beside the room
        a download waiting for it wants, or the planner's next item (:meth:`expect`): a
        planned item goes first; the names
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
        # each name's bytes as Catalog.name_bytes counts them (an undecodable byte: 3), as a reopen
        # budgets it; counted in the ledger as what they add to the budget in whole blocks, so that
        # the budget is the one a reopen over the same names reserves (round_up of the total)
        raw = [
            2 * (4 * len(name.encode("utf-8", "surrogatepass")) + (step if i < len(plain) and plain[i] else versioned))
            for i, name in enumerate(names)
        ]
        block, grows, total = self.block, [], self._budget_bytes
        for grow in raw:
            grows.append(round_up(total + grow, block) - round_up(total, block))
            total += grow
        limits: list[int] = []
        with self._cond:
            if grows:
                ledger.check_room(self._root, ledger.overhead + grows[0])
                # Wait for room (acks) rather than count space the reserved items already hold: the
                # ledger never exceeds the capacity. Reservations waiting for room re-check the limit.
                # A download waiting for room goes first, and so does the planner's next item
                # (expect), planned and not yet reserved: a consumer may wait for it while holding
                # items. The names take only room beyond what it wants, else the budget, growing a
                # block at a time, took each block an ack freed, and a download of an item of more
                # than a block waited for ever.
                while not self._closed and not ledger.fits(grows[0] + (self._ahead() if grows[0] else 0)):
                    self._cond.wait()
            if grows and not self._closed:
                # the largest item beside the budget, and the room left, with the names so far
                # counted, beside a waiting download's or the planner's next item's; none known,
                # the first name's item is the next (the planner has taken every item listed)
                limit = ledger.limit - grows[0]
                ahead = self._ahead() or (sizes[0] if sizes and sizes[0] <= limit else 0)
                free = ledger.free - ahead - grows[0]
                limits.append(limit)
                for i in range(1, len(grows)):
                    grow = grows[i]
                    if grow > max(free, 0) or limit - grow <= 0 or (i < len(sizes) and sizes[i] > limit - grow):
                        break  # for the next call, with that name first: it raises, waits, or refuses the item
                    limit, free = limit - grow, free - grow
                    limits.append(limit)
                counted = sum(grows[: len(limits)])
                self._budget_bytes += sum(raw[: len(limits)])
                self.record.budget += counted
                ledger.overhead += counted
            self._cond.notify_all()
        return limits

    def set_plan(self, plan: str) -> None:
        """Record the plan (its configuration as JSON) once it is known, for a later ``resume``.

        Raises:
            OSError: the journal's rewrite failed; a full disk as :func:`~.fulldisk.full_disk`
                says it (the disk, what holds it, what to do).
        """
        with self._cond, said_full(self._given, self.root):
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
        noted = False
        try:
            if not keep and self.record.journal.is_open:  # else recovery never finished: the next open decides
                for name in list(self.record.published):
                    self.drop(name, gone_ok=True)  # a consumer may ack meanwhile (a job deleted under its lanes)
            with self._cond:  # and the files of its acks and drops go while the cache is still ours
                self._cond.wait_for(lambda: not self._acks_deleting)
            try:
                rmtree(self.staging_root)
            except OSError as exc:  # not fatal: the next open removes staging leftovers
                log.warning("could not remove staging %s: %s", self.staging_root, exc)
            noted = self.record.journal.is_open  # else recovery never finished: nothing known to note
        finally:
            self.record.close()
            try:
                if noted:  # what the folder holds, for a share of the disk measured before the next owner's recovery
                    write_note(self.root, self.block)
            finally:
                self._lock.release()


def journal_budget_of(name_bytes: int, count: int, versions: bool = True) -> int:
    """:meth:`Cache.journal_budget` of ``count`` items whose names take ``name_bytes`` bytes
    (UTF-8) in all: for a caller that sizes a cache before it has a catalog (``cachepipe map``).
    ``versions``: whether their publishes journal a version (items with ETags; default True)."""
    step = state.EVENT_OVERHEAD + (state.VERSION_OVERHEAD if versions else 0)
    return 2 * (4 * name_bytes + step * count) + 256


def _off_the_mount(given: str | os.PathLike[str], here: str, staging: Path) -> OSError | None:
    """The error to raise if ``staging`` (or the state folder it is made in, where it is not
    there yet) is on another mount than the cache directory, whose mount point is ``here``
    (``given`` as the user wrote it): a mount at or inside its ``.cachepipe``, of another
    filesystem or a bind mount of the same one. A publish renames an item from staging into the
    cache directory, which no rename does across mounts (``EXDEV``, after the item's download),
    and staging at a mount point cannot be removed (``EBUSY``). None where they are on one mount, or the mounts cannot be read."""
    folder = staging if staging.exists() else staging.parent
    there = mount_at(str(folder))[0]
    if here == there:
        return None
    return OSError(
        errno.EXDEV,
        f"cache_dir {os.fspath(given)!r}: {str(folder)!r} is on another mount than cache_dir ({there!r}, not "
        f"{here!r}): an item is published by a rename from its staging folder there, which cannot cross mounts; "
        "mount nothing at or inside cache_dir's .cachepipe folder",
    )


def _identity(path: str) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``path``: which directory it is, whatever its name."""
    st = os.stat(path)
    return st.st_dev, st.st_ino
