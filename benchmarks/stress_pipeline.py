"""Stress: randomized seeds against a plain Pipeline whose listing streams; hangs, held items, cap.

Each seed makes a source folder of item folders in a temporary directory (random count, up to
3,000; random sizes, one file or several, some in a subfolder; a few items much larger than the
rest, the capacity sized on them) and reads it with one :class:`~cachepipe.Pipeline` in its
plain pass (one epoch, no shuffle, one rank: the listing streams, ``Pipeline._streams``; its
journal budget grows a block at a time as names are listed, ``Cache.note_listed``). The source
is a local folder, walked as it is listed: its listing streams as a store's in pages does, and a
seed of thousands of items costs a second or two (a moto S3 server would cost the upload of
every object per seed, and seconds per hundred GETs). In mode ``paged`` the same folder is
listed through a store that pauses between pages of random length (as S3 answers page by page),
so that the listing's budget grows while downloads, hand-outs and acks run, not all before.

The consumer (one thread) takes every item with ``get(timeout=...)`` (``auto_ack=False``) or
the iterator (``auto_ack=True``), checks each item's name (the listing's order) and bytes, and:

- ``auto_ack=False``: holds up to ``k`` items (a random number of them, 0..k, before each take;
  ``k`` such that the capacity holds any ``k`` items, the next and the whole listing's state budget:
  the limit that docs/guide/guarantees.md states for a consumer that holds items), acks them in
  random order (one by one or several at once, ``ack_many``), and gives some back (``release``:
  it must come again next), takes a batch now and then (``get_many``, no more than the capacity
  serves beside those it holds), and pauses now and then (0-5 ms) before a take;
- may stop mid-pass (closing the pipeline with items held, half the time with
  ``keep_on_close=True``: the resumed pass reuses the items left) and resume it in a new pipeline:
  from ``state_dict()`` (``load_state_dict``) or, once the listing ended, with ``resume=True``
  (the journal's acks beyond the position kept): the items after the position (all of them, or
  those not acked) must come, in order, each once.

It checks, and reports per mode:

- **hung**: no item for ``--timeout`` seconds (default 20 s; a take waits for room, a download,
  the listing). Every thread's stack is dumped (``faulthandler``) to ``--log`` (stderr by
  default), then the pipeline is closed (which ends the take) and the next seed runs;
- **stalled**: a take waited more than 4 s without hanging;
- **wrong**: an item out of order, twice, missing, with other bytes, or a released item that did
  not come next;
- **over cap**: the bytes under the cache directory, sampled every 2 ms and counted as the
  capacity counts them (each file in whole blocks of the filesystem, a block per folder, as
  ``tests/sampling.py`` does), over the capacity;
- **leaks**: after each close, a thread of cachepipe's alive, a file descriptor more open than
  before the pipeline, or an item left in the cache folder;
- **errors**: anything raised (an ``OversizeError`` is one: every capacity here is legitimate).

Modes (``--mode``; "largest" is what the largest item takes as the capacity counts it: its files
in whole blocks and its folders; "state" is what the cache counts for its own state with the
whole listing's journal budget, read from a probe pipeline over the source whose listing does
not stream):

- ``tight``: capacity ``state +`` the ``k + 1`` largest items: the least the docs promise to
  serve a consumer that holds ``k`` items (any of those it took) and takes the next;
- ``paged``: as ``tight``, the listing through the pausing store;
- ``roomy``: capacity 2-6 times that of ``tight``, the listing through the pausing store;
- ``s3``: as ``tight``, the items (up to 300) put into a moto S3 server (a process of its own,
  started once) and read from it: listed in pages of 1-50 keys (``list_page_size``; the first
  request asks for 100 at most), with ETags (the journal budgets a version per name), over HTTP;
- ``beyond``: a consumer the docs say cannot be served: it holds up to ``k`` (1-4) items, the
  capacity (as ``tight``'s, the listing through the pausing store) serves fewer, ``j < k``. It
  may wait for room that only its own acks would free: a hang here is expected, but must be
  told: the stall warning (``stall_warning``, a quarter of ``--timeout`` here) must say that
  items handed out hold their space (a hang not told so is counted apart);
- ``files``: as ``tight``, with ``items="files"``: every object an item (``i00000.bin``, one in
  four in a folder of its own, ``i00007/x.bin``), listed whole or through the pausing store;
- ``threads``: 2-4 consumer threads take from one pipeline at once (the listing through the
  pausing store), each holding up to ``k`` (0-3; or each looping with ``auto_ack``); the capacity
  serves ``t x k`` held items and the next. No stop and resume. Judged at the end, by the order
  of the leases (the broker counts them as it hands out; a thread records a hand-out some time
  after it): the first hand-outs in the listing's order, every item acked once, by its last lease,
  handed out again only after a release;
- ``lease``: as ``threads`` with 1-3 threads and ``lease_timeout`` of 0.05, 0.2 or 1 s: a thread
  now and then drops an item it took (never acks nor releases it; at most 1-3 at a time,
  counted in the capacity): it must come again after the lease, and an ack of the dropped
  object must then be refused (``UnknownItemError``) and leave the new hand-out's files whole;
  acks and releases of a held item whose lease expired meanwhile may be refused (counted). Every
  item is delivered at least once and acked exactly once, by its last lease (an ack of an earlier
  one accepted would delete the files of a later one under its consumer); files found gone when
  read are a finding unless a later lease of the item explains them (counted as overtaken);
- ``capacity``: as ``paged``, with ``set_capacity`` every 2-30 ms mid-pass, to between the least
  (``tight``'s) and 2-4 times it, and now and then to one block (below the state: it must be
  refused with ``ValueError``). The cache is sampled against the capacity in force: raised before
  a grow; after a shrink below what the cache holds ("nothing is deleted for it; downloads wait
  until acknowledgements bring the cache under it"), the old one until the cache counts no more
  than the new (``Cache.used``), the next change waiting for that;
- ``faults``: as ``s3``, the server behind ``tests/faultproxy.py``: each request (LIST or GET)
  meets a fault at a chance of 2, 5 or 15%: a 503 (SlowDown) in its place, or the next
  connection reset or cut after 2,000 bytes with every live connection dropped. Retried as the
  docs say (``retries=12``, backoff 0.02 s doubling to 0.4 s: the defaults' 36-73 s would be
  minutes a seed): every item once, or an error the docs name (its retries spent: counted
  apart, as documented, with the retries logged), never a hang or an item lost silently.

Results (benchmarks/README.md, 2026-12-01): no hang, stall, wrong item, overshoot, leak or error in
tight 0-199, paged 0-199, roomy 0-99, s3 0-59; beyond 0-59: 45 hangs, each told by the stall
warning. Before the fix of the streamed budget's deadlock (b21b56c^) tight and paged 0-39 did
not hang either: within the docs' limit the next item always has room.

Results of the modes added 2026-12-01 (files, threads, lease, capacity, faults): see
benchmarks/README.md.

Run against another tree with ``PYTHONPATH=TREE`` (``TMPDIR=/dev/shm``: scratch on tmpfs)::

    python benchmarks/stress_pipeline.py --mode paged --seeds 0 100
    python benchmarks/stress_pipeline.py --mode tight --seeds 0 10 --json
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from common import (  # benchmarks/common.py
    BUCKET,
    CREDENTIALS,
    PeakSampler,
    Server,
    format_table,
    print_seeds_report,
    seeds_footer,
    tree,
)

from cachepipe import Pipeline
from cachepipe.blocks import clamp_block, folders_made, footprint
from cachepipe.errors import CachePipeError, UnknownItemError
from cachepipe.stores import Store, open_store
from cachepipe.stores.base import ObjectInfo
from cachepipe.stores.fsspec import FsspecStore

KIB = 1024
STALL = 4.0  # a take that waited longer stalled
MODES = ("tight", "paged", "roomy", "beyond", "s3", "files", "threads", "lease", "capacity", "faults")
COUNTS = ("redelivered", "refused", "late_refused", "overtaken", "dropped", "resized", "resize_refused", "below", "faults")
TESTS = Path(__file__).resolve().parents[1] / "tests"  # faultproxy.py, for mode faults
HELD_HINT = "items handed out and not acknowledged hold their space"  # the stall warning's, when acks would free room


class Warnings(logging.Handler):
    """Keeps cachepipe's warnings (the stall warning says what a waiting take waits for)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARNINGS = Warnings()


# ---- the source ----------------------------------------------------------------------
def content(name: str, rel: str, size: int) -> bytes:
    """The bytes of file ``rel`` of item ``name``: its name repeated, so a swapped item shows."""
    seed = f"{name}/{rel};".encode()
    return (seed * (size // len(seed) + 1))[:size]


def make_source(root: Path, count: int, rng: random.Random) -> tuple[list[str], dict[str, dict[str, int]]]:
    """``count`` item folders ``i00000``... under ``root``: one file, or two, the second maybe in
    a subfolder; a few items (about one in 200, at least one) 8-32 times larger, or (two seeds in
    five) every item of one size (1 byte, 4 or 6 KiB: then each ack frees just what the next
    item takes, and the room a growing budget leaves it is all there is). Returns
    the names (in listing order) and each item's files with their sizes."""
    names, files = [], {}
    big = {rng.randrange(count) for _ in range(max(1, count // 200))}
    uniform = rng.choice([0, 0, 1, 4 * KIB, 6 * KIB])  # every item of this size (0: random sizes)
    for i in range(count):
        name = f"i{i:05d}"
        size = uniform or rng.randint(1, 6 * KIB)
        if i in big and not uniform:
            size *= rng.randint(8, 32)
        shape = rng.choice(["one", "one", "two", "sub"])
        if shape == "one" or size < 3:
            rels = {"a.bin": size}
        else:
            cut = rng.randrange(1, size)
            rels = {"a.bin": cut, ("sub/b.bin" if shape == "sub" else "b.bin"): size - cut}
        for rel, part in rels.items():
            path = root / name / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content(name, rel, part))
        names.append(name)
        files[name] = rels
    return names, files


def make_files_source(root: Path, count: int, rng: random.Random) -> tuple[list[str], dict[str, dict[str, int]]]:
    """As :func:`make_source`, for ``items="files"``: ``count`` files ``i00000.bin``... under
    ``root``, one in four in a folder of its own (``i00007/x.bin``, one item); their files as
    ``{"": size}`` (the item is the file)."""
    names, files = [], {}
    big = {rng.randrange(count) for _ in range(max(1, count // 200))}
    uniform = rng.choice([0, 0, 1, 4 * KIB, 6 * KIB])
    for i in range(count):
        size = uniform or rng.randint(1, 6 * KIB)
        if i in big and not uniform:
            size *= rng.randint(8, 32)
        name = f"i{i:05d}/x.bin" if rng.random() < 0.25 else f"i{i:05d}.bin"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content(name, "", size))
        names.append(name)
        files[name] = {"": size}
    return names, files


def charge_of(rels: dict[str, int], block: int, name: str = "") -> int:
    """What an item of ``rels`` takes as the capacity counts it (:meth:`Cache.charge`); ``{"": size}``:
    the single object ``name`` (``items="files"``), the folders of its name."""
    if "" in rels:
        return footprint(rels.values(), folders_made((), True, name), block)
    folders = 1 + len({rel.rsplit("/", 1)[0] for rel in rels if "/" in rel})
    return footprint(rels.values(), folders, block)


class PagedStore(FsspecStore):
    """A local folder listed in pages of ``page`` objects with a pause of ``pause`` seconds
    before each page after the first (a store that answers page by page)."""

    def __init__(self, url: str, page: int, pause: float) -> None:
        super().__init__(url)
        self.page, self.pause = page, pause

    def list(self, start_after: str | None = None) -> Iterator[ObjectInfo]:
        for n, obj in enumerate(super().list(start_after)):
            if n and n % self.page == 0:
                time.sleep(self.pause)
            yield obj


class Source:
    """Where a seed's items are read from: the local folder (``server`` None; listed in pages
    with pauses if ``page``), or its copy in the moto server's bucket under ``prefix``, listed
    ``page`` keys a request."""

    def __init__(self, folder: Path, page: int, pause: float, server: Server | None = None, prefix: str = "",
                 via: str | None = None) -> None:  # fmt: skip
        self.folder, self.page, self.pause, self.server = folder, page, pause, server
        self.url = f"s3://{BUCKET}/{prefix}" if server is not None else str(folder)
        endpoint = via or (server.endpoint if server is not None else "")  # via: the fault proxy's, in front of it
        self.options = {"endpoint_url": endpoint, "skip_instance_cache": True} if server is not None else {}

    def upload(self) -> None:
        """Put every file of the folder into the bucket (the server's)."""
        import boto3

        assert self.server is not None
        s3 = boto3.client("s3", endpoint_url=self.server.endpoint, region_name="us-east-1",
                          aws_access_key_id=CREDENTIALS, aws_secret_access_key=CREDENTIALS)  # fmt: skip
        prefix = self.url.split("/", 3)[3]
        files = [p for p in sorted(self.folder.rglob("*")) if p.is_file()]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda f: s3.put_object(Bucket=BUCKET, Key=f"{prefix}/{f.relative_to(self.folder).as_posix()}",
                                                  Body=f.read_bytes()), files))  # fmt: skip

    def store(self) -> Store | None:
        """A new store for a pipeline (None: the pipeline opens the folder itself)."""
        if self.server is not None:
            store = open_store(self.url, self.options)
            store.list_page_size = self.page  # type: ignore[attr-defined]  # the fsspec store's
            return store
        return PagedStore(self.url, self.page, self.pause) if self.page else None


def state_of(source: Source, probe: Path, cache: Path | None = None, **options: Any) -> int:
    """What a cache over ``source`` counts for its own state with the whole listing's journal
    budget: the capacity less the limit of a probe pipeline whose listing does not stream. With
    ``cache``: that of a pass resumed there with ``options`` (its open counts the journal left
    and, with ``resume=True``, the listing it saves, beside the budget: more than a first pass),
    the probe opened over a copy of the cache folder: its state and the items kept in it (a
    copy of the state alone, whose open found none of them on disk, kept a journal without their
    records: a block less, at times, than the real open counted, whose largest item was then
    oversize at open)."""
    capacity = 1 << 30
    saved = options.pop("state", None)
    if cache is None:
        options = {"shuffle": True, "items": options.get("items", "folders")}
    else:
        shutil.rmtree(probe, ignore_errors=True)
        shutil.copytree(cache, probe, symlinks=True)
        (probe / ".cachepipe" / "lock").unlink(missing_ok=True)
    pipe = Pipeline(source.url, probe, capacity, store=source.store(), storage_options=source.options, prefetch=1,
                    max_concurrency=1, **options)  # fmt: skip
    if saved is not None:
        pipe.load_state_dict(saved)
    with pipe:
        state = capacity - pipe._cache.limit  # noqa: SLF001 - the limit OversizeError checks; not in Stats
    shutil.rmtree(probe, ignore_errors=True)
    return state


# ---- one seed ------------------------------------------------------------------------
@dataclass
class Setup:
    count: int
    auto_ack: bool
    hold: int  # k: the most items the consumer holds while it takes the next
    options: dict[str, Any]
    page: int = 0  # the pausing store's page (0: a plain local listing)
    pause: float = 0.0
    stop_after: int | None = None  # close after this many takes, then resume
    resume_by: str = ""  # "state" (load_state_dict) or "journal" (resume=True, once listed whole)
    factor: int = 1  # roomy: the capacity over tight's
    pauses: float = 0.0  # how often the consumer pauses (0-5 ms) before a take
    served: int = 0  # the capacity serves a consumer holding this many (beyond: fewer than ``hold``)
    keep: bool = False  # the pass stopped mid-way closes with keep_on_close=True: the resumed one reuses its items
    capacity: int = 0
    threads: int = 1  # consumer threads on the pipeline (threads, lease: 2-4, 1-3), each holding up to ``hold``
    forget: int = 0  # lease: the most items taken and dropped (never acked nor released) at a time
    resize: int = 0  # capacity: set_capacity between the least (tight's) and this many times it, mid-pass
    lowest: int = 0  # capacity: the state and the largest item: what a shrink below the items held goes down to at most
    faults: float = 0.0  # faults: the chance of a fault per request (503 answered, or a connection reset or cut)


def choose(mode: str, rng: random.Random, max_items: int | None = None) -> Setup:
    count = rng.choice([rng.randint(5, 99), rng.randint(100, 600), rng.randint(600, 3000)])
    if mode in ("s3", "faults"):  # each object a PUT to the server first: a few hundred at most
        count = rng.choice([rng.randint(5, 99), rng.randint(100, 300)])
    count = count if max_items is None else min(count, max_items)  # the rest drawn as without it
    auto_ack = rng.random() < 0.25
    options = {"prefetch": rng.choice([None, 1, 2, rng.randint(3, 64)]), "max_concurrency": rng.choice([1, 2, 4, 8, 64])}
    setup = Setup(count, auto_ack, 0 if auto_ack else rng.randint(0, 4), options)
    if mode in ("paged", "roomy", "beyond", "threads", "lease", "capacity"):
        setup.page, setup.pause = rng.choice([1, 5, 20, 100, 500]), rng.choice([0.0005, 0.002, 0.01])
    elif mode == "files":  # listed whole or in pages
        setup.page, setup.pause = rng.choice([0, 0, 1, 20, 500]), rng.choice([0.0005, 0.002])
        options["items"] = "files"
    elif mode in ("s3", "faults"):
        setup.page = rng.choice([1, 3, 10, 50])  # keys a listing request; the first asks for 100 at most
    setup.pauses = rng.choice([0.0, 0.0, 0.05, 0.3])
    if rng.random() < 0.3:
        setup.stop_after = rng.randint(0, count)
        setup.resume_by = rng.choice(["state", "journal"])
    if mode == "roomy":
        setup.factor = rng.randint(2, 6)
    if mode == "beyond":  # holds more than the capacity serves: k of 1-4, room for fewer beside the budget
        setup.auto_ack, setup.hold = False, rng.randint(1, 4)
        setup.served = rng.randint(0, setup.hold - 1)
    else:
        setup.served = setup.hold
    if mode in ("threads", "lease"):  # t threads, each holding up to k: the capacity serves t x k held and the next
        setup.threads = rng.randint(2, 4) if mode == "threads" else rng.randint(1, 3)
        setup.hold = 1 if setup.auto_ack else rng.randint(0, 3)  # auto_ack: each holds the one it uses
        setup.stop_after = None  # one pass: no stop and resume (a position with items out of order in hand)
        if mode == "lease":
            setup.auto_ack = False
            options["lease_timeout"] = rng.choice([0.05, 0.2, 1.0])
            setup.forget = rng.randint(1, 3)
        setup.served = setup.threads * setup.hold + setup.forget
    if mode == "capacity":
        setup.resize = rng.randint(2, 4)
    if mode == "faults":  # retried sooner than by default (1.7-3.4 s for 12 retries, not 36-73 s): a pass meets hundreds
        setup.faults = rng.choice([0.02, 0.05, 0.15])
        options.update(retry_backoff=0.02, retry_backoff_max=0.4)
    return setup


class Hang(Exception):
    """The watchdog closed the pipeline: no item came within the timeout."""


@dataclass
class Run:
    """What the seed's consumer saw, across its pipelines."""

    timeout: float
    log: TextIO
    hung: list[str] = field(default_factory=list)
    told: list[bool] = field(default_factory=list)  # per hang: the stall warning said to ack or release
    wrong: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    longest: float = 0.0
    takes: int = 0
    acks: int = 0
    releases: int = 0
    resumed: int = 0
    redelivered: int = 0  # lease: hand-outs of an item whose earlier lease expired
    refused: int = 0  # lease: acks or releases refused, their lease expired
    late_refused: int = 0  # lease: late acks of a dropped item's expired lease, refused as the docs say
    overtaken: int = 0  # lease: hand-outs whose files were gone when read, acked under a later lease of the item
    dropped: int = 0  # lease: items taken and never acked nor released
    resized: int = 0  # capacity: set_capacity calls (grow or shrink)
    resize_refused: int = 0  # capacity: set_capacity below the state's room, refused with ValueError
    below: int = 0  # capacity: shrinks below the least that serves the consumer, for 5-30 ms
    faults: int = 0  # faults: faults the proxy injected
    documented: list[str] = field(default_factory=list)  # faults: an error the docs name (retries spent)


def watched(pipe: Pipeline, run: Run, progress: list[float], done: threading.Event, what: str) -> threading.Thread:
    """A thread that closes ``pipe`` when ``progress[0]`` (the monotonic time of the consumer's
    last step) is ``run.timeout`` seconds old, having dumped every thread's stack to the log."""

    def watch() -> None:
        while not done.wait(0.1):
            if time.monotonic() - progress[0] > run.timeout:
                told = [m for m in WARNINGS.messages if m.startswith("no item ready")]
                run.told.append(bool(told) and HELD_HINT in told[-1])
                said = f"; warned: {told[-1]!r}" if told else "; no warning"
                run.hung.append(f"{what}: no item within {run.timeout:g} s ({progress[1]}){said}")
                print(f"---- {what}: hung ({progress[1]}); every thread's stack:", file=run.log, flush=True)
                faulthandler.dump_traceback(run.log, all_threads=True)
                run.log.flush()
                pipe.close()
                return

    thread = threading.Thread(target=watch, name="stress-watchdog", daemon=True)
    thread.start()
    return thread


def right_bytes(item: Any, rels: dict[str, int], run: Run, what: str) -> bool:
    """Whether each file of ``item`` has the bytes made for it (``rels``: its files' sizes; ``""``:
    the item is the file); if not, say so in ``run.wrong``."""
    for rel, size in rels.items():
        data = (item / rel if rel else Path(item)).read_bytes()
        if data != content(item.name, rel, size):
            run.wrong.append(f"{what}: {item.name}/{rel}: wrong bytes ({len(data)} of {size})")
            return False
    return True


def consume(pipe: Pipeline, setup: Setup, run: Run, expected: list[str], files: dict[str, dict[str, int]],
            rng: random.Random, stop_after: int | None, what: str) -> list[str]:  # fmt: skip
    """Take the items of ``pipe``, which must be ``expected`` in order, holding, acking and
    releasing at random; stop after ``stop_after`` takes (None: to the end). Returns the names
    acked. Raises :class:`Hang` if the watchdog closed the pipeline."""
    progress: list[Any] = [time.monotonic(), "before the first take"]
    done = threading.Event()
    watchdog = watched(pipe, run, progress, done, what)
    acked: list[str] = []
    delivered = 0  # the next expected item's index
    held: list[Any] = []
    released: list[str] = []  # given back: each must come before any other
    seen_ack: set[str] = set()

    def check(item: Any) -> bool:
        nonlocal delivered
        name = item.name
        if released:
            if name not in released:
                run.wrong.append(f"{what}: released {released} came not next but {name}")
                return False
            released.remove(name)
        elif delivered >= len(expected) or name != expected[delivered]:
            want = expected[delivered] if delivered < len(expected) else "the end"
            run.wrong.append(f"{what}: got {name}, expected {want}")
            return False
        else:
            delivered += 1
        return right_bytes(item, files[name], run, what)

    def ack(items: list[Any]) -> None:
        if len(items) > 1 and rng.random() < 0.5:
            pipe.ack_many(items)
        else:
            for it in items:
                pipe.ack(it)
        for it in items:
            if it.name in seen_ack:
                run.wrong.append(f"{what}: {it.name} acked twice")
            seen_ack.add(it.name)
            acked.append(it.name)
        run.acks += len(items)

    try:
        if setup.auto_ack:
            started = time.monotonic()
            for taken, item in enumerate(pipe, 1):
                waited = time.monotonic() - started
                run.longest = max(run.longest, waited)
                run.takes += 1
                progress[:] = [time.monotonic(), f"after {item.name}"]
                if not check(item):
                    return acked
                if stop_after is not None and taken >= stop_after:
                    return acked  # the last one is not acked: closed in hand
                acked.append(item.name)  # acked by the loop when it asks for the next
                if rng.random() < setup.pauses:
                    time.sleep(rng.uniform(0, 0.005))
                started = time.monotonic()
            if run.hung:  # the loop ends when the watchdog closes the pipeline
                raise Hang
            if delivered < len(expected):
                run.wrong.append(f"{what}: ended after {delivered} of {len(expected)} items")
            return acked
        taken = 0
        while True:
            target = rng.randint(0, setup.hold)
            while len(held) > target:  # ack (or give back) some, in random order
                if rng.random() < 0.07:
                    back = held.pop(rng.randrange(len(held)))
                    pipe.release(back)
                    released.append(back.name)
                    run.releases += 1
                    continue
                rng.shuffle(held)
                n = rng.randint(1, len(held) - target)
                ack(held[:n])
                del held[:n]
            if stop_after is not None and taken >= stop_after:
                return acked
            if rng.random() < setup.pauses:
                time.sleep(rng.uniform(0, 0.005))  # holding its items while the listing and the downloads go on
            started = time.monotonic()
            progress[:] = [started, f"taking item {delivered} with {len(held)} held"]
            # a batch, at times: the next item and those ready after it, no more than the capacity serves
            count = rng.randint(1, setup.served + 1 - len(held)) if len(held) <= setup.served and rng.random() < 0.2 else 1
            try:
                items = pipe.get_many(count, timeout=run.timeout + 10)
            except RuntimeError:
                if run.hung:
                    raise Hang from None
                raise
            run.longest = max(run.longest, time.monotonic() - started)
            progress[:] = [time.monotonic(), "after a take"]
            if not items:
                if released or delivered < len(expected):
                    run.wrong.append(f"{what}: ended after {delivered} of {len(expected)} items")
                ack(held)
                held.clear()
                return acked
            for item in items:
                run.takes += 1
                taken += 1
                if not check(item):
                    return acked
                held.append(item)
    finally:
        done.set()
        watchdog.join()


def lease_order(lease: str) -> int:
    """The order of a lease among the pipeline's: its ids are ``tag-N-seq``, ``N`` counted up (hex)
    as the broker hands out, under its lock (``Broker._pop``). A thread records a hand-out some
    time after it: a lease of 50 ms may have expired by then and the item gone to another thread,
    which acked it; the order tells the hand-outs apart whenever they are recorded."""
    return int(lease.split("-")[1], 16)


class Shared:
    """What the threads of :func:`consume_shared` saw, under one lock: each item's hand-outs (the
    order of their leases), its accepted acks and releases, the hand-outs whose files were not
    right when read (a fault, unless a later lease of the item explains it: the files of a
    lease that expired are deleted by the next one's ack), and the objects of those taken and
    dropped (lease mode: their leases expire). Judged at the end (:meth:`finish`): hand-outs are
    recorded after they happen, by threads that the lease's expiry does not wait for."""

    def __init__(self, expected: list[str], files: dict[str, dict[str, int]], run: Run, what: str) -> None:
        self.lock = threading.Lock()
        self.index = {name: i for i, name in enumerate(expected)}
        self.files, self.run, self.what = files, run, what
        self.handed: dict[str, list[int]] = {}  # name -> the order of each of its leases
        self.acked: dict[str, list[int]] = {}  # name -> the leases its accepted acks named
        self.releases: dict[str, int] = {}  # name -> releases accepted
        self.unread: list[tuple[str, int, str]] = []  # (name, lease, what was wrong) of files not right when read
        self.dropped: dict[str, Any] = {}  # name -> the object taken and dropped, its lease to expire
        self.leases = False  # lease_timeout set: a lease may expire, its item handed out again

    def deliver(self, item: Any) -> Any:
        """Record a hand-out and read its files; returns the object dropped earlier for the same
        item (its lease expired: it came again), if any."""
        name, run = item.name, self.run
        with self.lock:
            run.takes += 1
            if name not in self.index:
                run.wrong.append(f"{self.what}: got {name}, not listed")
                return None
            self.handed.setdefault(name, []).append(lease_order(item.lease))
            if len(self.handed[name]) > 1 and self.leases:
                run.redelivered += 1
            stale = self.dropped.pop(name, None)
        self.read(item)
        return stale

    def read(self, item: Any) -> None:
        """Check ``item``'s files; what is not right is judged at the end (:meth:`finish`)."""
        wrong = Run(self.run.timeout, self.run.log)
        try:
            right_bytes(item, self.files[item.name], wrong, self.what)
        except FileNotFoundError as exc:
            wrong.wrong.append(f"{self.what}: {item.name}: {exc}")
        if wrong.wrong:
            with self.lock:
                self.unread.append((item.name, lease_order(item.lease), wrong.wrong[0]))

    def acked_now(self, items: list[Any]) -> None:
        with self.lock:
            for it in items:
                self.acked.setdefault(it.name, []).append(lease_order(it.lease))
            self.run.acks += len(items)

    def released_now(self, item: Any) -> None:
        with self.lock:
            self.releases[item.name] = self.releases.get(item.name, 0) + 1
            self.run.releases += 1

    def finish(self, expected: list[str]) -> None:
        """At the end of the pass: the first hand-outs in the listing's order (the broker's
        leases are counted in hand-out order); every item acked once, by its last lease (an ack
        of an earlier one accepted would have deleted the files of a later one under its
        consumer); handed out again only after a release or (lease mode) an expiry; files not
        right only where a later lease of the item explains it."""
        run, what = self.run, self.what
        firsts = sorted((min(leases), name) for name, leases in self.handed.items())
        listed, want = [name for _, name in firsts], [n for n in expected if n in self.handed]
        if listed != want:
            at = next(i for i, (a, b) in enumerate(zip(listed, want, strict=True)) if a != b)
            run.wrong.append(f"{what}: first hand-outs out of the listing's order at {listed[at]} (expected {want[at]})")
        if not (run.hung or run.errors):
            missing = [n for n in expected if n not in self.acked]
            if missing:
                run.wrong.append(f"{what}: {len(missing)} items never acked: {missing[:5]}")
        for name, acks in self.acked.items():
            last = max(self.handed.get(name, [-1]))
            if len(acks) > 1:
                run.wrong.append(f"{what}: {name} acked {len(acks)} times (leases {acks})")
            elif acks[0] != last:
                run.wrong.append(f"{what}: {name}: the ack of lease {acks[0]} was accepted, and lease {last} came after")
        if not self.leases:
            again = [n for n, leases in self.handed.items() if len(leases) > 1 + self.releases.get(n, 0)]
            if again:
                run.wrong.append(f"{what}: handed out more often than released, without leases: {again[:5]}")
        for name, lease, message in self.unread:
            if not self.leases or lease == max(self.handed[name]):
                run.wrong.append(message)
            else:
                run.overtaken += 1


def consume_shared(pipe: Pipeline, setup: Setup, run: Run, expected: list[str], files: dict[str, dict[str, int]],
                   rng: random.Random, what: str) -> None:  # fmt: skip
    """Take the items of ``pipe`` in ``setup.threads`` threads at once, each holding up to
    ``setup.hold`` items (acked in random order, or released), or each looping with ``auto_ack``.
    Lease mode (``lease_timeout`` set): a thread now and then drops an item it took (never acks
    it; at most ``setup.forget`` at a time): it must come again after the lease, and an ack of
    the dropped object then must be refused (:class:`UnknownItemError`) and leave the new
    hand-out's files in place; an ack of a held item whose lease expired meanwhile may be
    refused too (it comes again). Checks each item's bytes, that each thread's new items are in
    the listing's order, and at the end that every item was acked once, by its last lease."""
    progress: list[Any] = [time.monotonic(), "before the first take"]
    done = threading.Event()
    watchdog = watched(pipe, run, progress, done, what)
    shared = Shared(expected, files, run, what)
    shared.leases = setup.options.get("lease_timeout") is not None

    def refused(kind: str, exc: UnknownItemError) -> None:
        if not shared.leases:
            raise exc
        with shared.lock:
            run.refused += 1

    def ack(items: list[Any], trng: random.Random) -> None:
        if len(items) > 1 and len({it.name for it in items}) == len(items) and trng.random() < 0.5:
            try:
                pipe.ack_many(items)
                shared.acked_now(items)
                return
            except UnknownItemError as exc:  # one of them expired: none acked; each on its own below
                refused("ack_many", exc)
        for it in items:
            try:
                pipe.ack(it)
                shared.acked_now([it])
            except UnknownItemError as exc:
                refused("ack", exc)

    def late(stale: Any, live: Any) -> None:
        """Ack ``stale``, dropped and then handed out again as ``live``: refused, ``live`` left whole."""
        try:
            pipe.ack(stale)
        except UnknownItemError:
            with shared.lock:
                run.late_refused += 1
        else:
            with shared.lock:
                run.wrong.append(f"{what}: a late ack of {stale.name}'s expired lease {stale.lease} was accepted")
        shared.read(live)

    def worker(t: int, trng: random.Random) -> None:
        held: list[Any] = []
        try:
            if setup.auto_ack:
                previous = None
                started = time.monotonic()
                for item in pipe:
                    if previous is not None:  # acked by the loop as it asked for this one
                        shared.acked_now([previous])
                    run.longest = max(run.longest, time.monotonic() - started)
                    progress[:] = [time.monotonic(), f"thread {t} after {item.name}"]
                    shared.deliver(item)
                    previous = item
                    if trng.random() < setup.pauses:
                        time.sleep(trng.uniform(0, 0.005))
                    started = time.monotonic()
                if previous is not None and not run.hung:
                    shared.acked_now([previous])
                return
            while True:
                target = trng.randint(0, setup.hold)
                while len(held) > target:
                    if trng.random() < 0.07:
                        back = held.pop(trng.randrange(len(held)))
                        try:
                            pipe.release(back)
                            shared.released_now(back)
                        except UnknownItemError as exc:  # expired: handed out again already, or soon
                            refused("release", exc)
                        continue
                    trng.shuffle(held)
                    n = trng.randint(1, len(held) - target)
                    ack(held[:n], trng)
                    del held[:n]
                if trng.random() < setup.pauses:
                    time.sleep(trng.uniform(0, 0.005))
                started = time.monotonic()
                progress[:] = [started, f"thread {t} taking with {len(held)} held"]
                count = trng.randint(1, setup.hold + 1 - len(held)) if trng.random() < 0.2 else 1
                items = pipe.get_many(count, timeout=run.timeout + 10)
                run.longest = max(run.longest, time.monotonic() - started)
                progress[:] = [time.monotonic(), f"thread {t} after a take"]
                if not items:
                    ack(held, trng)  # lease mode: all are stale by now (the end waits for every live lease)
                    return
                for item in items:
                    stale = shared.deliver(item)
                    if stale is not None:
                        late(stale, item)
                    mine = next((h for h in held if h.name == item.name), None)
                    if mine is not None:  # its lease expired while this thread held it: the old one is stale
                        held.remove(mine)
                        late(mine, item)
                    with shared.lock:
                        drop = shared.leases and len(shared.dropped) < setup.forget and trng.random() < 0.05
                        if drop:
                            shared.dropped[item.name] = item
                            run.dropped += 1
                    if not drop:
                        held.append(item)
        except RuntimeError:
            if not run.hung:
                raise
        except Exception as exc:  # noqa: BLE001 - any failure of a thread is a finding of the seed
            with shared.lock:
                if not run.hung:
                    run.errors.append(f"{what}: thread {t}: {type(exc).__name__}: {exc}")
            pipe.close()  # the others end too

    threads = [threading.Thread(target=worker, args=(t, random.Random(rng.random())), name=f"stress-consumer-{t}")
               for t in range(setup.threads)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    watchdog.join()
    shared.finish(expected)
    if run.hung:
        raise Hang


def items_in(cache: Path) -> set[str]:
    """The names under ``cache`` but its state folder."""
    return {p.name for p in cache.iterdir() if p.name != ".cachepipe"} if cache.exists() else set()


def cachepipe_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("cachepipe"))


def fds() -> dict[str, str]:
    """This process's open file descriptors and what each is."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            found[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own, closed since
            continue
    return found


def resizer(pipe: Pipeline, setup: Setup, run: Run, bound: list[int], stop: threading.Event, rng: random.Random,
            block: int) -> None:  # fmt: skip
    """Mode capacity: every 2-30 ms, set the capacity of ``pipe`` to one between the least that
    serves the consumer (``setup.capacity``) and ``setup.resize`` times it; now and then to a
    block, which must be refused (``ValueError``: no room beside the state); and now and then,
    for 5-30 ms, below the least, down to the state and the largest item (``setup.lowest``: no
    item is ever over it), which may be below the items the consumer holds (the docs: "nothing
    is deleted for it; downloads wait until acknowledgements bring the cache under it": the
    consumer's take waits, for room only its acks would free, until the capacity comes back).
    ``bound[0]``: what the cache may hold now: raised before a grow; after a shrink, lowered only
    once the cache counts no more than the new capacity (``Cache.used``: downloads reserved
    under the old one may still be written), the next change waiting for that; not lowered for
    a shrink below the least."""
    least = setup.capacity
    try:
        while not stop.wait(rng.uniform(0.002, 0.03)):
            if rng.random() < 0.05:
                try:
                    pipe.set_capacity(block)
                except ValueError:
                    run.resize_refused += 1
                else:
                    run.wrong.append(f"set_capacity({block}) accepted below the state's room ({pipe._cache.limit})")  # noqa: SLF001
                continue
            if setup.lowest < least and rng.random() < 0.1:  # below what the consumer may hold, for a moment
                pipe.set_capacity(rng.randint(setup.lowest, least - 1))
                run.resized += 1
                run.below += 1
                stop.wait(rng.uniform(0.005, 0.03))
            new = rng.randint(least, least * setup.resize)
            if new >= bound[0]:
                bound[0] = new
                pipe.set_capacity(new)
            else:
                pipe.set_capacity(new)
                while pipe._cache.used > new and not stop.wait(0.001):  # noqa: SLF001 - the count set_capacity compares
                    pass
                if pipe._cache.used <= new:  # noqa: SLF001
                    bound[0] = new
            run.resized += 1
    except RuntimeError:  # closed (the watchdog's, or the pass ended)
        pass


def arm(proxy: Any, setup: Setup, run: Run, rng: random.Random) -> None:
    """Mode faults: each request through ``proxy`` (a LIST or a GET) meets a fault at the chance
    ``setup.faults``: half of them a 503 (SlowDown) answered in its place; the other half let
    through, but the next connection reset or cut after its first 2,000 bytes, and every live
    connection dropped at once (a reset of the requests under way, this one among them).
    Drawn per request, not in time: a client that retries meets as many faults a request
    however fast it retries (faults on a clock met every retry of a quick backoff)."""
    gate = threading.Event()
    gate.set()  # held for no time: answered with the 503 at once

    def hit(head: str) -> bool:  # on the proxy's loop, for each request's head
        draw = rng.random()
        if draw < setup.faults / 2:
            run.faults += 1
            return True
        if draw < setup.faults:
            run.faults += 1
            proxy.inject(rng.choice(["reset", "cut"]), 1)
        return False

    proxy.hold(hit, gate, answer="503")


def one_pipeline(source: Source, cache: Path, setup: Setup, run: Run, expected: list[str], files: dict[str, dict[str, int]],
                 rng: random.Random, stop_after: int | None, what: str, bound: list[int] | None = None,
                 proxy: Any = None, **extra: Any) -> tuple[list[str], dict[str, Any] | None]:  # fmt: skip
    """Open a pipeline over ``source``, consume it, close it and look for leaks; returns the
    names acked and the state at the close (None: the pass ended, or failed). ``bound``: the
    capacity in force, which mode capacity changes (:func:`resizer`); ``proxy``: the fault
    proxy the source is read through (mode faults: :func:`arm`)."""
    before = fds()
    items_before = items_in(cache)
    WARNINGS.messages.clear()
    state = extra.pop("state", None)
    pipe = Pipeline(source.url, cache, setup.capacity, store=source.store(), storage_options=source.options,
                    auto_ack=setup.auto_ack, stall_warning=run.timeout / 4, **setup.options, **extra)  # fmt: skip
    if state is not None:
        pipe.load_state_dict(state)
    acked: list[str] = []
    saved = None
    opened = False
    stop = threading.Event()
    helpers = []
    if proxy is not None:  # the faults from the listing's first request on
        arm(proxy, setup, run, random.Random(rng.random()))
    try:
        pipe.open()
        opened = True
        if setup.resize and bound is not None:
            block = clamp_block(os.statvfs(cache).f_frsize)
            helpers.append(threading.Thread(target=resizer, args=(pipe, setup, run, bound, stop, random.Random(rng.random()),
                                                                  block), name="stress-resizer"))  # fmt: skip
            helpers[-1].start()
        if setup.threads > 1 or "lease_timeout" in setup.options:
            consume_shared(pipe, setup, run, expected, files, rng, what)
        else:
            acked = consume(pipe, setup, run, expected, files, rng, stop_after, what)
        if stop_after is not None and not run.wrong:
            saved = pipe.state_dict()
    except Hang:
        pass
    except (CachePipeError, OSError) as exc:
        if proxy is not None and not run.hung:  # the retries spent: an error the docs name (ItemFailedError...)
            retried = sum("retry" in m for m in WARNINGS.messages)
            run.documented.append(f"{what}: {type(exc).__name__}: {exc} ({retried} retries logged in the pass)")
        elif not run.hung:
            run.errors.append(f"{what}: {type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - any failure of the pass is a finding of the seed
        if not run.hung:
            run.errors.append(f"{what}: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        for helper in helpers:
            helper.join()
        if proxy is not None:  # no fault for what comes after the pass (the probe of a resumed pass's state)
            proxy.clear()
            proxy.hold(lambda _head: False, stop)
        if setup.resize and bound is not None:
            bound[0] = max(bound[0], setup.capacity)
        pipe.close()
    deadline = time.monotonic() + 5
    while cachepipe_threads() and time.monotonic() < deadline:  # joined by close: this should not wait
        time.sleep(0.05)
    if cachepipe_threads():
        run.leaks.append(f"{what}: threads alive after close: {cachepipe_threads()}")
    for _ in range(40 if proxy is not None else 5):  # the sampler's walk holds a folder open for a moment, the proxy
        new_fds = sorted(set(fds().values()) - set(before.values()))  # its sockets as it closes them: a leak stays
        if not new_fds:
            break
        time.sleep(0.05)
    if new_fds:
        run.leaks.append(f"{what}: file descriptors open after close that were not before: {new_fds[:5]}")
    # kept by an earlier pass: this one's failed open leaves them to the next owner (its recovery decides)
    left = sorted(items_in(cache) - (set() if opened else items_before))
    if left and not extra.get("keep_on_close"):
        run.leaks.append(f"{what}: left in the cache after close: {left[:5]}")
    return acked, saved


def run_seed(
    mode: str,
    seed: int,
    timeout: float,
    log: TextIO,
    server: Server | None = None,
    max_items: int | None = None,
    proxy: Any = None,
) -> dict[str, Any]:
    rng = random.Random(f"{mode}/{seed}")
    setup = choose(mode, rng, max_items)
    setup.keep = setup.stop_after is not None and random.Random(f"{mode}/{seed}/keep").random() < 0.5  # the rest as before
    started = time.monotonic()
    run = Run(timeout, log)
    resumed_capacity = 0
    with tempfile.TemporaryDirectory(prefix="stress-pipeline-") as tmp:
        via = proxy.endpoint if proxy is not None else None
        source = Source(Path(tmp, "source"), setup.page, setup.pause, server, f"{mode}-{seed}-{os.getpid()}", via)
        items = setup.options.get("items", "folders")
        names, files = (make_files_source if items == "files" else make_source)(source.folder, setup.count, rng)
        if server is not None:
            source.upload()
        block = clamp_block(os.statvfs(tmp).f_frsize)  # the cache's filesystem: the caches are under tmp
        charges = sorted((charge_of(files[n], block, n) for n in names), reverse=True)
        largest = charges[0]
        state = state_of(source, Path(tmp, "probe"), items=items)
        # the least that serves a consumer holding k items and taking the next: the k + 1 largest
        setup.capacity = setup.factor * (sum(charges[: setup.served + 1]) + state)
        setup.lowest = state + largest
        cache = Path(tmp, "cache")
        bound = [setup.capacity]  # the capacity in force (mode capacity changes it mid-pass)
        with PeakSampler(cache, interval=0.002, block=block, limit=lambda: bound[0]) as peak:
            kept = {"keep_on_close": True} if setup.keep else {}
            acked, saved = one_pipeline(source, cache, setup, run, names, files, rng, setup.stop_after, "pass", bound,
                                        proxy, **kept)  # fmt: skip
            if saved is not None and not (run.hung or run.wrong or run.errors):
                run.resumed = 1
                if setup.resume_by == "journal" and saved.get("n_items") is not None:
                    done = set(acked)
                    rest = [n for n in names[saved["index"] :] if n not in done]
                    extra: dict[str, Any] = {"resume": True}
                else:
                    rest = names[saved["index"] :]
                    extra = {"state": saved}
                if rest:  # the capacity grown by what the resumed open counts beyond the first's state
                    grown = state_of(source, Path(tmp, "probe"), cache, items=items, **extra) - state
                    setup.capacity += max(0, grown)
                    resumed_capacity = setup.capacity
                    bound[0] = max(bound[0], setup.capacity)
                    one_pipeline(source, cache, setup, run, rest, files, rng, None, "resumed", bound, proxy,
                                 **extra)  # fmt: skip
    return {
        "seed": seed,
        "items": setup.count,
        "auto_ack": setup.auto_ack,
        "hold": setup.hold,
        "options": setup.options,
        "page": setup.page,
        "pause": setup.pause,
        "stop_after": setup.stop_after,
        "resume_by": setup.resume_by if run.resumed else "",
        "kept": setup.keep and bool(run.resumed),
        "largest": largest,
        "state": state,
        "capacity": setup.capacity,
        "resumed_capacity": resumed_capacity,
        "peak": peak.peak,
        "samples": peak.samples,
        # samples over the capacity in force (mode capacity: see resizer; else the pass's capacity), as (bytes, capacity)
        "over_capacity": bool(peak.over),
        "over_samples": peak.over[:5],
        "threads": setup.threads,
        "lease_timeout": setup.options.get("lease_timeout"),
        "redelivered": run.redelivered,
        "refused": run.refused,
        "late_refused": run.late_refused,
        "overtaken": run.overtaken,
        "dropped": run.dropped,
        "resized": run.resized,
        "resize_refused": run.resize_refused,
        "below": run.below,
        "fault_chance": setup.faults,
        "faults": run.faults,
        "documented": run.documented,
        "hung": run.hung,
        "hung_told": all(run.told) if run.hung else None,
        "served": setup.served,
        "stalled": not run.hung and run.longest > STALL,
        "longest_take_s": round(run.longest, 3),
        "wrong": run.wrong,
        "errors": run.errors,
        "leaks": run.leaks,
        "takes": run.takes,
        "acks": run.acks,
        "releases": run.releases,
        "resumed": run.resumed,
        "seconds": round(time.monotonic() - started, 2),
    }


# ---- report --------------------------------------------------------------------------
def summary(mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "mode": mode,
        "seeds": len(rows),
        "hung": sum(bool(r["hung"]) for r in rows),
        "stalled": sum(r["stalled"] for r in rows),
        "wrong": sum(bool(r["wrong"]) for r in rows),
        "over_capacity": sum(r["over_capacity"] for r in rows),
        "leaks": sum(bool(r["leaks"]) for r in rows),
        "errors": sum(bool(r["errors"]) for r in rows),
        "takes": sum(r["takes"] for r in rows),
        "releases": sum(r["releases"] for r in rows),
        "resumed": sum(r["resumed"] for r in rows),
        "kept": sum(r.get("kept", False) for r in rows),
        **{k: sum(r[k] for r in rows) for k in COUNTS},
        "documented": sum(bool(r["documented"]) for r in rows),
        "documented_seeds": [r["seed"] for r in rows if r["documented"]],
        "longest_take_s": max((r["longest_take_s"] for r in rows), default=0.0),
        "hung_seeds": [r["seed"] for r in rows if r["hung"]],
        "hung_silent_seeds": [r["seed"] for r in rows if r["hung"] and not r["hung_told"]],
        "stalled_seeds": [r["seed"] for r in rows if r["stalled"]],
        "failed_seeds": [r["seed"] for r in rows if r["wrong"] or r["errors"] or r["leaks"] or r["over_capacity"]],
        "seconds": round(sum(r["seconds"] for r in rows), 1),
    }


def render(report: dict[str, Any]) -> str:
    cols = ["mode", "seeds", "hung", "stalled", "wrong", "over cap", "leaks", "errors", "takes", "releases", "resumed",
            "longest s", "s"]  # fmt: skip
    s = report["summary"]
    row = [str(s[k]) for k in ("mode", "seeds", "hung", "stalled", "wrong", "over_capacity", "leaks", "errors", "takes",
                                "releases", "resumed")] + [f"{s['longest_take_s']:.1f}", f"{s['seconds']:.0f}"]  # fmt: skip
    extra = {"lease": ("redelivered", "refused", "late_refused", "overtaken", "dropped"),
             "capacity": ("resized", "resize_refused", "below"),
             "faults": ("faults", "documented")}.get(s["mode"], ())  # fmt: skip
    lines = [
        *format_table(cols, [row], left=0),
        *([", ".join(f"{k.replace('_', ' ')}: {s[k]}" for k in extra)] if extra else []),
        f"hung seeds: {s['hung_seeds'] or '-'} (not told to ack or release: {s['hung_silent_seeds'] or '-'})",
        f"stalled seeds (a take waited > {STALL:g} s): {s['stalled_seeds'] or '-'}; failed seeds: {s['failed_seeds'] or '-'}",
    ]
    return "\n".join([*lines, *seeds_footer(report, ("hung", "wrong", "errors", "leaks", "documented"))])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="paged", help="the scenario (default paged; see the module notes)")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 30], metavar=("FROM", "TO"), help="seeds FROM..TO-1 (default 0 30)")
    p.add_argument("--timeout", type=float, default=20.0, help="no item for this long is a hang (default 20 s)")
    p.add_argument("--max-items", type=int, help="at most this many items a seed (default: up to 3,000; s3 300)")
    p.add_argument("--log", type=Path, help="where a hang's thread stacks go (default stderr)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.seeds[0] >= args.seeds[1]:
        p.error(f"--seeds {args.seeds[0]} {args.seeds[1]}: expected FROM < TO")
    logger = logging.getLogger("cachepipe")  # its warnings kept, not printed (the small capacities' are by design)
    logger.addHandler(WARNINGS)
    logger.propagate = False
    log = open(args.log, "a") if args.log else sys.stderr  # noqa: SIM115 - open for the whole run
    rows = []
    measured = tree()  # at the start: the commit may move while the seeds run
    server = proxy = None
    if args.mode in ("s3", "faults"):
        for key, value in (("AWS_ACCESS_KEY_ID", CREDENTIALS), ("AWS_SECRET_ACCESS_KEY", CREDENTIALS),
                           ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
            os.environ[key] = value
        os.environ.pop("AWS_PROFILE", None)
        server = Server("subprocess")
        import boto3

        boto3.client("s3", endpoint_url=server.endpoint).create_bucket(Bucket=BUCKET)
        if args.mode == "faults":
            sys.path.insert(0, str(TESTS))
            from faultproxy import FaultProxy  # tests/faultproxy.py

            host, port = server.endpoint.removeprefix("http://").split(":")
            proxy = FaultProxy(host, int(port))
            proxy.endpoint = proxy.start()
    try:
        for seed in range(*args.seeds):
            row = run_seed(args.mode, seed, args.timeout, log, server, args.max_items, proxy)
            state = "HUNG" if row["hung"] else "stalled" if row["stalled"] else "ok"
            if row["wrong"] or row["errors"] or row["over_capacity"] or row["leaks"]:
                state += " FAILED"
            print(
                f"{args.mode} seed {seed}: {state}, {row['items']} items, hold {row['hold']}, {row['takes']} takes, "
                f"longest take {row['longest_take_s']:.1f} s, {row['seconds']:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            rows.append(row)
    finally:
        if log is not sys.stderr:
            log.close()
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
    print_seeds_report(measured, args.timeout, summary(args.mode, rows), rows, render, args.json)
    return 1 if any(r["wrong"] or r["errors"] or r["over_capacity"] or r["leaks"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
