"""The plan: epochs, seeded shuffle, rank/worker shares, balance, resume, rank defaults (pure)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import types
from array import array
from collections import Counter
from itertools import islice

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.catalog import FileEntry, Item
from cachepipe.plan import Cursor, Frontier, Plan, Step, default_rank_world, default_worker, permutation, split, tick

FAST = settings(max_examples=100, deadline=None)

sizes_st = st.lists(st.integers(0, 1000), min_size=0, max_size=40)
config_st = st.fixed_dictionaries(
    {
        "shuffle": st.booleans(),
        "seed": st.integers(-(2**40), 2**40),
        "world_size": st.integers(1, 5),
        "num_workers": st.integers(1, 3),
        "balance": st.sampled_from(["bytes", "count"]),
        "partition": st.sampled_from(["epoch", "fixed"]),
    }
)


def plans(sizes, cfg, **extra):
    """{(rank, worker): Plan} for every share of one configuration."""
    w, k = cfg["world_size"], cfg["num_workers"]
    base = {key: cfg[key] for key in ("shuffle", "seed", "balance", "partition")}
    return {
        (r, j): Plan(sizes, rank=r, world_size=w, worker=j, num_workers=k, **base, **extra) for r in range(w) for j in range(k)
    }


# ---- shares ------------------------------------------------------------------------------
@FAST
@given(sizes_st, config_st, st.integers(0, 3))
def test_shares_are_disjoint_and_cover_the_epoch(sizes, cfg, epoch):
    everyone = plans(sizes, cfg, epochs=epoch + 1)
    taken = Counter()
    for plan in everyone.values():
        taken.update(plan.share(epoch))
    assert taken == Counter(range(len(sizes)))  # each item exactly once, across all shares


@FAST
@given(sizes_st, config_st, st.integers(0, 3))
def test_worker_shares_split_the_rank_share_in_order(sizes, cfg, epoch):
    k = cfg["num_workers"]
    whole = plans(sizes, {**cfg, "num_workers": 1})
    split_up = plans(sizes, cfg)
    for r in range(cfg["world_size"]):
        rank_share = list(whole[r, 0].share(epoch))
        parts = [list(split_up[r, j].share(epoch)) for j in range(k)]
        assert sorted(x for p in parts for x in p) == sorted(rank_share)
        pos = {x: i for i, x in enumerate(rank_share)}
        for p in parts:  # each worker reads its items in the rank's order
            assert [pos[x] for x in p] == sorted(pos[x] for x in p)


@FAST
@given(sizes_st, config_st, st.integers(0, 3))
def test_bytes_balance_within_the_largest_item(sizes, cfg, epoch):
    cfg = {**cfg, "balance": "bytes"}
    largest = max(sizes, default=0)
    whole = plans(sizes, {**cfg, "num_workers": 1})
    rank_bytes = [sum(sizes[x] for x in whole[r, 0].share(epoch)) for r in range(cfg["world_size"])]
    assert max(rank_bytes) - min(rank_bytes) <= largest
    split_up = plans(sizes, cfg)
    for r in range(cfg["world_size"]):
        rank_share = whole[r, 0].share(epoch)
        in_rank = max((sizes[x] for x in rank_share), default=0)
        worker_bytes = [sum(sizes[x] for x in split_up[r, j].share(epoch)) for j in range(cfg["num_workers"])]
        assert max(worker_bytes) - min(worker_bytes) <= in_rank


@FAST
@given(st.integers(0, 60), st.integers(1, 200), st.integers(1, 7), st.integers(0, 10), st.sampled_from(["bytes", "count"]))
def test_equal_sizes_give_counts_within_one(n, size, parts, seed, balance):
    order = permutation(n, seed, 0)
    counts = [len(split(order, [size] * n, parts, p, balance)) for p in range(parts)]
    assert max(counts) - min(counts) <= 1


@FAST
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=30), st.integers(1, 6), st.integers(0, 5))
def test_every_part_gets_an_item_when_there_are_enough(sizes, parts, seed):
    order = permutation(len(sizes), seed, 3)
    got = [len(split(order, sizes, parts, p)) for p in range(parts)]
    assert all(g >= 1 for g in got[: len(sizes)])


def test_split_by_bytes_is_the_documented_greedy():
    # walk 9, 1, 1, 1, 8: fewest bytes wins, ties by fewer items then lower part
    order, sizes = [0, 1, 2, 3, 4], [9, 1, 1, 1, 8]
    assert list(split(order, sizes, 2, 0)) == [0]
    assert list(split(order, sizes, 2, 1)) == [1, 2, 3, 4]
    assert list(split([0, 1, 2], [0, 0, 0], 2, 0)) == [0, 2]  # zero sizes: round-robin by count


def test_count_balance_deals_round_robin():
    assert list(split([5, 4, 3, 2, 1], [100, 1, 1, 1, 1, 1], 2, 1, "count")) == [4, 2]


# ---- determinism -------------------------------------------------------------------------
def test_permutation_is_pinned():
    # a regression pin: the order must not change across versions or processes
    assert list(permutation(10, 0, 0)) == list(permutation(10, 0, 0))
    assert list(permutation(10, 0, 0)) == PINNED_0_0
    assert list(permutation(10, 7, 3)) == PINNED_7_3


PINNED_0_0 = [1, 5, 0, 6, 8, 7, 2, 4, 9, 3]
PINNED_7_3 = [0, 2, 9, 1, 4, 5, 8, 7, 6, 3]


def test_permutation_is_the_same_in_another_process():
    code = "from cachepipe.plan import permutation; print(list(permutation(50, 12345, 6)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(list(permutation(50, 12345, 6)))


@FAST
@given(sizes_st, config_st, st.integers(1, 3))
def test_same_inputs_same_plan(sizes, cfg, epochs):
    a = plans(sizes, cfg, epochs=epochs)
    b = plans(sizes, cfg, epochs=epochs)
    for key in a:
        assert list(a[key]) == list(b[key])


@FAST
@given(st.integers(-(2**63), 2**63), st.integers(0, 1000))
def test_each_epoch_gets_a_new_permutation(seed, epoch):
    n = 30  # two equal permutations of 30 items: probability 1/30!
    assert list(permutation(n, seed, epoch)) != list(permutation(n, seed, epoch + 1))
    assert sorted(permutation(n, seed, epoch)) == list(range(n))


def test_order_is_identical_on_every_rank():
    sizes = list(range(20))
    orders = {tuple(Plan(sizes, shuffle=True, seed=3, rank=r, world_size=4).order(2)) for r in range(4)}
    assert len(orders) == 1


def test_no_shuffle_keeps_catalog_order_every_epoch():
    plan = Plan([1] * 5, epochs=2, rank=0, world_size=1)
    assert [s.item for s in plan] == [0, 1, 2, 3, 4] * 2


def test_fixed_partition_keeps_each_rank_on_the_same_items():
    sizes = [1 + (i * 37) % 11 for i in range(40)]
    for r in range(3):
        plan = Plan(sizes, epochs=4, shuffle=True, seed=1, rank=r, world_size=3, partition="fixed")
        assert len({frozenset(plan.share(e)) for e in range(4)}) == 1
        assert len({tuple(plan.share(e)) for e in range(4)}) > 1  # but read in a new order


def test_items_are_accepted_as_catalog_items():
    items = [Item(f"f{i}", (FileEntry(f"f{i}/a", "a", s),), s) for i, s in enumerate([3, 4, 5])]
    assert list(Plan(items, rank=0, world_size=1).sizes) == [3, 4, 5]


# ---- positions and resume ----------------------------------------------------------------
@FAST
@given(sizes_st, config_st, st.integers(1, 3), st.data())
def test_resume_from_any_position_yields_exactly_the_remainder(sizes, cfg, epochs, data):
    plan = plans(sizes, cfg, epochs=epochs)[
        data.draw(st.integers(0, cfg["world_size"] - 1)), data.draw(st.integers(0, cfg["num_workers"] - 1))
    ]
    full = list(plan)
    assert [(s.epoch, s.index) for s in full if s.index == 0] == sorted({(s.epoch, 0) for s in full})
    k = data.draw(st.integers(0, len(full)))
    state = plan.state_dict(full[k - 1] if k else None)
    resumed = Plan(
        sizes,
        epochs=epochs,
        rank=plan.rank,
        world_size=plan.world_size,
        worker=plan.worker,
        num_workers=plan.num_workers,
        shuffle=cfg["shuffle"],
        seed=cfg["seed"],
        balance=cfg["balance"],
        partition=cfg["partition"],
    )
    resumed.load_state_dict(state)
    assert list(resumed) == full[k:]
    assert list(plan.steps(Cursor(state["epoch"], state["index"]))) == full[k:]


@FAST
@given(st.integers(2, 12), st.integers(0, 40), st.integers(0, 9))
def test_endless_plan_resumes_mid_epoch(n, k, seed):
    plan = Plan([1] * n, epochs=None, shuffle=True, seed=seed, rank=0, world_size=1)
    head = list(islice(plan, k + 20))
    assert [s.epoch for s in head] == sorted(s.epoch for s in head)
    again = Plan([1] * n, epochs=None, shuffle=True, seed=seed, rank=0, world_size=1)
    again.load_state_dict(plan.state_dict(head[k]))
    assert list(islice(again, 19)) == head[k + 1 :]
    assert list(plan.future(plan.after(head[k]), 5)) == head[k + 1 : k + 6]


def test_state_is_json_and_names_the_next_position():
    import json

    plan = Plan([1, 2, 3], epochs=2, rank=0, world_size=1)
    state = json.loads(json.dumps(plan.state_dict(Step(0, 2, 2))))
    assert (state["epoch"], state["index"]) == (1, 0)  # after the last step of epoch 0
    assert plan.state_dict(Step(1, 2, 2))["epoch"] == 2  # finished
    plan.load_state_dict(plan.state_dict(Step(1, 2, 2)))
    assert list(plan) == []


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"seed": 1}, "seed"),
        ({"epochs": 3}, "epochs"),
        ({"world_size": 2}, "world_size"),
        ({"rank": 1, "world_size": 2}, "world_size"),
        ({"shuffle": False}, "shuffle"),
        ({"num_workers": 2}, "num_workers"),
        ({"balance": "count"}, "balance"),
        ({"partition": "fixed"}, "partition"),
    ],
)
def test_state_from_another_configuration_is_refused(change, key):
    base = {"epochs": 2, "shuffle": True, "seed": 0, "rank": 0, "world_size": 1}
    state = Plan([1, 2, 3], **base).state_dict()
    other = Plan([1, 2, 3], **{**base, **change})
    with pytest.raises(ValueError, match=rf"{key}=") as info:
        other.load_state_dict(state)
    assert "cannot resume" in str(info.value)


def test_state_from_another_catalog_is_refused():
    state = Plan([1, 2, 3], rank=0, world_size=1).state_dict()
    with pytest.raises(ValueError, match="sizes_digest="):
        Plan([1, 2, 4], rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="n_items="):
        Plan([1, 2], rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        Plan([1, 2, 3], rank=0, world_size=1).load_state_dict({"seed": 0})


def test_bad_positions_are_refused():
    plan = Plan([1, 2, 3], epochs=2, rank=0, world_size=1)
    for bad in [(0, 4), (3, 0), (2, 1), (-1, 0), (0, -1)]:
        with pytest.raises(ValueError, match="position"):
            plan.normalise(bad)
    assert plan.normalise((0, 3)) == (1, 0)


def test_frontier_moves_past_a_batch_of_steps_consumed_at_once():
    plan = Plan([1] * 3, epochs=2, rank=0, world_size=1)
    frontier = Frontier(plan)
    seqs = [frontier.issue(s) for s in plan]
    frontier.consume(seqs[0])
    frontier.consume(seqs[2], seqs[0], seqs[1], seqs[5])  # a batch of acks, in any order, one consumed before
    assert frontier.position == (1, 0)
    with pytest.raises(KeyError):
        frontier.consume(seqs[3], 99)  # one never issued: none of the batch is marked
    assert frontier.position == (1, 0)
    frontier.consume(seqs[4])
    assert frontier.position == (1, 0)  # (1, 0) is still out
    frontier.consume(seqs[3])
    assert frontier.position == (2, 0)  # the end: (1, 2) was consumed in the batch before


def test_frontier_is_the_first_unconsumed_step():
    plan = Plan([1] * 3, epochs=2, rank=0, world_size=1)
    frontier = Frontier(plan)
    seqs = [frontier.issue(s) for s in plan]
    assert frontier.position == (0, 0)
    assert frontier.step(seqs[1]) == Step(0, 1, 1)
    frontier.consume(seqs[1])
    assert frontier.position == (0, 0)  # step 0 is still out
    frontier.consume(seqs[0])
    assert frontier.position == (0, 2)
    frontier.consume(seqs[0])  # idempotent
    frontier.consume(seqs[2])
    assert frontier.position == (1, 0)
    with pytest.raises(KeyError):
        frontier.consume(99)
    resumed = Plan([1] * 3, epochs=2, rank=0, world_size=1)
    resumed.load_state_dict(frontier.state_dict())
    assert [s.tick for s in resumed] == [tick(1, 0), tick(1, 1), tick(1, 2)]


def test_frontier_issues_runs_and_gives_their_epochs_and_ticks():
    plan = Plan([1] * 3, epochs=2, rank=0, world_size=1)
    frontier = Frontier(plan)
    steps = list(plan)
    first, rest = frontier.issue_many(steps[:2]), frontier.issue_many(steps[2:])
    assert list(first) + list(rest) == list(range(6))  # consecutive, as issue() gives them
    assert frontier.step(4) == steps[4]
    assert frontier.epoch_ticks([4, 0, 3]) == [(s.epoch, s.tick) for s in (steps[4], steps[0], steps[3])]
    frontier.consume(0)
    with pytest.raises(KeyError):
        frontier.epoch_ticks([1, 0])  # 0 is below the frontier now


# ---- arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epochs": 0}, "epochs 0"),
        ({"rank": 2, "world_size": 2}, "rank 2"),
        ({"rank": -1, "world_size": 2}, "rank -1"),
        ({"rank": 0, "world_size": 0}, "world_size 0"),
        ({"rank": 0}, "give both"),
        ({"worker": 3, "num_workers": 3}, "worker 3"),
        ({"balance": "items"}, "balance 'items'"),
        ({"partition": "x"}, "partition 'x'"),
        ({"seed": 1.5}, "seed 1.5"),
        ({"epochs": None, "world_size": 4, "rank": 0}, "at least one item per share"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {"rank": 0, "world_size": 1, **kwargs}
    if "give both" in match:
        args.pop("world_size")
    with pytest.raises(ValueError, match=match):
        Plan([1, 2, 3], **args)


def test_negative_size_is_named():
    with pytest.raises(ValueError, match=r"sizes\[1\] = -5"):
        Plan([1, -5], rank=0, world_size=1)


MEMORY_PROBE = """
import resource, sys
from array import array
from itertools import islice
from cachepipe.plan import Plan
from cachepipe.retention import PlanFuture
sizes = array("q", [1000]) * 1_000_000
list(islice(Plan([1], rank=0, world_size=1), 1))  # warm up the imports
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
plan = Plan(sizes, epochs=None, shuffle=sys.argv[1] == "shuffle", rank=0, world_size=1)
steps = list(islice(plan, 10))
future = PlanFuture(plan)
future.prepare(0)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024, [s.item for s in steps][:3] == [0, 1, 2])
"""


def test_plan_memory_for_a_million_items():
    # peak RSS growth (Linux reports KiB) of a 1M-item plan with its next-use lookups for 2 epochs
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, "ordered"], capture_output=True, text=True, check=True).stdout
    grown, ordered = out.split()
    assert ordered == "True"
    assert int(grown) < 48 * 2**20, f"peak grew by {int(grown) / 2**20:.1f} MiB"


# ---- rank and worker defaults ------------------------------------------------------------
@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"RANK": "2", "WORLD_SIZE": "4"}, (2, 4)),
        ({"RANK": " 0 ", "WORLD_SIZE": "1"}, (0, 1)),
    ],
)
def test_rank_world_from_the_environment(env, expected, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    assert default_rank_world(env) == expected


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x'"),
        ({"RANK": "1", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK 2"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK -1"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE 0"),
        ({"RANK": "1"}, "RANK='1' is set but WORLD_SIZE"),
        ({"WORLD_SIZE": "3"}, "WORLD_SIZE='3' is set but RANK"),
    ],
)
def test_bad_rank_world_in_the_environment_is_named(env, match, monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    with pytest.raises(ValueError, match=match):
        default_rank_world(env)


def test_rank_world_from_an_initialised_torch_distributed(monkeypatch):
    dist = types.SimpleNamespace(
        is_available=lambda: True, is_initialized=lambda: True, get_rank=lambda: 3, get_world_size=lambda: 8
    )
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    assert default_rank_world({"RANK": "0", "WORLD_SIZE": "1"}) == (3, 8)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert default_rank_world({"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)


def test_plan_defaults_to_the_environment(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.distributed", raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    plan = Plan([1] * 9)
    assert (plan.rank, plan.world_size) == (1, 3)


def test_worker_defaults(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.utils.data", raising=False)
    assert default_worker() == (0, 1)
    info = types.SimpleNamespace(id=2, num_workers=4)
    monkeypatch.setitem(sys.modules, "torch.utils.data", types.SimpleNamespace(get_worker_info=lambda: info))
    assert default_worker() == (2, 4)


def test_importing_the_plan_does_not_import_torch():
    code = "import sys, cachepipe.plan, cachepipe.retention; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_fixed_partition_keeps_each_worker_on_the_same_items():
    # each DataLoader worker has a cache of its own: its items must stay with it too
    sizes = [1 + (i * 37) % 11 for i in range(40)]
    for r in range(2):
        for j in range(3):
            plan = Plan(sizes, epochs=4, shuffle=True, seed=1, rank=r, world_size=2, worker=j, num_workers=3, partition="fixed")
            assert len({frozenset(plan.share(e)) for e in range(4)}) == 1
            assert len({tuple(plan.share(e)) for e in range(4)}) > 1


@given(st.lists(st.lists(st.integers(0, 2**40), max_size=8), max_size=8))
def test_a_growing_plan_extended_in_runs_is_the_plan_grown_one_item_at_a_time(runs):
    from cachepipe.plan import GrowingPlan

    one, batched, listed = GrowingPlan(seed=3), GrowingPlan(seed=3), []
    for run in runs:
        for size in run:
            one.add(size)
        batched.extend(run)
        listed += run
        state = Frontier(batched).state_dict()
        assert state == Frontier(one).state_dict()
        assert state["listed"] == len(listed)  # the digest of the sizes listed, made here independently
        assert state["listed_digest"] == hashlib.blake2b(array("q", listed).tobytes(), digest_size=16).hexdigest()
        Plan([*listed, 7], epochs=1, seed=3, rank=0, world_size=1).load_state_dict(state)  # a resume on more accepts it
    assert list(batched.sizes) == listed
    assert batched.complete().state_dict() == one.complete().state_dict()
    assert Frontier(batched).state_dict() == Frontier(one).state_dict()
    with pytest.raises(RuntimeError, match="complete"):
        batched.extend([1])
