"""How a fetched item ends: checked, prepared, published in runs, restarted after a disk
error, or reported failed.

:class:`_Finishing` is the base class of :class:`~cachepipe.fetcher.Fetcher` (not used alone):
once a download thread counts an item's last part done, the item is published as it is (by
runs: one journal write and one hand-over to the broker for every item queued meanwhile), or
checked against its ETag and unpacked or prepared first, or, after a local write error or an
ETag mismatch, its staging is freed and the item restarted after a backoff, keeping its
reservation and its place in line; any other error discards its staging, gives back its space
and reports it in its turn. Invariant: an item is published only whole and verified, and a
failed one is always reported, never lost. The attributes are set by
:meth:`~cachepipe.fetcher.Fetcher.__init__`.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .backoff import backoff_delay
from .blocks import folders_made, round_up
from .broker import Broker
from .cache import Cache, tree_bytes
from .catalog import Item
from .config import PipelineConfig
from .downloads import LocalWriteError
from .errors import ItemFailedError, PrepareOverflowError, VerificationError
from .removal import delete_tree
from .stores.base import Store
from .unpack import DEFAULT_MAX_MEMBERS, unpack_in_place

__all__: list[str] = []

log = logging.getLogger("cachepipe.fetcher")


_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


def _local_error(exc: BaseException) -> OSError | None:
    """``exc`` if it is the local disk's (a staging write failed, or the disk is full or
    failing), not the store's: the item restarts from scratch (:meth:`_Finishing._retry_disk_error`); else None."""
    if isinstance(exc, LocalWriteError) or (isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS):
        return exc
    return None


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


class FetchCounters:
    """Producer-side counters, read by :meth:`cachepipe.Pipeline.stats`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes_downloaded = 0
        self.requests = 0
        self.retries = 0
        self.hedges = 0
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


class _Finishing:
    """The end of an item's download (see the module notes): :class:`~cachepipe.fetcher.Fetcher`'s base."""

    # set by Fetcher.__init__, which says what each holds
    counters: FetchCounters
    _store: Store
    _cache: Cache
    _broker: Broker[str]
    _cfg: PipelineConfig
    _stop: threading.Event
    _pool: ThreadPoolExecutor
    _prepare_pool: ThreadPoolExecutor | None
    _publish_lock: threading.Lock
    _to_publish: list[_Job]
    _publishing: bool

    def _start(self, seq: int, item: Item, extra: int, turn: int, attempt: int = 0) -> None:
        """Stage an item and queue its bytes again (:meth:`cachepipe.fetcher.Fetcher._start`)."""
        raise NotImplementedError

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
        self._cache.discard(job.staged, self._cache.charge(job.item, job.extra), job.item.name)
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
            cache = self._cache
            got = cache.publish_many([(job.staged, job.item, cache.charge(job.item)) for job in jobs])
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

    def _prepare_and_publish(self, job: _Job) -> None:
        """Unpack and/or run the prepare hook on a verified staged item, measure it, publish it
        (prepare pool). The extraction may add at most ``job.extra`` bytes beside the archives."""
        item, reserved, staged = job.item, self._cache.charge(job.item, job.extra), Path(job.staged)
        block = self._cache.block
        try:
            if self._cfg.unpack:
                # the extraction in whole blocks and its folders, as the item is measured below: it
                # takes at most the extra reserved beside the item (rounded up to whole blocks)
                unpack_in_place(
                    staged,
                    name=item.name,
                    limit_bytes=round_up(job.extra, block),
                    block=block,
                    max_members=DEFAULT_MAX_MEMBERS,
                    stop=self._stop,
                    advice=self._cfg.unpack_advice(item.size, job.extra, block, item.is_file),
                )
                if self._stop.is_set():
                    return  # closing: the cache removes staging wholesale; the hook is not run
            if self._cfg.prepare is not None:
                self._cfg.prepare(staged)
            # what it takes, as the ledger charges items: its files in whole blocks, a block per folder,
            # those of a single object's name among them (made when it is published: folders_made)
            used = block + tree_bytes(staged, block=block) if staged.is_dir() else round_up(staged.stat().st_size, block)
            if item.is_file:
                used += folders_made((), True, item.name) * block
            if used > reserved:
                raise PrepareOverflowError(
                    f"prepare wrote item {item.name!r} up to {used} bytes (its files in whole blocks of {block} "
                    f"bytes, a block per folder), more than the {reserved} reserved ({item.size} listed, "
                    f"{self._cache.charge(item)} in blocks, + prepare_reserve/prepare_ratio)"
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

        The reservation is kept, so the cap holds and the item keeps its place in line. A
        staging area that cannot be deleted fails the item instead (its reservation given
        back, what is left counted as foreign until the next open, as by :meth:`Cache.discard`):
        a restart would download a second copy beside bytes counted nowhere.
        """
        if not isinstance(error, VerificationError):
            self.counters.add(disk_errors=1)
        left = delete_tree(job.staged, self._cache.block)  # logged if any
        if job.attempt >= self._cfg.retries or left:
            self._cache.unreserve(self._cache.charge(job.item, job.extra), job.item.name, left=left)
            self._report_failure(job.seq, job.item, job.item.name, error)
            return
        delay = backoff_delay(job.attempt, self._cfg.retry_backoff, self._cfg.retry_backoff_max)
        what = "verification failed" if isinstance(error, VerificationError) else "local disk error"
        log.warning("%s on %s (%s): staging freed, retrying the item in %.2fs", what, job.item.name, error, delay)
        if self._stop.wait(delay):
            return
        self._start(job.seq, job.item, job.extra, job.turn, job.attempt + 1)

    def _fail_reserved(self, seq: int, item: Item, extra: int, error: BaseException) -> None:
        """Give back the space reserved for ``item`` (its size and ``extra``) and report its failure."""
        self._cache.unreserve(self._cache.charge(item, extra), item.name)
        self._report_failure(seq, item, item.name, error)

    def _report_failure(self, seq: int, item: Item, key: str, error: BaseException) -> None:
        self.counters.add(items_failed=1)
        failure = ItemFailedError(item.name, f"{self._store.url.rstrip('/')}/{key}", error)
        failure.__cause__ = error
        log.error("%s", failure)
        self._broker.fail(seq, item.name, failure)


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
