"""PyTorch adapter: an ``IterableDataset`` over a cachepipe source (extra ``torch``).

Two modes, same samples: every (rank, DataLoader worker) reads exactly the share that
:class:`~cachepipe.plan.Plan` gives it, in the same order, epoch after epoch.

*Per-process* (``cache_dir`` and ``capacity``): each DataLoader worker runs its own
:class:`~cachepipe.Pipeline` over its share, with ``capacity / num_workers`` and its own cache
folder ``cache_dir/rank<r>-worker<k>``. No service is needed: for a laptop, a notebook, a job
of one process. The price: every process lists the source, and the capacity is split.

*Node* (``node=SOCKET``): the workers of every rank on the node read from the node's
``cachepipe serve`` daemon (a ``jobs`` section in its configuration), which lists once, holds
one cache under the node's capacity (an item may be as large as all of it) and downloads for
every lane with one pool of connections (see :mod:`cachepipe.node`). The dataset registers the
job (its spec: source, plan options, world size, the node's ranks, DataLoader workers), then each
worker reads its lane by position. The position is the dataset's state.

Epochs: with ``epochs=E``, one pass over the DataLoader reads all ``E`` epochs, each in its own
order (the cache fetches across the epochs' boundaries). A loop that makes one pass per epoch
calls :meth:`~CachePipeDataset.set_epoch` before each, as for torch's ``DistributedSampler``:
the pass then reads that epoch alone. Without it, every pass reads the same epochs in the same
order (logged, with ``shuffle``). Per-process with ``retain="auto"``, such a pass plans the
later epochs too, stops at its epoch's end and keeps what it retained or fetched ahead on disk
for the next pass (``keep_on_close``, but in the plan's last epoch). With several ranks,
``equal_steps`` defaults to ``"pad"``, so that DDP ranks run the same number of steps; with
it, an item skipped at run time (``on_error``/``on_oversize="skip"``) is replaced by a repeat of
another sample of its worker (:mod:`cachepipe.repeats`: logged), so that each worker still
yields its planned count. A
Hugging Face ``Trainer`` or an Accelerate loop must not prepare the DataLoader (it would split
the shares again): see docs/training.md.

Items are read inside the worker: pass ``transform(path)`` (decode the video, read the text...)
and the worker yields what it returns; the item is released as soon as ``transform`` returns.
:meth:`~CachePipeDataset.state_dict` and :meth:`~CachePipeDataset.load_state_dict` work in
every worker in both modes (what ``StatefulDataLoader`` saves and restores).
A bare path cannot leave a worker process safely (it would be evicted before the main process
read it), so ``transform`` is required when ``num_workers > 0``.

The same lifetime holds in the main process (``num_workers=0``, no ``transform``): a yielded
:class:`~cachepipe.CachedItem` is deleted when the loop asks for the next sample, so a batch of
several paths (``batch_size > 1`` with the default collate) holds deleted paths but the last:
read items in ``transform``, or use ``batch_size=1``/``None``. Using an acknowledged
``CachedItem`` as a path raises ``FileNotFoundError``; a ``str`` of it cannot be tracked.

This module holds the dataset's front (its options, ``__iter__``, ``state_dict``) and the
per-process mode. The node mode is the base class ``_NodeMode`` (:mod:`cachepipe.torchnode`),
the state and lane of either mode ``_DatasetState`` (:mod:`cachepipe.torchstate`), and the
listing shared by the ranks of ``torch.distributed`` is :mod:`cachepipe.torchdist`.
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
from .cache.room import room_at
from .config import PipelineConfig, Share, check_cache_dir, check_source, parse_capacity, small_capacity, with_unit
from .errors import CacheLockedError, OversizeError
from .manifest import Manifest, _is_url, read_manifest
from .pipeline import CachedItem, Pipeline, Skipped
from .plan import Cursor
from .torchdist import _distributed, _from_rank0, _manifest_bytes, _save_manifest, local_ranks
from .torchnode import _JOB_OPTIONS, NODE_BATCH, NODE_BATCH_BYTES, _NodeMode
from .torchshare import SharedManifest
from .torchstate import _repeats

# NODE_BATCH, NODE_BATCH_BYTES: importable from here, as before
__all__ = ["NODE_BATCH", "NODE_BATCH_BYTES", "CachePipeDataset", "local_ranks"]

log = logging.getLogger("cachepipe")


SIBLING_WAIT = 60.0  #: per-process mode: most seconds a worker waits for a folder another worker of its DataLoader holds


class CachePipeDataset(_NodeMode, torch.utils.data.IterableDataset):  # type: ignore[misc, type-arg, unused-ignore]  # torch: an optional extra (Any when absent)
    """Stream a source through a size-capped cache into a DataLoader.

    Args:
        source: dataset URL (see :class:`~cachepipe.Pipeline`).
        cache_dir: per-process mode: a folder under which each (rank, worker) gets its own
            cache. Not with ``node`` (the daemon's ``jobs.root`` decides).
        capacity: per-process mode: the total for this rank; each worker gets
            ``capacity / num_workers``; a share of the disk (``"80%"``) is of its free space
            and of what the workers of every rank hold in ``cache_dir`` (resolved as each
            worker's cache opens, so it keeps its size over the items they kept). With ``node``:
            the job's share of the daemon's ``jobs.capacity`` (default: all of it).
        transform: ``fn(path) -> sample``, run in the worker while the item is on disk.
            Required with ``num_workers > 0``. None: yield the item itself (only with
            ``num_workers=0``).
        node: the node daemon's socket (or ``http://HOST:PORT``): node mode. None (default):
            per-process mode.
        job: node mode: the job's name on the daemon, the same in every rank (default: derived
            from the source, the plan options, the world size and the node's ranks, so a job
            started again with the same settings finds its cache).
        node_ranks: node mode: the ranks on this node (default: from torchrun's ``RANK``,
            ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``, else this rank alone).
        **options: :class:`~cachepipe.config.PipelineConfig` options (``epochs``, ``shuffle``,
            ``seed``, ``rank``/``world_size``, ``storage_options``...); with ``node``, only
            the plan's (``items``, ``manifest``, ``epochs``, ``shuffle``, ``seed``, ``balance``,
            ``partition``, ``equal_steps``, ``retain``, ``on_error``, ``on_oversize``) and
            ``rank``/``world_size``. ``worker`` and ``num_workers`` are set from the DataLoader.
            ``equal_steps`` defaults to ``"pad"`` with several ranks (every rank the same
            number of items and batches per epoch, as DDP needs, like ``DistributedSampler``;
            ``Pipeline``'s default is None); give ``equal_steps=None`` for the shares as
            they were before it existed (to resume a state saved then). With it set and
            several ranks, a skipped item (``on_error``/``on_oversize="skip"``) is replaced by
            a repeat of the worker's previous sample (the next one at a pass's start), logged;
            a worker whose every item of a pass is skipped raises
            :class:`~cachepipe.errors.NothingToRepeatError` (a ``RuntimeError``).

    Raises:
        ValueError: a missing, misplaced or invalid argument, named (per-process mode: every
            pipeline option, as :class:`~cachepipe.Pipeline` checks it; node mode: the daemon
            checks the job's options when it registers); ``transform=None`` with a skip option
            and ``equal_steps`` over several ranks (a repeat of a path would be of a deleted item).
        TypeError: ``transform`` is not callable.
    """

    def __init__(
        self,
        source: str,
        cache_dir: str | os.PathLike[str] | None = None,
        capacity: int | str | None = None,
        transform: Callable[[Any], Any] | None = None,
        *,
        node: str | os.PathLike[str] | None = None,
        job: str | None = None,
        node_ranks: list[int] | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        self._state: dict[str, Any] | None = None  # loaded (load_state_dict), for the next iter() to take
        self._pass: object | None = None  # the latest iter()'s token: only its pass records a position here
        self._start: dict[str, Any] | None = None  # the state the latest pass started from (None: the start)
        self._pipe: Pipeline | None = None  # the latest pass's open pipeline (per-process mode)
        self._cursor: Cursor | None = None  # node mode: the position after the last item yielded here
        self._lane_info: tuple[str, int, int, Any] | None = None  # node mode: the lane, once registered here
        self._end: int | None = None  # the epoch the latest pass ends before (None: the plan's end)
        # equal_steps with skips: (the state at the last sample read, its step's yields due, the
        # yields made from its step on): a state resumes there, reading it again (see _equal_local)
        self._owed: tuple[Any, int, int] | None = None
        # per-process mode, a capacity given as a share: the bytes it was of at the latest
        # pipeline made here (see _room), named by an OversizeError over a worker's share
        self._room: int | None = None
        # per-process mode, the manifest planned from, read here (see _hold_manifest), and its
        # copy in shared memory for workers started by spawn or forkserver, once one is
        self._manifest: Manifest | None = None
        self._shared: SharedManifest | None = None
        # set_epoch's value (-1: never called), in shared memory: persistent DataLoader workers read
        # what the main process set after they started
        self._epoch = torch.full((), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call, unused-ignore]
        # passes run to their end by this dataset or its DataLoader workers, and whether a replay
        # was logged: shared too, as a pass's workers are new processes unless persistent
        self._passes = torch.zeros(2, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call, unused-ignore]
        for key in ("worker", "num_workers"):
            if key in options:
                raise ValueError(f"{key}={options[key]!r}: set by the DataLoader, not by the dataset")
        if "start_epoch" in options:
            raise ValueError(f"start_epoch={options['start_epoch']!r}: call dataset.set_epoch(epoch) before a pass instead")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform={transform!r}: expected a function fn(path) -> sample, or None")
        self.source, self.transform, self.options = source, transform, options
        self.node = None if node is None else os.fspath(node)
        self.job, self.node_ranks = job, node_ranks
        _, world = self._rank_world()  # both or neither, and in range: here, not first in every DataLoader worker
        if world > 1 and "equal_steps" not in options:
            # DDP-safe by default; set here, so every worker's pipeline, or the job's spec, carries it
            options["equal_steps"] = "pad"
        # a skipped item's step is taken by a repeat: only where equal counts are planned and kept
        # (one rank has no collective to hang; equal_steps=None plans unequal counts anyway)
        skips = [f"{key}='skip'" for key in ("on_error", "on_oversize") if options.get(key) == "skip"]
        # per-process, the pipeline's options say whether it skips; a node's jobs.options may too
        self._equal = world > 1 and options.get("equal_steps") is not None and (bool(skips) or node is not None)
        if self._equal and skips and transform is None:
            raise ValueError(
                f"transform=None with {' and '.join(skips)} and equal_steps={options['equal_steps']!r} over "
                f"{world} ranks: a skipped item's step is taken by a repeat of another sample, and a path is deleted "
                "once the loop asks for the next; pass transform=fn(path) (the repeat is its sample)"
            )
        if self.node is None:
            if cache_dir is None or capacity is None:
                raise ValueError("cache_dir and capacity are required without node= (per-process mode)")
            self.cache_dir: Path | None = Path(check_cache_dir(cache_dir))
            self.capacity: int | Share | None = parse_capacity(capacity)
            # every option checked here, as each worker's pipeline will check it (before any listing)
            config = {k: v for k, v in options.items() if k != "store"}  # Pipeline(store=) is not an option
            PipelineConfig(source=source, cache_dir=self.cache_dir, capacity=self.capacity, **config)
            if options.get("store") is None:
                check_source(source)
            if (small := small_capacity(capacity, self.capacity)) is not None:
                log.warning("%s", small)  # here, as written: the workers' pipelines get their shares in bytes
            if options.get("manifest") is None:
                shared = self._list_once()
                if shared is not None:
                    self.options["manifest"] = shared
            self._hold_manifest()
        else:
            if cache_dir is not None:
                raise ValueError(f"cache_dir={str(cache_dir)!r} with node=: the daemon's jobs.root decides where a job caches")
            unknown = sorted(set(options) - _JOB_OPTIONS - {"rank", "world_size"})
            if unknown:
                raise ValueError(
                    f"{', '.join(unknown)} with node=: a job sets only {sorted(_JOB_OPTIONS)} and rank/world_size; "
                    "the rest is the daemon's jobs.options"
                )
            self.cache_dir, self.capacity = None, None if capacity is None else parse_capacity(capacity)
            if options.get("manifest") is None and options.get("catalog") is None:
                digest = self._node_catalog()
                if digest is not None:
                    self.options["catalog"] = digest

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

    def set_epoch(self, epoch: int) -> None:
        """Make each later pass read epoch ``epoch`` of the plan alone (counted from 0), in that
        epoch's order (with ``shuffle``: its own permutation), as ``DistributedSampler.set_epoch``
        does. Call it before each pass of a loop that makes one pass per epoch; a pass already
        running keeps its epochs, and a state loaded with :meth:`load_state_dict` resumes the
        pass it was saved in. Persistent DataLoader workers see it (shared memory). Never
        called: a pass reads every epoch of the plan (``epochs``), from the first.

        Per-process mode without a ``manifest`` (or ``store``): the first call lists the source,
        here, into a manifest under ``cache_dir`` that every later pass and DataLoader worker
        plans from (else each worker of each pass would list it again), so the passes read one
        catalog, as one pass over the epochs does.

        Raises:
            ValueError: ``epoch`` is not an integer >= 0, or is past the plan's epochs (give
                ``epochs`` the number of epochs you train, or None: endless); per-process mode
                with ``resume=True``.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"set_epoch({epoch!r}): expected an integer >= 0 (epochs count from 0)")
        if self.node is None and self.options.get("resume"):
            raise ValueError(
                f"set_epoch({epoch}) with resume=True: resume continues the pass each worker's journal holds, and a pass "
                "per epoch is another plan each time; resume from StatefulDataLoader's state instead"
            )
        epochs = self.options.get("epochs", 1)
        if epochs is not None and epoch >= epochs:
            raise ValueError(
                f"set_epoch({epoch}) with epochs={epochs}: the plan has epochs 0 to {epochs - 1}; "
                "give the dataset epochs=N (the epochs you train) or epochs=None (endless)"
            )
        if self.cache_dir is not None and self.options.get("manifest") is None and self.options.get("store") is None:
            rank, _ = self._rank_world()
            data = _manifest_bytes(self.source, self._items(), self.options)
            self.options["manifest"] = _save_manifest(self.cache_dir, rank, data, self.source, self._items())
            self._hold_manifest()
        self._epoch.fill_(epoch)

    def pipeline(self) -> Pipeline:
        """The pipeline this process (a DataLoader worker, or the main process) iterates
        (per-process mode): over every epoch of the plan, or the one :meth:`set_epoch` set. A
        capacity given as a share of the disk is worked out in bytes here, not when it opens."""
        return self._pipeline(self._first_epoch())

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
        share = with_unit(capacity // num_workers)
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

    def __iter__(self) -> Iterator[Any]:
        """A pass: over the share from the state loaded, if any, else from the start.

        The loaded state is taken here, by the first ``iter()`` after :meth:`load_state_dict`
        (``StatefulDataLoader`` may make an iterator it never runs, then another). Until the
        pass yields, :meth:`state_dict` is where it starts. Once it has ended, in a DataLoader
        worker the state is its end (the worker's share of the loader's pass is done, which a
        ``StatefulDataLoader`` checkpoint taken while other workers still yield must keep); in
        the main process it is the start of the next pass. Only the latest iterator of this
        dataset in a process records its position here. Without a loaded state, the pass reads
        the epoch :meth:`set_epoch` set, else every epoch of the plan."""
        start, self._state = self._state, None
        token = self._pass = object()
        self._start, self._pipe, self._cursor = start, None, None
        self._owed = None
        ended, logged = (int(x) for x in self._passes.tolist())
        if not start and ended and not logged and self._first_epoch() is None and self.options.get("shuffle"):
            self._passes[1] = 1  # once (two workers starting at once may both log it)
            log.warning(
                "%s: this pass reads the same epochs in the same order as the last one: call set_epoch(epoch) before "
                "each pass for a new order (one epoch per pass), or give epochs=N and make one pass",
                self.source,
            )
        if not start and (first := self._first_epoch()) is not None:
            # the epoch set, fixed now and named in a state taken before the pass yields (a
            # StatefulDataLoader worker that has not yielded when the loader is saved saves it)
            start = {"start_epoch": first} if self.node is None else {"epoch": first, "index": 0, "end_epoch": first + 1}
            self._start = start
        return self._iter_node(start, token) if self.node is not None else self._iter_local(start, token)

    @contextlib.contextmanager
    def _in_share(self) -> Iterator[None]:
        """An :class:`OversizeError` raised inside, in a DataLoader worker, whose pipeline has
        ``capacity / num_workers``, says that this is the capacity it names (a share of the disk
        with the bytes it was of: see :func:`_room`)."""
        try:
            yield
        except OversizeError as exc:
            info = torch.utils.data.get_worker_info()
            if info is None or info.num_workers == 1:
                raise
            capacity = str(self.capacity)
            if self._room is not None:  # a share of the disk: of what, in bytes
                capacity += f" of {self._room} bytes free or cached in cache_dir"
            of = f"this DataLoader worker's share of the cache (capacity {capacity} / num_workers {info.num_workers})"
            raise OversizeError(exc.item, exc.size, exc.capacity, exc.occupied, of) from None

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
                pipe = _open(make)
                if not start and self.options.get("resume") and _finished(pipe.state_dict()):
                    # resume=True continues a pass this folder's journal holds; one that ended (this
                    # process's last pass, or a run that finished) has nothing left: this pass is new
                    pipe.close()
                    pipe = _open(lambda: self._pipeline(None, resume=False))
        except BaseException:
            self._not_started(start, token)
            raise
        if self._pass is token:
            self._pipe, self._end = pipe, end
        try:
            with self._in_share():  # an item over the worker's share, in its turn
                if self._equal and self.transform is not None:
                    yield from self._equal_local(pipe, start, end, token)
                else:
                    while (item := _next(pipe, end)) is not None:
                        if self.transform is None:
                            yield item
                            pipe.ack(item)  # when the loop asks for the next
                        else:
                            sample = self.transform(item)
                            pipe.ack(item)  # read: its space is free while the sample travels on, and the state is past it
                            yield sample
        finally:
            pipe.close()
        self._ended(token)

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

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: valid in every DataLoader worker (``StatefulDataLoader`` saves
        each worker's) and in the main process.

        Node mode: the position after the last sample this process (worker) yielded, with the
        job, lane and catalog digest, and the epoch the pass ends before (``end_epoch``: None
        for the plan's end; one past the epoch :meth:`set_epoch` set). Either mode, with
        ``equal_steps`` over several ranks and a skip option (node mode: whatever the job's
        options), once the pass yielded: the position of the last sample read (a resume reads
        it again, to repeat it for skipped items after it), ``"repeat"`` the yields due for its
        step and ``"yielded"`` those made from its step on (not made again). Per-process
        mode: the plan's configuration and the position of this process's pipeline
        (:meth:`cachepipe.Pipeline.state_dict`): after the last sample yielded with a
        ``transform``, at the item in hand without one; with ``end_epoch`` in a
        :meth:`set_epoch` pass with ``retain="auto"``. Before this process iterates: the state
        loaded, or the start (``{}``; in a pass that :meth:`set_epoch` set, once it began, that
        epoch's start until it yields). After a pass ended: its end in a DataLoader worker, the
        next pass's start in the main process.
        """
        if self._state is None:  # no state loaded since this process's last pass began
            if self.node is not None and self._cursor is not None and self._lane_info is not None:
                name, rank, worker, digest = self._lane_info
                cursor = self._cursor if self._owed is None else self._owed[0]
                return {
                    "job": name,
                    "rank": rank,
                    "worker": worker,
                    "epoch": cursor.epoch,
                    "index": cursor.index,
                    "catalog_digest": digest,
                    "end_epoch": self._end,
                    **self._owed_counts(),
                }
            if self.node is None and self._owed is not None:
                return {**self._owed[0], **self._owed_counts()}
            if self.node is None and self._pipe is not None:
                return self._local_state(self._pipe)
        start = self._state if self._state is not None else self._start
        if start is not None:
            return dict(start)
        return {}  # the start: of the plan, or of the epoch set_epoch sets before the pass

    def __getstate__(self) -> dict[str, Any]:
        """A copy (for a DataLoader worker started by spawn or forkserver) keeps this process's
        position, not its pipeline (threads, locks, files: this process's alone)."""
        state = dict(self.__dict__)
        if self._pipe is not None:
            state["_start"] = self._local_state(self._pipe) if self._owed is None else {**self._owed[0], **self._owed_counts()}
        state["_pipe"], state["_pass"] = None, None
        if self._manifest is not None:  # to a worker started by spawn: the held read, in shared memory
            if self._shared is None or self._shared.manifest is not self._manifest:
                self._shared = SharedManifest.of(self._manifest)  # once per manifest read, not per worker
            state["_manifest"] = self._shared  # None: not held, the copy reads the file
        state["_shared"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, ``pickle``) gets set_epoch's value in shared memory of its
        own, so that the persistent workers of a DataLoader over the copy see its later calls (a
        plain copy of the tensor is private memory, which forked workers only inherit). A worker
        started by spawn or forkserver receives the parent's shared value, which stays shared."""
        self.__dict__.update(state)
        for shared in (self._epoch, self._passes):
            if not shared.is_shared():
                shared.share_memory_()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Start the next iteration at ``state`` (from :meth:`state_dict`, same settings and data);
        the iterations after it start from the beginning, as without a state."""
        self._state = dict(state)


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


def _open(make: Callable[[], Pipeline]) -> Pipeline:
    """``make()``, opened. In a DataLoader worker, a cache folder held by another worker of the
    same DataLoader (same parent process) is waited for, up to :data:`SIBLING_WAIT` seconds:
    ``StatefulDataLoader``, resuming a checkpoint taken after a pass, starts the saved pass's
    workers, then the next pass's while the first ones still stop (a worker whose state is
    before an item ``drop_last`` dropped still has it to read, in its folder)."""
    deadline = time.monotonic() + SIBLING_WAIT
    while True:
        pipe = make()
        try:
            return pipe.open()
        except CacheLockedError as exc:
            if torch.utils.data.get_worker_info() is None or not _sibling(exc.owner) or time.monotonic() >= deadline:
                raise
            log.info("%s is held by %s, a worker of this DataLoader that stops: waiting for it", exc.cache_dir, exc.owner)
        time.sleep(0.1)  # another process's lock: polled (flock has no timed wait)


def _sibling(owner: str) -> bool:
    """True if a :class:`CacheLockedError`'s owner (``"pid PID HOST"``) is a process on this host
    with this process's parent (read from ``/proc``: Linux; elsewhere False), or may be one: the
    owner not yet written (``"another process"``: the lock file is written just after its
    ``flock`` is taken), or a pid that is gone (the file still names the last owner while the
    next writes its own). The next try reads the owner that holds it."""
    if owner == UNKNOWN_OWNER:
        return True
    parts = owner.split()
    if len(parts) != 3 or parts[0] != "pid" or not parts[1].isdigit() or parts[2] != socket.gethostname():
        return False
    try:
        stat = Path(f"/proc/{parts[1]}/stat").read_text()
    except FileNotFoundError:
        return Path("/proc/self/stat").exists()  # gone (where /proc tells)
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[-1].split()  # after the command name, which may hold spaces
    return len(fields) > 1 and fields[1] == str(os.getppid())


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
