"""The download threads follow how long requests take (:func:`cachepipe.fetcher.download_threads`).

Where a request costs about nothing next to a part's own work (a ``memory://`` or local
source), a few threads take parts, not ``max_concurrency``: more would only take turns at the
interpreter's lock. Where requests are long, every thread the limit allows takes parts. The
store is fsspec's real memory store; its ``get`` is held or delayed to make requests long.
"""

from __future__ import annotations

import threading
import time
from typing import BinaryIO

import fsspec
import pytest
from waiting import wait_until

from cachepipe import Pipeline
from cachepipe.stores.fsspec import FsspecStore

ROOT = "memory://threads/data"


class TimedStore(FsspecStore):
    """The memory store, counting the gets in flight at once. ``delay``: seconds each get after
    the first ``delay_after`` sleeps; after ``free`` gets, every get waits for ``release``.
    ``peak_delayed``: the most gets in flight at once while delayed ones ran."""

    def __init__(self, delay: float = 0.0, free: int | None = None, delay_after: int = 0) -> None:
        super().__init__(ROOT)
        self.delay, self.free, self.delay_after = delay, free, delay_after
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.gets = self.in_flight = self.peak = self.peak_delayed = 0

    def hold(self) -> None:
        """Hold every get from now on until ``release``."""
        with self._lock:
            self.free = self.gets

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        with self._lock:
            self.gets += 1
            held = self.free is not None and self.gets > self.free
            delayed = self.delay and self.gets > self.delay_after
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            if delayed:
                self.peak_delayed = max(self.peak_delayed, self.in_flight)
        try:
            if delayed:
                time.sleep(self.delay)
            if held:
                assert self.release.wait(30), "the test never released the held gets"
            return super().get(key, out, start, end)
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.fixture
def files():
    """``n`` 1-byte single-file items in the memory store; removed afterwards."""
    fs = fsspec.filesystem("memory")
    made: list[str] = []

    def make(n: int) -> None:
        for i in range(n):
            fs.pipe_file(f"{ROOT}/{i:05d}", b"x")
            made.append(f"{i:05d}")

    yield make
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]


def test_requests_that_cost_nothing_are_made_by_a_few_threads(files, tmp_path):
    files(6000)
    store = TimedStore(free=3000)  # its gets cost nothing; held from the 3,000th on, or from hold()
    try:
        with Pipeline(ROOT, tmp_path / "cache", "64MiB", items="files", store=store, max_concurrency=64) as pipe:
            # The choice starts at the limit and falls as windows of parts are measured: by the
            # 1,000th get on a quiet machine; later on a busy one, where a request's wall time
            # also counts the waits for the interpreter's lock (a local run saw 40 there once).
            def chosen() -> int:
                threads = pipe.stats().download_threads
                return threads if threads <= 16 or store.gets >= 3000 else 0

            threads = wait_until(chosen, what="a choice of a few threads, or 3,000 gets")
            store.hold()
            gets = store.gets
            # every thread the pool has that takes a part now blocks in its get
            wait_until(lambda: store.in_flight >= 1, what="a held get")
            time.sleep(0.5)  # time for more threads to reach a get, if more take parts
            held = store.in_flight
            store.release.set()
            names = [item.name for item in pipe]
    finally:
        store.release.set()
    # of 64: the free gets took microseconds, a part's work more (2 or 3 on a quiet machine)
    assert threads <= 16, f"{threads} threads chosen after {gets} gets"
    assert sorted(names) == [f"{i:05d}" for i in range(6000)]  # nothing lost or repeated
    assert held <= 16  # the threads that took parts (the choice may have moved by one window since)
    assert store.peak <= 64


def test_long_requests_are_made_by_every_thread_the_limit_allows(files, tmp_path):
    # 200 ms requests: the limit wherever a part's own work takes under 6.4 ms of CPU (200/31; at
    # 50 ms requests, 1.6 ms, which a full suite on two busy cores passed: 31 threads chosen)
    files(200)
    store = TimedStore(delay=0.2)
    with Pipeline(ROOT, tmp_path / "cache", "64MiB", items="files", store=store, max_concurrency=32) as pipe:
        names = [item.name for item in pipe]
        threads = pipe.stats().download_threads
    assert len(names) == 200
    assert threads == 32
    assert store.peak == 32


def test_an_item_whose_requests_turn_slow_gets_its_threads_back(tmp_path):
    # One 48 MiB file in 256 KiB parts: the first 48 requests cost nothing (few threads are
    # chosen), the rest take 20 ms each. The threads come back for the rest of the same item:
    # up to max_large_requests (16) at once, not the few of the fast stretch.
    fsspec.filesystem("memory").pipe_file(f"{ROOT}/big/f", b"y" * (48 << 20))
    try:
        store = TimedStore(delay=0.02, delay_after=48)
        with Pipeline(ROOT, tmp_path / "cache", "1GiB", store=store, part_size="256KiB") as pipe:
            names = [item.name for item in pipe]
        assert names == ["big"]
        assert store.peak_delayed >= 12  # 16 on a quiet machine; 4 or 5 when threads did not come back
    finally:
        fsspec.filesystem("memory").store.clear()
        fsspec.filesystem("memory").pseudo_dirs[:] = [""]


def test_small_items_whose_requests_turn_slow_are_fetched_over_every_thread_again(files, tmp_path):
    # While requests cost nothing, a download thread takes parts of small items in runs; once
    # they turn slow (100 ms), one part per thread again, over every thread the limit allows.
    # (20 ms, on a loaded machine, left threads too little time to be in flight together: 17.)
    files(600)
    store = TimedStore(delay=0.1, delay_after=300)
    with Pipeline(ROOT, tmp_path / "cache", "64MiB", items="files", store=store, max_concurrency=32) as pipe:
        names = [item.name for item in pipe]
    assert names == [f"{i:05d}" for i in range(600)]
    # in runs of 16, the 300 slow ones would be 19 requests at most; one part per thread: up to 32
    # (23 in a full suite on a busy hour, where 24 was asked and the run failed)
    assert store.peak_delayed >= 20, store.peak_delayed
