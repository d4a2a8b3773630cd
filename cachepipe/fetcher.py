"""The producer: reserves space, downloads items into staging, verifies, publishes.

One planner thread walks the plan in order, given in runs of steps: it waits for prefetch room
and for space (both conditions signalled by consumers, never polled), stages the item and
queues its bytes for a pool of ``max_concurrency`` download threads, of which
:func:`download_threads` take parts (as many as keep one working while the others wait for
their requests). The items of a run that need no wait are started together, a round or two of
each lock for all of them (:meth:`Fetcher._start_without_waiting`). Each thread takes the next
part from the earliest started item with bytes not yet requested, and cuts it when it takes it:
a ranged GET of :func:`item_part_size` for the items then ahead of that item that count
(:func:`items_ahead`, by the consumers' pace) (up to ``part_size``, :func:`auto_part_size`), so
that the item the consumers wait for is fetched over every thread.
The requests of items with a file over :data:`HEAD_MIN_PART` (one cut into parts) are at most
``max_large_requests``; an item of smaller files only is short requests, each mostly round trip,
so more of them (up to ``max_concurrency``) keep the link busy.
While requests cost less than twice a part's own work (a memory or local source), a thread
takes up to :data:`PART_RUN` parts of small items at once; one whose request must be retried
hands the rest to another thread first.
The thread that finishes an item's last part queues it to publish (or discards it and reports
the failure); the first thread to queue one publishes every item queued meanwhile, a run at a
time (one journal write, one hand-over to the broker), while the others go on downloading.
Transient errors are retried with exponential backoff and equal jitter, sleeping on the stop
event so that :meth:`Fetcher.stop` is immediate. With ``download_processes``, each
GET is made by a worker process (:mod:`cachepipe.downloads`) while the download thread waits
for it: the threads keep the bookkeeping, the workers the request path.

The parts are the fetcher's own, each in a module: the sizes and thread counts are pure policy
(:mod:`cachepipe.fetch_policy`), the bytes not yet requested are :class:`PartQueue`
(:mod:`cachepipe.partqueue`), the retry schedule is :func:`~cachepipe.backoff.backoff_delay`
(:mod:`cachepipe.backoff`), and what happens to an item once its last part is in (checked,
prepared, published, restarted or reported) is the base class ``_Finishing``
(:mod:`cachepipe.finishing`), which part in flight is late and its second request (a hedge)
the base class above it, ``_LateParts`` (:mod:`cachepipe.lateparts`; the race of the two
requests is :mod:`cachepipe.hedging`), and the requests of the parts a thread took (retried,
timed to choose :func:`download_threads`, counted done) the base class above that one,
``_PartRequests`` (:mod:`cachepipe.partrequests`). This module keeps the planner thread and
what each download thread takes.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from .backoff import backoff_delay
from .broker import Broker
from .cache import Cache
from .catalog import Item
from .config import PipelineConfig, Share
from .downloads import DownloadWorkers
from .errors import ArchiveError, CacheRemovedError, OversizeError, UnsafeKeyError
from .fetch_policy import (
    HEAD_MIN_PART,
    MAX_PART,
    auto_part_size,
    download_threads,
    item_part_size,
    items_ahead,
)
from .finishing import FetchCounters, _Job
from .hedging import Flight
from .lateparts import _Part
from .partqueue import PartQueue
from .partrequests import _PartRequests
from .stores.base import Store, takes_etag
from .unpack import split_volume

# the policy's names, PartQueue and backoff_delay: importable from here, as before
__all__ = [
    "HEAD_MIN_PART",
    "MAX_PART",
    "Fetcher",
    "PartQueue",
    "Planned",
    "auto_part_size",
    "backoff_delay",
    "download_threads",
    "item_part_size",
    "items_ahead",
]

log = logging.getLogger("cachepipe.fetcher")


Planned = tuple[int, Item, int]
"""A planned step for the fetcher: ``(seq, item, tick)`` (``tick`` orders the plan's steps)."""

ROOM_RUN = 64
"""Items whose room a download waits for beyond its own in a full cache, while as many are ready
for the consumers (``Cache.acquire``'s ``run``): acks then start downloads in runs, not one each."""

PART_RUN = 16
"""The most parts of small items a download thread takes at once, while requests cost less than
twice the work around them (a memory or local source: ``Fetcher._take_and_fetch``)."""


class Fetcher(_PartRequests):
    """Downloads planned items into the cache and hands them to the broker.

    Args:
        store: where the bytes come from.
        cache: where they go (space reservation, staging, publish).
        broker: who hands them out.
        plan: runs of :data:`Planned` steps ``(seq, item, tick)``, in the order to fetch (``tick``
            orders the plan's steps).
        config: concurrency, part size, retries and prefetch settings.
        upcoming: for a plan whose runs come as a streamed listing queues items (None: the
            plan is known), a reader of the first item of the plan's next run, made when a
            run's last item is reserved (:meth:`StreamingListing.upcoming
            <cachepipe.listing.StreamingListing.upcoming>`): each reservation tells the cache
            what the next item takes (:meth:`Cache.expect <cachepipe.cache.Cache.expect>`).
    """

    def __init__(
        self,
        store: Store,
        cache: Cache,
        broker: Broker[str],
        plan: Iterable[Sequence[Planned]],
        config: PipelineConfig,
        upcoming: Callable[[], Callable[[], Item | None]] | None = None,
    ) -> None:
        self._store = store
        self._upcoming = upcoming  # a reader of the first item of the plan's next run (a streamed listing's)
        self._conditional = takes_etag(store)  # each GET is conditional on the listed ETag (If-Match)
        self._cache = cache
        self._broker = broker
        self._plan = plan
        self._cfg = config
        self._stop = threading.Event()
        self.counters = FetchCounters()
        self._min_part = min(config.part_size or HEAD_MIN_PART, HEAD_MIN_PART)  # the smallest part item_part_size gives
        self._pool = ThreadPoolExecutor(config.max_concurrency, thread_name_prefix="cachepipe-fetch")
        self._parts: PartQueue[_Job] = PartQueue(config.large_requests)
        self._parts_lock = threading.Lock()  # _parts, _takers, _large, _flights and _watching
        self._parts_changed = threading.Condition(self._parts_lock)  # parts queued, or stopping: wakes a watching thread
        self._takers = 0  # download threads taking parts
        self._large = 0  # requests in flight of items with a file over HEAD_MIN_PART
        self._flights: dict[int, Flight] = {}  # parts of files cut in several, in flight, by id(part): hedged when late
        self._watching = False  # a download thread with no part to take waits for a flight's hedge to be due
        broker.on_hand_out = self._consumers_moved
        broker.on_starve = self._cache.wake_starving
        self.threads = config.max_concurrency  # download threads wanted now (download_threads)
        self._paces: list[tuple[float, float]] = []  # (request wall s, thread CPU s) of parts since the last choice
        self._cheap = False  # the last choice found requests shorter than twice the work around them
        self._publish_lock = threading.Lock()  # _to_publish and _publishing
        self._to_publish: list[_Job] = []  # verified items waiting for the publishing thread
        self._publishing = False  # a download thread is publishing what is queued
        self._job_errors = threading.Lock()  # a job's first error, set by the thread of one of its parts (rare: one lock)
        processes = config.download_processes
        self._workers = (
            DownloadWorkers(config.source, config.storage_options, processes, -(-config.max_concurrency // processes))
            if processes
            else None
        )
        self._prepare_pool = (
            ThreadPoolExecutor(config.prepare_workers, thread_name_prefix="cachepipe-prepare") if config.prepares else None
        )
        # a completed item without an error goes to publish as it is: nothing to verify or prepare first
        self._publish_as_is = config.verify != "etag" and self._prepare_pool is None
        self._thread = threading.Thread(target=self._run, name="cachepipe-producer", daemon=True)
        self.removed: CacheRemovedError | None = None  # the cache directory is gone: stopped for good (halt)

    def start(self) -> None:
        self._thread.start()

    def interrupt(self) -> None:
        """Stop planning and downloading without waiting: no part is taken, no request retried and
        no backoff slept from now on, and an item whose request fails meanwhile is not reported
        (staging is the cache's to remove at close). Download worker processes abort their
        stores' requests. Then the pipeline aborts its own store, and :meth:`stop` joins."""
        self._stop_taking()
        if self._workers is not None:
            self._workers.abort()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop planning and downloading; wait for the threads (in-flight requests finish their
        chunk, or fail at once if the store was aborted after :meth:`interrupt`)."""
        self._stop_taking()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._workers is not None:
            self._workers.close()
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=True, cancel_futures=True)

    def _stop_taking(self) -> None:
        """Set the stop event, and wake a download thread waiting for a part to be late."""
        with self._parts_lock:
            self._stop.set()
            self._parts_changed.notify_all()

    def halt(self, seq: int, name: str, error: CacheRemovedError) -> None:
        """Stop for good because the cache directory is gone (``error``, found at item ``seq``
        ``name``, or by a consumer: seq -1): planning and downloads end, waiters for room wake,
        and consumers get ``error`` in turn. Once; returns at once (:meth:`stop` joins the threads)."""
        with self._parts_lock:
            if self._stop.is_set():
                return
            self.removed = error
            self._stop.set()
            self._parts_changed.notify_all()
        log.error("downloads stopped: %s", error)
        self._cache.interrupt()
        # in the turn of the first step not resolved: steps before the one that found it may never come now
        self._broker.fail(0, name, error, begun=seq >= 0, kind="stream")

    # ---- planner thread --------------------------------------------------------------
    def _run(self) -> None:
        self._unbegun = 0  # the first planned step not yet handed to the broker (begun or reported)
        try:
            for run in self._plan:
                done = 0
                while done < len(run):
                    if self._stop.is_set():
                        return
                    self._unbegun = run[done][0]
                    started = self._start_without_waiting(run[done:])
                    if started is None:
                        return
                    done += started
                    if done < len(run):
                        self._unbegun = run[done][0]  # the run's seqs may skip some (steps acked before a restart)
                        if not self._plan_one(*run[done], self._charge_of(run, done + 1)):
                            return
                        done += 1
        except BaseException as exc:  # noqa: BLE001 - planning failed: the consumer sees it in turn, never a hang
            log.error("planning stopped at step %d: %s", self._unbegun, exc)
            self._broker.fail(self._unbegun, "<listing>", exc, begun=False, kind="stream")
        finally:
            self._broker.finish()

    def _begin(self, seq: int, count: int = 1) -> int:
        """:meth:`Broker.begin` ``count`` planned items, the last of them ``seq``; their first turn."""
        turn = self._broker.begin_many(count)
        self._unbegun = seq + 1
        return turn

    def _start_without_waiting(self, run: Sequence[tuple[int, Item, int]]) -> int | None:
        """Start the first items of ``run`` that need no wait (room ahead of the consumers under
        ``prefetch``, space in the cache, no earlier copy on disk or on its way, nothing to
        refuse; see :meth:`Cache.acquire_many`): two rounds of the broker's lock, one of the
        cache's and one of the download queue's for all of them. Returns how many (0: the next
        one waits, :meth:`_plan_one`; always 0 with ``min_free``); None if stopped."""
        if self._cfg.min_free is not None:
            return 0  # free space is polled per item (_wait_for_free_space)
        room = len(run) if self._cfg.prefetch is None else min(len(run), self._broker.room_ahead(self._cfg.prefetch))
        if room <= 0:
            return 0
        wanted = []
        for _seq, item, _tick in run[:room]:
            if self._refusal(item) is not None:
                break
            wanted.append((item, self._extra(item)))
        first = run[0][0]
        count = self._cache.acquire_many(wanted, lambda: self._broker.withdrawn(first), self._charge_of(run, len(wanted)))
        if not count:
            return 0
        if self._stop.is_set():
            for item, extra in wanted[:count]:
                self._cache.unreserve(self._cache.charge(item, extra), item.name)
            return None
        turn = self._begin(run[count - 1][0], count)
        self._start_many([(run[i][0], item, extra, turn + i, 0) for i, (item, extra) in enumerate(wanted[:count])])
        return count

    def _charge_of(self, run: Sequence[Planned], index: int) -> int | Callable[[], int]:
        """What the planned item after ``run[:index]`` takes in the cache (:meth:`Cache.charge`):
        ``run[index]``'s; past the run's end, the next run's first, read each time the cache
        asks (a streamed listing's, which may queue it only after this reservation, and which
        the planner may take and wait to reserve: see :meth:`Cache.expect`); 0 if the plan has
        no next run."""
        if index < len(run):
            item = run[index][1]
            return self._cache.charge(item, self._extra(item))
        if self._upcoming is None:
            return 0
        read = self._upcoming()

        def charge() -> int:
            item = read()
            return 0 if item is None else self._cache.charge(item, self._extra(item))

        return charge

    def _plan_one(self, seq: int, item: Item, tick: int, then: int | Callable[[], int] = 0) -> bool:
        """Start (or refuse, or hand out from disk) one planned item, waiting for room ahead of
        the consumers, free space and cache space as needed; False if stopped meanwhile.
        ``then``: what the planned item after it takes (see :meth:`Cache.expect`)."""
        waited = time.monotonic()
        if self._cfg.prefetch is not None and not self._broker.wait_ahead_below(self._cfg.prefetch):
            return False
        refused = self._refusal(item)
        if refused is not None:
            self._cache.expect(then)
            self._begin(seq)
            self._report_failure(seq, item, refused.key if isinstance(refused, UnsafeKeyError) else item.name, refused)
            return True
        extra = self._extra(item)
        # an item over the cache's limit is refused by acquire (oversize) whatever the disk's free
        # space: waiting for that first would hold every later item up for ever
        charge = self._cache.charge(item, extra)  # what it takes on the disk, as the ledger counts it
        if charge <= self._cache.limit and not self._wait_for_free_space(charge):
            return False
        try:
            got = self._cache.acquire(
                *(item, tick, self._broker.starving, extra, lambda: self._broker.withdrawn(seq)),
                run=(ROOM_RUN - 1) * charge,
                patient=self._patient,
                then=then,
            )
        except OversizeError as exc:  # no longer fits beside the state budget: this item only
            self._cache.expect(then)
            self._begin(seq)
            self.counters.add(items_failed=1)
            self._broker.fail(seq, item.name, exc, kind="oversize")
            return True
        if got is False:
            return False
        if got is not True:
            self._cache.expect(then)  # nothing reserved: the next item is next
        if got is None:  # the broker plans another step first (a node's waiting lane): this one is unplanned
            self._broker.withdraw(seq)
            self._unbegun = seq + 1
            return True
        if got is not True:  # on disk already: recovered at open, or retained
            self._begin(seq)
            self.counters.add(items_adopted=1)  # counted before a consumer can take it, as a download is
            self._broker.put(seq, item.name, os.fspath(got))
            return True
        self.counters.add(producer_wait_seconds=time.monotonic() - waited)
        if self._stop.is_set():
            self._cache.unreserve(self._cache.charge(item, extra), item.name)
            return False
        self._start(seq, item, extra, self._begin(seq))
        return True

    def _part_size(self) -> int:
        """``part_size`` as configured, or by default for the capacity now (it may change live)."""
        return self._cfg.part_size or auto_part_size(self._cache.limit, self._cfg.large_requests)

    def _wait_for_free_space(self, size: int) -> bool:
        """Pause while the filesystem would keep less than ``min_free`` after this item.

        Free space has no change event to wait on, so this is the one place that polls
        (once a second, on the stop event so that closing is immediate). False if stopped.
        """
        need = self._cfg.min_free
        if need is None:
            return True
        paused = False
        while not self._stop.is_set():
            usage = shutil.disk_usage(self._cache.root)
            floor = int(usage.total * need.fraction) if isinstance(need, Share) else need
            if usage.free - size >= floor:
                if paused:
                    log.warning("free space recovered (%d bytes free); resuming downloads", usage.free)
                return True
            if not paused:
                paused = True
                self.counters.add(disk_pauses=1)
                log.warning("only %d bytes free under %s, min_free is %d: pausing downloads", usage.free, self._cache.root, floor)
            self._stop.wait(1.0)
        return False

    def _start(self, seq: int, item: Item, extra: int, turn: int, attempt: int = 0) -> None:
        """:meth:`_start_many` of one item."""
        self._start_many([(seq, item, extra, turn, attempt)])

    def _start_many(self, items: Sequence[tuple[int, Item, int, int, int]]) -> None:
        """Stage each ``(seq, item, extra, turn, attempt)`` and queue its bytes for the download
        threads (parts are cut as they are taken, :meth:`PartQueue.take`), in one round of the
        queue's lock; start threads to take them: up to ``max_concurrency`` for an item of
        small files only, else up to ``max_large_requests``."""
        jobs = []
        for seq, item, extra, turn, attempt in items:
            try:
                staged = self._cache.stage(item, self._min_part)
            except OSError as exc:
                if exc.errno == errno.ENAMETOOLONG:  # a path of the item over the file system's limit: never fits
                    self._fail_reserved(seq, item, extra, exc)
                    continue
                removed = self._cache.removed() if exc.errno == errno.ENOENT else None
                if removed is not None:  # the cache directory was removed: nothing more can be fetched into it
                    self._cache.unreserve(self._cache.charge(item, extra), item.name)
                    self.halt(seq, item.name, removed)
                    continue
                unstaged = f"{self._cache.staging_root}/unstaged"
                self._retry_disk_error(_Job(seq, item, unstaged, turn, extra, attempt=attempt), exc)
                continue
            jobs.append(_Job(seq, item, staged, turn, extra, attempt=attempt))
        empty, more = [], 0
        with self._parts_lock:
            for job in jobs:
                item, staged = job.item, job.staged
                files = ((f, staged if item.is_file else f"{staged}/{f.rel}") for f in item.files)
                started = self._parts.add(job, item.size, job.turn, files)
                if started is None:
                    empty.append(job)
                    continue
                room = self._room_for_takers(started)
                if room > 0:  # no more than its parts, at most
                    room = min(room, sum(-(-f.size // self._min_part) for f in item.files))
                more += room
                self._takers += room
            if jobs:
                self._parts_changed.notify()
        for job in empty:
            self._finish_or_report(job)
        for _ in range(more):
            self._pool.submit(self._take_and_fetch)

    # ---- download threads ------------------------------------------------------------
    def _take_and_fetch(self, first: list[_Part] | None = None) -> None:
        """A download thread's task: fetch parts, each cut when taken, until none is left, or
        until more threads take parts than :attr:`threads` wants. While requests cost less than
        twice the work around them (:meth:`_note_paces`), a thread takes up to :data:`PART_RUN` parts
        of small items at once: one round of the queue's lock for them. ``first``: parts of
        small items taken already (the rest of another thread's run), fetched first."""
        large = False  # the parts just fetched were of an item with a file over HEAD_MIN_PART
        paces: list[tuple[float, float]] = []  # the parts just fetched: request wall s, this thread's CPU s
        if first is not None:
            paces = self._fetch_timed(first)
        while True:
            more = 0
            with self._parts_lock:  # a thread leaves only with the lock held, so no queued part is left untaken
                self._large -= large
                if paces:
                    more = self._note_paces(paces)
                # a large part waits while max_large_requests are in flight: their threads take it next
                large_free = self._large < self._cfg.large_requests
                parts = []
                hedge = None
                if not self._stop.is_set() and self._takers <= self.threads:  # else leave: another thread takes it
                    served, part_size = self._broker.served(), self._part_size()
                    fresh = None if self._broker.outpaced() else self._broker.fresh()
                    # while the consumers outpace the items the link is the limit: a second request would
                    # take its bytes from the others. It may exceed max_large_requests (the late one holds one)
                    hedge = self._late_part(served) if self._flights and fresh is not None else None
                    part = None if hedge is not None else self._parts.take(served, part_size, large_free, fresh)
                    while part is not None:
                        parts.append(part)
                        if not (self._cheap and part[0].small) or len(parts) == PART_RUN:
                            break
                        part = self._parts.take(served, part_size, large=False, fresh=fresh)
                    if len(parts) == 1 and self._cfg.hedge and self._workers is None and not self._whole(parts[0]):
                        self._flights[id(parts[0])] = Flight(parts[0], time.perf_counter())
                if not parts and hedge is None:
                    for _ in range(more):  # counted as takers: started whatever this thread does
                        self._pool.submit(self._take_and_fetch)
                    watch = None
                    if not (self._stop.is_set() or self._takers > self.threads or self._watching):
                        # set before the consumers' place is read: a hand-out from now on wakes this thread
                        self._watching = True
                        watch = self._hedge_wait(self._broker.served(), self._broker.outpaced())
                        self._watching = watch is not None
                    self._takers -= 1
                    if watch is None:
                        return
                    # one thread, not counted as a taker meanwhile, waits for a part in flight to
                    # be late: the threads may all be done with their parts before (or new parts
                    # come, or the consumers move on: _consumers_moved)
                    self._parts_changed.wait(None if math.isinf(watch) else watch)
                    self._watching = False
                    self._takers += 1
                    large, paces = False, []
                    continue
                large = hedge is not None or not parts[0][0].small
                self._large += large
            for _ in range(more):
                self._pool.submit(self._take_and_fetch)
            paces = self._fetch_timed(parts) if hedge is None else self._hedge(hedge)

    def _consumers_moved(self) -> None:
        """An item was handed out (:attr:`Broker.on_hand_out`): the items behind it have one fewer
        ahead, so a part in flight may be due to be hedged now; wake the thread waiting for one,
        if one waits (read without the lock first: one attribute per item handed out). Fewer
        items are ready: wake the planner if it waits for a run's room (:meth:`_patient`) and
        the consumers no longer have items enough."""
        if self._watching:
            with self._parts_lock:
                self._parts_changed.notify()
        self._cache.wake_run(self._patient)

    def _patient(self) -> bool:
        """The consumers have :data:`ROOM_RUN` items ready, so a download that fits may wait for
        room for a run after it (:meth:`Cache.acquire`'s ``patient``)."""
        return self._broker.patient(ROOM_RUN)

    def _extra(self, item: Item) -> int:
        """Bytes to reserve beside ``item`` for what unpack and the prepare hook write: as the
        config asks, but at most what the cache leaves beside the item (more would wait forever),
        in whole blocks (it is reserved rounded up to them: :meth:`~cachepipe.cache.Cache.charge`)."""
        if self._prepare_pool is None:  # neither unpack nor a prepare hook (made for config.prepares)
            return 0
        cache = self._cache
        beside = cache.limit - cache.charge(item)
        wanted = self._cfg.prepare_extra(item.size, cache.block, item.is_file)
        return max(0, min(wanted, beside - beside % cache.block))

    def _refusal(self, item: Item) -> ArchiveError | UnsafeKeyError | None:
        """Why ``item`` cannot be delivered as configured, known before downloading it; or None.
        An item with a key that cannot be stored safely (:attr:`Item.unsafe`) is refused here,
        before anything of it is reserved or written: it fails in its turn (``on_error``)."""
        if item.unsafe is not None:
            return item.unsafe
        if self._cfg.unpack and item.is_file and split_volume(item.name) is not None:
            return ArchiveError(
                f"{item.name!r} is one volume of a split archive: with items='files' each object is unpacked alone. "
                "Put the volumes of each archive in a folder of their own and use items='folders' "
                "(or `cachepipe map --items files --unpack`, which groups them)"
            )
        return None
