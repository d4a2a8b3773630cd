"""The direct S3 GET path (cachepipe.stores.s3direct) against the moto server: with moto checking
every signature against IAM access keys, through the fault proxy (which records request heads),
and the addresses s3fs's client resolves."""

from __future__ import annotations

import io
import json
import urllib.request
from datetime import datetime, timedelta, timezone

import pytest

from cachepipe.stores.fsspec import FsspecStore

BODY = bytes(range(256)) * 300  # 76,800 bytes
ODD_KEY = "c d/ü+x~=(1).bin"


def _post(url: str, data: bytes) -> None:
    request = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "text/plain"})  # noqa: S310 - a local http:// URL built here
    urllib.request.urlopen(request).close()  # noqa: S310 - a local http:// URL built here


class MotoIAM:
    """An IAM user allowed everything, with two access keys; :meth:`enforce` makes the moto server
    check the signature of every request from then on (until the test ends)."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1")
        iam.create_user(UserName="reader")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="all", PolicyDocument=json.dumps(policy))
        made = [iam.create_access_key(UserName="reader")["AccessKey"] for _ in range(2)]
        self.keys = [(k["AccessKeyId"], k["SecretAccessKey"]) for k in made]

    def enforce(self) -> None:
        _post(f"{self.endpoint}/moto-api/reset-auth", b"0")

    def delete_key(self, access_key: str, signed_with: tuple[str, str]) -> None:
        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=signed_with[0],
            aws_secret_access_key=signed_with[1],
        )
        iam.delete_access_key(UserName="reader", AccessKeyId=access_key)


@pytest.fixture
def moto_iam(s3_endpoint):
    iam = MotoIAM(s3_endpoint)
    yield iam
    _post(f"{s3_endpoint}/moto-api/reset-auth", b"inf")  # the server is shared: no checks again


def _get(store: FsspecStore, key: str, start: int = 0, end: int | None = None) -> bytes:
    out = io.BytesIO()
    end = len(BODY) if end is None else end
    assert store.get(key, out, start, end) == end - start
    return out.getvalue()


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
    store = FsspecStore(s3_source.url, {**s3_source.options, "endpoint_url": endpoint, "skip_instance_cache": True})
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
    store = FsspecStore(s3_source.url, {**s3_source.options, "endpoint_url": endpoint, "skip_instance_cache": True})
    try:
        proxy.inject("redirect", 1)
        assert _get(store, "a", 10, 20) == BODY[10:20]
        assert proxy.injected["redirect"] == 1
        assert store._direct.url("data", "video/a") is None
        assert _get(store, "a") == BODY
    finally:
        store.close()
