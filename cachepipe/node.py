"""``NodePipeline``: one cache for every consumer of a job on a node, each served its own share.

A per-process :class:`~cachepipe.Pipeline` reads one share of the plan (a rank, a DataLoader
worker) into a cache of its own. A node pipeline reads the shares of all the node's consumers
(its *lanes*: every worker of every rank the node runs, see :mod:`cachepipe.lanes`) into one
cache under the node's capacity, downloads them in one merged order with one pool of
connections, and hands each lane exactly the items of its share in its order: the items a
per-process pipeline with the same ``rank``/``worker`` would give it.

A consumer names its position. :meth:`NodePipeline.take` ``(rank, worker, cursor)`` returns the
item at ``cursor`` of that lane (``(epoch, index)``, index counting the lane's steps), and
consumes every earlier step of the lane: a position is a cumulative acknowledgement, so a
consumer that restarts from its own saved position (a checkpoint) gets exactly the items from
there on, whatever the node had handed out before. A position before what the node still holds
for the lane, or past what it planned, moves the lane there: what the lane held is kept on disk
for the steps that reach it again (without retention) or acknowledged, and planning restarts at
the new position (:meth:`~cachepipe.lanes.LaneSchedule.reset`). A lane has one consumer at a
time: a consumer that waits while another moves the lane elsewhere (a DataLoader resumed beside
an earlier one that still reads) gets :class:`~cachepipe.errors.LaneConflictError`.

The consumer's position is the resume state; the node's journal is not (a node pipeline always
opens with ``resume=False``: published items that match the catalog are reused when a lane's
plan reaches them, nothing is skipped on the node's word).

The fetch order serves the lane with the fewest steps planned and not consumed (see
:meth:`~cachepipe.lanes.LaneSchedule.next`), so lanes are fetched for as fast as they consume;
a lane that waits for a step not planned yet goes first, and a download that the fetcher has
not begun, waiting for its room, is given back unbegun for it (see
:meth:`~cachepipe.lanequeues.LaneQueues.withdraw`); so is one for another lane when a lane
consumes or moves, before the room it frees goes to it: the schedule chooses again by the loads
after the move. Steps of one item that are planned at once (lanes an epoch apart) share its one
copy on disk (see :class:`~cachepipe.lanequeues.LaneQueues`, the bookkeeping of the lanes'
steps): no lane waits for another to move on. A lane that waits for an item with no room gets
the room of items fetched ahead for lanes that are not waiting (see
:meth:`~cachepipe.lanequeues.LaneQueues.give_back`): a lane that stops asking (a rank waiting
for another in an all-reduce) never holds the room of the lane it waits for. It gets it once it
has waited ``give_back_after`` (a shorter wait is ordinary back-pressure), or at once from lanes
that have not asked since a lane restarted elsewhere (a job restarted from its checkpoints, its
ranks back one after the other). What consumers hold (handed out, not consumed) cannot be given
back: size the node's capacity for what the lanes hold at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .broker import Closed, Failed
from .cache import Cache
from .catalog import Item, Names
from .config import Share
from .errors import LaneConflictError
from .fetcher import Planned
from .lanequeues import LaneQueues
from .lanes import LaneSchedule, NodePlan
from .lanesteps import _MovedAway, _Planned
from .passes import _charges, _reserve
from .pipeline import CachedItem, Pipeline, Skipped
from .plan import Cursor
from .retention import NEVER, PlanFuture, is_placeholder, make_policy
from .stores import Store

__all__ = ["NodePipeline", "SkippedStep", "Taken"]

log = logging.getLogger("cachepipe.node")


ROOM_CHECK = 1.0
"""Seconds a lane waits for its item between checks that a download has room (see
:meth:`NodePipeline.take`)."""

GIVE_BACK_AFTER = 5.0
"""The default of :class:`NodePipeline`'s ``give_back_after``: seconds a lane waits for its item
before items planned ahead for other lanes are given back to make room for it. Shorter waits are
ordinary back-pressure: a lane that computes for a while per item consumes soon, and giving its
next item back would download it again (two lanes taking 0.5 s and 3 s per item, with room for
two items, downloaded 1.21x the data and took 49 s instead of 38 s when lanes gave back after
1 s). Items planned ahead for lanes that have not asked since a lane of the node restarted
elsewhere are given back at the first check (see :meth:`NodePipeline._wait`)."""

HELD_WARNING = 30.0
"""Seconds a lane waits, with no room made for it, before the node logs that its consumers hold
the whole cache."""


def _has(positions: Sequence[int], index: int) -> bool:
    """Whether ``index`` is in ``positions`` (ascending)."""
    at = bisect_left(positions, index)
    return at < len(positions) and positions[at] == index


@dataclass(frozen=True)
class Taken:
    """An item handed to a lane: ``item`` (its files stay until the lane moves past ``cursor``)
    and ``cursor``, its position in the lane's share (the next position is ``after``)."""

    item: CachedItem
    cursor: Cursor
    after: Cursor


@dataclass(frozen=True)
class SkippedStep:
    """A lane's step whose item was skipped (``on_error``/``on_oversize="skip"``), as
    :meth:`NodePipeline.take` reports it when asked to (``report_skips``): the item's name, why,
    its position in the lane's share and the next position."""

    name: str
    reason: str
    cursor: Cursor
    after: Cursor


class NodePipeline(Pipeline):
    """Stream ``source`` through one cache at ``cache_dir`` for every lane of a node.

    Args:
        source: dataset URL (as for :class:`~cachepipe.Pipeline`).
        cache_dir: the node's cache directory.
        capacity: the node's capacity, for all its lanes (as for :class:`~cachepipe.Pipeline`).
        store: a store to use instead of opening ``source``.
        ranks: the ranks this node serves (each a rank of ``world_size``).
        world_size: ranks in the whole job.
        num_workers: DataLoader workers per rank (default 1: each rank is one lane).
        give_back_after: seconds a lane waits for an item with no room before items planned
            ahead for lanes that are not asking are given back to make room for it (default
            :data:`GIVE_BACK_AFTER`, 5 s; shorter waits are ordinary back-pressure; checked
            every :data:`ROOM_CHECK` seconds, so 0 gives back at the first check). Items
            planned ahead for lanes that have not asked since a lane restarted elsewhere are
            given back at the first check, whatever its value.
        **options: other :class:`~cachepipe.config.PipelineConfig` options (``epochs``,
            ``shuffle``, ``seed``, ``partition``, ``balance``, ``equal_steps``, ``manifest``, ``retain``...);
            ``rank``, ``worker``, ``resume``, ``start_epoch`` and ``auto_ack`` do not apply (a
            lane starts where its consumer's :meth:`take` asks), nor ``prefetch`` (refused).

    Raises:
        ValueError: a bad option, ``ranks`` not a set of ranks of ``world_size``, or
            ``give_back_after`` not a number of seconds >= 0.
    """

    def __init__(
        self,
        source: str,
        cache_dir: str | os.PathLike[str],
        capacity: int | str | Share,
        *,
        ranks: Sequence[int],
        world_size: int,
        num_workers: int = 1,
        store: Store | None = None,
        give_back_after: float = GIVE_BACK_AFTER,
        **options: Any,
    ) -> None:
        if (
            isinstance(give_back_after, bool)
            or not isinstance(give_back_after, (int, float))
            or not 0 <= give_back_after < float("inf")
        ):
            raise ValueError(
                f"give_back_after={give_back_after!r}: expected seconds, a finite number >= 0 (default {GIVE_BACK_AFTER})"
            )
        for key in ("rank", "worker", "resume", "auto_ack", "lease_timeout", "ordered"):
            if key in options:
                raise ValueError(f"{key}={options[key]!r}: a node pipeline's lanes are given by ranks and num_workers")
        if options.get("prefetch") is not None:
            raise ValueError(
                f"prefetch={options['prefetch']!r}: a node's lanes run ahead within their share of the capacity; "
                "a count of items ahead of all lanes together would hold a lane behind items of a lane that is not asking"
            )
        if options.get("start_epoch"):
            raise ValueError(f"start_epoch={options['start_epoch']!r}: a node lane starts where its consumer's take() asks")
        super().__init__(source, cache_dir, capacity, store=store, world_size=world_size, num_workers=num_workers, **options)
        self.ranks, self.world_size, self.num_workers = list(ranks), world_size, num_workers
        NodePlan([], ranks=self.ranks, world_size=world_size, num_workers=num_workers)  # checks them now
        self._moves = threading.Lock()  # one lane move at a time (journal position, eviction order)
        self._contended_lanes: set[tuple[int, int]] = set()  # lanes found with two consumers (logged once each)
        self.give_back_after = float(give_back_after)

    def __repr__(self) -> str:
        return f"NodePipeline({self.config.source!r}, ranks={self.ranks} of {self.world_size}, state={self._state})"

    def _streams(self, cache: Cache) -> bool:
        return False

    def _shares_catalog(self) -> bool:
        """Whether ranks on other nodes plan over this catalog too."""
        return len(self.ranks) < self.world_size

    def _catalog(self, store: Store, cache: Cache) -> Iterator[list[Planned]]:
        cfg = self.config
        self._future = None
        catalog, sizes, eligible, _ = self._fitting(store, cache)
        plan = NodePlan(
            sizes,
            ranks=self.ranks,
            world_size=self.world_size,
            num_workers=self.num_workers,
            epochs=cfg.epochs,
            shuffle=cfg.shuffle,
            seed=cfg.seed,
            balance=cfg.balance,
            partition=cfg.partition,
            equal_steps=cfg.equal_steps,
        )
        cache.recover(catalog, resume=False, reusable=not cfg.prepares)  # as a pipeline's (see _Pass._catalog)
        self._check_limit(catalog, eligible, cache)
        self.node_plan = plan
        future = PlanFuture(plan, horizon=2) if cfg.retain == "auto" else None
        self._future = future  # the acks' next reads (see _next_reads)

        def prepare(epoch: int) -> None:  # in the background once a lane enters epoch: see LaneQueues
            plan.prepare(epoch + 2, pause=queues.pause)  # queues.pause: stops when the queues close
            if future is not None:
                future.prepare(epoch, pause=queues.pause)  # the next uses of epoch's items, in the two epochs after it

        queues = LaneQueues(LaneSchedule(plan), self._stale, self._shared, prepare, cache.wake)
        self._broker = queues
        self._queues = queues
        self._catalog_items, self._eligible_items = catalog, eligible
        if future is not None:
            charges = _charges(catalog, eligible, cache.block)
            policy = make_policy("auto", charges, future, reserve=_reserve(cache, cfg, charges))
            cache.use_retention(policy, Names(catalog, eligible), 0)
        self._total_steps = None
        return queues.steps(self._item)

    def _item(self, i: int) -> Item:
        return self._catalog_items[i if self._eligible_items is None else self._eligible_items[i]]

    # ---- lanes -----------------------------------------------------------------------
    def take(
        self,
        rank: int,
        worker: int = 0,
        cursor: Cursor | tuple[int, int] = (0, 0),
        timeout: float | None = None,
        report_skips: bool = False,
    ) -> Taken | SkippedStep | None:
        """The item at ``cursor`` of lane ``(rank, worker)``, once it is on disk; every earlier
        step of the lane is consumed (its item acknowledged). None: the lane's share ends
        before ``cursor``.

        Failed items are skipped (``on_error="skip"``) or raised (``"raise"``, as often as
        the lane asks for that position), like :meth:`Pipeline.get`. ``report_skips``: a
        skipped item is returned as a :class:`SkippedStep` in its turn (as
        :meth:`Pipeline.get_or_skipped`), not passed over: the lane then asks for its ``after``.

        Raises:
            ValueError: not a lane of this node, or not a position of its plan.
            TimeoutError: nothing became ready within ``timeout`` seconds.
            LaneConflictError: another consumer of the lane moved it while this one waited.
            ItemFailedError, OversizeError: the item at ``cursor`` failed (``on_error="raise"``).
            CacheRemovedError: the cache directory was removed (see :meth:`check_cache`).
            RuntimeError: the pipeline is not open.
        """
        self._require_open()
        self._check_cache_due()
        queues = self._queues
        lane = self.node_plan.lane(rank, worker)
        at = queues.schedule.normalise(lane, cursor)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._move(lane, at)
            try:
                planned = self._wait(lane, at, timeout, deadline)
            except Closed:
                raise RuntimeError(f"{self!r} is closed") from None
            except _MovedAway as moved:
                raise self._conflict(rank, worker, at, moved.floor) from None
            if planned is None:
                return None
            value = planned.value
            if isinstance(value, Failed):
                self.check_cache()  # failed because the cache directory is gone?
                self._skip_or_raise(value)
                after = queues.schedule.after(lane, planned.step)
                if report_skips:
                    return SkippedStep(value.name, value.reason, at, after)
                at = after
                continue
            if value is None:  # wait() returns only steps on disk or failed
                raise RuntimeError(f"lane {rank}.{worker}: step {at} handed out before it was on disk")
            self._count("handed")
            after = queues.schedule.after(lane, planned.step)
            return Taken(CachedItem._of(value, planned.kept, f"{rank}.{worker}@{at.epoch}.{at.index}"), at, after)  # noqa: SLF001 - from what the node kept

    def take_many(
        self,
        rank: int,
        worker: int = 0,
        cursor: Cursor | tuple[int, int] = (0, 0),
        count: int = 1,
        max_bytes: int | None = None,
        timeout: float | None = None,
        report_skips: bool = False,
    ) -> list[Taken] | list[SkippedStep]:
        """:meth:`take` the item at ``cursor``, then as many of the lane's next items as are on
        disk already (no waiting for them), up to ``count`` items and ``max_bytes`` bytes in all
        (the first is always included). Empty: the lane's share ends before ``cursor``. One call
        (one request to the daemon) for several small items. ``report_skips``: a skipped item
        at ``cursor`` is returned alone, as a :class:`SkippedStep` (see :meth:`take`).

        Raises:
            ValueError: ``count`` below 1, or as :meth:`take`.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count {count!r}: expected an integer >= 1")
        first = self.take(rank, worker, cursor, timeout, report_skips)
        if first is None:
            return []
        if isinstance(first, SkippedStep):
            return [first]
        got, size = [first], first.item.size
        lane, queues = self.node_plan.lane(rank, worker), self._queues
        while len(got) < count:
            at = got[-1].after
            if queues.schedule.done(lane, at):
                break
            planned = queues.ready(lane, at, None if max_bytes is None else max_bytes - size)
            if planned is None:
                break
            self._count("handed")
            size += planned.size
            value = planned.value
            if value is None or isinstance(value, Failed):  # ready() returns only items on disk
                raise TypeError(f"lane {rank}.{worker}: step {at} handed out before it was on disk")
            item = CachedItem._of(value, planned.kept, f"{rank}.{worker}@{at.epoch}.{at.index}")  # noqa: SLF001 - as in take
            got.append(Taken(item, at, queues.schedule.after(lane, planned.step)))
        return got

    def consume(self, rank: int, worker: int = 0, cursor: Cursor | tuple[int, int] = (0, 0)) -> None:
        """Lane ``(rank, worker)`` is done with every step before ``cursor``: acknowledge them now
        (a consumer that read its item calls it before its next :meth:`take`, so that the space is
        free while it works).

        Raises:
            ValueError: not a lane of this node, or not a position of its plan.
            RuntimeError: the pipeline is not open.
        """
        self._require_open()
        lane = self.node_plan.lane(rank, worker)
        self._move(lane, self._queues.schedule.normalise(lane, cursor))

    def lanes_done(self) -> int:
        """How many of the node's lanes have consumed their whole share: each step of every
        epoch (always 0 for a plan without end, ``epochs=None``). Once the pipeline has opened."""
        queues = self._queues
        return sum(queues.schedule.done(lane, floor) for lane, floor in enumerate(queues.floors()))

    def _conflict(self, rank: int, worker: int, at: Cursor, floor: Cursor) -> LaneConflictError:
        """The error for the consumer of lane ``(rank, worker)`` that waited for ``at`` while
        another moved the lane to ``floor``; logged once per lane. It does not move the lane back:
        each move consumes the steps before it, so two consumers would consume (delete) each
        other's items, and a request left waiting by a consumer that went away (a killed
        DataLoader worker) would take the lane from the one after it."""
        with self._counts_lock:
            first = (rank, worker) not in self._contended_lanes
            self._contended_lanes.add((rank, worker))
        message = (
            f"lane {rank}.{worker}: another consumer moved the lane to {tuple(floor)} while this one waited for "
            f"{tuple(at)}; a lane (a rank's DataLoader worker of one job) has one consumer at a time: is an earlier "
            "DataLoader of this job still reading, beside one that resumed it?"
        )
        if first:
            log.warning("%s (refused; logged once per lane)", message)
        return LaneConflictError(message)

    def _wait(self, lane: int, at: Cursor, timeout: float | None, deadline: float | None) -> _Planned | None:
        """:meth:`LaneQueues.wait` in turns of :data:`ROOM_CHECK` seconds; after each, if a
        download has no room (:meth:`Cache.shortfall`) and the lane's step waits for that room
        (not planned yet, or its download not begun), steps planned ahead for lanes whose
        consumers are not waiting are given back (:meth:`LaneQueues.give_back`) and their copies
        given up (:meth:`Cache.give_up`): those of lanes that have not asked since a lane moved
        outside what was planned for it at once (``unasked_only``), the others once the lane
        has waited ``give_back_after`` seconds (see the class). A lane that moves so has a
        consumer restarted elsewhere, and the others may have too: in a job restarted from its
        checkpoints, the lanes not back yet hold what was fetched ahead for positions their
        consumers will move away from, and the lanes back already, waiting at their first
        all-reduce for the last rank, what they read ahead (before, each rank back waited for
        the give-back, and every first step with it). If nothing can be given back once the
        lane has waited ``give_back_after``, every item in the cache is held by a consumer:
        after :data:`HELD_WARNING` seconds this is logged, once per wait. A step that downloads
        already gives nothing back (room would not bring it sooner; each turn gave back an item
        that was then downloaded again). ``deadline``: the monotonic time at which it raises
        TimeoutError (None: never); ``timeout``, the seconds it names."""
        queues, start = self._queues, time.monotonic()
        rank, worker = self.node_plan.lanes[lane]
        warned = False
        while True:
            turn = ROOM_CHECK if deadline is None else max(0.0, min(ROOM_CHECK, deadline - time.monotonic()))
            try:
                return queues.wait(lane, at, turn)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no item became ready within {timeout} s") from None
            grace = time.monotonic() - start < self.give_back_after  # ordinary back-pressure: a slower lane consumes soon
            needed = self._cache.shortfall()
            if not needed:
                continue
            with self._moves:
                # in the grace, only from lanes not back since a restart; freed counted as the ledger counts it
                gone = queues.give_back(needed, lane, at, unasked_only=grace, charge=self._charge)
                for planned in gone or ():
                    self._cache.give_up(planned.name, planned.step.epoch, planned.tick)
            if gone is None:
                continue  # its item downloads (or is ready): room would not bring it sooner
            if gone:
                log.info(
                    "lane %s.%s waits for room: gave back %d items planned ahead for other lanes%s",
                    rank,
                    worker,
                    len(gone),
                    " (that have not asked since a lane restarted)" if grace else "",
                )
                continue
            if grace:
                continue
            self._cache.force_room()  # with retention: evict retained items, however soon they are used
            if not warned and time.monotonic() - start >= HELD_WARNING:
                warned = True
                log.warning(
                    "lane %s.%s has waited %.0f s for its item at %s: the node's cache (capacity %s) has no room "
                    "for the next download, and every item in it is held by a consumer that has not consumed it; "
                    "a consumer that holds its item while it waits for another (DDP ranks step together) needs a "
                    "capacity of an item per lane at least: raise the capacity, or consume each item once read "
                    "(the PyTorch adapter does with a transform)",
                    rank,
                    worker,
                    time.monotonic() - start,
                    tuple(at),
                    self._cache.capacity,
                )

    def _charge(self, planned: _Planned) -> int:
        """The room that ``planned`` 's copy frees once given up, as the ledger counts it, for
        :meth:`LaneQueues.give_back` (whose ``needed`` is the ledger's shortfall): its files in
        whole blocks and its folders, without what ``prepare`` or ``unpack`` added (so never
        above what it frees: at worst one more item is given back). No lock of the cache."""
        return self._cache.charge(self._item(planned.step.item))

    def _move(self, lane: int, cursor: Cursor) -> None:
        with self._moves:
            consumed, stale, acked = self._queues.move(lane, cursor)
            if consumed:  # one journal write for the lot
                acks = [(planned.name, planned.step.epoch, planned.tick) for planned in consumed]
                self._cache.evict_many(acks, self._next_reads(consumed))
            if acked:
                with self._counts_lock:
                    self._counts["acked"] += acked
            for planned, after in zip(stale, self._next_reads(stale), strict=True):
                self._cache.shelve(planned.name, planned.step.epoch, planned.tick, after)
            self._advance()

    def _next_reads(self, copies: Sequence[_Planned]) -> list[int | None]:
        """With retention, for each copy about to be acknowledged, the tick after which its item
        is next read (see :meth:`Cache.evict_many`): just before the first of its steps that the
        lane reading it has not consumed (the lanes' floors now), from the earliest floor on;
        None without retention. The copy's pin says the next use after the latest step that
        shared it (:meth:`_shared`), and a lane that moved back over such a step (its consumer
        restarted) reads the copy there again: deleted as read for the last time, it was
        downloaded twice, with room for every item."""
        future = self._future
        if future is None or not copies:
            return [None] * len(copies)
        plan, schedule = self.node_plan, self._queues.schedule
        floors = [
            NEVER if schedule.done(lane, c) else plan.tick(lane, c.epoch, c.index) for lane, c in enumerate(self._queues.floors())
        ]
        start = min(floors)  # NEVER: every lane is at its end, and nothing is read after NEVER - 1
        got: list[int | None] = []
        for planned in copies:
            after, item = start - 1, planned.step.item
            while True:
                read = future.next_use(item, after)
                if read == NEVER or is_placeholder(read):
                    break
                index, positions = read & 0xFFFFFFFF, plan.positions(read >> 32)
                if not any(floor > read and _has(positions[lane], index) for lane, floor in enumerate(floors)):
                    after = read - 1  # its lane has not consumed it: the next read
                    break
                after = read  # consumed: look on
            got.append(after)
        return got

    def _shared(self, planned: _Planned) -> None:
        """A step planned to share a copy on disk or downloading: its retention pin now lasts
        until the latest of them (the policy's next use of the item is after it)."""
        self._cache.reach(planned.name, planned.tick)

    def _stale(self, planned: _Planned) -> None:
        """An item on disk that its lane moved away from: keep it for the step that reaches it
        again (no retention), or acknowledge it (retention decides whether to keep it)."""
        if isinstance(planned.value, Failed) or planned.value is None:
            return
        self._cache.shelve(planned.name, planned.step.epoch, planned.tick, self._next_reads([planned])[0])

    def _advance(self) -> None:
        """Journal the node's position: the earliest of the lanes' first unconsumed steps."""
        plan, queues = self.node_plan, self._queues
        ticks = [plan.tick(lane, c.epoch, c.index) for lane, c in enumerate(queues.floors()) if not queues.schedule.done(lane, c)]
        if ticks:
            low = min(ticks)
            self._cache.advance(low >> 32, low & 0xFFFFFFFF)

    # ---- what a node pipeline does not do -------------------------------------------
    def get(self, timeout: float | None = None) -> CachedItem | None:
        raise TypeError(f"{self!r} hands items to lanes: use take(rank, worker, cursor)")

    def __iter__(self) -> Iterator[CachedItem]:
        raise TypeError(f"{self!r} hands items to lanes: use take(rank, worker, cursor)")

    def get_many(self, count: int, timeout: float | None = None) -> list[CachedItem]:
        raise TypeError(f"{self!r} hands items to lanes: use take_many(rank, worker, cursor, count)")

    def get_or_skipped(self, timeout: float | None = None) -> CachedItem | Skipped | None:
        raise TypeError(f"{self!r} hands items to lanes: use take(rank, worker, cursor, report_skips=True)")

    def ack(self, path: str | os.PathLike[str], lease: str | None = None) -> None:
        raise TypeError(f"{self!r}: a lane acknowledges by moving on, take(rank, worker, cursor) or consume()")

    release = renew = ack

    def ack_many(self, items: Iterable[Any]) -> None:
        raise TypeError(f"{self!r}: a lane acknowledges by moving on, take(rank, worker, cursor) or consume()")

    def state_dict(self) -> dict[str, Any]:
        raise TypeError(f"{self!r}: each lane's consumer keeps its own position (the cursor it passes to take)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise TypeError(f"{self!r}: each lane's consumer keeps its own position (the cursor it passes to take)")
