"""The lifecycle of a :class:`~cachepipe.pipeline.Pipeline` below its public
:meth:`~cachepipe.pipeline.Pipeline.open` and :meth:`~cachepipe.pipeline.Pipeline.close`: its
states (unopened, open, closed), the check that a call finds it open and in the process that
opened it (:meth:`_Lifecycle._require_open`), and the core's parts started in order at open (the
cache opened, the catalog step run, the fetcher started: :meth:`_Lifecycle._start`) and stopped
in the order that keeps a close prompt, when it closes or when its open fails (wakers first,
then the store's requests in flight cut, then the joins: :meth:`_Lifecycle._stop`).

:class:`_Lifecycle` is a base class of :class:`~cachepipe.pipeline.Pipeline` (not used alone),
under :class:`~cachepipe.handout._Handout` and over :class:`~cachepipe.passes._Pass`, whose
catalog step it runs; the attributes it shares with the pipeline are declared below and set by
``Pipeline.__init__`` and :meth:`_Lifecycle._start`.
"""

from __future__ import annotations

import os
import threading

from .broker import Broker
from .cache import Cache
from .delivered import CachedItem
from .fetcher import Fetcher
from .passes import _Pass
from .stores import Store
from .stores.base import abort_store

__all__: list[str] = []

_UNOPENED, _OPEN, _CLOSED = "unopened", "open", "closed"


class _Lifecycle(_Pass):
    """The lifecycle of a pipeline (see the module notes): a base of :class:`~cachepipe.pipeline.Pipeline`."""

    # set by Pipeline.__init__ (see there) and by _start
    _state: str
    _pid: int
    _abort_lock: threading.Lock
    _opening: Store | None
    _owns_store: bool
    _handed: dict[str, CachedItem]
    _store: Store
    _fetcher: Fetcher

    def _start(self, store: Store, cache: Cache, broker: Broker[str]) -> None:
        """Open ``cache``, run the catalog step over ``store`` and start the fetcher: the core's
        parts, set on the pipeline as they are made (``broker`` is replaced by a node pipeline's
        catalog step). If any of it fails, what was started is stopped (wakers first, then the
        store's requests in flight cut, then the joins, as :meth:`_stop`), the cache closed and
        the error raised: :meth:`~cachepipe.pipeline.Pipeline.open` closes the store."""
        cfg = self.config
        fetcher: Fetcher | None = None
        cache.open()
        try:
            self._broker, self._cache = broker, cache
            steps = self._catalog(store, cache)
            broker = self._broker  # a node pipeline's catalog step replaces it by its lanes' queues
            listing = self._listing
            fetcher = Fetcher(store, cache, broker, steps, cfg, listing.upcoming if listing is not None else None)
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
            if self._owns_store:  # a store given as it is (no view) is its owner's: waited for
                abort_store(store)
            if self._listing is not None:
                self._listing.stop()
            if fetcher is not None:
                fetcher.stop()
            cache.close()
            raise

    def _stop(self) -> None:
        """Stop the core's parts of an open pipeline, in the order that keeps it prompt: wakers
        first, then the store's requests in flight cut (its ``abort()``), then the joins; then
        the cache closed (its items deleted unless ``keep_on_close``: the objects of those still
        handed out then raise ``FileNotFoundError``), the store (one it opened, or its view of
        one given: not a store given without a view, its owner's) and the progress bar."""
        self._broker.close()
        self._cache.interrupt()
        if self._listing is not None:
            self._listing.interrupt()
        self._fetcher.interrupt()  # before the abort: a request it cuts is neither retried nor reported
        if self._owns_store:  # a store given as it is (no view) is its owner's: waited for
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
        if self._owns_store:
            self._store.close()
        if self._bar is not None:
            self._bar.close()

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
