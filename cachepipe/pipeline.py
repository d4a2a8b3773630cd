"""``Pipeline``: the in-process front-end over the core (store, catalog, cache, fetcher, broker)."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .broker import Broker, Closed, Failed, Lease
from .cache import Cache
from .catalog import Catalog, Item, Names
from .config import PipelineConfig, Share, check_cache_dir, check_option_names, check_source, parse_capacity, small_capacity
from .errors import ConfigError, EmptySourceError, OversizeError, UnknownItemError, UnsafeKeyError
from .fetcher import Fetcher, Planned, backoff_delay
from .items import PathItem
from .listing import StreamingListing
from .plan import Cursor, Frontier, GrowingPlan, Plan, Step, default_rank_world
from .plan import tick as plan_tick
from .retention import PlanFuture, make_policy
from .sourcing import empty_source, fitting_items, make_plan, obtain_catalog
from .stores import Store, open_store
from .stores.base import abort_store

__all__ = ["CachedItem", "Pipeline", "Skipped", "Stats"]

log = logging.getLogger("cachepipe")

PLAN_RUN = 64
"""The most steps the producer is given at once (see :class:`cachepipe.fetcher.Fetcher`): it
starts those that need no wait together, a round or two of each lock for them."""


CACHE_CHECK_SECONDS = 1.0
"""How often, at most, :meth:`Pipeline.get_many` checks that the cache directory is still there
(two ``stat`` calls; see :meth:`Pipeline.check_cache`)."""


_Held = tuple[str, int, tuple[str, ...]]
"""What a hand-out needs of an item in flight: its name, size and files' relative paths."""

_ONE_FILE = ("",)  # the files of every single-file item


def _held(item: Item) -> _Held:
    """What the pipeline keeps of ``item`` from planning until consumed: a tuple of strings and
    ints, which Python's garbage collector stops tracking at its first collection (an
    :class:`Item` stays tracked, with its files: with many items ready, every full collection
    walked them all, and every thread waited)."""
    files = tuple(item.files)
    rels = _ONE_FILE if len(files) == 1 and not files[0].rel else tuple(f.rel for f in files)
    return item.name, item.size, rels


class CachedItem(PathItem):
    """A delivered item: usable wherever a path is (``open(item / "text.txt")``, ``os.fspath``).

    Its files exist from the hand-out until the item is acknowledged, and no longer: read it
    before the loop asks for the next item (``auto_ack``) or before your ``ack``, and copy out
    what must outlive it. After :meth:`Pipeline.ack` of this object, or :meth:`Pipeline.close`
    (unless ``keep_on_close``), ``os.fspath(item)`` and ``item / "x"`` raise
    ``FileNotFoundError`` naming the item and why; a ``str`` or ``Path`` taken from it earlier
    cannot be tracked and simply points at deleted files. A process forked while the item is
    held sees the same files, deleted when the parent acks: the child must be done first.

    Attributes:
        path: the local path (a folder, or a file for single-object items).
        name: the item's name (its path relative to the source prefix and to the cache dir).
        size: total bytes, as listed.
        files: relative paths of its files as listed, in key order (``("",)`` for a single
            file). With ``unpack`` or a ``prepare`` hook, ``size`` and ``files`` still describe
            the listed objects (the archives), not what the item's folder holds after it: list
            the folder for those.
        lease: the lease token; ``ack``/``release`` of this object check it, so a consumer whose
            lease expired cannot evict the item from under the next one.
    """

    __slots__ = ("_first", "_gone", "files", "lease", "name", "size")

    def __init__(self, path: str | os.PathLike[str], item: Item, lease: str = "") -> None:
        super().__init__(path)
        self._set(_held(item), lease)

    @classmethod
    def _of(cls, path: str, held: _Held, lease: str, first: bool = False) -> CachedItem:
        """The item handed out at ``path`` (a string the cache made: not checked again), from
        what the pipeline kept of it (:func:`_held`); ``first``: see :meth:`Cache.first_hand_out`."""
        self = cls.__new__(cls)
        self._local, self._path = path, None
        self.name, self.size, self.files = held
        self.lease, self._gone, self._first = lease, None, first
        return self

    def _set(self, held: _Held, lease: str) -> None:
        self.name, self.size, self.files = held
        self.lease = lease
        self._gone: str | None = None  # why its files are gone, once they are
        self._first = False  # its first hand-out since this pipeline downloaded it (Cache.first_hand_out)

    def __fspath__(self) -> str:
        self._check()
        return self._local

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        self._check()
        return self.path / other

    def _check(self) -> None:
        if self._gone is not None:
            raise FileNotFoundError(
                errno.ENOENT,
                f"item {self.name!r} was {self._gone}: its files are deleted; read an item before it is acknowledged "
                "(auto_ack: before the loop asks for the next) and copy out what must outlive it",
                self._local,
            )

    def __repr__(self) -> str:
        return f"CachedItem({self._local!r}, size={self.size})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CachedItem):
            return self.path == other.path
        if isinstance(other, (str, os.PathLike)):
            return self.path == Path(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.path)


@dataclass(frozen=True)
class Stats:
    """A snapshot of a pipeline's counters. Sizes in bytes, times in seconds."""

    items_listed: int
    items_ready: int
    items_handed: int  # hand-outs, counting re-deliveries
    items_acked: int
    items_released: int
    items_failed: int
    items_skipped: int  # turns passed over; an item left out of the plan at open (planning alone) once
    items_reused: int
    items_redelivered: int
    bytes_listed: int
    bytes_downloaded: int
    bytes_in_cache: int
    capacity: int
    requests: int
    retries: int
    disk_errors: int
    disk_pauses: int
    consumer_wait_seconds: float
    producer_wait_seconds: float
    download_threads: int  # threads taking parts now at most: max_concurrency, fewer where requests cost about nothing


@dataclass(frozen=True)
class Skipped:
    """An item passed over in its turn (``on_error``/``on_oversize="skip"``), as
    :meth:`Pipeline.get_or_skipped` reports it: its name, and why (the error, as text)."""

    name: str
    reason: str


_UNOPENED, _OPEN, _CLOSED = "unopened", "open", "closed"


def _log_oversize_skipped(error: OversizeError) -> None:
    """Log an item skipped as larger than the capacity (``on_oversize="skip"``), without the
    error's advice to pass that option."""
    log.warning("skipping item %r (on_oversize='skip'): %s", error.item, error.reason)


def _unsafe_refused(item: str, error: UnsafeKeyError) -> UnsafeKeyError:
    """The error that refuses a listing with an item whose key cannot be stored safely
    (``on_error="raise"``), saying how to read the rest."""
    advice = (
        f"item {item!r} cannot be stored in the cache (nothing of it is written); on_error='skip' skips it in "
        "its turn (logged, counted in items_skipped) and reads the other items"
    )
    return UnsafeKeyError(error.key, error.reason, advice)


class Pipeline:
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
            (for tests and custom backends).
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
        self._pid = os.getpid()
        self._handed: dict[str, CachedItem] = {}  # lease id -> the object handed out, until ack or release
        self._state = _UNOPENED
        self._lock = threading.Lock()
        self._closing = threading.Event()  # close() was called: an open() under way stops listing and raises
        self._abort_lock = threading.Lock()  # _opening, between open() and a close() from another thread
        self._opening: Store | None = None  # the store while open() runs (a close meanwhile aborts it)
        self._inflight: dict[int, _Held] = {}  # seq -> what a hand-out needs of its item, from planning until consumed
        self._listing: StreamingListing | None = None
        self._counts = {"handed": 0, "acked": 0, "released": 0, "skipped": 0}
        self._counts_lock = threading.Lock()  # not _lock: open() holds that while the listing thread counts
        self._bar: Any = None
        self._resumed_complete = False  # opened at the end of a finite plan (resume, or a state loaded)
        self._start_state: dict[str, Any] | None = None
        self._catalog_digest: str | None = None  # of the whole catalog the plan was made from (None: streamed)
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
        """
        with self._lock:
            if self._state != _UNOPENED:
                raise RuntimeError(f"{self!r} cannot be opened again: create a new Pipeline")
            self._state = _CLOSED  # until it is open: a failed open cannot be retried on this object
            cfg = self.config
            store = self._given_store or open_store(cfg.source, cfg.storage_options)
            with self._abort_lock:
                self._opening = store
            cache = Cache(cfg.cache_dir, cfg.capacity)
            broker: Broker[str] = Broker(ordered=cfg.ordered, lease_timeout=cfg.lease_timeout)
            fetcher: Fetcher | None = None
            try:
                cache.open()
                try:
                    self._broker, self._cache = broker, cache
                    steps = self._catalog(store, cache)
                    broker = self._broker  # a node pipeline's catalog step replaces it by its lanes' queues
                    fetcher = Fetcher(store, cache, broker, steps, cfg)
                    if cfg.progress:
                        from tqdm.auto import tqdm

                        self._bar = tqdm(total=self._total_steps, unit="item", desc="cachepipe", dynamic_ncols=True)
                        if self._bar.total != self._total_steps:  # a streamed listing ended while the bar was made
                            self._bar.total = self._total_steps
                            self._bar.refresh()
                    self._store, self._fetcher = store, fetcher
                    with self._abort_lock:
                        if self._closing.is_set():
                            raise RuntimeError(f"{self!r} was closed while it opened")
                        self._opening = None  # open: a close() from now on takes the lock and stops it in order
                    fetcher.start()
                    self._state = _OPEN
                except BaseException:
                    # wakers first, then the store's requests in flight cut, then the joins (as close())
                    if self._listing is not None:
                        self._listing.interrupt()
                    if fetcher is not None:
                        broker.close()
                        cache.interrupt()
                        fetcher.interrupt()
                    abort_store(store)
                    if self._listing is not None:
                        self._listing.stop()
                    if fetcher is not None:
                        fetcher.stop()
                    cache.close()
                    raise
            except BaseException as exc:
                with self._abort_lock:
                    self._opening = None
                if self._bar is not None:
                    self._bar.close()
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
                log.warning(
                    "%s: the pass resumed is complete (%s): nothing to hand out; resume=False reads it again",
                    cfg.source,
                    "from the state loaded" if self._start_state is not None else f"as recorded in {cache.root}",
                )
        return self

    def _streams(self, cache: Cache) -> bool:
        """Whether the listing can stream: a plain pass in listing order that needs neither the
        whole catalog up front (shuffle, shares, retention, a resume point) nor its names to
        decide which leftovers of an earlier owner to keep."""
        cfg = self.config
        return (
            cfg.epochs == 1
            and not cfg.shuffle
            and not self._shares_catalog()
            and cfg.retain == "none"
            and not cfg.resume
            and self._start_state is None
            and cfg.manifest is None
            and not cache.has_leftovers()
        )

    def _share_text(self) -> str:
        """What share of the plan this pipeline reads, for the open's log line ("" for all of it):
        a rank taken from the environment (RANK/WORLD_SIZE, torch.distributed) is otherwise unseen."""
        plan = getattr(self, "_plan", None)  # a NodePipeline plans per lane, and keeps none
        if not isinstance(plan, Plan) or plan.world_size * plan.num_workers == 1:  # a streamed plan is all of it
            return ""
        whence = "" if self.config.rank is not None else " (from RANK/WORLD_SIZE or torch.distributed)"
        worker = f", worker {plan.worker} of {plan.num_workers}" if plan.num_workers > 1 else ""
        return f"; this process reads the share of rank {plan.rank} of {plan.world_size}{whence}{worker}"

    def _shares_catalog(self) -> bool:
        """Whether other processes plan over this catalog too (ranks, DataLoader workers), each
        taking its share of one plan."""
        cfg = self.config
        world = cfg.world_size if cfg.rank is not None else default_rank_world()[1]
        return world != 1 or cfg.num_workers > 1

    def _catalog(self, store: Store, cache: Cache) -> Iterator[list[Planned]]:
        """List (or load the saved listing), recover the cache, build the plan; return the fetch order."""
        cfg = self.config
        self._future: PlanFuture | None = None
        if self._streams(cache):
            return self._stream(store, cache)
        catalog, sizes, eligible, from_manifest = self._fitting(store, cache)
        plan = make_plan(cfg, sizes)
        # with a manifest, a resume must also be of the same manifest
        key = _plan_key(plan, cfg, self._catalog_digest if from_manifest else None)
        cursor, acked = cache.recover(catalog, resume=cfg.resume, plan=key)
        if self._start_state is not None:
            saved = self._start_state.get("catalog_digest")
            if saved is not None and saved != self._catalog_digest:
                raise ConfigError(
                    f"state was saved with catalog_digest={saved!r}, this pipeline's catalog has "
                    f"catalog_digest={self._catalog_digest!r}: cannot resume over other data"
                )
            plan.load_state_dict(self._start_state)  # an explicit position wins over the journal's
            cursor, acked = plan.start, set()
        elif cfg.start_epoch and tuple(cursor) == (0, 0) and not acked:  # nothing resumed
            cursor = plan.start = plan.normalise(Cursor(cfg.start_epoch, 0))
        largest = self._check_limit(plan.sizes, catalog, eligible, cache)
        self._plan: Plan | GrowingPlan = plan
        self._frontier = Frontier(plan, Cursor(*cursor))
        self._catalog_items, self._eligible = catalog, eligible
        if cfg.retain == "auto":
            self._future = PlanFuture(plan, horizon=2)
            reserve = min(cache.limit // 4, max(2 * cfg.large_requests, 16) * largest)
            policy = make_policy("auto", plan.sizes, self._future, reserve=reserve)
            cache.use_retention(policy, Names(catalog, eligible), plan_tick(*cursor))
        before = _steps_before(plan, cursor)
        self._total_steps = None if cfg.epochs is None else sum(len(plan.share(e)) for e in range(cfg.epochs)) - before
        # every step left acknowledged already: at the end, or short of it where the last acks
        # were journaled beyond the cursor (a process killed before it closed)
        self._resumed_complete = (before > 0 or bool(acked)) and self._total_steps is not None and self._total_steps <= len(acked)
        return self._steps(plan, Cursor(*cursor), acked)

    def _fitting(self, store: Store, cache: Cache) -> tuple[Catalog, array[int], array[int] | None, bool]:
        """The catalog (from the manifest, a saved listing or a listing), and the sizes of the
        items that fit under the capacity beside what the cache holds otherwise: ``(catalog,
        sizes, eligible, from_manifest)``, where plan item ``i`` is catalog item ``eligible[i]``
        (``eligible`` None: every item is planned, no second list is kept).

        An item that does not fit is left out of the plan only when this process plans over the
        catalog alone. When other processes take shares of the same plan (ranks, DataLoader
        workers), every item is planned, and one over this cache's limit is skipped in its turn
        (``on_oversize="skip"``): what fits depends on each process's foreign files and, with a
        capacity given as a share of the disk, on the disk's free space at its open, and plans
        over different items would deal the items differently, some to two processes and some to
        none."""
        cfg = self.config
        catalog, self._catalog_digest, from_manifest = obtain_catalog(cfg, store, cache, self._closing)
        unsafe = catalog.unsafe
        if unsafe:  # in every process's plan, in its place: refused by the fetcher in its turn
            first = next(iter(unsafe))
            if cfg.on_error == "raise":
                raise _unsafe_refused(catalog.name(first), unsafe[first])
            log.warning(
                "%d item(s) under %s cannot be stored in the cache, and will be skipped in their turn "
                "(on_error='skip'); the first, %r: %s",
                len(unsafe),
                cfg.source,
                catalog.name(first),
                unsafe[first],
            )
        sizes = catalog.sizes
        self._listed = len(catalog)
        self._listed_bytes = sum(sizes)
        # recover() reserves the journal's budget too (and measures the state files: checked after it)
        occupied = cache.foreign + cache.journal_budget(catalog)
        eligible, too_large = fitting_items(catalog, cache.capacity, occupied)
        if too_large and cfg.on_oversize == "raise":
            raise too_large[0]
        if eligible is not None and not eligible:
            raise EmptySourceError(f"no items under {cfg.source!r}: found no {cfg.items} smaller than the capacity")
        if self._shares_catalog():
            return catalog, sizes, None, from_manifest
        for error in too_large:
            _log_oversize_skipped(error)
            self._counts["skipped"] += 1
        return catalog, sizes if eligible is None else array("q", (sizes[i] for i in eligible)), eligible, from_manifest

    def _check_limit(self, sizes: array[int], catalog: Catalog, eligible: array[int] | None, cache: Cache) -> int:
        """The largest of ``sizes``; with ``on_oversize="raise"``, raises :class:`OversizeError`
        for the first item above what the cache can hold once recovered (state files and foreign
        files counted). With ``"skip"``, such an item (left in by :meth:`_fitting`'s estimate,
        made before the state files were measured) is skipped in its turn, when its room is
        reserved (:meth:`Cache.acquire` raises for it)."""
        largest = max(sizes)
        if largest > cache.limit and self.config.on_oversize == "raise":
            i = next(i for i, size in enumerate(sizes) if size > cache.limit)
            item = catalog[i if eligible is None else eligible[i]]
            raise OversizeError(item.name, item.size, cache.capacity, cache.capacity - cache.limit)
        return largest

    def _steps(self, plan: Plan, cursor: Cursor, acked: set[tuple[int, str]]) -> Iterator[list[Planned]]:
        """The fetch order, run in the producer thread, in runs of up to :data:`PLAN_RUN` steps
        (issued in one round of the plan's lock): each step gets the next sequence number.
        Steps acknowledged before a restart are consumed at once, not fetched."""
        prepared = -1
        for run in _in_runs(plan.steps(cursor), PLAN_RUN):
            epochs = {step.epoch for step in run} - {prepared}
            if self._future is not None:
                for epoch in sorted(epochs):
                    self._future.prepare(epoch)  # next-use lookups, computed outside the cache's lock
                    prepared = epoch
            catalog, eligible = self._catalog_items, self._eligible
            items = [catalog[step.item if eligible is None else eligible[step.item]] for step in run]
            seqs = self._issue(run, items)
            planned: list[Planned] = []
            for seq, step, item in zip(seqs, run, items, strict=True):
                if (step.epoch, item.name) in acked:
                    self._broker.skip(seq)
                    self._consume([seq])
                else:
                    planned.append((seq, item, step.tick))
            if planned:
                yield planned

    def _issue(self, steps: list[Step], items: list[Item]) -> range:
        """Give ``steps`` (of ``items``) their sequence numbers, in one round of the plan's lock;
        they are in flight until consumed."""
        held = [_held(item) for item in items]  # outside the lock, which the consumers' acks take
        with self._plan_lock:
            seqs = self._frontier.issue_many(steps)
            self._inflight.update(zip(seqs, held, strict=True))
        return seqs

    def _stream(self, store: Store, cache: Cache) -> Iterator[list[Planned]]:
        """Start the streaming listing (see :mod:`cachepipe.listing`); return the fetch order.

        Waits for the first page: a listing error, an oversize item (``on_oversize="raise"``) or
        an item with an unsafe key (``on_error="raise"``) in it is raised here; later ones reach
        the consumer in their turn.
        """
        cfg = self.config
        cache.recover(Catalog(), resume=False)  # nothing of an earlier owner's to keep (see _streams)
        plan = GrowingPlan(seed=cfg.seed, balance=cfg.balance, partition=cfg.partition, equal_steps=cfg.equal_steps)
        self._plan, self._frontier = plan, Frontier(plan)
        self._total_steps = None

        def admit(run: list[Item]) -> list[bool]:  # in the listing thread, in listing order
            if cfg.on_error == "raise":
                bad = next((k for k, item in enumerate(run) if item.unsafe is not None), None)
                if bad == 0:
                    raise _unsafe_refused(run[0].name, run[0].unsafe)  # type: ignore[arg-type]  # not None: bad
                if bad is not None:
                    run = run[:bad]  # the unsafe item comes first in the next call (the rest is given again)
            keeps: list[bool] = []
            names, sizes = [item.name for item in run], [item.size for item in run]
            limits = cache.note_listed(names, sizes, [not item.tagged for item in run]) or [cache.limit]  # none: closed
            for item, limit in zip(run, limits, strict=False):  # the first len(limits) items
                if item.size > limit:
                    error = OversizeError(item.name, item.size, cache.capacity, cache.capacity - limit)
                    if cfg.on_oversize == "raise":
                        raise error  # the first item of the run: note_listed stops before an oversize one
                    _log_oversize_skipped(error)
                    self._count("skipped")
                keeps.append(item.size <= limit)
            with self._plan_lock:
                plan.extend([item.size for item, keep in zip(run, keeps, strict=False) if keep])
            return keeps

        def complete() -> None:  # in the listing thread, once it listed everything
            with self._plan_lock:
                full = plan.complete()
            cache.set_plan(_plan_key(full, cfg))
            self._total_steps = full.n_items
            if self._bar is not None:
                self._bar.total = full.n_items
                self._bar.refresh()

        listing = StreamingListing(
            store, cfg.items, admit, complete, cfg.retries, lambda n: backoff_delay(n, cfg.retry_backoff, cfg.retry_backoff_max)
        )
        self._listing = listing
        listing.start()
        listing.wait_first_page()
        if listing.done and plan.n_items == 0:
            raise empty_source(cfg.source, cfg.items, listing.objects, listing.listed)
        return self._stream_steps(listing)

    def _stream_steps(self, listing: StreamingListing) -> Iterator[list[Planned]]:
        """The fetch order of a streaming listing, run in the producer thread: the items listed
        and not yet planned, up to :data:`PLAN_RUN` at a time (issued in one round of the plan's
        lock)."""
        index = 0
        while True:
            items = listing.take_many(PLAN_RUN)
            if not items:
                break
            indices = range(index, index + len(items))
            index += len(items)
            seqs = self._issue([Step(0, i, i) for i in indices], items)
            yield list(zip(seqs, items, indices, strict=True))  # epoch 0: a step's tick is its index
        if listing.stopped:
            return
        if index == 0:
            raise empty_source(self.config.source, self.config.items, listing.objects, listing.listed)

    def _consume(self, seqs: Sequence[int]) -> None:
        """Steps are done (acknowledged, or failed and reported): move the resume point."""
        with self._plan_lock:
            before = self._frontier.position
            for seq in seqs:
                self._inflight.pop(seq, None)
            self._frontier.consume(*seqs)
            after = self._frontier.position
        if after != before:
            self._cache.advance(after.epoch, after.index)

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
        largest = max(self._plan.sizes, default=0) if self.config.on_oversize == "raise" else 0
        new = self._cache.set_capacity(value, at_least=largest)
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
        removed. Called from another thread while :meth:`open` lists, it aborts that listing,
        and ``open`` raises ``RuntimeError``.
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
        self._broker.close()
        self._cache.interrupt()
        if self._listing is not None:
            self._listing.interrupt()
        self._fetcher.interrupt()  # before the abort: a request it cuts is neither retried nor reported
        abort_store(self._store)
        if self._listing is not None:
            self._listing.stop()
        self._fetcher.stop()
        self._cache.close(keep=self.config.keep_on_close)
        if not self.config.keep_on_close:
            with self._counts_lock:
                held, self._handed = list(self._handed.values()), {}
            for item in held:
                item._gone = "deleted when its pipeline closed"  # noqa: SLF001 - the pipeline ends its items' lives
        self._store.close()
        if self._bar is not None:
            self._bar.close()
        log.info("closed %s", self.config.source)

    def __enter__(self) -> Pipeline:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- consuming -------------------------------------------------------------------
    def __iter__(self) -> Iterator[CachedItem]:
        """Yield items until all are delivered. Opens the pipeline if needed, and then closes it
        when the loop ends (prefer ``with`` so that ``break`` and errors close it at once)."""
        owner = self._state == _UNOPENED
        if owner:
            self.open()
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
                ``on_error="raise"`` only), raised once the items listed before it.
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

    def _get_many(self, count: int, timeout: float | None, report: bool) -> list[CachedItem] | Skipped:
        """:meth:`get_many`; ``report``: an item skipped in its turn is returned as a :class:`Skipped`."""
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count!r}")
        self._require_open()
        self._check_cache_due()
        while True:
            try:
                got = self._take(count, timeout)
            except Closed:
                raise RuntimeError(f"{self!r} is closed") from None
            if got is None:
                return []
            if isinstance(got, Failed):
                self.check_cache()  # an item failed: because the cache directory is gone?
                if got.kind == "stream":
                    raise got.error  # listing or planning stopped: not an item to skip, the rest is unknown
                if got.seq >= 0:
                    self._consume([got.seq])  # reported: the resume point moves past it
                # "oversize": judged when its space was reserved (see Cache.reserve)
                self._skip_or_raise(got)
                if report:
                    return Skipped(got.name, got.reason)
                continue
            first_hand_out, inflight = self._cache.first_hand_out, self._inflight
            items = [
                CachedItem._of(lease.value, inflight[lease.seq], lease.id, first_hand_out(lease.name))  # noqa: SLF001 - from what the pipeline kept
                for lease in got
            ]
            with self._counts_lock:
                self._counts["handed"] += len(items)
                for item in items:
                    self._handed[item.lease] = item
            if self._bar is not None:
                self._bar.update(len(items))
                self._bar.set_postfix(
                    cache=f"{self._cache.used / 2**20:.0f}/{self._cache.capacity / 2**20:.0f}MiB", refresh=False
                )
            return items

    def _check_cache_due(self) -> None:
        """:meth:`check_cache`, if the last was :data:`CACHE_CHECK_SECONDS` ago or the fetcher found the cache gone."""
        now = time.monotonic()
        if self._fetcher.removed is not None or now - self._cache_checked >= CACHE_CHECK_SECONDS:
            self._cache_checked = now
            self.check_cache()

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

    def _skip_or_raise(self, failed: Failed) -> None:
        """A failed item in its turn: raise its error (``on_error``/``on_oversize="raise"``), or
        log and count it as skipped."""
        if (self.config.on_oversize if failed.kind == "oversize" else self.config.on_error) == "raise":
            raise failed.error
        if isinstance(failed.error, OversizeError):
            _log_oversize_skipped(failed.error)
        else:
            log.warning("skipping %s item: %s", "oversize" if failed.kind == "oversize" else "failed", failed.error)
        self._count("skipped")

    def _take(self, count: int, timeout: float | None) -> Any:
        """The broker's next items, warning every ``stall_warning`` seconds that nothing is ready."""
        every = self.config.stall_warning
        if every is None:
            return self._broker.take_many(count, timeout)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            chunk = every if deadline is None else min(every, deadline - time.monotonic())
            try:
                return self._broker.take_many(count, max(chunk, 0.0))
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no item became ready within {timeout} s") from None
            counts = self._broker.counts()
            held = (
                "; items handed out and not acknowledged hold their space: ack or release them"
                if counts["handed"] and not counts["pending"]
                else ""
            )
            log.warning(
                "no item ready for %.0f s from %s: %d downloading, %d handed out, cache %d of %d bytes used%s",
                time.monotonic() - start,
                self.config.source,
                counts["pending"],
                counts["handed"],
                self._cache.used,
                self._cache.capacity,
                held,
            )

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
        self._require_open()
        if self._fetcher.removed is not None:  # a path may now name another owner's item: nothing is deleted
            raise self._fetcher.removed
        wanted = [self._lease_key(*item) if isinstance(item, tuple) else self._lease_key(item, None) for item in items]
        if not wanted:
            return
        try:
            taken = self._broker.ack_many([(name, lease) for name, lease, _path in wanted])
        except KeyError as exc:
            name, why = exc.args
            path = next(path for named, _lease, path in wanted if named == name)
            raise self._not_handed_out("ack", path, why) from None
        with self._plan_lock:
            steps = self._frontier.epoch_ticks([lease.seq for lease in taken])
        try:
            self._cache.evict_many([(lease.name, epoch, tick) for lease, (epoch, tick) in zip(taken, steps, strict=True)])
        except BaseException:
            self._broker.restore(taken)  # not recorded: the consumer still holds the items, and may ack again
            raise
        self._consume([lease.seq for lease in taken])
        with self._counts_lock:
            self._counts["acked"] += len(taken)
            handed = [self._handed.pop(lease.id, None) for lease in taken]
        for item in handed:
            if item is not None:
                item._gone = "acknowledged"  # noqa: SLF001 - the pipeline ends its items' lives

    def release(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Give a delivered item back: it is handed out again, before any other.

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        taken = self._lease(path, "release", lease)
        self._count("released")
        with self._counts_lock:
            self._handed.pop(taken.id, None)

    def renew(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        """Extend the lease of a delivered item by ``lease_timeout`` (a consumer still at work).

        Raises:
            UnknownItemError: ``path`` is not an item currently handed out (see :meth:`ack`).
        """
        self._lease(path, "renew", lease)

    def _lease_key(self, path: str | os.PathLike[str], lease: str | None) -> tuple[str, str | None, str | os.PathLike[str]]:
        """``(name, lease, path)`` of an item a consumer names by its :class:`CachedItem` or path."""
        if isinstance(path, CachedItem):
            return path.name, lease or path.lease, path
        return self._name_of(path), lease, path

    def _lease(self, path: str | os.PathLike[str], verb: str, lease: str | None) -> Lease[str]:
        self._require_open()
        name, lease, _path = self._lease_key(path, lease)
        action = {"release": self._broker.release, "renew": self._broker.renew}[verb]
        try:
            return action(name, lease)
        except KeyError as exc:
            raise self._not_handed_out(verb, path, exc.args[1]) from None

    def _not_handed_out(self, verb: str, path: str | os.PathLike[str], why: str) -> UnknownItemError:
        """The error for a ``verb`` of ``path`` that the broker refused (``why``, see :meth:`Broker._live`)."""
        if why == "twice":
            return UnknownItemError(f"cannot {verb} {str(path)!r}: given twice in one call")
        if why == "another lease":
            timeout = self.config.lease_timeout
            expired = (
                ""
                if timeout is None
                else f"your lease expired after lease_timeout={timeout:g} s and the item was handed out again, or "
            )
            return UnknownItemError(
                f"cannot {verb} {str(path)!r}: it is handed out under another lease ({expired}the lease given is not the "
                "one that delivered it)"
            )
        return UnknownItemError(
            f"cannot {verb} {str(path)!r}: not an item handed out by this pipeline (never delivered, already "
            "acknowledged or released, or its lease expired)"
        )

    def _name_of(self, path: str | os.PathLike[str]) -> str:
        full, prefix = os.path.abspath(path), self._cache.prefix
        return full[len(prefix) :] if full.startswith(prefix) else f"<outside the cache: {path}>"

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
            disk_errors=c.disk_errors,
            disk_pauses=c.disk_pauses,
            consumer_wait_seconds=self._broker.wait_seconds,
            producer_wait_seconds=c.producer_wait_seconds,
            download_threads=self._fetcher.threads,
        )

    def _count(self, name: str) -> None:
        with self._counts_lock:
            self._counts[name] += 1

    def _require_open(self, allow_closed: bool = False) -> None:
        if os.getpid() != self._pid and self._state == _OPEN:
            raise RuntimeError(
                f"{self!r} was opened in process {self._pid} and cannot be used in process {os.getpid()} "
                "(a fork: its threads did not survive it, and the parent owns its items); "
                "open a new Pipeline in this process"
            )
        if self._state == _OPEN or (allow_closed and self._state == _CLOSED):
            return
        raise RuntimeError(
            f"{self!r} is {self._state}: "
            + ("use it inside 'with' or call open()" if self._state == _UNOPENED else "create a new Pipeline")
        )


def _in_runs(steps: Iterator[Step], size: int) -> Iterator[list[Step]]:
    """``steps`` in lists of up to ``size``; if ``steps`` raises, the steps it gave before the
    error first (their items are delivered before it), then the error."""
    run: list[Step] = []
    try:
        for step in steps:
            run.append(step)
            if len(run) == size:
                yield run
                run = []
    except Exception:
        if run:
            yield run
        raise
    if run:
        yield run


def _plan_key(plan: Plan, cfg: PipelineConfig, catalog_digest: str | None = None) -> str:
    """The plan's configuration (its position excluded), the source and the items mode it was
    made of, and ``catalog_digest`` if given, as JSON: what a resume must match (an item count
    and sizes alone match another source's listing of items of the same sizes)."""
    key = {k: v for k, v in plan.state_dict().items() if k not in ("epoch", "index")}
    key["source"], key["items"] = cfg.source, cfg.items
    if catalog_digest is not None:
        key["catalog_digest"] = catalog_digest
    return json.dumps(key, sort_keys=True)


def _steps_before(plan: Plan, cursor: tuple[int, int]) -> int:
    """How many of this share's steps come before ``cursor`` (for the progress bar's total)."""
    epoch, index = cursor
    return sum(len(plan.share(e)) for e in range(epoch)) + index
