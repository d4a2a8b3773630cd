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
from .grouping import tree_order
from .stores import Store
from .stores.base import FIRST_PAGE_KEYS, ObjectInfo, takes_start_after

__all__ = ["FIRST_PAGE_OBJECTS", "QUEUE_ITEMS", "StreamingListing", "empty_source", "list_source"]

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
            before (at or before the last one in the store's order, see :func:`_position`): an
            item is never admitted twice, even if a store's answer overlaps.
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
        self._stop = threading.Event()
        self._objects = 0
        self._resumes = takes_start_after(store)  # store.list(start_after=...) lists the keys after one
        self._in_key_order = True  # every key listed so far (by every listing) came after the one before it
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

    def take_many(self, count: int) -> list[Item]:
        """The next item, waiting for it, and those queued after it, up to ``count`` in all;
        empty at the end (or when stopped). Raises the listing's error in turn."""
        with self._cond:
            while not self._queue and not self.done and not self._stop.is_set():
                self._cond.wait()
            queue = self._queue
            if queue:
                self._cond.notify_all()  # room for the listing thread
                return [queue.popleft() for _ in range(min(count, len(queue)))]
            if self.error is not None:
                raise self.error
            return []

    # ---- the listing thread ------------------------------------------------------------
    def _run(self) -> None:
        last: tuple[str, str] | None = None  # positions of the last item listed (see _position): a restart skips up to it
        after: str | None = None  # the last key of the last item listed: a restart may list the keys after it
        admitted = 0  # objects in the items listed (files: a folder's marker or a loose object is in none)
        orders = [True, True]  # the items came in key order; folder by folder (as the store lists, on every listing)
        attempt = 0
        run: list[Item] = []  # listed, not admitted yet

        def admit_run() -> bool:
            """Admit and queue the run, taken out first (an error in its admission must not admit
            it again); False if stopped meanwhile."""
            nonlocal run, last, after, admitted
            admitting, run, last, after = run, [], _position(run[-1]), run[-1].files[-1].key
            admitted += sum(len(item.files) for item in admitting)
            return self._queue_run(admitting)

        try:
            while not self._stop.is_set():
                run = []
                skip = last  # a restarted listing skips what was admitted before (items come in order)
                previous: tuple[str, str] | None = None
                if after is not None and self._resumes and self._in_key_order:
                    # after the last item admitted (a folder listed in part is listed again from its
                    # first key), counting the first page from where the listing was
                    self._objects = admitted
                    objects = self._store.list(start_after=after)  # type: ignore[call-arg]  # takes_start_after said so
                else:
                    self._objects = 0  # a listing from the start counts its first page again
                    objects = self._store.list()
                try:
                    for item in group_items(self._count(objects), self._mode):
                        at = _position(item)
                        if previous is not None:  # which of the two orders the store lists in
                            orders = [ordered and a > b for ordered, a, b in zip(orders, at, previous, strict=True)]
                            if not any(orders):  # each listing in one order, but not all in the same
                                raise ValueError(
                                    f"{self._store.url}: listed in neither order across its listings (in key order "
                                    f"once, folder by folder another time): {at[0]!r} after {previous[0]!r}; "
                                    "what was listed before cannot be told from what was not"
                                )
                        previous = at
                        if skip is not None:
                            # listed before: at or before the last one in each order the store may list in
                            if all(a <= b for ordered, a, b in zip(orders, at, skip, strict=True) if ordered):
                                continue
                            skip = None
                        attempt = 0
                        run.append(item)
                        if len(run) < ADMIT_RUN and self._first_page and len(self._queue) >= ADMIT_AHEAD:
                            continue  # the producer has work queued: gather a run (not in the first page: open raises its errors)
                        if not admit_run():
                            return
                    if run and not admit_run():  # the last run
                        return
                except Exception as exc:
                    # listed before the error: theirs is the turn before it, and a restart skips them
                    if run and not admit_run():
                        return
                    if not is_transient(exc) or attempt >= self._retries or self._stop.is_set():
                        raise
                    delay = self._backoff(attempt)
                    attempt += 1
                    log.warning(
                        "listing %s failed, retry %d/%d in %.2fs: %s", self._store.url, attempt, self._retries, delay, exc
                    )
                    if self._stop.wait(delay):
                        return
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
        """``objects``, counted (the first page), and followed: whether each key came after the
        one before it (a restart lists after a key only while they all did)."""
        previous: str | None = None
        for obj in objects:
            yield obj
            key = obj.key
            if previous is not None and key <= previous:
                self._in_key_order = False
            previous = key
            self._objects += 1
            if self._objects >= FIRST_PAGE_OBJECTS and not self._first_page:
                with self._cond:
                    self._first_page = True
                    self._cond.notify_all()


def _position(item: Item) -> tuple[str, str]:
    """Where ``item`` stands in a listing in key order, and in one made folder by folder
    (:func:`~cachepipe.grouping.tree_order`). A folder's keys all start with ``name/``, so in key
    order folders come in the order of ``name + "/"``, not of their names: ``a-b/f`` is listed
    before ``a/f`` although ``"a" < "a-b"``; folder by folder, in the order of their names. A
    single-file item's name is its key."""
    key = item.name if item.is_file else f"{item.name}/"
    return key, tree_order(key)


def empty_source(source: str, items: str, objects: int, listed: int = 0) -> EmptySourceError:
    """The error of a listing of ``source`` that ended without an item to deliver, saying why:
    every one of the ``listed`` items was larger than the capacity, the prefix lists nothing
    (``objects`` 0: a wrong bucket or prefix), or its objects lie directly under it while
    ``items="folders"`` makes items of folders only."""
    what = f"no items under {source!r}: found no {items}"
    if listed:
        return EmptySourceError(f"{what} smaller than the capacity")
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


def list_source(
    store: Store,
    items: Literal["folders", "files"],
    retries: int = 12,
    backoff: float = 0.2,
    backoff_max: float = 10.0,
    source: str = "",
    stop: threading.Event | None = None,
) -> Catalog:
    """List ``store`` into a catalog, retrying transient store errors as downloads are (the whole
    listing again: a catalog is built in one pass). ``source`` names it in the log. ``stop``: once
    set (a pipeline closing while it opens), an error is not retried and a backoff ends at once.

    Raises:
        EmptySourceError: no items (:func:`empty_source` says why).
        OSError, UnsafeKeyError, ...: a permanent error, or a transient one after ``retries``
            (or once ``stop`` is set).
    """
    stop = stop or threading.Event()
    for attempt in range(retries + 1):
        objects = _Counted(store.list())
        try:
            catalog = Catalog.from_listing(objects, items)
        except Exception as exc:
            if not is_transient(exc) or attempt == retries or stop.is_set():
                raise
            delay = backoff_delay(attempt, backoff, backoff_max)
            log.warning("listing %s failed, retry %d/%d in %.2fs: %s", source or store.url, attempt + 1, retries, delay, exc)
            if stop.wait(delay):  # a backoff in the opening thread; Ctrl-C interrupts it, and so does a close
                raise
        else:
            if not catalog:
                raise empty_source(source or store.url, items, objects.n)
            return catalog
    raise AssertionError("unreachable")


class _Counted:
    """The objects of a listing, counted as they pass (``n``)."""

    def __init__(self, objects: Iterable[ObjectInfo]) -> None:
        self._objects, self.n = objects, 0

    def __iter__(self) -> Iterator[ObjectInfo]:
        for obj in self._objects:
            self.n += 1
            yield obj
