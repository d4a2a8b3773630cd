"""One ``cachepipe map`` run: :func:`map_items` (exported as ``cachepipe.map``) and what it drives.

The run lists ``SRC`` (or reads its manifest) and ``DST``, skips the items whose marker is in ``DST`` (for the same input and
the same command), hands what ``DST`` holds under each other item to the uploader (which deletes
what an attempt does not write again: :mod:`~cachepipe.map.uploader`), splits the capacity
between downloads and the jobs' output slots, takes the work folder's lock, and feeds the items
of a :class:`~cachepipe.Pipeline` to ``jobs`` threads, each a :class:`~cachepipe.map.job.Job`. Ctrl-C
(or a crashed job) stops the commands and the downloads, and propagates.

Its parts: the checks of ``fn`` or the command before anything is downloaded
(:mod:`~cachepipe.map.runnable`), how the capacity is split between downloads and the jobs' slots
(:mod:`~cachepipe.map.sizing`, pure), and the run's own requests to ``SRC`` and ``DST``, retried,
with the markers of the items already done (:mod:`~cachepipe.map.remote`: ``_MapRun``'s base
class).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..blocks import round_up
from ..cache import journal_budget_of
from ..cache.lock import lock_file, unusable_dir
from ..cache.room import block_at, room_at
from ..config import Share, check_cache_dir, check_destination, check_source, with_unit
from ..errors import CacheLockedError, ConfigError, ItemFailedError, UnknownItemError
from ..listing import empty_source
from ..locations import inside_prefix
from ..pipeline import Pipeline
from ..stores import Store, open_store
from ..stores.base import WritableStore
from .child import Watcher, kill_leftovers
from .job import Job, Slot, remove_slot
from .plan import (
    WORK_DIR,
    MapConfig,
    MapItem,
    PlannedSource,
    command_digest,
    function_name,
    item_charge,
    item_reserve,
    plan_items,
)
from .remote import _Remote
from .result import MapResult, Tally
from .runnable import _check_command, _from_fileless_main, _importing, _unguarded_line
from .share import resolve_rank, take_share
from .sizing import _refusals, _Sizing
from .uploader import DestinationError, Uploader

__all__ = ["map_items"]

log = logging.getLogger("cachepipe.map")

_STATE_BLOCKS = 4
"""What the downloads' cache finds of its state at its open, a block each (its ledger counts them
so: :meth:`cachepipe.cache.Cache.recover`): the state folder ``.cachepipe``, its lock (a line),
its journal (the header of a pass) and its staging folder."""

_WORK_BLOCKS = 1
"""The work folder :data:`~cachepipe.map.plan.WORK_DIR`, there when the downloads' cache opens
(its lock is an empty file): a block, which that cache counts as not its own (foreign)."""

_MIB = 1024**2

_FOR = {False: "outputs", True: "extracted files and outputs"}  # what the jobs' slots hold, by cfg.unpack

UNGUARDED = (
    "a child process that runs fn starts by running the main script again (multiprocessing's spawn), "
    'and this call to map_items is not under the script\'s `if __name__ == "__main__":` guard, so each child '
    "would run map_items again instead of fn: put the call (or the call of the function that makes it) under the guard"
)


class _MapRun(_Remote):
    def __init__(
        self, cfg: MapConfig, fn: Callable[[str, str], Any] | None, store: Store | None, dest_store: Store | None
    ) -> None:
        self.cfg = cfg
        self._fn = fn
        self._store = store
        self._dest = dest_store
        self._stop = threading.Event()
        self._crash_lock = threading.Lock()
        self._result = MapResult()
        self._tally = Tally(self._result)
        self._by_local: dict[str, MapItem] = {}
        self._crash: BaseException | None = None
        self._held: dict[str, list[str]] = {}  # what DST holds under each item to run (remote.Checked.held)
        self._command = command_digest(cfg.command, None if fn is None else function_name(fn), cfg.unpack)

    # -- orchestration ---------------------------------------------------------------------------------
    def run(self) -> MapResult:
        cfg, result = self.cfg, self._result
        started = time.monotonic()
        src = self._store or open_store(cfg.source, cfg.storage_options)
        try:
            dst = self._dest or open_store(cfg.dest, cfg.storage_options if cfg.dest_options is None else cfg.dest_options)
            try:
                if not isinstance(dst, WritableStore):
                    raise ConfigError(
                        f"destination {cfg.dest!r}: {type(dst).__name__} cannot be written to (it has no put/exists/delete)"
                    )
                if hasattr(dst, "upload_part_size"):
                    dst.upload_part_size = cfg.upload_part_size
                check_bucket = getattr(dst, "check_bucket", None)  # optional: a missing bucket fails here, not at each upload
                if check_bucket is not None:
                    self._retrying(f"checking {cfg.dest}", check_bucket)
                inside = inside_prefix(cfg.source, cfg.dest)
                listing = self._listing(src)
                if inside is not None:  # DST under SRC: its results are not items
                    listing = [o for o in listing if not o.key.startswith(inside)]
                planned = plan_items(listing, cfg.items, cfg.unpack)
                if not planned:  # a mistyped prefix lists nothing: said, not "0 done" and exit 0
                    raise empty_source(cfg.source, cfg.items, len(listing), store=src)
                result.items_listed = len(planned)
                names = {mi.name for mi in planned}  # every rank's: whose DST/<name>/ holds a key (held_by_item)
                if cfg.world_size > 1:  # this process's share, from the listing alone (never from what is done)
                    planned = take_share(planned, cfg.rank, cfg.world_size)
                self._record_share(planned)
                # an item whose keys cannot be stored is refused, whatever DST holds: never downloaded
                unsafe = {mi.name: mi.unsafe for mi in planned if mi.unsafe is not None}
                safe = [mi for mi in planned if mi.unsafe is None]
                if not cfg.dry_run and cfg.rank == 0:  # one walk of a local DST for the job, not one per rank
                    self._remove_stale(dst)
                checked = self._done(dst, safe, self._command, names)
                self._held = checked.held
                todo = [mi for mi in safe if mi.name not in checked.done]
                result.items_skipped = len(checked.done)
                result.command_changed = checked.command_changed
                result.held = checked.held
                result.planned = [mi.name for mi in todo]
                if not cfg.dry_run:
                    for name, why in unsafe.items():
                        self._tally.fail(name, why, "", 0)
                    if todo:
                        self._execute(src, dst, todo)
                else:  # what the run would refuse, for the same reason
                    refused = dict(unsafe)
                    if todo:
                        sizing = self._size(todo, _resolve_capacity(cfg.capacity, cfg.cache_dir))
                        refused |= dict(_refusals(todo, sizing))
                    result.planned = [mi.name for mi in todo if mi.name not in refused]
                    result.refused = refused
                    result.held = {name: keys for name, keys in checked.held.items() if name not in refused}
            finally:
                if self._dest is None:
                    dst.close()
        finally:
            if self._store is None:
                src.close()
        result.seconds = time.monotonic() - started
        return result

    def _record_share(self, share: list[MapItem]) -> None:
        cfg, r = self.cfg, self._result
        r.rank, r.world_size, r.rank_source = cfg.rank, cfg.world_size, cfg.rank_source
        r.share_items, r.share_bytes = len(share), sum(mi.size for mi in share)
        log.info(
            "rank %d of %d (%s): %d of %d items, %d bytes",
            cfg.rank,
            cfg.world_size,
            cfg.rank_source,
            r.share_items,
            r.items_listed,
            r.share_bytes,
        )

    def _size(self, todo: Sequence[MapItem], capacity: int) -> _Sizing:
        cfg = self.cfg
        runs = cfg.command is not None or self._fn is not None
        block = block_at(cfg.cache_dir)  # as the downloads' cache reads it at its open
        reserve = max(item_reserve(cfg, mi, runs, block).total for mi in todo)
        margin = cfg.out_margin if cfg.out_margin is not None else min(reserve, 64 * _MIB)
        # the pipeline's journal budget (Cache.journal_budget, from Catalog.name_bytes: a name's
        # undecodable byte as its surrogate's 3 UTF-8 bytes) in whole blocks, the state's folders
        # and files an open finds, and the work folder, as the cache's ledger counts them
        names = sum(len(mi.local.encode("utf-8", "surrogatepass")) for mi in todo)
        state = round_up(journal_budget_of(names, len(todo)), block) + (_STATE_BLOCKS + _WORK_BLOCKS) * block
        charges = {mi.name: item_charge(cfg, mi, block) for mi in todo}
        sizing = _Sizing(capacity, reserve, margin, min(cfg.jobs, len(todo)), state, block, charges)
        r = self._result
        r.capacity, r.reserve, r.margin, r.download_capacity = capacity, reserve, margin, sizing.downloads
        if sizing.largest <= 0:
            least = sizing.least_for(max(charges.values()))
            raise ConfigError(
                f"capacity {capacity} bytes leaves no room for downloads after setting aside {sizing.jobs} jobs x "
                f"({reserve} bytes reserve + {margin} bytes margin) for {_FOR[cfg.unpack]} and {state} bytes for the "
                f"state of a run over {len(todo)} items (in the filesystem's blocks of {block} bytes); raise capacity "
                f"to at least {least} bytes (the largest item beside those), or lower jobs, "
                f"{'unpack_ratio, ' if cfg.unpack else ''}out_reserve/out_ratio or out_margin"
            )
        return sizing

    def _execute(self, src: Store, dst: WritableStore, todo: list[MapItem]) -> None:
        cfg = self.cfg
        cache_dir = cfg.cache_dir.absolute()
        sizing = self._size(todo, _resolve_capacity(cfg.capacity, cache_dir))  # refuse before touching the disk
        work = cache_dir / WORK_DIR
        try:
            work.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a read-only filesystem, /proc...: named as a pipeline's cache_dir is
            error = unusable_dir(cfg.cache_dir, exc)
            if error is None:
                raise
            raise error from exc
        lock_fd = _take_lock(work, cache_dir)
        try:
            leftovers = kill_leftovers(work)
            if leftovers:
                log.warning(
                    "killed %d processes (pids %s) left running in %s by an earlier run that was killed: what its "
                    "commands started",
                    len(leftovers),
                    ", ".join(map(str, leftovers[:10])),
                    work,
                )
            for entry in work.iterdir():  # slots left by a run that died
                if entry.name != "lock":
                    remove_slot(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            refused = dict(_refusals(todo, sizing))
            fits = [mi for mi in todo if mi.name not in refused]
            for name, why in refused.items():
                self._tally.fail(name, why, "", 0)
            if fits:
                self._by_local = {mi.local: mi for mi in fits}
                self._pump(src, dst, fits, sizing, work)
        except BaseException as exc:  # a stop (Ctrl-C, SIGTERM) is raised instead of the jobs' crash: say the crash
            if isinstance(self._crash, DestinationError) and self._crash is not exc:
                log.error("%s", self._crash)  # the others were logged where they came (_worker)
            raise
        finally:
            os.close(lock_fd)
        if self._crash is not None:
            raise self._crash

    def _pump(self, src: Store, dst: WritableStore, items: list[MapItem], sizing: _Sizing, work: Path) -> None:
        cfg = self.cfg
        grouped = cfg.items == "files" and cfg.unpack
        pipe = Pipeline(
            cfg.source,
            cfg.cache_dir,
            with_unit(sizing.downloads),
            store=PlannedSource(src, items),
            items="folders" if grouped else cfg.items,
            auto_ack=False,
            on_error="raise",
            retries=cfg.request_retries,
            retry_backoff=cfg.retry_backoff,
            retry_backoff_max=cfg.retry_backoff_max,
            max_concurrency=cfg.max_concurrency,
            max_large_requests=cfg.max_large_requests,
            part_size=cfg.part_size,
            verify=cfg.verify,
        )
        uploader = Uploader(
            dst,
            cfg.upload_concurrency,
            cfg.request_retries,
            cfg.retry_backoff,
            cfg.retry_backoff_max,
            self._stop,
            command=self._command,
            held=self._held,
        )
        self._watcher = Watcher(cfg.watch_interval)
        if cfg.progress:
            self._tally.open_bar(len(items), lambda: uploader.counters.bytes)
        workers: list[threading.Thread] = []
        try:
            with pipe:
                self._pipe = pipe
                for n in range(sizing.jobs):
                    job = Job(
                        cfg,
                        self._fn,
                        Slot(work / str(n), sizing.reserve + sizing.margin, sizing.block),
                        watcher=self._watcher,
                        uploader=uploader,
                        stop=self._stop,
                        tally=self._tally,
                    )
                    workers.append(threading.Thread(target=self._worker, args=(job,), name=f"cachepipe-map-job{n}", daemon=True))
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
            uploader.close()
            self._result.bytes_out, self._result.files_out = uploader.counters.bytes, uploader.counters.files
            self._tally.close_bar()
            for n in range(len(workers)):
                slot_root = work / str(n)
                if slot_root.exists():
                    remove_slot(slot_root)

    def _worker(self, job: Job) -> None:
        """A job's thread: take items from the pipeline until none is left; ack each after processing."""
        try:
            while not self._stop.is_set():
                try:
                    cached = self._pipe.get()
                except ItemFailedError as exc:
                    mi = self._by_local.get(exc.item)
                    self._tally.fail(mi.name if mi else exc.item, f"download failed: {exc}", "", 1)
                    continue
                except RuntimeError:
                    if self._stop.is_set():
                        return  # the pipeline was closed: the run is stopping
                    raise  # the pipeline failed: a crash of the run, as any other planning error
                if cached is None:
                    return
                self._tally.taken(cached.size)
                try:
                    job.process(cached, self._by_local[cached.name])
                finally:
                    try:
                        self._pipe.ack(cached)
                    except (RuntimeError, UnknownItemError):
                        pass  # closed while this item ran: closing removes it anyway
        except BaseException as exc:  # a bug, or a destination full or refusing: stop the run and raise it from map_items
            with self._crash_lock:
                first = self._crash is None
                self._crash = self._crash or exc
            if not isinstance(exc, DestinationError):
                log.exception("map job crashed")
            elif not first:  # not the one raised: said here, once (the one raised its caller reports; _execute)
                log.error("%s", exc)
            self._stop.set()
            self._watcher.kill_all()
            self._pipe.close()


def _resolve_capacity(capacity: int | Share, cache_dir: Path) -> int:
    """``capacity`` in bytes: a share of the free space on ``cache_dir``'s filesystem and of what
    ``cache_dir`` holds (a killed run's downloads and outputs are this run's room, as a
    pipeline's own items are its own: :class:`~cachepipe.cache.Cache`), or the bytes given."""
    if not isinstance(capacity, Share):
        return capacity
    return int(room_at(cache_dir, [cache_dir]) * capacity.fraction)


def _take_lock(work: Path, cache_dir: Path) -> int:
    """flock ``work/lock`` (an empty file, so it adds no bytes) for the whole run."""
    fd = os.open(work / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        lock_file(fd, str(work / "lock"))
    except BlockingIOError:
        os.close(fd)
        raise CacheLockedError(str(cache_dir), "another cachepipe map run") from None
    except OSError as exc:
        os.close(fd)
        error = unusable_dir(cache_dir, exc)  # a filesystem without locks (ENOLCK), named as cache_dir
        if error is None:
            raise
        raise error from exc
    return fd


def map_items(
    fn: Callable[[str, str], Any] | Sequence[str] | None,
    source: str,
    dest: str,
    *,
    cache_dir: str | os.PathLike[str],
    capacity: int | str | Share,
    store: Store | None = None,
    dest_store: Store | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    **options: Any,
) -> MapResult:
    """Run ``fn`` on every item of ``source`` through a size-capped cache; upload its results to ``dest``.

    Exported as ``cachepipe.map``. See :mod:`cachepipe.map` for the cap, resumption and retries.

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
        store: a store to use instead of opening ``source`` (tests). It stays open, yours to
            close: the run's pipeline reads through a view of it (see ``Pipeline``'s ``store``).
        dest_store: a store to use instead of opening ``dest`` (tests).
        rank: this process's rank among ``world_size`` processes that share the items of
            ``source`` (each lists it and takes a disjoint, byte-balanced share). Default: from
            the environment, ``RANK``/``WORLD_SIZE``, then ``JOB_COMPLETION_INDEX`` with
            ``world_size`` or ``CACHEPIPE_WORLD_SIZE``, then ``SLURM_ARRAY_TASK_ID`` (see
            :mod:`cachepipe.map.share`); else 0 of 1, every item.
        world_size: the number of processes (with ``rank``, or as the count of an index found
            in the environment).
        **options: the other fields of :class:`MapConfig`: ``jobs`` (1), ``out_reserve``
            (a size per item) or ``out_ratio`` (times the command's input: the item, or with
            ``unpack`` its extracted files; default 1.0), ``out_margin``, ``items``
            (``"folders"``/``"files"``), ``manifest`` (a listing of ``source`` written by
            :func:`cachepipe.index`, a path or an object URL read with ``storage_options``: the run
            plans from it and does not list ``source``; give every rank the same one), ``unpack``,
            ``unpack_ratio`` (room for the extracted files, in times the item's size; default
            1.25, see :data:`~cachepipe.config.UNPACK_RATIO`), ``timeout``
            (seconds per attempt), ``retries`` (2, per item), ``request_retries`` (12, per
            request, as downloads), ``storage_options``, ``dest_options`` (default: the same),
            ``upload_concurrency`` (8), ``upload_part_size`` (16 MiB), ``max_concurrency`` (64),
            ``max_large_requests`` (16), ``part_size`` (default: a pipeline's, by the cache's capacity, see
            :func:`~cachepipe.fetch_policy.auto_part_size`), ``verify`` (``"size"``; ``"etag"``: each
            input file's MD5 checked against its ETag where that is an MD5, a mismatch fetched
            again, as a pipeline's), ``watch_interval`` (0.05 s), ``kill_grace``
            (5 s), ``max_members``, ``dry_run``, ``progress``.

    Returns:
        a :class:`MapResult`; failed items are in ``result.failed`` (the run does not stop for them).

    Raises:
        ValueError: a bad option, or nothing to do (no ``fn``, no command, no ``unpack``).
        TypeError: ``fn`` cannot be pickled for the child process, or it is defined in a
            ``__main__`` that the child cannot import (``python -c``, a REPL, a notebook).
        RuntimeError: the call runs at a script's top level outside its ``__main__`` guard, or
            at the top level of ``fn``'s module while it is imported.
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
        _check_command(command[0])
    elif fn is not None:
        if not callable(fn):
            raise TypeError(f"fn {fn!r}: expected a callable fn(item_path, out_path), a command list, or None")
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"fn {fn!r} cannot be sent to a child process ({exc}); define it at module level") from exc
        line = _unguarded_line()
        if line is not None or getattr(multiprocessing.current_process(), "_inheriting", False):
            where = f"{sys.modules['__main__'].__file__}, line {line}: " if line is not None else ""
            raise RuntimeError(where + UNGUARDED)  # else each child runs map_items, and every item fails
        importing = _importing(fn)
        if importing is not None:  # else the run hangs: its job threads wait for the import that waits for them
            raise RuntimeError(
                f"fn {fn!r}: its module {importing!r} is still being imported (map_items is called from its top "
                "level), so a child process that imports it to find fn would run map_items again: call map_items "
                "once the import has ended, e.g. from the script that imports the module, under its `if __name__ == "
                '"__main__":` guard'
            )
        if _from_fileless_main(fn):
            raise TypeError(
                f"fn {fn!r} is defined in __main__ of an interactive session (python -c, a REPL, a notebook) or of a "
                "package run with python -m, which the child process that runs it cannot import (it starts a fresh "
                "interpreter): define fn in a .py file and import it (in a notebook: %%writefile transform.py, then "
                "from transform import fn), or pass a command"
            )
        func = fn
    node = resolve_rank(os.environ, rank, world_size)  # the edge: the environment is read here, once
    cfg = MapConfig(
        source=source,
        dest=dest,
        cache_dir=check_cache_dir(cache_dir),
        capacity=capacity,
        command=command,
        rank=node.rank,
        world_size=node.world_size,
        rank_source=node.source,
        **options,
    )
    if store is None:
        check_source(source)
    if dest_store is None:
        check_destination(dest, "dest", folder=True)  # `s3:/b/out/` or `b/out/`: not a local folder made in silence
    if command is None and func is None and not cfg.unpack:
        raise ConfigError(
            "nothing to do: give a command (on the command line after --: cachepipe map SRC DST -- CMD {}), "
            "or --unpack (map(fn=...) and unpack=True in Python)"
        )
    return _MapRun(cfg, func, store, dest_store).run()
