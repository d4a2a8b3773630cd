"""`make demo`: an embedded local S3 server, generated sample folders, streamed through a small cache.

Starts a moto S3 server on 127.0.0.1 (a free port), uploads 48 sample folders (video.mp4 of
1-3 MiB + text.txt), then streams them through a 16 MiB cache with a progress bar and prints
what the cache did. Nothing leaves this machine; the cache is removed at the end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import sys
import tempfile
import time

os.environ.setdefault("AWS_ACCESS_KEY_ID", "demo")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "demo")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import boto3
from moto.server import ThreadedMotoServer

from cachepipe import Pipeline

FOLDERS = 48
CAPACITY = "16MiB"


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="demo")
        rng = random.Random(0)
        digests = {}
        total = 0
        for i in range(FOLDERS):
            video = rng.randbytes(rng.randint(1, 3) * 1024 * 1024)
            name = f"folder{i:03d}"
            s3.put_object(Bucket="demo", Key=f"video/{name}/video.mp4", Body=video)
            s3.put_object(Bucket="demo", Key=f"video/{name}/text.txt", Body=f"caption {i}\n".encode())
            digests[name] = hashlib.md5(video).hexdigest()
            total += len(video)
        print(f"local S3 server at {endpoint}: {FOLDERS} folders, {total / 2**20:.0f} MiB in s3://demo/video/")

        with tempfile.TemporaryDirectory(prefix="cachepipe-demo-") as tmp:
            cache_dir = os.path.join(tmp, "cache")
            print(f"streaming through a {CAPACITY} cache at {cache_dir}\n")
            start = time.monotonic()
            with Pipeline(
                "s3://demo/video/",
                cache_dir=cache_dir,
                capacity=CAPACITY,
                storage_options={"endpoint_url": endpoint},
                progress=True,
            ) as pipe:
                for path in pipe:
                    data = (path / "video.mp4").read_bytes()  # "train" on it
                    if hashlib.md5(data).hexdigest() != digests[path.name]:
                        raise SystemExit(f"corrupt item {path.name}")
                stats = pipe.stats()
            elapsed = time.monotonic() - start
        print()
        print(
            f"delivered {stats.items_handed} items, all verified, in {elapsed:.2f} s "
            f"({stats.bytes_downloaded / 2**20 / elapsed:.0f} MiB/s)"
        )
        print(f"cache capacity {stats.capacity / 2**20:.0f} MiB for a {total / 2**20:.0f} MiB dataset")
        for field, value in vars(stats).items():
            print(f"  {field:24} {value:.3f}" if isinstance(value, float) else f"  {field:24} {value}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
