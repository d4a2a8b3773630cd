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
from .catalog import Item, check_key, group_items
from .config import Capacity, Share, parse_size
from .errors import CacheLockedError, CachePipeError, ConfigError, ItemFailedError, UnknownItemError, UnsafeKeyError, is_transient
from .fetcher import backoff_delay
from .pipeline import CachedItem, Pipeline
from .stores import Store, open_store
from .stores.base import ObjectInfo, WritableStore
from .unpack import DEFAULT_MAX_MEMBERS, ArchiveError, ChecksumError, is_checksum_file, split_volume, unpack_item
from .uploader import DONE_MARKER, Uploader, marker_key

__all__ = ["map_items", "MapConfig", "MapResult", "MapFailure", "MapItem", "OutputTooLargeError", "plan_items",
           "add_map_parser", "run_map_command", "WORK_DIR"]

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
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     start_new_session=True, preexec_fn=_die_with_parent if _libc is not None else None)
        self.pid = self.proc.pid

    def wait(self, timeout: float | None, grace: float) -> tuple[int, str, bool]:
        """Block until CMD exits (reading its stderr tail); on ``timeout`` TERM, then KILL its group."""
        assert self.proc.stderr is not None
        fd = self.proc.stderr.fileno()
        tail = bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        stage = 0  # 0 running, 1 sent TERM, 2 sent KILL
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if stage == 2:
                        break  # a descendant that left the group holds stderr open: stop reading
                    stage += 1
                    _signal_group(self.pid, signal.SIGTERM if stage == 1 else signal.SIGKILL)
                    deadline = time.monotonic() + (grace if stage == 1 else 1.0)
                    continue
                if not sel.select(remaining):
                    continue
                data = os.read(fd, 65536)
                if not data:
                    break
                tail += data
                del tail[:-TAIL_BYTES]
        code = self.proc.wait()
        self.proc.stderr.close()
        return code, tail.decode("utf-8", "replace"), stage > 0

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
    except BaseException:
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
        tail = self._conn.recv() if self._conn.poll() else ""
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
