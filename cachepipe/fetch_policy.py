"""The fetch policy: how big each ranged GET is, and how many download threads run.

Pure functions of numbers the fetcher measures or is configured with (no disk, no network,
unit-tested in ``tests/test_fetch_policy.py`` and ``tests/test_download_threads.py``):
:func:`auto_part_size` (the default ``part_size``), :func:`item_part_size` with
:func:`items_ahead` (the size of an item's next part, by the items ahead of it that count) and
:func:`download_threads` (Little's law over the requests' and the work's times). The
:class:`~cachepipe.fetcher.Fetcher` applies them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "HEAD_MIN_PART",
    "HEDGE_AFTER",
    "HEDGE_AHEAD",
    "HEDGE_MIN_S",
    "MAX_PART",
    "MIN_PART",
    "PACE_WINDOW",
    "auto_part_size",
    "download_threads",
    "hedge_in",
    "item_part_size",
    "items_ahead",
]


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
    (the slow consumer of ``benchmarks/bench_link.py``: stall after its first item 1.9% against
    3.8%, medians on a quiet machine)."""
    ahead = max(0, ahead)
    return ahead if fresh is None else max(0, min(ahead, fresh) - 1)


HEDGE_AFTER = 2.0
"""A part of an item the consumers want next is requested a second time (hedged) once it has run
this many times as long as the median of that item's parts that came (:func:`hedge_in`)."""

HEDGE_MIN_S = 0.2
"""Seconds a part runs at least before it is hedged: Linux's least TCP retransmission timeout.
A part late by less was not held by a lost packet, but by a busy CPU or a busy store, which a
second request would only make busier."""

HEDGE_AHEAD = 1
"""An item with more than this many items ahead of it (fetching, or ready and never handed out)
is not hedged: the consumers have those to read while its late part comes."""


def hedge_in(running_s: float, came_s: Sequence[float], ahead: int) -> float | None:
    """Seconds until a part that has run ``running_s`` seconds is to be requested again, from
    the bytes it has not written yet on, by a second request (the first to end wins, the other
    stops writing at once): 0 or less, now. None, never (for now): its item has more than
    :data:`HEDGE_AHEAD` items ahead of it (fetching, or ready and never handed out), or fewer
    than two of its other parts came (``came_s``, their seconds each). Else it is due once it
    has run :data:`HEDGE_AFTER` times their median, and at least :data:`HEDGE_MIN_S`.

    Why: a few parts in a hundred take several times as long as the others of their item (a
    lost packet at the end of a response waits for TCP's retransmission timeout, 0.2 s or more;
    a lost connection request, 1 s), and an item is ready only when its last part is. Asking
    again on another connection bounds that wait, at the cost of a part's bytes twice, for the
    items the consumers are about to take only (the slow consumer of
    ``benchmarks/bench_link.py``: see ``benchmarks/README.md``). Amazon's S3 guidelines give the
    same advice: retry the slow requests of a latency-sensitive application. The fetcher asks
    only while the consumers do not outpace the items
    (:meth:`cachepipe.broker.Broker.outpaced`): where the link is the limit, the other requests
    keep it busy meanwhile, and a second request would take its bytes from theirs (the video case
    of the same benchmark fell from 0.98 to 0.83 of the link when every late part was hedged)."""
    if ahead > HEDGE_AHEAD or len(came_s) < 2:
        return None
    return max(HEDGE_MIN_S, HEDGE_AFTER * statistics.median(came_s)) - running_s


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
