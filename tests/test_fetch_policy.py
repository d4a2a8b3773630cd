import os
from pathlib import Path

import pytest

from cachepipe.catalog import FileEntry, Item
from cachepipe.downloads import StagingFile
from cachepipe.fetch_policy import HEDGE_MIN_S, hedge_in
from cachepipe.fetcher import (
    HEAD_MIN_PART,
    PartQueue,
    auto_part_size,
    backoff_delay,
    download_threads,
    item_part_size,
    items_ahead,
)
from cachepipe.hedging import Flight, Superseded

MIB = 1024 * 1024


def test_the_default_part_size_gives_every_request_a_part_in_half_the_cache():
    assert auto_part_size(64 * MIB, 16) == 2 * MIB
    assert auto_part_size(256 * MIB, 16) == 8 * MIB
    assert auto_part_size(50 * 1024 * MIB, 16) == 8 * MIB  # large caches: 8 MiB parts
    assert auto_part_size(8 * MIB, 16) == 1 * MIB  # never below 1 MiB
    assert auto_part_size(64 * MIB, 4) == 8 * MIB


def test_the_consumers_next_item_is_split_over_every_download_thread():
    assert item_part_size(64 * MIB, 8 * MIB, 16, ahead=0) == 4 * MIB
    assert item_part_size(8 * MIB + 1024, 8 * MIB, 16, ahead=0) == -(-(8 * MIB + 1024) // 16)
    assert item_part_size(1 * MIB, 8 * MIB, 16, ahead=0) == HEAD_MIN_PART  # never below the floor
    assert item_part_size(1 * MIB, 128 * 1024, 16, ahead=0) == 128 * 1024  # nor above part_size
    assert item_part_size(1 * MIB, 8 * MIB, 1, ahead=0) == 1 * MIB  # one thread: one part


def test_parts_grow_with_the_items_ahead_until_part_size():
    # 16 threads, 8 MiB items, 2 MiB parts: the parts in flight hold the items ahead and this one
    sizes = [item_part_size(8 * MIB, 2 * MIB, 16, ahead) for ahead in range(5)]
    assert sizes == [MIB // 2, MIB, 3 * MIB // 2, 2 * MIB, 2 * MIB]
    assert item_part_size(64 * MIB, 8 * MIB, 16, ahead=1) == 8 * MIB
    assert item_part_size(50 * 1024, 8 * MIB, 16, ahead=0) >= 50 * 1024  # a small file is one GET


def test_backoff_grows_caps_and_keeps_half():
    assert backoff_delay(0, 0.2, 10, rand=lambda: 0.0) == 0.1
    assert backoff_delay(0, 0.2, 10, rand=lambda: 1.0) == 0.2
    assert backoff_delay(3, 0.2, 10, rand=lambda: 1.0) == 1.6
    assert backoff_delay(30, 0.2, 10, rand=lambda: 0.0) == 5.0
    # the default budget (12 retries) waits 36 to 73 s in all
    assert (
        36
        < sum(backoff_delay(a, 0.2, 10, rand=lambda: 0.0) for a in range(12))
        < sum(backoff_delay(a, 0.2, 10, rand=lambda: 1.0) for a in range(12))
        < 73
    )


def _item(name, *sizes):
    files = tuple(FileEntry(f"{name}/f{i}", f"f{i}", size) for i, size in enumerate(sizes))
    return Item(name, files, sum(sizes), is_file=False)


def _queue(queue, job, turn, item):
    return queue.add(job, item.size, turn, ((f, Path(item.name) / f.rel) for f in item.files))


def test_parts_are_cut_when_taken_for_the_items_ahead_then():
    """The second item's parts are cut for what is ahead of it when a thread takes them, not
    when it started: once the first item is handed out it is the head, and goes over every thread."""
    queue, part_size = PartQueue(concurrency=4), 2 * MIB
    _queue(queue, "a", 0, _item("a", 2 * MIB))
    _queue(queue, "b", 1, _item("b", 2 * MIB))
    taken = [queue.take(0, part_size) for _ in range(4)]
    assert [(s.job, start, end) for s, _, _, start, end in taken] == [("a", i * MIB // 2, (i + 1) * MIB // 2) for i in range(4)]
    assert queue.take(0, part_size)[3:] == (0, MIB)  # "b", one item ahead: parts of 1 MiB
    part = queue.take(1, part_size)  # "a" handed out: "b" is next, 512 KiB parts
    assert (part[0].job, part[3], part[4]) == ("b", MIB, MIB + MIB // 2)


def test_items_still_coming_count_as_ahead_only_while_the_consumers_outpace_the_items():
    assert items_ahead(3, None) == 3  # the consumers wait for every item: the link is the limit
    assert items_ahead(-1, None) == 0
    # a consumer slower than the items (or none seen yet): the items ready ahead, less the next one
    assert [items_ahead(3, fresh) for fresh in range(5)] == [0, 0, 1, 2, 2]
    assert items_ahead(1, 4) == 0  # the next item is ready, and this one comes after it


def test_for_a_consumer_slower_than_the_items_each_item_goes_over_every_thread_until_two_are_ready():
    """The slow consumer of bench_link's link: its first item is handed out, the second is
    ready; the third and fourth are cut over every thread, in turn, as the next item is, where
    counting the items still coming as ahead shared the link between them."""
    queue, part_size = PartQueue(concurrency=4), 2 * MIB
    for turn, name in enumerate("abcd"):
        _queue(queue, name, turn, _item(name, 2 * MIB))
    for _ in range(6):  # "a" (4 parts of 512 KiB, the next item) and "b" (2 of 1 MiB, one ahead)
        queue.take(0, part_size)
    # "a" handed out, "b" ready (fresh 1), "c" and "d" still coming
    assert queue.take(1, part_size, fresh=1)[3:] == (0, MIB // 2)  # "c": as the next item
    assert queue.take(1, part_size)[3:] == (MIB // 2, 3 * MIB // 2)  # consumers outpacing: "b" ahead counts
    assert queue.take(1, part_size, fresh=1)[3:] == (3 * MIB // 2, 2 * MIB)
    assert queue.take(1, part_size, fresh=1)[3:] == (0, MIB // 2)  # "d": "c", still coming, does not count
    assert queue.take(1, part_size, fresh=2)[3:] == (MIB // 2, 3 * MIB // 2)  # "b" and "c" ready: one counts
    assert queue.take(1, part_size)[3:] == (3 * MIB // 2, 2 * MIB)


def test_parts_follow_the_order_items_started_file_by_file():
    queue = PartQueue(concurrency=1)
    _queue(queue, "a", 0, _item("a", 10, 0, 3 * MIB // 2))
    _queue(queue, "b", 1, _item("b", 5))
    got = []
    while (part := queue.take(0, MIB)) is not None:
        got.append((part[0].job, part[1].rel, part[3], part[4]))
    assert got == [("a", "f0", 0, 10), ("a", "f2", 0, MIB), ("a", "f2", MIB, 3 * MIB // 2), ("b", "f0", 0, 5)]
    assert _queue(queue, "c", 2, _item("c", 0, 0)) is None  # nothing to request


def test_an_item_is_done_after_its_last_part_or_when_it_gives_up():
    queue = PartQueue(concurrency=1)
    _queue(queue, "a", 0, _item("a", 2 * MIB))
    first, second = queue.take(0, MIB), queue.take(0, MIB)
    assert not queue.done(first[0])  # the second is running
    assert queue.done(second[0])
    _queue(queue, "b", 1, _item("b", 3 * MIB))
    first, second = queue.take(0, MIB), queue.take(0, MIB)
    assert not queue.done(first[0], give_up=True)  # failed: the third part is never requested ...
    assert queue.take(0, MIB) is None
    assert queue.done(second[0])  # ... so the second is the last


def test_without_room_for_a_large_request_only_items_of_small_files_are_taken_and_never_out_of_turn():
    """``large=False`` (``max_large_requests`` in flight): an item whose files are all of at most
    HEAD_MIN_PART is taken; the next part of an item with a larger file is not (also its small
    files), and nothing behind it is taken before it."""
    queue = PartQueue(concurrency=2)
    _queue(queue, "a", 0, _item("a", HEAD_MIN_PART, 10))
    _queue(queue, "b", 1, _item("b", 5, 2 * MIB + 1))
    _queue(queue, "c", 2, _item("c", 7))
    assert [queue.take(0, MIB, large=False)[0].job for _ in range(2)] == ["a", "a"]  # small: one request a file
    assert queue.take(0, MIB, large=False) is None  # "b" has a file over the floor: its 5 bytes wait too, and "c"
    part = queue.take(0, MIB)
    assert (part[0].job, part[1].rel, part[3], part[4]) == ("b", "f0", 0, 5)
    assert [queue.take(0, MIB)[3:] for _ in range(2)] == [(0, MIB), (MIB, 2 * MIB)]  # cut into parts
    assert queue.take(0, MIB, large=False) is None  # its last byte is a large item's request too
    assert queue.take(0, MIB)[1:] == (FileEntry("b/f1", "f1", 2 * MIB + 1), Path("b/f1"), 2 * MIB, 2 * MIB + 1)
    assert queue.take(0, MIB, large=False)[0].job == "c"  # small again, in turn


def test_download_threads_keep_one_working_while_the_others_wait_for_requests():
    assert download_threads(0.0, 0.0, 64) == 64  # nothing measured yet: the limit
    assert download_threads(10e-6, 100e-6, 64) == 2  # a request costs less than a part's work
    assert download_threads(0.0, 100e-6, 64) == 1
    assert download_threads(1e-3, 100e-6, 64) == 11  # 1 ms requests, 100 us of work each
    assert download_threads(16e-3, 100e-6, 64) == 64  # a remote link: the limit
    assert download_threads(1e-3, 100e-6, 4) == 4
    assert download_threads(1e-3, 100e-6, 1) == 1


def test_a_part_of_an_item_the_consumers_take_next_is_hedged_once_it_ran_twice_its_siblings_median():
    came = [0.2, 0.25, 0.1]  # the item's other parts: median 0.2 s
    assert hedge_in(0.1, came, ahead=0) == pytest.approx(0.3)  # due in 0.3 s: at 0.4 s
    assert hedge_in(0.4, came, ahead=0) == pytest.approx(0.0)
    assert hedge_in(1.0, came, ahead=1) == pytest.approx(-0.6)  # one item ahead: still hedged
    assert hedge_in(1.0, came, ahead=2) is None  # the consumers have two items to read meanwhile
    assert hedge_in(1.0, [0.2], ahead=0) is None  # one part that came says nothing of the link
    assert hedge_in(0.0, [0.001, 0.002], ahead=0) == pytest.approx(HEDGE_MIN_S)  # a nearby store: never sooner


def test_of_two_requests_racing_for_a_part_the_first_to_end_wins_and_the_other_writes_nothing_more(tmp_path):
    path = tmp_path / "staged"
    path.write_bytes(bytes(8))
    flight = Flight(part=None, began=0.0)
    first, second = flight.first, flight.race()
    with pytest.raises(RuntimeError, match="hedged once"):
        flight.race()
    late_fd, hedge_fd = os.open(path, os.O_WRONLY), os.open(path, os.O_WRONLY)
    late = StagingFile(late_fd, 0, first.guard(os.pwrite))
    first.watch(late, late_fd)
    late.write(b"ab")  # the first request is under way: a hedge starts from its third byte
    assert flight.written() == 2 and not flight.over
    hedge = StagingFile(hedge_fd, 2, second.guard(os.pwrite))
    second.watch(hedge, hedge_fd)
    hedge.write(b"cdefgh")
    second.close(os.close)
    assert second.claim() and flight.over and first.lost() and not second.lost()
    # the late request no longer holds the file open: a deleted item's space is freed at once
    assert os.readlink(f"/proc/self/fd/{late_fd}") == os.devnull
    assert not os.get_inheritable(late_fd)  # as the staging file was opened (O_CLOEXEC): no child process gets it
    with pytest.raises(Superseded):
        late.write(b"XX")  # its next bytes: refused, not written
    first.close(os.close)
    assert not first.claim()  # it ended too: the part was counted by the other
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(late_fd)  # closed once, by its owner
    assert path.read_bytes() == b"abcdefgh"


def test_a_request_that_opens_the_file_after_the_other_won_holds_it_open_no_longer(tmp_path):
    """A hedge (or a first request's retry) may open the staging file after the other request
    has ended: the part is counted, the item may be published and acknowledged, and a request
    that gets no answer would keep its space taken until it times out."""
    path = tmp_path / "staged"
    path.write_bytes(bytes(4))
    flight = Flight(part=None, began=0.0)
    first, second = flight.first, flight.race()
    assert first.claim()  # the first request ended before the second opened the file
    fd = os.open(path, os.O_WRONLY)
    out = StagingFile(fd, 0, second.guard(os.pwrite))
    second.watch(out, fd)
    assert os.readlink(f"/proc/self/fd/{fd}") == os.devnull
    with pytest.raises(Superseded):
        out.write(b"XX")
    second.close(os.close)
    assert path.read_bytes() == bytes(4)
