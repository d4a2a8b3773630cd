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

This module holds the dataset's front (its options, ``__iter__``, ``state_dict``). The
per-process mode is the base class ``_LocalMode`` (:mod:`cachepipe.torchlocal`), the node mode
the base class ``_NodeMode`` (:mod:`cachepipe.torchnode`), the state and lane of either mode
``_DatasetState`` (:mod:`cachepipe.torchstate`), the listing shared by the ranks of
``torch.distributed`` is :mod:`cachepipe.torchdist`, and the note saying which dataset reads a
worker's cache folder is :mod:`cachepipe.torchreader`.
"""

from __future__ import annotations

import logging
import multiprocessing.context
import os
import pickle
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.utils.data

from .config import PipelineConfig, Share, check_cache_dir, check_source, parse_capacity, small_capacity
from .manifest import Manifest
from .pipeline import Pipeline
from .plan import STATE_VERSION, Cursor
from .torchdist import _manifest_bytes, _save_manifest, local_ranks
from .torchlocal import (
    SIBLING_WAIT,  # noqa: F401 - importable from here, as before
    _LocalMode,
    _sibling,  # noqa: F401 - importable from here, as before
)
from .torchnode import _JOB_OPTIONS, NODE_BATCH, NODE_BATCH_BYTES, _NodeMode
from .torchshare import SharedManifest

# NODE_BATCH, NODE_BATCH_BYTES: importable from here, as before
__all__ = ["NODE_BATCH", "NODE_BATCH_BYTES", "CachePipeDataset", "local_ranks"]

log = logging.getLogger("cachepipe")


class CachePipeDataset(_LocalMode, _NodeMode, torch.utils.data.IterableDataset):  # type: ignore[misc, type-arg, unused-ignore]  # torch: an optional extra (Any when absent)
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
            ``seed``, ``rank``/``world_size`` (default: an initialised ``torch.distributed``'s, else
            ``RANK``/``WORLD_SIZE``, read here, for every DataLoader worker), ``storage_options``...); with ``node``, only
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
        self._calls = 0  # set_epoch's calls when the latest pass here began (see _ended)
        self._pass: object | None = None  # the latest iter()'s token: only its pass records a position here
        self._start: dict[str, Any] | None = None  # the state the latest pass started from (None: the start)
        self._pipe: Pipeline | None = None  # the latest pass's open pipeline (per-process mode)
        self._cursor: Cursor | None = None  # node mode: the position after the last item yielded here
        # node mode: the lane (job, rank, worker, catalog digest, the spec's fields of _LANE_PLAN), once registered here
        self._lane_info: tuple[str, int, int, Any, dict[str, Any]] | None = None
        self._end: int | None = None  # the epoch the latest pass ends before (None: the plan's end)
        # equal_steps with skips: (the state at the last sample read, its step's yields due, the
        # yields made from its step on): a state resumes there, reading it again (see _equal_local)
        self._owed: tuple[Any, int, int] | None = None
        # per-process mode, a capacity given as a share: the bytes it was of at the latest
        # pipeline made here (see _room), named by an OversizeError over a worker's share
        self._room: int | None = None
        # per-process mode: bytes of each worker's share that its folder and reader note take
        # beside its cache (two blocks of cache_dir's filesystem), and its part of this rank's
        # manifests in cache_dir (of a capacity in bytes), set with _room
        self._aside = 0
        # per-process mode, the manifest planned from, read here (see _hold_manifest), and its
        # copy in shared memory for workers started by spawn or forkserver, once one is
        self._manifest: Manifest | None = None
        self._shared: SharedManifest | None = None
        # this dataset object's identity, the same in its DataLoader workers (forked, or a copy
        # unpickled by spawn): a worker that finds its cache folder held by a worker of another
        # dataset object over this cache_dir is refused within seconds, not after SIBLING_WAIT
        # (see torchlocal._open)
        self._identity = uuid.uuid4().hex
        # set_epoch's value (-1: never called), in shared memory: persistent DataLoader workers read
        # what the main process set after they started
        self._epoch = torch.full((), -1, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call, unused-ignore]
        # passes run to their end by this dataset or its DataLoader workers, whether a replay was
        # logged, whether a pass began from the start before set_epoch's first call (it reads
        # every epoch: that call says so), and set_epoch's calls (a pass that ends after one made
        # while it ran says so): shared too, as a pass's workers are new processes unless persistent
        self._passes = torch.zeros(4, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call, unused-ignore]
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
        rank, world = self._rank_world()  # both or neither, and in range: here, not first in every DataLoader worker
        self._defaulted = "rank" not in options  # see _check_ranks
        if self._defaulted:
            # resolved here, once: a DataLoader worker has no torch.distributed of its own (not initialised
            # there), so under a launcher that sets no RANK/WORLD_SIZE (mp.spawn) each rank's workers were rank 0 of 1
            options["rank"], options["world_size"] = rank, world
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
        first = self._first_epoch() is None
        self._epoch.fill_(epoch)
        self._passes[3] += 1  # after the epoch: a pass that read this call's count reads its epoch
        if first and int(self._passes[2]) and epochs != 1:
            # a pass began before (set_epoch after the loop, or after iter(loader) whose workers began):
            # flagged before that pass read the epoch, checked after it is set, so not missed in a race
            log.warning(
                "%s: set_epoch(%d), its first call, came after a pass of this dataset began without it: that pass "
                "reads every epoch of the plan (epochs=%s), not one; call set_epoch(epoch) before each pass, before "
                "iter(loader) or the for loop over it (as DistributedSampler.set_epoch)",
                self.source,
                epoch,
                epochs,
            )

    def pipeline(self) -> Pipeline:
        """The pipeline this process (a DataLoader worker, or the main process) iterates
        (per-process mode): over every epoch of the plan, or the one :meth:`set_epoch` set. A
        capacity given as a share of the disk is worked out in bytes here, not when it opens."""
        return self._pipeline(self._first_epoch())

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
        self._check_ranks()
        start, self._state = self._state, None
        token = self._pass = object()
        self._start, self._pipe, self._cursor = start, None, None
        self._owed = None
        if not start:
            self._passes[2] = 1  # before the epoch is read: set_epoch's first call warns of this pass (see there)
        self._calls = int(self._passes[3])  # before the epoch is read: see _ended
        ended, logged, _, _ = (int(x) for x in self._passes.tolist())
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

    def _check_ranks(self) -> None:
        """A rank and world size taken when the dataset was made (not given) that an initialised
        ``torch.distributed`` contradicts now: the dataset was made before ``init_process_group``."""
        dist = torch.distributed
        if not self._defaulted or not dist.is_available() or not dist.is_initialized():
            return
        made, now = (self.options["rank"], self.options["world_size"]), (dist.get_rank(), dist.get_world_size())
        if made != now:
            raise ValueError(
                f"this dataset was made as rank {made[0]} of {made[1]} (torch.distributed not initialised then, nor "
                f"RANK/WORLD_SIZE set), and torch.distributed is rank {now[0]} of {now[1]}: make the dataset after "
                "init_process_group, or give it rank= and world_size="
            )

    def state_dict(self) -> dict[str, Any]:
        """Where to resume: valid in every DataLoader worker (``StatefulDataLoader`` saves
        each worker's) and in the main process.

        Node mode: the position after the last sample this process (worker) yielded, with the
        state's ``version`` (a state of another is refused; one without, of an earlier cachepipe,
        is read), the job, lane and catalog digest, the job's plan layout (``plan``: world size, DataLoader
        workers, shuffle, seed, balance, partition, equal_steps; a resume under another is
        refused, naming the field), and the epoch the pass ends before (``end_epoch``: None
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
                name, rank, worker, digest, plan = self._lane_info
                cursor = self._cursor if self._owed is None else self._owed[0]
                return {
                    "version": STATE_VERSION,
                    "job": name,
                    "rank": rank,
                    "worker": worker,
                    "epoch": cursor.epoch,
                    "index": cursor.index,
                    "catalog_digest": digest,
                    "plan": plan,
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
        position, not its pipeline (threads, locks, files: this process's alone). A rank taken
        when the dataset was made is checked here too: such a worker has no ``torch.distributed``
        of its own to check it against (:meth:`_check_ranks`).

        Raises:
            TypeError: pickled for a process that multiprocessing starts (spawn, forkserver), the
                dataset's ``store=`` object cannot be (cachepipe's stores cannot: they hold
                connections, locks, an event loop), naming it and what to do.
        """
        self._check_ranks()
        store = self.options.get("store")
        if store is not None and multiprocessing.context.get_spawning_popen() is not None:  # sent to a new process
            try:
                pickle.dumps(store)
            except Exception as exc:  # whatever the store's pickling raises is said, chained
                raise TypeError(
                    f"{self.source}: the dataset's store={store!r} cannot be pickled ({type(exc).__name__}: {exc}), and "
                    "DataLoader workers started by spawn or forkserver (the default on macOS, and on Linux from Python "
                    "3.14) get the dataset pickled: pass the source's URL and storage_options instead of a store object "
                    "(each worker opens the store itself), or start the workers by fork (Linux): "
                    "DataLoader(..., multiprocessing_context='fork')"
                ) from exc
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
