"""Retention policies (belady, lru, none) and the simulator, with no disk and no network; and the
cache's retention path on a real directory (the last test)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.plan import Plan, tick
from cachepipe.retention import (
    LRU,
    NEVER,
    Belady,
    NoRetention,
    PlanFuture,
    SequenceFuture,
    belady_min,
    compulsory_bytes,
    is_placeholder,
    make_policy,
    run,
    simulate,
)

FAST = settings(max_examples=100, deadline=None)


@st.composite
def workloads(draw, equal: bool):
    n = draw(st.integers(1, 8))
    sequence = draw(st.lists(st.integers(0, n - 1), min_size=0, max_size=40))
    sizes = [1] * n if equal else draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    capacity = draw(st.integers(max(sizes), max(sizes) * 5))
    return sequence, sizes, capacity


def brute_force_optimum(sequence, capacity):
    """Fewest misses for equal sizes (1 each): try every victim at every miss."""

    @cache
    def best(t, cache):
        if t == len(sequence):
            return 0
        x = sequence[t]
        if x in cache:
            return best(t + 1, cache)
        if len(cache) < capacity:
            return 1 + best(t + 1, cache | {x})
        return 1 + min(best(t + 1, (cache - {v}) | {x}) for v in cache)

    return best(0, frozenset())


# ---- hand-computed cases -----------------------------------------------------------------
def test_hand_computed_equal_sizes():
    seq, sizes = [0, 1, 2, 0, 1, 2], [1, 1, 1]
    # MIN: 0, 1, 2 miss (2 evicts 1, used at 4 after 0 at 3); 0 hit; 1 miss; 2 hit
    assert belady_min(seq, sizes, 2) == 4
    assert simulate("belady", seq, sizes, 2) == 4
    assert simulate("belady", seq, sizes, 2, prefetch=1) == 4
    # LRU on demand: every access misses on this cycle
    assert simulate("lru", seq, sizes, 2, prefetch=1) == 6
    assert simulate("none", seq, sizes, 2) == 6
    assert compulsory_bytes(seq, sizes) == 3


def test_hand_computed_sizes():
    seq, sizes = [0, 1, 0, 2, 1, 0], [3, 2, 4]
    # capacity 6: 0 (3) + 1 (2) fit; 0 hit; 2 (4) needs 3 more bytes: evict the farthest, 0 (next
    # use 5), which frees enough; 1 hit; 2 is dropped after its read (never again); 0 misses again
    assert belady_min(seq, sizes, 6) == 3 + 2 + 4 + 3
    assert simulate("belady", seq, sizes, 6, prefetch=1) == 12
    assert simulate("belady", seq, sizes, 6) == 12
    # capacity 7: the same, evicting 0 alone makes room (2 + 4 <= 7)
    assert belady_min(seq, sizes, 7) == 12
    # capacity 5: 2 (4) needs both gone: evict 0 (next 5) then 1 (next 4); both miss again
    assert belady_min(seq, sizes, 5) == 3 + 2 + 4 + 2 + 3
    assert simulate("belady", seq, sizes, 9) == 9  # everything fits: each item once


def test_per_step_downloads():
    result = run("belady", [0, 1, 0, 1], [5, 7], 12)
    assert list(result.per_step) == [5, 7, 0, 0]
    assert list(result.lead) == [0, 1, -1, -1]  # item 1's download started one step ahead
    assert result.bytes == 12


# ---- properties --------------------------------------------------------------------------
@FAST
@given(workloads(equal=True), st.one_of(st.none(), st.integers(1, 6)))
def test_belady_is_optimal_and_beats_lru_and_none_with_equal_sizes(work, prefetch):
    seq, sizes, capacity = work
    best = belady_min(seq, sizes, capacity)
    online = simulate("belady", seq, sizes, capacity, prefetch=prefetch)
    assert online == best
    assert online <= simulate("lru", seq, sizes, capacity, prefetch=prefetch)
    assert online <= simulate("none", seq, sizes, capacity, prefetch=prefetch)
    if len(seq) <= 14:
        assert best == brute_force_optimum(tuple(seq), capacity)


@FAST
@given(workloads(equal=False), st.one_of(st.none(), st.integers(1, 6)))
def test_online_belady_makes_the_offline_decisions_with_sizes(work, prefetch):
    seq, sizes, capacity = work
    assert simulate("belady", seq, sizes, capacity, prefetch=prefetch) == belady_min(seq, sizes, capacity)
    assert belady_min(seq, sizes, capacity) >= compulsory_bytes(seq, sizes)


@FAST
@given(workloads(equal=False), st.sampled_from(["belady", "lru", "none"]), st.integers(0, 12))
def test_the_cache_never_holds_more_than_its_capacity(work, name, reserve):
    seq, sizes, capacity = work
    policy = make_policy(name, sizes, SequenceFuture(seq), reserve=reserve)
    on_disk: set[int] = set()

    class Checked(type(policy)):  # observe every decision the simulator applies
        pass

    policy.__class__ = Checked
    real_victims, real_admit, real_ack = policy.choose_victims, policy.on_admit, policy.on_ack

    def choose_victims(needed, item, tick, *, urgent=False):
        victims = real_victims(needed, item, tick, urgent=urgent)
        for v in victims or ():
            assert v in on_disk and not policy.is_pinned(v)
            on_disk.discard(v)
        return victims

    def on_admit(item, tick):
        real_admit(item, tick)
        on_disk.add(item)
        assert sum(sizes[x] for x in on_disk) <= capacity
        assert policy.pinned_bytes + policy.retained_bytes == sum(sizes[x] for x in on_disk)

    def on_ack(item, tick):
        keep = real_ack(item, tick)
        if not keep:
            on_disk.discard(item)
        return keep

    policy.choose_victims, policy.on_admit, policy.on_ack = choose_victims, on_admit, on_ack
    downloaded = simulate(policy, seq, sizes, capacity)
    assert policy.pinned_bytes == 0
    assert downloaded >= compulsory_bytes(seq, sizes)


@FAST
@given(st.integers(1, 30), st.integers(1, 4), st.integers(0, 50), st.sampled_from(["belady", "lru"]))
def test_when_the_data_fits_later_epochs_download_nothing(n, epochs, seed, name):
    plan = Plan([10] * n, epochs=epochs, shuffle=True, seed=seed, rank=0, world_size=1)
    seq = [s.item for s in plan]
    result = run(name, seq, plan.sizes, capacity=10 * n)
    assert result.bytes == 10 * n
    assert sum(result.per_step[n:]) == 0


def test_without_retention_every_epoch_downloads_again():
    seq = [0, 1, 2] * 3
    assert simulate("none", seq, [1, 1, 1], 3, prefetch=1) == 9


# ---- the rules of the online policy ------------------------------------------------------
def belady_on(seq, sizes, reserve=0):
    return Belady(sizes, SequenceFuture(seq), reserve=reserve)


def test_never_evicts_an_item_needed_before_the_one_fetched():
    seq = [0, 1, 0, 2]
    policy = belady_on(seq, [1, 1, 1])
    policy.on_admit(0, 0)
    assert policy.on_ack(0, 0) is True  # 0 is read again at 2: retained
    assert policy.choose_victims(1, 2, 3) is None  # fetching tick 3 would evict 0, needed at 2
    assert policy.choose_victims(1, 2, 3, urgent=True) is None  # urgency never overrides this rule
    assert policy.is_retained(0)
    assert policy.choose_victims(1, 1, 1) == [0]  # for tick 1, 0 (needed at 2) may go
    assert not policy.is_retained(0) and policy.retained_bytes == 0


def test_forced_evicts_what_the_rules_keep_items_used_last_first():
    """A node's lane waits for the step and the lanes that would use the retained items first
    wait for that lane: ``forced`` waives both rules, and still takes the latest next use first."""
    seq = [0, 1, 2, 0, 1, 3]
    policy = belady_on(seq, [1, 1, 1, 1])
    for item, at in ((0, 0), (1, 1)):
        policy.on_admit(item, at)
        assert policy.on_ack(item, at) is True  # 0 read again at 3, 1 at 4
    assert policy.choose_victims(1, 3, 5, urgent=True) is None  # do no harm: both are needed before tick 5
    assert policy.choose_victims(1, 3, 5, forced=True) == [1]  # 1 is needed last
    assert policy.choose_victims(1, 3, 5, forced=True) == [0]
    assert policy.retained_bytes == 0 and policy.choose_victims(1, 3, 5, forced=True) is None


def test_waits_while_a_pinned_item_is_the_better_victim():
    # ticks: 0:a 1:b 2:c 3:b 4:a -- at tick 2, a (pinned, next 4) is farther than b (retained, next 3)
    a, b, c = 0, 1, 2
    seq = [a, b, c, b, a]
    policy = belady_on(seq, [1, 1, 1])
    policy.on_admit(b, 1)
    policy.on_ack(b, 1)  # b retained
    policy.on_admit(a, 0)  # a pinned, not yet acknowledged
    assert policy.choose_victims(1, c, 2) is None  # wait: a's ack frees a better victim
    assert policy.choose_victims(1, c, 2, urgent=True) == [b]
    policy2 = belady_on(seq, [1, 1, 1], reserve=5)
    policy2.on_admit(b, 1)
    policy2.on_ack(b, 1)
    policy2.on_admit(a, 0)
    assert policy2.choose_victims(1, c, 2) == [b]  # fewer pinned bytes than the reserve: evict, keep prefetching
    assert policy.on_ack(a, 0) is True  # a is read again at 4: retained, now the victim
    assert policy.choose_victims(1, c, 2) == [a]


def test_items_never_read_again_are_evicted_on_ack():
    policy = belady_on([0, 1], [1, 1])
    policy.on_admit(0, 0)
    assert policy.on_ack(0, 0) is False
    assert policy.retained_bytes == policy.pinned_bytes == 0


def test_a_retained_item_is_a_hit_and_pinned_again():
    policy = belady_on([0, 1, 0], [4, 1])
    policy.on_admit(0, 0)
    policy.on_ack(0, 0)
    assert policy.retained_bytes == 4
    assert policy.on_fetch(0, 2) is True
    assert policy.pinned_bytes == 4 and policy.retained_bytes == 0
    assert policy.on_fetch(1, 1) is False


def test_an_item_pinned_twice_stays_until_its_last_ack():
    for policy in (belady_on([0, 0], [1]), LRU([1]), NoRetention([1])):
        assert policy.on_fetch(0, 0) is False
        policy.on_admit(0, 0)
        assert policy.on_fetch(0, 1) is True
        assert policy.on_ack(0, 0) is True  # still pinned by step 1
        assert policy.pinned_bytes == 1
        policy.on_ack(0, 1)
        assert policy.pinned_bytes == 0


def test_lru_evicts_the_least_recently_acknowledged():
    policy = LRU([1, 1, 1])
    for t, x in enumerate([0, 1, 2]):
        policy.on_admit(x, t)
    for t, x in [(1, 1), (0, 0), (2, 2)]:
        assert policy.on_ack(x, t) is True
    assert policy.choose_victims(2, 3, 3) == [1, 0]
    assert policy.choose_victims(5, 3, 3) is None  # not enough retained: wait, evict nothing
    assert policy.is_retained(2)


def test_none_never_retains_and_waits_for_acks():
    policy = NoRetention([1, 1])
    policy.on_admit(0, 0)
    assert policy.choose_victims(0, 1, 1) == []
    assert policy.choose_victims(1, 1, 1) is None
    assert policy.on_ack(0, 0) is False


def test_forget_drops_a_failed_download():
    policy = belady_on([0, 0], [3])
    policy.on_admit(0, 0)
    policy.forget(0)
    assert policy.pinned_bytes == 0 and not policy.is_pinned(0)
    assert policy.on_fetch(0, 1) is False


def test_protocol_misuse_is_refused():
    policy = belady_on([0, 1], [1, 1])
    with pytest.raises(KeyError, match="item 0 is not pinned"):
        policy.on_ack(0, 0)
    policy.on_admit(0, 0)
    with pytest.raises(ValueError, match="already on disk"):
        policy.on_admit(0, 0)
    with pytest.raises(ValueError, match="retention policy 'mru'"):
        make_policy("mru", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the future"):
        make_policy("auto", [1])
    with pytest.raises(ValueError, match="reserve -1"):
        LRU([1], reserve=-1)
    with pytest.raises(ValueError, match="does not fit"):
        simulate("belady", [0], [5], 4)
    with pytest.raises(ValueError, match="does not fit"):
        belady_min([0], [5], 4)
    with pytest.raises(ValueError, match="prefetch 0"):
        simulate("none", [0], [1], 4, prefetch=0)


def test_heaps_stay_bounded_on_long_runs():
    n = 50
    plan = Plan([1] * n, epochs=40, shuffle=True, seed=2, rank=0, world_size=1)
    seq = [s.item for s in plan]
    policy = belady_on(seq, plan.sizes)
    simulate(policy, seq, plan.sizes, 20)
    assert len(policy._pheap) <= 2 * n + 64 and len(policy._rheap) <= 2 * n + 64


# ---- next uses from a plan ---------------------------------------------------------------
@FAST
@given(st.integers(1, 25), st.integers(1, 4), st.integers(1, 4), st.integers(0, 30), st.integers(1, 3))
def test_plan_future_matches_the_flattened_plan(n, epochs, world, seed, horizon):
    sizes = [1 + (i * 7) % 5 for i in range(n)]
    plan = Plan(sizes, epochs=epochs, shuffle=True, seed=seed, rank=world - 1, world_size=world)
    steps = list(plan)
    flat = SequenceFuture([s.item for s in steps])
    future = PlanFuture(plan, horizon=horizon)
    for i, s in enumerate(steps):
        got = future.next_use(s.item, s.tick)
        expected = flat.next_use(s.item, i)
        if expected == NEVER:
            assert got == NEVER or (is_placeholder(got) and got >> 32 == s.epoch + horizon)
        elif steps[expected].epoch <= s.epoch + horizon:
            assert got == steps[expected].tick
        else:  # known only as "after epoch + horizon", which is before the real next read
            assert is_placeholder(got) and got >> 32 == s.epoch + horizon and got < steps[expected].tick


@FAST
@given(
    st.integers(2, 20),
    st.integers(2, 4),
    st.integers(1, 4),
    st.integers(0, 30),
    st.integers(1, 3),
    st.floats(0.05, 1.0),
    st.booleans(),
)
def test_belady_on_a_plan_with_a_horizon(n, epochs, world, seed, horizon, share, fixed):
    sizes = [1] * n
    plan = Plan(sizes, epochs=epochs, shuffle=True, seed=seed, rank=0, world_size=world, partition="fixed" if fixed else "epoch")
    steps = list(plan)
    seq = [s.item for s in steps]
    capacity = max(1, int(share * n))  # up to the whole catalog: items outlive the horizon
    policy = Belady(plan.sizes, PlanFuture(plan, horizon=horizon))
    got = run(policy, seq, plan.sizes, capacity, ticks=[s.tick for s in steps]).bytes  # must not stall
    best = belady_min(seq, plan.sizes, capacity)
    assert got >= best
    if world == 1 or horizon >= epochs:  # every next read is within the horizon: MIN's decisions
        assert got == best


def test_an_item_past_the_horizon_can_still_be_evicted():
    # rank 0 of 2 reads item x in epoch 0, and (with horizon 1) not in epoch 1: its next use is a
    # placeholder "after epoch 1". In epoch 2, the placeholder is in the past: it must be looked
    # up again, not treated as "needed before the item being fetched" (which would stall).
    sizes = [1] * 8
    for seed in range(50):
        plan = Plan(sizes, epochs=3, shuffle=True, seed=seed, rank=0, world_size=2)
        later = set(plan.share(1))
        lost = [x for x in plan.share(0) if x not in later]
        if lost:
            break
    future = PlanFuture(plan, horizon=1)
    x = lost[0]
    policy = Belady(sizes, future)
    t = tick(0, list(plan.share(0)).index(x))
    policy.on_admit(x, t)
    key = future.next_use(x, t)
    assert is_placeholder(key) and key >> 32 == 1
    assert policy.on_ack(x, t) in (True, False)
    if policy.is_retained(x):
        y = next(i for i in plan.share(2) if i != x)
        fetch = tick(2, list(plan.share(2)).index(y))
        assert policy.choose_victims(1, y, fetch, urgent=True) == [x]


class Scripted:
    """A future with given answers: {(item, tick): next use}."""

    def __init__(self, answers):
        self.answers = answers

    def next_use(self, item, at):
        return self.answers[item, at]


def test_a_stale_placeholder_is_looked_up_again_before_choosing():
    a, b, c = 0, 1, 2
    after_epoch_1 = tick(1, 0xFFFFFFFF)
    future = Scripted(
        {
            (a, tick(0, 0)): after_epoch_1,  # a: not in epochs 1..1+horizon as seen from epoch 0
            (b, tick(2, 0)): tick(2, 5),  # b: read again soon
            (a, tick(2, 1)): tick(3, 0),  # a, asked again from epoch 2: in epoch 3, after b
        }
    )
    policy = Belady([1, 1, 1], future)
    policy.on_admit(a, tick(0, 0))
    policy.on_ack(a, tick(0, 0))
    policy.on_admit(b, tick(2, 0))
    policy.on_ack(b, tick(2, 0))
    assert policy.choose_victims(1, c, tick(2, 1)) == [a]  # a stale bound would have made it b
    assert policy.is_retained(b)


def test_plan_future_finds_a_later_read_in_the_same_epoch():
    plan = Plan([1] * 6, epochs=2, shuffle=True, seed=1, rank=0, world_size=1)
    share = list(plan.share(0))
    future = PlanFuture(plan)
    assert future.next_use(share[4], tick(0, 1)) == tick(0, 4)  # asked at another item's step
    assert future.next_use(share[4], tick(0, 4)) >> 32 == 1  # at its own step: the next epoch
    with pytest.raises(ValueError, match="reads item"):
        SequenceFuture([0, 1]).next_use(1, 0)


def test_plan_future_on_an_endless_plan():
    plan = Plan([1] * 4, epochs=None, shuffle=True, seed=5, rank=0, world_size=1)
    future = PlanFuture(plan)
    future.prepare(0)
    step = next(iter(plan))
    nxt = future.next_use(step.item, step.tick)
    assert nxt >> 32 == 1 and plan.share(1)[nxt & 0xFFFFFFFF] == step.item
    with pytest.raises(ValueError, match="horizon 0"):
        PlanFuture(plan, horizon=0)


def test_an_item_retained_twice_with_one_key_is_one_victim():
    # Retained, handed out again at the same step (a resumed pass: recovered items are retained
    # as of the resume point, then fetched there), acked: two heap entries with the same key.
    policy = Belady([10, 10], SequenceFuture([0, 1, 0]))
    policy.on_admit(0, 0)
    assert policy.on_ack(0, 0)
    assert policy.on_fetch(0, 0)
    assert policy.on_ack(0, 0)
    assert policy.choose_victims(15, 1, 1, urgent=True) is None  # 10 retained bytes are not 15
    assert policy.choose_victims(10, 1, 1, urgent=True) == [0]


class _NeverAgain:
    """A future in which no item is read again: every acknowledged item is deleted, not kept."""

    def next_use(self, item: int, tick: int) -> int:
        return NEVER


def test_a_fetch_waits_while_the_items_earlier_copy_is_deleted(tmp_path):
    """With retention, an item acknowledged and not kept is forgotten by the policy before its
    files are gone. A fetch of it meanwhile must wait for them (one copy at a time), not stage a
    second copy that cannot be published onto the first (FileExistsError, found by bench_node.py
    when node lanes acknowledged in batches). Here item "a" (4,000 files) takes a while to delete,
    and "b", acknowledged in the same batch, is deleted after it."""
    import threading

    from waiting import wait_until

    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog(mode="folders")
    catalog.add("a", [(f"f{i:04d}", 0, None) for i in range(4000)])
    catalog.add("b", [("x", 10, None)])
    a, b = catalog[0], catalog[1]
    cache = Cache(tmp_path / "c", 1 << 20)
    cache.open()
    try:
        cache.recover(catalog, resume=False)
        cache.use_retention(make_policy("auto", [a.size, b.size], _NeverAgain()), catalog.names, 0)
        for step, item in enumerate((a, b)):
            assert cache.acquire(item, step) is True
            staged = Path(cache.stage(item))
            for f in item.files:
                (staged / f.rel).write_bytes(b"x" * f.size)
            cache.publish(staged, item)
        acks = threading.Thread(target=cache.evict_many, args=([("a", 0, 0), ("b", 0, 1)],))
        acks.start()
        wait_until(lambda: not cache.record.published)  # both acknowledged, neither kept; "a" is being deleted
        assert cache.acquire(b, 2) is True  # the next read of "b"
        assert not (tmp_path / "c" / "b").exists()  # its earlier copy was gone before this one was admitted
        staged = Path(cache.stage(b))
        (staged / "x").write_bytes(b"y" * 10)
        cache.publish(staged, b)
        acks.join()
    finally:
        cache.close()


def test_a_step_sharing_a_pinned_copy_moves_its_next_use_past_it():
    """A node's steps of one item share one copy, pinned by the first and acknowledged by the
    last: the copy's next use is the one after the latest step that shares it. Before, it was
    the one after the first: the sharing step itself, read already, so the item was kept with a
    next use in the past and never chosen for eviction."""
    policy = Belady([10, 10, 10], SequenceFuture([0, 1, 0, 2, 0]))
    policy.on_admit(0, 0)
    policy.reach(0, 2)  # the step at tick 2 shares the copy of tick 0
    policy.reach(0, 0)  # an earlier tick does not move it back
    assert policy.on_ack(0, 2) is True and policy._rkey[0] == 4  # kept for tick 4, the next use after 2
    policy.reach(1, 1)  # not pinned: nothing
    assert not policy.is_pinned(1) and not policy.is_retained(1)


def test_an_ack_that_names_the_next_read_overrides_the_shared_copy_s_key():
    """A node's lane that moved back drops a step that shared a copy, and will read it there
    again: the node names the tick before the item's first read that no lane has consumed, and
    the copy is kept by that, not by the next use after the latest step that shared it (none
    here: it was deleted, and downloaded again for the dropped step). With another pin still on
    the item, ``after`` changes nothing."""
    policy = Belady([10, 10, 10], SequenceFuture([0, 0, 1, 2]))
    policy.on_admit(0, 0)
    policy.reach(0, 1)  # the step at tick 1 shares the copy: no use after it
    assert policy.on_ack(0, 0, after=0) is True and policy._rkey[0] == 1  # kept for tick 1, read again
    assert policy.on_fetch(0, 1) is True and policy.on_ack(0, 1, after=1) is False  # nothing after it: deleted
    assert policy.retained_bytes == policy.pinned_bytes == 0
    policy.on_admit(2, 3)
    policy.on_fetch(2, 3)  # pinned twice
    assert policy.on_ack(2, 3, after=3) is True and policy.is_pinned(2) and not policy.is_retained(2)
