"""equal_steps: every rank the same number of items per epoch (DDP), pure (Plan, NodePlan)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.lanes import NodePlan
from cachepipe.plan import Plan, deal, equalise, permutation

FAST = settings(max_examples=150, deadline=None)

sizes_st = st.lists(st.integers(0, 1000), min_size=0, max_size=40)
config_st = st.fixed_dictionaries(
    {
        "shuffle": st.booleans(),
        "seed": st.integers(0, 2**40),
        "world_size": st.integers(1, 6),
        "num_workers": st.integers(1, 3),
        "balance": st.sampled_from(["bytes", "count"]),
        "partition": st.sampled_from(["epoch", "fixed"]),
        "equal_steps": st.sampled_from(["pad", "drop"]),
    }
)


def shares(sizes, cfg, epoch):
    """{(rank, worker): list of items} of ``epoch`` for every share of one configuration."""
    w, k = cfg["world_size"], cfg["num_workers"]
    base = {key: cfg[key] for key in ("shuffle", "seed", "balance", "partition", "equal_steps")}
    return {
        (r, j): list(Plan(sizes, rank=r, world_size=w, worker=j, num_workers=k, epochs=epoch + 1, **base).share(epoch))
        for r in range(w)
        for j in range(k)
    }


def split_order(n, cfg, epoch):
    """The permutation the split is made of: the epoch's, or with partition="fixed" epoch -1's."""
    if not cfg["shuffle"]:
        return list(range(n))
    return list(permutation(n, cfg["seed"], -1 if cfg["partition"] == "fixed" else epoch))


def torch_sampler_indices(order, world, drop_last):
    """What torch's DistributedSampler reads of ``order`` in one epoch, all ranks together
    (its code, written out: torch/utils/data/distributed.py)."""
    n = len(order)
    if drop_last and n % world:
        total = math.ceil((n - world) / world) * world
        return order[:total]
    total = math.ceil(n / world) * world
    padding = total - n
    if padding <= len(order):
        return order + order[:padding]
    return order + (order * math.ceil(padding / len(order)))[:padding]


@FAST
@given(sizes_st, config_st, st.integers(0, 2))
def test_every_rank_reads_the_same_number_of_items(sizes, cfg, epoch):
    got = shares(sizes, cfg, epoch)
    n, w = len(sizes), cfg["world_size"]
    expect = (-(-n // w) if cfg["equal_steps"] == "pad" else n // w) if n else 0
    for r in range(w):
        assert sum(len(got[r, j]) for j in range(cfg["num_workers"])) == expect


@FAST
@given(sizes_st, config_st, st.integers(0, 2))
def test_pad_reads_the_first_items_again_and_drop_leaves_out_the_last(sizes, cfg, epoch):
    got = shares(sizes, cfg, epoch)
    order, w = split_order(len(sizes), cfg, epoch), cfg["world_size"]
    if not order:
        assert all(share == [] for share in got.values())
        return
    expect = torch_sampler_indices(order, w, cfg["equal_steps"] == "drop")
    if cfg["equal_steps"] == "pad" and len(order) >= w:
        assert expect == order + order[: (-len(order)) % w]  # the first k items, once more
    if cfg["equal_steps"] == "drop":
        assert expect == order[: len(order) - len(order) % w]  # all but the last n % w
    assert Counter(x for share in got.values() for x in share) == Counter(expect)


@FAST
@given(sizes_st, config_st, st.integers(0, 2))
def test_bytes_differ_by_at_most_the_largest_item_and_workers_count_alike_on_every_rank(sizes, cfg, epoch):
    cfg = {**cfg, "balance": "bytes"}
    got = shares(sizes, {**cfg, "num_workers": 1}, epoch)
    largest = max(sizes, default=0)
    rank_bytes = [sum(sizes[x] for x in got[r, 0]) for r in range(cfg["world_size"])]
    assert max(rank_bytes) - min(rank_bytes) <= largest
    split_up = shares(sizes, cfg, epoch)
    k = cfg["num_workers"]
    counts = {tuple(sorted(len(split_up[r, j]) for j in range(k))) for r in range(cfg["world_size"])}
    assert len(counts) == 1  # the same counts on every rank: batches of any size are as many on every rank
    for r in range(cfg["world_size"]):
        in_rank = max((sizes[x] for x in got[r, 0]), default=0)
        worker_bytes = [sum(sizes[x] for x in split_up[r, j]) for j in range(k)]
        assert max(worker_bytes) - min(worker_bytes) <= in_rank
        assert max(len(split_up[r, j]) for j in range(k)) - min(len(split_up[r, j]) for j in range(k)) <= 1


@FAST
@given(st.lists(st.integers(0, 10**6), max_size=60), st.integers(1, 7), st.sampled_from(["bytes", "count"]))
def test_deal_gives_one_item_per_round_to_each_part(sizes, parts, balance):
    order = list(range(len(sizes)))
    out = deal(order, sizes, parts, balance)
    for start in range(0, len(order), parts):
        round_ = order[start : start + parts]
        # each part's next item is from this round, and the round is shared out exactly
        taken = [share[start // parts] for share in out if len(share) > start // parts]
        assert sorted(taken) == sorted(round_)
    assert sorted(len(share) for share in out) == sorted(len(order[p::parts]) for p in range(parts))


def test_deal_by_bytes_is_the_documented_rounds():
    # round 1: 9, 1 -> 9 to part 0 (both at 0 bytes: lower part), 1 to part 1
    # round 2: 1, 8 -> 8 to part 1 (1 byte, fewer than 9), 1 to part 0
    # round 3: 5, 5 -> part 1 (9 bytes, part 0 has 10) gets the first 5 of the walk
    sizes = [9, 1, 1, 8, 5, 5]
    assert [list(share) for share in deal(range(6), sizes, 2)] == [[0, 2, 5], [1, 3, 4]]
    assert [list(share) for share in deal(range(6), sizes, 2, "count")] == [[0, 2, 4], [1, 3, 5]]
    assert [list(share) for share in deal(range(3), [1, 5, 2], 4)] == [[1], [2], [0], []]  # a short round


def test_equalise_pads_by_cycling_and_drops_the_tail():
    assert list(equalise(range(5), 4, "pad")) == [0, 1, 2, 3, 4, 0, 1, 2]
    assert list(equalise(range(3), 8, "pad")) == [0, 1, 2, 0, 1, 2, 0, 1]  # DistributedSampler's cycling
    assert list(equalise(range(5), 4, "drop")) == [0, 1, 2, 3]
    assert list(equalise(range(3), 8, "drop")) == []
    assert list(equalise(range(8), 4, "pad")) == list(range(8))
    assert list(equalise(range(0), 4, "pad")) == []
    assert list(equalise(range(5), 4, None)) == list(range(5))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_reported_case_of_25_items_on_2_ranks(world):
    # 25 items of different sizes (what crashed a DDP job): by bytes their counts differ
    sizes = [random.Random(i).randint(1, 10_000) for i in range(25)]
    before = [len(Plan(sizes, rank=r, world_size=world, shuffle=True).share(0)) for r in range(world)]
    assert len(set(before)) > 1
    for mode, count in (("pad", -(-25 // world)), ("drop", 25 // world)):
        for partition in ("epoch", "fixed"):
            got = [
                len(Plan(sizes, rank=r, world_size=world, shuffle=True, equal_steps=mode, partition=partition).share(0))
                for r in range(world)
            ]
            assert got == [count] * world


def test_one_rank_is_unchanged():
    sizes = [random.Random(i).randint(1, 100) for i in range(17)]
    for mode in ("pad", "drop"):
        for partition in ("epoch", "fixed"):
            a = Plan(sizes, rank=0, world_size=1, num_workers=1, shuffle=True, epochs=2, partition=partition)
            b = Plan(sizes, rank=0, world_size=1, num_workers=1, shuffle=True, epochs=2, partition=partition, equal_steps=mode)
            assert list(a) == list(b)


def test_fixed_partition_pads_and_drops_the_same_items_every_epoch():
    sizes = [random.Random(i).randint(1, 100) for i in range(23)]
    base = list(permutation(23, 4, -1))
    for r in range(4):
        drop = Plan(sizes, rank=r, world_size=4, shuffle=True, seed=4, epochs=3, partition="fixed", equal_steps="drop")
        assert len({frozenset(drop.share(e)) for e in range(3)}) == 1
    everyone = Counter()
    for r in range(4):
        pad = Plan(sizes, rank=r, world_size=4, shuffle=True, seed=4, epochs=3, partition="fixed", equal_steps="pad")
        assert len({tuple(sorted(pad.share(e))) for e in range(3)}) == 1
        everyone.update(pad.share(2))
    assert everyone == Counter(base + base[:1])  # 23 -> 24: the first item of epoch -1's permutation, twice


# ---- resume ------------------------------------------------------------------------------
def test_a_state_saved_before_the_option_existed_still_loads():
    # a state of f857347 (no "equal_steps" key), written out
    plan = Plan([5, 6, 7], epochs=2, shuffle=True, seed=1, rank=0, world_size=2, equal_steps=None)
    state = {
        "version": 1,
        "n_items": 3,
        "sizes_digest": plan.sizes_digest(),
        "epochs": 2,
        "shuffle": True,
        "seed": 1,
        "world_size": 2,
        "rank": 0,
        "num_workers": 1,
        "worker": 0,
        "balance": "bytes",
        "partition": "epoch",
        "epoch": 1,
        "index": 0,
    }
    assert {k: v for k, v in plan.state_dict().items() if k not in ("epoch", "index")} == {
        k: v for k, v in state.items() if k not in ("epoch", "index")
    }  # None: the very same state (and journal plan key) as before
    plan.load_state_dict(state)
    assert plan.start == (1, 0)
    with pytest.raises(ValueError, match=r"equal_steps=None, this plan has equal_steps='pad': cannot resume"):
        Plan([5, 6, 7], epochs=2, shuffle=True, seed=1, rank=0, world_size=2, equal_steps="pad").load_state_dict(state)


def test_a_state_of_another_equal_steps_is_refused():
    kw = {"epochs": 2, "shuffle": True, "seed": 1, "rank": 1, "world_size": 2}
    pad = Plan([5, 6, 7], **kw, equal_steps="pad")
    state = pad.state_dict()
    assert state["equal_steps"] == "pad"
    Plan([5, 6, 7], **kw, equal_steps="pad").load_state_dict(state)
    for other in (None, "drop"):
        with pytest.raises(ValueError, match=rf"equal_steps='pad', this plan has equal_steps={other!r}"):
            Plan([5, 6, 7], **kw, equal_steps=other).load_state_dict(state)


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="equal_steps 'even': expected None, 'pad' or 'drop'"):
        Plan([1, 2], rank=0, world_size=1, equal_steps="even")


# ---- node ----------------------------------------------------------------------------------
@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(0, 50),
    world=st.integers(1, 5),
    workers=st.integers(1, 3),
    shuffle=st.booleans(),
    partition=st.sampled_from(["epoch", "fixed"]),
    balance=st.sampled_from(["bytes", "count"]),
    equal_steps=st.sampled_from(["pad", "drop"]),
    seed=st.integers(0, 5),
)
def test_node_lanes_read_exactly_the_plan_shares(n, world, workers, shuffle, partition, balance, equal_steps, seed):
    sizes = [random.Random(seed * 1000 + i).randint(0, 100) for i in range(n)]
    kw = {"epochs": 2, "shuffle": shuffle, "seed": seed, "partition": partition, "balance": balance, "equal_steps": equal_steps}
    cut = world // 2 + 1
    nodes = [NodePlan(sizes, ranks=list(range(cut)), world_size=world, num_workers=workers, **kw)]
    if cut < world:
        nodes.append(NodePlan(sizes, ranks=list(range(cut, world)), world_size=world, num_workers=workers, **kw))
    for epoch in range(2):
        total = Counter()
        for node in nodes:
            share, positions = node.share(epoch), node.positions(epoch)
            total.update(share)
            for lane, (rank, worker) in enumerate(node.lanes):
                mine = Plan(sizes, rank=rank, world_size=world, worker=worker, num_workers=workers, **kw).share(epoch)
                assert [share[j] for j in positions[lane]] == list(mine)  # exactly the per-process share, in order
        plan_total = Counter()
        for r in range(world):
            for k in range(workers):
                plan_total.update(Plan(sizes, rank=r, world_size=world, worker=k, num_workers=workers, **kw).share(epoch))
        assert total == plan_total
    assert nodes[0].config()["equal_steps"] == equal_steps


def test_node_config_without_equal_steps_is_unchanged():
    assert "equal_steps" not in NodePlan([1, 2, 3], ranks=[0], world_size=2).config()


# ---- a node, for real (moto) ---------------------------------------------------------------
@pytest.mark.parametrize("partition", ["epoch", "fixed"])
def test_a_node_hands_each_lane_its_padded_share_even_an_item_twice(s3_source, tmp_path, partition):
    from test_node import expected, read_lanes, sizes_of

    from cachepipe.node import NodePipeline

    for i in range(25):
        s3_source.put(f"item{i:03d}/f", bytes([i]) * ((i * 7919) % 5000 + 100))
    names = [f"item{i:03d}" for i in range(25)]
    sizes = sizes_of({n: {"f": b"x" * ((i * 7919) % 5000 + 100)} for i, n in enumerate(names)})
    kw = {"epochs": 2, "shuffle": True, "seed": 0, "partition": partition, "equal_steps": "pad"}
    lanes = [(r, k) for r in (0, 1) for k in (0, 1)]  # ranks 0 and 1 of 3: this node serves two of them
    if partition == "fixed":  # this seed gives lane (0, 0) an item twice an epoch
        share = Plan(sizes, rank=0, world_size=3, worker=0, num_workers=2, **kw).share(0)
        assert len(set(share)) < len(share)
    pipe = NodePipeline(
        s3_source.url,
        tmp_path / "node",
        64 * 1024,
        ranks=[0, 1],
        world_size=3,
        num_workers=2,
        storage_options=s3_source.options,
        **kw,
    )
    out: dict = {}
    with pipe:
        read_lanes(pipe, lanes, out)
    for r, k in lanes:
        assert out[(r, k)] == expected(names, sizes, r, k, 3, 2, **kw)
    for epoch in (0, 1):  # both ranks read 9 items an epoch (25 padded to 27)
        assert [sum(1 for k in (0, 1) for e, _ in out[(r, k)] if e == epoch) for r in (0, 1)] == [9, 9]
