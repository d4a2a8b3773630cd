"""The consumers of one node, merged into one fetch order (pure code).

A node serves several consumers of one job: rank ``r`` of ``world_size``, DataLoader worker
``k`` of ``num_workers``, for each of the node's ranks. Each such *lane* reads exactly the
share that :class:`~cachepipe.plan.Plan` gives ``(r, k)`` (the same object a per-process pipeline
uses: one definition of who reads what). :class:`NodePlan` interleaves the lanes' shares of
each epoch into one sequence, by ``(index, lane)``: the first step of every lane, then the
second of every lane, and so on. That is the order a job whose ranks advance in step (DDP)
needs its items in, and the order the node's single fetcher downloads them in. It is also a
plan in its own right, with :meth:`NodePlan.share`, :meth:`NodePlan.done` and ``n_items``,
so that :class:`~cachepipe.retention.PlanFuture` and Belady retention see the whole node.

:class:`LaneSchedule` picks the step to fetch next while each lane's position may be moved by
its consumer (a worker restarting from a checkpoint asks for an earlier position; one that
skipped ahead, for a later one): :meth:`LaneSchedule.next` serves the lane with the fewest
steps planned and not consumed, then the earliest ``(epoch, index)`` (the merged order when
lanes keep pace), passing over a lane the caller holds back; :meth:`LaneSchedule.reset`
moves a lane and starts a new *generation* of it, so that steps planned for its old position can be told
apart. Nothing here does I/O or starts a thread; the only locks guard the epochs computed.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

from .catalog import Item
from .plan import EPOCHS_CACHED, STATE_VERSION, Cursor, Plan, Step, deal, equalise, permutation, split_all
from .plan import tick as plan_tick
from .plan_split import RUN

__all__ = ["Lane", "LaneSchedule", "LaneStep", "NodePlan"]


class Lane(NamedTuple):
    """One consumer of a node: DataLoader ``worker`` of ``rank`` (worker 0 without workers)."""

    rank: int
    worker: int


class LaneStep(NamedTuple):
    """A step of one lane (``step.index`` counts that lane's steps) in the node's order
    (``tick``: the epoch and the merged index, see :func:`cachepipe.plan.tick`)."""

    lane: int  # index into NodePlan.lanes
    generation: int
    step: Step
    tick: int


def check_ranks(ranks: Sequence[int], world_size: int) -> list[int]:
    """``ranks`` sorted, checked: not empty, distinct, each in ``[0, world_size)``.

    Raises:
        ValueError: naming the bad value.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size {world_size!r}: expected an integer >= 1")
    if not ranks:
        raise ValueError("ranks []: expected the node's ranks, at least one")
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank!r} in ranks: expected an integer with 0 <= rank < world_size = {world_size}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {list(ranks)!r}: a rank is listed twice")
    return sorted(ranks)


class NodePlan:
    """The shares of a node's lanes (every rank in ``ranks``, every worker) merged in one order.

    Args:
        sizes: the catalog (item sizes in bytes, or :class:`~cachepipe.catalog.Item` objects).
        ranks: the ranks this node serves (distinct, each below ``world_size``).
        world_size: ranks in the whole job.
        num_workers: DataLoader workers per rank (1: no workers).
        epochs, shuffle, seed, balance, partition, equal_steps: as for :class:`~cachepipe.plan.Plan`.

    Raises:
        ValueError: a bad argument, named with its value and what is accepted.
    """

    def __init__(
        self,
        sizes: Sequence[int] | Sequence[Item],
        *,
        ranks: Sequence[int],
        world_size: int,
        num_workers: int = 1,
        epochs: int | None = 1,
        shuffle: bool = False,
        seed: int = 0,
        balance: Literal["bytes", "count"] = "bytes",
        partition: Literal["epoch", "fixed"] = "epoch",
        equal_steps: Literal["pad", "drop"] | None = None,
    ) -> None:
        self.ranks = check_ranks(ranks, world_size)
        self.world_size, self.num_workers = world_size, num_workers
        first = Plan(
            sizes,
            epochs=epochs,
            shuffle=shuffle,
            seed=seed,
            rank=self.ranks[0],
            world_size=world_size,
            worker=0,
            num_workers=num_workers,
            balance=balance,
            partition=partition,
            equal_steps=equal_steps,
        )
        self.sizes = first.sizes
        self.lanes = [Lane(rank, worker) for rank in self.ranks for worker in range(num_workers)]
        self.plans = [first] + [
            Plan(
                self.sizes,
                epochs=epochs,
                shuffle=shuffle,
                seed=seed,
                rank=lane.rank,
                world_size=world_size,
                worker=lane.worker,
                num_workers=num_workers,
                balance=balance,
                partition=partition,
                equal_steps=equal_steps,
            )
            for lane in self.lanes[1:]
        ]
        self.n_items, self.epochs = first.n_items, epochs
        self._merged: OrderedDict[int, tuple[array[int], list[array[int]]]] = OrderedDict()
        self._lock = threading.Lock()  # guards _merged: lanes read it while the planner computes an epoch
        self._computing = threading.Lock()  # one epoch computed at a time
        self._lane_of: array[int] | None = None  # partition="fixed": each item's lane here, or -1
        self._more_lanes: dict[int, list[int]] = {}  # partition="fixed", "pad": an item's further lanes here

    def __repr__(self) -> str:
        return f"NodePlan({self.n_items} items, ranks={self.ranks} of {self.world_size}, num_workers={self.num_workers})"

    def lane(self, rank: int, worker: int) -> int:
        """The index of lane ``(rank, worker)`` in :attr:`lanes`.

        Raises:
            ValueError: this node does not serve that rank, or the worker is out of range.
        """
        if rank not in self.ranks:
            raise ValueError(f"rank {rank!r}: this node serves ranks {self.ranks} of world_size {self.world_size}")
        if isinstance(worker, bool) or not isinstance(worker, int) or not 0 <= worker < self.num_workers:
            raise ValueError(f"worker {worker!r}: expected 0 <= worker < num_workers = {self.num_workers}")
        return self.ranks.index(rank) * self.num_workers + worker

    def done(self, epoch: int) -> bool:
        """True when ``epoch`` is past the last epoch of a finite plan."""
        return self.epochs is not None and epoch >= self.epochs

    def share(self, epoch: int) -> array[int]:
        """Catalog indices the node reads in ``epoch``: the lanes' shares interleaved by ``(index, lane)``."""
        return self._merge(epoch)[0]

    def lane_share(self, lane: int, epoch: int) -> array[int]:
        """Lane ``lane``'s share of ``epoch`` (computed with every lane's, in one pass)."""
        self._merge(epoch)
        return self.plans[lane].share(epoch)

    def prepare(self, *epochs: int, pause: Callable[[], None] | None = None) -> None:
        """Compute the shares of ``epochs`` (those before the end) for every lane at once, so
        that the lanes' own plans find them (their ``normalise`` and ``after`` read them).
        ``pause``: called every few hundred items of the computation (a thread computing in the
        background lets the interpreter's lock go: see :func:`~cachepipe.plan.permutation`)."""
        for epoch in epochs:
            if not self.done(epoch):
                self._merge(epoch, pause)

    def positions(self, epoch: int) -> list[array[int]]:
        """For each lane, the merged index (in :meth:`share`) of each of its steps in ``epoch``."""
        return self._merge(epoch)[1]

    def tick(self, lane: int, epoch: int, index: int) -> int:
        """The node's tick of step ``index`` of ``lane`` in ``epoch``."""
        return plan_tick(epoch, self.positions(epoch)[lane][index])

    def prepared(self, epoch: int) -> bool:
        """True if ``epoch``'s shares are computed (or ``epoch`` is past the end): reading them
        takes no time."""
        with self._lock:
            return self.done(epoch) or epoch in self._merged

    def _merge(self, epoch: int, pause: Callable[[], None] | None = None) -> tuple[array[int], list[array[int]]]:
        with self._lock:
            got = self._merged.get(epoch)
            if got is not None:
                self._merged.move_to_end(epoch)
                return got
        with self._computing:  # one epoch at a time; a second caller of it waits for the first
            with self._lock:
                got = self._merged.get(epoch)
            if got is None:
                got = self._compute(epoch, pause)
                with self._lock:
                    self._merged[epoch] = got
                    if len(self._merged) > EPOCHS_CACHED:
                        self._merged.popitem(last=False)
            return got

    def _compute(self, epoch: int, pause: Callable[[], None] | None) -> tuple[array[int], list[array[int]]]:
        """``epoch``'s merged share and each lane's positions in it (about 2 s per million
        catalog items on the 2-core VM: :meth:`prepare` it outside the locks that lanes wait on)."""
        shares = self._lane_shares(epoch, pause)
        for plan, share in zip(self.plans, shares, strict=True):
            plan.prime(epoch, share)
        return interleave(shares)

    def _lane_shares(self, epoch: int, pause: Callable[[], None] | None = None) -> list[array[int]]:
        """Every lane's share of ``epoch``, in one pass over the epoch (what each lane's
        :meth:`Plan.share` computes, without a walk of the whole catalog per lane)."""
        first = self.plans[0]
        order = first.order(epoch, pause)
        if first.partition == "fixed" and self.world_size * self.num_workers > 1:
            if self._lane_of is None:
                base = permutation(self.n_items, first.seed, -1) if first.shuffle else order
                self._lane_of = self._deal(base)
            lane_of, more = self._lane_of, self._more_lanes
            out: list[array[int]] = [array("I") for _ in self.lanes]
            keep = [a.append for a in out]
            for start in range(0, len(order), RUN):
                for x in order[start : start + RUN]:
                    lane = lane_of[x]
                    if lane >= 0:
                        keep[lane](x)
                        if more and x in more:  # "pad": an item given twice (read twice in a row by one lane)
                            for other in more[x]:
                                keep[other](x)
                if pause is not None:
                    pause()
            return out
        return self._split(order, pause)

    def _split(self, order: Sequence[int], pause: Callable[[], None] | None = None) -> list[array[int]]:
        """Every lane's part of ``order``, a whole epoch's, as :meth:`Plan.share` splits it."""
        plan = self.plans[0]
        if plan.equal_steps is None:
            by_rank = split_all(order, self.sizes, self.world_size, plan.balance, pause)
            return [
                share
                for rank in self.ranks
                for share in split_all(by_rank[rank], self.sizes, self.num_workers, plan.balance, pause)
            ]
        if self.world_size > 1:
            by_rank = deal(equalise(order, self.world_size, plan.equal_steps), self.sizes, self.world_size, plan.balance, pause)
        else:
            by_rank = [array("I", order)]
        return [share for rank in self.ranks for share in deal(by_rank[rank], self.sizes, self.num_workers, plan.balance, pause)]

    def _deal(self, base: array[int]) -> array[int]:
        """``partition="fixed"``: each item's lane on this node (-1: another node's), split
        once over ``base`` as :meth:`Plan.share` splits it; an item of several lanes here
        (``equal_steps="pad"``) has the others in :attr:`_more_lanes`, in lane order."""
        lane_of = array("i", [-1]) * self.n_items
        more: dict[int, list[int]] = {}
        for lane, share in enumerate(self._split(base)):
            for x in share:
                if lane_of[x] < 0:
                    lane_of[x] = lane
                else:
                    more.setdefault(x, []).append(lane)
        self._more_lanes = more
        return lane_of

    def config(self) -> dict[str, Any]:
        """The plan's configuration (what a resume or a second registration must match)."""
        plan = self.plans[0]
        return {
            "version": STATE_VERSION,
            "n_items": self.n_items,
            "sizes_digest": plan.sizes_digest(),
            "epochs": self.epochs,
            "shuffle": plan.shuffle,
            "seed": plan.seed,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "num_workers": self.num_workers,
            "balance": plan.balance,
            "partition": plan.partition,
            **({} if plan.equal_steps is None else {"equal_steps": plan.equal_steps}),
        }


def interleave(shares: Sequence[array[int]]) -> tuple[array[int], list[array[int]]]:
    """The shares merged by ``(index, lane)`` (the first item of every share, then the second of
    every share long enough, ...), and each share's positions in the result. By bands of
    indices that the same shares reach, each copied by strided slices (no loop per item)."""
    merged: array[int] = array("I", bytes(4 * sum(len(s) for s in shares)))
    positions: list[array[int]] = [array("I") for _ in shares]
    start = filled = 0
    for end in sorted({len(s) for s in shares}):
        if end == start:
            continue  # empty shares
        active = [k for k, s in enumerate(shares) if len(s) >= end]
        width, band = len(active), end - start
        for offset, k in enumerate(active):
            first = filled + offset
            merged[first : filled + width * band : width] = shares[k][start:end]
            positions[k].extend(range(first, filled + width * band, width))
        start, filled = end, filled + width * band
    return merged, positions


class LaneSchedule:
    """Where each lane of a :class:`NodePlan` is, and which step the node fetches next.

    Every lane starts at ``(0, 0)`` (normalised: an empty first share is skipped).
    """

    def __init__(self, plan: NodePlan) -> None:
        self.plan = plan
        plan.prepare(0, 1)
        self.cursors = [p.normalise(Cursor(0, 0)) for p in plan.plans]
        self.generations = [0] * len(plan.lanes)
        self.latest = max(cursor.epoch for cursor in self.cursors)
        """The latest epoch a lane's next step to plan has been in: the epochs after it are
        prepared (:meth:`NodePlan.prepare`) before a lane enters them, outside any lock."""

    def done(self, lane: int, cursor: Cursor | None = None) -> bool:
        """True if ``lane`` has no step at or after ``cursor`` (default: its position)."""
        return self.plan.done((self.cursors[lane] if cursor is None else cursor).epoch)

    def all_done(self) -> bool:
        """True when every lane is past the end of a finite plan."""
        return all(self.plan.done(cursor.epoch) for cursor in self.cursors)

    def next(
        self, load: Sequence[int] | None = None, hold: Callable[[int, int], bool] = lambda _lane, _item: False
    ) -> LaneStep | None:
        """The next step to plan; that lane moves past it. None: every lane is at its end, or
        ``hold(lane, item)`` is true of every lane's next step.

        The lane is the one with the least ``load`` (its steps planned and not yet consumed;
        default: none), then the earliest ``(epoch, index)``, then the lowest number. So lanes
        are served as fast as they consume: a DataLoader takes one sample from each worker in
        turn and DDP ranks step together, by count, so a lane whose shares are shorter runs
        epochs ahead of the others, and an order by epoch alone would wait for it. A lane whose
        next step (of catalog index ``item``) is held back is passed over (the node holds back a
        lane that is far enough ahead over items already on disk).
        """
        best: tuple[int, int, int, int] | None = None
        for lane, cursor in enumerate(self.cursors):
            if self.plan.done(cursor.epoch):
                continue
            key = (0 if load is None else load[lane], cursor.epoch, cursor.index, lane)
            if best is not None and key >= best:
                continue
            if hold(lane, self.plan.lane_share(lane, cursor.epoch)[cursor.index]):
                continue
            best = key
        if best is None:
            return None
        _, epoch, index, lane = best
        plan = self.plan.plans[lane]
        step = Step(epoch, index, self.plan.lane_share(lane, epoch)[index])
        self.plan.prepare(epoch + 1)  # prepared already if the caller kept up with latest
        cursor = self.cursors[lane] = plan.after(step)
        self.latest = max(self.latest, cursor.epoch)
        return LaneStep(lane, self.generations[lane], step, self.plan.tick(lane, epoch, index))

    def normalise(self, lane: int, cursor: Cursor | tuple[int, int]) -> Cursor:
        """``cursor`` as the position of ``lane``'s next step (see :meth:`Plan.normalise`).

        Raises:
            ValueError: not a position of this lane's plan.
        """
        self._prepare_for(lane, cursor[0], cursor[1])
        return self.plan.plans[lane].normalise(cursor)

    def after(self, lane: int, step: Step | Cursor | tuple[int, ...]) -> Cursor:
        """The position that follows ``step`` of ``lane``."""
        self._prepare_for(lane, step[0], step[1] + 1)
        return self.plan.plans[lane].after(step)

    def _prepare_for(self, lane: int, epoch: Any, index: Any) -> None:
        """Compute (for every lane at once) the shares that ``lane``'s plan reads to normalise
        ``(epoch, index)``: that epoch's, and the next ones' only while the position is the end
        of a share (an epoch being prepared in the background is not waited for before it is
        needed). A malformed position is left to the plan to refuse."""
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in (epoch, index)):
            return
        while not self.plan.done(epoch):
            self.plan.prepare(epoch)
            if index != len(self.plan.lane_share(lane, epoch)):
                return
            epoch, index = epoch + 1, 0

    def reset(self, lane: int, cursor: Cursor | tuple[int, int]) -> int:
        """Move ``lane`` to ``cursor`` (its next step to plan); returns its new generation.

        Raises:
            ValueError: not a position of this lane's plan.
        """
        self.cursors[lane] = self.normalise(lane, cursor)
        self.latest = max(self.latest, self.cursors[lane].epoch)
        self.generations[lane] += 1
        return self.generations[lane]
