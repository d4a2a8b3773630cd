"""``Closer``: close the pipelines whose cache directory was removed, each in a thread of its own.

Closing a pipeline waits for its downloads in flight to end (``Pipeline.close``), which takes as
long as a read from a store that stopped answering may (a minute). The thread that finds a cache
removed is a request thread (a health check, a consumer's ``next``) or the daemon's main thread
(the periodic check, which sends systemd's heartbeats and handles signals): it marks the
pipeline down and hands the close to a :class:`Closer`, so that it answers at once. Opening a
pipeline (or a job) of the same name again first waits for its close (:meth:`Closer.wait`), and
the daemon's stop waits for all of them (:meth:`Closer.wait_all`): no thread outlives the daemon.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

__all__ = ["Closer"]

log = logging.getLogger("cachepipe.service")


class _Closable(Protocol):
    def close(self) -> None: ...


class Closer:
    """Closes pipelines in the background, one thread per pipeline, joined on demand."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[str, threading.Thread] = {}

    def close(self, key: str, pipeline: _Closable) -> None:
        """Close ``pipeline`` (known as ``key``, e.g. ``train`` or ``job/NAME``) in a thread;
        returns at once. A close that fails is logged."""
        self.wait(key)  # an earlier close of the same key (already done: its pipeline was opened after it)
        thread = threading.Thread(target=self._close, args=(key, pipeline), name=f"cachepipe-close-{key}", daemon=False)
        with self._lock:
            self._threads[key] = thread
        thread.start()

    @staticmethod
    def _close(key: str, pipeline: _Closable) -> None:
        started = time.monotonic()
        try:
            pipeline.close()
        except Exception:  # closing what is left of a removed cache: logged, the pipeline is down either way
            log.exception("closing %s after its cache directory was removed failed", key)
            return
        log.info("closed %s after its cache directory was removed (%.1f s)", key, time.monotonic() - started)

    def wait(self, key: str) -> None:
        """Wait until the close of ``key`` (if one is under way) has ended."""
        with self._lock:
            thread = self._threads.pop(key, None)
        if thread is None:
            return
        if thread.is_alive():
            log.info("waiting for %s to finish closing (downloads in flight end first)", key)
        thread.join()

    def wait_all(self) -> None:
        """Wait for every close under way."""
        with self._lock:
            keys = list(self._threads)
        for key in keys:
            self.wait(key)
