"""Shared fixtures: one real moto S3 server per session, reset between tests; thread-leak guard."""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

# Credentials for the moto server; set before any SDK reads the environment.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Endpoint URL (http://127.0.0.1:PORT) of a moto S3 server started once per session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_endpoint(moto_server: str) -> Iterator[str]:
    """The moto endpoint, emptied before the test (buckets and objects)."""
    req = urllib.request.Request(f"{moto_server}/moto-api/reset", method="POST")
    urllib.request.urlopen(req).close()
    yield moto_server


@pytest.fixture
def s3_client(s3_endpoint: str):
    """A boto3 S3 client on the moto server, for arranging test data."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")


@pytest.fixture
def s3_options(s3_endpoint: str) -> dict:
    """storage_options that point s3fs at the moto server."""
    return {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}


# Threads that outlive a test by design and are not ours: the moto server and its
# per-connection handlers (kept alive by pooled client connections), fsspec's event loop.
_FOREIGN_THREADS = ("fsspecIO", "process_request_thread", "_server_entry")


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
