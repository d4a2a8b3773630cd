import threading
from collections.abc import Callable

import pytest
from waiting import wait_until

from cachepipe.broker import Broker, Closed, Failed


def test_ordered_waits_for_earlier_items():
    b = Broker(ordered=True)
    for _ in range(3):
        b.begin()
    b.put(2, "c", "C")
    b.put(1, "b", "B")
    with pytest.raises(TimeoutError):
        b.take(timeout=0.01)
    b.put(0, "a", "A")
    assert [b.take(0).name for _ in range(3)] == ["a", "b", "c"]
    b.finish()
    assert b.take(0) is None


def test_begin_gives_each_item_its_turn_and_served_the_items_ahead_of_it():
    b = Broker()
    assert b.begin() - b.served() == 0  # the consumers wait for this one next
    assert b.begin() - b.served() == 1
    b.put(0, "a", "A")
    assert b.begin() - b.served() == 2  # ready and never handed out still counts
    assert b.take(0).name == "a"
    b.put(1, "b", "B")
    assert b.begin() == 3  # its turn: 3 items were begun before it
    assert 3 - b.served() == 2  # "b" ready, "c" fetching


def test_served_counts_the_items_no_longer_ahead_of_the_consumers():
    b = Broker()
    turns = [b.begin() for _ in range(3)]  # turns 0, 1, 2: nothing served yet
    assert b.served() == 0 and turns == [0, 1, 2]
    b.put(1, "b", "B")
    assert b.served() == 0  # ready, never handed out: still ahead
    b.put(0, "a", "A")
    assert b.take(0).name == "a"
    assert b.served() == 1  # the item of turn 2 has 2 - 1 items ahead of it: "b" ready, "c" fetching
    b.fail(2, "c", OSError("gone"))
    assert b.take(0).name == "b"
    assert isinstance(b.take(0), Failed)
    assert b.served() == 3


def test_unordered_hands_out_what_is_ready():
    b = Broker(ordered=False)
    b.begin(), b.begin()
    b.put(1, "b", "B")
    assert b.take(0).name == "b"


def test_release_goes_to_the_front_and_ack_ends_the_lease():
    b = Broker()
    for seq, name in enumerate("ab"):
        b.begin()
        b.put(seq, name, name.upper())
    first = b.take(0)
    b.release(first.name)
    assert b.take(0).name == "a"
    b.ack("a")
    with pytest.raises(KeyError):
        b.ack("a")
    assert b.take(0).name == "b"


def test_failure_is_delivered_in_turn():
    b = Broker()
    b.begin(), b.begin()
    b.put(1, "b", "B")
    b.fail(0, "a", OSError("boom"))
    got = b.take(0)
    assert isinstance(got, Failed) and got.name == "a"
    assert b.take(0).name == "b"


def test_skip_moves_order_past_an_item():
    b = Broker()
    b.begin()
    b.put(1, "b", "B")
    b.skip(0)
    assert b.take(0).name == "b"


def test_close_wakes_blocked_consumer():
    b = Broker()
    errors = []

    def consumer():
        try:
            b.take()
        except Closed:
            errors.append("closed")

    t = threading.Thread(target=consumer)
    t.start()
    b.close()
    t.join(30)  # bounds a hang only
    assert errors == ["closed"] and not t.is_alive()


def _broker(pending, ready, handed, released):
    b = Broker()
    seq = 0
    for _ in range(pending + ready + handed):
        b.begin()
    for _ in range(ready + handed):
        b.put(seq, f"i{seq}", seq)
        seq += 1  # noqa: SIM113 - the counter continues across an inner loop
    for _ in range(handed):
        lease = b.take(0)
    for _ in range(released):
        b.release(lease.name)
    return b


@pytest.mark.parametrize(
    ("pending", "ready", "handed", "released", "passes"),
    [(2, 0, 0, 0, False), (1, 1, 0, 0, False), (1, 0, 1, 0, True), (1, 0, 1, 1, True), (0, 0, 0, 0, True)],
)
def test_prefetch_gate_counts_pending_and_unhanded(pending, ready, handed, released, passes):
    b = _broker(pending, ready, handed, released)
    done = threading.Event()
    t = threading.Thread(target=lambda: (b.wait_ahead_below(2), done.set()))
    t.start()
    # 30 s bounds a hang only; 0.2 s: a gate that must not open stays shut however long we wait
    assert done.wait(0.2 if not passes else 30) == passes
    b.close()  # wakes the gate if it is still waiting
    t.join()


def test_expired_lease_is_handed_out_again_and_stale_ack_rejected():
    b = Broker(lease_timeout=0.05)
    b.begin()
    b.put(0, "a", "A")
    b.finish()
    first = b.take(0)  # its deadline is fixed now: it expires 0.05 s from here
    b.lease_timeout = 3600  # the leases handed out from now on outlive any stall of the machine
    got = []

    def take() -> None:
        try:
            got.append(b.take())  # no timeout: only the expiry of the first lease can wake it
        except Closed:
            pass

    taker = threading.Thread(target=take)
    taker.start()
    taker.join(30)  # bounds a hang only
    if taker.is_alive():
        b.close()  # wakes it, so that the failure below does not leave a thread behind
        taker.join()
    assert not taker.is_alive() and len(got) == 1, "take() was not woken by the expiry of the first lease"
    second = got[0]  # the same item again, under a new lease
    assert second.name == "a" and second.id != first.id and b.redelivered == 1
    with pytest.raises(KeyError):
        b.ack("a", first.id)  # the dead consumer's late ack cannot evict the live lease
    b.renew("a", second.id)
    b.ack("a", second.id)
    assert b.take(0) is None


def test_stream_end_waits_for_expiring_leases_only():
    b = Broker(lease_timeout=3600)  # long: the lease cannot expire between the calls below, however slow
    b.begin()
    b.put(0, "a", "A")
    b.finish()
    lease = b.take(0)
    with pytest.raises(TimeoutError):
        b.take(0)  # the stream has not ended: the lease may still expire and its item come back
    b.ack(lease.name, lease.id)
    assert b.take(0) is None


def test_begin_many_gives_consecutive_turns_and_room_ahead_counts_them():
    b = Broker()
    assert b.room_ahead(5) == 5
    assert b.begin_many(3) == 0  # turns 0, 1, 2
    assert b.begin() == 3
    assert b.room_ahead(5) == 1  # 4 fetching
    b.put(0, "a", "A")
    assert b.room_ahead(5) == 1  # ready and never handed out: still ahead
    assert b.take(0).name == "a"
    assert b.room_ahead(5) == 2
    assert b.room_ahead(2) == -1  # over the limit already: none may begin (the producer waits instead)


def test_a_planning_failure_at_a_skipped_step_comes_in_the_turn_of_the_next_step():
    # Steps acknowledged before a restart are skipped: one is done already. Planning that stops
    # there is failed in the turn of the first step not done, after the items before it.
    b = Broker(ordered=True)
    b.begin_many(2)
    b.skip(2)
    b.fail(2, "<listing>", RuntimeError("planning broke"), begun=False, kind="stream")
    with pytest.raises(TimeoutError):
        b.take(timeout=0.01)  # not before items 0 and 1
    b.put(1, "b", "B")
    b.put(0, "a", "A")
    assert [b.take(0).name, b.take(0).name] == ["a", "b"]
    failed = b.take(0)
    assert isinstance(failed, Failed) and failed.seq == 3 and failed.kind == "stream"


def test_a_consumer_back_at_once_that_waits_outpaces_the_items_and_a_slower_one_does_not():
    now = [0.0]  # the broker's clock, moved by the test: no result depends on real time
    b = Broker(clock=lambda: now[0])
    for _ in range(3):
        b.begin()
    assert not b.outpaced()  # nothing known
    b.put(0, "a", "A")
    assert b.take(0).name == "a" and not b.outpaced()  # no wait

    def take_while(advance: float, then: Callable[[], object]) -> str:
        """take() in a thread; once it waits, move the clock by ``advance`` and call ``then``."""
        got: list[str] = []
        consumer = threading.Thread(target=lambda: got.append(b.take(10).name))
        consumer.start()
        wait_until(lambda: b._waiting == 1, what="the consumer to wait")
        now[0] += advance
        then()
        consumer.join()
        return got[0]

    # a slow consumer: back 0.5 s after its item, which comes 0.05 s later
    now[0] += 0.5
    assert take_while(0.05, lambda: b.put(1, "b", "B")) == "b"
    assert not b.outpaced()  # it waited less than the time it took to come back
    # a fast consumer: back at once, and waits 0.2 s
    seen: list[bool] = []
    assert take_while(0.2, lambda: (seen.append(b.outpaced()), b.put(2, "c", "C"))) == "c"
    assert seen == [True]  # while it waited
    assert b.outpaced()  # and after
    assert b.fresh() == 0
