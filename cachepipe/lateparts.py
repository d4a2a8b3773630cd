"""Late parts: which part in flight is requested a second time, and that second request (a
hedge). The fetcher's side of hedged requests: when is :func:`~cachepipe.fetch_policy.hedge_in`
(pure); the race of the two requests, in which no write of the one that lost reaches the file
after the other won, is :mod:`cachepipe.hedging`. Bookkeeping under the fetcher's parts lock,
and one request; :class:`~cachepipe.fetcher.Fetcher` decides which thread makes it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator

from .catalog import FileEntry
from .downloads import get_part
from .errors import is_transient
from .fetch_policy import hedge_in
from .finishing import _Finishing, _Job, _local_error
from .hedging import Flight
from .partqueue import Started

__all__: list[str] = []

log = logging.getLogger("cachepipe.fetcher")  # the fetcher's, as before the move

_Part = tuple[Started[_Job], FileEntry, str, int, int]
"""A part taken from the queue (:meth:`PartQueue.take`): its item, file, local path and range."""


class _LateParts(_Finishing):
    """Parts in flight that may run late, and their second requests:
    :class:`~cachepipe.fetcher.Fetcher`'s base (above :class:`~cachepipe.finishing._Finishing`)."""

    # set by Fetcher.__init__, which says what each holds
    _flights: dict[int, Flight]
    _conditional: bool
    _job_errors: threading.Lock

    def _parts_done(self, parts: list[_Part]) -> None:
        """Count parts done (:meth:`cachepipe.fetcher.Fetcher._parts_done`)."""
        raise NotImplementedError

    @staticmethod
    def _whole(part: _Part) -> bool:
        """The part is its file, whole (created by its request, so never raced: a second request
        would truncate what the first wrote)."""
        return part[3] == 0 and part[4] == part[1].size

    def _hedges(self, served: int) -> Iterator[tuple[float | None, Flight]]:
        """Each part in flight that may be hedged: the last of its item (every other part came,
        nothing more to request, no error), not hedged yet, and of an item two or more of whose
        other parts came; with the seconds until :func:`hedge_in` says to where the consumers
        are now (0 or less: now), or None while its item has too many ahead of it. Under the
        parts lock. ``served``: see :meth:`cachepipe.broker.Broker.served`."""
        now = time.perf_counter()
        for flight in self._flights.values():
            started = flight.part[0]
            if flight.hedge is not None or flight.over or started.todo or started.running > 1 or started.job.error is not None:
                continue
            running = now - flight.began
            if hedge_in(running, started.came, 0) is None:
                continue  # too few of its other parts came to say when: the next that comes says
            yield hedge_in(running, started.came, started.turn - served), flight

    def _late_part(self, served: int) -> Flight | None:
        """A part in flight due to be requested again (:meth:`_hedges`), marked as hedged; or None."""
        for due, flight in self._hedges(served):
            if due is not None and due <= 0:
                flight.race()
                return flight
        return None

    def _hedge_wait(self, served: int, outpaced: bool) -> float | None:
        """Seconds until the first part in flight is due to be hedged (:meth:`_hedges`); ``math.inf``
        if none is due where the consumers are now, or while they outpace the items (``outpaced``:
        none is hedged then), but one may be once they move on: a hand-out wakes the waiting thread
        (:meth:`~cachepipe.fetcher.Fetcher._consumers_moved`); None if none may be before
        another part comes."""
        waits = (math.inf if outpaced or due is None else max(due, 0.001) for due, _flight in self._hedges(served))
        return min(waits, default=None)

    def _hedge(self, flight: Flight) -> list[tuple[float, float]]:
        """Request a late part again, from the bytes its first request has not written yet on
        (:mod:`cachepipe.hedging`); if this request ends first, count the part done. Returns no
        paces (the request is not a part's usual one).

        Its error is sorted as any request's (:meth:`~cachepipe.fetcher.Fetcher._get_with_retries`).
        A transient one (a retry may get past it) or the local disk's is the first request's to
        meet, if it is real: that one goes on alone. Any other is the store's answer about the
        object itself (changed since it was listed, gone, denied), which a retry of the first
        request would get too: the item's error, and it fails now (this request ends first, so
        the part is counted done and the first one's writes are refused), not once the first
        request, late, ends."""
        started, f, local, _start, end = flight.part
        job = started.job
        racer = flight.hedge
        assert racer is not None  # noqa: S101 - _late_part started the race
        begin = flight.part[3] + flight.written()
        if begin >= end or flight.over or self._stop.is_set() or job.disk_error is not None:
            return []
        self.counters.add(hedges=1)
        etag = f.etag if self._conditional else None
        try:
            got = get_part(self._store, f.key, local, begin, end, False, self._cache.file_calls, etag, racer)
        except Exception as exc:  # noqa: BLE001 - sorted below: lost the race, the first request's to meet, or the item's
            if racer.lost() or self._stop.is_set() or is_transient(exc) or _local_error(exc) is not None:
                log.debug("the second request of %s bytes %d-%d ended: %r", f.key, begin, end, exc)
                return []
            with self._job_errors:
                if job.error is None:
                    job.error, job.error_key = exc, f.key
            if racer.claim():
                self._parts_done([flight.part])
            return []
        self.counters.answered(got)
        if got == end - begin and racer.claim():
            log.debug("the second request of %s bytes %d-%d came first", f.key, begin, end)
            self._parts_done([flight.part])
        return []
