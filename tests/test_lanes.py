"""The node's merged plan and its schedule (pure): lanes get exactly their Plan shares."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.lanes import LaneSchedule, NodePlan
from cachepipe.plan import Cursor, Plan, tick
from cachepipe.retention import PlanFuture


def node(sizes, ranks, world, workers, **kw) -> NodePlan:
    return NodePlan(sizes, ranks=ranks, world_size=world, num_workers=workers, **kw)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 60),
    world=st.integers(1, 5),
    workers=st.integers(1, 3),
    epochs=st.integers(1, 3),
    shuffle=st.booleans(),
    partition=st.sampled_from(["epoch", "fixed"]),
    balance=st.sampled_from(["bytes", "count"]),
    seed=st.integers(0, 5),
)
def test_node_shares_are_the_lanes_plans_and_nodes_cover_each_epoch_once(
    n, world, workers, epochs, shuffle, partition, balance, seed
):
    sizes = [random.Random(seed * 1000 + i).randint(0, 100) for i in range(n)]
    kw = {"epochs": epochs, "shuffle": shuffle, "seed": seed, "partition": partition, "balance": balance}
    ranks = list(range(world))
    nodes = [node(sizes, ranks[: world // 2 + 1], world, workers, **kw)]
    if world // 2 + 1 < world:
        nodes.append(node(sizes, ranks[world // 2 + 1 :], world, workers, **kw))
    for epoch in range(epochs):
        merged = [x for plan in nodes for x in plan.share(epoch)]
        assert sorted(merged) == list(range(n))  # the nodes together read every item once
        for plan in nodes:
            share, positions = plan.share(epoch), plan.positions(epoch)
            for lane, (rank, worker) in enumerate(plan.lanes):
                mine = Plan(sizes, rank=rank, world_size=world, worker=worker, num_workers=workers, **kw).share(epoch)
                assert [share[j] for j in positions[lane]] == list(mine)  # exactly the per-process share, in order
            keys = sorted((i, lane) for lane, where in enumerate(positions) for i in range(len(where)))
            assert [positions[lane][i] for i, lane in keys] == list(range(len(share)))  # merged by (index, lane)


def test_schedule_walks_the_merged_order_and_each_lane_in_its_own():
    sizes = [10, 20, 30, 40, 50, 60, 70]
    plan = node(sizes, [0, 1], 2, 2, epochs=2, shuffle=True, seed=4)
    schedule = LaneSchedule(plan)
    walked = []
    while (got := schedule.next()) is not None:
        walked.append(got)
    assert [(s.step.epoch, s.tick) for s in walked] == sorted((s.step.epoch, s.tick) for s in walked)
    assert [s.step.item for s in walked] == list(plan.share(0)) + list(plan.share(1))
    for lane in range(4):
        assert [s.step for s in walked if s.lane == lane] == list(plan.plans[lane])
    assert all(s.tick == tick(s.step.epoch, plan.positions(s.step.epoch)[s.lane][s.step.index]) for s in walked)


def test_schedule_passes_over_a_lane_held_back_and_none_when_every_lane_is():
    plan = node(list(range(1, 13)), [0], 1, 2, epochs=1)
    schedule = LaneSchedule(plan)
    asked = []

    def hold(lane: int, item: int) -> bool:
        asked.append((lane, item))
        return lane == 0

    got = schedule.next([0, 5], hold)  # lane 0 is the less loaded, but held back
    assert got.lane == 1 and asked[0] == (0, plan.lane_share(0, 0)[0])
    assert schedule.next([0, 5], lambda _lane, _item: True) is None
    assert schedule.cursors[0] == Cursor(0, 0)  # a lane passed over keeps its position


def test_reset_moves_one_lane_and_starts_a_new_generation():
    plan = node(list(range(1, 13)), [0, 1], 2, 1, epochs=2)
    schedule = LaneSchedule(plan)
    for _ in range(6):
        schedule.next()
    assert schedule.cursors == [Cursor(0, 3), Cursor(0, 3)]
    assert schedule.reset(0, (0, 1)) == 1
    got = schedule.next()
    assert (got.lane, got.generation, tuple(got.step)[:2]) == (0, 1, (0, 1))
    assert schedule.reset(1, (0, 6)) == 1 and schedule.cursors[1] == Cursor(1, 0)  # the end of a share is the next epoch's start
    with pytest.raises(ValueError, match="epoch 0 has 6 steps"):
        schedule.reset(0, (0, 7))


def test_a_finite_plan_ends_for_every_lane():
    schedule = LaneSchedule(node([1, 2, 3], [0], 1, 2, epochs=1))
    assert len(list(iter(schedule.next, None))) == 3
    assert schedule.done(0) and schedule.done(1)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match=r"rank 2 in ranks: expected an integer with 0 <= rank < world_size = 2"):
        node([1], [0, 2], 2, 1)
    with pytest.raises(ValueError, match=r"a rank is listed twice"):
        node([1], [1, 1], 2, 1)
    with pytest.raises(ValueError, match=r"ranks \[\]"):
        node([1], [], 2, 1)
    plan = node([1, 2], [3], 4, 2)
    with pytest.raises(ValueError, match=r"this node serves ranks \[3\] of world_size 4"):
        plan.lane(0, 0)
    with pytest.raises(ValueError, match=r"worker 2: expected 0 <= worker < num_workers = 2"):
        plan.lane(3, 2)
    assert plan.lane(3, 1) == 1


def test_retention_sees_the_whole_node():
    """PlanFuture over the merged plan: an item's next use is its next read by any lane."""
    plan = node(list(range(1, 9)), [0, 1], 2, 1, epochs=3, shuffle=True, seed=1, partition="fixed")
    future = PlanFuture(plan, horizon=2)
    share0, share1 = plan.share(0), plan.share(1)
    first = share0[0]
    assert future.next_use(first, tick(0, 0)) == tick(1, list(share1).index(first))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1000), max_size=12), min_size=1, max_size=9))
def test_interleave_merges_by_index_then_share(lists):
    """:func:`interleave` (strided slices by bands) against its definition, with empty and
    unequal shares."""
    from array import array

    from cachepipe.lanes import interleave

    shares = [array("I", xs) for xs in lists]
    merged, positions = interleave(shares)
    order = sorted((i, k) for k, xs in enumerate(lists) for i in range(len(xs)))
    assert list(merged) == [lists[k][i] for i, k in order]
    assert [list(p) for p in positions] == [[order.index((i, k)) for i in range(len(xs))] for k, xs in enumerate(lists)]


def test_a_node_keeps_the_epochs_of_a_lane_two_behind_while_it_plans_two_ahead():
    """Review: the node computes the epoch after next as soon as a lane enters an epoch; with a
    lane two epochs behind (shares of unequal lengths drift apart), five epochs are read at once,
    and with four kept the lagging lane's was computed again and again (2 s per million items)."""
    plan = node([1] * 20, [0, 1], 2, 2, epochs=None, shuffle=True, seed=3)
    latest = 4
    plan.prepare(*range(latest - 2, latest + 3))  # the lagging lane's epoch .. the epoch after next
    assert all(plan.prepared(e) for e in range(latest - 2, latest + 3))
    assert all(len(p._shares) >= 5 for p in plan.plans)  # the lanes' own plans keep them too
