"""The requests of the parts a download thread took: each made with retries (a transient
error is backed off on the stop event, the rest of the thread's run handed to another thread
before the first backoff; the local disk's error or the store's is recorded on the item, not
raised), timed, and counted done, so that the items whose last part came are finished
(:class:`~cachepipe.finishing._Finishing`). The parts' times choose how many download threads
take parts (:func:`~cachepipe.fetch_policy.download_threads`).

:class:`_PartRequests` is the base class of :class:`~cachepipe.fetcher.Fetcher` above
:class:`~cachepipe.lateparts._LateParts` (not used alone): which part a thread takes next (the
queue under the parts lock, a late part to hedge, or a wait) stays the fetcher's
(:meth:`~cachepipe.fetcher.Fetcher._take_and_fetch`). The attributes are set by
:meth:`~cachepipe.fetcher.Fetcher.__init__`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .backoff import backoff_delay
from .catalog import FileEntry
from .downloads import DownloadWorkers, get_part
from .errors import VerificationError, is_transient
from .fetch_policy import PACE_WINDOW, download_threads
from .finishing import _Job, _local_error
from .hedging import Racer
from .lateparts import _LateParts, _Part
from .partqueue import PartQueue, Started

__all__: list[str] = []

log = logging.getLogger("cachepipe.fetcher")  # the fetcher's, as before the move


class _PartRequests(_LateParts):
    """The requests of the parts taken, timed and counted done: :class:`~cachepipe.fetcher.Fetcher`'s
    base (above :class:`~cachepipe.lateparts._LateParts`)."""

    # set by Fetcher.__init__, which says what each holds
    threads: int
    _workers: DownloadWorkers | None
    _parts: PartQueue[_Job]
    _parts_lock: threading.Lock
    _parts_changed: threading.Condition
    _takers: int
    _watching: bool
    _paces: list[tuple[float, float]]
    _cheap: bool
    _publish_as_is: bool

    def _take_and_fetch(self, first: list[_Part] | None = None) -> None:
        """A download thread's task (:meth:`cachepipe.fetcher.Fetcher._take_and_fetch`)."""
        raise NotImplementedError

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
        done = list(parts)  # counted done here: all but a part whose second request came first
        for index, (started, f, local, start, end) in enumerate(parts):
            job = started.job
            flight = self._flights.get(id(parts[index]))  # registered by the thread that took it, removed once done
            if job.error is not None or job.disk_error is not None or self._stop.is_set():
                if flight is not None and not flight.first.claim():
                    done.remove(parts[index])
                continue
            handed: list[bool] = []  # the rest of the run handed to another thread (before a backoff)

            def hand_off(index: int = index, handed: list[bool] = handed) -> None:
                rest = parts[index + 1 :]
                if rest and not self._start_taker(rest):
                    return  # closing: the loop skips the rest and counts every part done once, at its end
                self._parts_done(parts[:index])  # after the hand-over: finishing them may wait a disk error's backoff
                handed.append(True)

            began = time.perf_counter()
            racer = None if flight is None else flight.first
            try:
                self._get_with_retries(job, f, local, start, end, hand_off if len(parts) > 1 else None, racer)
            except Exception as exc:  # a defect, not the store's error: the item fails (reported), never half-published
                if racer is None or not racer.lost():
                    log.exception("a download thread's part of %s failed unexpectedly", job.item.name)
                    with self._job_errors:
                        if job.error is None:
                            job.error, job.error_key = exc, f.key
            else:
                requests.append(time.perf_counter() - began)
            if flight is not None:
                if flight.first.claim():
                    flight.took = time.perf_counter() - began
                else:  # its second request came first, and counted it done
                    done.remove(parts[index])
            if handed:
                self._parts_done([parts[index]])
                return requests
        self._parts_done(done)
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
            for part in parts:
                flight = self._flights.pop(id(part), None)
                if flight is not None and flight.took is not None:
                    part[0].came.append(flight.took)
            if self._watching:  # a part came: another may be its item's last now, due sooner
                self._parts_changed.notify()
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
        self,
        job: _Job,
        f: FileEntry,
        local: str,
        start: int,
        end: int,
        before_backoff: Callable[[], None] | None = None,
        racer: Racer | None = None,
    ) -> None:
        """Request one part, retrying transient errors with backoff (``before_backoff`` is called
        once, before the first); an error is recorded on the job (``error``, or ``disk_error``
        for the local disk), not raised. ``racer``: the part may be raced by a second request
        (:meth:`_hedge`); once that one has won, this one ends, recording nothing."""
        cfg = self._cfg
        for attempt in range(cfg.retries + 1):
            if attempt and (job.error is not None or job.disk_error is not None):
                return  # another part failed during the backoff: the item fails or restarts without this one
            if racer is not None and racer.lost():
                return  # its second request came first during the backoff
            try:
                whole = start == 0 and end == f.size  # one part: the file is created here, not by stage()
                if self._workers is not None:  # whose stores are cachepipe's own, which take etag
                    got = self._workers.get(f.key, local, start, end, whole, f.etag)
                else:
                    etag = f.etag if self._conditional else None
                    got = get_part(self._store, f.key, local, start, end, whole, self._cache.file_calls, etag, racer)
                self.counters.answered(got)
                if got != end - start:
                    raise VerificationError(f"{f.key}: short body, {got} of {end - start} bytes at offset {start}")
                return
            except Exception as exc:  # noqa: BLE001 - sorted below: a local disk error, a transient one retried, else the item's failure
                if racer is not None and racer.lost():
                    return  # the second request came first (this one's error may be only its write refused)
                local_error = _local_error(exc)
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
