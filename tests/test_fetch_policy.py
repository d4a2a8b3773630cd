from cachepipe.fetcher import backoff_delay, split_ranges


def test_split_ranges_cover_exactly():
    assert split_ranges(0, 4) == []
    assert split_ranges(4, 4) == [(0, 4)]
    assert split_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


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
