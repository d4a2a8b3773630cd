"""The native S3 GET engine (``engine="obstore"``, cachepipe.stores.s3native) against the moto server,
and through the fault proxy for the errors a server or a network makes."""

from __future__ import annotations

import gc
import io
import logging
import os
import select
import signal
import socket
import time
import weakref

import pytest
from conftest import listed
from waiting import in_a_fork

from cachepipe import ConfigError, ObjectChangedError, Pipeline, StoreUnavailableError, StoreUnreachableError
from cachepipe.errors import is_transient
from cachepipe.stores import check_store, open_store

pytest.importorskip("obstore")

from cachepipe.stores.s3native import NativeS3Store  # after the skip: needs obstore

KIB = 1024
MIB = 1024 * KIB
BODY = bytes(range(256)) * 300  # 76,800 bytes
ODD_KEY = "c d/ü+x~=(1).bin"
PROFILE = "aws_access_key_id = fromprofile\naws_secret_access_key = s\n"  # a shared credentials file's lines


def _options(endpoint: str) -> dict:
    return {"engine": "obstore", "endpoint_url": endpoint, "key": "testing", "secret": "testing"}


@pytest.fixture
def native(s3_source):
    store = open_store(s3_source.url, _options(s3_source.options["endpoint_url"]))
    yield store
    store.close()


def _through(fault_proxy, s3_source):
    """``(proxy, endpoint, store)``: a native store on ``s3_source`` whose requests go through the proxy."""
    proxy, endpoint = fault_proxy
    return proxy, endpoint, open_store(s3_source.url, _options(endpoint))


def test_engine_option_opens_the_native_store_and_is_checked():
    assert isinstance(open_store("s3://data/video/", _options("http://127.0.0.1:1")), NativeS3Store)
    with pytest.raises(ConfigError, match="'obstor'"):
        open_store("s3://data/video/", {**_options("http://127.0.0.1:1"), "engine": "obstor"})
    with pytest.raises(ConfigError, match="s3:// URLs only"):
        open_store("memory://data/video", {"engine": "obstore"})


def test_an_option_the_engine_cannot_honour_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="'s3_additional_kwargs'"):
        open_store("s3://data/video/", {**_options("http://127.0.0.1:1"), "s3_additional_kwargs": {"RequestPayer": "requester"}})
    with pytest.raises(ConfigError, match="'verify'"):
        open_store("s3://data/video/", {**_options("http://127.0.0.1:1"), "client_kwargs": {"verify": False}})
    with pytest.raises(ConfigError, match="'secret'"):
        open_store("s3://data/video/", {"engine": "obstore", "endpoint_url": "http://127.0.0.1:1", "key": "testing"})


@pytest.mark.parametrize(
    ("option", "named"),
    [
        ({"client_kwargs": {"region_name": 5}}, "storage_options client_kwargs['region_name'] = 5 (of type int)"),
        ({"token": 7}, "storage_options token (of type int; not shown)"),
    ],
)
def test_a_value_obstore_refuses_when_its_store_is_made_is_a_config_error_naming_the_option(option, named):
    """obstore's S3Store raised a bare TypeError naming no option ("'int' object is not an instance
    of 'str'") out of open_store, and check_store (serve --check) did not make one."""
    options = {**_options("http://127.0.0.1:1"), **option}
    for call in (check_store, open_store):
        with pytest.raises(ConfigError) as info:
            call("s3://data/video/", options)
        assert f"{named} for 's3://data/video/': obstore refuses it" in str(info.value), info.value
        assert str(info.value).endswith("expected a string") and isinstance(info.value.__cause__, TypeError)


@pytest.mark.parametrize(("given", "missing"), [("key", "secret"), ("secret", "key")])
def test_a_key_without_its_secret_is_refused_by_the_check_as_by_open_and_pipeline(tmp_path, given, missing):
    """check_store (serve --check, and serve at its start) refused nothing here: only opening the
    store did (with another message), after the check had said the options were valid."""
    options = {"engine": "obstore", "endpoint_url": "http://127.0.0.1:1", given: "testing"}
    expected = rf"storage_options\['{given}'\] is given without storage_options\['{missing}'\]"
    with pytest.raises(ConfigError, match=expected):
        check_store("s3://data/video/", options)
    with pytest.raises(ConfigError, match=expected):
        open_store("s3://data/video/", options)
    with pytest.raises(ConfigError, match=expected):
        Pipeline("s3://data/video/", tmp_path / "c", "1MiB", storage_options=options).open()  # before any request
    check_store("s3://data/video/", {**options, "anon": True})  # unsigned: neither is used


def test_round_trip_of_whole_objects_listed_in_key_order(s3_source, native):
    bodies = {"b/2.bin": BODY, "a/x/1.bin": b"1", ODD_KEY: b"odd"}
    for key, body in bodies.items():
        s3_source.put(key, body)
    listed = list(native.list())
    assert [o.key for o in listed] == sorted(bodies)
    for info in listed:
        out = io.BytesIO()
        assert native.get(info.key, out, 0, info.size) == info.size
        assert out.getvalue() == bodies[info.key]


def test_ranged_get_writes_exactly_the_range_at_the_files_position(s3_source, native):
    s3_source.put("f/obj", BODY)
    for start, end in [(0, len(BODY)), (100, 2000), (len(BODY) - 7, len(BODY)), (5, 5)]:
        out = io.BytesIO()
        out.write(b"head")
        assert native.get("f/obj", out, start, end) == end - start
        assert out.getvalue() == b"head" + BODY[start:end]


def test_both_paths_make_the_get_conditional_on_the_listed_etag(s3_source, native):
    """A short range goes through obstore, a long one through the direct path: both send the
    listed ETag as If-Match, and both refuse an object rewritten since as changed."""
    size = NativeS3Store.DIRECT_FROM + 10
    s3_source.put("f/obj", b"a" * size)
    (listed,) = native.list()
    for start, end in ((0, 100), (0, size)):
        out = io.BytesIO()
        assert native.get("f/obj", out, start, end, etag=listed.etag) == end - start
    s3_source.put("f/obj", b"b" * size)
    for start, end in ((0, 100), (0, size)):
        out = io.BytesIO()
        with pytest.raises(ObjectChangedError, match=r"f/obj .*changed since it was listed"):
            native.get("f/obj", out, start, end, etag=listed.etag)
        assert out.getvalue() == b""


def test_missing_key_is_file_not_found_keeping_the_store_code(s3_source, native):
    s3_source.put("f/present", b"x")
    with pytest.raises(FileNotFoundError) as info:
        native.get("f/absent", io.BytesIO(), 0, 1)
    error = info.value
    assert error.code == "NoSuchKey" and error.endpoint == s3_source.options["endpoint_url"]
    assert "f/absent" in str(error) and "NoSuchKey" in str(error)
    assert not is_transient(error)


def test_missing_bucket_is_file_not_found_naming_it(s3_source):
    store = open_store("s3://no-such-bucket/video/", _options(s3_source.options["endpoint_url"]))
    try:
        with pytest.raises(FileNotFoundError) as info:
            store.get("f", io.BytesIO(), 0, 1)
    finally:
        store.close()
    assert info.value.code == "NoSuchBucket" and "no-such-bucket" in str(info.value)


def test_throttling_is_store_unavailable_and_transient(s3_source, fault_proxy):
    s3_source.put("f", BODY)
    proxy, endpoint, store = _through(fault_proxy, s3_source)
    try:
        proxy.inject("503", 1)
        with pytest.raises(StoreUnavailableError) as info:
            store.get("f", io.BytesIO(), 0, len(BODY))
        out = io.BytesIO()
        assert store.get("f", out, 0, len(BODY)) == len(BODY)  # obstore did not retry it itself: the core does
    finally:
        store.close()
    assert info.value.code == "SlowDown" and info.value.endpoint == endpoint
    assert is_transient(info.value) and out.getvalue() == BODY
    assert proxy.injected["503"] == 1


def test_a_connection_dropped_mid_body_is_a_transient_connection_error(s3_source, fault_proxy):
    s3_source.put("f", BODY)
    proxy, endpoint, store = _through(fault_proxy, s3_source)
    try:
        proxy.inject("cut", 1)
        out = io.BytesIO()
        with pytest.raises(ConnectionError) as info:
            store.get("f", out, 0, len(BODY))
    finally:
        store.close()
    assert is_transient(info.value) and not isinstance(info.value, StoreUnreachableError), repr(info.value)
    assert endpoint in str(info.value) and proxy.injected["cut"] == 1
    assert len(out.getvalue()) < len(BODY)


@pytest.mark.parametrize(("fault", "code"), [("InvalidAccessKeyId", "InvalidAccessKeyId"), ("403", "AccessDenied")])
def test_rejected_and_denied_are_permission_errors_keeping_the_store_code(s3_source, fault_proxy, fault, code):
    s3_source.put("f", b"x")
    proxy, endpoint, store = _through(fault_proxy, s3_source)
    try:
        proxy.inject(fault, 1)
        with pytest.raises(PermissionError) as info:
            store.get("f", io.BytesIO(), 0, 1)
    finally:
        store.close()
    assert info.value.code == code and info.value.endpoint == endpoint and code in str(info.value)
    assert not is_transient(info.value)


def test_a_redirected_short_get_goes_through_the_fsspec_backend_and_so_do_the_next(s3_source, fault_proxy, caplog):
    """S3's answer for a bucket in another region than obstore's (its region comes from
    ``region_name`` or the environment, not from ``~/.aws/config`` as botocore's does): the GET
    is sent again by the fsspec backend, whose client follows such redirects, and so are the
    store's next GETs, with one warning naming ``region_name``."""
    s3_source.put("f", BODY)
    proxy, _, store = _through(fault_proxy, s3_source)
    outs = [io.BytesIO() for _ in range(3)]
    try:
        proxy.inject("redirect", 1)
        with caplog.at_level(logging.WARNING, logger="cachepipe.stores.s3native"):
            got = [store.get("f", out, 0, len(BODY)) for out in outs]
    finally:
        store.close()
    assert got == [len(BODY)] * 3 and all(out.getvalue() == BODY for out in outs)
    assert proxy.injected["redirect"] == 1
    assert _senders(proxy, "f") == ["obstore", "s3direct", "s3direct", "s3direct"]
    said = [r.getMessage() for r in caplog.records if r.name == "cachepipe.stores.s3native"]
    assert len(said) == 1 and "region_name" in said[0], said


def test_refused_before_any_answer_is_unreachable_and_after_one_is_transient(s3_source, moto_server):
    from faultproxy import FaultProxy

    s3_source.put("f", b"0123456789")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    never = open_store(s3_source.url, _options(closed))
    with pytest.raises(StoreUnreachableError, match="refused"):
        never.get("f", io.BytesIO(), 0, 10)
    never.close()

    host, port = moto_server.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    endpoint = proxy.start()
    store = open_store(s3_source.url, _options(endpoint))
    try:
        assert store.get("f", io.BytesIO(), 0, 10) == 10
        proxy.stop()  # the listening socket is closed: new connections are refused
        errors = []
        for _ in range(3):  # the first may meet the pooled connection that the proxy dropped
            with pytest.raises(ConnectionError) as info:
                store.get("f", io.BytesIO(), 0, 10)
            errors.append(info.value)
    finally:
        store.close()
    for error in errors:
        assert is_transient(error) and not isinstance(error, StoreUnreachableError), repr(error)
        assert error.endpoint == endpoint
    assert any("refused" in str(e) or "ConnectionRefused" in str(e.__cause__) for e in errors)


def test_without_a_direct_path_a_region_redirect_is_permanent_and_says_what_to_set(s3_source, fault_proxy, monkeypatch):
    """(With a direct path, the GET is sent again there instead:
    ``test_a_redirected_short_get_goes_through_the_fsspec_backend_and_so_do_the_next``.)"""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # no direct path (as in the test of that below)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    s3_source.put("redirect/f", b"x")  # "redirect" in the key too: not what the seam goes by
    proxy, _, store = _through(fault_proxy, s3_source)
    try:
        proxy.inject("redirect", 1)
        with pytest.raises(OSError, match="region_name") as info:
            store.get("redirect/f", io.BytesIO(), 0, 1)
        assert store._answered  # a 301 is an answer: a refused connection after it is an outage
        proxy.inject("refuse", 1)
        with pytest.raises(ConnectionError):  # a dropped request naming the key's URL stays a connection error
            store.get("redirect/f", io.BytesIO(), 0, 1)
    finally:
        store.close()
    assert not is_transient(info.value)


def test_unresolvable_host_is_unreachable(s3_source):
    store = open_store(s3_source.url, _options("http://cachepipe-test.invalid:9000"))
    try:
        with pytest.raises(StoreUnreachableError, match="does not resolve"):
            store.get("f", io.BytesIO(), 0, 1)
    finally:
        store.close()


def test_pipeline_retries_the_engines_transient_errors_without_corruption(s3_source, fault_proxy, tmp_path):
    """The fetcher's retries see the engine's errors: bodies cut mid-way and throttling."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(4, {"f": 200 * KIB})
    manifest = listed(s3_source, tmp_path)
    proxy.inject("cut", 3)
    proxy.inject("503", 2)
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=_options(endpoint),
        manifest=manifest,
        retry_backoff=0.01,
        max_concurrency=2,
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
        stats = pipe.stats()
    assert got == {name: files["f"] for name, files in data.items()}
    assert proxy.injected["cut"] == 3 and proxy.injected["503"] == 2
    assert stats.retries >= 5


def test_the_store_object_given_to_a_pipeline_serves_the_next_one_through_both_paths(s3_source, native, tmp_path):
    """A pipeline given the native store (store=) aborted it as it closed: the next pipeline's
    GETs were refused with StoreClosedError, through obstore (short ranges) and through the
    fsspec backend (ranges of a mebibyte or more). Now each pipeline aborts only its own view."""
    data = s3_source.folders(2, {"small": 10 * KIB, "large": MIB + 1})
    for run in ("a", "b"):
        with Pipeline(s3_source.url, tmp_path / run, "8MiB", store=native) as pipe:
            got = {p.name: {f: (p / f).read_bytes() for f in ("small", "large")} for p in pipe}
        assert got == data
    assert len(list(native.list())) == 4


def test_download_worker_processes_use_the_engine_and_send_its_errors_back(s3_source, fault_proxy, tmp_path):
    """With download_processes each worker opens its own native store; a translated error crosses
    the process boundary classified (retried here) and keeping the store code."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(3, {"f": 20 * KIB})
    proxy.inject("503", 2)
    with Pipeline(
        s3_source.url,
        tmp_path / "c",
        "1MiB",
        storage_options=_options(endpoint),
        manifest=listed(s3_source, tmp_path),
        retry_backoff=0.01,
        max_concurrency=2,
        download_processes=1,
    ) as pipe:
        got = {p.name: (p / "f").read_bytes() for p in pipe}
        stats = pipe.stats()
    assert got == {name: files["f"] for name, files in data.items()}
    assert proxy.injected["503"] == 2 and stats.retries >= 2


def _senders(proxy, key: str) -> list[str]:
    """Who sent each GET of ``key`` through the proxy, in order: obstore and s3fs (botocore) name
    themselves, s3direct sends no User-Agent."""
    heads = [h.lower() for h in proxy.requests if h.startswith(f"GET /data/video/{key} ")]
    return ["obstore" if "\nuser-agent: object_store/" in h else "s3fs" if "\nuser-agent:" in h else "s3direct" for h in heads]


def test_a_range_of_a_mebibyte_or_more_goes_through_the_direct_path_a_shorter_one_through_obstore(s3_source, fault_proxy):
    """Per GET, obstore costs less CPU below 1 MiB and s3direct less from there (bench_engines.py):
    each range goes to the cheaper one, seen at the proxy by who sent it."""
    big = bytes(range(256)) * (8 * KIB)  # 2 MiB
    s3_source.put("big", big)
    proxy, _, store = _through(fault_proxy, s3_source)
    cut = NativeS3Store.DIRECT_FROM
    assert cut == 1024 * KIB
    ranges = [(0, cut - 1), (5, 5 + cut), (0, len(big)), (len(big) - 10, len(big))]
    outs = [io.BytesIO() for _ in ranges]
    try:
        got = [store.get("big", out, start, end) for out, (start, end) in zip(outs, ranges, strict=True)]
    finally:
        store.close()
    assert got == [end - start for start, end in ranges]
    assert [out.getvalue() for out in outs] == [big[start:end] for start, end in ranges]
    assert _senders(proxy, "big") == ["obstore", "s3direct", "s3direct", "obstore"]


def test_without_a_direct_path_every_range_goes_through_obstore(s3_source, fault_proxy, monkeypatch):
    """An HTTP proxy in the environment leaves the fsspec backend without its direct path (it
    would not apply the proxy): large ranges then go through obstore too, not through s3fs."""
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    big = bytes(range(256)) * (8 * KIB)  # 2 MiB
    s3_source.put("big", big)
    proxy, _, store = _through(fault_proxy, s3_source)
    out = io.BytesIO()
    try:
        got = store.get("big", out, 0, len(big))
    finally:
        store.close()
    assert got == len(big) and out.getvalue() == big
    assert _senders(proxy, "big") == ["obstore"]


def _profile_only(monkeypatch, tmp_path, profile: str = "") -> None:
    """Credentials only in a shared credentials file (as ``~/.aws/credentials``), its default
    profile's lines ``profile``: none in the environment, no instance metadata."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    shared = tmp_path / "credentials"
    shared.write_text(f"[default]\n{profile}")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(shared))


def test_without_key_and_secret_obstore_signs_with_botocores_credentials_from_a_profile(
    s3_source, fault_proxy, monkeypatch, tmp_path
):
    """obstore alone does not read ``~/.aws``: it is handed what botocore found for the direct
    path, so that small and large GETs are signed alike."""
    _profile_only(monkeypatch, tmp_path, PROFILE + "aws_session_token = tok\n")
    big = bytes(range(256)) * (8 * KIB)  # 2 MiB
    s3_source.put("big", big)
    proxy, endpoint = fault_proxy
    store = open_store(s3_source.url, {"engine": "obstore", "endpoint_url": endpoint, "skip_instance_cache": True})
    small, large = io.BytesIO(), io.BytesIO()
    try:
        assert store.get("big", small, 0, 100) == 100
        assert store.get("big", large, 0, len(big)) == len(big)
    finally:
        store.close()
    assert small.getvalue() == big[:100] and large.getvalue() == big
    heads = [h.lower() for h in proxy.requests if h.startswith("GET /data/video/big ")]
    assert _senders(proxy, "big") == ["obstore", "s3direct"]
    assert all("credential=fromprofile/" in h and "\nx-amz-security-token: tok" in h for h in heads), heads


def test_obstore_asks_for_the_credentials_again_after_credentials_for_seconds(s3_source, monkeypatch, tmp_path):
    """obstore asks its provider again only when what it holds expires within 5 minutes: each copy
    is said to expire then, :attr:`NativeS3Store.CREDENTIALS_FOR` seconds on (1 s here). Asked
    on every GET, it would cost a hop to Python each; never asked again, rotated credentials
    would go stale."""
    monkeypatch.setattr(NativeS3Store, "CREDENTIALS_FOR", 1)
    _profile_only(monkeypatch, tmp_path, PROFILE)
    s3_source.put("f", BODY)
    store = open_store(
        s3_source.url, {"engine": "obstore", "endpoint_url": s3_source.options["endpoint_url"], "skip_instance_cache": True}
    )
    gets, elapsed = 0, 0.0
    try:
        began = time.monotonic()
        # 2.5 s of GETs, and on a busy machine until it asked again (a full suite once saw 1 ask in 15 GETs)
        while elapsed < 2.5 or (store._credentials.asked < 2 and elapsed < 10):
            assert store.get("f", io.BytesIO(), 0, len(BODY)) == len(BODY)
            gets += 1
            time.sleep(0.05)
            elapsed = time.monotonic() - began
    finally:
        store.close()
    asked = store._credentials.asked
    assert gets >= 10 and 2 <= asked <= elapsed + 2 and asked < gets / 2, (gets, asked, elapsed)  # not once per GET


def test_no_credentials_anywhere_is_a_permission_error_naming_the_object(s3_source, monkeypatch, tmp_path):
    _profile_only(monkeypatch, tmp_path)
    s3_source.put("f", BODY)
    store = open_store(
        s3_source.url, {"engine": "obstore", "endpoint_url": s3_source.options["endpoint_url"], "skip_instance_cache": True}
    )
    try:
        with pytest.raises(PermissionError) as info:
            store.get("f", io.BytesIO(), 0, len(BODY))
    finally:
        store.close()
    assert not is_transient(info.value)
    assert str(info.value).startswith("[Errno 13] no usable credentials for s3://data/video/f at ")
    assert "rejected" not in str(info.value)  # nothing was sent: the endpoint rejected nothing


def test_a_process_forked_after_obstore_ran_gets_through_the_direct_path_instead_of_hanging(s3_source, fault_proxy):
    """obstore's runtime does not survive a fork: a GET through it in such a child waits forever
    (as a DataLoader worker forked after the main process read through this engine would)."""
    s3_source.put("f", BODY)
    proxy, endpoint, store = _through(fault_proxy, s3_source)
    try:
        assert store.get("f", io.BytesIO(), 0, len(BODY)) == len(BODY)  # obstore runs in this process
    finally:
        store.close()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a new store, as a worker would open
        status = 1
        try:
            os.close(read)
            said: list[logging.LogRecord] = []
            handler = logging.Handler(logging.WARNING)
            handler.emit = said.append  # type: ignore[method-assign]
            logging.getLogger("cachepipe.stores.s3native").addHandler(handler)
            child = open_store(s3_source.url, _options(endpoint))
            out = io.BytesIO()
            got = [child.get("f", out, 0, len(BODY)), child.get("f", io.BytesIO(), 0, len(BODY)), child.get("f", out, 5, 5)]
            child.close()
            warned = [r.getMessage() for r in said]
            right = got == [len(BODY), len(BODY), 0] and out.getvalue() == BODY
            named = f"was forked after obstore ran in process {os.getppid()},"  # the test's process
            os.write(write, b"ok" if right and len(warned) == 1 and named in warned[0] else b"wrong")
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        answer = os.read(read, 16) if ready else b"hung"
    finally:
        os.close(read)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    assert answer == b"ok" and status == 0, (answer, status)
    assert _senders(proxy, "f") == ["obstore", "s3direct", "s3direct"]  # and the warning said once


def test_the_store_object_itself_works_in_a_process_forked_after_obstore_ran(s3_source, fault_proxy, tmp_path):
    """The object a DataLoader worker inherits (the dataset's ``store=``), not one opened there:
    its short GETs go through the fsspec backend there, as in a store opened there, and so do
    its uploads, which failed ("RuntimeError: This class is not fork-safe": the s3fs filesystem
    made in this process)."""
    big = bytes(range(256)) * (8 * KIB)  # 2 MiB: the direct path's
    s3_source.put("f", BODY)
    s3_source.put("big", big)
    proxy, _, store = _through(fault_proxy, s3_source)
    local = tmp_path / "up"
    local.write_bytes(b"up")

    def child() -> None:
        out = io.BytesIO()
        assert store.get("f", out, 0, len(BODY)) == len(BODY) and out.getvalue() == BODY
        out = io.BytesIO()
        assert store.get("big", out, 0, len(big)) == len(big) and out.getvalue() == big
        store.put(local, "up")
        assert [o.key for o in store.list()] == ["big", "f", "up"]

    try:
        assert store.get("f", io.BytesIO(), 0, len(BODY)) == len(BODY)  # obstore runs in this process
        assert in_a_fork(child) == 0
        assert store.get("f", io.BytesIO(), 0, len(BODY)) == len(BODY)
    finally:
        store.close()
    assert _senders(proxy, "f") == ["obstore", "s3direct", "obstore"]


def test_a_closed_store_is_freed_with_its_credential_provider(s3_source):
    """obstore's store holds the provider, and obstore's objects are not traversed by the garbage
    collector: a provider that referred back to the store would keep both alive for good."""
    store = open_store(s3_source.url, {"engine": "obstore", "endpoint_url": s3_source.options["endpoint_url"]})
    assert store._store.credential_provider is not None
    freed = weakref.ref(store)
    store.close()
    del store
    gc.collect()
    assert freed() is None


@pytest.mark.parametrize("first", ["small", "large"])
def test_an_answer_through_either_path_makes_a_refused_connection_an_outage(s3_source, moto_server, first):
    """Once the endpoint answered a GET (through obstore or the direct path), a refused
    connection is a server down for a while, retried, on both paths; not a wrong endpoint."""
    from faultproxy import FaultProxy

    big = bytes(range(256)) * (8 * KIB)  # 2 MiB
    s3_source.put("big", big)
    host, port = moto_server.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    endpoint = proxy.start()
    store = open_store(s3_source.url, _options(endpoint))
    ranges = {"small": (0, 100), "large": (0, len(big))}
    errors = []
    try:
        assert store.get("big", io.BytesIO(), *ranges[first]) == ranges[first][1]
        proxy.stop()
        for start, end in ranges.values():
            with pytest.raises(ConnectionError) as info:
                store.get("big", io.BytesIO(), start, end)
            errors.append(info.value)
    finally:
        store.close()
    assert [is_transient(e) and not isinstance(e, StoreUnreachableError) for e in errors] == [True, True], errors


def test_taking_the_credentials_is_not_an_answer_from_the_endpoint(monkeypatch, tmp_path):
    """The direct path's probe sends nothing: an endpoint that refuses every connection and
    never answered is unreachable (not retried) on both paths, after the credentials were taken."""
    _profile_only(monkeypatch, tmp_path, PROFILE)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    store = open_store("s3://data/video/", {"engine": "obstore", "endpoint_url": endpoint, "skip_instance_cache": True})
    errors = []
    try:
        for end in (100, 2 * NativeS3Store.DIRECT_FROM):
            with pytest.raises(StoreUnreachableError) as info:
                store.get("f", io.BytesIO(), 0, end)
            errors.append(info.value)
    finally:
        store.close()
    assert all("never answered" in str(e) or "before it ever answered" in str(e) for e in errors), errors


def test_an_http_error_while_taking_the_credentials_is_not_an_answer_from_the_endpoint(s3_source):
    """A 403 from STS or SSO while botocore refreshes credentials says nothing of the S3
    endpoint: a refused connection to it is still "never answered" afterwards."""
    import botocore.exceptions

    from cachepipe.stores.fsspec import FsspecStore

    store = FsspecStore(s3_source.url, s3_source.options)
    refused = botocore.exceptions.ClientError(
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "AssumeRole"
    )
    try:
        with pytest.raises(PermissionError), store._errors("s3://data/video/f", sends=False):
            raise refused
        assert not store.answered
        with pytest.raises(PermissionError), store._errors("s3://data/video/f"):
            raise refused  # the same from a request to the endpoint: an answer
        assert store.answered
    finally:
        store.close()


def test_a_bucket_the_direct_path_leaves_to_s3fs_is_left_to_it_for_small_ranges_too(s3_source, fault_proxy):
    """A bucket in another region (a 301 naming it): the direct path leaves its requests to
    s3fs, whose client follows such redirects; small ranges follow, rather than fail."""
    big = bytes(range(256)) * (8 * KIB)  # 2 MiB
    s3_source.put("big", big)
    proxy, _, store = _through(fault_proxy, s3_source)
    large, small = io.BytesIO(), io.BytesIO()
    try:
        proxy.inject("redirect", 1)
        assert store.get("big", large, 0, len(big)) == len(big)
        assert store.get("big", small, 0, 100) == 100
    finally:
        store.close()
    assert large.getvalue() == big and small.getvalue() == big[:100]
    assert proxy.injected["redirect"] == 1
    assert _senders(proxy, "big") == ["s3direct", "s3fs", "s3fs"]


def test_anonymous_short_ranges_go_through_obstore_unsigned(s3_source, fault_proxy, s3_client):
    """``anon``: the direct path's route is unsigned, and short GETs still go through obstore,
    unsigned (the object readable by anyone)."""
    s3_source.put("f", BODY)
    s3_client.put_object_acl(Bucket="data", Key="video/f", ACL="public-read")
    proxy, endpoint = fault_proxy
    store = open_store(s3_source.url, {"engine": "obstore", "endpoint_url": endpoint, "anon": True})
    assert store._direct  # an unsigned route: the case under test
    out = io.BytesIO()
    try:
        assert store.get("f", out, 0, len(BODY)) == len(BODY)
    finally:
        store.close()
    assert out.getvalue() == BODY
    heads = [h.lower() for h in proxy.requests if h.startswith("GET /data/video/f ")]
    assert _senders(proxy, "f") == ["obstore"] and "authorization:" not in heads[0], heads


def test_the_endpoint_of_aws_endpoint_url_s3_is_where_small_gets_go(s3_source, monkeypatch):
    """With no endpoint_url, the listing and large GETs go where botocore finds the endpoint
    (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``); obstore does not read the first, and
    sent the small GETs to AWS; errors named "the AWS S3 endpoint"."""
    endpoint = s3_source.options["endpoint_url"]
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    s3_source.put("a/small.bin", BODY)
    store = open_store(s3_source.url, {"engine": "obstore", "key": "testing", "secret": "testing", "skip_instance_cache": True})
    try:
        assert store.endpoint == endpoint
        out = io.BytesIO()
        assert store.get("a/small.bin", out, 0, len(BODY)) == len(BODY)
        assert out.getvalue() == BODY
    finally:
        store.close()
