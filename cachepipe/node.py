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
not begun, waiting for its room, is given back unbegun for it (see :meth:`LaneQueues.withdraw`);
so is one for another lane when a lane consumes or moves, before the room it frees goes to it:
the schedule chooses again by the loads after the move.
Steps of one item that are planned at once (lanes an epoch apart) share its one copy on disk
(see :class:`LaneQueues`): no lane waits for another to move on. A lane that waits for an item
with no room gets the room of items fetched ahead for lanes that are not waiting (see
:meth:`LaneQueues.give_back`): a lane that stops asking (a rank waiting for another in an
all-reduce) never holds the room of the lane it waits for. What consumers hold (handed out,
not consumed) cannot be given back: size the node's capacity for what the lanes hold at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from .broker import Broker, Closed, Failed, FailureKind
from .cache import Cache
from .catalog import Item, Names
from .config import Share
from .errors import LaneConflictError
from .fetcher import Planned
from .lanes import LaneSchedule, NodePlan
from .pipeline import CachedItem, Pipeline, Skipped, _Held, _held
from .plan import Cursor, Step
from .retention import PlanFuture, make_policy
from .stores import Store

__all__ = ["NodePipeline", "SkippedStep", "Taken"]

log = logging.getLogger("cachepipe.node")


def let_others_run() -> None:
    """Let the interpreter's lock go to a thread that waits for it, if any (a computation in
    the background calls it every few hundred items: without it, each thread that let the
    lock go for a moment, as every download and hand-out does, waited up to the switch
    interval, 5 ms, to get it back, and the lanes stalled: benchmarks/bench_node_epochs.py)."""
    time.sleep(0)


class _PreparingStopped(Exception):
    """Raised by :meth:`LaneQueues.pause` in the plan-ahead thread once the queues are closed."""


class _MovedAway(Exception):
    """Raised by :meth:`LaneQueues.wait` when another consumer of the lane moved it away from
    the position waited for (two consumers read one lane)."""

    def __init__(self, floor: Cursor) -> None:
        super().__init__(floor)
        self.floor = floor


SHARED_RUN = 256
"""Most steps that share a copy the planner plans in one hold of the queues' lock."""

ROOM_CHECK = 1.0
"""Seconds a lane waits for its item between checks that a download has room (see
:meth:`NodePipeline.take`)."""

GIVE_BACK_AFTER = 5.0
"""The default of :class:`NodePipeline`'s ``give_back_after``: seconds a lane waits for its item
before items planned ahead for other lanes are given back to make room for it. Shorter waits are
ordinary back-pressure: a lane that computes for a while per item consumes soon, and giving its
next item back would download it again (two lanes taking 0.5 s and 3 s per item, with room for
two items, downloaded 1.21x the data and took 49 s instead of 38 s when lanes gave back after
1 s)."""

HELD_WARNING = 30.0
"""Seconds a lane waits, with no room made for it, before the node logs that its consumers hold
the whole cache."""


@dataclass(slots=True, eq=False)
class _Planned:
    """A step of a lane, from planning until the lane consumes it.

    The step that downloads an item also keeps the record of that one copy of it (``got``,
    ``holders``), which later steps of the item share while it is held (see
    :class:`LaneQueues`). One object per step: the node may hold millions.
    """

    seq: int  # the download's turn; -1: the step shares the copy of ``source``
    lane: int
    generation: int
    step: Step
    tick: int
    kept: _Held  # what a hand-out needs of the item (not the Item: the collector stops tracking it)
    source: _Planned | None = None  # the step whose copy this one shares; None: its own download
    got: str | Failed | None = None  # the copy's: None while downloading; its path once on disk, or its failure
    holders: int = 1  # the copy's: steps planned and not consumed that hold it
    handed: bool = False

    @property
    def copy(self) -> _Planned:
        """The step that keeps this step's copy (itself, unless it shares one)."""
        return self if self.source is None else self.source

    @property
    def value(self) -> str | Failed | None:
        """The item's path once on disk, or its failure; None while it downloads."""
        return self.copy.got

    @property
    def key(self) -> Cursor:
        return Cursor(self.step.epoch, self.step.index)

    @property
    def name(self) -> str:
        return self.kept[0]

    @property
    def size(self) -> int:
        return self.kept[1]


@dataclass(slots=True)
class _LaneState:
    generation: int = 0
    floor: Cursor = field(default_factory=lambda: Cursor(0, 0))  # every step of the lane before it is consumed
    held: dict[Cursor, _Planned] = field(default_factory=dict)  # planned in this generation, not consumed
    waiting: int = 0


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


class LaneQueues(Broker[str]):
    """The fetcher's hand-out for a node: each planned step belongs to one lane.

    Bookkeeping only, under one condition variable, like :class:`~cachepipe.broker.Broker`
    (whose producer side it implements). Items that arrive for a lane that moved on are given to
    ``on_stale`` (outside the lock); each step planned to share a copy to ``on_share``, under the
    lock (before a lane could take it and move past it), in the producer thread: it may take
    the cache's lock, never the other way round.

    An epoch's shares take about 2 s per million catalog items to compute (the 2-core VM), and
    planning waits for nothing else: computed when needed, under the lock or by the planner, they
    stopped every lane that long at each epoch. When a lane enters epoch ``e`` (the planner plans its
    first step), the shares of ``e + 1`` are ready (the planner computes them outside the lock if
    not), and ``prepare(e)`` (default: the shares of ``e + 2``) runs in a thread of its own while
    planning goes on, letting the interpreter's lock go every few hundred items (:meth:`pause`,
    which stops it once the queues are closed). :meth:`close` waits for that thread.

    A step whose item has a copy planned or on disk for another step (another lane's, or an
    earlier epoch of its own lane) shares that copy instead of downloading it again: the cache
    holds one copy of an item at a time, and a lane must never wait for another lane to move on
    (a DataLoader's main process waits for worker 1's batch while worker 0 holds the item worker
    1 needs next). The copy is deleted (or shelved) when its last step is consumed. A lane plans
    such shared steps only while it holds fewer than its fair share of the node's copies
    (copies / lanes; a lane that holds none is never held back), so the planner stops when the
    lanes are that far ahead over items already on disk; it plans at most
    :data:`SHARED_RUN` of them per hold of the lock. A step that shares a download that fails
    fails with it (the download failed its retries already); one planned after the failure
    downloads again.
    """

    def __init__(
        self,
        schedule: LaneSchedule,
        on_stale: Callable[[_Planned], None],
        on_share: Callable[[_Planned], None] = lambda _step: None,
        prepare: Callable[[int], None] | None = None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(ordered=True)
        self.schedule = schedule
        self._on_stale = on_stale
        self._on_share = on_share
        self._wake = wake
        self._prepare = prepare if prepare is not None else lambda epoch: schedule.plan.prepare(epoch + 2, pause=self.pause)
        self._preparing: threading.Thread | None = None  # the latest prepare() thread; under _cond
        self._lanes = [_LaneState(floor=c) for c in schedule.cursors]
        self._fetching: dict[int, _Planned] = {}  # download seq -> its step (the copy's), until it arrives
        self._copies: dict[int, _Planned] = {}  # catalog item -> the step with its copy, that a new step shares
        self._next_seq = 0
        self._started = 0  # downloads the fetcher began or withdrew (in turn: every seq below it)
        self._asking = -1  # the download asked back from the fetcher (see withdraw), or -1
        self._handed_count = 0
        self._error: BaseException | None = None

    # ---- planner side ----------------------------------------------------------------
    def steps(self, item_of: Callable[[int], Item]) -> Iterator[list[Planned]]:
        """The fetch order, run in the producer thread: the schedule's next step that needs a
        download (a run of one: the schedule picks each step by the lanes' load as it is then;
        steps that share a copy are planned on the way), waiting while every lane is at its end
        or as far ahead as it may run (until one moves, or the queues close). When a lane enters
        a new epoch, the next is made ready outside the lock and the one after it is prepared
        in the background (see the class notes)."""
        schedule, prepared = self.schedule, -1
        while True:
            latest = schedule.latest
            if latest > prepared:
                schedule.plan.prepare(latest + 1)  # ready already, unless an epoch took less than its preparation
                if not self._prepare_in_background(latest):
                    return  # closed
                prepared = latest
            shared = 0
            download: Planned | None = None
            with self._cond:
                while download is None and shared < SHARED_RUN and schedule.latest == prepared:
                    got = None if self._closed else self.schedule.next(self._load(), self._far_ahead)
                    if got is None:
                        if self._closed:
                            return
                        self._cond.wait()  # every lane at its end, or far ahead over copies on disk
                        continue
                    item = item_of(got.step.item)
                    copy = self._copies.get(got.step.item)
                    if copy is not None and isinstance(copy.got, Failed):
                        copy = None  # a failed item is tried again
                    planned = _Planned(-1, got.lane, got.generation, got.step, got.tick, _held(item), copy)
                    self._lanes[got.lane].held[planned.key] = planned
                    if copy is None:
                        planned.seq = self._next_seq
                        self._next_seq += 1
                        self._fetching[planned.seq] = self._copies[got.step.item] = planned
                        download = (planned.seq, item, planned.tick)
                        break
                    copy.holders += 1
                    self._on_share(planned)  # before any lane can take it and move past it
                    shared += 1
                    self._begun += 1  # a shared step counts as begun too (Broker.served: how many are ahead)
                    if copy.got is None:
                        self._pending += 1  # its copy is downloading
                    else:
                        self._fresh += 1
                        self._cond.notify_all()
            if download is not None:
                yield [download]

    def _prepare_in_background(self, epoch: int) -> bool:
        """Run ``prepare(epoch)`` in a thread (after the previous one ends); False if closed."""
        with self._cond:
            previous = self._preparing
        if previous is not None:
            previous.join()  # done long ago, unless an epoch took less than its preparation
        with self._cond:
            if self._closed:
                return False
            self._preparing = threading.Thread(target=self._run_prepare, args=(epoch,), name="cachepipe-plan-ahead", daemon=True)
            self._preparing.start()
        return True

    def pause(self) -> None:
        """The ``pause`` of a computation in the plan-ahead thread: :func:`let_others_run`, and
        once the queues are closed, stop it (raises): :meth:`close` waits for that thread, and an
        epoch's preparation takes seconds per million catalog items."""
        if self._closed:
            raise _PreparingStopped
        let_others_run()

    def _run_prepare(self, epoch: int) -> None:
        try:
            self._prepare(epoch)
        except _PreparingStopped:
            pass  # closed: nothing half-computed was kept (NodePlan and PlanFuture store an epoch once computed)
        except Exception:  # what failed here is computed again where it is needed, and raises there
            log.debug("preparing after epoch %d failed; computed again when needed", epoch, exc_info=True)

    def close(self) -> None:
        """:meth:`Broker.close`, then wait for the background preparation, if it runs."""
        super().close()
        with self._cond:
            preparing = self._preparing
        if preparing is not None:
            preparing.join()

    def _far_ahead(self, lane: int, item: int) -> bool:
        """True if the lane's next step (of catalog ``item``) would share a copy, and the lane
        already holds its fair share of the node's copies (planning it waits for the lane's
        consumer, which has steps to take)."""
        return item in self._copies and len(self._lanes[lane].held) * len(self._lanes) >= len(self._copies)

    def begin_many(self, count: int) -> int:
        """The fetcher began the next ``count`` downloads (in turn): their room is reserved."""
        with self._cond:
            self._started += count
            if self._asking < self._started:
                self._asking = -1  # begun before the fetcher saw it asked back
            self._begun += count
            self._pending += count
            return self._begun - count

    def withdrawn(self, seq: int) -> bool:
        """Whether a lane waiting for a step not planned yet asked for download ``seq`` back (the
        fetcher waits for its room; read without the lock, by the cache under its own)."""
        return self._asking == seq

    def withdraw(self, seq: int) -> None:
        """The fetcher gave download ``seq`` back without beginning it (nothing was reserved or
        dropped for it): it is unplanned, and its lane, if it still holds it, moves back to it and
        plans it again (as :meth:`give_back` does, before any download). The planner plans the
        waiting lane's step next (see :meth:`_load`)."""
        with self._cond:
            planned = self._fetching.pop(seq)
            self._started += 1
            self._asking = -1
            lane = self._lanes[planned.lane]
            if lane.held.get(planned.key) is planned:  # its lane's last planned step (the planner stopped at it)
                del lane.held[planned.key]
                lane.generation = self.schedule.reset(planned.lane, planned.key)
            planned.holders = 0
            if self._copies.get(planned.step.item) is planned:
                del self._copies[planned.step.item]
            self._cond.notify_all()

    def _ask_back(self, lane: _LaneState, moved: bool = False) -> None:
        """Under the lock, for ``lane`` waiting for a step not planned yet: ask the fetcher for the
        download it has not begun back (:meth:`withdrawn`; ``wake`` wakes it if it waits for
        room), if no waiting consumer needs it (its lane is not waiting, or moved away from it)
        and no other step shares its copy. Else the waiting lane's step would be planned only
        once that download has its room, which may come only from the waiting lane's own
        consumer, or after :data:`GIVE_BACK_AFTER`.

        ``moved``: ``lane`` has just consumed steps or moved away from them (:meth:`move`),
        whatever it has planned. The download was chosen by the lanes' loads from before the
        move, and would take at once the room the lane frees (or the items it shelves): unless
        it is ``lane``'s own step, it is asked back on the same terms, and the schedule chooses
        again (a lane beside one that holds its item and does not ask waited for the give-back
        at every step)."""
        seq = self._next_seq - 1
        if (lane.held and not moved) or seq < self._started or self._asking == seq:
            return  # its step is planned, every download planned has begun, or asked already
        planned = self._fetching.get(seq)
        if planned is None:
            return
        owner = self._lanes[planned.lane]
        held = owner.held.get(planned.key) is planned
        if planned.holders != held or (held and (owner.waiting or owner is lane)):
            return
        self._asking = seq
        self._wake()

    def put_many(self, ready: Sequence[tuple[int, str, str]]) -> None:
        self._arrive([(seq, value) for seq, _name, value in ready])

    def fail(self, seq: int, name: str, error: BaseException, begun: bool = True, kind: FailureKind = "item") -> None:
        if kind == "stream":  # planning stopped: every lane sees it
            with self._cond:
                self._error = error
                self._cond.notify_all()
            return
        self._arrive([(seq, Failed(seq, name, error, kind))])

    def _arrive(self, arrivals: Sequence[tuple[int, str | Failed]]) -> None:
        """Items (or failures) of planned steps are ready: one lock round, one wake-up."""
        stale: list[_Planned] = []
        with self._cond:
            for seq, value in arrivals:
                copy = self._fetching.pop(seq)
                copy.got = value
                held = self._lanes[copy.lane].held.get(copy.key) is copy
                self._pending -= 1 + copy.holders - held  # the download, and the shared steps that waited for it
                self._fresh += copy.holders
                if not copy.holders:  # every step of it moved on while it downloaded
                    if self._copies.get(copy.step.item) is copy:
                        del self._copies[copy.step.item]
                    stale.append(copy)
            self._cond.notify_all()  # stale ones too: fewer are ahead (a producer waits in wait_ahead_below)
        for planned in stale:
            self._on_stale(planned)

    def skip(self, seq: int) -> None:  # the node pipeline skips nothing on the journal's word
        raise NotImplementedError

    def starving(self) -> bool:
        return self._waiting > 0 and self._fresh == 0

    # ---- lane side -------------------------------------------------------------------
    def move(self, lane_no: int, cursor: Cursor) -> tuple[list[_Planned], list[_Planned], int]:
        """Lane ``lane_no`` asks for ``cursor`` (normalised): returns ``(consumed, stale,
        acked)``: the items on disk that the lane is done with (before ``cursor``) and those it
        no longer holds because it moved outside what was planned for it (see the module notes),
        each only if no other step holds its copy; and how many of its steps with an item on
        disk it consumed. A download of another lane that the fetcher has not begun is asked
        back first (:meth:`_ask_back`), before the caller frees the room or shelves the items."""
        with self._cond:
            lane = self._lanes[lane_no]
            if lane.floor <= cursor <= self.schedule.cursors[lane_no]:
                gone = [p for key, p in lane.held.items() if key < cursor]
                lane.floor = cursor
                moved = False
            else:
                gone = list(lane.held.values())
                lane.generation = self.schedule.reset(lane_no, cursor)
                lane.floor = self.schedule.cursors[lane_no]
                moved = True
            on_disk, acked = [], 0
            for planned in gone:
                del lane.held[planned.key]
                copy = planned.copy
                copy.holders -= 1
                if copy.got is None:
                    if planned.source is not None:
                        self._pending -= 1  # a shared step no longer waits for the download
                    continue  # the download arrives stale, if no step holds it then
                self._forget(planned)
                failed = isinstance(copy.got, Failed)
                acked += not failed
                if copy.holders:
                    continue  # another step holds the copy: it stays
                if self._copies.get(copy.step.item) is copy:
                    del self._copies[copy.step.item]
                if not failed:
                    on_disk.append(planned)
            if gone:
                self._ask_back(lane, moved=True)  # before the caller frees the room (evicts) or shelves items
            self._cond.notify_all()
        return ([], on_disk, 0) if moved else (on_disk, [], acked)

    def give_back(self, needed: int, lane_no: int, cursor: Cursor) -> list[_Planned] | None:
        """Make about ``needed`` bytes of room for a download that a waiting lane is held up
        behind: steps on disk that were planned ahead for lanes whose consumers are not waiting
        now, and not handed out, are unplanned, the one needed last first (the latest tick of a
        lane's last step). Their lanes plan them again (each lane moves back to such a step).
        Without this, a lane that stops asking (a DDP rank waiting for another rank) could hold
        the room that the lane it waits for needs, for ever.

        Lane ``lane_no`` waits for its step at ``cursor``: room helps it only if that step is
        not planned yet, or its download has not begun (it waits for room, or is queued behind
        the one that does). None: the step is on disk, failed, or downloading already; nothing
        is given back (room would not bring it sooner, and the items given back would be
        downloaded again).

        Returns the steps given back whose copy no other step holds (to delete); they add up to
        ``needed`` bytes or more, unless no more steps qualify."""
        gone: list[_Planned] = []
        freed = 0
        with self._cond:
            waited = self._lanes[lane_no].held.get(cursor)
            if waited is not None and (waited.value is not None or waited.copy.seq < self._started):
                return None
            while freed < needed:
                last: _Planned | None = None
                for lane in self._lanes:
                    if lane.waiting or not lane.held:
                        continue
                    step = lane.held[next(reversed(lane.held))]  # held in plan order: the lane's last
                    if not step.handed and isinstance(step.value, str) and (last is None or step.tick > last.tick):
                        last = step
                if last is None:
                    break
                lane = self._lanes[last.lane]
                del lane.held[last.key]
                lane.generation = self.schedule.reset(last.lane, last.key)
                self._forget(last)
                copy = last.copy
                copy.holders -= 1
                if not copy.holders:
                    if self._copies.get(copy.step.item) is copy:
                        del self._copies[copy.step.item]
                    gone.append(last)
                    freed += last.size
            self._cond.notify_all()  # the planner plans those steps again
        return gone

    def _load(self) -> list[int]:
        """Each lane's steps planned and not consumed; -1 for a lane that waits for a step not
        planned yet: the schedule plans it first."""
        return [-1 if lane.waiting and not lane.held else len(lane.held) for lane in self._lanes]

    def _forget(self, planned: _Planned) -> None:
        if planned.handed:
            self._handed_count -= 1
        else:
            self._fresh -= 1

    def wait(self, lane_no: int, cursor: Cursor, timeout: float | None) -> _Planned | None:
        """The planned step at ``cursor`` of the lane once it is on disk (or failed); None if the
        lane's plan ends before ``cursor``.

        Raises:
            TimeoutError: not ready within ``timeout`` seconds.
            Closed: the queues closed.
            _MovedAway: the lane is no longer at ``cursor`` (a lane waits at its first unconsumed
                step, where its consumer's take put it): another consumer of the lane moved it.
            BaseException: planning stopped (the error it stopped with).
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        lane = self._lanes[lane_no]
        with self._cond:
            try:
                while True:
                    if self._closed:
                        raise Closed
                    if self.schedule.done(lane_no, cursor):
                        return None
                    if cursor != lane.floor:  # another consumer of the lane moved it (see NodePipeline.take)
                        raise _MovedAway(lane.floor)
                    planned = lane.held.get(cursor)
                    if planned is not None and planned.value is not None:
                        if not planned.handed:
                            planned.handed = True
                            self._fresh -= 1
                            self._handed_count += 1
                            self._cond.notify_all()
                        return planned
                    if self._error is not None:
                        raise self._error
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"no item became ready within {timeout} s")
                    self._ask_back(lane)
                    lane.waiting += 1
                    self._waiting += 1
                    try:
                        self._cond.wait(remaining)
                    finally:
                        lane.waiting -= 1
                        self._waiting -= 1
            finally:
                self.wait_seconds += time.monotonic() - start

    def ready(self, lane_no: int, cursor: Cursor, room: int | None = None) -> _Planned | None:
        """The planned step at ``cursor`` of the lane if it is on disk now and its item is at
        most ``room`` bytes (None: any size), handed out by this call; else None: no waiting."""
        with self._cond:
            planned = self._lanes[lane_no].held.get(cursor)
            if planned is None or planned.value is None or isinstance(planned.value, Failed):
                return None
            if room is not None and planned.size > room:
                return None
            if not planned.handed:
                planned.handed = True
                self._fresh -= 1
                self._handed_count += 1
            return planned

    def floors(self) -> list[Cursor]:
        """Each lane's first unconsumed position."""
        with self._cond:
            return [lane.floor for lane in self._lanes]

    def counts(self) -> dict[str, int]:
        with self._cond:
            return {"ready": self._fresh, "handed": self._handed_count, "pending": self._pending}

    def leased(self) -> list[Any]:
        return []

    def take(self, timeout: float | None = None) -> Any:
        raise TypeError("a node pipeline hands items to lanes: use NodePipeline.take(rank, worker, cursor)")


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
            every :data:`ROOM_CHECK` seconds, so 0 gives back at the first check).
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
        cache.recover(catalog, resume=False)
        largest = self._check_limit(plan.sizes, catalog, eligible, cache)
        self.node_plan = plan
        future = PlanFuture(plan, horizon=2) if cfg.retain == "auto" else None

        def prepare(epoch: int) -> None:  # in the background once a lane enters epoch: see LaneQueues
            plan.prepare(epoch + 2, pause=queues.pause)  # queues.pause: stops when the queues close
            if future is not None:
                future.prepare(epoch, pause=queues.pause)  # the next uses of epoch's items, in the two epochs after it

        queues = LaneQueues(LaneSchedule(plan), self._stale, self._shared, prepare, cache.wake)
        self._broker = queues
        self._queues = queues
        self._catalog_items, self._eligible_items = catalog, eligible
        if future is not None:
            reserve = min(cache.limit // 4, max(2 * cfg.large_requests, 16) * largest)
            cache.use_retention(make_policy("auto", plan.sizes, future, reserve=reserve), Names(catalog, eligible), 0)
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
        """:meth:`LaneQueues.wait` in turns of :data:`ROOM_CHECK` seconds; after each, once the
        lane has waited ``give_back_after`` seconds (see the class), if a download has no room
        (:meth:`Cache.shortfall`) and the lane's step waits for that room (not planned yet, or
        its download not begun), steps planned ahead for lanes whose
        consumers are not waiting are given back (:meth:`LaneQueues.give_back`) and their copies
        given up (:meth:`Cache.give_up`). If none can be, every item in the cache is held by a
        consumer: after :data:`HELD_WARNING` seconds this is logged, once per wait. A step
        that downloads already gives nothing back (room would not bring it sooner; each turn
        gave back an item that was then downloaded again). ``deadline``: the monotonic time
        at which it raises TimeoutError (None: never); ``timeout``, the seconds it names."""
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
            if time.monotonic() - start < self.give_back_after:
                continue  # ordinary back-pressure: a slower lane consumes soon
            needed = self._cache.shortfall()
            if not needed:
                continue
            with self._moves:
                gone = queues.give_back(needed, lane, at)
                for planned in gone or ():
                    self._cache.give_up(planned.name, planned.step.epoch, planned.tick)
            if gone is None:
                continue  # its item downloads (or is ready): room would not bring it sooner
            if gone:
                log.info("lane %s.%s waits for room: gave back %d items planned ahead for other lanes", rank, worker, len(gone))
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

    def _move(self, lane: int, cursor: Cursor) -> None:
        with self._moves:
            consumed, stale, acked = self._queues.move(lane, cursor)
            if consumed:  # one journal write for the lot
                self._cache.evict_many([(planned.name, planned.step.epoch, planned.tick) for planned in consumed])
            if acked:
                with self._counts_lock:
                    self._counts["acked"] += acked
            for planned in stale:
                self._stale(planned)
            self._advance()

    def _shared(self, planned: _Planned) -> None:
        """A step planned to share a copy on disk or downloading: its retention pin now lasts
        until the latest of them (the policy's next use of the item is after it)."""
        self._cache.reach(planned.name, planned.tick)

    def _stale(self, planned: _Planned) -> None:
        """An item on disk that its lane moved away from: keep it for the step that reaches it
        again (no retention), or acknowledge it (retention decides whether to keep it)."""
        if isinstance(planned.value, Failed) or planned.value is None:
            return
        self._cache.shelve(planned.name, planned.step.epoch, planned.tick)

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
