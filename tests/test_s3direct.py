"""The direct S3 GET path (cachepipe.stores.s3direct) against the moto server: with moto checking
every signature against IAM access keys, through the fault proxy (which records request heads),
and the addresses s3fs's client resolves."""

from __future__ import annotations

import faulthandler
import io
import os
import re
import socket
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from faultproxy import SEGMENT, once
from waiting import in_a_fork, wait_until

from cachepipe.stores.fsspec import FsspecStore
from cachepipe.stores.s3direct import BODY_AHEAD, LOW_WATER, MIN_MARK, body_read, kernel_at_least

BODY = bytes(range(256)) * 300  # 76,800 bytes
ODD_KEY = "c d/ü+x~=(1).bin"


def _get(store: FsspecStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    out = io.BytesIO()
    end = len(BODY) if end is None else end
    assert store.get(key, out, start, end) == end - start
    return out.getvalue()


def _through(source, endpoint: str) -> FsspecStore:
    """A store of ``source`` reaching the server at ``endpoint`` (the fault proxy), with its own connections."""
    return FsspecStore(source.url, {**source.options, "endpoint_url": endpoint, "skip_instance_cache": True})


def _gets(proxy, key: str) -> list[str]:
    return [head for head in proxy.requests if head.startswith(f"GET /data/video/{key} ")]


def test_signed_requests_pass_the_servers_signature_check(s3_source, moto_iam):
    """moto recomputes each SigV4 signature from the IAM secret: odd characters in keys, ranges,
    listing pages with continuation tokens."""
    s3_source.put(ODD_KEY, BODY)
    others = [f"more/{c}+%20{i}.bin" for i, c in enumerate("aé z")]
    for other in others:
        s3_source.put(other, b"x" * 10)
    (key, secret), _ = moto_iam.keys
    moto_iam.enforce()
    endpoint = s3_source.options["endpoint_url"]
    store = FsspecStore(s3_source.url, {"endpoint_url": endpoint, "key": key, "secret": secret, "skip_instance_cache": True})
    wrong = FsspecStore(s3_source.url, {"endpoint_url": endpoint, "key": key, "secret": "not-it", "skip_instance_cache": True})
    try:
        assert store._direct is not None
        assert store._direct.url("data", f"video/{ODD_KEY}") == f"{endpoint}/data/video/c%20d/%C3%BC%2Bx~%3D%281%29.bin"
        assert _get(store, ODD_KEY) == BODY
        assert _get(store, ODD_KEY, 1000, 1001) == BODY[1000:1001]
        assert _get(store, ODD_KEY, 5, len(BODY)) == BODY[5:]
        store.list_page_size = 2
        assert [(o.key, o.size) for o in store.list()] == sorted([(ODD_KEY, len(BODY))] + [(k, 10) for k in others])
        with pytest.raises(PermissionError, match=r"rejected the credentials .*SignatureDoesNotMatch") as info:
            _get(wrong, ODD_KEY)
        assert info.value.__cause__ is not None and info.value.code == "SignatureDoesNotMatch"
    finally:
        store.close()
        wrong.close()


def test_changed_credentials_are_used_from_the_next_request(s3_source, moto_iam, fault_proxy):
    """Refreshable credentials (as from an assumed role): when botocore refreshes them, the next
    direct GET is signed with the new key, without a rejected try first."""
    from aiobotocore.credentials import AioRefreshableCredentials
    from aiobotocore.session import AioSession
    from botocore.credentials import CredentialProvider

    proxy, endpoint = fault_proxy
    s3_source.put("a", BODY)
    s3_source.put("b", BODY[::-1])
    current = [moto_iam.keys[0]]

    async def fetch() -> dict:
        key, secret = current[-1]
        expiry = datetime.now(timezone.utc) + timedelta(hours=1)
        return {"access_key": key, "secret_key": secret, "token": None, "expiry_time": expiry.isoformat()}

    class Rotating(CredentialProvider):  # aiobotocore's resolver awaits load()
        METHOD = "cachepipe-test"

        async def load(self):
            # refresh due whenever asked (advisory window 2 h > 1 h to expiry), never mandatory
            return AioRefreshableCredentials.create_from_metadata(
                await fetch(), refresh_using=fetch, method=self.METHOD, advisory_timeout=7200, mandatory_timeout=0
            )

    session = AioSession()
    session.get_component("credential_provider").insert_before("env", Rotating())
    moto_iam.enforce()
    store = FsspecStore(s3_source.url, {"endpoint_url": endpoint, "session": session, "skip_instance_cache": True})
    try:
        assert store._direct is not None
        assert _get(store, "a") == BODY
        old, new = moto_iam.keys
        current.append(new)
        moto_iam.delete_key(old[0], signed_with=new)
        assert _get(store, "b") == BODY[::-1]
    finally:
        store.close()
    (get_a,), (get_b,) = _gets(proxy, "a"), _gets(proxy, "b")
    assert f"Credential={old[0]}/" in get_a
    assert f"Credential={new[0]}/" in get_b


def test_a_403_is_signed_again_once_then_access_denied(s3_source, fault_proxy):
    proxy, endpoint = fault_proxy
    s3_source.put("a", BODY)
    store = _through(s3_source, endpoint)
    try:
        assert store._direct is not None
        proxy.inject("403", 1)
        assert _get(store, "a") == BODY
        assert len(_gets(proxy, "a")) == 2
        proxy.inject("403", 2)
        with pytest.raises(PermissionError, match="video/a") as info:
            _get(store, "a")
        assert info.value.__cause__ is not None
        assert len(_gets(proxy, "a")) == 4 and proxy.injected["403"] == 3
    finally:
        store.close()


def test_the_signing_region_is_s3fs_clients(s3_source, moto_iam, fault_proxy):
    """A custom region: direct requests are signed for it, as s3fs's own requests are (and moto
    checks the signature with it)."""
    proxy, endpoint = fault_proxy
    s3_source.put("a", BODY)
    (key, secret), _ = moto_iam.keys
    moto_iam.enforce()
    options = {
        "endpoint_url": endpoint,
        "key": key,
        "secret": secret,
        "client_kwargs": {"region_name": "eu-west-1"},
        "skip_instance_cache": True,
    }
    store = FsspecStore(s3_source.url, options)
    try:
        assert store.exists("a")  # a HeadObject by s3fs's own client
        assert store._direct is not None and _get(store, "a") == BODY
        assert [o.key for o in store.list()] == ["a"]
    finally:
        store.close()
    heads = [
        next(h for h in proxy.requests if h.startswith(start))
        for start in ("HEAD /data/video/a ", "GET /data/video/a ", "GET /data?")
    ]
    scopes = [head.split(f"Credential={key}/")[1].split(",")[0] for head in heads]
    assert all(scope.endswith("/eu-west-1/s3/aws4_request") for scope in scopes), scopes


def test_addresses_are_the_ones_s3fs_client_resolves(s3_source):
    """Path style on a custom endpoint; virtual-host style on AWS (regional) and when configured.
    Resolving an address sends nothing."""
    endpoint = s3_source.options["endpoint_url"]
    port = endpoint.rsplit(":", 1)[1]
    cases = [
        ({"endpoint_url": endpoint}, f"{endpoint}/data/video/x.bin"),
        ({"client_kwargs": {"region_name": "eu-west-1"}}, "https://data.s3.eu-west-1.amazonaws.com/video/x.bin"),
        (
            {"endpoint_url": f"http://localhost:{port}", "config_kwargs": {"s3": {"addressing_style": "virtual"}}},
            f"http://data.localhost:{port}/video/x.bin",
        ),
    ]
    for options, url in cases:
        store = FsspecStore(s3_source.url, {"key": "testing", "secret": "testing", **options, "skip_instance_cache": True})
        assert store._direct is not None and store._direct.url("data", "video/x.bin") == url, options
        store.close()


def test_anonymous_gets_are_unsigned(s3_source, s3_client, fault_proxy):
    proxy, endpoint = fault_proxy
    s3_source.put("a", BODY)
    s3_client.put_object_acl(Bucket="data", Key="video/a", ACL="public-read")
    store = FsspecStore(s3_source.url, {"endpoint_url": endpoint, "anon": True, "skip_instance_cache": True})
    try:
        assert store._direct is not None and _get(store, "a") == BODY
    finally:
        store.close()
    (get,) = _gets(proxy, "a")
    assert "authorization:" not in get.lower()


def test_a_region_redirect_hands_the_bucket_to_s3fs(s3_source, fault_proxy):
    """S3 answers a request signed for the wrong region with its bucket's region; s3fs's client
    follows that, so the request, and every later one to that bucket, goes through s3fs."""
    proxy, endpoint = fault_proxy
    s3_source.put("a", BODY)
    store = _through(s3_source, endpoint)
    try:
        proxy.inject("redirect", 1)
        assert _get(store, "a", 10, 20) == BODY[10:20]
        assert proxy.injected["redirect"] == 1
        assert store._direct.url("data", "video/a") is None
        assert _get(store, "a") == BODY
    finally:
        store.close()


def test_a_body_read_under_the_low_water_mark_never_waits_for_bytes_that_will_not_come():
    """body_read's promise, read by read over bodies around its thresholds: under a mark above
    1 byte, at least that mark and BODY_AHEAD bytes of the body come after the read (what
    http.client or TLS may hold unread counts against BODY_AHEAD), and the mark is at most a
    quarter of the receive buffer; at most BODY_AHEAD and two MIN_MARKs of a body are read
    under 1 byte, and few reads are marked; a body of unknown length, or a receive buffer too
    small for a mark, is read under 1 byte."""
    sizes = (0, 1, BODY_AHEAD, BODY_AHEAD + 2 * MIN_MARK, LOW_WATER + BODY_AHEAD + 1, 2 * LOW_WATER + 7, 5 * 1024 * 1024 + 3)
    for size in sizes:
        for most in (1, 4096, LOW_WATER, 1024 * 1024):
            if size // most > BODY_AHEAD + 2 * MIN_MARK:
                continue  # reads of 1 byte through the thresholds are enough: not through MiBs (seconds of CPU)
            for buffer in (4 * MIN_MARK, 128 * 1024, 4 * LOW_WATER, 32 * 1024 * 1024):
                left, unmarked, marked = size, 0, 0
                while left:
                    mark, amount = body_read(left, most, buffer)
                    assert 1 <= amount <= min(most, left)
                    if mark > 1:
                        assert MIN_MARK <= mark <= min(LOW_WATER, buffer // 4) and left - amount >= mark + BODY_AHEAD
                        marked += 1
                    else:
                        unmarked += amount
                    left -= amount
                assert unmarked < min(size, BODY_AHEAD + 2 * MIN_MARK) + 1
                if most >= LOW_WATER and buffer >= 4 * LOW_WATER:
                    assert marked <= size // LOW_WATER + 6
    assert body_read(None, 4096, 1 << 20) == (1, 4096)
    assert body_read(10 << 20, 4096, 4 * MIN_MARK - 1) == (1, 4096)


def _voluntary_switches() -> int:
    """How often this thread has slept (the kernel's count, Linux)."""
    with open("/proc/thread-self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))


def test_a_body_that_trickles_in_wakes_its_reader_once_per_low_water_mark(s3_source, fault_proxy):
    """Over a link a body comes a packet at a time: the reading thread must not wake for each
    (a poll, a recv and two hand-overs of the interpreter's lock every few KiB). The proxy sends
    2 MiB in 1,024 pieces of 2 KiB a millisecond apart; the thread sleeps far fewer times."""
    proxy, endpoint = fault_proxy
    body = bytes(range(256)) * (8 * 1024)  # 2 MiB
    s3_source.put("warm", b"x")
    s3_source.put("big", body)
    proxy.trickle_bytes = 2048
    store = _through(s3_source, endpoint)
    try:
        assert store._direct is not None
        out = io.BytesIO()
        store.get("warm", out, 0, 1)  # the route's probe and the connection, before counting
        proxy.inject("trickle", 1)
        before = _voluntary_switches()
        out = io.BytesIO()
        assert store.get("big", out, 0, len(body)) == len(body)
        slept = _voluntary_switches() - before
    finally:
        store.close()
    assert out.getvalue() == body and proxy.injected["trickle"] == 1
    pieces = len(body) // 2048
    assert slept < pieces // 4, f"the reader slept {slept} times for {pieces} pieces"


def test_bodies_of_every_size_around_the_low_water_mark_come_whole_when_they_trickle_in(s3_source, fault_proxy):
    """Whole objects and ranges whose ends fall around the mark's thresholds, each coming in
    pieces: none waits for a byte that will not come (that would be the store's 60 s timeout)."""
    proxy, endpoint = fault_proxy
    edge = BODY_AHEAD + 2 * MIN_MARK  # the smallest body read under a mark
    body = bytes(range(251)) * (3 * LOW_WATER // 251 + 1)
    s3_source.put("obj", body)
    store = _through(s3_source, endpoint)
    ranges = [(0, 1), (0, edge - 1), (0, edge), (0, edge + 1), (3, edge + 4), (0, LOW_WATER + BODY_AHEAD + 5), (7, len(body))]
    try:
        proxy.inject("trickle", len(ranges))  # the moto server closes each connection after its response
        for start, end in ranges:
            out = io.BytesIO()
            assert store.get("obj", out, start, end) == end - start
            assert out.getvalue() == body[start:end], (start, end)
    finally:
        store.close()
    assert proxy.injected["trickle"] == len(ranges)


def test_a_range_past_the_end_of_a_marked_body_reads_the_body_whole(s3_source, fault_proxy):
    """A manifest is read with a range to 2**62 (any size to its end): over a network (the proxy's
    segments), a body long enough for a mark ends before the range does, and the moto server
    closes the connection after it. The read returns the body's bytes; it used to raise EBADF
    (the loop asked the closed socket for its receive buffer), which nothing retried."""
    _proxy, endpoint = fault_proxy
    body = bytes(range(256)) * 800  # 200 KiB
    s3_source.put("whole", body)
    store = _through(s3_source, endpoint)
    try:
        assert store._direct is not None
        for end in (1 << 62, len(body) + 10):
            out = io.BytesIO()
            assert store.get("whole", out, 0, end) == len(body)
            assert out.getvalue() == body
    finally:
        store.close()


def test_marks_are_used_from_linux_5_8():
    """Kernels before 5.8 could leave a mark unmet under memory pressure: no marks there."""
    assert kernel_at_least("5.8.0", (5, 8)) and kernel_at_least("6.18.44-fc-v445-x86_64", (5, 8))
    assert kernel_at_least("10.0", (5, 8))
    assert not kernel_at_least("5.4.0-150-generic", (5, 8)) and not kernel_at_least("4.19.112", (5, 8))
    assert not kernel_at_least("3.10.0-1160.el7.x86_64", (5, 8)) and not kernel_at_least("", (5, 8))


def test_a_body_cut_short_returns_what_came_and_the_next_request_is_whole(s3_source, fault_proxy):
    """The server's connection ends mid-body (after a mark was set): the bytes that came are
    written and counted, nothing raises (the fetcher's size check retries the part), and the
    next request, on a new connection, is whole."""
    proxy, endpoint = fault_proxy
    body = bytes(range(256)) * (8 * 1024)  # 2 MiB
    s3_source.put("big", body)
    store = _through(s3_source, endpoint)
    proxy.cut_after = 700_000  # response bytes, headers included
    try:
        proxy.inject("cut", 1)
        out = io.BytesIO()
        got = store.get("big", out, 0, len(body))
        assert 0 < got < len(body) and out.getvalue() == body[:got]
        assert _get(store, "big", 0, len(body)) == body
    finally:
        store.close()
    assert proxy.injected["cut"] == 1


def test_a_body_that_stops_coming_times_out(s3_source, fault_proxy):
    """The server goes silent mid-body and keeps the connection open: the read waits under a
    low-water mark, and still gives up after the connection's timeout (a TimeoutError, which
    the fetcher retries); the next request is whole."""
    proxy, endpoint = fault_proxy
    body = bytes(range(256)) * (8 * 1024)  # 2 MiB
    s3_source.put("big", body)
    store = _through(s3_source, endpoint)
    assert store._direct is not None
    store._direct.TIMEOUT = 0.5  # seconds, for the connections made from now on
    proxy.cut_after = 400_000
    try:
        proxy.inject("stall", 1)
        with pytest.raises(TimeoutError):
            store.get("big", io.BytesIO(), 0, len(body))
        assert _get(store, "big", 0, len(body)) == body
    finally:
        store.close()
    assert proxy.injected["stall"] == 1


class _RangeServer(ThreadingHTTPServer):
    """An S3 stand-in that keeps connections alive (moto closes each after its response), over
    Ethernet-sized TCP segments as :mod:`faultproxy` (so bodies are read under low-water
    marks): a GET of ``/bucket/<key>`` with a ``Range`` gets a 206 of that range, or with
    :attr:`longer` of the range to the object's end. Any signature passes."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = objects
        self.longer = False
        self.connections = 0
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _RangeHandler)
        self.thread = threading.Thread(target=self.serve_forever, name="test-range-server")

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, SEGMENT)  # advertised to clients
        super().server_bind()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RangeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    server: _RangeServer

    def setup(self) -> None:
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def do_GET(self) -> None:
        body = self.server.objects[self.path.removeprefix("/bucket/")]
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        assert found is not None, self.headers
        start, end = int(found[1]), int(found[2]) + 1
        if self.server.longer:
            end = len(body)
        self.send_response(206)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(body)}")
        self.end_headers()
        self.wfile.write(body[start:end])

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass


@pytest.fixture
def range_server():
    server = _RangeServer({})
    server.thread.start()
    yield server
    server.shutdown()
    server.server_close()  # joins the handler threads (the clients closed their connections)
    server.thread.join(5)


def _read_on_one_connection(server: _RangeServer, body: bytes, ranges: list[tuple[int, int]]) -> None:
    """GET each range of ``body`` (object ``obj``) in turn from ``server``: each whole and right,
    all over one connection."""
    server.objects["obj"] = body
    store = FsspecStore("s3://bucket/", {"endpoint_url": server.url, "key": "k", "secret": "s", "skip_instance_cache": True})
    assert store._direct is not None
    store._direct.TIMEOUT = 2.0  # a head left waiting behind a mark fails fast, not in 60 s
    try:
        for start, end in ranges:
            out = io.BytesIO()
            assert store.get("obj", out, start, end) == end - start, (start, end)
            assert out.getvalue() == body[start:end], (start, end)
    finally:
        store.close()
    assert server.connections == 1


def test_a_kept_alive_connection_serves_the_next_request_after_a_marked_body(range_server):
    """After a body read under low-water marks, the connection's mark is back to 1 byte: the
    next response on it, large or a few bytes, is read at once. One connection for them all."""
    body = bytes(range(251)) * (4 * 1024 * 1024 // 251)
    mib = 1024 * 1024
    _read_on_one_connection(range_server, body, [(0, mib), (mib, len(body)), (10, 20), (3, 300_003), (0, 5), (0, len(body))])


def test_a_206_longer_than_the_range_asked_for_writes_the_range_alone(range_server):
    """A server that answers a range with more (to the object's end): the range is written, the
    rest is read off the connection (its mark back to 1 byte first), which then serves the
    next request."""
    range_server.longer = True
    body = bytes(range(251)) * (2 * 1024 * 1024 // 251)
    _read_on_one_connection(range_server, body, [(0, 600_000), (100, 300_100), (0, 10), (0, 10)])


def test_a_connection_serves_the_next_request_whichever_thread_makes_it(range_server):
    """Connections are kept for the next request of any thread, the one used last first: GETs
    made one after another by four live threads go over one connection, not one per thread (a
    pool of 64 download threads would keep 64, most of them idle and cold)."""
    body = bytes(range(251)) * 40
    range_server.objects["obj"] = body
    store = FsspecStore(
        "s3://bucket/", {"endpoint_url": range_server.url, "key": "k", "secret": "s", "skip_instance_cache": True}
    )
    turns = [threading.Event() for _ in range(5)]
    got: list[bytes] = []

    def one(i: int) -> None:
        # each waits for the one before, however long it takes: a loaded run's first GET (the
        # store's session made) took over the 5 s waited here, and the second went first
        turns[i].wait(60)
        out = io.BytesIO()
        store.get("obj", out, i, i + 1000)
        got.append(out.getvalue())
        turns[i + 1].set()
        turns[4].wait(60)  # alive until the last has its answer

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        for thread in threads:
            thread.start()
        turns[0].set()
        for thread in threads:
            thread.join(120)
    finally:
        store.close()
    assert got == [body[i : i + 1000] for i in range(4)]
    assert range_server.connections == 1


_OBJECTS = {str(i): bytes([65 + i]) * 200_000 for i in range(4)}  # of one size: another's bytes fit


def _kept_alive(server: _RangeServer) -> FsspecStore:
    return FsspecStore("s3://bucket/", {"endpoint_url": server.url, "key": "k", "secret": "s", "skip_instance_cache": True})


def test_a_store_used_in_forked_processes_has_connections_of_its_own_in_each(range_server):
    """A store used in processes forked from one that had used it (DataLoader workers given the
    dataset's ``store=``) shared its pooled connection with them: processes sending on one
    connection read each other's responses (LineTooLong, BadStatusLine made of another
    object's bytes: each of 3 processes failed, in 3 runs; through a DataLoader, an item of
    another object's bytes, or a listing that read a GET's answer)."""
    range_server.objects.update(_OBJECTS)
    store = _kept_alive(range_server)
    size = len(_OBJECTS["0"])
    assert store.get("0", io.BytesIO(), 0, size) == size  # its connection, pooled

    def gets() -> None:
        for n in range(30):
            key = str((os.getpid() + n) % len(_OBJECTS))
            out = io.BytesIO()
            assert store.get(key, out, 0, size) == size
            assert out.getvalue() == _OBJECTS[key]

    codes: list[int] = []
    forks = [threading.Thread(target=lambda: codes.append(in_a_fork(gets))) for _ in range(3)]
    try:
        for fork in forks:
            fork.start()
        for fork in forks:
            fork.join()
        assert codes == [0, 0, 0]
        gets()  # here too, on the connection it pooled: the forks closed only their descriptors
    finally:
        store.close()


def test_a_process_forked_while_a_thread_probes_makes_its_own_probe(range_server):
    """A thread asking s3fs's client for a bucket's route (a probe: a credential lookup in it
    may take seconds) holds a lock, held for ever in a process forked meanwhile: its first GET
    waited for it (killed after 10 s). Held here as such a thread holds it."""
    range_server.objects["obj"] = BODY
    store = _kept_alive(range_server)
    try:
        with store._direct._probing:
            assert in_a_fork(lambda: _get(store, "obj"), wait=10) == 0
        assert _get(store, "obj") == BODY
    finally:
        store.close()


@pytest.mark.parametrize("direct", [True, False])
def test_a_store_used_in_a_forked_process_sends_through_a_filesystem_of_its_own(s3_source, tmp_path, direct):
    """s3fs's filesystem refuses to run in a process forked from the one that made it (fsspec's
    "This class is not fork-safe"): a store used in such a process failed each request that
    s3fs sends (an upload, an existence check; every GET and listing page without the direct
    path) with a permanent OSError naming that. Now the store makes a filesystem of its own
    there, at its first use."""
    s3_source.put("a", BODY)
    options = {**s3_source.options, "skip_instance_cache": True}
    if not direct:
        options["config_kwargs"] = {"read_timeout": 30}  # an option that the direct path leaves to s3fs
    store = FsspecStore(s3_source.url, options)
    assert store.direct is direct
    assert [o.key for o in store.list()] == ["a"]  # s3fs's session made here (the probe, or the listing)
    local = tmp_path / "up"
    local.write_bytes(b"up")

    def child() -> None:
        assert _get(store, "a") == BODY
        store.put(local, "b")
        assert store.exists("b")
        assert [o.key for o in store.list()] == ["a", "b"]

    try:
        assert in_a_fork(child) == 0
        assert _get(store, "a") == BODY  # the parent's filesystem, as it was
        assert store.exists("b")
    finally:
        store.close()


def _read(store, key: str) -> bytes:
    out = io.BytesIO()
    store.get(key, out, 0, 1 << 20)
    return out.getvalue()


def test_a_fork_amid_the_parents_get_and_upload_leaves_each_process_its_own(s3_client, fault_proxy, tmp_path):
    """A process forked while a thread of its parent waits on a GET of the direct path (its
    connection in flight) and another on an upload (s3fs's, in the parent's event loop) reads,
    lists and uploads through the parent's store object with connections of its own, and so does
    a process it forks in turn (a grandchild: the parents' filesystems it keeps are two); the
    parent's GET and upload, let go after the forks, end as they would have."""
    s3_client.create_bucket(Bucket="data")
    s3_client.put_object(Bucket="data", Key="in/a", Body=b"A" * 1000)
    proxy, endpoint = fault_proxy
    store = FsspecStore("s3://data/in/", {"endpoint_url": endpoint, "key": "k", "secret": "s", "skip_instance_cache": True})
    assert store.direct
    local = tmp_path / "up"
    local.write_bytes(b"up")
    gate = threading.Event()
    proxy.hold(once(lambda h: h.startswith("GET /data/in/a ")), gate)
    proxy.hold(once(lambda h: h.startswith("PUT /data/in/parent ")), gate, keep=True)
    got: list[object] = []
    threads = [
        threading.Thread(target=lambda: got.append(_read(store, "a"))),
        threading.Thread(target=lambda: got.append(store.put(local, "parent"))),
    ]

    def grandchild() -> None:
        assert _read(store, "a") == b"A" * 1000
        store.put(local, "grandchild")

    def child() -> None:
        assert _read(store, "a") == b"A" * 1000
        store.put(local, "child")
        faulthandler.cancel_dump_traceback_later()  # in_a_fork's, of this process: its thread is not in a fork of it
        assert in_a_fork(grandchild) == 0
        assert store.exists("grandchild")
        assert [o.key for o in store.list()] == ["a", "child", "grandchild"]

    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: len([h for h in proxy.requests if h.startswith(("GET /data/in/a ", "PUT /data/in/parent "))]) == 2)
        assert in_a_fork(child) == 0
    finally:
        gate.set()
        for thread in threads:
            thread.join()
    try:
        assert sorted(got, key=repr) == [None, b"A" * 1000]  # the upload, the GET
        assert [o.key for o in store.list()] == ["a", "child", "grandchild", "parent"]
        assert _read(store, "a") == b"A" * 1000
    finally:
        store.close()
