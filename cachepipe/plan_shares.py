"""A plan's share of each epoch: the catalog indices that one (rank, worker) reads in it, cut
from the epoch's order by the pure functions of :mod:`cachepipe.plan_split`, and kept for the
last :data:`EPOCHS_CACHED` epochs read.

:class:`_Shares` is the base class of :class:`~cachepipe.plan.Plan` (not used alone): the plan
checks and sets the attributes, and keeps the positions and the resume state. Pure code: no I/O
and no thread of its own (a lock guards the epochs kept: the fetcher and the cache may read them
at once). :mod:`cachepipe.plan` re-exports :data:`EPOCHS_CACHED`.

``partition="epoch"`` (default) re-splits every epoch, like torch's ``DistributedSampler``.
``partition="fixed"`` splits once (by bytes or count, over the permutation of epoch ``-1``)
and then each rank reads its own items in the order of each epoch's global permutation: a
rank sees the same items every epoch, which is what lets a per-node cache retain them
across epochs. Its workers are split once in the same way (each DataLoader worker has a cache
of its own), so an item stays with one (rank, worker) for the whole run. ``equal_steps``
applies to that one split: ``"drop"`` leaves the same items out of every epoch (the last
``n % world_size`` of epoch ``-1``'s permutation), ``"pad"`` gives the same items twice every
epoch (a share that holds an item twice reads it twice in a row).
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, Literal

from .plan_split import deal, equalise, permutation, split

__all__ = ["EPOCHS_CACHED"]

# Final, not a setting: lanes (NodePlan) reads it under its own name, as plan re-exports it, so a value
# set on one module would not be the others'
EPOCHS_CACHED: Final = 5
"""Epochs whose shares a plan keeps computed. A node computes the epoch after next as soon as a
lane enters an epoch (:class:`cachepipe.lanequeues.LaneQueues`): with lanes two epochs apart, five
are read at once (fewer slots made the lagging lane's epoch be computed again and again)."""


class _Shares:
    """The share of each epoch, computed and kept: :class:`~cachepipe.plan.Plan`'s base."""

    # set by Plan.__init__, which checks them
    sizes: array[int]
    n_items: int
    shuffle: bool
    seed: int
    rank: int
    world_size: int
    worker: int
    num_workers: int
    balance: Literal["bytes", "count"]
    partition: Literal["epoch", "fixed"]
    equal_steps: Literal["pad", "drop"] | None
    _lock: threading.Lock
    _shares: OrderedDict[int, array[int]]
    _mine: bytearray | None
    _twice: bool

    def order(self, epoch: int, pause: Callable[[], None] | None = None) -> array[int]:
        """The whole epoch's order (all ranks), before splitting (``pause``: see :func:`permutation`)."""
        if self.shuffle:
            return permutation(self.n_items, self.seed, epoch, pause)
        return array("I", range(self.n_items))

    def share(self, epoch: int) -> array[int]:
        """The catalog indices this (rank, worker) reads in ``epoch``, in order (cached)."""
        with self._lock:
            got = self._shares.get(epoch)
            if got is not None:
                self._shares.move_to_end(epoch)
                return got
            got = self._compute_share(epoch)
            self._shares[epoch] = got
            if len(self._shares) > EPOCHS_CACHED:
                self._shares.popitem(last=False)
            return got

    def prime(self, epoch: int, share: array[int]) -> None:
        """Cache ``share`` as this plan's share of ``epoch``: the one :meth:`share` would compute,
        computed elsewhere for several plans at once (:class:`cachepipe.lanes.NodePlan`)."""
        with self._lock:
            self._shares[epoch] = share
            self._shares.move_to_end(epoch)
            if len(self._shares) > EPOCHS_CACHED:
                self._shares.popitem(last=False)

    def _compute_share(self, epoch: int) -> array[int]:
        order = self.order(epoch)
        if self.partition == "fixed" and self.world_size * self.num_workers > 1:
            if self._mine is None:
                base = permutation(self.n_items, self.seed, -1) if self.shuffle else order
                mine = bytearray(self.n_items)
                for x in self._split(base):
                    mine[x] += 1  # at most 2: "pad" repeats fewer items than the epoch has, or gives one per rank
                self._mine = mine
                self._twice = self.equal_steps == "pad" and max(mine, default=0) > 1
            mine = self._mine
            if self._twice:  # an item this share holds twice is read twice in a row
                return array("I", (x for x in order for _ in range(mine[x])))
            return array("I", (x for x in order if mine[x]))
        return self._split(order)

    def _split(self, order: Sequence[int]) -> array[int]:
        """This (rank, worker)'s part of ``order``, a whole epoch's (see :mod:`cachepipe.plan_split`)."""
        if self.equal_steps is None:
            if self.world_size > 1:
                order = split(order, self.sizes, self.world_size, self.rank, self.balance)
            return split(order, self.sizes, self.num_workers, self.worker, self.balance)
        if self.world_size > 1:
            order = deal(equalise(order, self.world_size, self.equal_steps), self.sizes, self.world_size, self.balance)[self.rank]
        return deal(order, self.sizes, self.num_workers, self.balance)[self.worker]
