"""Shared fixtures: one real moto S3 server per session, reset between tests; thread-leak guard."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the moto server logs every request at INFO

# Credentials for the moto server; set before any SDK reads the environment.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)

# A suite started with SIGINT ignored (`make test &` from a script, nohup) passes that on to every
# process it starts, and the tests that stop a `cachepipe map` or a daemon with Ctrl-C (SIGINT)
# found it ignored (as it should be, there: cachepipe keeps an ignored SIGINT). The processes the
# tests start get the default action back (an exec resets a handled signal, not an ignored one).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Endpoint URL (http://127.0.0.1:PORT) of a moto S3 server started once per session.

    moto's server picks each request's service from the credential scope of a SigV4
    ``Authorization`` header. The OBS SDK signs with V2 (``AWS key:signature``), and a signature
    holding exactly four ``/`` parses as a scope naming no service: HTTP 500, about one request in
    1,400, and a CI run failed on one. This server sends every request signed otherwise than
    with SigV4 to S3; the rest it routes as moto does (``test_s3direct.py`` uses its IAM).

    It also remembers the backend of each host it has routed: moto looks it up anew for every
    request, under the lock that every request takes, and the lookup lists moto's package folder
    and stats each of its ~175 service folders (about 1 ms of CPU a request).
    """
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class V2IsS3(DomainDispatcherApplication):
        def infer_service_region_host(self, environ: dict, path: str) -> str | None:
            auth = environ.get("HTTP_AUTHORIZATION")
            if auth and not auth.startswith("AWS4-"):
                return "s3.us-east-1.amazonaws.com"
            return super().infer_service_region_host(environ, path)

        def get_backend_for_host(self, host: str | None) -> object:
            known = self.__dict__.setdefault("_backend_of_host", {})  # called with the dispatcher's lock held
            if host not in known:
                backend = super().get_backend_for_host(host)
                if backend is None:
                    return None  # not remembered: moto says so (and prints why) each time
                known[host] = backend
            return known[host]

    server = make_server("127.0.0.1", 0, V2IsS3(create_backend_app), threaded=True, request_handler=MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, name="moto-s3-server", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


@pytest.fixture
def s3_endpoint(moto_server: str) -> Iterator[str]:
    """The moto endpoint, emptied before the test (buckets and objects)."""
    req = urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")  # noqa: S310 - a local http:// URL built here
    urllib.request.urlopen(req).close()  # noqa: S310 - a local http:// URL built here
    return moto_server


@pytest.fixture(scope="session")
def _session_s3_client(moto_server: str):
    import boto3

    return boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")


@pytest.fixture
def s3_client(s3_endpoint: str, _session_s3_client):
    """A boto3 S3 client on the moto server, for arranging test data. One for the session (its
    credentials are the suite's dummy keys, set before it is made; no test changes it): a new
    client for each test cost 20-30 ms of CPU."""
    return _session_s3_client


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict:
    """storage_options that point s3fs at the moto server."""
    return {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}


# Threads that outlive a test by design and are not ours: the moto server and its
# per-connection handlers (kept alive by pooled client connections), fsspec's event loop and
# that loop's default executor (aiohttp resolves host names there), tqdm's process-wide monitor.
_FOREIGN_THREADS = ("fsspecIO", "asyncio_", "process_request_thread", "moto-s3-server", "tqdm_monitor")


def _ours(t: threading.Thread) -> bool:
    return t.is_alive() and not any(tag in t.name for tag in _FOREIGN_THREADS)


@pytest.fixture(autouse=True)
def no_thread_leaks() -> Iterator[None]:
    """Every thread a test starts (cachepipe's or otherwise) must be gone when it ends."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and _ours(t)]
        if not leaked or time.monotonic() > deadline:
            break
        leaked[0].join(timeout=0.05)
    assert not leaked, f"threads leaked by this test: {[t.name for t in leaked]}"


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

    def user(self, name: str, actions: list[str]) -> tuple[str, str]:
        """A new IAM user allowed only ``actions`` (``["s3:GetObject"]``...): its access key pair."""
        import boto3

        iam = boto3.client("iam", endpoint_url=self.endpoint, region_name="us-east-1")
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName="only", PolicyDocument=json.dumps(policy))
        made = iam.create_access_key(UserName=name)["AccessKey"]
        return made["AccessKeyId"], made["SecretAccessKey"]

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
    """The moto server's IAM (:class:`MotoIAM`); signatures and permissions are checked from
    :meth:`MotoIAM.enforce` to the end of the test."""
    iam = MotoIAM(s3_endpoint)
    yield iam
    _post(f"{s3_endpoint}/moto-api/reset-auth", b"inf")  # the server is shared: no checks again


def as_a_user() -> list[str]:
    """The command prefix that runs a child as a user other than root runs it: without the
    capabilities that let root read and write any file (setpriv), so that permissions apply."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: files without permissions are readable and writable to this test")
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--"]


class Source:
    """A dataset location of one backend kind, with helpers to arrange objects in it."""

    def __init__(self, kind: str, url: str, options: dict, put, delete) -> None:
        self.kind, self.url, self.options = kind, url, options
        self._put, self._delete = put, delete

    def put(self, key: str, data: bytes) -> None:
        self._put(key, data)

    def put_many(self, objects: dict[str, bytes]) -> None:
        """Put each of ``objects`` {key: data}; all are there when it returns. To the moto server
        (s3, obs) several at a time: one put at a time waits on each round trip between this
        process's threads (about 9 ms a put where 5 are CPU; 4 ms with 8 at a time)."""
        if self.kind not in ("s3", "obs") or len(objects) < 2:
            for key, data in objects.items():
                self.put(key, data)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(8, len(objects)), thread_name_prefix="test-put") as pool:
            for done in [pool.submit(self.put, key, data) for key, data in objects.items()]:
                done.result()  # a failed put fails the test

    def delete(self, key: str) -> None:
        self._delete(key)

    def folders(self, n: int, files: dict[str, int], seed: int = 0) -> dict[str, dict[str, bytes]]:
        """Put ``n`` folders ``item000..`` each with ``files`` {name: size}; return their contents."""
        import random

        rng = random.Random(seed)
        data: dict[str, dict[str, bytes]] = {}
        for i in range(n):
            name = f"item{i:03d}"
            data[name] = {rel: rng.randbytes(size) for rel, size in files.items()}
        self.put_many({f"{name}/{rel}": body for name, item in data.items() for rel, body in item.items()})
        return data


def _s3_source(s3_client, s3_options) -> Source:
    s3_client.create_bucket(Bucket="data")
    return Source(
        "s3",
        "s3://data/video/",
        s3_options,
        lambda k, d: s3_client.put_object(Bucket="data", Key=f"video/{k}", Body=d),
        lambda k: s3_client.delete_object(Bucket="data", Key=f"video/{k}"),
    )


def _file_source(root) -> Source:
    root.mkdir()

    def put(key, data):
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return Source("file", str(root), {}, put, lambda k: (root / k).unlink())


def _memory_source() -> Source:
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs.clear()
    fs.pseudo_dirs.append("")
    return Source(
        "memory",
        "memory://data/video",
        {},
        lambda k, d: fs.pipe_file(f"/data/video/{k}", d),
        lambda k: fs.rm_file(f"/data/video/{k}"),
    )


def _obs_source(s3_client, s3_endpoint) -> Source:
    """The same moto bucket, reached through the Huawei OBS SDK (path-style http)."""
    src = _s3_source(s3_client, {})
    options = {"server": s3_endpoint, "access_key_id": "testing", "secret_access_key": "testing"}
    return Source("obs", "obs://data/video/", options, src._put, src._delete)


@pytest.fixture(params=["s3", "obs", "file", "memory"])
def source(request, tmp_path) -> Source:
    """An empty dataset prefix on each backend: s3 (s3fs) and obs (OBS SDK) against the moto
    server over HTTP, local files, fsspec memory."""
    if request.param == "s3":
        return _s3_source(request.getfixturevalue("s3_client"), request.getfixturevalue("s3_options"))
    if request.param == "obs":
        return _obs_source(request.getfixturevalue("s3_client"), request.getfixturevalue("s3_endpoint"))
    if request.param == "file":
        return _file_source(tmp_path / "src")
    return _memory_source()


@pytest.fixture
def s3_source(s3_client, s3_options) -> Source:
    """An empty dataset prefix on the moto S3 server."""
    return _s3_source(s3_client, s3_options)


@pytest.fixture(params=["s3", "obs"])
def remote_source(request) -> Source:
    """An empty dataset prefix on the moto server, through s3fs and through the OBS SDK."""
    if request.param == "s3":
        return _s3_source(request.getfixturevalue("s3_client"), request.getfixturevalue("s3_options"))
    return _obs_source(request.getfixturevalue("s3_client"), request.getfixturevalue("s3_endpoint"))


@pytest.fixture
def fault_proxy(moto_server: str):
    """A :class:`faultproxy.FaultProxy` in front of the moto server; yields (proxy, endpoint)."""
    from faultproxy import FaultProxy

    host, port = moto_server.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port))
    endpoint = proxy.start()
    yield proxy, endpoint
    proxy.stop()


def listed(source: Source, tmp_path: Path) -> str:
    """A manifest of ``source``, listed directly (not through a proxy): a pipeline opened on it
    sends nothing but the items' GETs, so faults a proxy takes before the pipeline opens hit
    those and only those (taken after it opens, they would race its first downloads)."""
    from cachepipe.manifest import index

    manifest = tmp_path / "listing.gz"
    index(source.url, manifest, storage_options=source.options)
    return str(manifest)


def via(source: Source, endpoint: str) -> dict:
    """``source``'s storage options with the endpoint replaced (to route through a proxy)."""
    options = dict(source.options)
    if source.kind == "obs":
        options["server"] = endpoint
    else:
        options["endpoint_url"] = endpoint
        # one botocore attempt per s3fs attempt, so the faults reach cachepipe's own retries
        options["config_kwargs"] = {"retries": {"max_attempts": 1, "mode": "standard"}}
    return options


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path under /tmp, for daemon sockets (a Unix socket path must fit in
    108 bytes, which pytest's tmp_path can exceed)."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="cp-"))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def one_large_item(tmp_path) -> tuple[str, list[str]]:
    """A local source of six one-file folders, ``item0``..``item5``, of 100 bytes but ``item2``
    of 95,000: it fits a cache of 100,000 bytes, not one of 90,000. Its path and item names."""
    src = tmp_path / "src"
    names = [f"item{i}" for i in range(6)]
    for name in names:
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(bytes(95_000 if name == "item2" else 100))
    return str(src), names
