"""The on-disk cache: ownership lock, capacity ledger, staging, atomic publish, eviction, recovery.

This module is the only code that writes the ledger or deletes cached files. Layout::

    cache_dir/
      .cachepipe/lock          flock'ed by the owner; holds "pid host"
      .cachepipe/journal       publishes and acks (see state.py)
      .cachepipe/catalog       the saved listing (resume only)
      .cachepipe/staging/N     downloads in progress (removed on open and close)
      .cachepipe/staging/xN    acknowledged items (1 MiB or more) moved aside, being deleted (see removal.py)
      <item>/...               published items

Invariant: the bytes of regular files under ``cache_dir`` never exceed the capacity. Space is
reserved (from listed sizes) before a download starts and released only after the files are
deleted. cachepipe's own state files have a budget reserved up front. Bytes found at open that
cachepipe does not manage ("foreign") count against the capacity and are never deleted.
"""

from __future__ import annotations

import errno
import fcntl
import heapq
import logging
import os
import shutil
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from . import state
from .catalog import Catalog, Item
from .config import Share
from .errors import CacheLockedError, ConfigError, OversizeError, VerificationError
from .plan import tick as plan_tick
from .removal import Reaper, rmtree, tree_bytes
from .retention import RetentionPolicy

__all__ = ["Cache", "tree_bytes"]

log = logging.getLogger("cachepipe.cache")

STATE_DIR = ".cachepipe"

# Items at least this large are deleted by the reaper thread, off the consumer's path: unlinking
# a large file takes the file system milliseconds (ext4: ~1.3 ms for 8 MiB). Smaller ones cost
# less to delete in place than to hand to a thread (tiny items: 1,600/s in place, 1,250/s through
# the reaper in benchmarks/bench_core.py on tmpfs).
REAP_MIN_BYTES = 1024 * 1024


class Cache:
    """A size-capped cache directory owned by one pipeline at a time.

    Use: :meth:`open` (lock, clean staging, read the journal), :meth:`recover` (with the catalog:
    reuse published items, drop stale ones, reserve the state budget), then reserve / stage /
    publish / evict, and :meth:`close`.

    Args:
        root: the cache directory (created if missing).
        capacity: bytes, or a :class:`~cachepipe.config.Share` of the filesystem's free space,
            resolved by :meth:`open`.
    """

    def __init__(self, root: Path, capacity: int | Share) -> None:
        self.root = Path(root).absolute()
        self.state_dir = self.root / STATE_DIR
        self.staging_root = self.state_dir / "staging"
        self._root, self._staging = str(self.root), str(self.staging_root)  # for the per-item paths
        self.catalog_path = self.state_dir / "catalog"
        self._capacity_spec = capacity
        self.capacity = 0
        self.foreign = 0  # bytes present at open that we do not manage
        self.overhead = 0  # bytes budgeted for our own state files
        self.pass_no = 0
        self.rebuilt = False  # the journal was unreadable and state was rebuilt from disk
        self._reserved = 0
        self._published: dict[str, int] = {}  # item name -> size
        self._deleting: set[str] = set()  # dropped or evicted without an ack, files not yet moved away
        self._recovered: dict[str, Path] = {}  # published items found at open, not yet handed out
        self._replay = state.Replay()
        self._journal = state.Journal(self.state_dir / "journal")
        self._journal_budget = 0
        self._acked: set[tuple[int, str]] = set()  # (epoch, name) acknowledged beyond the cursor
        self._acked_ticks: list[tuple[int, int, str]] = []  # heap of (tick, epoch, name) of _acked
        self._cursor = (0, 0)
        self._plan = ""
        self._claimed: set[str] = set()  # names with files on disk or on their way: one copy at a time
        self._policy: RetentionPolicy | None = None  # retain="auto": which acked items stay
        self._names: Sequence[str] = ()  # the policy's item i is _names[i]; found by _names.index()
        self._cond = threading.Condition()
        self._dirs = threading.Lock()  # parent folders of nested items: made by publish, removed by eviction
        self._closed = False
        self._seq = 0
        self._lock_fd: int | None = None
        self._reaper = Reaper(self._reaped)
        self._reaping = 0  # bytes of evicted items not yet deleted (still in _reserved)

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Take the ownership lock, delete staging leftovers, resolve the capacity, read the journal.

        Raises:
            CacheLockedError: another live process owns the directory.
        """
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            if self.staging_root.exists():
                shutil.rmtree(self.staging_root)
            self.staging_root.mkdir()
            usage = shutil.disk_usage(self.root)
            if isinstance(self._capacity_spec, Share):
                self.capacity = int(usage.free * self._capacity_spec.fraction)
            else:
                self.capacity = self._capacity_spec
                room = usage.free + tree_bytes(self.root)
                if self.capacity > room:
                    log.warning(
                        "capacity %d bytes exceeds the space available to %s (%d bytes): downloads will meet a full "
                        "disk, and in-order delivery can wait on space held by later items; lower the capacity or "
                        "give it as a share like '80%%'", self.capacity, self.root, room,
                    )
            try:
                self._replay = state.load(self._journal.path)
            except state.StateCorrupt as exc:
                log.warning("%s; rebuilding the cache state from the files on disk", exc)
                self._replay, self.rebuilt = state.Replay(), True
        except BaseException:
            self._unlock()
            raise

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
        are reused and everything else is left alone as foreign.

        Returns:
            ``(cursor, acked)``: the first unconsumed ``(epoch, index)`` of the plan, and the
            ``(epoch, name)`` pairs acknowledged beyond it.

        Raises:
            ConfigError: ``resume`` with a different plan, or after a streamed pass that stopped
                before its listing ended (its plan is unknown), or foreign files and the state
                budget leave no room under the capacity.
        """
        replay = self._replay
        if resume and not replay.plan and replay.cursor != (0, 0):
            raise ConfigError(
                f"resume=True, but the pass in {str(self.root)!r} streamed its listing and stopped at step "
                f"{replay.cursor[1]} before the listing ended, so its plan was never recorded and that position "
                "cannot be checked against the data; use resume=False to start a new pass"
            )
        if resume and replay.plan and plan and replay.plan != plan:
            raise ConfigError(
                f"resume=True, but {str(self.root)!r} holds a pass of another plan ({replay.plan}); this one is {plan}. "
                "The data (n_items, sizes_digest) or the epochs/shuffle/seed/rank settings differ; "
                "use the same ones, or resume=False to start a new pass"
            )
        live = replay.published | replay.publishing
        ours = live | {name for _epoch, name in replay.acked}
        if self.rebuilt:
            ours = live = {name for name in items.names if os.path.lexists(self.root / name)}
        for name in sorted(ours):
            path = self.root / name
            if not os.path.lexists(path):
                continue
            found = items.find(name)  # only names on disk are looked up: no index of the whole catalog
            item = items[found] if found >= 0 else None
            if name in live and item is not None and _matches(path, item):
                self._published[name] = item.size
                self._recovered[name] = path
                self._claimed.add(name)
            elif not self.rebuilt:
                log.info("removing stale cached item %s", name)
                self._remove_files(name)
        if resume:
            self.pass_no, self._cursor, self._acked = replay.pass_no, replay.cursor, set(replay.acked)
        else:
            self.pass_no, self._cursor, self._acked = replay.pass_no + 1, (0, 0), set()
        self._acked_ticks = []
        self._plan = plan
        self._compact()
        self._reserved = sum(self._published.values())
        state_files = tree_bytes(self.state_dir)
        self._journal_budget = self.journal_budget(items)
        self.overhead = state_files + self._journal_budget
        self.foreign = tree_bytes(self.root) - self._reserved - state_files
        self._check_overhead()
        self._replay = state.Replay()
        while self._recovered and self.foreign + self.overhead + self._reserved - self._reaping > self.capacity:  # a smaller capacity than before
            name = next(reversed(self._recovered))
            log.info("dropping %s, an earlier owner's item: the cache is over its capacity of %d bytes", name, self.capacity)
            self.drop(name)
        return self._cursor, set(self._acked)

    @staticmethod
    def journal_budget(items: Catalog) -> int:
        """Bytes the journal may take in a pass over ``items`` (reserved against the capacity by
        :meth:`recover`). A step writes at most four lines (I, P, A, C); a compacted journal holds
        at most two per item (P, A). Compacting at half the budget keeps it under it at all times."""
        return 2 * (4 * items.name_bytes + state.EVENT_OVERHEAD * len(items)) + 256

    def has_leftovers(self) -> bool:
        """True if the journal read at open names items on disk (or could not be read): then
        :meth:`recover` needs the whole catalog to decide which of them to keep."""
        replay = self._replay
        return self.rebuilt or bool(replay.published or replay.publishing or replay.acked)

    def note_listed(self, name: str) -> None:
        """Budget journal space for an item listed after :meth:`recover` (a listing that streams
        while downloads run): the same share per name that :meth:`recover` budgets. Blocks until
        that space is free (items are acked), so that the ledger never exceeds the capacity; a
        reservation that the larger budget leaves no room for raises instead of waiting (see
        :meth:`reserve`).

        Raises:
            ConfigError: the state budget alone would reach the capacity.
        """
        with self._cond:
            grow = 2 * (4 * len(name.encode("utf-8", "surrogateescape")) + state.EVENT_OVERHEAD)
            self._check_overhead(self.overhead + grow)
            # Wait for room (acks) rather than count space the reserved items already hold: the
            # ledger never exceeds the capacity. Reservations waiting for room re-check the limit.
            while not self._closed and self.foreign + self.overhead + self._reserved + grow > self.capacity:
                self._cond.wait()
            if self._closed:
                return
            self._journal_budget += grow
            self.overhead += grow
            self._cond.notify_all()

    def set_plan(self, plan: str) -> None:
        """Record the plan (its configuration as JSON) once it is known, for a later ``resume``."""
        with self._cond:
            self._plan = plan
            self._compact()

    def _check_overhead(self, overhead: int | None = None) -> None:
        """Raise ConfigError if foreign files and ``overhead`` (default: the current state budget)
        leave no room for any item."""
        overhead = self.overhead if overhead is None else overhead
        if self.foreign + overhead >= self.capacity:
            raise ConfigError(
                f"cache_dir {str(self.root)!r} holds {self.foreign} bytes not managed by cachepipe and needs "
                f"{overhead} bytes for its state, not less than the capacity of {self.capacity} bytes; "
                "empty it or raise the capacity"
            )

    def _compact(self) -> None:
        """Rewrite the journal from the state in memory (caller holds ``_cond`` or is alone).

        Memory holds only what is already journaled: every operation appends its event first,
        then updates memory, then calls :meth:`_compact_if_due`. An item whose deletion is under
        way stays published here until its files are moved away (see :meth:`_delete`)."""
        published = set(self._published) | self._deleting
        self._journal.rewrite(state.Replay(self.pass_no, published, set(), set(self._acked), self._cursor, self._plan))

    def _append(self, kind: str, arg: str) -> None:
        """Journal one event. Caller holds ``_cond``, updates memory after it, then calls
        :meth:`_compact_if_due`."""
        self._journal.append(kind, arg)

    def _compact_if_due(self) -> None:
        """Compact once the journal outgrows half its budget; a failure (a full disk) is logged and
        leaves the old journal, which is whole (the rewrite is atomic). Caller holds ``_cond``."""
        if self._journal.size > self._journal_budget // 2:
            try:
                self._compact()
            except OSError as exc:
                log.warning("could not compact the journal %s (%s); it keeps growing until this succeeds", self._journal.path, exc)

    def advance(self, epoch: int, index: int) -> None:
        """Record that every step of the plan before ``(epoch, index)`` is consumed. A position
        not after the current one is ignored: consumers acking in parallel report positions out
        of order, and the acks a later position made implicit are already pruned."""
        with self._cond:
            if (epoch, index) <= self._cursor:
                return  # another consumer's ack already moved it further: the position never goes back
            try:
                self._append("C", f"{epoch} {index}")
            except OSError as exc:  # the acks behind it are journaled: they stand for the position until a later one is written
                log.warning("journal: could not record the position (%d, %d): %s", epoch, index, exc)
                return
            if epoch > self._cursor[0]:  # acks of finished epochs are implied by the cursor
                self._acked = {a for a in self._acked if a[0] >= epoch}
            self._cursor = (epoch, index)
            ticks, now = self._acked_ticks, plan_tick(epoch, index)
            while ticks and ticks[0][0] < now:  # so are acks of steps before it
                _tick, e, name = heapq.heappop(ticks)
                self._acked.discard((e, name))
            self._compact_if_due()

    def _lock(self) -> None:
        path = self.state_dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CacheLockedError(str(self.root), f"pid {owner}" if owner[:1].isdigit() else owner) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        self._journal.close()
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def interrupt(self) -> None:
        """Wake every thread blocked in :meth:`reserve`; from now on it returns False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self, keep: bool = False) -> None:
        """Interrupt waiters, delete staging and (unless ``keep``) published items; unlock.

        Kept items stay in the journal and are reused by the next owner. Call only once no
        thread writes into staging any more.
        """
        self.interrupt()
        self._reaper.stop()  # deletes what acks moved aside; from now on deletions run here
        if self._lock_fd is None:
            return
        try:
            if not keep:
                for name in list(self._published):
                    self.drop(name)
            try:
                shutil.rmtree(self.staging_root)
            except FileNotFoundError:
                pass
            except OSError as exc:  # not fatal: the next open removes staging leftovers
                log.warning("could not remove staging %s: %s", self.staging_root, exc)
        finally:
            self._unlock()

    # ---- the ledger ------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Bytes accounted under the cache directory: foreign + state budget + reserved items."""
        with self._cond:
            return self.foreign + self.overhead + self._reserved

    @property
    def limit(self) -> int:
        """The largest item that can ever fit: capacity minus foreign bytes and the state budget."""
        return self.capacity - self.foreign - self.overhead

    def set_capacity(self, capacity: int | Share) -> int:
        """Change the capacity now; returns it in bytes. Shrinking deletes nothing: downloads
        wait until acknowledgements bring the cache under the new cap.

        Raises:
            ConfigError: the new capacity leaves no room beside foreign files and the state budget.
        """
        new = int(shutil.disk_usage(self.root).free * capacity.fraction) if isinstance(capacity, Share) else capacity
        if self.foreign + self.overhead >= new:
            raise ConfigError(f"capacity {new} bytes leaves no room beside {self.foreign + self.overhead} bytes of other files and state")
        with self._cond:
            self.capacity = new
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
        with self._cond:
            while not self._closed and self.foreign + self.overhead + self._reserved + size > self.capacity:
                if size > self.capacity - self.foreign - self.overhead:
                    raise OversizeError(name, size, self.capacity, self.foreign + self.overhead)
                self._cond.wait()
            if self._closed:
                return False
            self._reserved += size
            return True

    def unreserve(self, size: int, name: str | None = None) -> None:
        """Release a reservation (and the claim on ``name``) of an item that will not be published."""
        number = self._number(name) if name is not None and self._policy is not None else None
        with self._cond:
            self._reserved -= size
            if name is not None:
                self._claimed.discard(name)
                if self._policy is not None and number is not None:
                    self._policy.forget(number)
            self._cond.notify_all()

    # ---- staging and publish ---------------------------------------------------------
    def stage(self, item: Item, part_size: int | None = None) -> Path:
        """Create the staging area for ``item``: its folders and empty files.

        With ``part_size``, only the files that are empty or that several parts write into
        are created; the downloader creates a one-part file as it writes it (a file creation
        costs a few hundred microseconds on some disks: better in the download threads).

        Returns the staging path (a directory, or a file for single-object items).
        """
        with self._cond:
            self._seq += 1
            seq = self._seq
        path = f"{self._staging}/{seq}"  # strings, not Path objects: this runs once per item
        try:
            if item.is_file:
                if part_size is None or item.size == 0 or item.size > part_size:
                    with open(path, "wb"):
                        pass
                return Path(path)
            os.mkdir(path)
            made = {path}
            for f in item.files:
                target = f"{path}/{f.rel}"
                parent = target.rpartition("/")[0]
                if parent not in made:
                    os.makedirs(parent, exist_ok=True)
                    made.add(parent)
                if part_size is None or f.size == 0 or f.size > part_size:
                    with open(target, "wb"):
                        pass
        except OSError:
            rmtree(path)
            raise
        return Path(path)

    def item_path(self, item: Item) -> Path:
        """Where ``item`` is (or will be) published."""
        return self.root / item.name

    @staticmethod
    def verify(staged: Path, item: Item) -> None:
        """Check every staged file's size against the listing.

        Raises:
            VerificationError: a file's size differs from the listing.
        """
        base = os.fspath(staged)
        for f in item.files:
            actual = os.stat(f"{base}/{f.rel}" if f.rel else base).st_size
            if actual != f.size:
                raise VerificationError(errno.EIO, f"{f.key}: got {actual} bytes, listing says {f.size}")

    def publish(self, staged: Path, item: Item, reserved: int | None = None, verified: bool = False) -> Path:
        """Verify sizes (unless ``verified``), then atomically rename the staged item into place.

        Args:
            reserved: the bytes reserved for it, released at eviction (default: its listed size).

        Raises:
            VerificationError: a file's size differs from the listing.
            FileExistsError: something not managed by this cache is in the way.
        """
        if not verified:
            self.verify(staged, item)
        final = f"{self._root}/{item.name}"
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, f"cannot publish item {item.name!r}: {final} exists and is not managed by cachepipe")
        with self._cond, self._dirs:
            self._append("I", item.name)
            if "/" in item.name:  # a nested single-file item: its folders
                os.makedirs(final.rpartition("/")[0], exist_ok=True)
            os.rename(staged, final)
            try:
                self._append("P", item.name)
            except OSError as exc:  # the intent line is durable, and recovery checks the files: published all the same
                log.warning("journal: could not record that %s is published (%s); its intent line covers it", item.name, exc)
            self._published[item.name] = item.size if reserved is None else reserved
            self._compact_if_due()
        return Path(final)

    def discard(self, staged: Path, size: int, name: str) -> None:
        """Delete a staging area, release its reservation and the claim on ``name``."""
        try:
            rmtree(staged)
        finally:
            self.unreserve(size, name)

    def evict(self, name: str, epoch: int = 0, tick: int = 0) -> None:
        """An acknowledged item (the step at ``tick`` of ``epoch``): record the ack, then delete its
        files and release its space, unless the retention policy keeps it for a later step.

        The ack is journaled before the files go: a crash after it re-deletes, never re-delivers.
        If the write fails (disk full), nothing changed: the caller sees the error and may retry.

        Raises:
            KeyError: ``name`` is not a published item of this cache.
        """
        number = self._number(name) if self._policy is not None else None
        with self._cond:
            size = self._published[name]
            self._append("A", f"{epoch} {name}")
            self._acked.add((epoch, name))
            heapq.heappush(self._acked_ticks, (tick, epoch, name))
            if self._policy is not None and number is not None and self._policy.on_ack(number, tick):
                try:
                    self._append("P", name)  # still on disk, kept for a later step
                except OSError as exc:  # the ack is durable: delete the item instead of keeping it unrecorded
                    log.warning("journal: could not record that %s is kept (%s); deleting it", name, exc)
                    self._policy.forget(number)
                else:
                    self._compact_if_due()
                    self._cond.notify_all()
                    return
            del self._published[name]
            self._recovered.pop(name, None)
            self._compact_if_due()
        self._delete(name, size)

    def drop(self, name: str) -> None:
        """Delete a published item that was not acknowledged (closing, a leftover in the way, or a
        retention victim): its files go first, then the journal records it (see :meth:`_delete`)."""
        with self._cond:
            size = self._published.pop(name)
            self._recovered.pop(name, None)
            self._deleting.add(name)
        self._delete(name, size, dropped=True)

    def _delete(self, name: str, size: int, dropped: bool = False) -> None:
        """Remove a published item's files, then release its space and the claim on its name.

        The item is first renamed aside into staging: one atomic call, so a crash leaves it
        either whole at its path (still journaled as published: reused or removed at the next
        open) or in staging (cleared at open), never half-deleted where recovery would take it
        for a broken item. Only then is a drop (``dropped``) journaled ("D"); an ack's "A" was
        written before (a crash in between deletes, never re-delivers). An item of at least
        :data:`REAP_MIN_BYTES` is then deleted by the reaper thread, which releases the space
        after (see :mod:`.removal`); a smaller one, or any while closing, is deleted here. If the
        rename fails the item is deleted in place. Files that cannot be deleted are logged and
        count as foreign bytes until the next open removes them; nothing is raised (the ack or
        the drop is already recorded).
        """
        with self._cond:
            self._seq += 1
            aside = f"{self._staging}/x{self._seq}"
        try:
            os.rename(f"{self._root}/{name}", aside)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.debug("could not move %s aside (%s): deleting it in place", name, exc)
            aside = ""
        left = 0
        try:
            if aside:
                self._remove_parents(name)
            else:
                self._remove_files(name)
        except OSError as exc:  # what is left stays journaled as published: the next open removes it
            left = tree_bytes(f"{self._root}/{name}")
            log.error("could not delete %s (%d bytes left, counted as foreign until the next open): %s", name, left, exc)
        with self._cond:
            self._claimed.discard(name)
            self._reaping += size
            if left:
                self._deleting.add(name)  # journaled as published until then
            elif dropped:
                self._deleting.discard(name)
                try:
                    self._append("D", name)
                except OSError as exc:  # the files are gone: a missing "D" only leaves a name recovery skips
                    log.warning("journal: could not record that %s was deleted (%s)", name, exc)
                self._compact_if_due()
            self._cond.notify_all()  # wakes claim()
        if aside and size >= REAP_MIN_BYTES and self._reaper.put(aside, size):
            return
        if aside:
            try:
                rmtree(aside)
            except OSError as exc:  # in staging: the next open clears it
                left = tree_bytes(aside)
                log.error("could not delete %s (%d bytes left, counted as foreign until the next open): %s", aside, left, exc)
        self._reaped(size, left)

    def _reaped(self, size: int, left: int) -> None:
        """An item's files are deleted: release its ``size``; ``left`` bytes could not be deleted
        and count as foreign (on disk, not ours to reuse) until the staging area is cleared."""
        with self._cond:
            self._reserved -= size
            self._reaping -= size
            self.foreign += left
            self._cond.notify_all()  # wakes reserve()

    def use_retention(self, policy: RetentionPolicy, names: Sequence[str], tick: int) -> None:
        """Keep acknowledged items by ``policy`` (its item ``i`` is ``names[i]``). Items recovered
        at open become retained items as of ``tick`` (or are dropped if the policy says so).

        ``names`` is searched with ``names.index(name)`` for each item fetched or acknowledged:
        a :class:`~cachepipe.catalog.Names` view does that by binary search, with no index of
        the whole catalog in memory."""
        self._policy, self._names = policy, names
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

    def acquire(self, item: Item, tick: int = 0, starving: Callable[[], bool] = lambda: False, extra: int = 0) -> Path | bool:
        """Make room for the step at ``tick`` reading ``item``.

        Returns the item's path if it is on disk already (recovered at open, or retained): hand
        it out, no download. True: its space is reserved (and its name claimed): download it.
        False: the cache closed meanwhile.

        Without retention this waits for any earlier copy of the item to be gone (:meth:`claim`)
        and for space (:meth:`reserve`). With it, the policy picks retained items to evict; when
        it prefers to wait for an ack instead, the wait is re-checked every 0.25 s against
        ``starving()`` (a consumer blocked on this very step), the one case of a timed wait here.
        ``extra``: bytes reserved beside the item's own (the ``prepare`` hook's output).
        """
        with self._cond:
            recovered = self._recovered.pop(item.name, None)
        if recovered is not None:
            return recovered
        policy = self._policy
        if policy is None:
            if not self.claim(item.name):
                return False
            try:
                while (leftover := self._leftover_in_the_way(item.size + extra)) is not None:
                    log.info("dropping %s, an earlier owner's item not due yet, to make room for %s", leftover, item.name)
                    self.drop(leftover)
                return self.reserve(item.size + extra, item.name)
            except BaseException:
                self.unreserve(0, item.name)  # the claim
                raise
        idx = self._number(item.name)
        if idx is None:
            raise KeyError(f"item {item.name!r} is not in the plan given to use_retention()")
        while True:
            victims: list[tuple[str, int]] = []
            with self._cond:
                while not victims:
                    if self._closed:
                        return False
                    if policy.is_pinned(idx):  # an earlier step's copy is still out: one copy at a time
                        self._cond.wait()
                        continue
                    if policy.on_fetch(idx, tick):
                        return self.item_path(item)  # retained: still reserved and claimed
                    free = self.capacity - self.foreign - self.overhead - self._reserved
                    if free >= item.size:
                        self._reserved += item.size
                        self._claimed.add(item.name)
                        policy.on_admit(idx, tick)
                        return True
                    if free + self._reaping >= item.size:  # victims being deleted make room: no more
                        self._cond.wait()
                        continue
                    chosen = policy.choose_victims(item.size - free - self._reaping, idx, tick, urgent=starving())
                    if chosen is None:
                        self._cond.wait(0.25)
                        continue
                    for victim in chosen:
                        name = self._names[victim]
                        victims.append((name, self._published.pop(name)))
                        self._deleting.add(name)
            for name, size in victims:
                self._delete(name, size, dropped=True)

    def _leftover_in_the_way(self, size: int) -> str | None:
        """A recovered item (reused from an earlier owner, not handed out yet) to drop so that
        ``size`` bytes can ever fit, or None. Recovered items are handed out only when the plan
        reaches them, after the step that waits for room: if the room that every other
        reservation will free is not enough, waiting would never end. The last recovered name
        goes first (names are recovered in sorted order: for a listing-ordered plan, the one
        needed last)."""
        with self._cond:
            if not self._recovered:
                return None
            held = sum(self._published[name] for name in self._recovered)
            if self.capacity - self.foreign - self.overhead - held >= size:
                return None
            return next(reversed(self._recovered))

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

    def _remove_files(self, name: str) -> None:
        rmtree(f"{self._root}/{name}")
        self._remove_parents(name)

    def _remove_parents(self, name: str) -> None:
        """Nested single-file items: drop the folders that publish made for ``name``, if now empty."""
        if "/" not in name:
            return
        parent = (self.root / name).parent
        with self._dirs:
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                        break
                    raise
                parent = parent.parent


def _matches(path: Path, item: Item) -> bool:
    """True when ``path`` holds exactly the item's files with the listed sizes."""
    try:
        if item.is_file:
            return path.is_file() and not path.is_symlink() and path.stat().st_size == item.size
        expected = {f.rel: f.size for f in item.files}
        found = {}
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                p = Path(dirpath, name)
                found[p.relative_to(path).as_posix()] = p.lstat().st_size
        return found == expected
    except OSError:
        return False
