"""The consumer's side of a :class:`~cachepipe.pipeline.Pipeline`, below its public methods:
the broker's next items with the stall warning (``stall_warning``), an item failed in its turn
(skipped or raised, as ``on_error``/``on_oversize`` say), and which lease a consumer names by an
item or its path, with the error when the broker refuses it.

:class:`_Handout` is the base class of :class:`~cachepipe.pipeline.Pipeline` (not used alone)
and a subclass of :class:`~cachepipe.passes._Pass`, whose declared state it reads and whose
counters it counts skipped items in. The public methods that use it (``get``, ``ack``,
``release``, ``renew``) stay on the pipeline, the documented front-end;
:class:`~cachepipe.node.NodePipeline` uses it for its lanes' hand-outs too.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from .broker import Failed
from .delivered import CachedItem
from .errors import OversizeError, UnknownItemError
from .passes import _log_oversize_skipped, _Pass

__all__: list[str] = []

log = logging.getLogger("cachepipe")


class _Handout(_Pass):
    """The consumer's side of a pipeline (see the module notes): :class:`~cachepipe.pipeline.Pipeline`'s base."""

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
