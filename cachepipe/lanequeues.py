"""``LaneQueues``: a node's hand-out, the bookkeeping of every lane's planned steps.

The fetcher's side of a :class:`~cachepipe.node.NodePipeline` (a :class:`~cachepipe.broker.Broker`
to the fetcher): each planned step belongs to one lane (a DataLoader worker of a rank, see
:mod:`cachepipe.lanes`). The queues plan the node's downloads in the order that
:class:`~cachepipe.lanes.LaneSchedule` picks, let the steps of one item share its one copy, hand
a lane the step at its position once it is on disk, move a lane (consume the steps before a
position, or restart it elsewhere), give back the room of steps planned ahead for lanes that are
not asking, and ask a download not begun back for a lane that waits (see :class:`LaneQueues`).

Bookkeeping only, under one condition variable: what leaves a lane is returned to the node
pipeline, which does the cache's part (evict, shelve, give up) outside the queues' lock. The
records kept, one per planned step and one per lane, are in :mod:`cachepipe.lanesteps`.

Invariant: a step is held by its lane (``held``) from planning until the lane consumes it or
moves away from it, and the one copy of an item (``got``) lasts while a step holds it
(``holders``): no lane waits for another lane's consumer to move on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .broker import Broker, Closed, Failed, FailureKind
from .catalog import Item
from .delivered import _held
from .fetcher import Planned
from .lanes import LaneSchedule
from .lanesteps import _LaneState, _MovedAway, _Planned
from .plan import Cursor

__all__ = ["SHARED_RUN", "LaneQueues", "let_others_run"]

log = logging.getLogger("cachepipe.node")  # the node's logger, as before the queues had a module of their own


def let_others_run() -> None:
    """Let the interpreter's lock go to a thread that waits for it, if any (a computation in
    the background calls it every few hundred items: without it, each thread that let the
    lock go for a moment, as every download and hand-out does, waited up to the switch
    interval, 5 ms, to get it back, and the lanes stalled: benchmarks/bench_node_epochs.py)."""
    time.sleep(0)


class _PreparingStopped(Exception):
    """Raised by :meth:`LaneQueues.pause` in the plan-ahead thread once the queues are closed."""


SHARED_RUN = 256
"""Most steps that share a copy the planner plans in one hold of the queues' lock."""


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
        self._restarts = 0  # lanes moved outside what was planned for them (restarted consumers), see give_back
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
        room), if no waiting consumer needs it (its lane is not waiting for that step, or moved
        away from it) and no other step shares its copy. Else the waiting lane's step would be
        planned only once that download has its room, which may come only from the waiting
        lane's own consumer, or after :data:`~cachepipe.node.GIVE_BACK_AFTER`. A lane that
        waits for an earlier step (its download under way) does not need it yet: before, it kept
        it, and the room the other lane freed went to it; its consumer then held its item (a DDP
        rank until the other has taken the same step) while the other lane waited for the
        give-back (5 s; ``stress_node.py --mode hazard``, ``retain="auto"``).

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
        needed = owner.waiting and owner.floor == planned.key  # its consumer waits for it (a lane waits at its floor)
        if planned.holders != held or (held and (needed or owner is lane)):
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

    def patient(self, items: int) -> bool:
        """Never: the lanes take their steps without :meth:`Broker.take` (no :attr:`on_hand_out`
        to wake a download waiting for a run's room), so each download starts once it fits."""
        return False

    def outpaced(self) -> bool:
        """True: the lanes' pace is not followed (their takes are not :meth:`Broker.take`), so
        every item ahead counts when a part is cut, as before the pace was (see
        :func:`cachepipe.fetch_policy.items_ahead`)."""
        return True

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
                self._restarts += 1  # its consumer restarted: the others' may have too (see give_back)
            lane.asked = self._restarts
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

    def give_back(
        self,
        needed: int,
        lane_no: int,
        cursor: Cursor,
        unasked_only: bool = False,
        charge: Callable[[_Planned], int] | None = None,
    ) -> list[_Planned] | None:
        """Make about ``needed`` bytes of room for a download that a waiting lane is held up
        behind: steps on disk that were planned ahead for lanes whose consumers are not waiting
        now, and not handed out, are unplanned, the one needed last first (the latest tick of a
        lane's last step). Their lanes plan them again (each lane moves back to such a step).
        Without this, a lane that stops asking (a DDP rank waiting for another rank) could hold
        the room that the lane it waits for needs, for ever.

        ``unasked_only``: only from lanes that have not asked (moved) since a lane last moved
        outside what was planned for it (its consumer restarted elsewhere: a checkpoint, a
        resumed loader, a daemon that forgot the job). The caller gives back from those at once,
        from the others only once the lane has waited a while (ordinary back-pressure): when a
        whole job restarts, the lanes whose consumers are not back yet hold what was fetched
        ahead for positions their consumers will move away from.

        Lane ``lane_no`` waits for its step at ``cursor``: room helps it only if that step is
        not planned yet, or its download has not begun (it waits for room, or is queued behind
        the one that does). None: the step is on disk, failed, or downloading already; nothing
        is given back (room would not bring it sooner, and the items given back would be
        downloaded again).

        ``charge``: the room a step's copy frees once deleted, in the bytes of ``needed`` (the
        cache's ledger: :meth:`Cache.charge`, its files in whole blocks and its folders); by
        default its listed size. Called under this object's lock: it must not wait for the
        cache's. An estimate must not be above what the copy frees: too low gives back more
        than needed (a step downloaded again), too high too little (the lane waits a turn more).

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
                    if lane.waiting or not lane.held or (unasked_only and lane.asked == self._restarts):
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
                    freed += last.size if charge is None else charge(last)
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
                    if not self._fresh:
                        self._wake()  # starving() now: a download waiting for room looks again (see Cache.acquire)
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
