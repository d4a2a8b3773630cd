"""Core overheads without a network: hand-off rate, and memory for a very large catalog.

    .venv/bin/python benchmarks/bench_core.py                 # hand-offs of 10,000 items x 16 cases x 3, 1,000,000-item catalog
    .venv/bin/python benchmarks/bench_core.py --quick --json  # what the smoke test runs
    .venv/bin/python benchmarks/bench_core.py --no-handoff    # the catalog measurements only
    .venv/bin/python benchmarks/bench_core.py --split --catalog 1000 --no-full  # where the hand-off's time goes

Three measurements, each in a fresh child process (so RSS and CPU are its own):

- ``handoff``: items per second through ``Pipeline`` when downloads cost nothing: a
  ``memory://`` source of 1-byte items, either one-file folders (``items="folders"``) or single
  files (``items="files"``), taken by a consumer one by one (the iterator, which acks each
  item as it takes the next) or ``--batch`` at a time (``get_many`` and ``ack_many``), each with
  two caches (``--capacity``): one that never fills (**roomy**: twice the items' charge, as the
  cache counts them in whole blocks, a block per folder), and one that **fills** (half of it:
  through the run's second half the producer waits for acks, each of which frees one item's
  room, as with any source larger than its cache; the report's ``producer_wait_s`` says how
  long it waited). Run with
  the cache on the project disk and on tmpfs (``/dev/shm``; ``--no-tmpfs``: the disk only), beside the **floor**: the same
  file-system calls per item (for folders mkdir, create and write, rename, unlink, rmdir; for
  files create and write, rename, unlink) made by one plain Python loop, no threads. The ratio
  to the floor is the pipeline's own overhead. ``--repeats`` interleaved runs (the
  two consumers' order alternates: on a disk, a run right after another is often slower); medians.
  Each run also reports the time spent in Python's cyclic garbage collector (``gc.callbacks``)
  per item, its collections of the oldest generation ("full": each walks every tracked
  object, with every thread waiting), and the CPU time of its longest collection (a floor of the
  longest pause of every thread: on a busy machine the collecting thread may also be
  preempted). The ``memory://`` source's own objects are frozen out of the collector's walks
  (:func:`memory_source`), in every measurement that uses it (the ``--split`` ones too).
- ``catalog-stream``: a generated listing of ``--catalog`` one-file folders (no I/O to list);
  the default pass streams it (see ``cachepipe/listing.py``). Reports the time to the first item
  and the peak RSS after ``--consume`` items, while the listing runs ahead as far as it may.
- ``catalog-full``: the same listing with ``shuffle=True``, which needs the whole catalog before
  the first download: time to open (wall and CPU seconds: on a shared machine the CPU seconds
  vary less) and peak RSS.

``--split`` adds, for each place and shape, two measurements of the batched hand-off's parts:
the **consumer's side alone** (the clock starts once every item is ready: taking, acking and
deleting only), and **every per-item call in one thread** (the producer's calls for a run of
``--batch`` items, listing to publish, then the consumer's for that run; no other thread
running). The second is the work the pipeline's threads share; the pipeline's rate against it
is what running that work on threads, handing each item over between them, costs.

``--no-handoff`` runs only the two catalog measurements. ``--switch-interval S`` runs every
measuring process with ``sys.setswitchinterval(S)`` (Python's default is 0.005 s): how often a
thread running Python is made to hand the interpreter's lock to one waiting for it, which is
most of the pipeline's context switches on tmpfs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path
from typing import Any, BinaryIO

from common import command_line, file_system_of, format_table, machine_info, progress, provenance_lines

from cachepipe import Pipeline
from cachepipe.blocks import clamp_block, footprint
from cachepipe.stores.base import ObjectInfo


class GeneratedStore:
    """A source of ``n`` folders ``s0000000/f`` of ``size`` bytes each, listed from a generator."""

    url = "gen://bench"

    def __init__(self, n: int, size: int = 1) -> None:
        self.n, self.size = n, size

    def list(self):
        etag = "0" * 32
        for i in range(self.n):
            yield ObjectInfo(f"s{i:07d}/f", self.size, etag)

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        return out.write(b"x" * (end - start))

    def close(self) -> None:
        pass


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _switches() -> int:
    """Voluntary context switches of this process so far: each a thread that blocked (on a
    lock, the GIL, a queue, or I/O)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


class CollectorTime:
    """While entered: the seconds this process spends in Python's cyclic garbage collector
    (:data:`gc.callbacks`; a collection runs in the thread whose allocation set it off, with the
    interpreter's lock held, so every thread waits meanwhile), the collections of the oldest
    generation (each walks every tracked object), and the longest single collection.

    Each collection is timed by the CPU time of its thread (:func:`time.thread_time`), not by
    the clock: the callbacks are Python code, where the thread may hand the interpreter's lock
    to another (its switch interval) and wait for it back, and the clock between them would
    count those turns. The CPU time is a floor of the pause every thread saw: when the OS
    preempts the collecting thread, which holds the interpreter's lock, the others wait too
    (on this 2-core VM under load, a collection's clock time was up to 3 times its CPU time)."""

    def __enter__(self) -> CollectorTime:
        if self._note in gc.callbacks:
            raise RuntimeError("CollectorTime is entered already")
        self.seconds, self.full, self.longest = 0.0, 0, 0.0  # CPU seconds
        self._start: float | None = None  # a collection under way when entered is not counted
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time()
        elif self._start is not None:
            took = time.thread_time() - self._start
            self.seconds += took
            self.longest = max(self.longest, took)
            self.full += info["generation"] == 2
            self._start = None


def item_charge(where: str, shape: str) -> int:
    """What the cache charges a 1-byte item of ``shape`` in a folder on ``where``'s file system:
    its file in whole blocks, and a block for its folder (:func:`cachepipe.blocks.footprint`)."""
    block = clamp_block(os.statvfs(where).f_frsize)
    return footprint([1], 1 if shape == "folders" else 0, block)


def capacity_for(regime: str, n: int, where: str, shape: str) -> int:
    """The cache's capacity in bytes for ``n`` items of ``shape`` on ``where``: ``"roomy"``
    never fills (twice the items' charge, and 64 MiB for the cache's state), ``"fills"`` holds
    half the items' charge, so the producer waits for acks (each frees one item's room) through
    the second half of the run: the steady state of a source larger than its cache."""
    charge = n * item_charge(where, shape)
    return 2 * charge + 64 * 2**20 if regime == "roomy" else charge // 2


def run_handoff(n: int, where: str, shape: str, batch: int, capacity: int) -> dict[str, Any]:
    """Items per second through ``Pipeline`` from a ``memory://`` source of ``n`` 1-byte items
    (``shape`` ``"folders"``: one-file folders; ``"files"``: single files), consumed one by one
    (``batch`` 1: the iterator, which acks each item as it takes the next) or ``batch`` at a time
    (``get_many`` and ``ack_many``), with a cache of ``capacity`` bytes (:func:`capacity_for`);
    with the time spent in the garbage collector (:class:`CollectorTime`) and the producer's
    waits (``producer_wait_seconds``: for room in the cache, when it fills)."""
    with memory_source(n, shape) as url, tempfile.TemporaryDirectory(dir=where) as d:
        t0, c0, s0 = time.perf_counter(), _cpu(), _switches()
        with CollectorTime() as collector, Pipeline(url, Path(d) / "c", capacity, items=shape) as pipe:
            count = sum(1 for _ in pipe) if batch == 1 else _drain(pipe, batch)
            waited = pipe.stats().producer_wait_seconds
        wall, cpu, switches = time.perf_counter() - t0, _cpu() - c0, _switches() - s0
    assert count == n, (count, n)
    return {
        "capacity_bytes": capacity,
        "producer_wait_s": waited,
        "items": n,
        "wall_s": wall,
        "items_per_s": n / wall,
        "cpu_s": cpu,
        "switches": switches,
        "switch_interval_s": sys.getswitchinterval(),
        "gc_s": collector.seconds,
        "gc_full_collections": collector.full,
        "gc_longest_cpu_s": collector.longest,
    }


def _drain(pipe: Pipeline, batch: int) -> int:
    """Take every item ``batch`` at a time (``get_many``), acking each batch; returns the count."""
    count = 0
    while got := pipe.get_many(batch):
        count += len(got)
        pipe.ack_many(got)
    return count


@contextlib.contextmanager
def memory_source(n: int, shape: str) -> Iterator[str]:
    """A ``memory://`` source of ``n`` 1-byte items of ``shape``; yields its URL.

    Its objects (2 per item, each ``MemoryFile`` and its ``__dict__``, which the garbage
    collector would track and walk in every full collection: an object store's items are not in
    the process) are frozen out of the collector's walks (:func:`gc.freeze`) until it is left,
    with whatever else the process holds by then (its imported modules): the collections
    measured walk what the pipeline makes."""
    import fsspec

    fs = fsspec.filesystem("memory")
    for i in range(n):
        fs.pipe_file(f"/handoff/{i:07d}" + ("/f" if shape == "folders" else ""), b"x")
    gc.freeze()
    try:
        yield "memory://handoff"
    finally:
        gc.unfreeze()
        fs.store.clear()  # not fs.rm: the memory file system's recursive rm is quadratic in its size
        fs.pseudo_dirs[:] = [""]


def run_consumer_side(n: int, where: str, shape: str, batch: int) -> dict[str, Any]:
    """The consumer's side alone: as :func:`run_handoff` with ``get_many(batch)``, but the clock
    starts once all ``n`` items are ready (the producer is done; the cache holds them all,
    :func:`capacity_for` ``"roomy"``), so only taking, acking and deleting is timed."""
    with memory_source(n, shape) as url, tempfile.TemporaryDirectory(dir=where) as d:
        with Pipeline(url, Path(d) / "c", capacity_for("roomy", n, where, shape), items=shape) as pipe:
            while pipe.stats().items_ready < n:
                time.sleep(0.05)
            t0, c0, s0 = time.perf_counter(), _cpu(), _switches()
            count = _drain(pipe, batch)
            wall, cpu, switches = time.perf_counter() - t0, _cpu() - c0, _switches() - s0
    assert count == n, (count, n)
    return {"items": n, "wall_s": wall, "items_per_s": n / wall, "cpu_s": cpu, "switches": switches}


def run_one_thread(n: int, where: str, shape: str, batch: int) -> dict[str, Any]:
    """Every per-item call of both sides, made by one thread with no other running: for each run
    of ``batch`` items, list, reserve, stage, write, publish and queue each one (the producer's
    calls), then take the run, ack it and delete it (the consumer's). The sum of the work the
    pipeline's threads share, without their hand-overs: the pipeline's rate against this one is
    what running it on threads costs. Uses the core's internal classes (``Cache``, ``Broker``)."""
    from cachepipe.broker import Broker
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog
    from cachepipe.downloads import get_part
    from cachepipe.fetch_policy import HEAD_MIN_PART
    from cachepipe.stores import open_store

    with memory_source(n, shape) as url, tempfile.TemporaryDirectory(dir=where) as d:
        store = open_store(url)
        items = list(Catalog.from_listing(store.list(), mode=shape))  # type: ignore[arg-type]
        cache = Cache(Path(d) / "c", capacity_for("roomy", n, where, shape))
        cache.open()
        cache.recover(Catalog(mode=shape), resume=False)  # type: ignore[arg-type]
        broker: Broker[str] = Broker()
        t0, c0, s0 = time.perf_counter(), _cpu(), _switches()
        for first in range(0, n, batch):
            for seq in range(first, min(n, first + batch)):
                item = items[seq]
                cache.note_listed([item.name])
                cache.acquire(item)
                broker.begin()
                staged = cache.stage(item, HEAD_MIN_PART)  # the fetcher's smallest part, as in a pipeline
                for f in item.files:
                    get_part(store, f.key, f"{staged}/{f.rel}" if f.rel else str(staged), 0, f.size, True)
                broker.put(seq, item.name, cache.publish(staged, item))
            leases = broker.take_many(batch)
            assert isinstance(leases, list), leases
            broker.ack_many([(lease.name, lease.id) for lease in leases])
            cache.evict_many([(lease.name, 0, lease.seq) for lease in leases])
            cache.advance(0, leases[-1].seq + 1)
        wall, cpu, switches = time.perf_counter() - t0, _cpu() - c0, _switches() - s0
        cache.close()
    return {"items": n, "wall_s": wall, "items_per_s": n / wall, "cpu_s": cpu, "switches": switches}


def run_floor(n: int, where: str, shape: str) -> dict[str, Any]:
    """The same file-system calls per item as the pipeline makes, by one plain loop: for
    folders mkdir, create and write, rename, unlink, rmdir; for files create and write, rename,
    unlink."""
    with tempfile.TemporaryDirectory(dir=where) as d:
        t0 = time.perf_counter()
        if shape == "folders":
            for i in range(n):
                staged, final = f"{d}/s{i}", f"{d}/f{i}"
                os.mkdir(staged)
                with open(f"{staged}/f", "wb") as fh:
                    fh.write(b"x")
                os.rename(staged, final)
                os.unlink(f"{final}/f")
                os.rmdir(final)
        else:
            for i in range(n):
                staged, final = f"{d}/s{i}", f"{d}/f{i}"
                with open(staged, "wb") as fh:
                    fh.write(b"x")
                os.rename(staged, final)
                os.unlink(final)
        wall = time.perf_counter() - t0
    return {"items": n, "wall_s": wall, "items_per_s": n / wall}


def run_catalog(n: int, consume: int, shuffle: bool) -> dict[str, Any]:
    rss0 = _rss_mib()
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), _cpu()
        with Pipeline("gen://bench", Path(d) / "c", "256MiB", store=GeneratedStore(n), shuffle=shuffle) as pipe:
            opened, opened_cpu = time.perf_counter() - t0, _cpu() - c0
            first = None
            for k, _item in enumerate(pipe):
                if first is None:
                    first = time.perf_counter() - t0
                if k + 1 >= consume:
                    break
            listed = pipe.stats().items_listed
            rss = _rss_mib()
    return {
        "catalog": n,
        "consumed": consume,
        "open_s": opened,
        "open_cpu_s": opened_cpu,
        "first_item_s": first,
        "items_listed_at_end": listed,
        "peak_rss_mib": rss,
        "rss_before_mib": rss0,
    }


def _child(conn: Any, fn: str, args: tuple, switch_interval: float | None) -> None:
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    try:
        conn.send(("ok", globals()[fn](*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", repr(exc)))


def in_child(fn: str, *args: Any, limit: float, switch_interval: float | None = None) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process (``switch_interval``: its ``sys.setswitchinterval``)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, args, switch_interval))
    proc.start()
    try:
        if not parent.poll(limit):
            raise TimeoutError(f"{fn}{args} did not finish in {limit} s")
        status, value = parent.recv()
    finally:
        proc.kill() if proc.is_alive() else None
        proc.join()
    if status != "ok":
        raise RuntimeError(f"{fn}{args} failed: {value}")
    return value


def handoff_key(label: str, shape: str, batch: int, regime: str) -> str:
    """The hand-off case's key in the report: ``"tmpfs folders 64"`` with the roomy cache (the
    keys before the regimes were told apart), ``"tmpfs folders 64 fills"`` with the one that fills."""
    return f"{label} {shape} {batch}" + (" fills" if regime == "fills" else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--handoff", type=int, default=10_000, help="items in each hand-off measurement (default 10000)")
    p.add_argument("--batch", type=int, default=64, help="items per get_many/ack_many in the batched hand-off (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each hand-off case; medians reported (default 3)")
    p.add_argument("--catalog", type=int, default=1_000_000, help="items in the generated catalog (default 1000000)")
    p.add_argument("--consume", type=int, default=20_000, help="items consumed from the streamed catalog (default 20000)")
    p.add_argument(
        "--split",
        action="store_true",
        help="also split the batched hand-off's cost: the consumer's side alone, and every per-item call in one thread",
    )
    p.add_argument("--no-handoff", action="store_true", help="skip the hand-off measurement (catalog only)")
    p.add_argument("--no-full", action="store_true", help="skip the full (shuffled) catalog measurement")
    p.add_argument("--limit", type=float, default=600, help="seconds per measurement (default 600)")
    p.add_argument(
        "--switch-interval",
        type=float,
        help="seconds: sys.setswitchinterval in every measuring process (default: Python's, 0.005); "
        "how often a thread that runs Python is made to let the interpreter's lock go to a waiting one",
    )
    p.add_argument(
        "--disk",
        default=tempfile.gettempdir(),
        help="folder on the disk to measure (default: the temporary folder); its file system is reported",
    )
    p.add_argument(
        "--no-tmpfs",
        action="store_true",
        help="measure the hand-off with the cache on --disk only, not also on tmpfs (/dev/shm): the same code, half the runs",
    )
    p.add_argument(
        "--capacity",
        choices=("both", "roomy", "fills"),
        default="both",
        help="the hand-off's cache: 'roomy' never fills (twice the items' charge), 'fills' holds half of it, so the "
        "producer waits for acks, as with a source larger than its cache (default: both, each case in each)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.switch_interval is not None and not (math.isfinite(args.switch_interval) and args.switch_interval >= 1e-6):
        p.error(f"--switch-interval must be a finite number of seconds, at least 1e-6, not {args.switch_interval}")
    if args.split and args.capacity == "fills":
        p.error("--split compares with the roomy cache's hand-off: give --capacity both or roomy")
    if args.quick:
        args.handoff, args.catalog, args.consume, args.limit, args.repeats = 300, 5_000, 200, 120, 1
    if not os.path.isdir(args.disk) or not os.access(args.disk, os.W_OK):
        p.error(f"--disk must be a writable folder, not {args.disk!r}")
    shm = "/dev/shm"  # tmpfs on every Linux
    tmpfs = not args.no_tmpfs and os.path.isdir(shm) and os.access(shm, os.W_OK)
    places = [("disk", args.disk)] + ([("tmpfs", shm)] if tmpfs else [])
    import cachepipe

    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {"cachepipe": cachepipe.__version__},
        "places": {label: {"path": where, "file_system": file_system_of(where)} for label, where in places},
        "handoff": {},
        "split": {},
        "catalog": {},
        "load_average": {"start": list(os.getloadavg())},
        "switch_interval_s": sys.getswitchinterval() if args.switch_interval is None else args.switch_interval,
    }
    cases = [(label, where, shape) for label, where in places for shape in ("folders", "files")]
    regimes = ("roomy", "fills") if args.capacity == "both" else (args.capacity,)
    runs: dict[str, list[dict[str, Any]]] = {}
    for repeat in range(0 if args.no_handoff else args.repeats):
        for label, where, shape in cases:  # interleaved: every case once per repeat
            progress(f"repeat {repeat + 1}/{args.repeats}: hand-off on {label} ({where}), {shape}, {args.handoff} items")
            runs.setdefault(f"{label} {shape} floor", []).append(
                in_child("run_floor", args.handoff, where, shape, limit=args.limit, switch_interval=args.switch_interval)
            )
            for batch in (1, args.batch) if repeat % 2 == 0 else (args.batch, 1):  # order rotates: the disk drifts
                for regime in regimes if batch == 1 else regimes[::-1]:
                    capacity = capacity_for(regime, args.handoff, where, shape)
                    got = in_child(
                        *("run_handoff", args.handoff, where, shape, batch, capacity),
                        limit=args.limit,
                        switch_interval=args.switch_interval,
                    )
                    runs.setdefault(handoff_key(label, shape, batch, regime), []).append(got)
            for part in ("run_consumer_side", "run_one_thread") if args.split else ():
                got = in_child(
                    part, args.handoff, where, shape, args.batch, limit=args.limit, switch_interval=args.switch_interval
                )
                runs.setdefault(f"{label} {shape} {part}", []).append(got)
    for label, _where, shape in [] if args.no_handoff else cases:
        floor = statistics.median(r["items_per_s"] for r in runs[f"{label} {shape} floor"])
        for batch, regime in [(batch, regime) for batch in (1, args.batch) for regime in regimes]:
            got = runs[handoff_key(label, shape, batch, regime)]
            rate = statistics.median(r["items_per_s"] for r in got)
            report["handoff"][handoff_key(label, shape, batch, regime)] = {
                "cache_on": label,
                "shape": shape,
                "batch": batch,
                "capacity": regime,
                "capacity_bytes": got[0]["capacity_bytes"],
                "producer_wait_s": statistics.median(r["producer_wait_s"] for r in got),
                "items": args.handoff,
                "items_per_s": rate,
                "runs_items_per_s": [r["items_per_s"] for r in got],
                "cpu_us_per_item": statistics.median(r["cpu_s"] for r in got) / args.handoff * 1e6,
                "switches_per_item": statistics.median(r["switches"] for r in got) / args.handoff,
                "gc_us_per_item": statistics.median(r["gc_s"] for r in got) / args.handoff * 1e6,
                "gc_full_collections": statistics.median(r["gc_full_collections"] for r in got),
                "gc_longest_cpu_ms": statistics.median(r["gc_longest_cpu_s"] for r in got) * 1e3,
                "switch_interval_s": got[0]["switch_interval_s"],
                "floor_items_per_s": floor,
                "of_floor": rate / floor,
            }
        if args.split and "roomy" in regimes:
            pipeline = report["handoff"][handoff_key(label, shape, args.batch, "roomy")]
            report["split"][f"{label} {shape}"] = {
                "cache_on": label,
                "shape": shape,
                "batch": args.batch,
                "pipeline_items_per_s": pipeline["items_per_s"],
                "pipeline_cpu_us_per_item": pipeline["cpu_us_per_item"],
                "pipeline_switches_per_item": pipeline["switches_per_item"],
                **{
                    f"{part}_{key}": statistics.median(r[key] for r in runs[f"{label} {shape} run_{part}"]) * scale
                    for part in ("consumer_side", "one_thread")
                    for key, scale in (("items_per_s", 1), ("cpu_s", 1e6 / args.handoff), ("switches", 1 / args.handoff))
                },
                "floor_items_per_s": floor,
            }
    progress(f"streamed catalog of {args.catalog} items, consuming {args.consume}")
    report["catalog"]["stream"] = in_child(
        "run_catalog", args.catalog, args.consume, False, limit=args.limit, switch_interval=args.switch_interval
    )
    if not args.no_full:
        progress(f"full (shuffled) catalog of {args.catalog} items")
        report["catalog"]["full"] = in_child(
            "run_catalog", args.catalog, min(args.consume, 1000), True, limit=args.limit, switch_interval=args.switch_interval
        )
    report["load_average"]["end"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [
        [
            r["cache_on"],
            r["shape"],
            "iterator" if r["batch"] == 1 else f"get_many({r['batch']})",
            f"{r['capacity']} ({r['capacity_bytes'] / 2**20:,.0f} MiB, {r['producer_wait_s']:.2f} s)",
            f"{r['items_per_s']:,.0f}",
            f"{r['cpu_us_per_item']:,.0f}",
            f"{r['gc_us_per_item']:,.1f} ({r['gc_full_collections']:g}, {r['gc_longest_cpu_ms']:,.1f} ms)",
            f"{r['floor_items_per_s']:,.0f}",
            f"{r['of_floor']:.2f}",
        ]
        for r in report["handoff"].values()
    ]
    lines = []
    if rows:
        title = f"hand-off through Pipeline (memory:// source, {args.handoff:,} items of 1 byte; medians of {args.repeats} runs):"
        lines.append(title)
        if args.switch_interval is not None:
            lines.append(f"(every measuring process ran with sys.setswitchinterval({args.switch_interval:g}))")
        lines.append("; ".join(f"{label}: {p['path']} ({p['file_system']})" for label, p in report["places"].items()))
        lines += [
            *format_table(
                [
                    *("cache on", "items", "consumer", "capacity (producer waited)", "items/s", "CPU us/item"),
                    *("GC us/item (full, longest CPU)", "fs floor items/s", "x floor"),
                ],
                rows,
            ),
            "",
        ]
    rows = [
        [
            r["cache_on"],
            r["shape"],
            f"{r['pipeline_items_per_s']:,.0f} ({r['pipeline_cpu_us_per_item']:,.0f}, {r['pipeline_switches_per_item']:.1f})",
            f"{r['consumer_side_items_per_s']:,.0f} ({r['consumer_side_cpu_s']:,.0f}, {r['consumer_side_switches']:.1f})",
            f"{r['one_thread_items_per_s']:,.0f} ({r['one_thread_cpu_s']:,.0f}, {r['one_thread_switches']:.1f})",
            f"{r['pipeline_items_per_s'] / r['one_thread_items_per_s']:.2f}",
            f"{r['floor_items_per_s']:,.0f}",
        ]
        for r in report["split"].values()
    ]
    if rows:
        lines.append(
            f"cost split of the get_many({args.batch}) hand-off: items/s (CPU us/item, voluntary context switches/item), "
            f"medians of {args.repeats} runs:"
        )
        lines += [
            *format_table(
                [
                    "cache on",
                    "items",
                    "pipeline",
                    "consumer side alone",
                    "all calls, one thread",
                    "pipeline / one thread",
                    "fs floor",
                ],
                rows,
            ),
            "",
        ]
    rows = [
        [
            mode,
            f"{r['catalog']:,}",
            f"{r['open_s']:.2f}",
            f"{r['open_cpu_s']:.2f}",
            f"{r['first_item_s']:.2f}",
            f"{r['consumed']:,}",
            f"{r['items_listed_at_end']:,}",
            f"{r['peak_rss_mib']:.0f}",
        ]
        for mode, r in report["catalog"].items()
    ]
    lines += ["generated catalog:"]
    lines += format_table(
        ["listing", "items", "open s", "open CPU s", "1st item s", "consumed", "listed by then", "peak RSS MiB"], rows
    )
    load = report["load_average"]
    lines += ["", *provenance_lines(report)]
    lines += [
        f"load average (1/5/15 min) at start {[round(x, 2) for x in load['start']]}, at end {[round(x, 2) for x in load['end']]}"
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
