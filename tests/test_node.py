"""NodePipeline in-process over the moto server (and a local folder): one cache, every lane its exact plan share."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import pytest
from sampling import Sampler, block_of, charge
from waiting import wait_until

from cachepipe.broker import Closed
from cachepipe.catalog import Item
from cachepipe.lanes import LaneSchedule, NodePlan
from cachepipe.node import LaneQueues, NodePipeline
from cachepipe.plan import Cursor, Plan

KIB = 1024


def sizes_of(data: dict[str, dict[str, bytes]]) -> list[int]:
    return [sum(len(b) for b in files.values()) for _, files in sorted(data.items())]


def read_lane(pipe: NodePipeline, rank: int, worker: int, start=(0, 0), limit: int | None = None, out=None):
    """Consume a lane like a DataLoader worker: take, read every file, consume, move on."""
    cursor, got = Cursor(*start), []
    while limit is None or len(got) < limit:
        taken = pipe.take(rank, worker, cursor, timeout=30)
        if taken is None:
            break
        assert taken.cursor == cursor
        for rel in taken.item.files:
            assert (taken.item.path / rel).stat().st_size > 0
        got.append((taken.cursor.epoch, taken.item.name))
        cursor = taken.after
        pipe.consume(rank, worker, cursor)
    if out is not None:
        out[(rank, worker)] = got
    return got, cursor


def read_lanes(pipe: NodePipeline, lanes: list[tuple[int, int]], out: dict) -> None:
    """Read every lane at once, a thread each (the node's consumers run side by side)."""
    threads = [threading.Thread(target=read_lane, args=(pipe, r, k), kwargs={"out": out}) for r, k in lanes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def expected(names, sizes, rank, worker, world, workers, **kw):
    plan = Plan(sizes, rank=rank, world_size=world, worker=worker, num_workers=workers, **kw)
    return [(s.epoch, names[s.item]) for s in plan]


def state_of(source: str, tmp_path: Path, **options) -> int:
    """What a node's cache over ``source`` counts for its own state (``.cachepipe``: its files
    and the journal's budget, in whole blocks), measured on a cache opened beside the test's: a
    capacity sized in the items' charges holds this too. ``options``: ``storage_options``."""
    with NodePipeline(source, tmp_path / "state-probe", "4MiB", ranks=[0], world_size=1, **options) as probe:
        probe.take(0, 0, (0, 0), timeout=10)
        return probe._cache.ledger.overhead


def numbered_items(source: Path, count: int) -> list[str]:
    """``count`` items of 16 KiB in the folder ``source`` (``item000/a.bin``..., item i's bytes
    all i); their names."""
    names = [f"item{i:03d}" for i in range(count)]
    for i, name in enumerate(names):
        (source / name).mkdir(parents=True)
        (source / name / "a.bin").write_bytes(bytes([i]) * 16 * KIB)
    return names


def test_each_lane_gets_exactly_its_share_under_one_cap(s3_source, tmp_path):
    data = s3_source.folders(24, {"a.bin": 3 * KIB, "b.txt": 100})
    names, sizes = sorted(data), sizes_of(data)
    kw = {"epochs": 2, "shuffle": True, "seed": 7}
    capacity = 64 * KIB  # about 20 items of the 24 the node reads per epoch
    cache = tmp_path / "node"
    pipe = NodePipeline(
        s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, num_workers=2, storage_options=s3_source.options, **kw
    )
    out: dict = {}
    with Sampler(cache) as sampler, pipe:
        read_lanes(pipe, [(r, k) for r in (0, 1) for k in (0, 1)], out)
        stats = pipe.stats()
    assert sampler.samples > 0 and sampler.peak <= capacity
    for r in (0, 1):
        for k in (0, 1):
            assert out[(r, k)] == expected(names, sizes, r, k, 2, 2, **kw)
    for epoch in (0, 1):  # the node reads every item once per epoch
        assert sorted(n for lane in out.values() for e, n in lane if e == epoch) == names
    assert stats.items_handed == stats.items_acked == 48
    # no retention: an epoch downloads again what no lane still holds from the one before (a copy held is shared)
    assert sum(sizes) < stats.bytes_downloaded <= 2 * sum(sizes)


@pytest.mark.parametrize("smaller", [0, 1])
def test_nodes_whose_caches_fit_other_items_still_deal_every_item_to_one_rank(tmp_path, one_large_item, smaller):
    """Two nodes of one job with caches of different sizes (on_oversize="skip"): each node left
    the items over its own limit out of its plan, so the nodes dealt different lists, and items
    went to two ranks or to none. Now every node plans every item; an item over a node's limit
    is skipped in its rank's turn."""
    src, names = one_large_item
    got, skipped = [], 0
    for rank in (0, 1):
        capacity = 90_000 if rank == smaller else 100_000
        options = {"ranks": [rank], "world_size": 2, "balance": "count", "on_oversize": "skip"}
        with NodePipeline(src, tmp_path / f"node{rank}", capacity, **options) as pipe:
            cursor = Cursor(0, 0)
            while (taken := pipe.take(rank, 0, cursor, timeout=30)) is not None:  # passes over a skipped step
                got.append(taken.item.name)
                cursor = taken.after
                pipe.consume(rank, 0, cursor)
            skipped += pipe.stats().items_skipped
    assert sorted(got) == sorted(names if skipped == 0 else [n for n in names if n != "item2"])
    assert skipped in (0, 1)


def test_a_lane_restarting_from_an_earlier_position_gets_those_items_again(s3_source, tmp_path):
    data = s3_source.folders(16, {"a.bin": KIB})
    names, sizes = sorted(data), sizes_of(data)
    pipe = NodePipeline(s3_source.url, tmp_path / "node", "1MiB", ranks=[0], world_size=1, storage_options=s3_source.options)
    mine = expected(names, sizes, 0, 0, 1, 1)
    with pipe:
        first, _ = read_lane(pipe, 0, 0, limit=10)
        assert first == mine[:10]
        again, _ = read_lane(pipe, 0, 0, start=(0, 3))  # a checkpoint taken after 3 items
        assert again == mine[3:]
        skipped, _ = read_lane(pipe, 0, 0, start=(0, 14))  # a consumer ahead of the node
        assert skipped == mine[14:]
        assert pipe.take(0, 0, (1, 0)) is None  # past the end of a one-epoch share


def test_items_a_rewound_lane_left_on_disk_are_not_downloaded_again(s3_source, tmp_path):
    data = s3_source.folders(8, {"a.bin": 4 * KIB})
    names, sizes = sorted(data), sizes_of(data)
    pipe = NodePipeline(s3_source.url, tmp_path / "node", "1MiB", ranks=[0], world_size=1, storage_options=s3_source.options)
    with pipe:
        assert pipe.take(0, 0, (0, 0), timeout=30).item.name == names[0]
        deadline = time.monotonic() + 30
        while pipe.stats().bytes_downloaded < sum(sizes):  # the node fetches ahead: all 8 fit
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert pipe.take(0, 0, (0, 2), timeout=30).item.name == names[2]  # 0 and 1 consumed
        got, _ = read_lane(pipe, 0, 0, start=(0, 1))  # a restart one item back
        assert [n for _, n in got] == names[1:]
        stats = pipe.stats()
    # item 1 (consumed, then asked for again) is fetched twice; 2..7, on disk when the lane
    # moved back, are kept for it and handed out from disk
    assert stats.bytes_downloaded == sum(sizes) + sizes[1]
    assert stats.items_reused == 6


def test_node_local_shuffle_with_retention_downloads_the_node_share_once(s3_source, tmp_path):
    """partition="fixed" keeps each item on its lane, so a node cache that holds the node's share
    serves epochs 2 and 3 from disk (retention sees every lane of the node)."""
    data = s3_source.folders(24, {"a.bin": 2 * KIB})
    names, sizes = sorted(data), sizes_of(data)
    kw = {"epochs": 3, "shuffle": True, "seed": 3, "partition": "fixed", "retain": "auto"}
    # ranks 0 and 1 of a 4-rank job: the node reads half of the items, the same half every epoch
    pipe = NodePipeline(
        s3_source.url, tmp_path / "node", "256KiB", ranks=[0, 1], world_size=4, num_workers=2,
        storage_options=s3_source.options, **kw,
    )  # fmt: skip
    out: dict = {}
    with pipe:
        read_lanes(pipe, [(r, k) for r in (0, 1) for k in (0, 1)], out)
        stats = pipe.stats()
    plan_kw = {k: v for k, v in kw.items() if k != "retain"}
    node_items = set()
    for r in (0, 1):
        for k in (0, 1):
            assert out[(r, k)] == expected(names, sizes, r, k, 4, 2, **plan_kw)
            node_items |= {n for _, n in out[(r, k)]}
    assert stats.bytes_downloaded == sum(sizes[names.index(n)] for n in node_items)


def test_lane_and_option_errors_are_named(s3_source, tmp_path):
    s3_source.folders(2, {"a.bin": KIB})
    with pytest.raises(ValueError, match="rank=0: a node pipeline's lanes are given by ranks and num_workers"):
        NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, rank=0)
    with pytest.raises(ValueError, match=r"prefetch=2: a node's lanes run ahead within their share of the capacity"):
        NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, prefetch=2)
    with pytest.raises(ValueError, match=r"start_epoch=2: a node lane starts where its consumer's take\(\) asks"):
        NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, epochs=3, start_epoch=2)
    with pytest.raises(ValueError, match=r"rank 1 in ranks: expected an integer with 0 <= rank < world_size = 1"):
        NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[1], world_size=1)
    for bad in (-1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match=rf"give_back_after={bad!r}: expected seconds, a finite number >= 0 \(default 5.0\)"):
            NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, give_back_after=bad)
    assert NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1).give_back_after == 5.0
    pipe = NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, storage_options=s3_source.options)
    with pipe:
        with pytest.raises(ValueError, match=r"this node serves ranks \[0\] of world_size 1"):
            pipe.take(1, 0)
        with pytest.raises(ValueError, match=r"epoch 0 has 2 steps"):
            pipe.take(0, 0, (0, 3))
        with pytest.raises(TypeError, match="use take"):
            pipe.get()


def test_lanes_read_at_different_paces_in_epochs_do_not_stall(s3_source, tmp_path):
    """A DataLoader takes one sample from each worker in turn: a worker with a shorter share runs
    epochs ahead of the others, holding a ready item of its next epoch (the same item, with
    partition="fixed") while the others need theirs. The node must serve both."""
    data = s3_source.folders(3, {"a.bin": KIB})
    names, sizes = sorted(data), sizes_of(data)
    kw = {"epochs": 6, "shuffle": True, "seed": 2, "partition": "fixed"}
    pipe = NodePipeline(
        s3_source.url, tmp_path / "node", "1MiB", ranks=[0], world_size=1, num_workers=2,
        storage_options=s3_source.options, retain="auto", **kw,
    )  # fmt: skip
    cursors = {0: Cursor(0, 0), 1: Cursor(0, 0)}
    got: dict[int, list] = {0: [], 1: []}
    with pipe:
        done: set[int] = set()
        while len(done) < 2:
            for worker in (0, 1):  # round robin, as a DataLoader's main process
                if worker in done:
                    continue
                taken = pipe.take(0, worker, cursors[worker], timeout=20)
                if taken is None:
                    done.add(worker)
                    continue
                got[worker].append((taken.cursor.epoch, taken.item.name))
                cursors[worker] = taken.after
                pipe.consume(0, worker, taken.after)
    for worker in (0, 1):
        assert got[worker] == expected(names, sizes, 0, worker, 1, 2, **kw)
    assert len(got[0]) != len(got[1])  # uneven shares: the lanes' epochs drift apart


def test_take_many_hands_the_next_items_already_on_disk(s3_source, tmp_path):
    data = s3_source.folders(10, {"a.bin": KIB})
    names = sorted(data)
    pipe = NodePipeline(s3_source.url, tmp_path / "node", "1MiB", ranks=[0], world_size=1, storage_options=s3_source.options)
    with pipe:
        first = pipe.take(0, 0, (0, 0), timeout=30)
        deadline = time.monotonic() + 30
        while pipe.stats().items_ready < 9:  # the other nine are fetched ahead
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = pipe.take_many(0, 0, first.after, count=4)
        assert [t.item.name for t in got] == names[1:5] and [t.cursor for t in got] == [Cursor(0, i) for i in range(1, 5)]
        got = pipe.take_many(0, 0, got[-1].after, count=10, max_bytes=int(2.5 * KIB))  # two items of ~1 KiB fit
        assert [t.item.name for t in got] == names[5:7]
        got = pipe.take_many(0, 0, got[-1].after, count=10, max_bytes=1)  # the first item always comes
        assert [t.item.name for t in got] == names[7:8]
        assert pipe.take_many(0, 0, (1, 0)) == []
        with pytest.raises(ValueError, match="count 0: expected an integer >= 1"):
            pipe.take_many(0, 0, (0, 0), count=0)


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_a_lane_whose_next_item_another_lane_holds_shares_that_copy(s3_source, tmp_path, retain):
    """Worker 0 holds item X (taken, its batch not yet asked for by the DataLoader's main
    process), while worker 1 reaches X in its next epoch. Before, one copy of an item at a time:
    worker 1's step was passed over until worker 0 moved on, and worker 0 would not move before
    the main process had worker 1's batch, so the job hung (under the defaults, in 2 of 6 seeds of
    a 3-epoch run). Now worker 1 is handed the same copy, deleted when the last lane moves on.
    With retention too: X is not read again, so it is deleted (at first, its retention took the
    next use after worker 0's step, worker 1's step, already read: X was kept, never evictable)."""
    data = s3_source.folders(6, {"a.bin": KIB})
    names, sizes = sorted(data), sizes_of(data)
    kw = {"epochs": 2, "shuffle": True, "seed": 0}
    plan = NodePlan(sizes, ranks=[0], world_size=1, num_workers=2, **kw)
    first, second = list(plan.lane_share(0, 0)), list(plan.lane_share(1, 1))
    k, j = next((k, second.index(x)) for k, x in enumerate(first) if x in second)
    cache = tmp_path / "node"
    options = {"ranks": [0], "world_size": 1, "num_workers": 2, "storage_options": s3_source.options, "retain": retain}
    pipe = NodePipeline(s3_source.url, cache, "1MiB", **options, **kw)
    with Sampler(cache) as sampler, pipe:
        lane0, at = read_lane(pipe, 0, 0, limit=k)
        held = pipe.take(0, 0, at, timeout=20)  # worker 0 holds X
        assert held.item.name == names[first[k]]
        lane1, at = read_lane(pipe, 0, 1, limit=len(plan.lane_share(1, 0)) + j)
        assert at == Cursor(1, j)
        shared = pipe.take(0, 1, at, timeout=20)  # before: TimeoutError
        assert shared.item.name == held.item.name and shared.item.path == held.item.path
        assert (shared.item.path / "a.bin").read_bytes() == data[held.item.name]["a.bin"]
        pipe.consume(0, 1, shared.after)
        assert held.item.path.is_dir()  # worker 0 still holds it
        pipe.consume(0, 0, held.after)
        assert not held.item.path.exists()  # the last lane moved on: deleted (not read again)
        lane0 += [(0, held.item.name), *read_lane(pipe, 0, 0, held.after)[0]]
        lane1 += [(1, held.item.name), *read_lane(pipe, 0, 1, shared.after)[0]]
        stats = pipe.stats()
    assert sampler.samples > 0 and sampler.peak <= 1 << 20
    assert lane0 == expected(names, sizes, 0, 0, 1, 2, **kw) and lane1 == expected(names, sizes, 0, 1, 1, 2, **kw)
    assert stats.items_handed == stats.items_acked == 12
    assert stats.bytes_downloaded <= 2 * sum(sizes) - sizes[first[k]]  # X downloaded once for both epochs


def test_a_download_that_arrives_after_its_lane_moved_past_it_is_shelved_with_its_path():
    """Found in review: with a copy's record apart from its steps, a download that arrived after
    every step of it had moved on went to on_stale without its path, which shelved nothing: its
    space was lost until close, and the next step of the item waited for the name for ever."""

    plan = NodePlan([10, 20, 30], ranks=[0], world_size=1)
    stale: list = []
    queues = LaneQueues(LaneSchedule(plan), on_stale=stale.append)
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    downloads = [next(steps)[0], next(steps)[0]]
    queues.begin_many(2)
    assert queues.move(0, Cursor(0, 2)) == ([], [], 0)  # the lane moved past both while they downloaded
    queues.put_many([(seq, item.name, f"/cache/{item.name}") for seq, item, _tick in downloads])
    assert [(planned.name, planned.value) for planned in stale] == [("item0", "/cache/item0"), ("item1", "/cache/item1")]
    assert queues.outpaced()  # the lanes' pace is not followed: parts are cut for every item ahead
    queues.close()
    steps.close()


def test_a_shared_step_is_given_to_on_share_before_a_lane_can_take_it():
    """Found in review: steps that share a copy went to on_share (which moves the copy's
    retention past them) after the queues' lock was let go; a lane could take and pass the step
    first, and the copy was kept for a use already read. on_share now runs under the lock."""

    plan = NodePlan([10] * 4, ranks=[0], world_size=1, num_workers=2, epochs=2, shuffle=True, seed=0)
    x = plan.lane_share(1, 1)[0]
    assert x in plan.lane_share(0, 0)  # lane 1's first item of epoch 1 is one of lane 0's epoch 0
    seen: list = []
    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None)
    queues._on_share = lambda planned: seen.append((planned.step.item, planned.lane, queues._cond._is_owned()))
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    downloads = [next(steps)[0] for _ in range(4)]  # every lane's epoch 0
    queues.begin_many(4)
    queues.put_many([(seq, item.name, f"/cache/{item.name}") for seq, item, _tick in downloads])
    queues.move(1, Cursor(1, 0))  # lane 1 read its epoch 0; lane 0 still holds x
    planner = threading.Thread(target=next, args=(steps, None), daemon=True)
    planner.start()
    try:
        wait_until(lambda: seen, what="a shared step")
        assert seen[0] == (x, 1, True)  # lane 1's step of x, while the planner held the lock
        assert queues.wait(1, Cursor(1, 0), timeout=0).value == f"/cache/item{x}"
    finally:
        queues.close()
        planner.join(10)


def test_planning_shared_steps_stops_once_every_lane_holds_its_share_of_the_copies():
    """An endless plan over two items: after their two downloads, every step can share a copy on
    disk. The planner holds a lane back once it holds its fair share of the node's copies
    (copies / lanes), and waits. Without that bound, planning shared steps went on for ever
    under the queues' lock."""
    from cachepipe.catalog import Item

    plan = NodePlan([10, 20], ranks=[0], world_size=1, num_workers=2, epochs=None)
    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None)
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    downloads = [next(steps)[0], next(steps)[0]]
    assert sorted(item.name for _seq, item, _tick in downloads) == ["item0", "item1"]
    queues.begin_many(2)
    queues.put_many([(seq, item.name, f"/cache/{item.name}") for seq, item, _tick in downloads])
    planner = threading.Thread(target=next, args=(steps, None), daemon=True)  # daemon: if it spins, the test still ends
    planner.start()

    def load() -> list[int] | None:
        if not queues._cond.acquire(timeout=10):  # the queues' lock
            raise AssertionError("the planner keeps the queues' lock")
        try:
            return queues._load()  # the lanes' planned steps
        finally:
            queues._cond.release()

    try:
        time.sleep(0.1)  # the planner looks for a step to plan, and waits
        assert load() == [1, 1] and planner.is_alive()  # each holds its share (2 copies / 2 lanes)
    finally:
        if queues._cond.acquire(timeout=1):  # closing needs the lock
            queues._cond.release()
            queues.close()
            planner.join(timeout=10)


def _two_lanes_three_downloads():
    """The queues of a node of two lanes of 4 items of 10 bytes each (no disk, no cache), with
    the first three downloads planned: lane 0's first, lane 1's first, lane 0's second (a tie of
    the lanes' loads goes to lane 0). ``(queues, steps, woken, downloads, lanes)``: ``woken``
    gets an entry at each wake of the fetcher, ``lanes`` each lane's item names in order."""
    plan = NodePlan([10] * 8, ranks=[0, 1], world_size=2)
    woken: list[int] = []
    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None, wake=lambda: woken.append(1))
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    downloads = [next(steps)[0] for _ in range(3)]
    lanes = [[f"item{i}" for i in plan.lane_share(lane, 0)] for lane in (0, 1)]
    return queues, steps, woken, downloads, lanes


def test_a_lane_waiting_for_a_step_not_planned_asks_for_the_download_not_begun_back_and_goes_first():
    """The bookkeeping of a download given back before it begins (no disk): lane 1 waits for its
    second step while the fetcher waits for room for lane 0's second, planned ahead. The waiting
    lane asks for it back (the fetcher is woken); once the fetcher withdraws it, lane 1's step is
    the next download, then lane 0's again (its lane moved back to it)."""
    queues, steps, woken, downloads, lanes = _two_lanes_three_downloads()  # lane 0's first, lane 1's first, lane 0's second
    assert [item.name for _seq, item, _tick in downloads] == [lanes[0][0], lanes[1][0], lanes[0][1]]
    queues.begin_many(2)  # the third waits for room
    queues.put_many([(seq, item.name, f"/cache/{item.name}") for seq, item, _tick in downloads[:2]])
    assert queues.wait(1, Cursor(0, 0), timeout=0).name == lanes[1][0]
    queues.move(1, Cursor(0, 1))
    with pytest.raises(TimeoutError):
        queues.wait(1, Cursor(0, 1), timeout=0.05)  # lane 1's second is not planned
    third = downloads[2][0]
    assert woken and queues.withdrawn(third)
    queues.withdraw(third)
    assert not queues.withdrawn(third)
    assert [item.name for _seq, item, _tick in (next(steps)[0], next(steps)[0])] == [lanes[1][1], lanes[0][1]]
    queues.close()
    steps.close()


def test_a_lane_that_consumes_asks_for_the_download_of_a_lane_not_asking_back_before_it_frees_the_room():
    """The bookkeeping (no disk): lane 0 holds its first item (its consumer does not ask) and
    the fetcher waits for room for lane 0's second, planned at a tie of the lanes' loads. Lane 1
    consumes its first: its move asks for that download back, before the caller frees the
    room (the fetcher is woken), and once withdrawn, lane 1's second is the next download (its
    load is now the lower), then lane 0's again. Not for a download of the moving lane's own."""
    queues, steps, woken, downloads, lanes = _two_lanes_three_downloads()  # lane 0's first, lane 1's first, lane 0's second
    queues.begin_many(2)  # the third waits for room
    queues.put_many([(seq, item.name, f"/cache/{item.name}") for seq, item, _tick in downloads[:2]])
    for lane in (0, 1):
        assert queues.wait(lane, Cursor(0, 0), timeout=0).name == lanes[lane][0]
    third = downloads[2][0]
    consumed, _stale, _acked = queues.move(1, Cursor(0, 1))
    assert [p.name for p in consumed] == [lanes[1][0]]
    assert woken and queues.withdrawn(third)
    queues.withdraw(third)
    fourth = next(steps)[0]
    assert fourth[1].name == lanes[1][1]
    fifth = next(steps)[0]
    assert fifth[1].name == lanes[0][1]
    queues.begin_many(1)  # lane 1's second begins; lane 0's second waits for room again
    queues.put_many([(fourth[0], fourth[1].name, f"/cache/{fourth[1].name}")])
    woken.clear()
    queues.move(0, Cursor(0, 1))  # lane 0 consumes its first: the download waiting is its own
    assert not woken and not queues.withdrawn(fifth[0])
    queues.close()
    steps.close()


def test_a_lane_that_consumes_asks_back_the_download_of_a_lane_that_waits_for_an_earlier_step():
    """The bookkeeping (no disk): lane 0's consumer waits for its first item, which downloads;
    the fetcher waits for room for lane 0's second, planned at a tie of the lanes' loads. Lane
    1 consumes its first: lane 0's consumer does not need that download yet, so the move asks
    for it back, and lane 1's second is the next download. Before, a waiting lane kept every
    download of its own, and the room lane 1 freed went to lane 0's second; lane 0's consumer
    then held its first (a DDP rank until rank 1 has taken the same step) while lane 1 waited
    for the give-back (5 s; ``stress_node.py --mode hazard``, ``retain="auto"``)."""
    queues, steps, woken, downloads, lanes = _two_lanes_three_downloads()  # lane 0's first, lane 1's first, lane 0's second
    queues.begin_many(2)  # the third waits for room
    first, second, third = (seq for seq, _item, _tick in downloads)
    queues.put_many([(second, lanes[1][0], f"/cache/{lanes[1][0]}")])  # lane 0's first still downloads
    got: dict = {}

    def lane_0() -> None:
        with contextlib.suppress(Closed):
            got[0] = queues.wait(0, Cursor(0, 0), timeout=30)

    waiting = threading.Thread(target=lane_0)
    waiting.start()
    try:
        wait_until(lambda: queues._lanes[0].waiting, what="lane 0 waiting for its first")
        assert queues.wait(1, Cursor(0, 0), timeout=0).name == lanes[1][0]
        woken.clear()
        queues.move(1, Cursor(0, 1))
        assert woken and queues.withdrawn(third)  # before, not asked back: lane 0 was waiting
        queues.withdraw(third)
        assert next(steps)[0][1].name == lanes[1][1]
        queues.put_many([(first, lanes[0][0], f"/cache/{lanes[0][0]}")])
        waiting.join(30)
        assert got[0].name == lanes[0][0]
    finally:
        queues.close()
        waiting.join(30)
        steps.close()


@pytest.mark.parametrize(("retain", "give_back_after"), [("none", None), ("auto", 0.0)], ids=["none", "auto"])
def test_a_waiting_lane_gets_the_room_of_an_item_planned_ahead_for_a_lane_that_is_not_asking(
    s3_source, tmp_path, retain, give_back_after
):
    """Two ranks that step together, as DDP ranks without DataLoader workers: each holds the
    item it trains on until the other has its next. Room (beside the state) for an item of
    20 KiB, one of 60 KiB and two blocks, in what they take on the disk (their file and folder
    in whole blocks: 24 and 64 KiB on 4 KiB blocks): rank 0 holds its first item (20 KiB), and
    its second (20 KiB) was planned first (the lower lane, at a tie) and fetched while there was
    room. Rank 1's second item (60 KiB) has no room beside what rank 0, which waits for rank 1,
    holds, even once rank 1 consumes its first. Before, rank 1 waited
    for ever; now rank 0's second item, not handed out, is given back (deleted, or left to the
    retention policy, which then evicts it) and planned again. Without retention after the
    default wait (5 s), with retention at the first check (``give_back_after=0``): what is given
    back does not depend on when. (With items of one size, the room rank 1's consume frees is
    enough, and rank 0's download that waits for it is asked back unbegun instead: see
    ``test_a_lane_beside_a_rank_that_holds_its_item_gets_the_room_it_frees_at_each_step``.)"""
    sizes = [20, 20, 20, 60, 20, 20, 20, 20]  # balance="count": rank 0 the even items, rank 1 the odd
    for i, size in enumerate(sizes):
        s3_source.put(f"item{i:03d}/a.bin", bytes(size * KIB))
    names = [f"item{i:03d}" for i in range(len(sizes))]
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    room = charge(tmp_path, [20 * KIB], 1) + charge(tmp_path, [60 * KIB], 1) + 2 * block
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + room
    setting = {} if give_back_after is None else {"give_back_after": give_back_after}
    pipe = NodePipeline(
        s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, storage_options=s3_source.options, balance="count",
        shuffle=False, retain=retain, **setting,
    )  # fmt: skip
    with Sampler(cache, block=block) as sampler, pipe:
        first = [pipe.take(r, 0, (0, 0), timeout=10) for r in (0, 1)]
        wait_until(lambda: pipe.stats().bytes_downloaded == 60 * KIB and pipe._cache.shortfall())  # rank 1's second waits
        second = pipe.take(1, 0, first[1].after, timeout=30)  # consumes rank 1's first; given back after give_back_after
        assert second.cursor == first[1].after
        got = {r: [first[r].item.name] for r in (0, 1)}
        got[1].append(second.item.name)
        got[0] += [t.item.name for t in [pipe.take(0, 0, first[0].after, timeout=10)]]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert got == {0: names[0:4:2], 1: names[1:4:2]}
    assert stats.bytes_downloaded == (sum(sizes[:4]) + sizes[2]) * KIB  # rank 0's second item twice


def test_a_waiting_lane_is_given_back_what_its_download_lacks_in_the_ledger_s_bytes(s3_source, tmp_path, caplog):
    """The give-back counts what each item given back frees as the ledger counts it (its file
    and folder in whole blocks), not its listed size. Items of 20 KiB (24 KiB on the disk on
    4 KiB blocks), room for five beside the state: ranks 0 and 1 take their first, and the node
    fetches rank 0's second and third and rank 1's second. Rank 1 reads on to its third (68 KiB
    listed, 72 on the disk), which lacks one item's room beside what rank 0 holds (its first in
    hand, its second and third ahead). Rank 0's third, given back, frees exactly that. Before,
    the give-back counted its 20 KiB listed, not enough for 24 KiB lacking, and gave back rank
    0's second too: downloaded again for nothing."""
    import logging

    sizes = [20, 20, 20, 20, 20, 68, 20, 20]  # balance="count": rank 0 the even items, rank 1 the odd
    names, store = _gated_items(s3_source, sizes)
    cache = tmp_path / "node"
    block, item = block_of(tmp_path), charge(tmp_path, [20 * KIB], 1)
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + 5 * item
    pipe = NodePipeline(
        s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, store=store, balance="count", shuffle=False,
        give_back_after=0.0,
    )  # fmt: skip
    with Sampler(cache, block=block) as sampler, pipe, caplog.at_level(logging.INFO, logger="cachepipe.node"):
        first = [pipe.take(r, 0, (0, 0), timeout=10) for r in (0, 1)]
        wait_until(lambda: pipe.stats().bytes_downloaded == 5 * 20 * KIB and pipe._cache.shortfall())  # rank 1's third waits
        second = pipe.take(1, 0, first[1].after, timeout=10)
        third = pipe.take(1, 0, second.after, timeout=10)  # rank 1's second consumed: a 20 KiB item's room lacks
        gave = [r.getMessage() for r in caplog.records if "gave back" in r.getMessage()]
        got = {0: [first[0].item.name], 1: [t.item.name for t in (first[1], second, third)]}
        at = first[0].after
        for _ in range(2):
            taken = pipe.take(0, 0, at, timeout=10)
            got[0].append(taken.item.name)
            at = taken.after
    assert sampler.peak <= capacity
    assert got == {0: names[0:6:2], 1: names[1:6:2]}
    assert gave == ["lane 1.0 waits for room: gave back 1 items planned ahead for other lanes"], gave
    gets = {name: store.gets.get(f"{name}/a.bin", 0) for name in names[:6]}
    assert gets == {name: 2 if name == names[4] else 1 for name in names[:6]}, gets  # before, rank 0's second twice too


def test_a_lane_waiting_while_consumers_hold_the_whole_cache_is_logged(s3_source, tmp_path, monkeypatch, caplog):
    """Rank 0 holds its first item (30 KiB) while rank 1 waits for its second (60 KiB), with room
    (beside the state) for both but a block, in what they take on the disk (34 and 64 KiB on
    4 KiB blocks): no room can be made (what rank 0 holds is in its hand), so the capacity is too small for
    ranks that hold their items while they wait for each other. The node says so once the lane
    has waited ``HELD_WARNING`` seconds (made 0 here), naming the lane and the capacity; once
    rank 0 consumes, rank 1 gets its item."""
    import logging

    import cachepipe.node

    monkeypatch.setattr(cachepipe.node, "HELD_WARNING", 0.0)
    for i, size in enumerate([30, 30, 30, 60]):  # rank 0: items 0, 2; rank 1: items 1, 3
        s3_source.put(f"item{i:03d}/a.bin", bytes(size * KIB))
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    room = charge(tmp_path, [30 * KIB], 1) + charge(tmp_path, [60 * KIB], 1) - block  # two of 30 KiB, not three
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + room
    pipe = NodePipeline(
        s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, storage_options=s3_source.options, give_back_after=0.0
    )
    with Sampler(cache, block=block) as sampler, pipe:
        first = [pipe.take(r, 0, (0, 0), timeout=10) for r in (0, 1)]
        with caplog.at_level(logging.WARNING, logger="cachepipe.node"), pytest.raises(TimeoutError):
            pipe.take(1, 0, first[1].after, timeout=2.5)
        warned = [r.getMessage() for r in caplog.records if r.name == "cachepipe.node"]
        assert len(warned) == 1, warned
        assert "lane 1.0 has waited" in warned[0] and f"capacity {pipe.stats().capacity}" in warned[0]
        pipe.consume(0, 0, first[0].after)
        assert pipe.take(1, 0, first[1].after, timeout=10).item.name == "item003"
    assert sampler.peak <= capacity


class _Gated:
    """A store whose GET of ``key`` waits until ``gate`` is set (a download that takes long);
    counts the GETs of each key."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.url, self.key = inner, inner.url, key
        self.gate = threading.Event()
        self.gets: dict[str, int] = {}

    def list(self):
        return self.inner.list()

    def get(self, key, out, start, end, *, etag=None):
        self.gets[key] = self.gets.get(key, 0) + 1
        if key.startswith(self.key):
            assert self.gate.wait(30), "gate never opened"
        return self.inner.get(key, out, start, end, etag=etag)

    def close(self) -> None:
        self.inner.close()


def _gated_items(s3_source, sizes: list[int]) -> tuple[list[str], _Gated]:
    """Items ``item000``.. of one file of ``sizes[i]`` KiB each, their names, and a store over
    them that counts the GETs (its gate open)."""
    from cachepipe.stores import open_store

    for i, size in enumerate(sizes):
        s3_source.put(f"item{i:03d}/a.bin", bytes(size * KIB))
    store = _Gated(open_store(s3_source.url, s3_source.options), "no such key")
    store.gate.set()
    return [f"item{i:03d}" for i in range(len(sizes))], store


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_a_lane_whose_item_is_downloading_gives_nothing_back(s3_source, tmp_path, monkeypatch, retain):
    """Rank 0 waits for its second item, which downloads slowly (3 s); rank 1 reads its first
    item meanwhile (it holds it), and its second is on disk, planned ahead; the next download
    waits for room. Room would not bring rank 0's item any sooner: nothing is given back, and
    every item is downloaded once. Before, every ROOM_CHECK gave back the last item planned
    ahead (rank 1's, then rank 0's own third, then rank 1's again...): each downloaded again."""
    import cachepipe.node
    from cachepipe.stores import open_store

    monkeypatch.setattr(cachepipe.node, "ROOM_CHECK", 0.2)
    data = s3_source.folders(8, {"a.bin": 32 * KIB})
    names, sizes = sorted(data), sizes_of(data)
    lanes = [[n for _e, n in expected(names, sizes, r, 0, 2, 1)] for r in (0, 1)]
    store = _Gated(open_store(s3_source.url, s3_source.options), lanes[0][1])
    cache = tmp_path / "node"
    pipe = NodePipeline(  # give_back_after=0: the check of what the lane waits for, at once
        s3_source.url, cache, "144KiB", ranks=[0, 1], world_size=2, store=store, retain=retain, give_back_after=0.0
    )
    with Sampler(cache) as sampler, pipe:
        held = pipe.take(1, 0, (0, 0), timeout=10)  # rank 1 reads its first item
        first = pipe.take(0, 0, (0, 0), timeout=10)
        threading.Timer(3.0, store.gate.set).start()
        got = {0: [first.item.name], 1: [held.item.name]}
        got[0] += [n for _e, n in read_lane(pipe, 0, 0, first.after)[0]]
        got[1] += [n for _e, n in read_lane(pipe, 1, 0, held.after)[0]]
        stats = pipe.stats()
    assert sampler.peak <= 144 * KIB
    assert got == {0: lanes[0], 1: lanes[1]}
    assert stats.bytes_downloaded == 8 * 32 * KIB, store.gets


def test_a_lane_whose_item_is_downloading_logs_no_warning(s3_source, tmp_path, monkeypatch, caplog):
    """As the test of the warning, except that rank 1's second item is as small as the others:
    rank 0's second item (planned first, waiting for room) is asked back when rank 1 consumes
    its first (before that, it took the room and was given back for rank 1's), and rank 1's
    second downloads, slowly (2.5 s), while rank 0's second, planned again, waits for room that
    nothing can give. The cache is not full of items consumers hold: rank 1's item is on its
    way. No warning (before, it was logged while the download ran: every turn that gave
    nothing back counted, whatever the lane waited for)."""
    import logging

    import cachepipe.node
    from cachepipe.stores import open_store

    monkeypatch.setattr(cachepipe.node, "HELD_WARNING", 0.0)
    for i, size in enumerate([30, 30, 30, 30]):  # rank 0: items 0, 2; rank 1: items 1, 3
        s3_source.put(f"item{i:03d}/a.bin", bytes(size * KIB))
    store = _Gated(open_store(s3_source.url, s3_source.options), "item003")
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    room = 3 * charge(tmp_path, [30 * KIB], 1) - block  # two items (34 KiB each on 4 KiB blocks), not three
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + room
    pipe = NodePipeline(s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, store=store, give_back_after=0.0)
    with Sampler(cache, block=block) as sampler, pipe:
        first = [pipe.take(r, 0, (0, 0), timeout=10) for r in (0, 1)]
        with caplog.at_level(logging.WARNING, logger="cachepipe.node"):
            threading.Timer(2.5, store.gate.set).start()
            assert pipe.take(1, 0, first[1].after, timeout=10).item.name == "item003"
        warned = [r.getMessage() for r in caplog.records if r.name == "cachepipe.node"]
        assert not warned, warned
    assert sampler.peak <= capacity


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_a_restarted_lane_is_not_held_up_behind_a_download_planned_ahead_for_a_lane_that_is_not_asking(
    s3_source, tmp_path, caplog, retain
):
    """Rank 0 holds its first item (20 KiB) and stops asking (a DDP rank at its all-reduce);
    its second (20 KiB) is on disk, and its third (60 KiB) is the download the fetcher waits
    room for, with room (beside the state) for the three but two blocks, in what they take on
    the disk (24, 24 and 64 KiB on 4 KiB blocks): it cannot fit until rank 0 moves on. Rank 1 (10 KiB items) read two
    items and restarts from its first (a DataLoader worker restarted, or resumed from a
    checkpoint), which fits. Before, its step was planned only once rank 0's download had
    room: nothing could be given back for it (rank 0's last step was not on disk), so after
    GIVE_BACK_AFTER (5 s) the node dropped rank 1's own items, kept on disk for it, to make
    room for rank 0's, which still did not fit, and rank 1 waited until rank 0 moved on (in
    DDP, for ever). Now the fetcher gives that download back unbegun, and rank 1's step is
    planned first: it gets its item before rank 0's third is downloaded, with nothing given
    back or dropped. The timeout of the restarted take only bounds the hang it was."""
    import logging

    sizes = [20, 10, 20, 10, 60, 10, 20, 10, 20, 10]  # balance="count": rank 0 the even items, rank 1 the odd
    names, store = _gated_items(s3_source, sizes)
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    room = 2 * charge(tmp_path, [20 * KIB], 1) + charge(tmp_path, [60 * KIB], 1) - 2 * block
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + room
    pipe = NodePipeline(s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, balance="count", store=store, retain=retain)
    with Sampler(cache, block=block) as sampler, pipe, caplog.at_level(logging.INFO, logger="cachepipe"):
        held = pipe.take(0, 0, (0, 0), timeout=10)
        first, _ = read_lane(pipe, 1, 0, limit=2)
        wait_until(pipe._cache.shortfall, what="a download waiting for room")  # rank 0's third item
        assert store.gets.get("item004/a.bin", 0) == 0
        again = pipe.take(1, 0, (0, 0), timeout=20)
        assert again.item.name == names[1]
        assert store.gets.get("item004/a.bin", 0) == 0  # rank 0's third was not downloaded first
        assert not [r.getMessage() for r in caplog.records if r.name in ("cachepipe.node", "cachepipe.cache")]
        got = {1: [n for _e, n in first] + [again.item.name]}
        got[1] += [n for _e, n in read_lane(pipe, 1, 0, again.after)[0]]
        got[0] = [held.item.name] + [n for _e, n in read_lane(pipe, 0, 0, held.after)[0]]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert got == {0: names[0::2], 1: names[1::2][:2] + names[1::2]}
    if retain == "none":  # rank 1's first two twice (consumed, then asked for again); the rest once
        assert stats.bytes_downloaded == (sum(sizes) + sizes[1] + sizes[3]) * KIB, store.gets


def test_a_job_restarted_from_its_checkpoints_gets_the_room_of_lanes_that_have_not_asked_since(tmp_path, caplog):
    """A whole job restarted from its checkpoints while the node runs on (torchrun restarts
    every rank; the daemon stays), its ranks back one after the other. Before the restart,
    ranks 0 and 1 (16 KiB items, room beside the state for four and a half, in what they take on
    the disk: 20 KiB each on 4 KiB blocks) read three items each, and the node
    fetched ahead for both: the cache is full. Rank 0 is back first, from its checkpoint after
    one item: its lane moves back and its step there (consumed, deleted) has no room, which
    what was fetched ahead for rank 1, not back yet, holds. Rank 0 reads three items, to its
    first all-reduce, where it waits for rank 1; the node fetches ahead again. Rank 1 is back:
    its first step has no room, which what was fetched ahead for rank 0, waiting for it, holds.
    Before, each waited for the give-back (``give_back_after``: 5 s by default, 600 s here, so
    the take timed out), and in DDP every rank's first step with them. Now each restart (a lane
    moved outside what was planned for it) leaves the lanes that have not asked since out of
    the give-back's grace, which is for consumers that ask at their pace: each gets the room of
    the other's last item at the first check. Both then read their shares to the end from
    their checkpoints, under the cap. The take's timeout only bounds the stall it was."""
    import logging

    source = tmp_path / "source"
    names = numbered_items(source, 16)  # balance="count", no shuffle: rank 0 the even items, rank 1 the odd
    cache = tmp_path / "node"
    block, item = block_of(tmp_path), charge(tmp_path, [16 * KIB], 1)
    capacity = state_of(str(source), tmp_path) + 4 * item + item // 2
    pipe = NodePipeline(
        str(source), cache, capacity, ranks=[0, 1], world_size=2, balance="count", shuffle=False, give_back_after=600.0
    )

    def full(items: int) -> bool:  # that many downloads, and the next waits for room
        return pipe.stats().bytes_downloaded == items * 16 * KIB and bool(pipe._cache.shortfall())

    with Sampler(cache, block=block) as sampler, pipe, caplog.at_level(logging.INFO, logger="cachepipe.node"):
        for rank in (0, 1):  # the job before the restart
            read_lane(pipe, rank, 0, limit=3)
        wait_until(lambda: full(10), what="a full cache")  # six read, four ahead
        got = {0: [n for _e, n in read_lane(pipe, 0, 0, (0, 1), limit=3)[0]]}  # rank 0 is back (600 s each before)
        # its two read again, rank 1's item given back fetched again, one more ahead for rank 0
        wait_until(lambda: full(14), what="a full cache again")
        got[1] = [n for _e, n in read_lane(pipe, 1, 0, (0, 1), limit=1)[0]]  # rank 1 is back (600 s before)
        gave = [r.getMessage() for r in caplog.records if "gave back" in r.getMessage()]
        assert len(gave) == 2 and [m[:9] for m in gave] == ["lane 0.0 ", "lane 1.0 "], gave
        assert all(m.endswith("(that have not asked since a lane restarted)") for m in gave), gave
        got[0] += [n for _e, n in read_lane(pipe, 0, 0, (0, 4))[0]]
        got[1] += [n for _e, n in read_lane(pipe, 1, 0, (0, 2))[0]]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert got == {0: names[2::2], 1: names[3::2]}
    assert stats.items_acked == 6 + 14


def test_a_download_held_up_only_by_retained_items_whose_readers_wait_behind_it_evicts_them(tmp_path):
    """With retention, a lane's download waits for room that only items retained for other
    lanes hold, and nothing is pinned: no acknowledgement can free room, and the steps that
    would read those items cannot be planned before the download (the planner plans one at a
    time). Before, the policy kept them ("do no harm": their next reads come before the
    download's step in the plan's order) until the give-back forced room (``give_back_after``:
    5 s by default, 600 s here, so the take timed out): ``stress_node.py --mode tiny`` stalled
    so at 6 of seeds 0-29 (a take of 5-6 s, every lane waiting). Rank 0 (items of 16, 16 and
    32 KiB) waits for its third, which does not fit beside rank 1's second (16 KiB), held;
    rank 1 then moves back to its first step (a consumer restarted from its checkpoint), and
    its second is retained for its next read there. Now rank 0's item evicts it at once.
    Both lanes then read their shares to the end, under the cap. The take's timeout only
    bounds the stall it was."""
    source = tmp_path / "source"
    sizes = [16, 16, 16, 16, 32]  # balance="count", no shuffle: rank 0 items 0, 2, 4; rank 1 items 1, 3
    names = [f"item{i:03d}" for i in range(len(sizes))]
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        (source / name).mkdir(parents=True)
        (source / name / "a.bin").write_bytes(bytes([i]) * size * KIB)
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    room = charge(tmp_path, [16 * KIB], 1) + charge(tmp_path, [32 * KIB], 1) - block  # two small items, not a small and the large
    capacity = state_of(str(source), tmp_path) + room
    pipe = NodePipeline(
        str(source), cache, capacity, ranks=[0, 1], world_size=2, balance="count", shuffle=False, retain="auto",
        give_back_after=600.0,
    )  # fmt: skip
    got: dict = {}
    with Sampler(cache, block=block) as sampler, pipe:
        held = pipe.take(1, 0, pipe.take(1, 0, (0, 0), timeout=10).after, timeout=10)  # rank 1 holds its second item
        assert held.item.name == names[3]
        got[0], at = read_lane(pipe, 0, 0, limit=2)

        def rank_0() -> None:  # reads on from its third item
            try:
                got[0] += read_lane(pipe, 0, 0, at)[0]
            except TimeoutError as exc:
                got["timeout"] = exc

        waiting = threading.Thread(target=rank_0)
        waiting.start()
        wait_until(lambda: pipe._queues._lanes[0].waiting and pipe._cache.shortfall(), what="rank 0 waiting for room")
        pipe.consume(1, 0, (0, 0))  # rank 1 moves back: its second item is retained, for its next read
        waiting.join(40)  # rank 0's read ends with its item (600 s before, the take timed out at 30 s)
        assert not waiting.is_alive() and "timeout" not in got, got.get("timeout")
        got[1] = read_lane(pipe, 1, 0)[0]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert [n for _e, n in got[0]] == names[0::2]
    assert [n for _e, n in got[1]] == names[1::2]
    assert stats.items_acked == 3 + 1 + 2


def test_a_lane_moved_back_beside_a_rank_that_holds_its_item_drops_what_it_shelved_for_its_step(tmp_path):
    """Without retention, rank 0 holds its first item (32 KiB) until rank 1 has taken the same
    step (DDP ranks step together); rank 1 (8 KiB items) read its first item and holds its
    second when its consumer restarts from its first step (a checkpoint). The cache has room
    for an item of each rank: rank 1's second, shelved on disk for the step that reaches it
    again, holds the room of its first, which was consumed and must be downloaded again; that
    download waits for room before rank 1 asks for it. Before, it waited for room that an
    acknowledgement would free, one of rank 0's held item, which in DDP comes only once rank
    1 has its item: the give-back forced room after ``give_back_after`` (5 s by default, 600 s
    here, so the take timed out; ``stress_node.py --mode hazard`` stalled so: each of the 15
    stalls traced at seeds 0-59, all with ``retain="none"``). Now rank 1 waits with nothing ready, so
    the download looks again and drops the shelved item for its step at once. Both ranks then
    read their shares to the end, under the cap. The take's timeout only bounds the stall it
    was."""
    source = tmp_path / "source"
    sizes = [32, 8, 32, 8]  # balance="count", no shuffle: rank 0 items 0 and 2, rank 1 items 1 and 3
    names = [f"item{i:03d}" for i in range(len(sizes))]
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        (source / name).mkdir(parents=True)
        (source / name / "a.bin").write_bytes(bytes([i]) * size * KIB)
    cache = tmp_path / "node"
    block = block_of(tmp_path)
    small = charge(tmp_path, [8 * KIB], 1)
    capacity = state_of(str(source), tmp_path) + charge(tmp_path, [32 * KIB], 1) + small
    pipe = NodePipeline(
        str(source), cache, capacity, ranks=[0, 1], world_size=2, balance="count", shuffle=False, retain="none",
        give_back_after=600.0,
    )  # fmt: skip
    with Sampler(cache, block=block) as sampler, pipe:
        first, at = read_lane(pipe, 1, 0, limit=1)
        second = pipe.take(1, 0, at, timeout=10)  # rank 1 holds its second item
        held = pipe.take(0, 0, (0, 0), timeout=10)  # rank 0 holds its first, until rank 1 has taken step (0, 0)
        pipe.consume(1, 0, (0, 0))  # rank 1 restarted from its first step: its second is shelved
        wait_until(lambda: pipe._cache.shortfall() == small, what="rank 1's first waiting for room")  # before it waits
        again = pipe.take(1, 0, (0, 0), timeout=20)  # (600 s before)
        assert [second.item.name, held.item.name, again.item.name] == [names[3], names[0], names[1]]
        got = {1: [n for _e, n in first] + [n for _e, n in read_lane(pipe, 1, 0, again.cursor)[0]]}
        got[0] = [held.item.name] + [n for _e, n in read_lane(pipe, 0, 0, held.after)[0]]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert got == {0: names[0::2], 1: [names[1], *names[1::2]]}
    assert stats.bytes_downloaded == (sum(sizes) + 8 + 8) * KIB  # rank 1's first (consumed) and second (dropped) again


def test_a_lane_that_asks_at_its_pace_keeps_what_was_planned_for_it(s3_source, tmp_path):
    """Two lanes that consume each item once read, at different paces: rank 1 reads an item
    every 1.5 s, rank 0 at once. Rank 0 waits for room that rank 1's next item holds until rank
    1 asks for it, within its pace: ordinary back-pressure, nothing to give back, each item
    downloaded once. When lanes gave back after 1 s of waiting (ROOM_CHECK), rank 1's next item
    was given back, and downloaded again, at nearly every step (found by review)."""
    data = s3_source.folders(8, {"a.bin": 32 * KIB})
    names, sizes = sorted(data), sizes_of(data)
    cache = tmp_path / "node"
    pipe = NodePipeline(s3_source.url, cache, "80KiB", ranks=[0, 1], world_size=2, storage_options=s3_source.options)
    out: dict = {}

    def slow() -> None:
        cursor, got = Cursor(0, 0), []
        while (taken := pipe.take(1, 0, cursor, timeout=30)) is not None:
            got.append((0, taken.item.name))
            cursor = taken.after
            pipe.consume(1, 0, cursor)
            time.sleep(1.5)
        out[1] = got

    with Sampler(cache) as sampler, pipe:
        thread = threading.Thread(target=slow)
        thread.start()
        out[0] = read_lane(pipe, 0, 0)[0]
        thread.join()
        stats = pipe.stats()
    assert sampler.peak <= 80 * KIB
    for r in (0, 1):
        assert out[r] == expected(names, sizes, r, 0, 2, 1)
    assert stats.bytes_downloaded == 8 * 32 * KIB, stats.bytes_downloaded // (32 * KIB)


def test_the_epoch_after_next_is_prepared_in_the_background_while_planning_goes_on():
    """Computing an epoch's shares takes about 2 s per million catalog items; computed when
    first needed, under the queues' lock, it stopped every lane that long at each epoch
    (benchmarks/bench_node_epochs.py). When a lane enters epoch e, ``prepare(e)`` runs in a
    thread of its own: here it blocks, and epoch 0 is planned meanwhile, up to the step at
    which a lane enters epoch 1 (the planner then waits for it: it has had an epoch's time,
    unless an epoch is shorter than its preparation). close() waits for the thread."""
    from cachepipe.catalog import Item

    plan = NodePlan([10] * 8, ranks=[0], world_size=1, num_workers=2, epochs=3, shuffle=True, seed=0)
    release = threading.Event()
    asked: list[tuple[int, str]] = []

    def prepare(epoch: int) -> None:
        asked.append((epoch, threading.current_thread().name))
        release.wait(30)

    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None, prepare=prepare)
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    planned: list = []
    planner = threading.Thread(target=lambda: planned.extend(next(steps)[0] for _ in range(8)), daemon=True)
    planner.start()
    try:
        wait_until(lambda: len(planned) == 7, what="epoch 0 planned while prepare(0) runs")
        assert all(tick >> 32 == 0 for _seq, _item, tick in planned)
        assert asked == [(0, "cachepipe-plan-ahead")]  # in a thread of its own, still running
        release.set()
        wait_until(lambda: len(planned) == 8, what="the last step of epoch 0, once prepare(0) ended")
        wait_until(lambda: [epoch for epoch, _name in asked] == [0, 1], what="prepare(1), a lane having entered epoch 1")
    finally:
        release.set()
        planner.join(10)
        queues.close()
        steps.close()
    assert not any(t.name == "cachepipe-plan-ahead" for t in threading.enumerate())


def test_close_stops_the_preparation_in_the_background():
    """close() waits for the plan-ahead thread; an epoch's preparation takes about 2 s per million
    catalog items (more with retain='auto'), so close (SIGTERM, Ctrl-C) waited that long. The
    thread now stops at its next pause once the queues are closed: the epoch it was computing is
    left uncomputed (computed again if ever needed)."""
    plan = NodePlan([10] * 400_000, ranks=[0], world_size=1, num_workers=8, epochs=4, shuffle=True, seed=0)
    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None)
    assert queues._prepare_in_background(0)  # what the planner does when a lane enters epoch 0: epoch 2
    queues.close()
    assert not any(t.name == "cachepipe-plan-ahead" for t in threading.enumerate())
    assert not plan.prepared(2)  # cut short, not run to its end


@pytest.mark.parametrize(("waits_at", "moved_to"), [((0, 5), (0, 0)), ((0, 0), (0, 3))], ids=["moved-back", "moved-on"])
def test_a_consumer_whose_lane_another_consumer_moved_while_it_waited_is_refused(s3_source, tmp_path, caplog, waits_at, moved_to):
    """Two consumers of one lane at once (found by a randomized run of DataLoaders of one job: a
    loader resumed beside an earlier one whose workers still asked): one waits for its item, a
    slow download, and the other moves the lane elsewhere (its consume). Before, the first waited
    for ever: only a move plans a lane from a position, and the lane was no longer at its
    position. Now it gets LaneConflictError at once, naming both positions, and the lane stays
    where the other consumer put it (moving it back would consume the other's items: a position
    acknowledges every step before it). The node warns once."""
    import logging

    from cachepipe.errors import LaneConflictError
    from cachepipe.stores import open_store

    data = s3_source.folders(8, {"a.bin": 32 * KIB})
    mine = [name for _e, name in expected(sorted(data), sizes_of(data), 0, 0, 1, 1)]
    store = _Gated(open_store(s3_source.url, s3_source.options), mine[waits_at[1]])
    cache = tmp_path / "node"
    pipe = NodePipeline(s3_source.url, cache, "80KiB", ranks=[0], world_size=1, store=store)
    got: dict = {}

    def waiter() -> None:
        try:
            pipe.take(0, 0, waits_at, timeout=15)
        except Exception as exc:  # noqa: BLE001 - what the waiter got, checked below
            got["error"] = exc

    with Sampler(cache) as sampler, pipe, caplog.at_level(logging.WARNING, logger="cachepipe.node"):
        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until(lambda: store.gets.get(f"{mine[waits_at[1]]}/a.bin"), what="the download the consumer waits for")
        wait_until(lambda: pipe._queues._lanes[0].waiting, what="the consumer waiting")  # it asked first
        pipe.consume(0, 0, moved_to)  # the other consumer
        thread.join(10)
        store.gate.set()
        assert not thread.is_alive()  # before: it waited until its timeout (TimeoutError)
        taken = pipe.take(0, 0, moved_to, timeout=10)  # the other consumer reads on from where it put the lane
    assert isinstance(got["error"], LaneConflictError), got
    assert f"moved the lane to {moved_to} while this one waited for {waits_at}" in str(got["error"])
    assert taken.item.name == mine[moved_to[1]]
    warned = [r.getMessage() for r in caplog.records if r.name == "cachepipe.node"]
    assert len(warned) == 1 and warned[0].startswith("lane 0.0: another consumer moved the lane"), warned
    assert sampler.peak <= 80 * KIB


class _Slow:
    """A store whose every GET takes ``delay`` seconds (a large item over a slow link)."""

    def __init__(self, inner, delay: float) -> None:
        self.inner, self.url, self.delay = inner, inner.url, delay
        self.gets = 0

    def list(self):
        return self.inner.list()

    def get(self, key, out, start, end, *, etag=None):
        self.gets += 1
        time.sleep(self.delay)
        return self.inner.get(key, out, start, end, etag=etag)

    def close(self) -> None:
        self.inner.close()


def test_two_consumers_reading_one_lane_to_its_end_one_is_refused_and_the_other_reads_on_intact(s3_source, tmp_path, monkeypatch):
    """Two consumers of one lane read it to its end from two positions (a loader resumed beside
    an earlier one), each download taking longer than a turn (ROOM_CHECK, shortened here to 0.2
    s; downloads of 0.5 s), with room for three items (in what they take on the disk) beside
    the state. Found by review of the first fix, which moved the lane back after a turn:
    neither got an item for 20 s while the node downloaded the items again and again. Now the
    one whose lane the other moved while it waited is refused (LaneConflictError), and the
    other reads its share from its position to the end, each item whole."""
    import cachepipe.node
    from cachepipe.errors import LaneConflictError
    from cachepipe.stores import open_store

    monkeypatch.setattr(cachepipe.node, "ROOM_CHECK", 0.2)
    data = s3_source.folders(12, {"a.bin": 8 * KIB})
    mine = [name for _e, name in expected(sorted(data), sizes_of(data), 0, 0, 1, 1)]
    store = _Slow(open_store(s3_source.url, s3_source.options), 0.5)
    capacity = state_of(s3_source.url, tmp_path, storage_options=s3_source.options) + 3 * charge(tmp_path, [8 * KIB], 1) + 100
    pipe = NodePipeline(s3_source.url, tmp_path / "node", capacity, ranks=[0], world_size=1, store=store)
    out: dict = {}

    def reader(start) -> None:
        got = out.setdefault(start, [])
        cursor = Cursor(*start)
        try:
            while (taken := pipe.take(0, 0, cursor, timeout=20)) is not None:
                assert (taken.item.path / "a.bin").read_bytes() == data[taken.item.name]["a.bin"]
                got.append(taken.item.name)
                cursor = taken.after
                pipe.consume(0, 0, cursor)
        except LaneConflictError:
            got.append("refused")

    with pipe:
        readers = [threading.Thread(target=reader, args=(start,)) for start in ((0, 0), (0, 6))]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
    refused = [start for start, got in out.items() if got[-1:] == ["refused"]]
    assert len(refused) == 1, (out, store.gets)  # before the first fix: both waited; with it, neither was served
    (reads_on,) = set(out) - set(refused)
    assert out[reads_on] == mine[reads_on[1] :], out  # its share from its position, to the end


def test_a_download_that_arrives_for_a_lane_that_moved_away_wakes_the_fetcher_waiting_for_room_ahead():
    """Found by the review of the withdraw (fails on 8451bc1 too): ``_arrive`` lowered
    ``_pending`` for every arrival but notified only if some arrival was not stale: when every
    arrival was for steps whose lanes moved away (a restarted lane), a producer waiting in
    ``Broker.wait_ahead_below`` was never woken, and planning stopped for every lane. Nodes
    now refuse ``prefetch`` (the way a node reached that wait), and any arrival wakes."""
    plan = NodePlan([10] * 8, ranks=[0], world_size=1)
    queues = LaneQueues(LaneSchedule(plan), on_stale=lambda _planned: None)
    steps = queues.steps(lambda i: Item(f"item{i}", (), plan.sizes[i]))
    seq, item, _tick = next(steps)[0]  # lane 0's first step
    queues.begin_many(1)  # downloading: one item ahead of the consumers
    woke = threading.Event()

    def producer() -> None:  # Fetcher._plan_one with prefetch=1
        if queues.wait_ahead_below(1):
            woke.set()

    def waiters() -> int:
        with queues._cond:
            return len(queues._cond._waiters)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    try:
        wait_until(waiters, what="the producer waiting for room ahead")
        queues.move(0, Cursor(0, 5))  # the lane's consumer restarts elsewhere: the download will arrive stale
        wait_until(waiters, what="the producer waiting again after the move's wake-up")
        queues.put_many([(seq, item.name, f"/cache/{item.name}")])  # arrives: nothing is ahead any more
        assert queues.counts()["pending"] == 0
        assert woke.wait(5), "the producer waiting for room ahead was not woken by the stale arrival"
    finally:
        queues.close()
        thread.join(5)
        steps.close()


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_a_lane_beside_a_rank_that_holds_its_item_gets_the_room_it_frees_at_each_step(tmp_path, retain):
    """Rank 0 takes its first item and holds it without asking (a DDP rank at its all-reduce);
    rank 1 reads its whole lane meanwhile, consuming each item once read. Room for two items
    and a half (of 16 KiB, 20 KiB on the disk with their folder on 4 KiB blocks) beside the
    state: what rank 0 holds, and one more. Each item rank 1 consumes frees
    the room its next needs. Before, that room went to rank 0's next item, planned ahead (at
    a tie of the lanes' loads, the lower lane) and waiting for room, and rank 1's step, planned
    after it, waited for the give-back (``give_back_after``, 5 s by default, 30 s here) at
    every step; the given-back item was downloaded again. Now rank 1's move asks that download
    back unbegun, as a lane waiting for a step not planned yet does, and rank 1's step has the
    room at once. The take's timeout only bounds the stall it was."""
    source = tmp_path / "source"
    names = numbered_items(source, 10)  # balance="count", no shuffle: rank 0 the even items, rank 1 the odd
    cache = tmp_path / "node"
    block, item = block_of(tmp_path), charge(tmp_path, [16 * KIB], 1)
    capacity = state_of(str(source), tmp_path) + 2 * item + item // 2
    pipe = NodePipeline(
        str(source), cache, capacity, ranks=[0, 1], world_size=2, balance="count", shuffle=False, retain=retain,
        give_back_after=30.0,
    )  # fmt: skip
    with Sampler(cache, block=block) as sampler, pipe:
        held = pipe.take(0, 0, (0, 0), timeout=10)
        got = {0: [held.item.name], 1: []}
        cursor = Cursor(0, 0)
        while (taken := pipe.take(1, 0, cursor, timeout=10)) is not None:  # 30 s per step before
            assert (taken.item.path / "a.bin").read_bytes() == bytes([int(taken.item.name[4:])]) * 16 * KIB
            got[1].append(taken.item.name)
            cursor = taken.after
            pipe.consume(1, 0, cursor)
        got[0] += [n for _e, n in read_lane(pipe, 0, 0, held.after)[0]]
        stats = pipe.stats()
    assert sampler.peak <= capacity
    assert got == {0: names[0::2], 1: names[1::2]}
    assert stats.bytes_downloaded == 10 * 16 * KIB  # each item once: nothing given back


@pytest.mark.parametrize("retain", ["none", "auto"])
def test_lanes_of_nested_small_files_stay_under_the_cap_in_blocks_and_download_each_once(s3_source, tmp_path, retain):
    """Blocks review: a node of two ranks of two workers, over single-object items of 512 bytes
    in folders of their own (``items="files"``: each takes its file's block and its two
    folders'), on a small real filesystem; a lane reads four steps, then restarts from its first
    (with retention and room for every item, once every item is on disk: what was fetched ahead
    for it is shelved, then taken again), the room given back meanwhile counted in the ledger's
    bytes. What the cache holds never exceeds the capacity as the cache counts it (the Sampler's
    walk) nor as the disk lost it (statvfs); every lane gets its share; without retention an
    object is downloaded at most three times (once per epoch, and again for the restarted
    lane's first steps), with retention and room for all once: a copy shared with a step that
    the restarted lane dropped is kept for it (its ack's next use is the first read of it that
    a lane has not consumed; it was the next use after that step, and d03, d01, d09 were
    downloaded twice); and once every lane is at its end, retention keeps nothing."""
    from test_blocks_review import DiskLoss
    from test_disk_faults import tmpfs

    from cachepipe.stores import open_store

    keys = [f"d{i:02d}/e/x.bin" for i in range(24)]
    s3_source.put_many({key: bytes([i]) * 512 for i, key in enumerate(keys)})
    store = _Gated(open_store(s3_source.url, s3_source.options), "no such key")
    store.gate.set()
    with tmpfs(tmp_path / "disk", "4m") as disk:
        block, cache = block_of(disk), disk / "node"
        item = charge(disk, [512], 2)
        state = state_of(s3_source.url, disk, storage_options=s3_source.options, items="files", retain=retain, epochs=2)
        capacity = state + (len(keys) if retain == "auto" else 6) * item
        kw = {"epochs": 2, "shuffle": True, "seed": 3, "items": "files", "retain": retain}
        pipe = NodePipeline(
            s3_source.url, cache, capacity, ranks=[0, 1], world_size=2, num_workers=2, store=store, give_back_after=0.5, **kw
        )
        out: dict = {}
        with DiskLoss(disk) as lost, Sampler(cache, block=block) as sampler, pipe:
            read_lane(pipe, 0, 0, limit=4)  # lane 0.0 reads 4 steps, then restarts from its first
            if retain == "auto":  # room for every item: the node fetches them all, for every lane
                wait_until(lambda: pipe.stats().bytes_downloaded == len(keys) * 512, what="every item downloaded")
            read_lanes(pipe, [(r, k) for r in (0, 1) for k in (0, 1)], out)
            stats = pipe.stats()
            policy = pipe._cache._policy
            kept = (0, 0) if policy is None else (policy.retained_bytes, policy.pinned_bytes)
    sizes = [512] * len(keys)
    for r in (0, 1):
        for k in (0, 1):
            want = expected(sorted(keys), sizes, r, k, 2, 2, epochs=2, shuffle=True, seed=3)
            assert out[(r, k)] == want
    assert sampler.samples > 0 and sampler.peak <= capacity, f"{sampler.peak} bytes under {capacity}"
    assert lost.peak <= capacity, f"the disk lost {lost.peak} bytes under {capacity}"
    gets = [store.gets.get(key, 0) for key in keys]
    assert max(gets) <= (1 if retain == "auto" else 3), store.gets  # the restarted lane's first steps: again
    assert kept == (0, 0), "every lane at its end: no step reads what retention keeps"
    assert stats.items_failed == 0
