"""Listing a store into items: whole, with retries, or streamed while the first ones download.

- :func:`list_source`: list a store into a catalog, retrying transient errors (the one listing
  with retries, for a pipeline and for ``cachepipe index``);
- :func:`empty_source`: the error of a listing that found nothing to deliver, saying why (for
  a listing that streams, :func:`list_source` and ``cachepipe index``);
- :class:`StreamingListing`: a listing that streams: items are listed by a thread while the
  first ones download.

:class:`StreamingListing` is used by :class:`~cachepipe.pipeline.Pipeline` for a plain pass (one
epoch, listing order, one rank and worker, nothing to resume): the first download waits for the
first page of the listing, not for the whole of it, and the catalog is never held in memory as a
whole: listed items wait in a queue of at most :data:`QUEUE_ITEMS` until the producer takes
them, and the listing pauses while the queue is full. While the producer has
:data:`ADMIT_AHEAD` items queued, the listing admits the items it lists in runs (one round of
the cache's lock and of the queue's for a run, not for each item).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Literal

from .backoff import backoff_delay
from .catalog import Catalog, Item, group_items
from .errors import EmptySourceError, is_transient
from .grouping import _Loose, tree_order
from .keys import _TreeCheck
from .stores import Store
from .stores.base import FIRST_PAGE_KEYS, ObjectInfo, takes_start_after

__all__ = ["FIRST_PAGE_OBJECTS", "QUEUE_ITEMS", "StreamingListing", "empty_source", "list_source", "resumed_listing"]

log = logging.getLogger("cachepipe")

FIRST_PAGE_OBJECTS = FIRST_PAGE_KEYS
"""Objects in a first listing page (what the S3 and OBS stores ask for first, 100):
:meth:`StreamingListing.wait_first_page` returns once this many objects are listed, or the
listing ended."""

QUEUE_ITEMS = 10_000
"""Most listed items waiting for the producer (a few MB): the listing pauses beyond it."""

ADMIT_RUN, ADMIT_AHEAD = 64, 64
"""While at least ``ADMIT_AHEAD`` items wait for the producer (a run of its own: it takes up to
64 at a time), the listing admits the items it lists in runs of up to ``ADMIT_RUN`` (one round
of the cache's lock and of the queue's for a run); with fewer waiting, each item at once. A run
being gathered when the listing waits for its store's next page waits with it: at most
``ADMIT_RUN - 1`` items, listed while the producer had ``ADMIT_AHEAD`` queued (the producer
waits for them only if it starts all of those before the page comes). With 1,024 the listing
of tiny items on a quick source stayed, in some runs, at one item per admission from start to
end (the producer took each as it came, and the queue never grew to 1,024): twice the listing's
CPU per item (benchmarks/README.md, 2026-11-30). The first page's items are admitted each at once, so
that an error about one of them is raised by the open (:meth:`StreamingListing.wait_first_page`)."""


class StreamingListing:
    """List ``store`` into items in a thread; hand them out in order with :meth:`take`.

    Args:
        store: the source.
        mode: ``"folders"`` or ``"files"`` (see :func:`~cachepipe.catalog.group_items`).
        admit: called in the listing thread with a run of items (one or more, in order):
            returns whether to queue (True) or skip (False) each of its first ones (at least
            one), or raises about the first item to stop the listing with that error (it
            reaches the consumer in the item's turn). The rest of the run is given again.
        complete: called in the listing thread when the whole source is listed.
        retries, backoff: a transient listing error restarts the listing after
            ``backoff(attempt)`` seconds, up to ``retries`` times in a row (counted again once
            an item is listed). A restarted listing continues after the last key of the last
            item admitted (``store.list(start_after=...)``, see
            :meth:`Store.list <cachepipe.stores.base.Store.list>`), where the store takes it and
            every key so far came in key order (S3, OBS); else it lists from the start again
            (a store listing folder by folder: SeaweedFS). Either way it skips the items listed
            before (at or before the last one in the store's order, see :class:`_Restart`): an
            item is never admitted twice, even if a store's answer overlaps. In ``"files"``
            mode, a listing continued after a key checks its keys against those listed before
            (a file ``a`` listed before the cut, ``a/b`` after it: unsafe, as in one listing); in
            ``"folders"`` mode, the warning that counts the objects beside the folders counts
            those listed before the cut, as one listing's does.
    """

    def __init__(
        self,
        store: Store,
        mode: Literal["folders", "files"],
        admit: Callable[[list[Item]], list[bool]],
        complete: Callable[[], None],
        retries: int,
        backoff: Callable[[int], float],
    ) -> None:
        self._store, self._mode, self._admit, self._complete = store, mode, admit, complete
        self._retries, self._backoff = retries, backoff
        self._cond = threading.Condition()
        self._queue: deque[Item] = deque()
        self._takes = 0  # calls of take_many that took items (see upcoming)
        self._taken_first: Item | None = None  # the first item the latest of them took
        self._stop = threading.Event()
        self._objects = 0
        self._first_page = False
        self.listed = 0  # items listed (admitted or skipped)
        self.listed_bytes = 0
        self.done = False  # the listing ended (completely, or with ``error``)
        self.error: BaseException | None = None
        self._early_error = False  # the error came within the first page
        self._thread = threading.Thread(target=self._run, name="cachepipe-listing", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def interrupt(self) -> None:
        """Stop listing without waiting: no more pages are asked for, no backoff is slept, and an
        error met from now on (a page request the store's ``abort`` cut) is not retried."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def stop(self) -> None:
        """Stop listing and join the thread: a page request in flight completes first, unless
        the store was aborted after :meth:`interrupt` (see :meth:`Pipeline.close`)."""
        self.interrupt()
        if self._thread.ident is not None:
            self._thread.join()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    # ---- consumer side ---------------------------------------------------------------
    def wait_first_page(self) -> None:
        """Block until the first page is listed (or the listing ended); raise a listing error
        met within it (a later one reaches :meth:`take` in its turn)."""
        with self._cond:
            while not (self._first_page or self.done):
                self._cond.wait()
            if self.error is not None and self._early_error:
                raise self.error

    def take(self) -> Item | None:
        """The next item; None at the end (or when stopped). Raises the listing's error in turn."""
        got = self.take_many(1)
        return got[0] if got else None

    def upcoming(self) -> Callable[[], Item | None]:
        """A reader, made when the planner has planned every item it took, of the first item it
        takes next: the queue's head until the next :meth:`take_many` that takes items (None
        while none is queued), then the first item that took. Read from another thread (a
        streamed listing's state budget, :meth:`Cache.expect <cachepipe.cache.Cache.expect>`),
        it stays the planner's next item across the take, until the planner says so itself."""
        with self._cond:
            takes = self._takes

        def read() -> Item | None:
            with self._cond:
                if self._takes == takes:
                    return self._queue[0] if self._queue else None
                return self._taken_first if self._takes == takes + 1 else None

        return read

    def take_many(self, count: int) -> list[Item]:
        """The next item, waiting for it, and those queued after it, up to ``count`` in all;
        empty at the end (or when stopped). Raises the listing's error in turn."""
        with self._cond:
            while not self._queue and not self.done and not self._stop.is_set():
                self._cond.wait()
            queue = self._queue
            if queue:
                self._cond.notify_all()  # room for the listing thread
                self._takes, self._taken_first = self._takes + 1, queue[0]
                return [queue.popleft() for _ in range(min(count, len(queue)))]
            if self.error is not None:
                raise self.error
            return []

    # ---- the listing thread ------------------------------------------------------------
    def _run(self) -> None:
        restart = _Restart(self._store, self._mode)  # where a restart lists again, and what it skips
        seen = _TreeCheck()  # files: the keys listed, against which a listing continued after a key checks its own
        loose = _Loose()  # folders: the objects beside the folders, counted across a listing continued after a key
        admitted = 0  # objects in the items listed (files: a folder's marker or a loose object is in none)
        attempt = 0
        run: list[Item] = []  # listed, not admitted yet

        def admit_run() -> bool:
            """Admit and queue the run, taken out first (an error in its admission must not admit
            it again); False if stopped meanwhile."""
            nonlocal run, admitted
            admitting, run = run, []
            restart.listed(admitting[-1].files[-1].key)
            admitted += sum(len(item.files) for item in admitting)
            return self._queue_run(admitting)

        try:
            while not self._stop.is_set():
                run = []
                objects = restart.listing()
                # after a key, the first page counted from where the listing was; from the start, again
                self._objects = admitted if restart.after_key else 0
                if restart.after_key:
                    loose.continued(restart.after)
                else:  # a listing from the start sees every key again
                    seen, loose = _TreeCheck(), _Loose()
                try:
                    for item in group_items(self._count(objects), self._mode, seen, loose):
                        if restart.before(_unit(item.files[0].key, self._mode)):
                            continue
                        attempt = 0
                        run.append(item)
                        if len(run) < ADMIT_RUN and self._first_page and len(self._queue) >= ADMIT_AHEAD:
                            continue  # the producer has work queued: gather a run (not in the first page: open raises its errors)
                        if not admit_run():
                            return
                    if run and not admit_run():  # the last run
                        return
                except Exception as exc:  # noqa: BLE001 - _backoff raises it unless it is retried
                    # listed before the error: theirs is the turn before it, and a restart skips them
                    if run and not admit_run():
                        return
                    if _backoff(exc, attempt, self._retries, self._backoff(attempt), self._stop, self._store.url):
                        return
                    attempt += 1
                    continue
                self._finish()
                return
        except BaseException as exc:  # noqa: BLE001 - stored and raised again to the consumer
            with self._cond:
                self.error, self._early_error = exc, not self._first_page
        finally:
            with self._cond:
                self.done = True
                self._cond.notify_all()

    def _finish(self) -> None:
        """Run ``complete`` once the source is listed whole. Its error (the plan's journaling) is
        no listing's, which is not done again for it. Before the first page was handed (the open
        waits for it) it is raised there, as an open raises a full disk at once; after, a
        transient one (a full disk another writer may empty) is tried again after a backoff, up
        to the listing's ``retries``, as a download's local disk error is; then raised (the pass
        fails with it)."""
        attempt = 0
        while True:
            try:
                self._complete()
                return
            except Exception as exc:
                if not self._first_page or not is_transient(exc) or attempt >= self._retries or self._stop.is_set():
                    raise
                delay = self._backoff(attempt)
                attempt += 1
                log.warning(
                    "listing %s: listed whole, but its plan could not be recorded, retry %d/%d in %.2fs: %s",
                    self._store.url,
                    attempt,
                    self._retries,
                    delay,
                    exc,
                )
                if self._stop.wait(delay):
                    return

    def _queue_run(self, run: list[Item]) -> bool:
        """Admit ``run`` and queue the items kept, pausing while the queue is full; False if
        stopped meanwhile."""
        while run:
            keeps = self._admit(run)
            done, run = run[: len(keeps)], run[len(keeps) :]
            with self._cond:
                self.listed += len(done)
                self.listed_bytes += sum(item.size for item in done)
                self._queue.extend(item for item, keep in zip(done, keeps, strict=True) if keep)
                self._cond.notify_all()
                while len(self._queue) >= QUEUE_ITEMS and not self._stop.is_set():
                    self._cond.wait()
            if self._stop.is_set():
                return False
        return True

    @property
    def objects(self) -> int:
        """Objects the listing has read so far, in items or not: since its last restart from the
        start; a restart after a key counts from the objects of the items listed before it."""
        return self._objects

    def _count(self, objects: Iterator[ObjectInfo]) -> Iterator[ObjectInfo]:
        """``objects``, counted (the first page)."""
        for obj in objects:
            yield obj
            self._objects += 1
            if self._objects >= FIRST_PAGE_OBJECTS and not self._first_page:
                with self._cond:
                    self._first_page = True
                    self._cond.notify_all()


def _unit(key: str, mode: Literal["folders", "files"]) -> str:
    """The unit of a listing that ``key`` belongs to, which a restart lists whole or not at all:
    its item's (``name/`` for a folder's key, a single-file item's key itself); a key directly
    under the prefix in ``"folders"`` mode (in no item) is a unit of its own."""
    if mode == "files":
        return key
    cut = key.find("/")
    return key if cut < 0 else key[: cut + 1]


class _Restart:
    """Where a listing that a transient error cut lists again, and what it skips there: the rule
    of every listing with retries (:class:`StreamingListing`'s of items, and
    :func:`resumed_listing`'s of objects, for whole listings).

    A listing is taken by units (see :func:`_unit`: an item's objects): :meth:`listed` notes the
    last key of each unit taken whole. Listed again (:meth:`listing`), the store lists after that
    key where it takes ``start_after`` and every key it listed so far came in key order (S3,
    OBS); else from its start (a store listing folder by folder, SeaweedFS, whose answer to
    ``StartAfter`` follows its own order). Either way :meth:`before` tells the units at or before
    the last one taken, in each order the store may list in (key order; folder by folder, see
    :func:`~cachepipe.grouping.tree_order`): taken already, never twice, even where a store's
    answer overlaps. A unit read in part when the listing failed was not taken: it is listed
    again from its first key.

    ``start_after``: a key before every key wanted in both orders, and no folder of theirs (see
    :mod:`cachepipe.map.dstrange`): a listing that would list from the start lists after it where
    the store takes ``start_after``, whatever order the store lists in (the keys passed over are
    none of those wanted, in either store's reading of it); ``""`` (before every key): a whole
    listing, which asks full pages from its first request (see
    :func:`~cachepipe.stores.base.first_page_keys`).
    """

    def __init__(self, store: Store, mode: Literal["folders", "files"], start_after: str | None = None) -> None:
        self._store, self._mode, self._floor = store, mode, start_after
        self._takes = takes_start_after(store)  # store.list(start_after=...) lists the keys after one
        self._in_key_order = True  # every key listed so far (by every listing) came after the one before it
        self._by_key = self._by_tree = True  # the units came in key order; folder by folder (on every listing)
        self._after: str | None = None  # the last key of the last unit taken
        self.after = ""  # the key this listing lists after, where after_key
        self._skip: tuple[str, str] | None = None  # this listing skips up to this unit, in both orders
        self._previous: tuple[str, str] | None = None  # the unit before, in this listing: in both orders
        self.after_key = False  # this listing lists after the key of the last unit taken

    def listing(self) -> Iterator[ObjectInfo]:
        """The store's objects, listed (again): after the last key taken, or from the start."""
        after, self._previous, self._skip = self._after, None, None
        if after is not None:
            unit = _unit(after, self._mode)
            self._skip = (unit, tree_order(unit))
        self.after_key = after is not None and self._takes and self._in_key_order
        if after is not None and self.after_key:
            self.after = after
            return self._follow(self._store.list(start_after=after))  # type: ignore[call-arg]  # takes_start_after said so
        if self._floor is not None and self._takes:
            return self._follow(self._store.list(start_after=self._floor))  # type: ignore[call-arg]
        return self._follow(self._store.list())

    def _follow(self, objects: Iterable[ObjectInfo]) -> Iterator[ObjectInfo]:
        """``objects``, followed: whether each key came after the one before it."""
        previous: str | None = None
        for obj in objects:
            key = obj.key
            if previous is not None and key <= previous:
                self._in_key_order = False
            previous = key
            yield obj

    def before(self, unit: str) -> bool:
        """Whether ``unit`` (see :func:`_unit`), come next in this listing, was taken before it: at
        or before the last one taken, in each order the store may list in. Called once a unit.

        Raises:
            ValueError: the store listed in key order once and folder by folder another time:
                what was listed before cannot be told from what was not.
        """
        by_key, by_tree = self._by_key, self._by_tree
        tree = tree_order(unit) if by_tree else ""  # followed only while the store may list folder by folder
        previous, self._previous = self._previous, (unit, tree)
        if previous is not None:  # which of the two orders the store lists in
            by_key, by_tree = by_key and unit > previous[0], by_tree and tree > previous[1]
            if not (by_key or by_tree):  # each listing in one order, but not all in the same
                raise ValueError(
                    f"{self._store.url}: listed in neither order across its listings (in key order "
                    f"once, folder by folder another time): {unit!r} after {previous[0]!r}; "
                    "what was listed before cannot be told from what was not"
                )
            self._by_key, self._by_tree = by_key, by_tree
        skip = self._skip
        if skip is not None:
            if (not by_key or unit <= skip[0]) and (not by_tree or tree <= skip[1]):
                return True
            self._skip = None
        return False

    def listed(self, key: str) -> None:
        """The unit whose last key is ``key`` is taken whole: a restart lists after it."""
        self._after = key


def _backoff(exc: Exception, attempt: int, retries: int, delay: float, stop: threading.Event, url: str) -> bool:
    """After a listing's error ``exc`` at its ``attempt`` (counted from 0): raise it if it is not
    transient, the ``retries`` are spent or ``stop`` is set; else log and wait ``delay`` seconds
    (on ``stop``): whether ``stop`` was set meanwhile."""
    if not is_transient(exc) or attempt >= retries or stop.is_set():
        raise exc
    log.warning("listing %s failed, retry %d/%d in %.2fs: %s", url, attempt + 1, retries, delay, exc)
    return stop.wait(delay)


def resumed_listing(
    store: Store,
    mode: Literal["folders", "files"],
    retries: int,
    backoff: Callable[[int], float],
    stop: threading.Event,
    url: str = "",
    start_after: str | None = None,
) -> Iterator[ObjectInfo]:
    """``store``'s objects as one listing gives them, through transient errors: a listing cut by
    one lists again after the last key of the last item (see :func:`_unit`) read whole, or from
    the start (:class:`_Restart` says which, and what it skips), after ``backoff(attempt)``
    seconds, up to ``retries`` times in a row (counted again once an item is read). The objects
    of a folder are yielded once it is read whole (the next one started, or the listing ended):
    those of a folder read in part when the listing failed are listed again, not yielded twice.
    For a whole listing (:func:`list_source`, ``cachepipe map``'s): its pages are not asked again,
    and it asks full pages from its first request (no first item waits on it: it lists after
    ``""``, see :func:`~cachepipe.stores.base.first_page_keys`, where the store takes
    ``start_after``). ``start_after``: as :class:`_Restart`'s (a rank's listing of DST: only the
    part where its items' keys can be, :mod:`cachepipe.map.dstrange`); None: every key.

    Raises:
        the error of the store, if not transient, after ``retries``, or once ``stop`` is set (it
        ends a backoff at once); ValueError as :meth:`_Restart.before`.
    """
    restart, files = _Restart(store, mode, "" if start_after is None else start_after), mode == "files"
    attempt = 0
    while True:
        held: list[ObjectInfo] = []  # the objects of the unit being read
        unit: str | None = None
        skipping = False
        try:
            for obj in restart.listing():
                key = obj.key
                at = key if files else _unit(key, mode)
                if at != unit:
                    if held:  # the folder before is read whole
                        yield from held
                        restart.listed(held[-1].key)
                        held, attempt = [], 0
                    unit, skipping = at, restart.before(at)
                if skipping:
                    continue
                if at == key and not key.endswith("/"):  # a unit of one object (a file item, a loose one): whole
                    yield obj
                    restart.listed(key)
                    attempt = 0
                else:
                    held.append(obj)
        except Exception as exc:
            if _backoff(exc, attempt, retries, backoff(attempt), stop, url or store.url):
                raise
            attempt += 1
            continue
        yield from held
        return


def empty_source(source: str, items: str, objects: int, listed: int = 0, store: object = None) -> EmptySourceError:
    """The error of a listing of ``source`` that ended without an item to deliver, saying why:
    every one of the ``listed`` items was larger than the capacity, the prefix lists nothing
    (``objects`` 0: a wrong bucket or prefix, or a URL that names one object, asked of ``store``
    where it can tell, ``names_object``), or its objects lie directly under it while
    ``items="folders"`` makes items of folders only."""
    what = f"no items under {source!r}: found no {items}"
    if listed:
        return EmptySourceError(f"{what} smaller than the capacity")
    if not objects and _names_object(store):
        parent = source.rstrip("/").rsplit("/", 1)[0] + "/"
        return EmptySourceError(
            f"no items under {source!r}: it names one object, not a prefix; a source is the prefix (folder) its "
            f"items lie under, such as {parent!r} (with items='files' each object under it is an item)"
        )
    if not objects:
        return EmptySourceError(
            f"{what} with objects: the source lists no objects; check the bucket and the prefix (keys are case-sensitive)"
        )
    return EmptySourceError(
        f"{what} with objects: the {objects} object{'s' if objects > 1 else ''} it lists {'lie' if objects > 1 else 'lies'} "
        "directly under it, none in a folder; "
        "items='folders' (the default) makes an item of each folder below the prefix: pass items='files' for an item "
        "per object, or give the prefix above their folder"
    )


def _names_object(store: object) -> bool:
    """Whether ``store``'s URL names one object (a file) rather than a prefix: a hint for an
    empty listing, one request; False where the store cannot tell, or the request fails."""
    ask = getattr(store, "names_object", None)
    if ask is None:
        return False
    try:
        return bool(ask())
    except Exception:  # noqa: BLE001 - only a hint: the error says what it says without it
        return False


def list_source(
    store: Store,
    items: Literal["folders", "files"],
    retries: int = 12,
    backoff: float = 0.2,
    backoff_max: float = 10.0,
    source: str = "",
    stop: threading.Event | None = None,
) -> Catalog:
    """List ``store`` into a catalog, retrying transient store errors as downloads are: a listing
    cut by one continues after the last item it read whole (see :func:`resumed_listing`), up to
    ``retries`` times in a row. ``source`` names it in the log. ``stop``: once set (a pipeline
    closing while it opens), an error is not retried and a backoff ends at once.

    Raises:
        EmptySourceError: no items (:func:`empty_source` says why).
        OSError, UnsafeKeyError, ...: a permanent error, or a transient one after ``retries``
            (or once ``stop`` is set).
    """
    objects = _Counted(
        resumed_listing(
            store, items, retries, lambda attempt: backoff_delay(attempt, backoff, backoff_max), stop or threading.Event(), source
        )
    )
    catalog = Catalog.from_listing(objects, items)
    if not catalog:
        raise empty_source(source or store.url, items, objects.n, store=store)
    return catalog


class _Counted:
    """The objects of a listing, counted as they pass (``n``)."""

    def __init__(self, objects: Iterable[ObjectInfo]) -> None:
        self._objects, self.n = objects, 0

    def __iter__(self) -> Iterator[ObjectInfo]:
        for obj in self._objects:
            self.n += 1
            yield obj
