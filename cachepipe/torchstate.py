"""What a :class:`~cachepipe.torch.CachePipeDataset` holds and where its passes stand, in
either mode: the attributes its ``__init__`` sets, this process's lane (rank, DataLoader worker),
and a pass's bookkeeping: whether it began or ran to its end, and the state a pass resumes from.

Invariant: only the latest pass of this dataset in a process (its token, ``_pass``) records a
position here; in a DataLoader worker a pass that ended keeps its end as the state, in the main
process the next pass starts from the beginning. :class:`_DatasetState` is the lowest base class
of ``CachePipeDataset`` (``torch.CachePipeDataset`` <- ``torchlocal._LocalMode`` and
``torchnode._NodeMode``, each <- ``torchstate._DatasetState``), not used alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import torch.utils.data

from .config import Share
from .pipeline import Pipeline
from .plan import Cursor, default_rank_world
from .repeats import Repeats
from .torchparent import exit_with_parent

__all__: list[str] = []

log = logging.getLogger("cachepipe")


class _DatasetState:
    """The dataset's state and its lane (see the module notes): :class:`~cachepipe.torch.CachePipeDataset`'s base."""

    # set by CachePipeDataset.__init__, which says what each holds
    source: str
    transform: Callable[[Any], Any] | None
    options: dict[str, Any]
    node: str | None
    job: str | None
    node_ranks: list[int] | None
    cache_dir: Path | None
    capacity: int | Share | None
    _state: dict[str, Any] | None
    _pass: object | None
    _start: dict[str, Any] | None
    _pipe: Pipeline | None
    _cursor: Cursor | None
    _lane_info: tuple[str, int, int, Any, dict[str, Any]] | None
    _end: int | None
    _owed: tuple[Any, int, int] | None
    _equal: bool
    _epoch: Any  # a torch tensor in shared memory
    _calls: int
    _defaulted: bool
    _passes: Any  # a torch tensor in shared memory

    def _items(self) -> Literal["folders", "files"]:
        """The items mode (the ``items`` option, default ``"folders"``; checked where the
        pipeline's options are, or by the daemon)."""
        return cast(Literal["folders", "files"], str(self.options.get("items", "folders")))

    def _worker(self) -> tuple[int, int]:
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            exit_with_parent()  # an orphan (its rank killed) would hold its cache folder or lane from the restart
        if info is not None and self.transform is None:
            raise ValueError(
                f"transform=None with DataLoader num_workers={num_workers}: a path yielded by a worker process would be "
                "evicted before the main process reads it; pass transform=fn(path) to read items in the worker"
            )
        return worker, num_workers

    def _rank_world(self) -> tuple[int, int]:
        rank, world = self.options.get("rank"), self.options.get("world_size")
        if rank is None and world is None:
            return default_rank_world()
        if rank is None or world is None:
            raise ValueError(f"rank {rank!r}, world_size {world!r}: give both or neither")
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"rank {rank} with world_size {world}: expected 0 <= rank < world_size")
        return int(rank), int(world)

    def _first_epoch(self) -> int | None:
        """The epoch set by :meth:`set_epoch`, or None (never called)."""
        epoch = int(self._epoch.item())
        return None if epoch < 0 else epoch

    def _not_started(self, start: dict[str, Any] | None, token: object) -> None:
        """The pass failed before it began: the next iteration starts where this one would have."""
        if self._pass is token and self._state is None:
            self._state = start

    def _ended(self, token: object) -> None:
        """The pass ran to its end: in the main process, a state taken now is the next pass's
        start; in a DataLoader worker, it stays this pass's end (kept without the closed pipeline)."""
        if self._pass is not token:
            return
        self._passes[0] += 1
        if int(self._passes[3]) != self._calls:
            # set_epoch while the pass ran: called after iter(loader), whose workers began with the epoch before
            log.warning(
                "%s: set_epoch(%d) was called while this pass (%s) ran: it read the epochs it began with to its "
                "end, not that one; call set_epoch(epoch) before iter(loader) or the for loop over it",
                self.source,
                int(self._epoch.item()),
                self._where(),
            )
        self._owed = None
        if torch.utils.data.get_worker_info() is None:
            self._start, self._pipe, self._cursor = None, None, None
        elif self._pipe is not None:
            self._start, self._pipe = self._local_state(self._pipe), None

    def _where(self) -> str:
        """This process's lane, for messages: ``"rank R worker K"``."""
        worker, _ = self._worker()
        rank, _ = self._rank_world()
        return f"rank {rank} worker {worker}"

    def _owed_counts(self) -> dict[str, int]:
        """``equal_steps`` with skips, in a state at the last sample read (:attr:`_owed`): its
        step's yields due (``"repeat"``) and the yields made from it on (``"yielded"``); {} else."""
        if self._owed is None:
            return {}
        return {"repeat": self._owed[1], "yielded": self._owed[2]}

    def _local_state(self, pipe: Pipeline) -> dict[str, Any]:
        """Per-process mode: ``pipe``'s state, with the epoch its pass ends before if it stops
        before the plan's end (``end_epoch``)."""
        state = pipe.state_dict()
        if self._end is not None:
            state["end_epoch"] = self._end
        return state


def _repeats(where: str, start: Mapping[str, Any] | None) -> Repeats:
    """The substitutions of a pass started from ``start``: at a state's last sample, its step's
    yields due (``"repeat"``, default 1) and those made before (``"yielded"``, default 0: a
    state saved without them, which is after its last sample)."""
    start = start or {}
    return Repeats(where, int(start.get("repeat", 1)), int(start.get("yielded", 0)))
