"""Store faults injected at the network by a proxy between the client and the moto server."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from conftest import listed, via
from waiting import wait_until

from cachepipe import ItemFailedError, ObjectChangedError, Pipeline, StoreUnavailableError

KIB = 1024
MIB = 1024 * KIB


def _run(source, endpoint, tmp_path, **options):
    got = {}
    with Pipeline(
        source.url, tmp_path / "c", "1MiB", storage_options=via(source, endpoint), retry_backoff=0.01, **options
    ) as pipe:
        for path in pipe:
            got[path.name] = (path / "f").read_bytes()
        return got, pipe.stats()


def test_connections_dropped_mid_body_are_retried_without_corruption(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    data = remote_source.folders(6, {"f": 200 * KIB})
    manifest = listed(remote_source, tmp_path)
    proxy.inject("cut", 6)  # every new connection is cut after 2000 response bytes, 6 times
    with Pipeline(
        remote_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(remote_source, endpoint),
        manifest=manifest,
        retry_backoff=0.01,
        max_concurrency=2,
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
    assert got == {name: files["f"] for name, files in data.items()}
    assert proxy.injected["cut"] == 6


def test_the_first_items_are_fetched_by_every_download_thread(remote_source, fault_proxy, tmp_path):
    """Priority to the head of the queue: the item the consumer waits for is split into as many
    ranged GETs as there are download threads (parts of at least 256 KiB), and the one after it
    into parts for the one item ahead of it (256 or 512 KiB here, whether the first was handed
    out or not when they were cut), not one GET per ``part_size`` (1 MiB here), so that they do
    not arrive at a fraction of the link's speed."""
    proxy, endpoint = fault_proxy
    data = remote_source.folders(2, {"f": 1024 * KIB})
    options = via(remote_source, endpoint)
    with Pipeline(  # hedge=False: a part late on a loaded machine is not requested twice
        remote_source.url, tmp_path / "c", "8MiB", storage_options=options, max_concurrency=4, hedge=False
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
    assert got == {name: files["f"] for name, files in data.items()}
    parts = _object_gets(proxy, 1024 * KIB)
    first_item, second_item = (parts[key] for key in sorted(parts))
    assert first_item == [(start, start + 256 * KIB) for start in range(0, 1024 * KIB, 256 * KIB)]
    size = second_item[0][1]
    assert size in (256 * KIB, 512 * KIB)
    assert second_item == [(start, start + size) for start in range(0, 1024 * KIB, size)]


def test_the_default_part_size_follows_a_capacity_changed_live(remote_source, fault_proxy, tmp_path):
    """``part_size`` left to its default follows the capacity (``set_capacity``, a daemon's
    reload), not the capacity the pipeline opened with."""
    proxy, endpoint = fault_proxy
    data = remote_source.folders(2, {"f": 3 * MIB})
    options = via(remote_source, endpoint)
    with Pipeline(remote_source.url, tmp_path / "c", "4MiB", storage_options=options, max_concurrency=1, hedge=False) as pipe:
        it = iter(pipe)
        first = next(it)  # 4 MiB / 2: parts of 2 MiB; the second item does not fit beside it
        got = {first.name: (first / "f").read_bytes()}
        pipe.set_capacity("16MiB")  # 16 MiB / 2: parts of 8 MiB, so the second comes in one GET
        second = next(it)
        got[second.name] = (second / "f").read_bytes()
    assert got == {name: files["f"] for name, files in data.items()}
    parts = _object_gets(proxy, 3 * MIB)
    first_item, second_item = (parts[key] for key in sorted(parts))
    cut = first_item[0][1]
    assert first_item == [(0, cut), (cut, 3 * MIB)] and 2 * MIB - 64 * KIB < cut <= 2 * MIB  # (4 MiB - state) / 2
    assert second_item == [(0, 3 * MIB)]


def _object_gets(proxy, size):
    """The byte ranges ``[start, end)`` of the object GETs the proxy saw, sorted, by path
    (``size``: the objects' size, for a GET without a Range header)."""
    parts: dict[str, list[tuple[int, int]]] = {}
    for head in proxy.requests:
        first = head.split("\r\n")[0]
        if not first.startswith("GET") or "list-type" in first or "prefix=" in first:
            continue
        ranges = [line.split("=", 1)[1] for line in head.split("\r\n") if line.lower().startswith("range:")]
        start, end = (int(x) for x in ranges[0].split("-")) if ranges else (0, size - 1)
        parts.setdefault(first.split()[1].split("?")[0], []).append((start, end + 1))
    return {path: sorted(got) for path, got in parts.items()}


def test_an_item_restarted_after_an_etag_mismatch_keeps_its_place_in_line(s3_source, fault_proxy, tmp_path):
    """The consumers' next item, restarted after its body did not match its ETag, is fetched
    again before the items behind it, not after every item started meanwhile."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(4, {"f": 30 * KIB})
    manifest = listed(s3_source, tmp_path)  # the listing does not take the fault
    proxy.inject("corrupt", 1)  # the first GET: item000's
    options = via(s3_source, endpoint)
    with Pipeline(
        s3_source.url, tmp_path / "c", "1MiB", storage_options=options, manifest=manifest, verify="etag", max_concurrency=1
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
    assert got == {name: files["f"] for name, files in data.items()}
    order = [head.split()[1].split("/")[-2] for head in proxy.requests if head.startswith("GET") and "/item" in head.split()[1]]
    assert order[:2] == ["item000", "item000"], order


@pytest.mark.parametrize("download_processes", [0, 1], ids=["threads", "worker-processes"])
@pytest.mark.parametrize("part_size", [64 * KIB, None], ids=["part64k", "auto"])
def test_files_around_the_smallest_part_arrive_whole(s3_source, fault_proxy, tmp_path, download_processes, part_size):
    """Empty files, files at and around the smallest part (parts are cut when taken, so a file is
    whole or split depending on the moment), few threads, connections cut mid-body: every byte
    arrives, and nothing is left in staging."""
    proxy, endpoint = fault_proxy
    sizes = {"empty": 0, "a": 64 * KIB, "b": 64 * KIB + 1, "c": 256 * KIB, "d": 256 * KIB + 1, "e": 700 * KIB}
    data = s3_source.folders(4, sizes)
    options = via(s3_source, endpoint)
    manifest = listed(s3_source, tmp_path)
    proxy.inject("cut", 4)
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        "8MiB",
        storage_options=options,
        manifest=manifest,
        part_size=part_size,
        max_concurrency=2,
        download_processes=download_processes,
        retry_backoff=0.01,
    ) as pipe:
        got = {p.name: {f: (p / f).read_bytes() for f in sizes} for p in pipe}
        staging = tmp_path / "c" / ".cachepipe" / "staging"
        assert [p for p in staging.iterdir() if not p.name.startswith("x")] == []  # x*: acked items being deleted
    assert got == data
    assert proxy.injected["cut"] == 4


def test_throttling_and_refused_connections_are_retried(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    data = remote_source.folders(4, {"f": 10 * KIB})
    manifest = listed(remote_source, tmp_path)
    proxy.inject("503", 3)
    proxy.inject("refuse", 2)
    with Pipeline(
        remote_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(remote_source, endpoint),
        manifest=manifest,
        retry_backoff=0.01,
        max_concurrency=1,
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
        stats = pipe.stats()
    assert got == {name: files["f"] for name, files in data.items()}
    assert proxy.injected["503"] == 3 and proxy.injected["refuse"] == 2
    if remote_source.kind == "obs":  # the OBS store leaves all retrying to cachepipe
        assert stats.retries >= 5


def test_item_fails_after_retry_budget_naming_key_and_cause(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    remote_source.folders(2, {"f": 10 * KIB})
    manifest = listed(remote_source, tmp_path)
    proxy.inject("503", 10_000)
    with Pipeline(
        remote_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(remote_source, endpoint),
        manifest=manifest,
        retries=2,
        retry_backoff=0.01,
        max_concurrency=1,
    ) as pipe:
        with pytest.raises(ItemFailedError) as info:
            next(iter(pipe))
    assert "video/item000/f" in str(info.value)
    assert isinstance(info.value.__cause__, StoreUnavailableError)
    assert list((tmp_path / "c").iterdir()) == [tmp_path / "c" / ".cachepipe"]


def test_verify_etag_catches_corrupted_bytes_and_refetches(fault_proxy, s3_source, tmp_path, caplog):
    """A body that arrives with the right length but wrong bytes is caught by the MD5 ETag
    (logged as a failed verification, not as a local disk error)."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(3, {"f": 30 * KIB})
    manifest = listed(s3_source, tmp_path)
    proxy.inject("corrupt", 2)
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(s3_source, endpoint),
        manifest=manifest,
        verify="etag",
        retry_backoff=0.01,
        max_concurrency=1,
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
        stats = pipe.stats()
    assert got == {name: files["f"] for name, files in data.items()}
    assert proxy.injected["corrupt"] == 2 and stats.retries >= 1
    retried = [r.getMessage() for r in caplog.records if "staging freed" in r.getMessage()]
    assert retried and all(m.startswith("verification failed on item") for m in retried), retried


def test_store_down_for_a_while_then_back_resumes_by_itself(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    data = remote_source.folders(5, {"f": 8 * KIB})
    with Pipeline(
        remote_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(remote_source, endpoint),
        retry_backoff=0.05,
        retry_backoff_max=0.5,
        max_concurrency=2,
    ) as pipe:
        proxy.inject("refuse", 10**9)  # the store is down
        wait_until(lambda: pipe.stats().retries >= 4)
        assert pipe.stats().items_ready == 0 and pipe.stats().items_failed == 0
        proxy.clear()  # ... and back
        got = {p.name: (p / "f").read_bytes() for p in pipe}
    assert got == {name: files["f"] for name, files in data.items()}


def test_listing_is_retried(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    remote_source.folders(2, {"f": 10})
    proxy.inject("503", 2)
    with Pipeline(
        remote_source.url, tmp_path / "c", "1MiB", storage_options=via(remote_source, endpoint), retry_backoff=0.01
    ) as pipe:
        assert len(list(pipe)) == 2
    assert proxy.injected["503"] == 2


def test_failed_open_releases_the_cache(remote_source, fault_proxy, tmp_path):
    proxy, endpoint = fault_proxy
    remote_source.folders(2, {"f": 10})
    proxy.inject("503", 10**9)
    failing = Pipeline(
        remote_source.url, tmp_path / "c", "1MiB", storage_options=via(remote_source, endpoint), retries=1, retry_backoff=0.01
    )
    with pytest.raises(StoreUnavailableError):
        failing.open()
    proxy.clear()
    with Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=via(remote_source, endpoint)) as pipe:
        assert len(list(pipe)) == 2
    with pytest.raises(RuntimeError, match="create a new Pipeline"):
        failing.open()


def test_index_retries_a_transient_listing_error(remote_source, fault_proxy, tmp_path):
    from cachepipe.manifest import index, read_manifest

    proxy, endpoint = fault_proxy
    remote_source.folders(2, {"f": 10})
    proxy.inject("503", 2)
    manifest = index(remote_source.url, tmp_path / "m.gz", storage_options=via(remote_source, endpoint))
    assert len(read_manifest(tmp_path / "m.gz").catalog) == len(manifest.catalog) == 2
    assert proxy.injected["503"] == 2


def _item_get(head: str) -> bool:
    return head.startswith("GET") and "/item" in head.split()[1]


def _requests_at_once(fault_proxy, source, tmp_path, data, name: str, expected: int, held=_item_get, **options) -> int:
    """Hold every GET that ``held`` accepts until ``expected`` arrived (or 60 s passed) and 0.3 s
    more: the GETs held meanwhile, none answered. Then the whole run's bytes are checked against
    ``data``."""
    proxy, endpoint = fault_proxy
    gate, first = threading.Event(), len(proxy.requests)
    proxy.hold(held, gate, limit=600)  # none answered before they are counted, however long that takes
    manifest = listed(source, tmp_path)
    with Pipeline(
        source.url, tmp_path / name, "64MiB", storage_options=via(source, endpoint), manifest=manifest, **options
    ) as pipe:
        deadline = time.monotonic() + 60  # a loaded run had seen none of the large items' GETs after 10 s
        while sum(map(held, proxy.requests[first:])) < expected and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)
        at_once = sum(map(held, proxy.requests[first:]))
        gate.set()
        got = {p.name: {f.name: f.read_bytes() for f in Path(p).iterdir()} for p in pipe}
    assert got == data and proxy.hold_timeouts == 0
    return at_once


def test_items_of_small_files_go_over_more_requests_than_large_ones(s3_source, fault_proxy, tmp_path):
    """An item whose files are all of at most 256 KiB is short requests: up to ``max_concurrency``
    (64) of them are in flight, not only as many as for items with a larger file
    (``max_large_requests``, 16); ``max_concurrency`` bounds them all."""
    data = s3_source.folders(40, {"f": 10 * KIB})
    assert _requests_at_once(fault_proxy, s3_source, tmp_path, data, "default", 40) == 40
    assert _requests_at_once(fault_proxy, s3_source, tmp_path, data, "four", 4, max_concurrency=4) == 4


def test_the_requests_of_large_items_in_flight_are_at_most_max_large_requests(s3_source, fault_proxy, tmp_path):
    """Also when the threads that fetched items of small files go on to a large one: its parts
    wait for a thread of the ``max_large_requests`` ones."""
    data = s3_source.folders(40, {"f": 10 * KIB})
    rng = random.Random(1)
    for i in range(40, 48):
        body = rng.randbytes(2 * MIB)
        s3_source.put(f"item{i:03d}/x", body)
        data[f"item{i:03d}"] = {"x": body}

    def large_get(head: str) -> bool:
        return _item_get(head) and head.split()[1].endswith("/x")

    assert _requests_at_once(fault_proxy, s3_source, tmp_path, data, "default", 16, held=large_get) == 16
    assert _requests_at_once(fault_proxy, s3_source, tmp_path, data, "three", 3, held=large_get, max_large_requests=3) == 3


@pytest.mark.parametrize("processes", [0, 1])
def test_close_aborts_a_download_whose_body_stopped_coming(remote_source, fault_proxy, tmp_path, processes):
    # A store that stopped sending mid-body held close() (and so a daemon's SIGTERM) for as long
    # as a read may wait (60 s), past systemd's TimeoutStopSec: close waited for the download
    # threads before it closed the store. Now it aborts the store's requests first.
    proxy, endpoint = fault_proxy
    data = remote_source.folders(2, {"f": 200 * KIB})
    manifest = listed(remote_source, tmp_path)  # only the GETs go through the proxy
    proxy.inject("stall", 100)  # every connection: 2,000 bytes of the response, then silence, open
    pipe = Pipeline(
        remote_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=via(remote_source, endpoint),
        manifest=manifest,
        max_concurrency=1,
        retry_backoff=0.01,
        download_processes=processes,
    )
    pipe.open()
    closed = threading.Event()
    closing = threading.Thread(target=lambda: (pipe.close(), closed.set()))
    try:
        wait_until(lambda: any(map(_item_get, proxy.requests)), what="an item's GET")
        closing.start()
        wait_until(closed.is_set, timeout=20, what="close() while the store holds the body")
    finally:
        if closing.is_alive():
            proxy.drop_all()  # the fix failed: let the close end for the thread check
        if closing.ident is not None:
            closing.join()
        else:
            pipe.close()
    assert proxy.injected["stall"] >= 1
    assert pipe.stats().items_failed == 0  # not an item failure: the pipeline is closing
    staging = tmp_path / "c" / ".cachepipe" / "staging"
    assert not staging.exists() or not any(staging.iterdir())
    # the journal is whole: the same cache opens and delivers every item
    with Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=remote_source.options, manifest=manifest) as again:
        got = {p.name: (p / "f").read_bytes() for p in again}
    assert got == {name: files["f"] for name, files in data.items()}


def test_closing_one_of_two_pipelines_on_one_store_object_cuts_its_own_requests_only(remote_source, fault_proxy, tmp_path):
    # Two pipelines given one store object (store=), each with a GET of item000 held at the
    # proxy. Closing the first aborted the whole store: the second's GET in flight was cut, its
    # item failed with StoreClosedError, and every later request of the store was refused. Now
    # the first pipeline's close still returns while its own GET is held (cut), the second reads
    # every item, and a third pipeline on the same object after them too.
    from cachepipe.stores import open_store

    proxy, endpoint = fault_proxy
    data = remote_source.folders(3, {"f": 1000})
    manifest = listed(remote_source, tmp_path)  # only the GETs go through the proxy

    def first_item(head: str) -> bool:
        return _item_get(head) and "item000/f" in head.split()[1]

    gate = threading.Event()
    proxy.hold(first_item, gate)
    store = open_store(remote_source.url, via(remote_source, endpoint))
    opts = {"store": store, "manifest": manifest, "retry_backoff": 0.01}
    first = Pipeline(remote_source.url, tmp_path / "a", "1MiB", max_concurrency=1, **opts)
    second = Pipeline(remote_source.url, tmp_path / "b", "1MiB", **opts)
    closed = threading.Event()
    closing = threading.Thread(target=lambda: (first.close(), closed.set()))
    try:
        first.open()
        wait_until(lambda: sum(map(first_item, proxy.requests)) == 1, what="the first pipeline's GET of item000")
        second.open()
        wait_until(lambda: sum(map(first_item, proxy.requests)) == 2, what="the second pipeline's GET of item000")
        closing.start()
        wait_until(closed.is_set, timeout=20, what="close() while its GET is held")
        gate.set()
        got = {p.name: (p / "f").read_bytes() for p in second}  # before: ItemFailedError (StoreClosedError)
        second.close()
        with Pipeline(remote_source.url, tmp_path / "c", "1MiB", **opts) as third:
            again = {p.name: (p / "f").read_bytes() for p in third}
    finally:
        gate.set()
        if closing.ident is not None:
            closing.join()
        first.close()
        second.close()
        store.close()
    assert first.stats().items_failed == 0  # its cut GET is no item's failure: it was closing
    assert got == again == {name: files["f"] for name, files in data.items()}


@pytest.mark.parametrize("resume", [False, True], ids=["streamed-listing", "whole-listing"])
def test_close_from_another_thread_ends_an_open_whose_listing_gets_no_answer(remote_source, tmp_path, resume):
    # open() against an endpoint that accepts and never answers: Ctrl-C (or a close) waited for
    # the listing's page request, up to the 60 s read timeout. close() now aborts it, and open()
    # raises RuntimeError. resume=True lists in the opening thread, otherwise a listing thread.
    from faultproxy import silent

    remote_source.folders(1, {"f": 10})
    raised: list[BaseException] = []
    opening: threading.Thread | None = None
    try:
        with silent() as (endpoint, asked):
            options = via(remote_source, endpoint)
            pipe = Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=options, resume=resume)

            def run() -> None:
                try:
                    pipe.open()
                except BaseException as exc:  # noqa: BLE001 - the test checks it
                    raised.append(exc)

            opening = threading.Thread(target=run)
            opening.start()
            wait_until(asked.is_set, what="the listing's request")
            pipe.close()
            wait_until(lambda: not opening.is_alive(), timeout=20, what="open() to end after close()")
    finally:
        if opening is not None:
            opening.join()  # if the fix failed: the connections the block ended end open() too
    assert len(raised) == 1 and isinstance(raised[0], RuntimeError), raised
    assert "closed while it opened" in str(raised[0])
    staging = tmp_path / "c" / ".cachepipe" / "staging"
    assert not staging.exists() or not any(staging.iterdir())


def _second_part(key: str, head: str) -> bool:
    """Whether ``head`` is a GET of ``key``'s second part (bytes 262144 on: of 4 x 256 KiB)."""
    return head.startswith("GET") and key in head and "range: bytes=262144-" in head.lower()


def _hold_second_part(proxy, key: str) -> tuple[list[str], threading.Event]:
    """Hold the first GET of ``key``'s second part at the proxy until the returned gate is set;
    the list gets its head."""
    held: list[str] = []

    def late(head: str) -> bool:
        if not held and _second_part(key, head):
            held.append(head)
            return True
        return False

    gate = threading.Event()
    proxy.hold(late, gate, limit=600)  # held past any wait of the test: only a second request brings the part
    return held, gate


def test_a_late_part_of_the_item_the_consumer_waits_for_is_requested_again(remote_source, fault_proxy, tmp_path):
    """Hedged requests (``fetch_policy.hedge_in``): a part of the next item whose answer does not
    come (its request held by the network) is requested a second time once it ran twice as long
    as the item's other parts. The item comes whole while the first request is still held, and
    that request's bytes, let through afterwards, change nothing."""
    proxy, endpoint = fault_proxy
    data = remote_source.folders(2, {"f": MIB})
    first = min(data)
    manifest = listed(remote_source, tmp_path)
    held, gate = _hold_second_part(proxy, f"{first}/f")
    options = via(remote_source, endpoint)
    try:
        with Pipeline(
            remote_source.url, tmp_path / "c", "8MiB", storage_options=options, manifest=manifest, max_concurrency=4
        ) as pipe:
            # without a second request: TimeoutError, the part held until the gate; 30 s: the second
            # request waits for twice the other parts' time (the test below passed 10 s under load)
            item = pipe.get(timeout=30)
            assert item is not None and item.name == first and held and not gate.is_set()
            assert (item / "f").read_bytes() == data[first]["f"]
            gate.set()  # the first request's answer comes now: its first write finds the part done
            wait_until(lambda: held[0] in proxy.ended, what="the first request's connection dropped")
            assert (item / "f").read_bytes() == data[first]["f"]
            rest = pipe.get(timeout=10)
            assert rest is not None and (rest / "f").read_bytes() == data[rest.name]["f"]
            # the held part was requested twice; another part may be too, on a loaded machine (one
            # ran twice as long as its item's others: 2 hedges in 1 of 20 runs of the test below)
            assert sum(_second_part(f"{first}/f", head) for head in proxy.requests) == 2
            assert pipe.stats().hedges >= 1
            pipe.ack(item)
            pipe.ack(rest)
            assert pipe.get(timeout=10) is None
    finally:
        gate.set()
    assert proxy.hold_timeouts == 0


def test_a_late_part_is_requested_again_once_the_consumer_moves_on_with_nothing_else_to_fetch(
    remote_source, fault_proxy, tmp_path
):
    """A late part of an item two ahead of the consumer is not hedged (``HEDGE_AHEAD``); once the
    consumer takes an item it is one ahead, and the hand-out wakes a download thread to hedge it,
    though nothing else is left to fetch and no part comes (before: its wait ended only with the
    held request, here never, until the gate)."""
    proxy, endpoint = fault_proxy
    data = remote_source.folders(3, {"f": MIB})
    last = max(data)
    manifest = listed(remote_source, tmp_path)
    held, gate = _hold_second_part(proxy, f"{last}/f")
    options = via(remote_source, endpoint)
    try:
        with Pipeline(
            remote_source.url,
            tmp_path / "c",
            "8MiB",
            storage_options=options,
            manifest=manifest,
            max_concurrency=4,
            part_size="256KiB",
        ) as pipe:
            # every part but the held one (a loaded machine may hedge one of them too: count the held part's)
            wait_until(lambda: pipe.stats().requests >= 11, what="every part but the held one")
            assert sum(_second_part(f"{last}/f", head) for head in proxy.requests) == 1  # two ahead: not hedged
            first = pipe.get(timeout=10)  # the last item is one ahead now
            assert first is not None and first.name == "item000"
            wait_until(
                lambda: sum(_second_part(f"{last}/f", head) for head in proxy.requests) == 2,
                what="the held part requested again",
            )
            assert held and not gate.is_set() and pipe.stats().hedges >= 1
            for expected in ("item001", last):
                # 30 s: once in a full run on a loaded machine the second request took over 10 s
                # (obs; not reproduced in 60 runs alone or beside the faults tests under load)
                item = pipe.get(timeout=30)
                assert item is not None and item.name == expected
                assert (item / "f").read_bytes() == data[expected]["f"]
                pipe.ack(item)
            pipe.ack(first)
            gate.set()
            assert pipe.get(timeout=10) is None
    finally:
        gate.set()
    assert proxy.hold_timeouts == 0


def test_a_second_request_refused_as_changed_fails_the_item_at_once(remote_source, fault_proxy, tmp_path):
    """The object is rewritten while a late part's first request is held: its second request is
    refused (HTTP 412, conditional on the listed ETag), an error of the store like any request's,
    so the item fails with ``ObjectChangedError`` now (before: the refusal was only logged, and
    the item waited for the held request)."""
    proxy, endpoint = fault_proxy
    data = remote_source.folders(2, {"f": MIB})
    first = min(data)
    manifest = listed(remote_source, tmp_path)
    held: list[str] = []

    def late(head: str) -> bool:  # the first item's second part: its first GET held
        if not _second_part(f"{first}/f", head):
            return False
        if held:  # its second request: the object changes before it reaches the store
            remote_source.put(f"{first}/f", bytes(MIB))
            return False
        held.append(head)
        return True

    gate = threading.Event()
    proxy.hold(late, gate, limit=600)  # held past any wait of the test: only the second request ends the item
    options = via(remote_source, endpoint)
    try:
        with Pipeline(
            remote_source.url, tmp_path / "c", "8MiB", storage_options=options, manifest=manifest, max_concurrency=4
        ) as pipe:
            with pytest.raises(ItemFailedError) as info:
                # before: TimeoutError, the item waited for the held request; 30 s: the second request
                # waits for twice the other parts' time (a loaded run passed 10 s, 1 of 20 runs)
                pipe.get(timeout=30)
            assert isinstance(info.value.__cause__, ObjectChangedError), info.value
            assert f"{first}/f" in str(info.value) and not gate.is_set()
            # the held part was requested twice; another part may be too, on a loaded machine (one
            # ran twice as long as its item's others: 2 hedges in 1 of 20 runs)
            assert sum(_second_part(f"{first}/f", head) for head in proxy.requests) == 2
            assert pipe.stats().hedges >= 1
            gate.set()  # the first request's answer (a 412 too now) changes nothing
            wait_until(lambda: held[0] in proxy.ended, what="the first request's connection dropped")
    finally:
        gate.set()
    assert proxy.hold_timeouts == 0


def test_with_hedge_false_a_late_part_is_waited_for(s3_source, fault_proxy, tmp_path):
    """``hedge=False``: each byte is requested once, so the item waits for its held part."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(1, {"f": MIB})
    manifest = listed(s3_source, tmp_path)
    gate = threading.Event()
    proxy.hold(lambda head: "range: bytes=262144-" in head.lower(), gate)
    options = via(s3_source, endpoint)
    try:
        with Pipeline(
            s3_source.url, tmp_path / "c", "8MiB", storage_options=options, manifest=manifest, max_concurrency=4, hedge=False
        ) as pipe:
            with pytest.raises(TimeoutError):
                pipe.get(timeout=1)  # with hedges: the item in about 0.2 s
            gate.set()
            item = pipe.get(timeout=10)
            assert item is not None and (item / "f").read_bytes() == data[item.name]["f"]
            assert pipe.stats().hedges == 0
    finally:
        gate.set()
