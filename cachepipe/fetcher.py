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
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from .backoff import backoff_delay
from .broker import Broker
from .cache import Cache, tree_bytes
from .catalog import FileEntry, Item
from .config import PipelineConfig, Share
from .downloads import DownloadWorkers, LocalWriteError, get_part
from .errors import (
    ArchiveError,
    CacheRemovedError,
    ItemFailedError,
    OversizeError,
    PrepareOverflowError,
    UnsafeKeyError,
    VerificationError,
    is_transient,
)
from .removal import rmtree
from .stores.base import Store, takes_etag
from .unpack import DEFAULT_MAX_MEMBERS, split_volume, unpack_in_place

# backoff_delay: importable from here, as before
__all__ = ["Fetcher", "PartQueue", "Planned", "auto_part_size", "backoff_delay", "item_part_size", "items_ahead"]

log = logging.getLogger("cachepipe.fetcher")


MIN_PART, MAX_PART = 1024 * 1024, 8 * 1024 * 1024
"""The bounds of :func:`auto_part_size`, bytes."""


def auto_part_size(capacity: int, concurrency: int) -> int:
    """The default ``part_size``: ``capacity / (2 * concurrency)`` bytes, between
    :data:`MIN_PART` and :data:`MAX_PART`. Space is reserved an item at a time, so a cache that
    holds few items can keep few requests busy: with parts this small, each of the
    ``concurrency`` requests has a part to fetch while half the cache holds items waiting for
    the consumer (the video case of ``benchmarks/bench_link.py``, a 400 Mbit/s, 16 ms link, 64 MiB,
    16 requests: 0.97 of the link with 2 MiB parts, 0.91 with 8 MiB)."""
    return min(MAX_PART, max(MIN_PART, capacity // (2 * concurrency)))


HEAD_MIN_PART = 256 * 1024
"""The smallest part :func:`item_part_size` splits the consumers' next item into, bytes. A file
of at most this size is fetched whole by one request; the requests of an item with a larger
file count against ``max_large_requests``."""


def item_part_size(size: int, part_size: int, concurrency: int, ahead: int) -> int:
    """The size of the next ranged GET of an item of ``size`` bytes with ``ahead`` items ahead of
    it (fetching, or ready and never handed out), chosen when a download thread takes it.

    ``concurrency`` parts of this size hold at most ``ahead + 1`` items' worth of bytes, so a part
    taken now arrives in about the time the link takes to deliver the items ahead and this one:
    the item the consumers wait for next (``ahead == 0``) is split over every thread and comes at
    the whole link's speed, and each item after it comes in turn, not in a convoy with the
    ones behind it. At least :data:`HEAD_MIN_PART` (requests have a cost) and at most
    ``part_size`` (which it is once the consumers have enough ahead of them)."""
    return min(part_size, max(HEAD_MIN_PART, -(-size * (ahead + 1) // concurrency)))


def items_ahead(ahead: int, fresh: int | None) -> int:
    """The items ahead of an item that count when its next part is cut (:func:`item_part_size`),
    of ``ahead`` (fetching, or ready and never handed out): all of them while the consumers come
    back for items faster than the items come (``fresh`` None,
    :meth:`cachepipe.broker.Broker.outpaced`): the link is the limit, and an item still coming
    holds the consumers as long as a ready one. Otherwise (a consumer slower than the items,
    or none seen yet) the items ready and never handed out (``fresh``) less one: an item still
    coming gives a consumer no time, and the one ready next may be taken at any moment, so the
    items are fetched one after the other over every thread until two or more are ready ahead
    (the slow consumer of ``benchmarks/bench_link.py``: stall after its first item about 1%
    against 3%)."""
    ahead = max(0, ahead)
    return ahead if fresh is None else max(0, min(ahead, fresh) - 1)


PACE_WINDOW = 32
"""Parts between two choices of :func:`download_threads` (and the parts each choice looks at)."""


def download_threads(request_s: float, work_s: float, limit: int) -> int:
    """How many download threads to run: ``1 + request_s / work_s`` (rounded up), at least 1
    and at most ``limit``.

    Little's law: while one thread does a part's own work in Python (``work_s`` seconds of its
    CPU: the part's bookkeeping, writing it, publishing), the others wait for their requests
    (``request_s`` seconds each, wall). That many threads keep one always working, and the
    requests' round trips hidden behind it. More only take turns at the interpreter's lock:
    where a request costs about nothing (a ``memory://`` or local source), each handing over
    of the lock at a system call costs a context switch. ``work_s`` of 0 or less (nothing
    measured yet): ``limit``."""
    if work_s <= 0:
        return limit
    return max(1, min(limit, math.ceil(1 + request_s / work_s)))


Planned = tuple[int, Item, int]
"""A planned step for the fetcher: ``(seq, item, tick)`` (``tick`` orders the plan's steps)."""

PART_RUN = 16
"""The most parts of small items a download thread takes at once, while requests cost less than
twice the work around them (a memory or local source: ``Fetcher._take_and_fetch``)."""

J = TypeVar("J")


@dataclass(eq=False)
class Started(Generic[J]):
    """An item in a :class:`PartQueue`: its bytes not yet requested, and its parts running."""

    job: J
    size: int  # the item's bytes
    turn: int  # its place in hand-out order: turn - served items are ahead of it
    todo: deque[tuple[FileEntry, str, int]]  # files (or their rest) not yet requested: entry, local path, next offset
    small: bool  # every file of at most HEAD_MIN_PART: its requests do not count against max_large_requests
    running: int = 0


class PartQueue(Generic[J]):
    """The bytes of started items not yet requested, cut into ranged GETs as download threads
    take them. Not thread-safe: the fetcher holds one lock around every call.

    Args:
        concurrency: download threads.
    """

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self._started: deque[Started[J]] = deque()  # with bytes not yet requested, in the order they started

    def add(self, job: J, size: int, turn: int, files: Iterable[tuple[FileEntry, str]]) -> Started[J] | None:
        """Queue an item's files (those of 0 bytes need no request) in its turn: after the items
        of earlier turns, before those of later ones (an item restarted after a disk error or an
        ETag mismatch keeps its place). None if nothing is to fetch."""
        todo: deque[tuple[FileEntry, str, int]] = deque()
        small = True
        for f, local in files:
            if f.size:
                todo.append((f, local, 0))
                small = small and f.size <= HEAD_MIN_PART
        if not todo:
            return None
        started = Started(job, size, turn, todo, small)
        place = len(self._started)
        while place and self._started[place - 1].turn > turn:
            place -= 1
        self._started.insert(place, started)
        return started

    def head(self) -> Started[J] | None:
        """The earliest started item with bytes not yet requested, or None."""
        return self._started[0] if self._started else None

    def take(
        self, served: int, part_size: int, large: bool = True, fresh: int | None = None
    ) -> tuple[Started[J], FileEntry, str, int, int] | None:
        """The next part: from the earliest started item with bytes not yet requested, of
        :func:`item_part_size` for the items ahead of it now that count (:func:`items_ahead`;
        ``served``: see :meth:`cachepipe.broker.Broker.served`; ``fresh``: the items ready and
        never handed out, or None while the consumers outpace the items) and at most
        ``part_size`` bytes; None if every
        byte is requested, or if ``large`` is False and the next part is of an item with a file
        over :data:`HEAD_MIN_PART` (it waits for its turn: nothing later is taken before it)."""
        while self._started:
            started = self._started[0]
            if not started.todo:  # given up (see done)
                self._started.popleft()
                continue
            if not large and not started.small:
                return None
            f, local, start = started.todo[0]
            if started.small and f.size - start <= part_size:  # item_part_size would give at least the rest
                end = f.size
            else:
                ahead = items_ahead(started.turn - served, fresh)
                part = item_part_size(started.size, part_size, self.concurrency, ahead)
                end = min(f.size, start + part)
            if end == f.size:
                started.todo.popleft()
                if not started.todo:
                    self._started.popleft()
            else:
                started.todo[0] = (f, local, end)
            started.running += 1
            return started, f, local, start, end
        return None

    def done(self, started: Started[J], give_up: bool = False) -> bool:
        """A part of ``started`` ended (``give_up``: request no more of it, it failed). True if
        it was the item's last: nothing is running and nothing more will be requested."""
        started.running -= 1
        if give_up:
            started.todo.clear()
        return started.running == 0 and not started.todo


_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


@dataclass(slots=True)
class _Job:
    seq: int
    item: Item
    staged: str  # its staging path (a folder, or a file for single-object items)
    turn: int  # its place in hand-out order (see PartQueue)
    extra: int = 0  # bytes reserved beside the item's own for unpack/prepare (fixed when reserved)
    error: BaseException | None = None
    error_key: str = ""
    disk_error: OSError | None = None  # a local write failed: free staging, back off, restart the item
    attempt: int = 0


_Part = tuple[Started[_Job], FileEntry, str, int, int]
"""A part taken from the queue (:meth:`PartQueue.take`): its item, file, local path and range."""


class FetchCounters:
    """Producer-side counters, read by :meth:`cachepipe.Pipeline.stats`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_downloaded = 0
        self.requests = 0
        self.retries = 0
        self.items_fetched = 0
        self.items_adopted = 0
        self.items_failed = 0
        self.disk_errors = 0
        self.disk_pauses = 0
        self.producer_wait_seconds = 0.0

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def answered(self, got: int) -> None:
        """One request answered, with ``got`` bytes of body: :meth:`add` without its keywords
        (once per part, the most frequent count)."""
        with self.lock:
            self.requests += 1
            self.bytes_downloaded += got


class Fetcher:
    """Downloads planned items into the cache and hands them to the broker.

    Args:
        store: where the bytes come from.
        cache: where they go (space reservation, staging, publish).
        broker: who hands them out.
        plan: runs of :data:`Planned` steps ``(seq, item, tick)``, in the order to fetch (``tick``
            orders the plan's steps).
        config: concurrency, part size, retries and prefetch settings.
    """

    def __init__(
        self, store: Store, cache: Cache, broker: Broker[str], plan: Iterable[Sequence[Planned]], config: PipelineConfig
    ) -> None:
        self._store = store
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
        self._parts_lock = threading.Lock()  # _parts, _takers and _large
        self._takers = 0  # download threads taking parts
        self._large = 0  # requests in flight of items with a file over HEAD_MIN_PART
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
        self._stop.set()
        if self._workers is not None:
            self._workers.abort()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop planning and downloading; wait for the threads (in-flight requests finish their
        chunk, or fail at once if the store was aborted after :meth:`interrupt`)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._workers is not None:
            self._workers.close()
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=True, cancel_futures=True)

    def halt(self, seq: int, name: str, error: CacheRemovedError) -> None:
        """Stop for good because the cache directory is gone (``error``, found at item ``seq``
        ``name``, or by a consumer: seq -1): planning and downloads end, waiters for room wake,
        and consumers get ``error`` in turn. Once; returns at once (:meth:`stop` joins the threads)."""
        with self._parts_lock:
            if self._stop.is_set():
                return
            self.removed = error
            self._stop.set()
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
                        if not self._plan_one(*run[done]):
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
        count = self._cache.acquire_many(wanted, lambda: self._broker.withdrawn(first))
        if not count:
            return 0
        if self._stop.is_set():
            for item, extra in wanted[:count]:
                self._cache.unreserve(item.size + extra, item.name)
            return None
        turn = self._begin(run[count - 1][0], count)
        self._start_many([(run[i][0], item, extra, turn + i, 0) for i, (item, extra) in enumerate(wanted[:count])])
        return count

    def _plan_one(self, seq: int, item: Item, tick: int) -> bool:
        """Start (or refuse, or hand out from disk) one planned item, waiting for room ahead of
        the consumers, free space and cache space as needed; False if stopped meanwhile."""
        waited = time.monotonic()
        if self._cfg.prefetch is not None and not self._broker.wait_ahead_below(self._cfg.prefetch):
            return False
        refused = self._refusal(item)
        if refused is not None:
            self._begin(seq)
            self._report_failure(seq, item, refused.key if isinstance(refused, UnsafeKeyError) else item.name, refused)
            return True
        extra = self._extra(item)
        # an item over the cache's limit is refused by acquire (oversize) whatever the disk's free
        # space: waiting for that first would hold every later item up for ever
        if item.size <= self._cache.limit and not self._wait_for_free_space(item.size):
            return False
        try:
            got = self._cache.acquire(item, tick, self._broker.starving, extra, lambda: self._broker.withdrawn(seq))
        except OversizeError as exc:  # no longer fits beside the state budget: this item only
            self._begin(seq)
            self.counters.add(items_failed=1)
            self._broker.fail(seq, item.name, exc, kind="oversize")
            return True
        if got is False:
            return False
        if got is None:  # the broker plans another step first (a node's waiting lane): this one is unplanned
            self._broker.withdraw(seq)
            self._unbegun = seq + 1
            return True
        if got is not True:  # on disk already: recovered at open, or retained
            self._begin(seq)
            self._broker.put(seq, item.name, os.fspath(got))
            self.counters.add(items_adopted=1)
            return True
        self.counters.add(producer_wait_seconds=time.monotonic() - waited)
        if self._stop.is_set():
            self._cache.unreserve(item.size + extra, item.name)
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
                    self._cache.unreserve(item.size + extra, item.name)
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
                if not self._stop.is_set() and self._takers <= self.threads:  # else leave: another thread takes it
                    served, part_size = self._broker.served(), self._part_size()
                    fresh = None if self._broker.outpaced() else self._broker.fresh()
                    part = self._parts.take(served, part_size, large_free, fresh)
                    while part is not None:
                        parts.append(part)
                        if not (self._cheap and part[0].small) or len(parts) == PART_RUN:
                            break
                        part = self._parts.take(served, part_size, large=False)
                if not parts:
                    self._takers -= 1
                    return
                large = not parts[0][0].small
                self._large += large
            for _ in range(more):
                self._pool.submit(self._take_and_fetch)
            paces = self._fetch_timed(parts)

    def _fetch_timed(self, parts: list[_Part]) -> list[tuple[float, float]]:
        """:meth:`_fetch_parts`, with this thread's CPU seconds per part requested: the paces
        for :meth:`_note_paces`."""
        cpu = time.thread_time()
        try:
            requests = self._fetch_parts(parts)
        except Exception:  # a defect, not an item's failure (those are reported): the thread stays
            log.exception("a download thread's parts from %s on failed unexpectedly", parts[0][0].job.item.name)
            return []
        if not requests:
            return []
        work = (time.thread_time() - cpu) / len(requests)
        return [(request_s, work) for request_s in requests]

    def _note_paces(self, parts: list[tuple[float, float]]) -> int:
        """Count parts' request times and work (under the parts lock); every
        :data:`PACE_WINDOW` parts, choose :attr:`threads` (:meth:`_choose_threads`). Returns
        the threads to start now (counted as takers)."""
        paces, more = self._paces, 0
        for pace in parts:
            paces.append(pace)
            if len(paces) == PACE_WINDOW:
                more += self._choose_threads()
        return more

    def _choose_threads(self) -> int:
        """Choose :attr:`threads` from the median request time and the mean work of the last
        :data:`PACE_WINDOW` parts (:func:`download_threads`), and forget them. The median, since
        a request that came back while the interpreter's lock was busy is also counted as
        waiting for it. Returns the threads to start now (counted as takers): when more are
        wanted than take parts and parts are queued, up to the limit of the next item's kind,
        as :meth:`_start` would (an item being fetched must not stay on the few threads that a
        fast stretch of it chose)."""
        paces = self._paces
        request_s = sorted(r for r, _ in paces)[len(paces) // 2]
        work_s = sum(w for _, w in paces) / len(paces)
        paces.clear()
        self.threads = download_threads(request_s, work_s, self._cfg.max_concurrency)
        # a request's wall time counts its waits for the interpreter's lock too: one that costs
        # about nothing (a memory or local source) measures near a part's work, on either side
        self._cheap = request_s < 2 * work_s
        head = self._parts.head()
        more = 0 if head is None else self._room_for_takers(head)
        self._takers += more
        return more

    def _room_for_takers(self, started: Started[_Job]) -> int:
        """Threads that may start now to take parts of ``started`` (under the parts lock): up to
        ``max_concurrency`` for an item of small files only, else ``max_large_requests``, and
        no more than :attr:`threads` in all."""
        limit = self._cfg.max_concurrency if started.small else self._cfg.large_requests
        return max(0, min(limit, self.threads) - self._takers)

    def _fetch_parts(self, parts: list[_Part]) -> list[float]:
        """Fetch parts (each with retries), then count them done (:meth:`_parts_done`). Returns
        the seconds of each part's request (none for a part of an item that had failed).

        A part whose request must be retried does not hold the rest of a run: before its first
        backoff, the parts fetched so far are counted done (their items published) and the parts
        after it go to another download thread."""
        requests: list[float] = []
        for index, (started, f, local, start, end) in enumerate(parts):
            job = started.job
            if job.error is not None or job.disk_error is not None or self._stop.is_set():
                continue
            handed: list[bool] = []  # the rest of the run handed to another thread (before a backoff)

            def hand_off(index: int = index, handed: list[bool] = handed) -> None:
                rest = parts[index + 1 :]
                if rest and not self._start_taker(rest):
                    return  # closing: the loop skips the rest and counts every part done once, at its end
                self._parts_done(parts[:index])  # after the hand-over: finishing them may wait a disk error's backoff
                handed.append(True)

            began = time.perf_counter()
            try:
                self._get_with_retries(job, f, local, start, end, hand_off if len(parts) > 1 else None)
            except Exception as exc:  # a defect, not the store's error: the item fails (reported), never half-published
                log.exception("a download thread's part of %s failed unexpectedly", job.item.name)
                with self._job_errors:
                    if job.error is None:
                        job.error, job.error_key = exc, f.key
            else:
                requests.append(time.perf_counter() - began)
            if handed:
                self._parts_done([parts[index]])
                return requests
        self._parts_done(parts)
        return requests

    def _start_taker(self, parts: list[_Part]) -> bool:
        """Start a download thread that fetches ``parts`` first, counted as a taker; False if
        closing (the pool shut down, or about to)."""
        if self._stop.is_set():
            return False
        with self._parts_lock:
            self._takers += 1
        try:
            self._pool.submit(self._take_and_fetch, parts)
        except RuntimeError:  # the pool shut down meanwhile
            with self._parts_lock:
                self._takers -= 1
            return False
        return True

    def _parts_done(self, parts: list[_Part]) -> None:
        """Count fetched (or skipped) parts done, in one round of the queue's lock, and finish
        the items whose last part they were: first those to publish as they are, by one run
        (:meth:`_publish_in_turn`), then the others (a failure to report, a retry's backoff, a
        check or a prepare hook; :meth:`_finish_or_report`)."""
        if not parts:
            return
        with self._parts_lock:  # after an error nothing more is requested: the item fails or restarts
            last = [
                part[0].job
                for part in parts
                if self._parts.done(part[0], give_up=part[0].job.error is not None or part[0].job.disk_error is not None)
            ]
        publish: list[_Job] = []
        others: list[_Job] = []
        as_is = self._publish_as_is and not self._stop.is_set()  # nothing to check or prepare first, not closing
        for job in last:
            (publish if as_is and job.error is None and job.disk_error is None else others).append(job)
        if publish:
            self._publish_in_turn(publish)
        for job in others:
            self._finish_or_report(job)

    def _get_with_retries(
        self, job: _Job, f: FileEntry, local: str, start: int, end: int, before_backoff: Callable[[], None] | None = None
    ) -> None:
        """Request one part, retrying transient errors with backoff (``before_backoff`` is called
        once, before the first); an error is recorded on the job (``error``, or ``disk_error``
        for the local disk), not raised."""
        cfg = self._cfg
        for attempt in range(cfg.retries + 1):
            if attempt and (job.error is not None or job.disk_error is not None):
                return  # another part failed during the backoff: the item fails or restarts without this one
            try:
                whole = start == 0 and end == f.size  # one part: the file is created here, not by stage()
                if self._workers is not None:  # whose stores are cachepipe's own, which take etag
                    got = self._workers.get(f.key, local, start, end, whole, f.etag)
                else:
                    etag = f.etag if self._conditional else None
                    got = get_part(self._store, f.key, local, start, end, whole, self._cache.file_calls, etag)
                self.counters.answered(got)
                if got != end - start:
                    raise VerificationError(f"{f.key}: short body, {got} of {end - start} bytes at offset {start}")
                return
            except Exception as exc:  # noqa: BLE001 - sorted below: a local disk error, a transient one retried, else the item's failure
                local_error = (
                    exc if isinstance(exc, LocalWriteError) or (isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS) else None
                )
                if local_error is not None:
                    with self._job_errors:  # the disk, not the store: the whole item restarts from scratch
                        job.disk_error = job.disk_error or local_error
                    return
                if not is_transient(exc) or attempt == cfg.retries or self._stop.is_set() or job.error is not None:
                    with self._job_errors:
                        if job.error is None:
                            job.error, job.error_key = exc, f.key
                    return
                delay = backoff_delay(attempt, cfg.retry_backoff, cfg.retry_backoff_max)
                log.warning("retry %d/%d of %s in %.2fs: %s", attempt + 1, cfg.retries, f.key, delay, exc)
                self.counters.add(retries=1)
                if before_backoff is not None:
                    before_backoff()
                    before_backoff = None
                if self._stop.wait(delay):
                    return

    def _finish_or_report(self, job: _Job) -> None:
        """:meth:`_finish`, guarded: a pool thread's unexpected error must not lose the item silently."""
        try:
            self._finish(job)
        except Exception as exc:
            if self._stop.is_set():
                return
            log.exception("finishing %s failed", job.item.name)
            self._discard_and_report(job, job.item.name, exc)

    def _discard_and_report(self, job: _Job, key: str, error: BaseException) -> None:
        """Delete the item's staging, release its reservation, report its failure."""
        self._cache.discard(job.staged, job.item.size + job.extra, job.item.name)
        self._report_failure(job.seq, job.item, key, error)

    def _finish(self, job: _Job) -> None:
        """Publish a completed item, or discard it and report the failure."""
        if self._stop.is_set():
            return  # closing: the cache removes staging wholesale
        if job.error is None and job.disk_error is not None:
            self._retry_disk_error(job, job.disk_error)
            return
        if job.error is None and self._cfg.verify == "etag":
            mismatch = _etag_mismatch(job)
            if mismatch is not None:
                self.counters.add(retries=1)
                job.disk_error = mismatch
                self._retry_disk_error(job, mismatch)
                return
        if job.error is None and self._prepare_pool is not None:
            self._prepare_pool.submit(self._prepare_and_publish, job)
            return
        if job.error is None:
            self._publish_in_turn([job])
            return
        self._discard_and_report(job, job.error_key, job.error)

    def _publish_in_turn(self, jobs: list[_Job]) -> None:
        """Queue verified items to publish (every part wrote its whole range, as counted by
        get_part). The first thread to queue some publishes every item queued until none is left,
        a run at a time (:meth:`_publish_run`); the others go back to downloading at once, never
        waiting for the cache's lock."""
        with self._publish_lock:
            self._to_publish.extend(jobs)
            if self._publishing:
                return
            self._publishing = True
        while True:
            with self._publish_lock:
                jobs, self._to_publish = self._to_publish, []
                if not jobs:
                    self._publishing = False
                    return
            try:
                self._publish_run(jobs)
            except Exception as exc:  # a defect: every item of the run is reported, none lost
                log.exception("publishing %d items failed unexpectedly", len(jobs))
                for lost in jobs:
                    if not self._stop.is_set():
                        self._discard_and_report(lost, lost.item.name, exc)

    def _publish_run(self, jobs: list[_Job]) -> None:
        """Publish verified items by one journal write, then hand them to the broker at once."""
        if self._stop.is_set():
            return  # closing: the cache removes staging wholesale
        try:
            got = self._cache.publish_many([(job.staged, job.item, job.item.size) for job in jobs])
        except OSError as exc:  # the journal write failed (a full disk): nothing published
            got = [exc] * len(jobs)
        ready = []
        for job, path in zip(jobs, got, strict=True):
            if not isinstance(path, OSError):
                ready.append((job.seq, job.item.name, path))
            elif path.errno in _DISK_ERRNOS:  # backs off, then restarts the item: not on this thread
                self._pool.submit(self._retry_disk_error, job, path)
            else:
                self._discard_and_report(job, job.item.name, path)
        if ready:
            self.counters.add(items_fetched=len(ready))
            self._broker.put_many(ready)

    def _extra(self, item: Item) -> int:
        """Bytes to reserve beside ``item`` for what unpack and the prepare hook write: as the
        config asks, but at most what the cache leaves beside the item (more would wait forever)."""
        if self._prepare_pool is None:  # neither unpack nor a prepare hook (made for config.prepares)
            return 0
        return max(0, min(self._cfg.prepare_extra(item.size), self._cache.limit - item.size))

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

    def _prepare_and_publish(self, job: _Job) -> None:
        """Unpack and/or run the prepare hook on a verified staged item, measure it, publish it
        (prepare pool). The extraction may add at most ``job.extra`` bytes beside the archives."""
        item, reserved, staged = job.item, job.item.size + job.extra, Path(job.staged)
        try:
            if self._cfg.unpack:
                unpack_in_place(
                    staged,
                    name=item.name,
                    limit_bytes=job.extra,
                    max_members=DEFAULT_MAX_MEMBERS,
                    stop=self._stop,
                    advice=self._cfg.unpack_advice(item.size, job.extra),
                )
                if self._stop.is_set():
                    return  # closing: the cache removes staging wholesale; the hook is not run
            if self._cfg.prepare is not None:
                self._cfg.prepare(staged)
            used = tree_bytes(staged) if staged.is_dir() else staged.stat().st_size
            if used > reserved:
                raise PrepareOverflowError(
                    f"prepare wrote item {item.name!r} up to {used} bytes, more than the {reserved} reserved "
                    f"({item.size} listed + prepare_reserve/prepare_ratio)"
                )
            if self._stop.is_set():
                return
            path = self._cache.publish(staged, item, reserved=used, verified=True)
            self._cache.unreserve(reserved - used)
        except Exception as exc:  # noqa: BLE001 - unpack, the prepare hook (user code) or publish failed: the item's failure
            if self._stop.is_set():
                return
            self._discard_and_report(job, item.name, exc)
            return
        self.counters.add(items_fetched=1)
        self._broker.put(job.seq, item.name, path)

    def _retry_disk_error(self, job: _Job, error: OSError) -> None:
        """A local write failed (or the content did not match its ETag): free the item's staging
        files now, back off, restart the item.

        The reservation is kept, so the cap holds and the item keeps its place in line.
        """
        if not isinstance(error, VerificationError):
            self.counters.add(disk_errors=1)
        _rmtree_quiet(job.staged)
        if job.attempt >= self._cfg.retries:
            self._fail_reserved(job.seq, job.item, job.extra, error)
            return
        delay = backoff_delay(job.attempt, self._cfg.retry_backoff, self._cfg.retry_backoff_max)
        what = "verification failed" if isinstance(error, VerificationError) else "local disk error"
        log.warning("%s on %s (%s): staging freed, retrying the item in %.2fs", what, job.item.name, error, delay)
        if self._stop.wait(delay):
            return
        self._start(job.seq, job.item, job.extra, job.turn, job.attempt + 1)

    def _fail_reserved(self, seq: int, item: Item, extra: int, error: BaseException) -> None:
        """Give back the space reserved for ``item`` (its size and ``extra``) and report its failure."""
        self._cache.unreserve(item.size + extra, item.name)
        self._report_failure(seq, item, item.name, error)

    def _report_failure(self, seq: int, item: Item, key: str, error: BaseException) -> None:
        self.counters.add(items_failed=1)
        failure = ItemFailedError(item.name, f"{self._store.url.rstrip('/')}/{key}", error)
        failure.__cause__ = error
        log.error("%s", failure)
        self._broker.fail(seq, item.name, failure)


def _rmtree_quiet(path: str) -> None:
    """Remove a staging path (:func:`~cachepipe.removal.rmtree`: a folder, a file, or nothing);
    a failure is logged (the next open removes staging anyway)."""
    try:
        rmtree(path)
    except OSError as exc:
        log.warning("could not remove staging %s: %s", path, exc)


def _etag_mismatch(job: _Job) -> VerificationError | None:
    """Compare each staged file's MD5 with its ETag where the ETag is a plain MD5.

    Multipart ETags (``<md5>-<parts>``) and missing ones are not content hashes: skipped.
    """
    for f in job.item.files:
        etag = (f.etag or "").lower()
        if len(etag) != 32 or any(c not in "0123456789abcdef" for c in etag):
            continue
        digest = hashlib.md5(usedforsecurity=False)
        with open(f"{job.staged}/{f.rel}" if f.rel else job.staged, "rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
        if digest.hexdigest() != etag:
            return VerificationError(f"{f.key}: MD5 {digest.hexdigest()} does not match ETag {etag}")
    return None
