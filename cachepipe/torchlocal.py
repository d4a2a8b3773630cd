"""The per-process mode of :class:`~cachepipe.torch.CachePipeDataset` (``cache_dir`` and
``capacity``): each DataLoader worker runs its own :class:`~cachepipe.Pipeline` over its share,
with ``capacity / num_workers`` and its own cache folder ``cache_dir/rank<r>-worker<k>``; the
manifest listed once under ``torch.distributed`` (or by the first :meth:`set_epoch`), held
before the workers fork; a pass over the worker's pipeline, to its end or to the epoch it stops
before; a capacity given as a share of the disk resolved over every worker's folder; and a
folder that another worker still holds, waited for while that one may be stopping (it makes its
sample in hand, or closes: :mod:`cachepipe.torchreader` notes which), refused otherwise.

Invariant: a worker's pipeline is its own (its folder, its share of the capacity); an item is
acknowledged once its sample is made (with a ``transform``) or once the loop asks for the next.
:class:`_LocalMode` is a base class of ``CachePipeDataset`` over
:class:`~cachepipe.torchstate._DatasetState`, beside :class:`~cachepipe.torchnode._NodeMode`,
not used alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch.utils.data

from .cache.lock import UNKNOWN_OWNER
from .cache.room import block_at, room_at
from .config import Share, with_unit
from .errors import CacheLockedError, OversizeError
from .manifest import Manifest, _is_url, read_manifest
from .pipeline import CachedItem, Pipeline, Skipped
from .torchdist import _distributed, _from_rank0, _manifest_bytes, _save_manifest, manifests_taken
from .torchreader import Reader, ReaderNote, main_thread_ticks, owner_pid, proc_stat, reader
from .torchshare import SharedManifest
from .torchstate import _DatasetState, _repeats

__all__ = ["DATASET_WAIT", "IDLE_WAIT", "SIBLING_WAIT"]

log = logging.getLogger("cachepipe")

#: per-process mode: most seconds a worker waits for a folder another worker of its process holds that closes or left no
#: note (longer where its DataLoader has more than 11 workers: as long as torch may take to stop them, see ``_sibling_wait``)
SIBLING_WAIT = 60.0
#: per-process mode: seconds a worker waits for a folder that another worker of its process holds while
#: that one makes a sample, beyond what torch gives it to stop (a DataLoader iterator dropped after the next was made
#: stops its workers once their sample in hand is made: it joins them one after the other, each for
#: ``torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL``, 5 s, then terminates those still alive; so one may hold
#: its folder 5 s times its DataLoader's ``num_workers``, which its note gives)
DATASET_WAIT = 1.0
#: per-process mode: seconds a worker waits for a folder that another worker of its process holds while
#: that one waits to be asked for a sample (one whose iterator was dropped lets go at once), before it is refused:
#: seconds in which it hands no sample and its main thread runs nothing (one collating or sending a batch runs)
IDLE_WAIT = 1.0


class _LocalMode(_DatasetState):
    """The dataset in per-process mode (see the module notes)."""

    # set by CachePipeDataset.__init__, which says what each holds
    _room: int | None
    _aside: int
    _manifest: Manifest | None
    _shared: SharedManifest | None
    _identity: str

    def _list_once(self) -> str | None:
        """Under an initialised ``torch.distributed`` of several ranks: rank 0 lists the source
        and broadcasts its manifest; every rank writes it under ``cache_dir`` and plans from it
        (its digest is checked when it is read), so all ranks plan over one catalog with one
        listing. Returns the manifest's path, or None (not distributed: each process lists)."""
        if self.cache_dir is None or _distributed() is None:
            return None
        rank, data = _from_rank0(lambda: _manifest_bytes(self.source, self._items(), self.options), self.source)
        return _save_manifest(self.cache_dir, rank, data, self.source, self._items())

    def _hold_manifest(self) -> None:
        """Per-process mode, a local manifest to plan from: read it here, once, and hold it.
        Each DataLoader worker's pipeline then plans from that read
        (:func:`~cachepipe.manifest.read_manifest` returns a held manifest without reading it,
        while the file is unchanged), where every worker of every pass read the whole file:
        seconds per worker for a million items. A worker forked from this process inherits it;
        one started by spawn or forkserver gets a copy of it in shared memory
        (:mod:`cachepipe.torchshare`). A manifest given as an object URL is read by each worker."""
        location = self.options.get("manifest")
        self._manifest = self._shared = None
        if location is not None and not _is_url(os.fspath(location)):
            self._manifest = read_manifest(location, self.options.get("storage_options"))

    def _pipeline(
        self, first: int | None, epochs: int | None = None, resume: bool | None = None, end: int | None = None
    ) -> Pipeline:
        """This process's pipeline: epoch ``first`` alone, or the plan's epochs (``epochs``:
        the end a loaded state was saved with instead); ``resume`` instead of the option's.
        ``end``: a pass that stops before epoch ``end`` (a set_epoch pass with retention) over
        a pipeline of the plan's epochs from ``first``, which keeps its items on close for the
        next pass unless ``end`` is the plan's end. A capacity given as a share of the disk is
        resolved here, in bytes (:func:`_room`)."""
        if self.cache_dir is None or self.capacity is None:
            raise ValueError("pipeline(): a node-mode dataset has no pipeline of its own (it reads from the daemon)")
        worker, num_workers = self._worker()
        rank, world = self._rank_world()
        capacity = self.capacity
        if isinstance(capacity, Share):
            # of the room the rank's cache folders have together, not each of its own: a worker's
            # own items are room to it, its siblings' used space, which shrank every share on reopen
            self._room = _room(self.cache_dir, world, num_workers)
            capacity = int(self._room * capacity.fraction)
        # each worker's folder and its reader note beside it (see torchreader.note_path), in
        # cache_dir: a block each that no cache's ledger counts, so the shares leave them room;
        # and, of a capacity in bytes, this rank's manifests there (torchdist._save_manifest's),
        # a part each (a share of the disk is of the space free once they were written)
        block = block_at(self.cache_dir)
        manifests = 0 if isinstance(self.capacity, Share) else manifests_taken(self.cache_dir, rank, block)
        self._aside = 2 * block + -(-manifests // num_workers)
        share = with_unit(max(capacity // num_workers - self._aside, 0))
        options = {**self.options, "rank": rank, "world_size": world, "worker": worker, "num_workers": num_workers}
        if epochs is not None:
            options["epochs"] = epochs
        elif first is not None:
            options["start_epoch"] = first
            if end is None:
                options["epochs"] = first + 1
        if end is not None and (options.get("epochs", 1) is None or end < options.get("epochs", 1)):
            options["keep_on_close"] = True  # the next pass adopts what this one retained or fetched ahead
        if resume is not None:
            options["resume"] = resume
        return Pipeline(self.source, self.cache_dir / f"rank{rank}-worker{worker}", share, **options)

    @contextlib.contextmanager
    def _in_share(self) -> Iterator[None]:
        """An :class:`OversizeError` raised inside, in a DataLoader worker, whose pipeline has
        ``capacity / num_workers``, says that this is the capacity it names (a share of the disk
        with the bytes it was of: see :func:`_room`)."""
        try:
            yield
        except OversizeError as exc:
            # the worker's folder and its note (and its part of the rank's manifests), set aside
            # from its share: taken as its state is
            share, occupied = exc.capacity + self._aside, exc.occupied + self._aside
            info = torch.utils.data.get_worker_info()
            if info is None or info.num_workers == 1:
                raise OversizeError(exc.item, exc.size, share, occupied, taken=exc.taken, block=exc.block) from None
            capacity = str(self.capacity)
            if self._room is not None:  # a share of the disk: of what, in bytes
                capacity += f" of {self._room} bytes free or cached in cache_dir"
            of = f"this DataLoader worker's share of the cache (capacity {capacity} / num_workers {info.num_workers})"
            raise OversizeError(exc.item, exc.size, share, occupied, of, exc.taken, exc.block) from None

    def _iter_local(self, start: dict[str, Any] | None, token: object) -> Iterator[Any]:
        if start and _finished(start):
            # loaded at the end of its share (a worker's, saved once it had ended): nothing to read,
            # and no cache to take: StatefulDataLoader, resuming a finished pass, starts workers that
            # run such a pass while the next pass's workers open the same folders
            self._ended(token)
            return

        end = start.get("end_epoch") if start else None  # a set_epoch pass's end, saved in its state
        if start and set(start) == {"start_epoch"} and self.options.get("retain", "none") != "none":
            # over the plan's epochs, stopped here: what it retains (or fetches ahead) stays for the next pass
            end = int(start["start_epoch"]) + 1

        def make() -> Pipeline:
            if start and set(start) == {"start_epoch"}:  # a set_epoch pass from its start
                return self._pipeline(int(start["start_epoch"]), end=end)
            if start:  # {}: the start
                pipe = self._pipeline(None, start.get("epochs"), end=end)  # the pass it was saved in: its epochs
                pipe.load_state_dict(start)
                return pipe
            return self._pipeline(None)

        try:
            with self._in_share():
                pipe = _open(make, self._identity)
                if not start and self.options.get("resume") and _finished(pipe.state_dict()):
                    # resume=True continues a pass this folder's journal holds; one that ended (this
                    # process's last pass, or a run that finished) has nothing left: this pass is new
                    pipe.close()
                    pipe = _open(lambda: self._pipeline(None, resume=False), self._identity)
        except BaseException:
            self._not_started(start, token)
            raise
        if self._pass is token:
            self._pipe, self._end = pipe, end
        # in a DataLoader worker: which dataset reads the folder, and whether it makes a sample now
        info = torch.utils.data.get_worker_info()
        note = None if info is None else ReaderNote(pipe.config.cache_dir, self._identity, info.num_workers)
        try:
            with self._in_share():  # an item over the worker's share, in its turn
                if self._equal and self.transform is not None:
                    samples = self._equal_local(pipe, start, end, token)
                else:
                    samples = self._samples(pipe, end)
                for sample in samples:
                    if note is not None:
                        note.idle()
                    yield sample
                    if note is not None:
                        note.busy()
        finally:
            if note is not None:
                note.closing()
            try:
                pipe.close()
            finally:
                if note is not None:
                    note.close()
        self._ended(token)

    def _samples(self, pipe: Pipeline, end: int | None) -> Iterator[Any]:
        """Per-process mode: ``pipe``'s samples up to epoch ``end`` (as :func:`_next`): its items
        (each acknowledged when the next is asked for), or what ``transform`` makes of them."""
        while (item := _next(pipe, end)) is not None:
            if self.transform is None:
                yield item
                pipe.ack(item)  # when the loop asks for the next
            else:
                sample = self.transform(item)
                pipe.ack(item)  # read: its space is free while the sample travels on, and the state is past it
                yield sample

    def _equal_local(self, pipe: Pipeline, start: dict[str, Any] | None, end: int | None, token: object) -> Iterator[Any]:
        """Per-process mode, ``equal_steps`` over several ranks: one sample per planned step (up
        to epoch ``end``, as :func:`_next`), a skipped item's step taken by a repeat
        (:class:`~cachepipe.repeats.Repeats`)."""
        transform = self.transform
        if transform is None:
            raise ValueError("equal steps with transform=None: refused when the dataset is made")
        repeats = _repeats(self._where(), start)
        at: dict[str, Any] = {}
        while (got := _next_step(pipe, end)) is not None:
            if isinstance(got, Skipped):
                times = repeats.skipped(got.name, got.reason)
            else:
                times = repeats.sample(got.name, transform(got))
                at = self._local_state(pipe)  # at this item: a resume reads it again, to repeat it
                pipe.ack(got)
            for _ in range(times):
                if repeats.deliver():
                    if self._pass is token:
                        self._owed = (at, repeats.due, repeats.since)
                    yield repeats.previous
        repeats.end()


_FOLDER = re.compile(r"rank(\d+)-worker(\d+)")


def _room(cache_dir: Path, world: int, num_workers: int) -> int:
    """What a capacity given as a share of the disk is of, per-process: the space free on
    ``cache_dir``'s filesystem and what the cache folders of every rank's workers hold under
    it (``rank<r>-worker<k>``, ``r < world``, ``k < num_workers``). Each worker is one
    :class:`~cachepipe.Pipeline`, whose own share would count its items as room and its
    siblings' as used: each worker, and each rank on the disk, then got less on every reopen
    over the items they kept. Folders of a run with more workers or ranks are no one's: used."""
    held: list[str] = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):  # none yet: made when the first worker's cache opens
        held = [
            entry.path
            for entry in os.scandir(cache_dir)
            if (match := _FOLDER.fullmatch(entry.name)) and int(match[1]) < world and int(match[2]) < num_workers
        ]
    return room_at(cache_dir, held, caches=True)


def _open(make: Callable[[], Pipeline], dataset: str) -> Pipeline:
    """``make()``, opened, for the dataset object whose identity is ``dataset`` (made with it, the
    same in its DataLoader workers). In a DataLoader worker, a cache folder held by another worker
    of the same parent process may be held by one that stops: ``StatefulDataLoader``, resuming a
    checkpoint taken after a pass, starts the saved pass's workers, then the next pass's while the
    first ones still stop (a worker whose state is before an item ``drop_last`` dropped still has
    it to read, in its folder); so does ``it = iter(loader)`` over an iterator broken off (its
    workers stop once it is dropped, after the new one started them), and a dataset made for each
    pass. As the holder's note says (:mod:`cachepipe.torchreader`), whichever dataset it reads
    for, it is waited for while it makes a sample, as long as torch lets it stop (5 s times its
    DataLoader's ``num_workers``) and :data:`DATASET_WAIT` seconds more, and while it waits for
    its DataLoader (no sample handed, its main thread running nothing: not collating or sending a
    batch), :data:`IDLE_WAIT` seconds; then refused. A holder that closes, or left no note, is
    waited for up to :data:`SIBLING_WAIT` seconds (or as long as torch may take to stop its
    DataLoader's workers, where longer: :func:`_sibling_wait`). A DataLoader stops its workers,
    and they let go, before a pass's loop ends and when its broken-off iterator is dropped: what
    still holds a folder then reads at the same time, two datasets over one ``cache_dir``
    (training and validation), or two DataLoaders (or iterators) of one dataset. A folder held
    by this process, or by its parent or child process, is refused at once."""
    start = time.monotonic()
    # another dataset's idle holder: ((samples it handed, its main thread's CPU ticks), since when)
    idle: tuple[tuple[int, int | None], float] | None = None
    while True:
        pipe = make()
        try:
            pipe.open()
        except CacheLockedError as exc:
            worker = torch.utils.data.get_worker_info() is not None
            if _own(exc.owner):
                raise _read_at_once(exc, "this process") from None
            if (relation := _family(exc.owner)) is not None:
                raise _read_at_once(exc, relation) from None
            if not worker or not _sibling(exc.owner):
                raise
            now, held = time.monotonic(), reader(Path(exc.cache_dir), exc.owner)
            if held is not None and held.state != "close":  # (closing: it lets go)
                # of this dataset or another alike: a worker of a pass that stops (an iterator dropped)
                # makes its sample in hand and lets go, one that waits for its DataLoader is of a
                # loader that reads at the same time (two DataLoaders or iterators of this dataset)
                # idle: nothing handed and nothing run since (a worker that collates or sends a batch runs)
                pid = owner_pid(exc.owner)
                seen = (held.handed, None if pid is None else main_thread_ticks(pid))
                if held.state != "idle":
                    idle = None
                elif idle is None or idle[0] != seen:
                    idle = (seen, now)
                if now - start >= _stopping(held.workers) + DATASET_WAIT or (idle is not None and now - idle[1] >= IDLE_WAIT):
                    whose = "this dataset" if held.dataset == dataset else "another dataset"
                    raise _read_at_once(exc, f"a DataLoader worker of {whose} of this process") from None
            elif now - start >= (limit := _sibling_wait(held)):
                raise _read_at_once(exc, f"a DataLoader worker of this process, for {limit:g} s") from None
            whose = "this dataset's" if held is None or held.dataset == dataset else "another dataset's"
            log.info("%s is held by %s, %s DataLoader worker: waiting for it to stop", exc.cache_dir, exc.owner, whose)
            time.sleep(0.1)  # another process's lock: polled (flock has no timed wait)
            continue
        return pipe


def _sibling_wait(held: Reader | None) -> float:
    """Most seconds a worker waits for its folder held by a worker that closes or left no note (``held``:
    what that one's note says; None: no note): :data:`SIBLING_WAIT`, or as long as torch lets a
    worker of the holder's DataLoader stop (:func:`_stopping`) and :data:`DATASET_WAIT` more,
    where that is longer (a DataLoader of more than 11 workers)."""
    if held is None:
        return SIBLING_WAIT
    return max(SIBLING_WAIT, _stopping(held.workers) + DATASET_WAIT)


def _stopping(workers: int) -> float:
    """Most seconds a DataLoader of ``workers`` workers, its iterator dropped, lets a worker of it
    live: it joins them one after the other, each for ``MP_STATUS_CHECK_INTERVAL`` (5 s), then
    terminates those still alive (``_MultiProcessingDataLoaderIter._shutdown_workers``)."""
    utils = torch.utils.data._utils  # noqa: SLF001 - torch's shutdown reads its interval there
    interval = getattr(utils, "MP_STATUS_CHECK_INTERVAL", 5.0)
    return float(interval) * max(workers, 1)


def _own(owner: str) -> bool:
    """True if a :class:`CacheLockedError`'s owner (``"pid PID HOST"``) is this process."""
    return owner == f"pid {os.getpid()} {socket.gethostname()}"


def _read_at_once(exc: CacheLockedError, who: str) -> CacheLockedError:
    """``exc``, for a cache folder that ``who`` holds (this process, a DataLoader worker of it or
    of another dataset), saying why that is: datasets over one ``cache_dir``, or loaders of one
    dataset, read at the same time."""
    held = CacheLockedError(
        exc.cache_dir,
        f"{exc.owner} ({who}): two datasets over one cache_dir (training and validation), or two DataLoaders or "
        "iterators of one dataset (a pass broken off holds its folders while its iterator or persistent workers live), "
        "read at the same time use the same folders, cache_dir/rank<r>-worker<k>; give each dataset its own cache_dir, and "
        "read one DataLoader of a dataset at a time (end or delete the other's iterator first), or make the second "
        "loader's dataset anew with a cache_dir of its own",
    )
    held.owner = exc.owner
    return held


def _sibling(owner: str) -> bool:
    """True if a :class:`CacheLockedError`'s owner (``"pid PID HOST"``) is a process on this host
    with this process's parent (read from ``/proc``: Linux; elsewhere False), or may be one: an
    owner neither its lock file nor the kernel's list of locks names (``"another process"``:
    another OS, or a pid namespace that does not see it), or a pid that is gone (the file still
    names the last owner while the next writes its own). The next try reads the owner that
    holds it."""
    if owner == UNKNOWN_OWNER:
        return True
    pid = owner_pid(owner)
    if pid is None:
        return False
    fields = proc_stat(pid)
    if fields is None:
        return Path("/proc/self/stat").exists() and not Path(f"/proc/{pid}").exists()  # gone (where /proc tells)
    return len(fields) > 1 and fields[1] == str(os.getppid())


def _family(owner: str) -> str | None:
    """Who a :class:`CacheLockedError`'s owner (``"pid PID HOST"``) is, if it is this process's
    parent (this is a DataLoader worker of the process that reads the folder itself) or a child
    of it (a DataLoader worker of this process); else None."""
    pid = owner_pid(owner)
    if pid is None:
        return None
    if pid == os.getppid() and torch.utils.data.get_worker_info() is not None:
        return "the process this DataLoader worker is of"
    fields = proc_stat(pid)
    if fields is not None and len(fields) > 1 and fields[1] == str(os.getpid()):
        return "a DataLoader worker of this process"
    return None


def _finished(state: Mapping[str, Any]) -> bool:
    """True if a per-process pipeline ``state`` is at the end of its pass: of its (finite) plan,
    or the epoch its pass ends before (``end_epoch``)."""
    end = state.get("end_epoch")
    if end is None:
        end = state.get("epochs")
    return end is not None and state.get("epoch", 0) >= end


def _next(pipe: Pipeline, end: int | None) -> CachedItem | None:
    """``pipe``'s next item; None once all are delivered, or (``end``) once the next step is of
    epoch ``end`` or later. Skipped items are passed over (as :meth:`Pipeline.get` does)."""
    while isinstance(got := _next_step(pipe, end), Skipped):
        pass
    return got


def _next_step(pipe: Pipeline, end: int | None) -> CachedItem | Skipped | None:
    """``pipe``'s next step: its item, or the item skipped in its turn
    (:meth:`Pipeline.get_or_skipped`); None once all are delivered, or (``end``) once the next
    step is of epoch ``end`` or later. The caller acknowledges each item before it asks again,
    so the next step is the first unconsumed one, whose epoch the state names."""
    if end is not None and pipe.state_dict()["epoch"] >= end:
        return None
    return pipe.get_or_skipped()
