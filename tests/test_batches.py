"""Hand-out and acknowledgement in batches: ``get_many`` and ``ack_many``, and how the daemon
client's iterator sizes its batches (issue #19, item 4)."""

from __future__ import annotations

import contextlib
import errno
import gc
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import fsspec
import pytest
from crashfs import CrashFs
from sampling import block_of
from waiting import wait_until

from cachepipe import ItemFailedError, Pipeline, UnknownItemError
from cachepipe.blocks import round_up
from cachepipe.cache import STATE_DIR, Cache
from cachepipe.cache.core import journal_budget_of
from cachepipe.catalog import Catalog
from cachepipe.client import ITER_MOST, iter_batch
from cachepipe.node import NodePipeline
from cachepipe.stores.base import ObjectInfo
from cachepipe.stores.fsspec import FsspecStore


def journal_lines(cache_dir) -> list[str]:
    return (cache_dir / STATE_DIR / "journal").read_text().splitlines()


def test_get_many_takes_what_is_ready_in_order_and_ack_many_acks_it_all(s3_source, tmp_path):
    s3_source.folders(12, {"f": 100})
    cache = tmp_path / "c"
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, auto_ack=False) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 12)
        first = pipe.get_many(5, timeout=30)
        assert [item.name for item in first] == [f"item{i:03d}" for i in range(5)]
        rest = pipe.get_many(100, timeout=30)  # no more than is there, and no waiting for more
        assert [item.name for item in rest] == [f"item{i:03d}" for i in range(5, 12)]
        assert pipe.get_many(3, timeout=30) == []  # the end
        pipe.ack_many([*first, *rest])
        assert not any(item.path.exists() for item in first + rest)
        stats = pipe.stats()
        assert stats.items_acked == 12 and stats.bytes_in_cache < 12 * 100 + stats.capacity // 2
        acks = [line for line in journal_lines(cache) if line.startswith("A ")]
        assert sorted(acks) == sorted(f"A 0 item{i:03d}" for i in range(12))


def test_ack_many_is_all_or_nothing(s3_source, tmp_path):
    s3_source.folders(3, {"f": 100})
    cache = tmp_path / "c"
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, auto_ack=False) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 3)
        a, b, c = pipe.get_many(3, timeout=30)
        with pytest.raises(UnknownItemError, match="nope"):
            pipe.ack_many([a, b, cache / "nope"])
        with pytest.raises(UnknownItemError, match="given twice"):
            pipe.ack_many([a, str(a)])
        with pytest.raises(UnknownItemError, match="handed out under another lease"):
            pipe.ack_many([a, (b.path, "not-its-lease")])  # says why, not "not an item handed out"
        assert a.path.exists() and b.path.exists()  # nothing was acknowledged: still leased
        assert pipe.stats().items_acked == 0
        assert not [line for line in journal_lines(cache) if line.startswith("A ")]
        pipe.ack_many([(str(a), a.lease), b, str(c)])  # (path, lease) pairs and plain paths too
        assert pipe.stats().items_acked == 3
        with pytest.raises(UnknownItemError, match="already acknowledged"):
            pipe.ack_many([a])


def test_get_many_stops_before_a_failed_item_and_raises_it_in_its_turn(s3_source, tmp_path):
    s3_source.folders(4, {"f": 100})
    options = {"storage_options": s3_source.options, "auto_ack": False, "prefetch": 2}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 2)  # prefetch=2: nothing more until they are taken
        s3_source.delete("item002/f")  # vanishes between listing and download
        got = pipe.get_many(10, timeout=30)
        assert [item.name for item in got] == ["item000", "item001"]
        with pytest.raises(ItemFailedError, match="item002/f"):
            pipe.get_many(10, timeout=30)
        assert [item.name for item in pipe.get_many(10, timeout=30)] == ["item003"]


def test_get_many_with_on_error_skip_passes_the_failed_item(s3_source, tmp_path):
    s3_source.folders(4, {"f": 100})
    options = {"storage_options": s3_source.options, "on_error": "skip", "prefetch": 1}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 1)
        s3_source.delete("item001/f")
        names = []
        while batch := pipe.get_many(10, timeout=30):
            names += [item.name for item in batch]
            pipe.ack_many(batch)
        assert names == ["item000", "item002", "item003"] and pipe.stats().items_skipped == 1


def test_a_batch_of_acks_is_one_journal_write_and_single_files_are_unlinked_in_place(s3_source, tmp_path):
    """items='files': each item is one file, published by one rename; acking a batch of them
    makes one journal write for the acks (the position it moves to is written in front of the
    next event) and one unlink per item (no rename aside: an unlink is atomic too)."""
    data = {f"obj{i:03d}.bin": bytes([i]) * 50 for i in range(30)}
    for name, body in data.items():
        s3_source.put(name, body)
    got = {}
    options = {"storage_options": s3_source.options, "items": "files", "auto_ack": False}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 30)
        while batch := pipe.get_many(8, timeout=30):
            got.update({item.name: item.path.read_bytes() for item in batch})
            with CrashFs() as fs:  # no fault: it only records this thread's file-system mutations
                pipe.ack_many(batch)
            calls = [name for _n, name, _arg in fs.log]
            assert calls.count("write") == 1 and calls.count("unlink") == len(batch), fs.log
            assert "rename" not in calls, fs.log
    assert got == data


def test_bad_batch_sizes_and_node_pipelines_are_refused(s3_source, tmp_path):
    s3_source.folders(1, {"f": 10})
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options) as pipe:
        with pytest.raises(ValueError, match="count must be at least 1, got 0"):
            pipe.get_many(0)
        pipe.ack_many([])  # nothing to do
    node = NodePipeline(s3_source.url, tmp_path / "n", "1MiB", storage_options=s3_source.options, ranks=[0], world_size=1)
    with node, pytest.raises(TypeError, match="take_many"):
        node.get_many(4)


def test_iter_batch_covers_a_few_milliseconds_of_the_loop_body():  # Client.__iter__'s batches
    assert iter_batch(None) == 1  # nothing known yet: one
    assert iter_batch(0.0) == ITER_MOST
    assert iter_batch(1e-6) == ITER_MOST  # capped
    assert iter_batch(0.001, window=0.005) == 5
    assert iter_batch(0.004, window=0.005) == 1
    assert iter_batch(0.25) == 1  # a training step per item: one at a time, as before


@pytest.fixture
def files_cache(tmp_path):
    """An open 1 MiB cache of single-file items, recovered empty, and ``item(name, size)``."""
    cache = Cache(tmp_path / "c", 1 << 20)
    cache.open()
    try:
        cache.recover(Catalog(mode="files"), resume=False)
        yield cache, lambda name, size: Catalog.from_listing([ObjectInfo(name, size)], mode="files")[0]
    finally:
        cache.close()


def test_the_planner_reserves_the_items_that_fit_now_in_one_round_and_stops_at_one_that_waits(files_cache):
    cache, item = files_cache
    a, b, c, d = (item(name, 300 * 1024) for name in "abcd")
    assert cache.ledger.fits(4 * 300 * 1024 - 1) is False  # the state budget takes part of the MiB
    assert cache.acquire_many([(a, 0), (b, 0), (c, 0), (d, 0)]) == 3  # d would wait for space
    assert cache.ledger.reserved == 3 * 300 * 1024
    assert cache.acquire_many([(d, 0)]) == 0  # still no room: acquire() waits for it, not this
    cache.unreserve(300 * 1024, "a")
    assert cache.acquire_many([(b, 0), (d, 0)]) == 0  # b is claimed (on its way): acquire() waits for its copy
    assert cache.acquire_many([(d, 0), (a, 0)]) == 1  # room for one again, and a's claim is gone
    assert cache.ledger.reserved == 3 * 300 * 1024


def test_the_planner_leaves_an_item_recovered_or_shelved_to_acquire(files_cache):
    cache, item = files_cache
    a, b = item("a", 10), item("b", 10)
    assert cache.acquire_many([(a, 0)]) == 1
    staged = Path(cache.stage(a))
    staged.write_bytes(b"x" * 10)
    path = Path(cache.publish(staged, a))
    cache.shelve("a")  # a lane moved away from it: on disk, for the step that reaches it again
    assert cache.acquire_many([(b, 0)]) == 0  # a recovered copy may be in the way: acquire() decides
    assert cache.acquire(a) == path  # handed over, not fetched again
    assert cache.acquire_many([(b, 0)]) == 1
    cache.close()
    assert cache.acquire_many([(item("c", 10), 0)]) == 0


def test_an_item_shelved_while_a_download_waits_for_room_is_dropped_to_make_it(files_cache):
    """A node's lane that moves back shelves what it held after the planner, woken by the move,
    reached its next step: that step already waited for room, and the room check for shelved
    items came only before the wait. It waited for ever (a resumed node-mode dataset's second
    pass hung in 3 of 4 runs). The wait now ends when a shelved item is in the way."""
    cache, item = files_cache
    a, c = item("a", 600 * 1024), item("c", 600 * 1024)
    assert cache.acquire(a) is True
    staged = Path(cache.stage(a))
    staged.write_bytes(b"x" * a.size)
    path = Path(cache.publish(staged, a))  # a lane holds it
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(cache.acquire(c)))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # no room for c beside a: it waits
    cache.shelve("a")  # the lane moved away from a
    waiter.join(10)
    assert got == [True] and not path.exists()  # a dropped, c reserved
    assert not waiter.is_alive()


class Faulty(FsspecStore):
    """fsspec's memory store, where ``gone`` is missing when fetched (not transient) and ``flaky``
    fails once with a cut connection (transient, retried)."""

    def __init__(self, root: str, gone: str, flaky: str) -> None:
        super().__init__(root)
        self.gone, self.flaky, self.cut = gone, flaky, False

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        if key.endswith(self.gone):
            raise FileNotFoundError(key)
        if key.endswith(self.flaky) and not self.cut:
            self.cut = True
            raise ConnectionResetError("cut (injected)")
        return super().get(key, out, start, end)


def test_runs_of_cheap_requests_lose_nothing_when_one_of_their_items_fails(tmp_path):
    # A memory store's requests cost less than their work: the planner starts its items in runs
    # and the download threads take their parts in runs. A failure inside a run is that item's.
    root, fs = "memory://runs/data", fsspec.filesystem("memory")
    for i in range(400):
        fs.pipe_file(f"{root}/{i:05d}", bytes([i % 256]) * 10)
    try:
        store = Faulty(root, gone="00150", flaky="00151")
        options = {"items": "files", "store": store, "on_error": "skip", "retry_backoff": 0.001, "auto_ack": False}
        # in whole blocks: the journal's budget of 400 names, the state folder's files (a few
        # blocks), and two runs of 64 items of a block each (64 KiB held the budget and 10-byte items)
        block = block_of(tmp_path)
        capacity = round_up(journal_budget_of(5 * 400, 400, versions=False), block) + 8 * block + 2 * 64 * block
        with Pipeline(root, tmp_path / "c", capacity, **options) as pipe:
            names = []
            while batch := pipe.get_many(64, timeout=30):
                assert all(item.path.read_bytes() == bytes([int(item.name) % 256]) * 10 for item in batch)
                names += [item.name for item in batch]
                pipe.ack_many(batch)
            stats = pipe.stats()
        assert names == [f"{i:05d}" for i in range(400) if i != 150]  # in order, each once
        assert (stats.items_failed, stats.items_skipped, stats.retries) == (1, 1, 1)
        left = sorted(path.relative_to(tmp_path / "c").as_posix() for path in (tmp_path / "c").rglob("*"))
        # no staging or item left behind
        assert left == [STATE_DIR, f"{STATE_DIR}/held", f"{STATE_DIR}/journal", f"{STATE_DIR}/lock"]
    finally:
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]


@contextlib.contextmanager
def tiny_items(root: str, n: int, items: str) -> Iterator[int]:
    """``n`` tiny items under ``root`` in fsspec's memory store: single files of 1 byte, or
    folders of ``a.txt`` (2 bytes) and ``b/c.bin`` (1 byte); yields the objects the garbage
    collector tracks once they are made (after a collection), and removes them on leaving."""
    fs = fsspec.filesystem("memory")
    for i in range(n):
        if items == "files":
            fs.pipe_file(f"{root}/{i:05d}", b"x")
        else:
            fs.pipe(f"{root}/{i:05d}/a.txt", b"xy")
            fs.pipe(f"{root}/{i:05d}/b/c.bin", b"z")
    try:
        gc.collect()
        yield len(gc.get_objects())
    finally:
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]


@pytest.mark.parametrize("items", ["files", "folders"])
def test_items_waiting_for_the_consumer_are_not_tracked_by_the_garbage_collector(tmp_path, items):
    # Tiny items run far ahead of the consumer. What the pipeline keeps of each until it is
    # consumed used to be an Item, its files tuple and a FileEntry per file: three or four
    # objects per item that every full collection walked, every thread waiting.
    root, n = "memory://untracked/data", 3000
    with tiny_items(root, n, items) as before:
        with Pipeline(root, tmp_path / "c", "64MiB", items=items, shuffle=items == "folders") as pipe:
            wait_until(lambda: pipe.stats().items_ready == n)
            gc.collect()
            extra = len(gc.get_objects()) - before
            got = pipe.get_many(n)
            if items == "files":
                assert [(i.name, i.size, i.files) for i in got[:2]] == [("00000", 1, ("",)), ("00001", 1, ("",))]
            else:
                assert {(i.size, i.files) for i in got} == {(3, ("a.txt", "b/c.bin"))}
                assert sorted(i.name for i in got) == [f"{i:05d}" for i in range(n)]
                assert (got[0] / "b/c.bin").read_bytes() == b"z"
            pipe.ack_many(got)
        assert extra < n / 2, f"{extra} more objects tracked with {n} items ready"  # was 3 or 4 per item


@pytest.mark.parametrize("items", ["files", "folders"])
def test_the_node_keeps_fewer_tracked_objects_per_item_ready(tmp_path, items):
    # The node daemon's plan kept each item's Item, files tuple and FileEntries beside its own
    # record of the step (a _Planned, its Step and its Cursor): 6 or 7 tracked objects per item.
    root, n = "memory://untracked-node/data", 3000
    with tiny_items(root, n, items) as before:
        with NodePipeline(root, tmp_path / "n", "64MiB", items=items, ranks=[0], world_size=1) as node:
            wait_until(lambda: node.stats().items_ready == n)
            gc.collect()
            extra = len(gc.get_objects()) - before
            got = node.take_many(0, 0, (0, 0), count=n)
            assert len(got) == n and got[-1].item.name == f"{n - 1:05d}"
            if items == "files":
                assert [(t.item.name, t.item.size, t.item.files) for t in got[:2]] == [("00000", 1, ("",)), ("00001", 1, ("",))]
                assert got[-1].item.path.read_bytes() == b"x"
            else:
                assert {(t.item.size, t.item.files) for t in got} == {(3, ("a.txt", "b/c.bin"))}
                assert (got[-1].item / "b/c.bin").read_bytes() == b"z"
            node.consume(0, 0, got[-1].after)
        assert extra < 4.5 * n, f"{extra} more objects tracked with {n} items ready"  # was 6 or 7 per item


def test_a_planning_error_after_part_of_a_run_started_comes_after_those_items(tmp_path, monkeypatch):
    # A resumed pass leaves out of its runs the steps acknowledged before the restart, so a run's
    # seqs can skip one (2 here). Planning breaks at c, after a and b started together: the
    # error is handed out in c's turn (3), after a and b, not in the skipped step's.
    from cachepipe.broker import Broker, Failed
    from cachepipe.config import PipelineConfig
    from cachepipe.fetcher import Fetcher

    root, fs = "memory://gap/data", fsspec.filesystem("memory")
    for name in "abc":
        fs.pipe_file(f"{root}/{name}", b"x" * 10)
    catalog = Catalog.from_listing([ObjectInfo(name, 10) for name in "abc"], mode="files")
    acquire, acquire_many = Cache.acquire, Cache.acquire_many

    def acquire_or_fail(self, item, *args, **kwargs):
        if item.name == "c":
            raise RuntimeError("planning broke at c (injected)")
        return acquire(self, item, *args, **kwargs)

    monkeypatch.setattr(Cache, "acquire", acquire_or_fail)
    monkeypatch.setattr(Cache, "acquire_many", lambda self, items, *args: acquire_many(self, items[:2], *args))  # c waits
    cache = Cache(tmp_path / "c", 1 << 20)
    cache.open()
    broker: Broker = Broker(ordered=True)
    cfg = PipelineConfig(source=root, cache_dir=tmp_path / "c", capacity="1MiB", items="files")
    fetcher = Fetcher(FsspecStore(root), cache, broker, [[(0, catalog[0], 0), (1, catalog[1], 1), (3, catalog[2], 3)]], cfg)
    try:
        cache.recover(catalog, resume=False)
        broker.skip(2)
        fetcher.start()
        got = [broker.take(timeout=30) for _ in range(3)]
        assert [lease.name for lease in got[:2]] == ["a", "b"]
        assert isinstance(got[2], Failed) and got[2].seq == 3 and got[2].kind == "stream"
    finally:
        broker.close()
        cache.interrupt()
        fetcher.stop()
        cache.close()
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]


class FailsOnce(FsspecStore):
    """fsspec's memory store; the first get of ``key`` fails with ``error`` (``retried``: it was
    asked for again since)."""

    def __init__(self, root: str, key: str, error: OSError) -> None:
        super().__init__(root)
        self.key, self.error, self.failed, self.retried = key, error, False, False

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        if key.endswith(self.key):
            self.retried, self.failed = self.failed, True
            if not self.retried:
                raise self.error
        return super().get(key, out, start, end)


@pytest.mark.parametrize(
    "error", [ConnectionResetError("cut (injected)"), OSError(errno.ENOSPC, "No space left on device (injected)")], ids=str
)
def test_an_item_retried_in_a_run_does_not_hold_the_items_before_it(tmp_path, error):
    # Requests of a memory store cost less than their work: once the first parts show it, the
    # download threads take runs of up to 16 parts. Item 01000 fails once and waits its backoff
    # (at least 2.5 s) before it is fetched again: the items before it, in its run too, are
    # published meanwhile and handed out at once.
    root, fs = "memory://held/data", fsspec.filesystem("memory")
    for i in range(1200):
        fs.pipe_file(f"{root}/{i:05d}", b"x" * 10)
    try:
        store = FailsOnce(root, "01000", error)
        options = {"items": "files", "store": store, "retry_backoff": 5.0, "retry_backoff_max": 5.0}
        with Pipeline(root, tmp_path / "c", "64MiB", **options) as pipe:
            names = [pipe.get(timeout=30).name for _ in range(1000)]  # up to 00999 (leased, not acked: room enough)
            handed_before_the_retry = not store.retried
            rest = [item.name for item in pipe]
        assert names + rest == [f"{i:05d}" for i in range(1200)]
        assert store.failed and store.retried
        assert handed_before_the_retry  # not held behind 01000's backoff (a timed assertion before: under 2 s)
    finally:
        fs.store.clear()
        fs.pseudo_dirs[:] = [""]


def test_a_plan_given_in_runs_gives_the_steps_before_an_error_then_the_error():
    from cachepipe.passes import _in_runs

    def steps():
        yield from range(5)
        raise RuntimeError("no items for this share (injected)")

    runs = _in_runs(steps(), 2)
    assert [next(runs), next(runs), next(runs)] == [[0, 1], [2, 3], [4]]  # the last one short, before the error
    with pytest.raises(RuntimeError, match="injected"):
        next(runs)
    assert list(_in_runs(iter(range(4)), 2)) == [[0, 1], [2, 3]]
