"""ObsStore (esdk-obs-python) against the real moto S3 server over HTTP.

Only the status/code mapping table of ``ObsStore._check`` is driven with hand-made SDK results
(moto does not check signatures and never throttles); everything else goes over the wire.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import http.server
import io
import json
import logging
import os
import socket
import sys
import threading
import urllib.request
from collections.abc import Iterator

import pytest

pytest.importorskip("obs")

from obs.model import GetResult
from waiting import in_a_fork, wait_until

from cachepipe.errors import ConfigError, StoreClosedError, StoreUnavailableError, StoreUnreachableError, is_transient
from cachepipe.stores import check_store
from cachepipe.stores.base import ObjectInfo, Store
from cachepipe.stores.obs import CHUNK_SIZE, ObsServiceError, ObsStore

BUCKET = "obs-test-bucket"
SECRET = "sk-Very-Secret-0123456789"
TOKEN = "tok-Very-Secret-abcdefghij"
ENV_SECRET = "sk-From-Env-9876543210"
ENV_TOKEN = "tok-From-Env-zyxwvutsrq"


@pytest.fixture(autouse=True)
def clean_obs_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OBS_* variable from the developer's shell leaks into a test."""
    for name in ("OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY", "OBS_SECURITY_TOKEN", "OBS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def options(s3_endpoint: str) -> dict:
    """Explicit storage_options for the moto server (moto accepts any key pair)."""
    return {"server": s3_endpoint, "access_key_id": "AKTEST", "secret_access_key": SECRET, "security_token": TOKEN}


@pytest.fixture
def bucket(s3_client) -> str:
    s3_client.create_bucket(Bucket=BUCKET)
    return BUCKET


@pytest.fixture
def make_store(options: dict) -> Iterator:
    """Build ObsStores (default: the test bucket, explicit options) and close them after the test."""
    stores: list[ObsStore] = []

    def make(url: str = f"obs://{BUCKET}/data/", storage_options: dict | None = None, **kwargs) -> ObsStore:
        store = ObsStore(url, options if storage_options is None else storage_options, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _keys(server: str) -> dict:
    """storage_options with an explicit key pair (so the SDK never asks ECS metadata for one)."""
    return {"server": server, "access_key_id": "AK", "secret_access_key": SECRET}


def _etag(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _assert_no_secrets(*texts: str) -> None:
    for text in texts:
        for secret in (SECRET, TOKEN, ENV_SECRET, ENV_TOKEN):
            assert secret not in text


def _error_texts(exc: BaseException) -> list[str]:
    """str() and repr() of an exception and of its whole cause chain."""
    texts = []
    while exc is not None:
        texts += [str(exc), repr(exc)]
        exc = exc.__cause__
    return texts


# -- listing ---------------------------------------------------------------------------------


def test_the_test_server_answers_a_v2_signature_holding_four_slashes(s3_endpoint: str, bucket: str) -> None:
    """The OBS SDK signs with V2; moto once read such a signature with four ``/`` as a V4 scope."""
    request = urllib.request.Request(f"{s3_endpoint}/{BUCKET}", headers={"Authorization": "AWS AKTEST:ab/cd/ef/gh/ij="})  # noqa: S310 - a local http:// URL built here
    with urllib.request.urlopen(request) as answer:  # noqa: S310 - a local http:// URL built here
        assert answer.status == 200
        assert b"<Name>obs-test-bucket</Name>" in answer.read()


def test_list_nested_keys_across_pages(make_store, s3_client, bucket: str) -> None:
    objects = {
        "data/a.txt": b"a",
        "data/b/c/d.bin": b"dddd",
        "data/b/e.txt": b"",
        "data/folder1/video.mp4": b"v" * 1000,
        "data/folder1/text.txt": b"hello",
        "data/with space+plus ü.txt": b"odd",
        "data/z": b"zz",
        "database/not-under-prefix": b"x",  # shares the string prefix "data" but not "data/"
        "other/x": b"x",
    }
    for key, body in objects.items():
        s3_client.put_object(Bucket=bucket, Key=key, Body=body)
    store = make_store(page_size=2)

    listed = list(store.list())

    expected = sorted(
        (ObjectInfo(key=k[5:], size=len(v), etag=_etag(v)) for k, v in objects.items() if k.startswith("data/")),
        key=lambda info: info.key,
    )
    assert listed == expected
    assert [info.key for info in listed] == sorted(info.key for info in listed)


def test_list_is_streamed_page_by_page(make_store, s3_client, bucket: str, monkeypatch) -> None:
    for i in range(5):
        s3_client.put_object(Bucket=bucket, Key=f"data/k{i}", Body=b"x")
    store = make_store(page_size=2)
    calls = []
    real = store._client.listObjects
    monkeypatch.setattr(store._client, "listObjects", lambda *a, **kw: calls.append(kw["marker"]) or real(*a, **kw))

    it = store.list()
    assert next(it).key == "k0"
    assert len(calls) == 1  # the first object arrives before the second page is asked for
    assert [info.key for info in it] == ["k1", "k2", "k3", "k4"]
    assert len(calls) == 3


def test_list_whole_bucket_with_empty_prefix(make_store, s3_client, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="a/b", Body=b"12")
    s3_client.put_object(Bucket=bucket, Key="top", Body=b"1")
    store = make_store(f"obs://{bucket}")
    assert store.url == f"obs://{bucket}/"
    assert [(i.key, i.size) for i in store.list()] == [("a/b", 2), ("top", 1)]


def test_list_empty_prefix_yields_nothing(make_store, bucket: str) -> None:
    assert list(make_store().list()) == []


def test_list_skips_the_roots_own_marker_but_keeps_sub_markers(make_store, s3_client, bucket: str) -> None:
    for key in ("data/", "data/sub/", "data/sub/f"):
        s3_client.put_object(Bucket=bucket, Key=key, Body=b"")
    assert [i.key for i in make_store().list()] == ["sub/", "sub/f"]


# -- get ---------------------------------------------------------------------------------------


@pytest.fixture
def payload(s3_client, bucket: str) -> bytes:
    data = bytes(range(256)) * 40  # 10240 bytes
    s3_client.put_object(Bucket=bucket, Key="data/item/blob.bin", Body=data)
    return data


@pytest.mark.parametrize(("start", "end"), [(100, 2000), (0, 10240), (0, 1), (10239, 10240), (5000, 5001)])
def test_get_range(make_store, payload: bytes, start: int, end: int) -> None:
    out = io.BytesIO()
    out.write(b"HEAD")  # get writes at the current position, after what is there
    assert make_store().get("item/blob.bin", out, start, end) == end - start
    assert out.getvalue() == b"HEAD" + payload[start:end]


def test_get_past_the_end_is_short(make_store, payload: bytes) -> None:
    out = io.BytesIO()
    assert make_store().get("item/blob.bin", out, 10000, 20000) == 240
    assert out.getvalue() == payload[10000:]


def test_get_zero_size_object(make_store, s3_client, bucket: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="data/empty", Body=b"")
    out = io.BytesIO()
    assert make_store().get("empty", out, 0, 0) == 0
    assert out.getvalue() == b""


def test_get_empty_range_of_missing_key_raises(make_store, bucket: str) -> None:
    with pytest.raises(FileNotFoundError, match=f"obs://{BUCKET}/data/nope"):
        make_store().get("nope", io.BytesIO(), 0, 0)


def test_get_rejects_a_bad_range(make_store, payload: bytes) -> None:
    with pytest.raises(ValueError, match="bad byte range"):
        make_store().get("item/blob.bin", io.BytesIO(), 5, 4)


class _ChunkRecorder(io.RawIOBase):
    """A binary sink that records the size of each write and hashes the bytes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.digest = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.sizes.append(len(data))
        self.digest.update(data)
        return len(data)


def test_get_5mib_streams_in_chunks(make_store, s3_client, bucket: str) -> None:
    data = hashlib.sha256(b"seed").digest() * (5 * 1024 * 1024 // 32)
    s3_client.put_object(Bucket=bucket, Key="data/big.bin", Body=data)
    sink = _ChunkRecorder()

    assert make_store().get("big.bin", sink, 0, len(data)) == len(data)

    assert sink.digest.digest() == hashlib.sha256(data).digest()
    assert len(sink.sizes) >= 5
    assert max(sink.sizes) <= CHUNK_SIZE


class _PartialWriter(io.RawIOBase):
    """A raw sink that accepts at most 1000 bytes per write, as an unbuffered file may."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.buf += bytes(data[:1000])
        return min(len(data), 1000)


def test_get_handles_partial_writes(make_store, payload: bytes) -> None:
    sink = _PartialWriter()
    assert make_store().get("item/blob.bin", sink, 0, 10240) == 10240
    assert bytes(sink.buf) == payload


class _FailingWriter(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        raise OSError(28, "No space left on device")


def test_failed_write_does_not_poison_the_connection_pool(make_store, payload: bytes) -> None:
    store = make_store()
    with pytest.raises(OSError, match="No space left"):
        store.get("item/blob.bin", _FailingWriter(), 0, 10240)
    # The half-read connection must not be reused: the next requests see clean responses.
    out = io.BytesIO()
    assert store.get("item/blob.bin", out, 0, 10240) == 10240
    assert out.getvalue() == payload
    assert [i.key for i in store.list()] == ["item/blob.bin"]


# -- errors over HTTP --------------------------------------------------------------------------


def test_missing_key_is_file_not_found(make_store, bucket: str) -> None:
    with pytest.raises(FileNotFoundError, match=f"no such object obs://{BUCKET}/data/missing.bin") as info:
        make_store().get("missing.bin", io.BytesIO(), 0, 10)
    assert isinstance(info.value.__cause__, ObsServiceError)
    assert info.value.__cause__.code == "NoSuchKey"
    assert info.value.__cause__.status == 404


@pytest.mark.parametrize("op", ["list", "get"])
def test_missing_bucket_is_file_not_found_naming_it(make_store, s3_endpoint: str, op: str) -> None:
    store = make_store("obs://no-such-bucket/data/")
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket' does not exist") as info:
        list(store.list()) if op == "list" else store.get("k", io.BytesIO(), 0, 1)
    assert info.value.__cause__.code == "NoSuchBucket"


def test_unreachable_endpoint_is_connection_error(make_store, closed_port: int) -> None:
    """Refused before OBS ever answered: a wrong endpoint, not an outage, so not retried."""
    endpoint = f"http://127.0.0.1:{closed_port}"
    store = make_store(storage_options=_keys(endpoint))
    with pytest.raises(ConnectionError, match=f"cannot reach OBS endpoint {endpoint}: connection refused") as info:
        list(store.list())
    assert isinstance(info.value, StoreUnreachableError) and not is_transient(info.value)
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    with pytest.raises(ConnectionError, match="cannot reach OBS endpoint"):
        store.get("k", io.BytesIO(), 0, 1)


def test_a_silent_endpoint_is_unreachable_at_first_contact_and_a_timeout_at_a_get(make_store) -> None:
    """An endpoint that takes connections and never replies (a wrong port, another service): its
    first listing was a TimeoutError, retried as a slow store, as on S3 before (b3dd2a3); a GET
    comes after a listing, or from a worker process whose store saw none of its answers: retried."""
    with socket.socket() as server:  # accepts TCP connections (backlog) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        endpoint = f"http://127.0.0.1:{server.getsockname()[1]}"
        store = make_store(storage_options={**_keys(endpoint), "timeout": 0.3})
        with pytest.raises(StoreUnreachableError, match=f"cannot reach OBS endpoint {endpoint}: it took the connection"):
            list(store.list())
        with pytest.raises(TimeoutError, match=f"timed out after 0.3 s talking to OBS endpoint {endpoint}") as got:
            store.get("k", io.BytesIO(), 0, 1)
        assert is_transient(got.value)


def test_a_get_whose_connect_times_out_is_retried_and_a_listing_s_is_unreachable(make_store) -> None:
    """A connect that timed out before OBS ever answered: unreachable at a listing (the first
    contact), a TimeoutError (retried) at a GET, which a download worker process makes with a
    store that never saw the listing's answer (a busy server's full accept queue)."""
    from faultproxy import blackhole

    with blackhole() as endpoint:
        store = make_store(storage_options={**_keys(endpoint), "timeout": 0.3})
        with pytest.raises(TimeoutError) as got:
            store.get("k", io.BytesIO(), 0, 1)
        assert is_transient(got.value) and "timed out after 0.3 s talking to OBS endpoint" in str(got.value)
        with pytest.raises(StoreUnreachableError, match=r"no answer within 0.3 s before it ever answered"):
            list(store.list())


def test_endpoint_bucket_and_key_errors_differ(make_store, closed_port: int, s3_endpoint: str) -> None:
    """A wrong endpoint, a missing bucket and a rejected key each say something different."""
    store = make_store(storage_options=_keys(f"http://127.0.0.1:{closed_port}"))
    with pytest.raises(ConnectionError) as unreachable:
        list(store.list())
    with pytest.raises(FileNotFoundError) as no_bucket:
        list(make_store("obs://absent-bucket/").list())
    with pytest.raises(PermissionError) as rejected:
        make_store()._check(GetResult(code="InvalidAccessKeyId", message="bad key", status=403), "list", None)
    messages = {str(unreachable.value), str(no_bucket.value), str(rejected.value)}
    assert len(messages) == 3
    assert "cannot reach OBS endpoint" in str(unreachable.value)
    assert "does not exist" in str(no_bucket.value)
    assert "rejected the credentials" in str(rejected.value)


def test_closed_store_refuses_work_and_close_is_idempotent(make_store, bucket: str) -> None:
    store = make_store()
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="is closed"):
        list(store.list())
    with pytest.raises(RuntimeError, match="is closed"):
        store.get("k", io.BytesIO(), 0, 1)


def test_context_manager_closes(options: dict, bucket: str) -> None:
    with ObsStore(f"obs://{bucket}/", options) as store:
        assert list(store.list()) == []
    with pytest.raises(RuntimeError):
        list(store.list())


# -- the mapping table of the seam (hand-made SDK results: moto neither checks keys nor throttles)


@pytest.mark.parametrize(
    ("status", "code", "what", "expected", "text"),
    [
        (403, "InvalidAccessKeyId", "list", PermissionError, "rejected the credentials"),
        (403, "SignatureDoesNotMatch", "get", PermissionError, "rejected the credentials"),
        (400, "InvalidToken", "get", PermissionError, "rejected the credentials"),
        (400, "ExpiredToken", "list", PermissionError, "rejected the credentials"),
        (400, "InvalidArgument", "get", OSError, "InvalidArgument"),
        (403, "InvalidToken", "get", PermissionError, "rejected the credentials"),
        (401, None, "get", PermissionError, "rejected the credentials"),
        (403, "AccessDenied", "get", PermissionError, "access denied to obs://"),
        (403, None, "head", PermissionError, "access denied"),
        (404, "NoSuchKey", "get", FileNotFoundError, "no such object obs://"),
        (404, None, "head", FileNotFoundError, "or no such bucket"),
        (404, "NoSuchBucket", "get", FileNotFoundError, "does not exist"),
        (404, None, "list", FileNotFoundError, "not an OBS answer"),  # OBS names NoSuchBucket
        (500, "InternalError", "get", StoreUnavailableError, "unavailable"),
        (503, "SlowDown", "list", StoreUnavailableError, "throttling"),
        (503, "ServiceUnavailable", "get", StoreUnavailableError, "unavailable"),
        (429, "TooManyRequests", "get", StoreUnavailableError, "throttling"),
        (416, "InvalidRange", "get", OSError, "InvalidRange"),
    ],
)
def test_check_mapping_table(make_store, status, code, what, expected, text) -> None:
    store = make_store()
    resp = GetResult(code=code, message=f"server says {SECRET}", status=status, requestId="req-1")
    with pytest.raises(expected, match=text) as info:
        store._check(resp, what, None if what == "list" else "some/key")
    assert type(info.value) is expected  # not a wider or narrower class than the table says
    cause = info.value.__cause__
    assert isinstance(cause, ObsServiceError)
    assert (cause.status, cause.code, cause.request_id) == (status, code, "req-1")
    _assert_no_secrets(*_error_texts(info.value))  # the echoed secret is redacted


def test_check_passes_success(make_store) -> None:
    make_store()._check(GetResult(status=200), "list", None)
    make_store()._check(GetResult(status=206), "get", "k")


def test_auth_error_is_not_reported_as_not_found(make_store) -> None:
    with pytest.raises(PermissionError):
        make_store()._check(GetResult(code="AccessDenied", status=403), "get", "k")


# -- settings ---------------------------------------------------------------------------------


def test_store_protocol_and_resolved_description(make_store, s3_endpoint: str) -> None:
    store = make_store()
    assert isinstance(store, Store)
    assert store.url == f"obs://{BUCKET}/data/"
    assert (store.bucket, store.prefix) == (BUCKET, "data/")
    assert store.endpoint == s3_endpoint
    assert store.credential_source == "explicit"


def test_explicit_beats_env(make_store, s3_endpoint: str, monkeypatch, closed_port: int) -> None:
    monkeypatch.setenv("OBS_ENDPOINT", f"http://127.0.0.1:{closed_port}")
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "AK-env")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    store = make_store()
    assert store.endpoint == s3_endpoint
    assert store.credential_source == "explicit"


def test_env_beats_provider_and_works(make_store, s3_client, bucket: str, s3_endpoint: str, monkeypatch) -> None:
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc")
    monkeypatch.setenv("OBS_ENDPOINT", s3_endpoint)
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "AK-env")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("OBS_SECURITY_TOKEN", ENV_TOKEN)
    store = make_store(storage_options={})
    assert store.endpoint == s3_endpoint
    assert store.credential_source == "env"
    assert [i.key for i in store.list()] == ["f"]
    _assert_no_secrets(repr(store), str(store))


def test_endpoint_alone_from_options_and_keys_from_env(make_store, s3_endpoint: str, monkeypatch) -> None:
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "AK-env")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    store = make_store(storage_options={"endpoint_url": s3_endpoint})
    assert (store.endpoint, store.credential_source) == (s3_endpoint, "env")


class _RecordingProvider:
    """An SDK credential provider (a class with a static ``search``), as ECS/ENV are."""

    calls = 0

    @staticmethod
    def search() -> dict:
        _RecordingProvider.calls += 1
        return {"accessKey": "AK-provider", "secretKey": SECRET, "securityToken": None}


def test_provider_when_no_keys_anywhere(make_store, s3_client, bucket: str, s3_endpoint: str) -> None:
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc")
    _RecordingProvider.calls = 0
    store = make_store(storage_options={"server": s3_endpoint, "security_providers": [_RecordingProvider]})
    assert store.credential_source == "provider"
    out = io.BytesIO()
    assert [i.key for i in store.list()] == ["f"]
    assert store.get("f", out, 0, 3) == 3 and out.getvalue() == b"abc"
    assert _RecordingProvider.calls >= 2  # the SDK asks the provider on each request


class _Metadata:
    """What the local ECS metadata service of :func:`ecs_metadata` got and answers."""

    def __init__(self) -> None:
        self.asked: list[str] = []  # the request lines it got
        self.serving: str | None = None  # an access key it hands out; None: 403 to every request
        self.expires_at = "2000-01-01T00:00:00.000000Z"  # of what it hands out (as OBS writes it)
        self.stall = 0  # the next requests it holds (unanswered) until ``release`` is set: a lookup in flight
        self.stalled = threading.Event()  # a request is held
        self.release = threading.Event()  # the held requests are answered


@pytest.fixture
def ecs_metadata(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Metadata]:
    """The SDK's ECS provider asks a local server that has no credentials for it (403 to every
    request, as 169.254.169.254 answers where the suite runs), or has some (``serving``); yields
    its :class:`_Metadata`.

    The SDK fixes the metadata address (``obs/loadtoken.py``: ``HTTPConnection('169.254.169.254',
    timeout=5)`` inside ``ECS.search``): nothing configures it, so its module's ``http.client`` is
    swapped for one whose ``HTTPConnection`` connects here instead. The rest is the SDK's own
    lookup (three attempts 0.1 and 0.2 s apart, its lock, its cache)."""
    import http.client
    import http.server
    import threading
    import types

    from obs import loadtoken

    metadata = _Metadata()

    class Credentials(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            metadata.asked.append(self.requestline)
            if metadata.stall > 0:  # one lookup at a time (the SDK's lock): no race on the count
                metadata.stall -= 1
                metadata.stalled.set()
                metadata.release.wait(60)
            body = b""
            if metadata.serving is not None and self.command == "PUT":  # the v2 API's session token
                body = b"session-token"
            elif metadata.serving is not None:
                keys = {"access": metadata.serving, "secret": SECRET, "securitytoken": TOKEN, "expires_at": metadata.expires_at}
                body = json.dumps({"credential": keys}).encode()
            self.send_response(200 if body else 403)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = _answer  # noqa: N815 - http.server's names

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Credentials)
    thread = threading.Thread(target=server.serve_forever, name="ecs-metadata", daemon=True)
    thread.start()

    class ToTheTestServer(http.client.HTTPConnection):
        def __init__(self, host: str, port: int | None = None, **kwargs: object) -> None:
            assert host == "169.254.169.254", host
            if metadata.stall > 0:  # held, not timed out (the SDK's 5 s), then leaking its socket
                kwargs["timeout"] = 60
            super().__init__("127.0.0.1", server.server_port, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(loadtoken, "httplib", types.SimpleNamespace(HTTPConnection=ToTheTestServer))
    monkeypatch.delenv("HUAWEI_CLOUD_IDP_ID", raising=False)  # the OIDC provider: skipped without it
    for kept in ("ak", "sk", "token", "expires"):  # what the SDK's ECS keeps (class attributes): none
        monkeypatch.setattr(loadtoken.ECS, kept, None)
    try:
        yield metadata
    finally:
        metadata.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


def test_without_keys_the_metadata_service_is_asked_once_not_before_each_request(
    make_store, s3_client, bucket: str, fault_proxy, ecs_metadata: _Metadata, monkeypatch
) -> None:
    """The SDK asked ECS metadata before every request of a store without keys (it keeps what it
    finds, not that it found none): three attempts 0.3 s apart each time, under one lock of the
    SDK, so a public bucket read without keys off an ECS went at about 3 requests a second. Keys
    set in the environment later are still used at once."""
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc", ACL="public-read")
    proxy, endpoint = fault_proxy
    store = make_store(storage_options={"server": endpoint})
    for _ in range(10):
        assert store.get("f", io.BytesIO(), 0, 3) == 3
    # two lookups (the SDK's three attempts each: a lookup that finds none once is made again),
    # then 0.5 s without one, then 1 s, 2 s...: 2 to 4 lookups in the seconds 10 GETs take even
    # on a busy machine, where before each GET made one (30)
    lookups = len(ecs_metadata.asked)
    assert lookups in (6, 9, 12), ecs_metadata.asked
    assert not any("Authorization:" in head for head in proxy.requests)  # none found: unsigned

    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "AK-later")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    assert store.get("f", io.BytesIO(), 0, 3) == 3
    assert "Authorization: AWS AK-later:" in proxy.requests[-1]
    assert len(ecs_metadata.asked) == lookups


def test_once_the_metadata_service_had_credentials_a_failed_lookup_is_not_remembered(
    make_store, s3_client, bucket: str, fault_proxy, ecs_metadata: _Metadata
) -> None:
    """On an ECS whose metadata service failed as its credentials expired (down across their
    expiry: the SDK keeps unexpired ones through a failure), the next request looks again: a
    store that had found credentials went unsigned for a minute after the service was back (a
    PermissionError for a private bucket: a failed epoch), as if off an ECS."""
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc")  # private: an unsigned GET is denied
    proxy, endpoint = fault_proxy
    store = make_store(storage_options={"server": endpoint})
    ecs_metadata.serving = "AK-ecs"  # expired already: looked up again at each request
    assert store.get("f", io.BytesIO(), 0, 3) == 3
    assert "Authorization: AWS AK-ecs:" in proxy.requests[-1]

    ecs_metadata.serving = None  # the service fails (403), the credentials it gave have expired
    with pytest.raises(PermissionError, match="went unsigned"):
        store.get("f", io.BytesIO(), 0, 3)
    ecs_metadata.serving = "AK-ecs-renewed"  # back
    assert store.get("f", io.BytesIO(), 0, 3) == 3
    assert "Authorization: AWS AK-ecs-renewed:" in proxy.requests[-1]


def test_a_metadata_lookup_that_fails_once_at_the_start_is_made_again_at_the_next_request(
    make_store, s3_client, bucket: str, fault_proxy, ecs_metadata: _Metadata
) -> None:
    """On an ECS whose metadata service failed the first lookup (a blip; a service that limits
    the rate as a job's many workers start), the store went unsigned for 60 s (a PermissionError
    for a private bucket: every item of that minute failed), as if off an ECS."""
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc")  # private: an unsigned GET is denied
    proxy, endpoint = fault_proxy
    store = make_store(storage_options={"server": endpoint})
    with pytest.raises(PermissionError, match="went unsigned"):
        store.get("f", io.BytesIO(), 0, 3)
    ecs_metadata.serving = "AK-ecs"  # the service answers again
    assert store.get("f", io.BytesIO(), 0, 3) == 3
    assert "Authorization: AWS AK-ecs:" in proxy.requests[-1]


def test_a_process_forked_while_a_thread_looks_up_credentials_makes_its_own_lookup(
    make_store, s3_client, bucket: str, s3_endpoint: str, ecs_metadata: _Metadata
) -> None:
    """A process forked (a DataLoader worker, by default on Linux) while a thread of its parent
    looked up credentials for a store without keys (the SDK's ECS metadata lookup: up to three
    5 s timeouts where the address drops packets) inherited the locks that lookup held, held by
    a thread that does not exist in it: its first request, through a store of its own (the SDK's
    lock, a class attribute) or through the parent's store object (ours too), waited for ever."""
    s3_client.put_object(Bucket=bucket, Key="data/f", Body=b"abc", ACL="public-read")
    store = make_store(storage_options={"server": s3_endpoint})
    ecs_metadata.stall = 1
    got: list[int] = []
    looking = threading.Thread(target=lambda: got.append(store.get("f", io.BytesIO(), 0, 3)), name="looking-up")
    looking.start()
    try:
        assert ecs_metadata.stalled.wait(20)  # the parent's lookup is in flight, holding its locks

        def own_store() -> None:
            with ObsStore(f"obs://{BUCKET}/data/", {"server": s3_endpoint}) as mine:
                assert mine.get("f", io.BytesIO(), 0, 3) == 3

        assert in_a_fork(own_store) == 0  # before: killed after 30 s, waiting on the SDK's ECS.lock
        assert in_a_fork(lambda: store.get("f", io.BytesIO(), 0, 3)) == 0  # before: on the store's own
    finally:
        ecs_metadata.release.set()
        looking.join()
    assert got == [3]


def test_a_process_forked_while_a_thread_holds_the_sdk_s_other_request_locks_can_take_them() -> None:
    """As the ECS lookup's lock above, the SDK holds OIDC's lock across its requests to IAM, and
    one of its 16 locks (``obs.locks``, picked by the bucket's name) across the request that
    negotiates a bucket's signature (a client's first to it, at OBS's own endpoints): a process
    forked meanwhile found them held for ever. Held here by a thread, as those requests hold
    them (the tests' endpoint is an address, where the SDK does not negotiate, and OIDC's is
    fixed)."""
    from obs import loadtoken, locks

    negotiating = locks.get_lock(hash(BUCKET) % locks.LOCK_COUNT)
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with loadtoken.OIDC._lock, negotiating:
            holding.set()
            done.wait(60)

    holder = threading.Thread(target=hold, name="holding-the-sdk-s-locks")
    holder.start()
    try:
        assert holding.wait(20)

        def take() -> None:
            for lock in (loadtoken.OIDC._lock, locks.get_lock(hash(BUCKET) % locks.LOCK_COUNT)):
                assert lock.acquire(timeout=20)  # before: False (held by a thread not in this process)

        assert in_a_fork(take) == 0
    finally:
        done.set()
        holder.join()


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    """Objects ``/{BUCKET}/{i}`` (``_OBJECTS[i]``) over connections kept open (OBS keeps them; moto
    closes each after its response, so its clients pool none)."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = _OBJECTS[int(self.path.split("?")[0].rsplit("/", 1)[1])]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


_OBJECTS = [bytes([65 + i]) * 200_000 for i in range(4)]


def test_a_store_used_in_forked_processes_has_connections_of_its_own_in_each(make_store) -> None:
    """A store used in processes forked from one that had used it (a DataLoader's workers given
    the dataset's ``store=``) shared its pooled connection with them: processes sending on one
    connection read each other's responses (a GET returned another object's bytes, or a body as
    its status line: 14 of 15 processes of 30 GETs failed, in 5 runs)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    serving = threading.Thread(target=server.serve_forever, name="keep-alive-objects")
    serving.start()
    try:
        store = make_store(storage_options=_keys(f"http://127.0.0.1:{server.server_port}"))
        assert store.get("0", io.BytesIO(), 0, len(_OBJECTS[0])) == len(_OBJECTS[0])  # its connection, pooled

        def gets() -> None:
            for n in range(30):
                i = (os.getpid() + n) % len(_OBJECTS)
                out = io.BytesIO()
                assert store.get(str(i), out, 0, len(_OBJECTS[i])) == len(_OBJECTS[i])
                assert out.getvalue() == _OBJECTS[i]

        codes: list[int] = []
        forks = [threading.Thread(target=lambda: codes.append(in_a_fork(gets))) for _ in range(3)]
        for fork in forks:
            fork.start()
        for fork in forks:
            fork.join()
        assert codes == [0, 0, 0]
        gets()  # here too, on the connection it pooled: the forks' closed only their descriptors
        store.close()
    finally:
        server.shutdown()
        server.server_close()
        serving.join()


def test_a_provider_that_found_none_is_asked_again_after_a_quiet_time_that_grows() -> None:
    from obs.loadtoken import ENV, NoneTokenException

    from cachepipe.stores.obs_providers import ASK_AGAIN_AFTER, _Remembered, ask_again, quiet_after, remembering

    assert [quiet_after(n) for n in range(10)] == [0, 0, 0.5, 1, 2, 4, 8, 16, 32, ASK_AGAIN_AFTER]
    assert quiet_after(10**6) == ASK_AGAIN_AFTER
    assert ask_again(None, 0, 5.0)
    assert ask_again(100.0, 1, 100.0)  # one lookup found none: the next asks again (a blip costs no more)
    assert not ask_again(100.0, 9, 100.0 + ASK_AGAIN_AFTER - 1)
    assert ask_again(100.0, 9, 100.0 + ASK_AGAIN_AFTER)

    class Metadata:
        """A provider as the SDK's are (a class with a static ``search``): none, then some."""

        asked = 0
        has = False

        @staticmethod
        def search() -> dict:
            Metadata.asked += 1
            if not Metadata.has:
                raise NoneTokenException("none")
            return {"accessKey": "AK", "secretKey": SECRET, "securityToken": None}

    now = [1000.0]
    provider = _Remembered(Metadata, wait=60.0, clock=lambda: now[0])
    for _ in range(2):  # the first none is asked again at once; the second is remembered
        with pytest.raises(NoneTokenException):
            provider.search()
    for _ in range(3):
        with pytest.raises(NoneTokenException, match=r"asked again 0\.5 s after the last"):
            provider.search()
    assert Metadata.asked == 2
    for quiet in (0.5, 1, 2, 4, 8, 16, 32, 60, 60):  # each lookup that finds none doubles the quiet time
        now[0] += quiet
        with pytest.raises(NoneTokenException):
            provider.search()
    assert Metadata.asked == 11
    Metadata.has = True
    now[0] += 59
    with pytest.raises(NoneTokenException, match="asked again 60 s after the last"):
        provider.search()
    now[0] += 1
    assert provider.search()["accessKey"] == "AK"
    assert provider.search()["accessKey"] == "AK"
    assert Metadata.asked == 13  # found: asked each time, as the SDK asks it (it keeps its credentials)
    [env, ecs] = remembering([ENV, Metadata])
    assert env is ENV  # the environment: asked each time (keys set later used at once)
    assert isinstance(ecs, _Remembered) and ecs.__name__ == "Metadata"


def test_missing_endpoint_names_both_ways_to_set_it() -> None:
    with pytest.raises(ValueError, match=r"OBS_ENDPOINT") as info:
        ObsStore("obs://b/", {"access_key_id": "AK", "secret_access_key": SECRET})
    assert "storage_options['server']" in str(info.value)


def test_unknown_option_names_it_and_the_accepted_ones(s3_endpoint: str) -> None:
    with pytest.raises(ValueError, match=r"storage_options\['secret_key'\]") as info:
        ObsStore("obs://b/", {"server": s3_endpoint, "secret_key": SECRET})
    message = str(info.value)
    assert "access_key_id" in message and "secret_access_key" in message and "timeout" in message
    assert isinstance(info.value, ConfigError)
    _assert_no_secrets(message)


@pytest.mark.parametrize("key", ["use_http_conns", "use_http2"])
def test_unsupported_client_modes_are_refused(s3_endpoint: str, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ObsStore("obs://b/", {"server": s3_endpoint, key: True})


def test_two_endpoint_aliases_are_refused(s3_endpoint: str) -> None:
    with pytest.raises(ValueError, match="endpoint twice"):
        ObsStore("obs://b/", {"server": s3_endpoint, "endpoint": s3_endpoint})


def test_incomplete_credentials_are_refused_without_echoing_them(s3_endpoint: str, monkeypatch) -> None:
    with pytest.raises(ValueError, match=r"storage_options\['access_key_id'\] is missing") as info:
        ObsStore("obs://b/", {"server": s3_endpoint, "secret_access_key": SECRET})
    _assert_no_secrets(str(info.value))
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    with pytest.raises(ValueError, match=r"\$OBS_ACCESS_KEY_ID is missing") as info:
        ObsStore("obs://b/", {"server": s3_endpoint})
    _assert_no_secrets(str(info.value))


@pytest.mark.parametrize(
    "url",
    ["s3://b/p/", "obs:///p/", "obs://AK:SK@b/p/", "obs://b/p/?x=1", "b/p"],
)
def test_bad_urls(url: str, s3_endpoint: str) -> None:
    with pytest.raises(ValueError) as info:  # noqa: PT011 - any error of this type is what the test expects
        ObsStore(url, {"server": s3_endpoint})
    if "@" in url:
        assert "AK:SK" not in str(info.value)  # credentials in a URL are not echoed


@pytest.mark.parametrize("page_size", [0, 1001, "2", True])
def test_bad_page_size(page_size, s3_endpoint: str) -> None:
    with pytest.raises(ValueError, match="page_size"):
        ObsStore("obs://b/", {"server": s3_endpoint}, page_size=page_size)


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"timeout": None}, "timeout=None"), ({"custom_ciphers": "NO-SUCH-CIPHER"}, "custom_ciphers='NO-SUCH-CIPHER'")],
)
def test_what_the_client_refuses_when_it_is_made_check_store_refuses_naming_it_and_sends_nothing(extra, named) -> None:
    """check_store (serve --check, and serve at its start) passed these: only ObsStore refused
    them, when it made its client. Making one sends nothing: a listener at the endpoint sees no
    connection, for a client that the check makes and closes."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        endpoint = f"https://127.0.0.1:{listener.getsockname()[1]}"
        options = {**_keys(endpoint), "proxy_password": SECRET, **extra}
        with pytest.raises(ConfigError, match=r"obs\.ObsClient refused the storage options it was given") as checked:
            check_store("obs://b/p/", options)
        message = str(checked.value)
        assert f"server='{endpoint}'" in message and named in message and "proxy_password='***'" in message
        _assert_no_secrets(message)
        with pytest.raises(ConfigError) as opened:
            ObsStore("obs://b/p/", options)
        assert str(opened.value) == message
        check_store("obs://b/p/", _keys(endpoint))
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected


@pytest.mark.parametrize("server", ["http://127.0.0.1:abc", "http://h:1:2", "https://h:70000"])
def test_an_endpoint_whose_port_is_not_a_number_is_refused(server: str) -> None:
    """The SDK took a port that is not a number for none, and sent to port 80 or 443; 70000 failed at the first connect."""
    for make in (check_store, ObsStore):
        with pytest.raises(ConfigError, match=rf"its port is not a number from 0 to 65535, got '{server}'"):
            make("obs://b/p/", _keys(server))


def test_endpoint_without_scheme_defaults_to_https() -> None:
    store = ObsStore("obs://b/", _keys("obs.example.com"))  # https: the SDK's ssl warning must not escape
    try:
        assert store.endpoint == "https://obs.example.com"
    finally:
        store.close()


# -- secrets ------------------------------------------------------------------------------------


def test_secrets_absent_from_repr_errors_and_logs(
    make_store, s3_endpoint: str, bucket: str, closed_port: int, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv("OBS_ACCESS_KEY_ID", "AK-env")
    monkeypatch.setenv("OBS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.setenv("OBS_SECURITY_TOKEN", ENV_TOKEN)
    texts = []
    for store in (
        make_store(storage_options={"server": s3_endpoint}),
        make_store(),
        make_store(f"obs://{bucket}/", {"server": f"http://127.0.0.1:{closed_port}"}),
        make_store("obs://absent-bucket/", {"server": s3_endpoint}),
    ):
        texts += [repr(store), str(store)]
        for attempt in (lambda: list(store.list()), lambda: store.get("nope", io.BytesIO(), 0, 5)):  # noqa: B023 - the lambda is called at once, inside this iteration
            try:
                attempt()
            except OSError as exc:
                texts += _error_texts(exc)
    assert any("cannot reach OBS endpoint" in t for t in texts)
    assert any("no such object" in t for t in texts)
    assert any("does not exist" in t for t in texts)
    _assert_no_secrets(*texts, caplog.text)


# -- packaging ----------------------------------------------------------------------------------


def test_module_imports_without_loading_the_sdk() -> None:
    import subprocess
    import sys

    code = "import sys, cachepipe.stores.obs; assert 'obs' not in sys.modules, 'SDK imported eagerly'"
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True)


def test_missing_sdk_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "obs", None)  # makes `from obs import ...` fail
    with pytest.raises(ImportError, match=r"pip install 'cachepipe\[obs\]'") as info:
        ObsStore("obs://b/", _keys("http://127.0.0.1:9"))
    assert isinstance(info.value.__cause__, ImportError)


def test_sdk_provider_chain_is_enabled_only_without_keys(make_store, s3_endpoint: str) -> None:
    # No request is made: without a key pair the SDK would ask ECS metadata (169.254.169.254).
    client = make_store(storage_options={"server": s3_endpoint})._client
    assert client.security_provider_policy == "OBS_DEFAULT"
    assert [p.__name__ for p in client.security_providers] == ["ENV", "ECS", "OIDC"]  # as the SDK's
    assert make_store()._client.security_provider_policy is None


def test_a_get_whose_body_is_not_read_to_its_end_closes_its_socket(make_store, s3_client, bucket: str) -> None:
    """The SDK closes the connection of a response marked not to be pooled, but not the response,
    whose file object kept the socket open (closed, its descriptor not) until the response was
    collected: in a reference cycle, a ResourceWarning ("unclosed socket [closed]") at some later
    test's garbage collection, which failed a fresh clone's run (test_notebook_behaviour)."""
    s3_client.put_object(Bucket=bucket, Key="data/big", Body=bytes(3 * 2**20))
    store = make_store()

    class Full(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left") as failed:  # its traceback keeps the GET's frame alive
        store.get("big", Full(), 0, 3 * 2**20)
    half_closed = [sock for sock in store._socks if sock._closed and sock.fileno() != -1]
    assert half_closed == [], failed.value


def test_an_upload_whose_request_cannot_be_sent_closes_its_socket(make_store, bucket: str, fault_proxy, tmp_path) -> None:
    """A connection reset while the SDK sends a request (an upload's body to an endpoint that
    resets it, or a send cut by abort): the SDK lost that connection, its socket open, until the
    garbage collector found it (a descriptor leaked for each such failure, and a ResourceWarning
    in whatever test ran then; with the store's wrappers on the connection, it waited in a
    reference cycle)."""
    proxy, endpoint = fault_proxy
    local = tmp_path / "out.bin"
    local.write_bytes(bytes(4 * 2**20))  # more than the socket buffers take before the reset
    store = make_store(storage_options=_keys(endpoint))
    proxy.inject("refuse", 1)
    with pytest.raises(StoreUnavailableError, match="cannot reach OBS endpoint") as failed:  # its traceback keeps the frames
        store.put(local, "out.bin")
    store.close()
    left_open = [sock for sock in store._socks if sock.fileno() != -1]
    assert left_open == [], failed.value


def test_a_connection_the_sdk_lets_go_of_is_freed_at_once_not_by_the_garbage_collector(make_store, payload: bytes) -> None:
    """The store's wrappers on each connection the SDK takes referred to it: a reference cycle,
    so each connection the SDK let go of (the moto server closes every one after its response)
    waited for the garbage collector, and one the SDK dropped with its socket open (the test
    above) kept that socket open until then: its ResourceWarning failed whatever test was
    running at that collection, not the one that left it."""
    store = make_store()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            assert store.get("item/blob.bin", io.BytesIO(), 0, 10) == 10
        assert list(store._conns) == []
    finally:
        if enabled:
            gc.enable()


@pytest.fixture
def long_listing(s3_client, bucket: str) -> None:
    """A listing page longer than the fault proxy's ``cut_after`` (2,000 bytes)."""
    for i in range(20):
        s3_client.put_object(Bucket=bucket, Key=f"data/item{i:02d}", Body=b"x")


@pytest.mark.parametrize(("fault", "cut_after"), [("cut", 2000), ("reset", 2000), ("cut", 60)], ids=["cut", "reset", "cut-head"])
def test_a_listing_whose_body_ends_early_is_an_outage_and_its_socket_is_closed_at_once(
    make_store, long_listing: None, fault_proxy, fault: str, cut_after: int
) -> None:
    """``cut``: the connection closed mid-body. http.client reads that as the body's end, and the
    SDK, which drops what it cannot parse, returned a listing without a body: a permanent
    OSError "a listing that could not be parsed ... not an OBS answer", not an outage to retry.
    ``reset``: the read raised, and the SDK closed the connection, not the response, whose file
    object held the socket (the server said it would close the connection): open until the
    garbage collector found it. ``cut-head``: closed inside the response's headers, before its
    Content-Length (60 bytes: the status line and the Server header the moto server sends
    first): http.client ends the headers at the connection's end, and the rest read as a whole
    response with an empty body, the same permanent OSError."""
    proxy, endpoint = fault_proxy
    store = make_store(storage_options=_keys(endpoint))
    proxy.cut_after = cut_after
    proxy.inject(fault, 1)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(StoreUnavailableError, match="cannot reach OBS endpoint") as failed:
            list(store.list())
        left_open = [sock for sock in store._socks if sock.fileno() != -1]
    finally:
        if enabled:
            gc.enable()
    assert is_transient(failed.value)
    assert left_open == [], failed.value
    assert proxy.injected[fault] == 1
    assert len(list(store.list())) == 20  # the next connection is whole
    store.close()  # its pooled connection, before the proxy stops


def _in_frame(thread: threading.Thread, name: str) -> bool:
    """Whether ``thread`` runs the function ``name`` now (somewhere in its stack)."""
    frame = sys._current_frames().get(thread.ident)  # a thread's stack, read only
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("call", ["list", "names_object"])
def test_abort_cuts_a_listing_mid_body_and_a_check_with_the_store_s_closed_error(
    make_store, long_listing: None, fault_proxy, call: str
) -> None:
    """``list`` cut by abort once its page's body was coming: the SDK took the cut body for the
    end of a body it could not parse, and the store raised "a listing that could not be parsed"
    (OSError), not its closed error. ``names_object`` cut by abort: the SDK's raw exception
    (RemoteDisconnected), not translated at all."""
    proxy, endpoint = fault_proxy
    store = make_store(storage_options=_keys(endpoint))
    gate = threading.Event()
    if call == "list":
        proxy.inject("stall", 1)  # 2,000 bytes of the page, then silence
        where = "_prepare_response_data"  # the SDK reads the body (obs/client.py)
    else:
        proxy.hold(lambda head: head.startswith("HEAD"), gate)
        where = "getresponse"  # the SDK waits for the answer
    raised: list[BaseException] = []

    def run() -> None:
        try:
            list(store.list()) if call == "list" else store.names_object()
        except BaseException as exc:  # noqa: BLE001 - the test checks it
            raised.append(exc)

    asking = threading.Thread(target=run)
    asking.start()
    try:
        wait_until(lambda: _in_frame(asking, where), what=f"the request's thread in {where}")
        store.abort()
        asking.join(timeout=20)
    finally:
        gate.set()
        asking.join()
        store.close()  # its pooled connection, before the proxy stops
    assert len(raised) == 1 and isinstance(raised[0], StoreClosedError), raised


def test_the_sdk_imports_under_the_suite_s_warnings_with_nothing_compiled_yet(tmp_path) -> None:
    """esdk-obs-python's sources have invalid escape sequences: compiled inside a test (a fresh
    clone's empty bytecode prefix) their warning, an error in this suite, failed the import."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = Path(__file__).resolve().parent.parent / "pyproject.toml"
    (tmp_path / "test_sdk.py").write_text("def test_sdk():\n    import obs  # noqa: F401\n")
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(tmp_path / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(config), "--rootdir", str(tmp_path)]
    done = subprocess.run([*command, str(tmp_path)], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:]
