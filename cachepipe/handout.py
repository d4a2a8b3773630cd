"""The consumer's side of a :class:`~cachepipe.pipeline.Pipeline`, below its public methods:
the broker's next items with the stall warning (``stall_warning``), an item failed in its turn
(skipped or raised, as ``on_error``/``on_oversize`` say), the items taken made into
:class:`~cachepipe.delivered.CachedItem` objects and counted, the check that the cache directory
is still there (at most every :data:`CACHE_CHECK_SECONDS`), which lease a consumer names by an
item or its path, with the error when the broker refuses it, and the acks: the items evicted at
their steps, the steps consumed.

:class:`_Handout` is the base class of :class:`~cachepipe.pipeline.Pipeline` (not used alone)
and a subclass of :class:`~cachepipe.lifecycle._Lifecycle` (over
:class:`~cachepipe.passes._Pass`), whose declared state it reads and whose counters it counts
items in. The public methods that use it (``get``, ``get_many``, ``ack``, ``ack_many``,
``release``, ``renew``, ``check_cache``) stay on the pipeline, the documented front-end;
:class:`~cachepipe.node.NodePipeline` uses it for its lanes' hand-outs too.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from typing import Any

from .broker import Closed, Failed, Lease
from .delivered import CachedItem, Skipped
from .errors import OversizeError, UnknownItemError
from .lifecycle import _Lifecycle
from .passes import _log_oversize_skipped
from .sizes import format_size

__all__ = ["CACHE_CHECK_SECONDS"]

log = logging.getLogger("cachepipe")

CACHE_CHECK_SECONDS = 1.0
"""How often, at most, :meth:`Pipeline.get_many` checks that the cache directory is still there
(two ``stat`` calls; see :meth:`Pipeline.check_cache`)."""


class _Handout(_Lifecycle):
    """The consumer's side of a pipeline (see the module notes): :class:`~cachepipe.pipeline.Pipeline`'s base."""

    _cache_checked: float  # set by Pipeline.__init__, which says what it holds

    def check_cache(self) -> None:
        """Raise if the cache directory was removed or replaced (:meth:`cachepipe.pipeline.Pipeline.check_cache`)."""
        raise NotImplementedError

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
                if got.kind == "stream":  # listing or planning stopped: not an item to skip, the rest is unknown
                    raise got.error.with_traceback(got.trace)  # by every later get too: as reported, not grown
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
                for lease, item in zip(got, items, strict=True):
                    self._handed[lease.name] = item  # replaces the object of its expired lease, if any
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

    def _lease(self, path: str | os.PathLike[str], verb: str, lease: str | None) -> Lease[str]:
        self._require_open()
        name, lease, _path = self._lease_key(path, lease)
        action = {"release": self._broker.release, "renew": self._broker.renew}[verb]
        try:
            return action(name, lease)
        except KeyError as exc:
            raise self._not_handed_out(verb, path, exc.args[1]) from None

    def _ack_many(self, items: Iterable[str | os.PathLike[str] | tuple[str | os.PathLike[str], str]]) -> None:
        """:meth:`~cachepipe.pipeline.Pipeline.ack_many`: the leases taken back from the broker,
        the items evicted at their steps (given back to the broker if that fails), their steps
        consumed and their objects ended."""
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
            handed = [self._handed_end(lease) for lease in taken]
        for item in handed:
            if item is not None:
                item._gone = "acknowledged"  # noqa: SLF001 - the pipeline ends its items' lives

    def _handed_end(self, lease: Lease[str]) -> CachedItem | None:
        """The object handed out under ``lease``, no longer held in :attr:`_handed` (None: it is
        not there; the item was handed out again since). Under ``_counts_lock``."""
        item = self._handed.get(lease.name)
        if item is None or item.lease != lease.id:
            return None
        return self._handed.pop(lease.name)

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
            held = ""
            if counts["handed"] and not counts["pending"]:
                short = self._cache.shortfall()
                held = (
                    (f"; the next item waits for {format_size(short)} more room" if short else "")
                    + "; items handed out and not acknowledged hold their space: ack or release them, or, for a "
                    "consumer that keeps items while it asks for more, give a capacity that holds the items you "
                    "keep, the next one and the cache's state"
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

    def _lease_key(self, path: str | os.PathLike[str], lease: str | None) -> tuple[str, str | None, str | os.PathLike[str]]:
        """``(name, lease, path)`` of an item a consumer names by its :class:`CachedItem` or path."""
        if isinstance(path, CachedItem):
            return path.name, lease or path.lease, path
        return self._name_of(path), lease, path

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
