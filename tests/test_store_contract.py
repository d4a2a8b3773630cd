"""The store contract, one set of tests for every backend: s3 (s3fs) and obs (OBS SDK) against the
moto server, local files, fsspec memory."""

from __future__ import annotations

import http.client
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import as_a_user, via
from faultproxy import blackhole

from cachepipe import ConfigError, ObjectChangedError, Pipeline, StoreUnreachableError
from cachepipe.errors import LocalFileError, is_transient
from cachepipe.stores import open_store
from cachepipe.stores.base import CONNECT_TIMEOUT, listed_etag, takes_etag, takes_start_after


@pytest.fixture
def store(source):
    s = open_store(source.url, source.options)
    yield s
    s.close()


def test_lists_every_object_recursively_in_key_order_relative_to_the_root(source, store):
    bodies = {"b/2.bin": b"22", "a/x/1.bin": b"1", "a/0.bin": b"", "c d/ü.txt": b"uu"}
    for key, body in bodies.items():
        source.put(key, body)
    listed = list(store.list())
    assert [o.key for o in listed] == sorted(bodies)
    assert {o.key: o.size for o in listed} == {k: len(v) for k, v in bodies.items()}


def test_a_listing_after_a_key_lists_the_keys_after_it_in_key_order(source, store):
    """What a listing restarted after a transient error asks for (S3's StartAfter, OBS's marker,
    local and memory skip): the keys after one, whether or not it is listed itself."""
    keys = sorted(["a/1", "a b/1", "a/x/2", "a-b/3", "c"])  # "a b/1" and "a-b/3" before "a/1"
    for key in keys:
        source.put(key, b"x")
    assert takes_start_after(store)
    for at, key in enumerate(keys):
        assert [o.key for o in store.list(start_after=key)] == keys[at + 1 :], key
    assert [o.key for o in store.list(start_after="a/")] == ["a/1", "a/x/2", "c"]  # not a key of it


def test_delete_removes_the_keys_and_a_missing_one_is_no_error(source, store, tmp_path):
    """Every writable backend deletes (``cachepipe map`` deletes what an earlier attempt left in
    ``DST/<item>/``): a batch of keys, one of them absent, the others kept; on a local
    filesystem, the folders left empty up to ``within`` are removed too."""
    for key in ("i/keep", "i/old", "i/deep/er/x", "i/deep/y", "j/other"):
        source.put(key, b"x")
    store.delete(["i/old", "i/deep/er/x", "i/deep/y", "i/absent"], within="i")
    assert [o.key for o in store.list()] == ["i/keep", "j/other"]
    store.delete([], within="i")  # nothing to do: no request
    if source.kind == "file":
        assert sorted(p.name for p in (tmp_path / "src" / "i").iterdir()) == ["keep"]  # deep/ and deep/er/ removed
        store.delete(["i/keep"], within="i")
        assert (tmp_path / "src" / "i").is_dir()  # ``within`` is kept, emptied


def test_ranged_get_streams_exactly_the_range(source, store):
    body = bytes(range(256)) * 40
    source.put("f/obj", body)
    for start, end in [(0, len(body)), (100, 2000), (len(body) - 7, len(body))]:
        out = io.BytesIO()
        assert store.get("f/obj", out, start, end) == end - start
        assert out.getvalue() == body[start:end]


def test_missing_key_is_file_not_found_naming_it(source, store):
    source.put("f/present", b"x")
    with pytest.raises(FileNotFoundError, match="absent"):
        store.get("f/absent", io.BytesIO(), 0, 1)


def test_a_get_conditional_on_the_listed_etag_refuses_an_object_rewritten_since(source, store):
    """S3 and OBS make the GET conditional (If-Match): an object rewritten after listing, even to
    the same size, is refused as changed, not retried; local files and memory have no such
    request and take ``etag`` without a word."""
    source.put("f/obj", b"a" * 1000)
    (listed,) = store.list()
    out = io.BytesIO()
    assert store.get("f/obj", out, 0, 1000, etag=listed.etag or "abc") == 1000 and out.getvalue() == b"a" * 1000
    source.put("f/obj", b"b" * 1000)  # the same size: the size check cannot see it
    out = io.BytesIO()
    if source.kind in ("s3", "obs"):
        with pytest.raises(ObjectChangedError, match=r"f/obj .*changed since it was listed") as info:
            store.get("f/obj", out, 100, 200, etag=listed.etag)
        assert not is_transient(info.value) and out.getvalue() == b""
    else:
        assert store.get("f/obj", out, 100, 200, etag="abc") == 100 and out.getvalue() == b"b" * 100


def test_s3_gets_through_s3fs_are_conditional_too(s3_source):
    """Options the direct path does not apply send GETs through s3fs's client: its GETs carry the
    condition as well (s3fs's own cat_file takes none)."""
    from cachepipe.stores.fsspec import FsspecStore

    s3_source.put("a/f", b"0123456789")
    endpoint = s3_source.options["endpoint_url"]
    store = FsspecStore(s3_source.url, {**s3_source.options, "client_kwargs": {"endpoint_url": endpoint, "verify": False}})
    try:
        assert store._direct is None
        (listed,) = store.list()
        buf = io.BytesIO()
        assert store.get("a/f", buf, 2, 7, etag=listed.etag) == 5 and buf.getvalue() == b"23456"
        s3_source.put("a/f", b"9876543210")
        with pytest.raises(ObjectChangedError, match="a/f"):
            store.get("a/f", io.BytesIO(), 2, 7, etag=listed.etag)
    finally:
        store.close()


def test_a_weak_etag_is_listed_as_none_so_that_its_get_carries_no_condition():
    """If-Match compares strongly: a weak tag (W/"...", from a gateway that rewrites bodies)
    never matches, so a GET conditional on it was refused every time (ObjectChangedError for
    every object). A weak tag is now listed as unknown, and its object read unconditionally."""
    from cachepipe.stores.s3direct import _parse_listing

    assert [listed_etag(t) for t in ('"abc"', "abc", 'W/"abc"', '""', "", None)] == ["abc", "abc", None, None, None, None]
    page = b"""<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><IsTruncated>false</IsTruncated>
    <Contents><Key>a</Key><Size>1</Size><ETag>W/&quot;abc&quot;</ETag></Contents>
    <Contents><Key>b</Key><Size>2</Size><ETag>&quot;def&quot;</ETag></Contents></ListBucketResult>"""
    assert _parse_listing(page) == ([("a", 1, None), ("b", 2, "def")], None)


def test_takes_etag_tells_a_get_that_takes_the_condition_from_one_written_before_it():
    class Old:
        def get(self, key, out, start, end): ...

    class New:
        def get(self, key, out, start, end, *, etag=None): ...

    class Forwards:  # hands its keywords on to a call that may not take etag
        def get(self, key, out, start, end, **options): ...

    assert [takes_etag(s) for s in (Old(), New(), Forwards())] == [False, True, False]


def test_missing_bucket_is_file_not_found(remote_source):
    url = remote_source.url.replace("//data/", "//no-such-bucket/")
    s = open_store(url, remote_source.options)
    try:
        with pytest.raises(FileNotFoundError, match="no-such-bucket"):
            list(s.list())
    finally:
        s.close()


def test_s3_gets_take_the_direct_path_unless_an_option_needs_the_sdk(s3_source):
    """Plain s3fs options use presigned GETs over plain HTTP (the fault tests run through it);
    options the direct path would not apply keep every request in s3fs."""
    from cachepipe.stores.fsspec import FsspecStore

    s3_source.put("a/f", b"0123456789")
    plain = FsspecStore(s3_source.url, s3_source.options)
    assert plain._direct is not None
    for extra in (
        {"client_kwargs": {"endpoint_url": s3_source.options["endpoint_url"], "verify": False}},
        {"requester_pays": True},
        {"s3_additional_kwargs": {"SSECustomerKey": "k"}},
    ):
        store = FsspecStore(s3_source.url, {**s3_source.options, **extra, "skip_instance_cache": True})
        assert store._direct is None, extra
    import io

    buf = io.BytesIO()
    assert plain.get("a/f", buf, 2, 7) == 5 and buf.getvalue() == b"23456"
    plain.close()


# ---- error classification: what is retried, what fails at once, and what the message names ----
# The "fails at once" tests run the pipeline with its default retries (12, backoff from 0.2 s):
# before the classification they retried for about a minute, so a generous 10 s bound shows it.


def _fails_within(fn, seconds: float = 10.0) -> BaseException:
    """The exception ``fn()`` raised; fails the test if it is still running after ``seconds``."""
    box: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    thread = threading.Thread(target=run, name="test-fails-within", daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still going after {seconds} s: retrying an error that cannot pass"
    assert box, "did not fail"
    return box[0]


def _pipeline_run(url, options, tmp_path):
    def run() -> None:
        with Pipeline(url, tmp_path / "c", "1MiB", storage_options=options) as pipe:
            list(pipe)

    return run


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def test_unknown_storage_option_is_a_config_error_naming_it(source):
    with pytest.raises(ConfigError, match="'endpont'"):
        open_store(source.url, {**source.options, "endpont": "http://127.0.0.1:1"}).close()


def _obstore_importable() -> bool:
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(
    "engine", ["s3fs", pytest.param("obstore", marks=pytest.mark.skipif(not _obstore_importable(), reason="no obstore"))]
)
@pytest.mark.parametrize(
    ("endpoint", "why"),
    [
        ("http://[::1", "is not a valid URL (Invalid IPv6 URL)"),
        ("http://h:abc", "its port is not a number of 0 to 65535"),
        ("http://h:65536", "its port is not a number of 0 to 65535"),
        ("http://:9000", "names no host"),
        (9000, "is not text"),
    ],
)
def test_a_malformed_s3_endpoint_is_refused_by_the_check_as_by_open(engine, endpoint, why):
    """Such endpoints passed check_store (serve --check) and open_store, both engines, and failed
    at the first request."""
    from cachepipe.stores import check_store

    options = {"engine": engine, "endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    for call in (check_store, open_store):
        with pytest.raises(ConfigError) as info:
            call("s3://b/p/", options)
        assert f"storage_options endpoint_url {endpoint!r} for 's3://b/p/'" in str(info.value), info.value
        assert why in str(info.value) and "expected a URL like 'http://10.0.0.5:9000'" in str(info.value), info.value
    check_store("s3://b/p/", {**options, "endpoint_url": "http://[::1]:0"})


@pytest.mark.parametrize(
    "engine", ["s3fs", pytest.param("obstore", marks=pytest.mark.skipif(not _obstore_importable(), reason="no obstore"))]
)
@pytest.mark.parametrize("endpoint", ["http://AK:s3cr3t@127.0.0.1:9000", "https://s3cr3t@s3.example.com"])
def test_credentials_in_an_s3_endpoint_are_refused_by_the_check_as_by_open(engine, endpoint):
    """Such an endpoint passed check_store (serve --check said valid), then the first request
    failed: botocore took ``AK:s3cr3t@127.0.0.1`` for the host name (serve exited 1, "its host
    name does not resolve")."""
    from cachepipe.stores import check_store

    options = {"engine": engine, "endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    for call in (check_store, open_store):
        with pytest.raises(ConfigError) as info:
            call("s3://b/p/", options)
        message = str(info.value)
        assert "storage_options endpoint_url '" in message and "***@" in message, message
        assert "holds credentials (before its '@'), which the S3 client does not take from the URL" in message, message
        assert "s3cr3t" not in message, message


@pytest.mark.parametrize(
    ("endpoint", "shown"),
    [
        ("http://AK:s3cr3t@h:99999", "'http://***@h:99999'"),
        ("AK:s3cr3t@h:9000/p", "'***@h:9000/p'"),
        ("http://AK:s3cr3t@[::1:9000", "'http://***@[::1:9000'"),
    ],
)
def test_credentials_in_a_refused_s3_endpoint_are_not_shown(endpoint, shown):
    """Review: the message of a malformed endpoint showed it whole, a password written in it too."""
    from cachepipe.stores import check_store

    with pytest.raises(ConfigError) as info:
        check_store("s3://b/p/", {"endpoint_url": endpoint})
    assert f"storage_options endpoint_url {shown} for 's3://b/p/'" in str(info.value), info.value
    assert "s3cr3t" not in str(info.value), info.value


def test_s3_mistyped_endpoint_fails_at_once_suggesting_endpoint_url(s3_source, tmp_path):
    options = {"endpoint": s3_source.options["endpoint_url"], "key": "testing", "secret": "testing"}
    error = _fails_within(_pipeline_run(s3_source.url, options, tmp_path))
    assert isinstance(error, ConfigError), repr(error)
    assert "storage_options['endpoint']" in str(error) and "did you mean 'endpoint_url'" in str(error)
    assert s3_source.url in str(error)


def test_unknown_scheme_is_a_config_error_listing_the_known_ones():
    with pytest.raises(ConfigError, match="'s4://'") as info:
        open_store("s4://data/video/")
    assert "s3://, obs://, file://" in str(info.value) and "memory://" in str(info.value)


def test_unresolvable_host_fails_at_once_naming_host_and_url(remote_source, tmp_path):
    endpoint = "http://cachepipe-test.invalid:9000"
    error = _fails_within(_pipeline_run(remote_source.url, via(remote_source, endpoint), tmp_path))
    assert isinstance(error, StoreUnreachableError), repr(error)
    assert not is_transient(error)
    assert endpoint in str(error) and remote_source.url in str(error) and "does not resolve" in str(error)
    assert error.endpoint == endpoint


def test_an_endpoint_whose_connections_time_out_fails_at_once_naming_it(remote_source, tmp_path):
    """Before, a connect timeout was a transient error like any timeout: the first listing was
    tried 13 times, each after botocore's own 5 attempts of 60 s (over an hour), with a warning
    per retry and nothing else. Before the endpoint ever answered, it now fails at once."""
    with blackhole() as endpoint:
        options = via(remote_source, endpoint)
        if remote_source.kind == "obs":
            options["timeout"] = 1
        else:
            options["config_kwargs"] = {**options["config_kwargs"], "connect_timeout": 1}
        error = _fails_within(_pipeline_run(remote_source.url, options, tmp_path))
    assert isinstance(error, StoreUnreachableError), repr(error)
    assert not is_transient(error) and endpoint.removeprefix("http://") in str(error)
    assert "before it ever answered (packets dropped: a firewall, or a" in str(error)


def test_a_connect_timeout_is_unreachable_only_at_first_contact_and_on_the_stores_own_host():
    """Found in review: a GET's connect timeout in a download worker process (whose store never
    saw the listing's answer), or a connect timeout of the credentials' endpoint (STS), was
    taken for the S3 endpoint being unreachable, and failed for good."""
    from botocore.exceptions import ConnectTimeoutError

    from cachepipe.stores.fsspec import _translate

    endpoint = "http://s3.example:9000"
    mine = ConnectTimeoutError(endpoint_url="http://s3.example:9000/b?list-type=2")
    assert isinstance(_translate(mine, "s3://b/", endpoint, answered=False), StoreUnreachableError)
    got = _translate(mine, "s3://b/k", endpoint, answered=False, first=False)  # a GET: a busy server, retried
    assert isinstance(got, TimeoutError) and is_transient(got)
    sts = _translate(ConnectTimeoutError(endpoint_url="http://sts.example:8080/"), "s3://b/", endpoint, answered=False)
    assert not isinstance(sts, StoreUnreachableError) and is_transient(sts)
    assert "no answer to a connection to http://sts.example:8080/ (for s3://b/)" in str(sts)
    for url in (
        "https://b.s3.eu-west-1.amazonaws.com/",
        "http://b.minio.local:9000/",
        "https://b.s3.cn-north-1.amazonaws.com.cn/",
    ):
        got = _translate(ConnectTimeoutError(endpoint_url=url), "s3://b/", endpoint, answered=False)  # virtual hosts too
        assert isinstance(got, StoreUnreachableError), url
    for url in ("https://sts.amazonaws.com/", "https://sts.eu-west-1.amazonaws.com/", "http://169.254.169.254/latest"):
        got = _translate(ConnectTimeoutError(endpoint_url=url), "s3://b/", endpoint, answered=False)  # credentials' hosts
        assert not isinstance(got, StoreUnreachableError), url


def test_a_first_request_whose_reply_timed_out_before_any_answer_is_unreachable():
    """An endpoint that takes connections and never replies (a wrong port, another service) was
    retried as a slow store: 12 listings of a 60 s timeout each, silent for 13 minutes."""
    from botocore.exceptions import ReadTimeoutError

    from cachepipe.stores.fsspec import _translate

    endpoint = "http://s3.example:9000"
    for error in (TimeoutError("timed out"), ReadTimeoutError(endpoint_url="http://s3.example:9000/b?list-type=2")):
        got = _translate(error, "s3://b/", endpoint, answered=False)
        assert isinstance(got, StoreUnreachableError) and "sent no reply to the first request" in str(got), repr(got)
        for answered, first in ((True, True), (False, False)):  # a store that answered before; a GET: retried
            got = _translate(error, "s3://b/k", endpoint, answered=answered, first=first)
            assert isinstance(got, TimeoutError) and is_transient(got), (answered, first)
    sts = _translate(ReadTimeoutError(endpoint_url="https://sts.amazonaws.com/"), "s3://b/", endpoint, answered=False)
    assert not isinstance(sts, StoreUnreachableError) and is_transient(sts)


def test_s3_connects_wait_ten_seconds_unless_configured(s3_source):
    """botocore waits 60 s for a connection, up to 5 times per call; the S3 stores wait 10 s."""
    from cachepipe.stores.s3direct import ConnectTimeoutError, DirectGet

    store = open_store(s3_source.url, s3_source.options)
    assert store.fs.config_kwargs["connect_timeout"] == 10 == CONNECT_TIMEOUT == DirectGet(store.fs).connect_timeout
    assert store.direct
    given = open_store(s3_source.url, {**s3_source.options, "config_kwargs": {"connect_timeout": 0.5}})
    assert given.fs.config_kwargs["connect_timeout"] == 0.5 and given.direct  # before: the option turned the direct path off
    with blackhole() as endpoint:
        conn = http.client.HTTPConnection(endpoint.removeprefix("http://"))
        started = time.monotonic()
        with pytest.raises(ConnectTimeoutError, match=r"no connection to 127.0.0.1:\d+ within 0.5 s"):
            DirectGet(given.fs)._connect(conn)  # the direct path's connect, on its own
        assert time.monotonic() - started >= 0.45 and conn.sock is None


def test_refused_at_the_first_request_fails_at_once_naming_the_endpoint(remote_source, tmp_path):
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    error = _fails_within(_pipeline_run(remote_source.url, via(remote_source, endpoint), tmp_path))
    assert isinstance(error, StoreUnreachableError), repr(error)
    assert not is_transient(error)
    assert endpoint in str(error) and remote_source.url in str(error) and "refused" in str(error)


def test_refused_after_the_endpoint_answered_is_transient(remote_source, moto_server):
    """The endpoint answered, then went away (a restart): an outage, retried, naming the endpoint."""
    from faultproxy import FaultProxy

    remote_source.put("a/f", b"0123456789")
    host, port = moto_server.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    endpoint = proxy.start()
    store = open_store(remote_source.url, via(remote_source, endpoint))
    try:
        assert [o.key for o in store.list()] == ["a/f"]
        proxy.stop()  # the listening socket is closed: new connections are refused
        errors = []
        for _ in range(3):  # the first may meet the pooled connection that the proxy dropped
            with pytest.raises(ConnectionError) as info:
                store.get("a/f", io.BytesIO(), 0, 10)
            errors.append(info.value)
        for error in errors:
            assert is_transient(error) and not isinstance(error, StoreUnreachableError), repr(error)
            assert endpoint in str(error) and error.endpoint == endpoint
        assert any(isinstance(e.__cause__, ConnectionRefusedError) or "refused" in str(e) for e in errors)
    finally:
        store.close()


@pytest.mark.parametrize("code", ["InvalidAccessKeyId", "SignatureDoesNotMatch"])
def test_rejected_credentials_are_permission_errors_keeping_the_store_code(remote_source, fault_proxy, code):
    proxy, endpoint = fault_proxy
    store = open_store(remote_source.url, via(remote_source, endpoint))
    try:
        proxy.inject(code, 10)
        with pytest.raises(PermissionError) as info:
            list(store.list())
    finally:
        store.close()
    error = info.value
    assert error.code == code and error.endpoint == endpoint
    assert code in str(error) and endpoint in str(error) and remote_source.url.rstrip("/") in str(error)
    assert "does not" in str(error)  # the store's own message
    assert not is_transient(error)


def test_missing_bucket_names_the_store_code_and_the_endpoint(remote_source):
    url = remote_source.url.replace("//data/", "//no-such-bucket/")
    s = open_store(url, remote_source.options)
    try:
        with pytest.raises(FileNotFoundError) as info:
            list(s.list())
    finally:
        s.close()
    endpoint = remote_source.options.get("endpoint_url") or remote_source.options.get("server")
    assert info.value.code == "NoSuchBucket" and info.value.endpoint == endpoint
    assert "NoSuchBucket" in str(info.value) and endpoint in str(info.value) and "no-such-bucket" in str(info.value)
    assert not is_transient(info.value)


UPLOAD = r"""
import json, sys
from cachepipe.errors import is_transient
from cachepipe.stores import open_store
url, options, local = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
store = open_store(url, options)
try:
    store.put(local, "out/f.bin")
    print(json.dumps(None))
except OSError as exc:
    print(json.dumps([type(exc).__name__, isinstance(exc, PermissionError), is_transient(exc), exc.filename, str(exc)]))
finally:
    store.close()
"""


def _upload_as_a_user(url: str, options: dict, local: Path) -> list | None:
    """What ``put(local, "out/f.bin")`` raises in a child run as a user (not root, which reads
    and writes any file): ``[class name, a PermissionError, transient, filename, message]``;
    None if it uploaded."""
    argv = [*as_a_user(), sys.executable, "-c", UPLOAD, url, json.dumps(options), str(local)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_an_upload_of_a_local_file_it_cannot_read_is_a_local_error_naming_the_file(source, tmp_path):
    """A local file that the uploading user may not read (``chmod 000``) was the store's refusal:
    ``PermissionError('access denied to s3://...')``, which ``cachepipe map`` takes for the
    destination refusing writes (the run stops); through OBS, an endpoint it could not reach
    (retried). It is the machine's error, naming the file, and nothing is sent."""
    local = tmp_path / "f.bin"
    local.write_bytes(b"x" * 100)
    local.chmod(0)
    name, denied, transient, filename, message = _upload_as_a_user(source.url, source.options, local)
    assert name == "LocalFileError" and not denied and not transient, message
    assert filename == str(local) and "Permission denied" in message and "out/f.bin" in message, message
    if source.kind != "memory":  # the child's memory filesystem is its own
        store = open_store(source.url, source.options)
        try:
            assert not store.exists("out/f.bin")
        finally:
            store.close()


def test_an_upload_a_local_destination_refuses_is_its_permission_error(tmp_path):
    """A local destination that its user may not write (``chmod 555``) refuses with a
    ``PermissionError`` as S3's AccessDenied does, not a ``LocalFileError``: both are EACCES."""
    local = tmp_path / "f.bin"
    local.write_bytes(b"x" * 100)
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst").chmod(0o555)
    name, denied, transient, filename, message = _upload_as_a_user(str(tmp_path / "dst"), {}, local)
    assert name == "PermissionError" and denied and not transient, message
    assert filename != str(local) and str(tmp_path / "dst" / "out") in message, message


def test_an_upload_s3_refuses_is_its_permission_error(s3_source, moto_iam, tmp_path):
    """Credentials that may read but not write the bucket (no ``s3:PutObject``): the store's
    ``AccessDenied``, a ``PermissionError``, not the local file's error."""
    key, secret = moto_iam.user("reader-only", ["s3:GetObject", "s3:ListBucket"])
    local = tmp_path / "f.bin"
    local.write_bytes(b"x" * 100)
    moto_iam.enforce()
    store = open_store(s3_source.url, {**s3_source.options, "key": key, "secret": secret})
    try:
        assert list(store.list()) == []  # it may read
        with pytest.raises(PermissionError) as info:
            store.put(local, "out/f.bin")
    finally:
        store.close()
    assert not isinstance(info.value, LocalFileError) and info.value.code == "AccessDenied"
    assert "s3://data/video/out/f.bin" in str(info.value) and str(local) not in str(info.value)


@pytest.mark.parametrize(
    ("given", "meant"),
    [
        ({"aws_access_key_id": "k", "aws_secret_access_key": "s"}, "s3fs calls it 'key'"),
        ({"aws_secret_access_key": "s"}, "s3fs calls it 'secret'"),
        ({"aws_session_token": "t"}, "s3fs calls it 'token'"),
        ({"region_name": "eu-west-1"}, "client_kwargs={'region_name': ...}"),
    ],
)
def test_s3_options_under_botos_names_say_s3fs_s_name(given, meant):
    """boto3's names (``aws_access_key_id``... from a boto3 client's arguments or ~/.aws) are the
    first a user writes; the error listed s3fs's options without saying which one they are."""
    from cachepipe.stores import check_store

    with pytest.raises(ConfigError) as info:
        check_store("s3://b/p/", given)
    assert meant in str(info.value), info.value
    assert "'s'" not in str(info.value) and "'k'" not in str(info.value)  # values not shown
