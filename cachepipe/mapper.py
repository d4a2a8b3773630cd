"""``cachepipe map``: process a dataset bigger than the disk, item by item, and write the results back.

::

    cachepipe map SRC DST --cache DIR --capacity 20GiB --jobs 4 [--out-ratio 1.5] -- CMD ARGS...

For each item of ``SRC`` (a first-level folder, or an object with ``--items files``) CMD runs
once, with the item's local path and an empty output folder as ``{}``/``{out}`` placeholders
and as ``$CACHEPIPE_ITEM``/``$CACHEPIPE_OUT``. When it exits 0, everything in the output folder
is uploaded to ``DST/<item>/``, then the marker ``DST/<item>/.cachepipe-done``, then the local
input and output are deleted. Python: :func:`map_items`, with ``fn(item_path, out_path)``.

**The cap, both ways.** Bytes under ``--cache`` never exceed ``--capacity``. Downloads run in a
:class:`~cachepipe.Pipeline` whose capacity is ``capacity - jobs * (reserve + margin)``: they can
never take the space set aside for outputs. Each job owns a *slot* of ``reserve + margin`` bytes
for its outputs (and, with ``--unpack``, the extracted files), where ``reserve`` is
``--out-reserve`` or ``--out-ratio`` times the largest item. A watcher measures every running
job's slot (plus whatever the command adds to its input folder) every ``watch_interval``
(50 ms) and kills the command's process group once it holds more than the item's reserve; the
item fails with :class:`OutputTooLargeError`. The margin (default ``min(reserve, 64 MiB)``)
absorbs what a command writes between two measurements: the cap holds for any command that
writes less than ``margin`` per ``watch_interval`` (1.3 GB/s at the defaults); a faster
writer can pass the cap by what it writes beyond that within one interval. Extraction
(``--unpack``) is exact: each member's size is checked before it is written. The command's
input stays in the cache until its outputs are uploaded (a retry needs it), so downloads pause
while outputs wait for upload.

**Resumable.** Items whose marker exists in ``DST`` are skipped before anything is downloaded.
The marker is written last and lists the item's outputs; a run killed mid-upload leaves no
marker, and the next run does that item again.

**Failures.** A non-zero exit, a timeout or a failed upload retries the item (``--retries``,
re-using the downloaded input; an upload failure re-uploads without running CMD again); then
the item is recorded as failed with the tail of CMD's stderr and the run goes on. Over-reserve
outputs and unusable archives fail at once (a retry would do the same). Exit status 1 if any
item failed.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from .cache import tree_bytes
from .catalog import check_key, group_items
from .config import Capacity, Share, parse_size
from .errors import (
    CacheLockedError,
    CachePipeError,
    ConfigError,
    ItemFailedError,
    UnknownItemError,
    UnsafeKeyError,
    is_transient,
)
from .fetcher import backoff_delay
from .pipeline import CachedItem, Pipeline
from .stores import Store, open_store
from .stores.base import ObjectInfo, WritableStore
from .unpack import (
    DEFAULT_MAX_MEMBERS,
    ArchiveError,
    ChecksumError,
    is_checksum_file,
    split_volume,
    unpack_item,
)
from .uploader import Uploader, marker_key

__all__ = [
    "WORK_DIR",
    "MapConfig",
    "MapFailure",
    "MapItem",
    "MapResult",
    "OutputTooLargeError",
    "add_map_parser",
    "map_items",
    "plan_items",
    "run_map_command",
]

log = logging.getLogger("cachepipe.map")

WORK_DIR = ".cachepipe-map"
"""The folder under the cache directory holding the jobs' slots (outputs, extracted files)."""

TAIL_BYTES = 4096
_MIB = 1024**2


class OutputTooLargeError(CachePipeError, OSError):
    """A job's outputs (with extracted files and what it added to its input) outgrew its reserve."""


class CommandError(CachePipeError, RuntimeError):
    """CMD (or ``fn``) exited non-zero or timed out; ``tail`` holds the end of its stderr."""

    def __init__(self, message: str, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


def _optional_size(what: str) -> Any:
    return BeforeValidator(lambda v: None if v is None else parse_size(v, what))


class MapConfig(BaseModel):
    """Every option of a map run, validated (sizes in bytes). See :func:`map_items` for each."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    source: str = Field(min_length=1)
    dest: str = Field(min_length=1)
    cache_dir: Path
    capacity: Capacity
    command: tuple[str, ...] | None = None
    jobs: int = Field(default=1, ge=1, le=1024)
    out_reserve: Annotated[int | None, _optional_size("out_reserve")] = None
    out_ratio: float | None = Field(default=None, gt=0)
    out_margin: Annotated[int | None, _optional_size("out_margin")] = None
    items: Literal["folders", "files"] = "folders"
    unpack: bool = False
    timeout: float | None = Field(default=None, gt=0)
    retries: int = Field(default=2, ge=0, le=100)
    request_retries: int = Field(default=12, ge=0, le=1000)
    retry_backoff: float = Field(default=0.2, ge=0, le=60)
    retry_backoff_max: float = Field(default=10.0, gt=0, le=600)
    max_concurrency: int = Field(default=16, ge=1, le=1024)
    part_size: Annotated[int, BeforeValidator(lambda v: parse_size(v, "part_size"))] = 8 * _MIB
    upload_concurrency: int = Field(default=8, ge=1, le=1024)
    upload_part_size: Annotated[int, BeforeValidator(lambda v: parse_size(v, "upload_part_size"))] = 16 * _MIB
    storage_options: dict[str, Any] = Field(default_factory=dict)
    dest_options: dict[str, Any] | None = None
    watch_interval: float = Field(default=0.05, gt=0, le=10)
    kill_grace: float = Field(default=5.0, ge=0, le=600)
    max_members: int = Field(default=DEFAULT_MAX_MEMBERS, ge=1)
    dry_run: bool = False
    progress: bool = False

    @model_validator(mode="after")
    def _check(self) -> MapConfig:
        if self.out_reserve is not None and self.out_ratio is not None:
            raise ValueError("give out_reserve or out_ratio, not both")
        if self.upload_part_size < 5 * _MIB:
            raise ValueError(f"upload_part_size {self.upload_part_size}: expected at least 5 MiB (the smallest S3 part)")
        return self


# ---- planning (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class MapItem:
    """One unit of work.

    Attributes:
        name: its name in ``SRC`` and ``DST`` (results go to ``DST/<name>/``).
        local: its name in the cache (a single path segment when volumes are grouped).
        objects: its objects as the pipeline lists them (keys relative to ``SRC``, or under
            ``local`` when grouped).
        keys: real key of each listed key.
        size: total bytes.
    """

    name: str
    local: str
    objects: tuple[ObjectInfo, ...]
    keys: dict[str, str] = field(hash=False, compare=False)
    size: int = 0


def plan_items(objects: Iterable[ObjectInfo], items: Literal["folders", "files"], unpack: bool) -> list[MapItem]:
    """Group a listing into work items.

    ``folders``: each first-level folder; ``files``: each object. With ``files`` and ``unpack``,
    split volumes (``x.tar.gz-00``, ``x.tar.gz-01``...; ``.partaa``...; ``.001``...) in one folder
    form one item named by their stem (``dir/x.tar.gz``), and checksum files are attached to the
    item whose volume they name: ``<volume>.md5`` (in the same folder or, if that volume's file
    name is unique, anywhere under ``SRC``, e.g. a ``md5/`` folder beside ``compressed/``), and an
    ``md5sums`` file to every item with a volume in its folder. Checksum files are not items.

    Raises:
        UnsafeKeyError: an unsafe key, or an item named like the work folder ``.cachepipe-map``.
    """
    objects = [o for o in objects if not (o.key.endswith("/") and o.size == 0)]
    if items == "folders" or not unpack:
        planned = [MapItem(it.name, it.name, tuple(ObjectInfo(f.key, f.size, f.etag) for f in it.files),
                           {f.key: f.key for f in it.files}, it.size) for it in group_items(objects, items)]
    else:
        planned = _plan_grouped(objects)
    for mi in planned:
        if mi.local.split("/", 1)[0] == WORK_DIR:
            raise UnsafeKeyError(mi.objects[0].key, f"'{WORK_DIR}' is reserved for cachepipe map's work folder")
    return planned


def _plan_grouped(objects: list[ObjectInfo]) -> list[MapItem]:
    groups: dict[str, list[ObjectInfo]] = {}
    sidecars: list[ObjectInfo] = []
    for obj in objects:
        check_key(obj.key)
        if is_checksum_file(obj.key):
            sidecars.append(obj)
            continue
        folder, _, base = obj.key.rpartition("/")
        split = split_volume(base)
        name = obj.key if split is None else (f"{folder}/{split[0]}" if folder else split[0])
        groups.setdefault(name, []).append(obj)
    by_base: dict[str, list[str]] = {}
    for name, members in groups.items():
        for obj in members:
            by_base.setdefault(obj.key.rpartition("/")[2], []).append(name)
    for side in sidecars:
        folder, _, base = side.key.rpartition("/")
        if base.lower().endswith(".md5"):
            owners = by_base.get(base[:-4], [])
            near = [n for n in owners if any(o.key == f"{folder}/{base[:-4]}".lstrip("/") for o in groups[n])]
            targets = near or (owners if len(owners) == 1 else [])
        else:
            targets = [n for n, members in groups.items() if any(o.key.rpartition("/")[0] == folder for o in members)]
        for name in targets:
            groups[name].append(side)
    planned = []
    for name in sorted(groups):
        local = quote(name, safe="")
        members = sorted(groups[name], key=lambda o: o.key)
        listed = tuple(ObjectInfo(f"{local}/{o.key}", o.size, o.etag) for o in members)
        planned.append(MapItem(name, local, listed, {f"{local}/{o.key}": o.key for o in members}, sum(o.size for o in members)))
    return planned


class _PlannedSource:
    """The source store as the pipeline sees it: only the items to do, under their cache names."""

    def __init__(self, store: Store, items: Sequence[MapItem]) -> None:
        self.url = store.url
        self._store = store
        self._objects = sorted((o for mi in items for o in mi.objects), key=lambda o: o.key)
        self._keys = {k: v for mi in items for k, v in mi.keys.items()}

    def list(self) -> Iterator[ObjectInfo]:
        return iter(self._objects)

    def get(self, key: str, out: Any, start: int, end: int) -> int:
        return self._store.get(self._keys[key], out, start, end)

    def close(self) -> None:
        """The map run owns the real store and closes it."""


# ---- running one command -------------------------------------------------------------------------
_PR_SET_PDEATHSIG = 1
_libc: Any = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(None, use_errno=True)
        _prctl = _libc.prctl
    except (OSError, AttributeError):
        _libc = None


def _die_with_parent() -> None:
    """In a child: be killed when the map process dies (kill -9 included), so no orphan keeps
    writing into the cache. Linux only; elsewhere a no-op."""
    if _libc is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: this reaches everything it started
    except ProcessLookupError:
        try:
            os.kill(pid, sig)  # not yet a group leader (a function child before its setsid)
        except ProcessLookupError:
            pass  # already gone


class _CommandRun:
    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        # preexec_fn runs in the forked child before exec; _die_with_parent only makes one prctl
        # call through a function looked up at import, touching no lock another thread could hold.
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_die_with_parent if _libc is not None else None)  # noqa: PLW1509
        self.pid = self.proc.pid

    def wait(self, timeout: float | None, grace: float) -> tuple[int, str, bool]:
        """Block until CMD exits, keeping the tail of its stderr; past ``timeout`` TERM its group,
        ``grace`` seconds later KILL it. Returns (exit status, stderr tail, timed out)."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        tail = bytearray()
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._grace = grace
        self._stage = 0  # 0 running, 1 sent TERM, 2 sent KILL
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:  # read stderr until EOF (or until a KILL did not bring EOF: a detached descendant holds it)
                remaining = self._remaining()
                if remaining is not None and remaining <= 0:
                    if not self._escalate():
                        break
                    continue
                if not sel.select(remaining):
                    continue
                data = os.read(fd, 65536)
                if not data:
                    break
                tail += data
                del tail[:-TAIL_BYTES]
        while True:  # CMD may have closed its stderr and run on
            remaining = self._remaining()
            try:
                code = self.proc.wait(None if remaining is None else max(remaining, 0))
                break
            except subprocess.TimeoutExpired:
                self._escalate()
        self.proc.stderr.close()
        return code, tail.decode("utf-8", "replace"), self._stage > 0

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _escalate(self) -> bool:
        """The deadline passed: TERM, then KILL the group; False once KILL was sent and its second passed."""
        if self._stage == 2:
            self._deadline = None  # SIGKILL cannot be ignored: the exit comes
            return False
        self._stage += 1
        _signal_group(self.pid, signal.SIGTERM if self._stage == 1 else signal.SIGKILL)
        self._deadline = time.monotonic() + (self._grace if self._stage == 1 else 1.0)
        return True

    def kill(self) -> None:
        _signal_group(self.pid, signal.SIGKILL)


def _call_in_child(fn: Callable[[str, str], Any], item: str, out: str, cwd: str, env: dict[str, str], conn: Any) -> None:
    """Body of a function child (spawned): own session, dies with the parent, reports a traceback."""
    os.setsid()
    _die_with_parent()
    os.chdir(cwd)
    os.environ.update(env)
    try:
        fn(item, out)
    except BaseException:  # noqa: BLE001 - whatever fn raised is the item's failure, reported to the parent
        conn.send(traceback.format_exc()[-TAIL_BYTES:])
        conn.close()
        sys.exit(1)
    conn.close()


class _FunctionRun:
    def __init__(self, fn: Callable[[str, str], Any], item: Path, out: Path, cwd: Path, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_call_in_child, args=(fn, str(item), str(out), str(cwd), env, child),
                                name="cachepipe-map-fn", daemon=True)
        self.proc.start()
        child.close()
        self.pid = self.proc.pid

    def wait(self, timeout: float | None, grace: float) -> tuple[int, str, bool]:
        timed_out = not multiprocessing.connection.wait([self.proc.sentinel], timeout)
        if timed_out:
            _signal_group(self.pid, signal.SIGTERM)
            if not multiprocessing.connection.wait([self.proc.sentinel], grace):
                _signal_group(self.pid, signal.SIGKILL)
        self.proc.join()
        tail = ""
        if self._conn.poll():
            try:
                tail = self._conn.recv()
            except EOFError:
                pass  # the child closed the pipe without a traceback: it succeeded, or was killed
        code = self.proc.exitcode if self.proc.exitcode is not None else -1
        self._conn.close()
        self.proc.close()
        return code, tail, timed_out

    def kill(self) -> None:
        _signal_group(self.pid, signal.SIGKILL)


# ---- the output watcher ----------------------------------------------------------------------------
@dataclass(eq=False)
class _Watch:
    run: Any
    slot: Path
    grown: Path | None  # the input folder when CMD runs in it: what it adds there counts too
    base: int  # the input's size
    limit: int
    over: bool = False
    peak: int = 0

    def measure(self) -> int:
        used = tree_bytes(self.slot)
        if self.grown is not None:
            used += max(0, tree_bytes(self.grown) - self.base)
        self.peak = max(self.peak, used)
        return used


class _Watcher:
    """Measures the running jobs' slots every ``interval`` and kills a job that outgrew its reserve.

    Sizes have no change event to wait on, so this thread polls, and only while a job runs
    (it waits on a condition otherwise). Stop is immediate.
    """

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._watches: set[_Watch] = set()
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cachepipe-map-watcher", daemon=True)
        self._thread.start()

    def add(self, watch: _Watch) -> None:
        with self._cond:
            self._watches.add(watch)
            self._cond.notify_all()

    def remove(self, watch: _Watch) -> None:
        with self._cond:
            self._watches.discard(watch)

    def kill_all(self) -> None:
        with self._cond:
            for watch in self._watches:
                watch.run.kill()

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._watches and not self._stop.is_set():
                    self._cond.wait()
                watches = list(self._watches)
            for watch in watches:
                if not watch.over and watch.measure() > watch.limit:
                    watch.over = True
                    watch.run.kill()
                    log.warning("outputs of the job in %s passed its reserve of %d bytes: command killed", watch.slot, watch.limit)
            self._stop.wait(self._interval)


# ---- results ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MapFailure:
    """A failed item: its name, the error, CMD's stderr tail (may be empty), attempts made."""

    name: str
    error: str
    stderr_tail: str
    attempts: int


@dataclass
class MapResult:
    """What a map run did. Sizes in bytes.

    Attributes:
        items_listed: items under ``SRC``.
        items_skipped: items already complete in ``DST`` (marker found): not run.
        items_done: items completed by this run.
        items_failed: items recorded as failed (see :attr:`failed`).
        items_retried: attempts beyond the first, over all items.
        planned: names of the items to do (with ``dry_run``: what would run).
        bytes_in: bytes downloaded.
        bytes_out: bytes of outputs uploaded (markers excluded).
        files_out: output files uploaded.
        seconds: wall time of the run.
        capacity: the cap on bytes under the cache dir.
        download_capacity: the part of it given to downloads.
        reserve: bytes set aside per job for outputs (without the margin).
        margin: extra bytes per job that absorb a burst between two watcher measurements.
        peak_job_bytes: the largest job slot measured (outputs + extracted + added to inputs).
        failed: the failures, in the order they happened.
    """

    items_listed: int = 0
    items_skipped: int = 0
    items_done: int = 0
    items_failed: int = 0
    items_retried: int = 0
    planned: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    files_out: int = 0
    seconds: float = 0.0
    capacity: int = 0
    download_capacity: int = 0
    reserve: int = 0
    margin: int = 0
    peak_job_bytes: int = 0
    failed: list[MapFailure] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when no item failed."""
        return not self.failed


# ---- the run ---------------------------------------------------------------------------------------------
class _Slot:
    """One job's work folder under ``cache_dir/.cachepipe-map/<n>/``: ``in`` (extracted files),
    ``out`` (outputs), ``cwd`` (working directory for single-file items)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inp = root / "in"
        self.out = root / "out"
        self.cwd = root / "cwd"

    def reset(self) -> None:
        if self.root.exists():
            shutil.rmtree(self.root)
        for path in (self.inp, self.out, self.cwd):
            path.mkdir(parents=True)


@dataclass(frozen=True)
class _Sizing:
    capacity: int
    reserve: int
    margin: int
    jobs: int

    @property
    def downloads(self) -> int:
        return self.capacity - self.jobs * (self.reserve + self.margin)


class _MapRun:
    def __init__(self, cfg: MapConfig, fn: Callable[[str, str], Any] | None, store: Store | None, dest_store: Store | None) -> None:
        self.cfg = cfg
        self._fn = fn
        self._store = store
        self._dest = dest_store
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._result = MapResult()
        self._by_local: dict[str, MapItem] = {}
        self._crash: BaseException | None = None
        self._bar: Any = None
        self._bytes_taken = 0

    # -- orchestration ---------------------------------------------------------------------------------
    def run(self) -> MapResult:
        cfg, result = self.cfg, self._result
        started = time.monotonic()
        src = self._store or open_store(cfg.source, cfg.storage_options)
        try:
            dst = self._dest or open_store(cfg.dest, cfg.storage_options if cfg.dest_options is None else cfg.dest_options)
            try:
                if not isinstance(dst, WritableStore):
                    raise ConfigError(f"destination {cfg.dest!r}: {type(dst).__name__} cannot be written to (it has no put/exists)")
                if hasattr(dst, "upload_part_size"):
                    dst.upload_part_size = cfg.upload_part_size  # type: ignore[attr-defined]
                inside = _inside_prefix(cfg.source, cfg.dest)
                listing = self._retrying(f"listing {cfg.source}", lambda: list(src.list()))
                if inside is not None:  # DST under SRC: its results are not items
                    listing = [o for o in listing if not o.key.startswith(inside)]
                planned = plan_items(listing, cfg.items, cfg.unpack)
                done = self._done(dst, planned)
                todo = [mi for mi in planned if mi.name not in done]
                result.items_listed, result.items_skipped = len(planned), len(done)
                result.planned = [mi.name for mi in todo]
                if todo and not cfg.dry_run:
                    self._execute(src, dst, todo)
                elif todo:
                    self._size(todo, _resolve_capacity(cfg.capacity, cfg.cache_dir))
            finally:
                if self._dest is None:
                    dst.close()
        finally:
            if self._store is None:
                src.close()
        result.seconds = time.monotonic() - started
        return result

    def _size(self, todo: Sequence[MapItem], capacity: int) -> _Sizing:
        cfg = self.cfg
        reserve = max(self._reserve(mi) for mi in todo)
        margin = cfg.out_margin if cfg.out_margin is not None else min(reserve, 64 * _MIB)
        sizing = _Sizing(capacity, reserve, margin, min(cfg.jobs, len(todo)))
        r = self._result
        r.capacity, r.reserve, r.margin, r.download_capacity = capacity, reserve, margin, sizing.downloads
        if sizing.downloads <= 0:
            raise ConfigError(
                f"capacity {capacity} bytes leaves no room for downloads after setting aside {sizing.jobs} jobs x "
                f"({reserve} bytes reserve + {margin} bytes margin) for outputs; raise capacity, or lower jobs, "
                "out_reserve/out_ratio or out_margin"
            )
        return sizing

    def _reserve(self, mi: MapItem) -> int:
        if self.cfg.out_reserve is not None:
            return self.cfg.out_reserve
        return max(1, math.ceil((self.cfg.out_ratio or 1.0) * mi.size))

    def _execute(self, src: Store, dst: WritableStore, todo: list[MapItem]) -> None:
        cfg = self.cfg
        cache_dir = cfg.cache_dir.absolute()
        sizing = self._size(todo, _resolve_capacity(cfg.capacity, cache_dir))  # refuse before touching the disk
        work = cache_dir / WORK_DIR
        work.mkdir(parents=True, exist_ok=True)
        lock_fd = _take_lock(work, cache_dir)
        try:
            for entry in work.iterdir():  # slots left by a run that died
                if entry.name != "lock":
                    shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            fits = [mi for mi in todo if mi.size <= sizing.downloads]
            for mi in todo:
                if mi.size > sizing.downloads:
                    self._fail(mi.name, f"item is {mi.size} bytes, more than the {sizing.downloads} bytes the capacity leaves for "
                               "downloads beside the output reserves; raise capacity or lower jobs/out_reserve", "", 0)
            if fits:
                self._by_local = {mi.local: mi for mi in fits}
                self._pump(src, dst, fits, sizing, work)
        finally:
            os.close(lock_fd)
        if self._crash is not None:
            raise self._crash

    def _pump(self, src: Store, dst: WritableStore, items: list[MapItem], sizing: _Sizing, work: Path) -> None:
        cfg = self.cfg
        grouped = cfg.items == "files" and cfg.unpack
        pipe = Pipeline(cfg.source, cfg.cache_dir, sizing.downloads, store=_PlannedSource(src, items),
                        items="folders" if grouped else cfg.items, auto_ack=False, on_error="raise",
                        retries=cfg.request_retries, retry_backoff=cfg.retry_backoff, retry_backoff_max=cfg.retry_backoff_max,
                        max_concurrency=cfg.max_concurrency, part_size=cfg.part_size)
        self._uploader = Uploader(dst, cfg.upload_concurrency, cfg.request_retries, cfg.retry_backoff, cfg.retry_backoff_max, self._stop)
        self._watcher = _Watcher(cfg.watch_interval)
        if cfg.progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=len(items), unit="item", desc="cachepipe map", dynamic_ncols=True)
        workers: list[threading.Thread] = []
        try:
            with pipe:
                self._pipe = pipe
                for n in range(sizing.jobs):
                    slot = _Slot(work / str(n))
                    workers.append(threading.Thread(target=self._worker, args=(slot,), name=f"cachepipe-map-job{n}", daemon=True))
                    workers[-1].start()
                try:
                    for worker in workers:
                        worker.join()
                except BaseException:  # Ctrl-C: stop the commands and the downloads, then let it propagate
                    self._stop.set()
                    self._watcher.kill_all()
                    pipe.close()
                    for worker in workers:
                        worker.join()
                    raise
                self._result.bytes_in = pipe.stats().bytes_downloaded
        finally:
            self._stop.set()
            self._watcher.stop()
            self._uploader.close()
            counters = self._uploader.counters
            self._result.bytes_out, self._result.files_out = counters.bytes, counters.files
            if self._bar is not None:
                self._bar.close()
            for n in range(len(workers)):
                slot_root = work / str(n)
                if slot_root.exists():
                    shutil.rmtree(slot_root)

    # -- one job ----------------------------------------------------------------------------------------
    def _worker(self, slot: _Slot) -> None:
        try:
            while not self._stop.is_set():
                try:
                    cached = self._pipe.get()
                except ItemFailedError as exc:
                    mi = self._by_local.get(exc.item)
                    self._fail(mi.name if mi else exc.item, f"download failed: {exc}", "", 1)
                    continue
                except RuntimeError:
                    return  # the pipeline was closed (interrupted)
                if cached is None:
                    return
                with self._lock:
                    self._bytes_taken += cached.size
                try:
                    self._process(slot, cached)
                finally:
                    try:
                        self._pipe.ack(cached)
                    except (RuntimeError, UnknownItemError):
                        pass  # closed while this item ran: closing removes it anyway
        except BaseException as exc:  # a bug: stop the run and raise it from map_items
            log.exception("map job crashed")
            with self._lock:
                self._crash = self._crash or exc
            self._stop.set()
            self._watcher.kill_all()
            self._pipe.close()

    def _process(self, slot: _Slot, cached: CachedItem) -> None:
        cfg = self.cfg
        mi = self._by_local[cached.name]
        limit = self._reserve(mi)
        produced: Path | None = None
        manifest: dict[str, int] | None = None
        error: BaseException | None = None
        tail = ""
        attempt = 0
        for attempt in range(1, cfg.retries + 2):
            if self._stop.is_set():
                return
            if attempt > 1:
                with self._lock:
                    self._result.items_retried += 1
                log.warning("retrying %s (attempt %d of %d) after: %s", mi.name, attempt, cfg.retries + 1, error)
            try:
                if produced is None:
                    slot.reset()
                    produced = self._produce(slot, cached, mi, limit)
                if manifest is None:
                    log.info("uploading %s", mi.name)
                    manifest = self._uploader.upload_item(mi.name, produced, marker_dir=slot.root)
                    if self._stop.is_set():
                        return
            except (OutputTooLargeError, ArchiveError, ChecksumError, UnsafeKeyError) as exc:
                error, tail = exc, ""
                break  # the same input would fail the same way
            except CommandError as exc:
                error, tail, produced = exc, exc.tail, None
            except Exception as exc:  # noqa: BLE001 - an upload or local I/O error: the item is retried, then reported
                if self._stop.is_set():
                    return
                error, tail = exc, ""
                if produced is not None and not produced.exists():
                    produced = None
            else:
                slot.reset()
                self._succeed(mi, manifest)
                return
        if self._stop.is_set():
            return
        slot.reset()
        self._fail(mi.name, f"{type(error).__name__}: {error}", tail, attempt)

    def _produce(self, slot: _Slot, cached: CachedItem, mi: MapItem, limit: int) -> Path:
        """Unpack and/or run CMD on the item; return the folder whose files are the results."""
        cfg = self.cfg
        item_path = cached.path
        source = item_path
        if cfg.unpack:
            unpack_item(item_path, slot.inp, limit_bytes=limit, max_members=cfg.max_members)
            source = slot.inp
            if cfg.command is None and self._fn is None:
                return slot.inp
        cwd = source if source.is_dir() else slot.cwd
        env = {"CACHEPIPE_ITEM": str(source), "CACHEPIPE_OUT": str(slot.out), "CACHEPIPE_NAME": mi.name}
        if self._fn is not None:
            run: Any = _FunctionRun(self._fn, source, slot.out, cwd, env)
        else:
            assert cfg.command is not None
            argv = [a.replace("{out}", str(slot.out)).replace("{name}", mi.name).replace("{}", str(source)) for a in cfg.command]
            try:
                run = _CommandRun(argv, cwd, {**os.environ, **env})
            except OSError as exc:
                raise CommandError(f"cannot start {argv[0]!r}: {exc}", "") from exc
        watch = _Watch(run, slot.root, item_path if source == item_path and item_path.is_dir() else None, cached.size, limit)
        self._watcher.add(watch)
        try:
            code, tail, timed_out = run.wait(cfg.timeout, cfg.kill_grace)
        finally:
            self._watcher.remove(watch)
        used = watch.measure()
        with self._lock:
            self._result.peak_job_bytes = max(self._result.peak_job_bytes, watch.peak)
        if watch.over or used > limit:
            raise OutputTooLargeError(
                f"item {mi.name!r}: outputs reached {max(used, watch.peak)} bytes, over its reserve of {limit} bytes "
                "(the command was stopped); raise out_reserve/out_ratio"
            )
        if self._stop.is_set():
            raise InterruptedError("stopped")
        what = "fn" if self._fn is not None else f"command {cfg.command[0]!r}"  # type: ignore[index]
        if timed_out:
            raise CommandError(f"{what} timed out after {cfg.timeout} s", tail)
        if code != 0:
            status = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            raise CommandError(f"{what} {status}", tail)
        return slot.out

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _succeed(self, mi: MapItem, manifest: dict[str, int] | None) -> None:
        with self._lock:
            self._result.items_done += 1
        log.info("done %s: %d files, %d bytes", mi.name, len(manifest or {}), sum((manifest or {}).values()))
        self._tick()

    def _fail(self, name: str, error: str, tail: str, attempts: int) -> None:
        with self._lock:
            self._result.items_failed += 1
            self._result.failed.append(MapFailure(name, error, tail, attempts))
        log.error("item %s failed after %d attempt(s): %s", name, attempts, error)
        self._tick()

    def _tick(self) -> None:
        if self._bar is None:
            return
        with self._lock:
            r = self._result
            self._bar.update(1)
            self._bar.set_postfix(ordered_dict={"done": r.items_done, "failed": r.items_failed, "in": f"{self._bytes_taken / 1e6:.1f}MB",
                                                "out": f"{self._uploader.counters.bytes / 1e6:.1f}MB"}, refresh=False)

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
                time.sleep(delay)  # in the calling thread, before any job starts; Ctrl-C interrupts it
        raise AssertionError("unreachable")

    def _done(self, dst: WritableStore, planned: list[MapItem]) -> set[str]:
        """Names of the items whose marker is in DST (checked concurrently, one HEAD each)."""
        if not planned:
            return set()
        with ThreadPoolExecutor(min(16, len(planned)), thread_name_prefix="cachepipe-map-check") as pool:
            flags = list(pool.map(lambda mi: self._retrying(f"checking {mi.name}", lambda: dst.exists(marker_key(mi.name))), planned))
        return {mi.name for mi, flag in zip(planned, flags, strict=True) if flag}


def _inside_prefix(source: str, dest: str) -> str | None:
    """``dest`` relative to ``source`` when it lies under it (``s3://b/d/`` and ``s3://b/d/out/`` -> ``out/``)."""
    src, dst = source.rstrip("/") + "/", dest.rstrip("/") + "/"
    if dst == src:
        raise ConfigError(f"dest {dest!r} is the source itself; give a folder beside it or under it")
    return dst[len(src):] if dst.startswith(src) else None


def _resolve_capacity(capacity: int | Share, cache_dir: Path) -> int:
    if not isinstance(capacity, Share):
        return capacity
    probe = cache_dir.absolute()
    while not probe.exists():
        probe = probe.parent
    return int(shutil.disk_usage(probe).free * capacity.fraction)


def _take_lock(work: Path, cache_dir: Path) -> int:
    """flock ``work/lock`` (an empty file, so it adds no bytes) for the whole run."""
    fd = os.open(work / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise CacheLockedError(str(cache_dir), "another cachepipe map run") from None
    return fd


# ---- public entry points ---------------------------------------------------------------------------------
def map_items(
    fn: Callable[[str, str], Any] | Sequence[str] | None,
    source: str,
    dest: str,
    *,
    cache_dir: str | os.PathLike[str],
    capacity: int | str,
    store: Store | None = None,
    dest_store: Store | None = None,
    **options: Any,
) -> MapResult:
    """Run ``fn`` on every item of ``source`` through a size-capped cache; upload its results to ``dest``.

    Exported as ``cachepipe.map``. See the module docstring for the cap, resumption and retries.

    Args:
        fn: ``fn(item_path, out_path)``, run in a fresh process per item (``spawn``: it must be
            picklable, i.e. defined at module level, and a script calling ``map_items`` needs
            the ``if __name__ == "__main__":`` guard); or a command as a list of arguments, in
            which ``{}`` is the item's path, ``{out}`` the output folder and ``{name}`` the
            item's name; or None with ``unpack=True`` (the extracted files are the results).
            The working directory is the item's folder (for a single-file item: an empty
            scratch folder, counted in the reserve, not uploaded); the environment has
            ``CACHEPIPE_ITEM``, ``CACHEPIPE_OUT`` and ``CACHEPIPE_NAME``.
        source: dataset URL (as for :class:`~cachepipe.Pipeline`).
        dest: results URL; item ``x`` goes to ``dest/x/`` (``s3://``, ``obs://``, ``file://``...).
        cache_dir: local directory for inputs and outputs.
        capacity: hard cap on bytes under ``cache_dir`` (``"20GiB"``, ``"80%"``...).
        store, dest_store: stores to use instead of opening ``source``/``dest`` (tests).
        **options: the other fields of :class:`MapConfig`: ``jobs`` (1), ``out_reserve``
            (a size per item) or ``out_ratio`` (times the item's size; default 1.0),
            ``out_margin``, ``items`` (``"folders"``/``"files"``), ``unpack``, ``timeout``
            (seconds per attempt), ``retries`` (2, per item), ``request_retries`` (12, per
            request, as downloads), ``storage_options``, ``dest_options`` (default: the same),
            ``upload_concurrency`` (8), ``upload_part_size`` (16 MiB), ``max_concurrency``,
            ``part_size``, ``watch_interval`` (0.05 s), ``kill_grace`` (5 s), ``max_members``,
            ``dry_run``, ``progress``.

    Returns:
        a :class:`MapResult`; failed items are in ``result.failed`` (the run does not stop for them).

    Raises:
        ValueError: a bad option, or nothing to do (no ``fn``, no command, no ``unpack``).
        TypeError: ``fn`` cannot be pickled for the child process.
        CacheLockedError: another map run or pipeline uses ``cache_dir``.
    """
    command: tuple[str, ...] | None = None
    func: Callable[[str, str], Any] | None = None
    if isinstance(fn, str):
        raise TypeError(f"fn {fn!r}: give a command as a list of arguments, e.g. ['sh', '-c', '...']")
    if isinstance(fn, Sequence):
        command = tuple(str(a) for a in fn)
        if not command:
            raise ValueError("the command is empty")
    elif fn is not None:
        if not callable(fn):
            raise TypeError(f"fn {fn!r}: expected a callable fn(item_path, out_path), a command list, or None")
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"fn {fn!r} cannot be sent to a child process ({exc}); define it at module level") from exc
        func = fn
    cfg = MapConfig(source=source, dest=dest, cache_dir=Path(cache_dir), capacity=capacity, command=command, **options)
    if command is None and func is None and not cfg.unpack:
        raise ConfigError("nothing to do: give fn or a command (after -- on the command line), or unpack=True")
    return _MapRun(cfg, func, store, dest_store).run()


# ---- command line -----------------------------------------------------------------------------------------
_DESCRIPTION = """\
Run CMD once per item of SRC (a first-level folder, or an object with --items files) with the
item's local path as {} and an empty output folder as {out}; upload what CMD writes to
DST/<item>/, then the marker DST/<item>/.cachepipe-done; delete input and output. Bytes under
--cache never exceed --capacity: each of --jobs jobs keeps a reserve for its outputs
(--out-reserve or --out-ratio), downloads get the rest. Items already done in DST are skipped."""

_EPILOG = """\
examples:
  cachepipe map s3://b/shards/ s3://b/clips/ --items files --unpack --cache /mnt/ssd/c \\
      --capacity 20GiB --jobs 4 --out-ratio 2 -- python split.py {} {out}
  cachepipe map s3://b/ss/ s3://b/ss-video/ --items files --unpack --cache /tmp/c --capacity 50GiB --out-ratio 1.1

exit status: 0 every item done (or already done); 1 an item failed or an error; 2 usage; 130 interrupted
"""


def _add_options(parser: argparse.ArgumentParser | Any, suppress: bool) -> None:
    d = (lambda v: argparse.SUPPRESS) if suppress else (lambda v: v)
    parser.add_argument("--cache", dest="cache", default=d(None), metavar="DIR", help="cache directory (required)")
    parser.add_argument("--capacity", default=d(None), help="hard cap on bytes under --cache: '20GiB', '80%%' (required)")
    parser.add_argument("--jobs", "-j", type=int, default=d(1), help="commands running at once (default 1)")
    parser.add_argument("--out-reserve", default=d(None), metavar="SIZE", help="space for one item's outputs, e.g. '2GiB'")
    parser.add_argument("--out-ratio", type=float, default=d(None), metavar="R", help="space for one item's outputs, as R x its input size (default 1.0)")
    parser.add_argument("--out-margin", default=d(None), metavar="SIZE", help="extra space per job for writes between two size checks (default min(reserve, 64MiB))")
    parser.add_argument("--items", choices=("folders", "files"), default=d("folders"), help="an item is a first-level folder (default) or an object")
    parser.add_argument("--unpack", action="store_true", default=d(False), help="extract archives (tar, tar.gz, tar.zst, zip, split volumes) before CMD; without CMD the extracted files are uploaded")
    parser.add_argument("--timeout", type=float, default=d(None), metavar="S", help="seconds per attempt of CMD")
    parser.add_argument("--retries", type=int, default=d(2), help="more attempts of a failed item (default 2)")
    parser.add_argument("--dry-run", action="store_true", default=d(False), help="list what would run and exit")
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=d(True), help="no progress bar")
    parser.add_argument("--storage-option", "-o", action="append", default=d([]), metavar="KEY=VALUE", help="storage option for SRC and DST (repeat; VALUE parsed as JSON when it can be)")
    parser.add_argument("--dest-option", action="append", default=d([]), metavar="KEY=VALUE", help="storage option for DST only (repeat)")
    parser.add_argument("--upload-concurrency", type=int, default=d(8), help="files uploaded at once (default 8)")
    parser.add_argument("--upload-part-size", default=d("16MiB"), metavar="SIZE", help="multipart part size (default 16MiB)")
    parser.add_argument("--max-concurrency", type=int, default=d(16), help="download requests in flight (default 16)")
    parser.add_argument("--verbose", "-v", action="count", default=d(0), help="log each item (-vv: each file uploaded)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="dataset URL (s3://, obs://, file://, ...)")
    parser.add_argument("dest", metavar="DST", help="results URL: item X goes to DST/X/")
    _add_options(parser, suppress=False)
    parser.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="command run per item ({} item path, {out} output folder, {name} item name)")


def add_map_parser(subparsers: Any) -> None:
    """Add the ``map`` subcommand to a ``cachepipe`` argparse ``subparsers`` object."""
    parser = subparsers.add_parser("map", help="run a command on every item and upload its results",
                                   description=_DESCRIPTION, epilog=_EPILOG,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"storage option {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def run_map_command(args: argparse.Namespace) -> int:
    """Run ``cachepipe map`` from parsed arguments; print the summary; return the exit status."""
    rest = list(args.cmd or [])
    if "--" in rest:  # argparse hands everything after SRC DST here: options, then '--', then CMD
        cut = rest.index("--")
        options, command = rest[:cut], rest[cut + 1:]
    elif rest and rest[0].startswith("-"):
        options, command = rest, []
    else:
        options, command = [], rest
    late = argparse.ArgumentParser(prog="cachepipe map", add_help=False)
    _add_options(late, suppress=True)
    try:
        parsed, unknown = late.parse_known_args(options)
        if unknown:
            raise ConfigError(f"unrecognized arguments {unknown}: put the command after '--'")
        for key, value in vars(parsed).items():
            setattr(args, key, value)
        if not args.cache or not args.capacity:
            raise ConfigError("--cache and --capacity are required")
        if args.verbose:
            logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
            logging.getLogger("cachepipe").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
        storage = dict(_option(o) for o in args.storage_option)
        dest_options = {**storage, **dict(_option(o) for o in args.dest_option)}
        options_map: dict[str, Any] = {
            "jobs": args.jobs, "items": args.items, "unpack": args.unpack, "timeout": args.timeout, "retries": args.retries,
            "dry_run": args.dry_run, "progress": args.progress and not args.dry_run, "storage_options": storage,
            "dest_options": dest_options, "upload_concurrency": args.upload_concurrency,
            "upload_part_size": args.upload_part_size, "max_concurrency": args.max_concurrency,
        }
        for key in ("out_reserve", "out_ratio", "out_margin"):
            if getattr(args, key) is not None:
                options_map[key] = getattr(args, key)
        result = map_items(command or None, args.source, args.dest, cache_dir=args.cache, capacity=args.capacity, **options_map)
    except KeyboardInterrupt:
        print("cachepipe map: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except (ValueError, TypeError, OSError, CachePipeError) as exc:
        print(f"cachepipe map: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(format_plan(result, args.dest))
        return 0
    print(format_summary(result), file=sys.stderr)
    return 0 if result.ok else 1


def format_plan(result: MapResult, dest: str) -> str:
    """The ``--dry-run`` listing."""
    lines = [f"would run: {name} -> {dest.rstrip('/')}/{name}/" for name in result.planned]
    lines.append(f"{len(result.planned)} items to run, {result.items_skipped} already done, of {result.items_listed} listed")
    if result.planned:
        lines.append(f"capacity {result.capacity} bytes: {result.download_capacity} for downloads, "
                     f"{result.reserve} + {result.margin} margin per job for outputs")
    return "\n".join(lines)


def format_summary(result: MapResult) -> str:
    """The closing summary: counts, megabytes, failed items with their stderr tails."""
    lines = [(
        f"cachepipe map: {result.items_done} done, {result.items_failed} failed, {result.items_skipped} already done; "
        f"{result.bytes_in / 1e6:.1f} MB in, {result.bytes_out / 1e6:.1f} MB out ({result.files_out} files) "
        f"in {result.seconds:.1f} s; peak job {result.peak_job_bytes} of {result.reserve} bytes reserved"
    )]
    if result.failed:
        lines.append("failed items (run the same command again to retry them):")
        for failure in result.failed:
            lines.append(f"  {failure.name}: {failure.error} (after {failure.attempts} attempt(s))")
            for line in failure.stderr_tail.strip().splitlines()[-10:]:
                lines.append(f"    | {line}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cachepipe.mapper SRC DST ...``: the ``map`` subcommand on its own."""
    parser = argparse.ArgumentParser(prog="cachepipe map", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(parser)
    return run_map_command(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
