"""Seconds to fail for the configuration and permanent errors a new user meets first.

Each case opens a ``Pipeline`` with the default retries (12) against a local moto S3 server
(reached as s3:// and, through the OBS SDK, as obs://), and prints the exception it ends with
and how long that took. A mistake must fail at once (well under a second); only transient
faults are retried::

    .venv/bin/python benchmarks/fail_fast.py [CASE-SUBSTRING ...]

No root, no network beyond 127.0.0.1 (an unresolvable host uses the reserved ``.invalid`` TLD).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import boto3
from moto.server import ThreadedMotoServer

from cachepipe import Pipeline

CREDS_S3 = {"key": "testing", "secret": "testing"}
CREDS_OBS = {"access_key_id": "testing", "secret_access_key": "testing"}


def cases(endpoint: str, closed: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Case name -> (source URL, storage options)."""
    return {
        "s3 mistyped option endpoint=": ("s3://data/video/", {"endpoint": endpoint, **CREDS_S3}),
        "s3 closed port": ("s3://data/video/", {"endpoint_url": closed, **CREDS_S3}),
        "s3 unresolvable host": ("s3://data/video/", {"endpoint_url": "http://no-such-host.invalid:9000", **CREDS_S3}),
        "s3 missing bucket": ("s3://nobucket/video/", {"endpoint_url": endpoint, **CREDS_S3}),
        "unknown scheme": ("s4://data/video/", {}),
        "obs closed port": ("obs://data/video/", {"server": closed, **CREDS_OBS}),
        "obs unresolvable host": ("obs://data/video/", {"server": "http://no-such-host.invalid:9000", **CREDS_OBS}),
        "obs missing bucket": ("obs://nobucket/video/", {"server": endpoint, **CREDS_OBS}),
        "obs mistyped option": ("obs://data/video/", {"endpont": endpoint, **CREDS_OBS}),
        "file mistyped option": ("file:///tmp/", {"auto_mkdirs": True}),
        "memory mistyped option": ("memory://data/", {"endpoint": "x"}),
    }


def main() -> int:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        s3.create_bucket(Bucket="data")
        s3.put_object(Bucket="data", Key="video/a/f", Body=b"x")
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
        probe.close()  # nothing listens there now
        only = sys.argv[1:]
        print("seconds | case | outcome")
        for name, (url, options) in cases(endpoint, closed).items():
            if only and not any(o in name for o in only):
                continue
            start = time.monotonic()
            try:
                with (
                    tempfile.TemporaryDirectory() as folder,
                    Pipeline(url, folder + "/c", "1MiB", storage_options=options) as pipe,
                ):
                    list(pipe)
                outcome = "no error"
            except Exception as exc:  # noqa: BLE001 - the point is to report whatever it ends with
                outcome = f"{type(exc).__name__}: {exc}"
            print(f"{time.monotonic() - start:7.2f} | {name} | {outcome[:200]}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
