"""The requests one ``cachepipe map`` run sends itself, besides its pipeline's downloads and its
uploads: the check of DST's bucket and the listing of SRC, retried as downloads are
(:meth:`_Remote._retrying`), and which items DST already marks done, for the version of their
input listed now (:meth:`_Remote._done`: their markers, checked concurrently).

:class:`_Remote` is the base class of :class:`~cachepipe.map.run._MapRun` (not used alone), whose
options (``cfg``) and stop event it reads.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..backoff import backoff_delay
from ..errors import is_transient
from ..stores.base import WritableStore
from .plan import MapConfig, MapItem
from .uploader import MARKER_LIMIT, marker_key, marker_version

__all__: list[str] = []

log = logging.getLogger("cachepipe.map")


class _Remote:
    """The run's own requests to SRC and DST (see the module notes): :class:`~cachepipe.map.run._MapRun`'s base."""

    cfg: MapConfig
    _stop: threading.Event

    # -- DST and SRC requests ---------------------------------------------------------------------------
    def _retrying(self, what: str, call: Callable[[], Any]) -> Any:
        cfg = self.cfg
        for attempt in range(cfg.request_retries + 1):
            try:
                return call()
            except Exception as exc:
                if not is_transient(exc) or attempt == cfg.request_retries:
                    raise
                delay = backoff_delay(attempt, cfg.retry_backoff, cfg.retry_backoff_max)
                log.warning("%s failed, retry %d/%d in %.2fs: %s", what, attempt + 1, cfg.request_retries, delay, exc)
                if self._stop.wait(delay):  # before any job starts; the stop of a failed check wakes it (Ctrl-C too)
                    raise InterruptedError(f"stopped while retrying {what}") from exc
        raise AssertionError("unreachable")

    def _done(self, dst: WritableStore, planned: list[MapItem]) -> set[str]:
        """Names of the items whose marker is in DST, for the version of their input listed now
        (checked concurrently: one HEAD per item without a version, one GET of its marker per
        item with one). A marker of another version is of an input rewritten since: the item is
        done again. A marker that records no version (written by an earlier cachepipe) counts."""
        if not planned:
            return set()

        def done(mi: MapItem) -> bool:
            key, version = marker_key(mi.name), mi.version
            if version is None:
                return bool(dst.exists(key))
            body = io.BytesIO()
            try:
                dst.get(key, body, 0, MARKER_LIMIT)
            except FileNotFoundError:
                return False
            recorded = marker_version(body.getvalue())
            if recorded not in (None, version):
                log.info("%s: input changed since it was done (version %s, now %s): doing it again", mi.name, recorded, version)
                return False
            return True

        pool = ThreadPoolExecutor(min(16, len(planned)), thread_name_prefix="cachepipe-map-check")
        try:
            flags = list(pool.map(lambda mi: self._retrying(f"checking {mi.name}", lambda: done(mi)), planned))
        except BaseException:  # a check failed for good, or Ctrl-C: the checks in flight stop retrying
            self._stop.set()
            raise
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        return {mi.name for mi, flag in zip(planned, flags, strict=True) if flag}
