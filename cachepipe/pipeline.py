"""``Pipeline``: the in-process front-end over the core (store, catalog, cache, fetcher, broker).

Its lifecycle (unopened, open, closed: :meth:`Pipeline.open`, :meth:`Pipeline.close`), the
consumer's side (``for item in pipe``, :meth:`Pipeline.get`, :meth:`Pipeline.ack`, leases) and
the checkpoint (:meth:`Pipeline.state_dict`). The pass it reads (catalog, plan, fetch order,
resume point) is :mod:`cachepipe.passes`, the core's parts started at open and stopped at close
:mod:`cachepipe.lifecycle`, the consumer's side below its public methods :mod:`cachepipe.handout`
(all three base classes of :class:`Pipeline`, whose attributes they declare), and what it hands
out :mod:`cachepipe.delivered`.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from .broker import Broker
from .cache import Cache
from .config import PipelineConfig, Share, check_cache_dir, check_option_names, check_source, parse_capacity, small_capacity
from .delivered import CachedItem, Skipped, Stats
from .errors import ConfigError, UnknownItemError
from .handout import CACHE_CHECK_SECONDS, _Handout
from .lifecycle import _CLOSED, _OPEN, _UNOPENED
from .passes import PLAN_RUN
from .stores import Store, open_store
from .stores.base import abort_store, scoped_store

# PLAN_RUN and CACHE_CHECK_SECONDS: importable from here, as before
__all__ = ["CACHE_CHECK_SECONDS", "PLAN_RUN", "CachedItem", "Pipeline", "Skipped", "Stats"]

log = logging.getLogger("cachepipe")


class Pipeline(_Handout):
    """Stream the items under ``source`` through a size-capped cache at ``cache_dir``.

    ``for path in pipe`` yields :class:`CachedItem` paths; with ``auto_ack=True`` (default) each is
    evicted when the loop asks for the next. Use it as a context manager so that an exception or a
    ``break`` stops the downloads at once.

    Args:
        source: dataset URL (see :class:`~cachepipe.config.PipelineConfig`).
        cache_dir: cache directory, owned exclusively while open.
        capacity: hard cap on bytes under ``cache_dir``: an int, ``"50GiB"``, ``"1.5GB"``,
            ``"512M"``, ``"1g"``, ``"80%"`` of free space, or a :class:`~cachepipe.config.Share`.
        store: a :class:`~cachepipe.stores.Store` to use instead of opening ``source``
            (for tests and custom backends). It stays yours: the pipeline reads through a view
            of it (its ``scoped()``, which cachepipe's backends have: connections of its own),
            which it aborts and closes when it closes; the store itself serves other pipelines,
            one after another or at once, and you close it. A store without ``scoped()`` is used
            as it is, never aborted nor closed by the pipeline (its requests in flight are
            waited for at close).
        **options: every other field of :class:`~cachepipe.config.PipelineConfig`.

    Raises:
        ValueError: a malformed option (pydantic's ``ValidationError`` names the field, the value
            and what is accepted), an empty ``cache_dir``, a ``source`` with no scheme that is
            not an existing local path, a keyword that is no option (naming the one it
            resembles; :class:`~cachepipe.ConfigError`).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        cache_dir: str | os.PathLike[str],
        capacity: int | str | Share,
        *,
        store: Store | None = None,
        **options: Any,
    ) -> None:
        check_option_names(options)
        self.config = PipelineConfig(source=source, cache_dir=Path(check_cache_dir(cache_dir)), capacity=capacity, **options)
        if store is None:
            check_source(self.config.source)
        elif self.config.download_processes:
            raise ConfigError(
                f"download_processes={self.config.download_processes} with store={store!r}: worker processes open the "
                "source from its URL and storage_options, a store object cannot be shared with them; pass no store, "
                "or download_processes=0"
            )
        small = small_capacity(capacity, self.config.capacity)
        if small is not None:
            log.warning("%s", small)
        self._given_store = store  # None: opened from ``source`` by open()
        self._owns_store = True  # open() opened the store it uses (or a view of the one given): its to abort and close
        self._pid = os.getpid()
        self._handed: dict[str, CachedItem] = {}  # name -> the object last handed out, until ack or release
        self._state = _UNOPENED
        self._lock = threading.Lock()
        self._closing = threading.Event()  # close() was called: an open() under way stops listing and raises
        self._abort_lock = threading.Lock()  # _opening, between open() and a close() from another thread
        self._opening: Store | None = None  # the store while open() runs (a close meanwhile aborts it)
        self._inflight = {}  # seq -> what a hand-out needs of its item, from planning until consumed
        self._listing = None
        self._counts = {"handed": 0, "acked": 0, "released": 0, "skipped": 0}
        self._counts_lock = threading.Lock()  # not _lock: open() holds that while the listing thread counts
        self._bar = None
        self._resumed_complete = False  # opened at the end of a finite plan (resume, or a state loaded)
        self._start_state = None
        self._catalog_digest = None  # of the whole catalog the plan was made from (None: streamed)
        self._plan_lock = threading.Lock()  # the frontier: issued by the producer, consumed by consumers
        self._cache_checked = 0.0  # monotonic time of the last check_cache by get_many
        self._open_error: BaseException | None = None  # what open() raised: this pipeline has no position

    def __repr__(self) -> str:
        return f"Pipeline({self.config.source!r}, cache_dir={str(self.config.cache_dir)!r}, state={self._state})"

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> Pipeline:
        """List the source, take the cache, start downloading. Called by ``with`` and ``iter``.

        Raises:
            RuntimeError: the pipeline is already open or closed, or :meth:`close` was called from
                another thread while it opened (the listing's requests in flight are aborted; the
                error it cut is chained).
            CacheLockedError: another pipeline owns ``cache_dir``, or a cache directory inside
                it or around it (naming both).
            EmptySourceError: nothing to deliver under ``source``.
            OversizeError: an item is larger than the capacity (``on_oversize="raise"``).
            UnsafeKeyError: an object key cannot be mapped safely into the cache
                (``on_error="raise"``; with ``"skip"``, its item is skipped in its turn).
            OSError: ``cache_dir`` cannot be created or written; or its disk is full (``ENOSPC``,
                ``EDQUOT``), at once, naming the disk, what holds it and what to do (a running
                pipeline waits for room for its items instead; ``cachepipe serve`` waits to open).
        """
        with self._lock:
            if self._state != _UNOPENED:
                raise RuntimeError(f"{self!r} cannot be opened again: create a new Pipeline")
            self._state = _CLOSED  # until it is open: a failed open cannot be retried on this object
            cfg = self.config
            given = self._given_store
            if given is None:
                store = open_store(cfg.source, cfg.storage_options)
            else:  # whoever opens a store closes it: the view of a given store is this pipeline's, the store its owner's
                view = scoped_store(given)
                store = given if view is None else view
            self._owns_store = store is not given
            with self._abort_lock:
                self._opening = store if self._owns_store else None
            cache = Cache(cfg.cache_dir, cfg.capacity)
            broker: Broker[str] = Broker(ordered=cfg.ordered, lease_timeout=cfg.lease_timeout)
            try:
                self._start(store, cache, broker)
            except BaseException as exc:
                with self._abort_lock:
                    self._opening = None
                if self._bar is not None:
                    self._bar.close()
                if self._owns_store:
                    store.close()
                self._open_error = exc
                if self._closing.is_set() and isinstance(exc, Exception) and not isinstance(exc, RuntimeError):
                    self._open_error = RuntimeError(f"{self!r} was closed while it opened")
                    raise self._open_error from exc
                raise
            log.info(
                "opened %s: %s, capacity %d bytes%s",
                cfg.source,
                "listing while downloading" if self._listing else f"{self._listed} items, {self._listed_bytes} bytes",
                cache.capacity,
                self._share_text(),
            )
            if self._resumed_complete:
                loaded = self._start_state is not None
                log.warning(
                    "%s: the pass resumed is complete (%s): nothing to hand out; %s reads it again",
                    cfg.source,
                    "from the state loaded" if loaded else f"as recorded in {cache.root}",
                    "a pipeline without that state" if loaded else "resume=False",
                )
        return self

    @property
    def catalog_digest(self) -> str | None:
        """The digest of the catalog this pipeline planned from (a manifest's, or its listing's);
        None before :meth:`open`, or while a streamed listing is under way."""
        return self._catalog_digest

    def set_capacity(self, capacity: int | str | Share) -> None:
        """Change the capacity of an open pipeline, effective at once (see :meth:`Cache.set_capacity`).

        Lowering it below the bytes in the cache deletes nothing (a warning says so): downloads
        wait until acknowledgements bring the cache under it.

        Raises:
            ValueError: a malformed capacity, or one that leaves no room beside the files in
                ``cache_dir`` that are not items and cachepipe's state, or (``on_oversize="raise"``)
                less than the largest item planned: every such item still to come would fail,
                even if the capacity were raised again a moment later.
        """
        self._require_open()
        value = parse_capacity(capacity)
        small = small_capacity(capacity, value)
        if small is not None:
            log.warning("%s", small)
        largest, listed = self._largest_planned() if self.config.on_oversize == "raise" else (0, 0)
        new = self._cache.set_capacity(value, at_least=largest, listed=listed)
        self.config = self.config.model_copy(update={"capacity": value})
        log.info("capacity of %s set to %s", self.config.source, capacity)
        if (used := self._cache.used) > new:
            log.warning(
                "capacity of %s lowered to %d bytes, below the %d bytes in the cache now: nothing is deleted for it; "
                "downloads wait until acknowledgements bring the cache under it",
                self.config.source,
                new,
                used,
            )

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: the plan's configuration and its first unconsumed step (JSON-able),
        and ``catalog_digest``, the digest of the catalog the plan was made from (absent while
        a streamed listing is under way).

        Save it with a training checkpoint; pass it to :meth:`load_state_dict` of a new pipeline
        with the same settings to continue from there.

        Raises:
            RuntimeError: the pipeline is not opened yet, or its :meth:`open` failed (naming that
                error, chained): nothing was consumed, so a new pipeline starts where this one
                was to start (from the state loaded into it, if any).
        """
        self._require_open(allow_closed=True)
        if self._open_error is not None:
            error = self._open_error
            raise RuntimeError(
                f"{self!r} has no position to save: its open() failed ({type(error).__name__}: {error}); nothing was "
                "consumed, so a new Pipeline starts where this one was to (from the state loaded into it, if any)"
            ) from error
        with self._plan_lock:
            state = self._frontier.state_dict()
        if self._catalog_digest is not None:
            state["catalog_digest"] = self._catalog_digest
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start at the position in ``state`` (from :meth:`state_dict`). Call before :meth:`open`.

        Raises:
            RuntimeError: the pipeline is already open.
            ValueError: at open, if ``state`` was saved with different settings or data (a
                different ``catalog_digest``: :class:`~cachepipe.ConfigError` naming both).
        """
        if self._state != _UNOPENED:
            raise RuntimeError("load_state_dict() must be called before the pipeline is opened")
        self._start_state = dict(state)

    def close(self) -> None:
        """Stop every thread, remove staging files and (unless ``keep_on_close``) published items.

        Idempotent. Consumers blocked in the iterator stop; further use raises ``RuntimeError``.
        Items still handed out are deleted too (unless ``keep_on_close``): their
        :class:`CachedItem` objects raise ``FileNotFoundError`` from then on.

        Prompt: the store's requests in flight are aborted (its ``abort()``, where the backend
        can: see :mod:`cachepipe.stores.base`) before the threads are joined, so a download or a
        listing page blocked on a store that stopped answering ends at once; what it staged is
        removed. A store given as ``store=`` is not closed, nor aborted: only this pipeline's
        view of it (its requests), if the store has ``scoped()``. Called from another thread
        while :meth:`open` lists, it aborts that listing, and ``open`` raises ``RuntimeError``.
        """
        self._closing.set()
        with self._abort_lock:
            opening = self._opening
        if opening is not None:
            abort_store(opening)  # open() runs in another thread, holding the lock: it fails at once
        with self._lock:
            state, self._state = self._state, _CLOSED
        if state != _OPEN:
            return
        if os.getpid() != self._pid:
            return  # a forked copy: the threads, the lock and the files are the parent's to close
        self._stop()
        log.info("closed %s", self.config.source)

    def __enter__(self) -> Pipeline:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- consuming -------------------------------------------------------------------
    def __iter__(self) -> Iterator[CachedItem]:
        """Yield items until all are delivered. Opens the pipeline if needed, and then closes it
        when the loop ends (prefer ``with`` so that ``break`` and errors close it at once).

        Raises:
            RuntimeError: the pipeline is closed (a loop that opened it closed it when it ended,
                by a ``break`` too: iterate inside ``with`` to loop again). Closed from another
                thread while the loop runs, the loop ends.
        """
        owner = self._state == _UNOPENED
        if owner:
            self.open()
        else:
            self._require_open()  # a loop over a closed pipeline raises, as get does: it has not delivered everything
        last: CachedItem | None = None
        try:
            while True:
                if last is not None and self.config.auto_ack:
                    done, last = last, None
                    try:
                        self.ack(done)
                    except UnknownItemError:  # its lease expired: not ours to give back; this is the error raised
                        raise
                    except BaseException:  # not journaled (a full disk): still ours, given back below
                        last = done
                        raise
                try:
                    last = self.get()
                except RuntimeError:
                    if self._state == _CLOSED:
                        return  # closed by another thread
                    raise
                if last is None:
                    return
                yield last
        finally:
            if last is not None and self.config.auto_ack and self._state == _OPEN:
                self.release(last)  # the loop stopped inside this item: give it back, not evict
            if owner:
                self.close()

    def get(self, timeout: float | None = None) -> CachedItem | None:
        """Take the next item (leased until :meth:`ack` or :meth:`release`); None when all are delivered.

        Blocks up to ``timeout`` seconds (None: no limit). Safe to call from several threads.

        Raises:
            TimeoutError: no item became ready in time.
            ItemFailedError: the next item failed (``on_error="raise"``); the cause is chained.
            OSError, OversizeError, UnsafeKeyError, EmptySourceError: a listing that streams stopped
                after :meth:`open` (whatever ``on_error``; an unsafe key stops it with
                ``on_error="raise"`` only), raised once the items listed before it are delivered,
                and by every later call (never None after it: the rest of the source is unknown).
            RuntimeError: the pipeline is not open.
        """
        got = self.get_many(1, timeout)
        return got[0] if got else None

    def get_many(self, count: int, timeout: float | None = None) -> list[CachedItem]:
        """Take up to ``count`` items at once: the next one (blocking as :meth:`get`), then the
        items ready after it in turn, without waiting for more. An empty list when all are
        delivered. For many small items: with :meth:`ack_many`, the per-item costs (locks,
        wake-ups, journal writes) are paid once per batch.

        Args:
            count: the most items to return (at least 1).
            timeout: seconds to wait for the first item (None: no limit).

        Raises:
            ValueError: ``count`` is below 1.
            TimeoutError, ItemFailedError, OSError, ...: as :meth:`get`. A failed item is raised
                in its turn, after the items before it were returned by earlier calls.
        """
        got = self._get_many(count, timeout, report=False)
        return [] if isinstance(got, Skipped) else got  # report=False: never a Skipped

    def get_or_skipped(self, timeout: float | None = None) -> CachedItem | Skipped | None:
        """As :meth:`get`, but an item skipped in its turn (``on_error``/``on_oversize="skip"``:
        logged, counted and its step consumed, as :meth:`get` does) is returned as a
        :class:`Skipped` instead of passed over: for a consumer that keeps count of its steps
        (the PyTorch adapter puts a repeat in a skipped item's place, see ``equal_steps``).

        Raises:
            As :meth:`get`.
        """
        got = self._get_many(1, timeout, report=True)
        if isinstance(got, Skipped):
            return got
        return got[0] if got else None

    def check_cache(self) -> None:
        """Check that the cache directory, and the state directory in it, are the ones
        :meth:`open` took. :meth:`get` and :meth:`get_many` check at most once every
        :data:`CACHE_CHECK_SECONDS` (1 s) and after every failed item; so after a removal at most
        that long of hand-outs can name deleted paths.

        Raises:
            CacheRemovedError: they were removed or replaced. The pipeline stopped downloading,
                and every later ``get`` raises this too; :meth:`close` it and open a new one.
            RuntimeError: the pipeline is not open.
        """
        self._require_open()
        removed = self._fetcher.removed or self._cache.removed()
        if removed is None:
            return
        self._fetcher.halt(-1, "<cache>", removed)  # once: a later call finds it halted
        raise self._fetcher.removed or removed

    def ack(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Acknowledge a delivered item: its path is gone when this returns, and its space is
        freed once its files are deleted. Read the item before: paths or open files kept from it
        point at deleted files, and the acknowledged :class:`CachedItem` raises
        ``FileNotFoundError`` when used as a path (a ``str`` of it cannot be tracked).

        An item of 1 MiB or more is renamed aside and deleted
        by a background thread (freeing a large file can take the file system milliseconds; the
        caller does not wait for it); a smaller one is deleted here.

        Args:
            path: the :class:`CachedItem` (its lease is checked) or its local path.
            lease: the lease token to check when ``path`` is a plain path (optional).

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (never delivered,
                already acknowledged, released, or its lease expired). Nothing is freed twice.
            OSError: the ack could not be journaled (a full disk): nothing changed, the item is
                still leased to the caller, who may ack it again.
        """
        self.ack_many([path] if lease is None else [(path, lease)])

    def ack_many(self, items: Iterable[str | os.PathLike[str] | tuple[str | os.PathLike[str], str]]) -> None:
        """Acknowledge several delivered items at once (as :meth:`ack`), their acks journaled by
        one write: all of them, or none.

        Args:
            items: :class:`CachedItem` objects, local paths, or ``(path, lease)`` pairs.

        Raises:
            UnknownItemError: one of them is not an item currently handed out, or is given twice:
                nothing is acknowledged.
            CacheRemovedError: the cache directory was removed or replaced (see
                :meth:`check_cache`): its paths may name another owner's items, so nothing is deleted.
            OSError: the acks could not be journaled (a full disk): nothing changed.
        """
        self._ack_many(items)

    def release(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Give a delivered item back: it is handed out again, before any other.

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        taken = self._lease(path, "release", lease)
        self._count("released")
        with self._counts_lock:
            self._handed_end(taken)

    def renew(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Extend the lease of a delivered item by ``lease_timeout`` (a consumer still at work).

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        self._lease(path, "renew", lease)

    # ---- visibility ------------------------------------------------------------------
    def stats(self) -> Stats:
        """A snapshot of the counters (see :class:`Stats`)."""
        self._require_open(allow_closed=True)
        c = self._fetcher.counters
        counts = self._broker.counts()
        with self._counts_lock:
            mine = dict(self._counts)
        return Stats(
            items_listed=self._listing.listed if self._listing else self._listed,
            items_ready=counts["ready"],
            items_handed=mine["handed"],
            items_acked=mine["acked"],
            items_released=mine["released"],
            items_failed=c.items_failed,
            items_skipped=mine["skipped"],
            items_reused=c.items_adopted,
            items_redelivered=self._broker.redelivered,
            bytes_listed=self._listing.listed_bytes if self._listing else self._listed_bytes,
            bytes_downloaded=c.bytes_downloaded,
            bytes_in_cache=self._cache.used,
            capacity=self._cache.capacity,
            requests=c.requests,
            retries=c.retries,
            hedges=c.hedges,
            disk_errors=c.disk_errors,
            disk_pauses=c.disk_pauses,
            consumer_wait_seconds=self._broker.wait_seconds,
            producer_wait_seconds=c.producer_wait_seconds,
            download_threads=self._fetcher.threads,
        )
