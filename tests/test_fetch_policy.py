from cachepipe.fetcher import HEAD_MIN_PART, auto_part_size, backoff_delay, item_part_size, split_ranges

MIB = 1024 * 1024


def test_split_ranges_cover_exactly():
    assert split_ranges(0, 4) == []
    assert split_ranges(4, 4) == [(0, 4)]
    assert split_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_the_default_part_size_gives_every_request_a_part_in_half_the_cache():
    assert auto_part_size(64 * MIB, 16) == 2 * MIB
    assert auto_part_size(256 * MIB, 16) == 8 * MIB
    assert auto_part_size(50 * 1024 * MIB, 16) == 8 * MIB  # large caches: 8 MiB parts
    assert auto_part_size(8 * MIB, 16) == 1 * MIB  # never below 1 MiB
    assert auto_part_size(64 * MIB, 4) == 8 * MIB


def test_the_consumers_next_item_is_split_over_every_download_thread():
    assert item_part_size(64 * MIB, 8 * MIB, 16, head=False) == 8 * MIB
    assert item_part_size(64 * MIB, 8 * MIB, 16, head=True) == 4 * MIB
    assert item_part_size(8 * MIB + 1024, 8 * MIB, 16, head=True) == -(-(8 * MIB + 1024) // 16)
    assert item_part_size(1 * MIB, 8 * MIB, 16, head=True) == HEAD_MIN_PART  # never below the floor
    assert item_part_size(1 * MIB, 128 * 1024, 16, head=True) == 128 * 1024  # nor above part_size
    assert item_part_size(1 * MIB, 8 * MIB, 1, head=True) == 1 * MIB  # one thread: one part


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
