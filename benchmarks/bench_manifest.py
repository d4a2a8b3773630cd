"""Benchmark: time and memory of a manifest of many items: write, read, plan (no network).

A synthetic catalog of ``--items`` folder items (default 1,000,000), each of ``--files`` files
(default 2: ``video.mp4`` and ``text.txt``, with MD5 ETags), is written as a manifest to a local
file (:func:`cachepipe.manifest.write_manifest`: digest, then gzip JSON lines), read back and
checked (:func:`cachepipe.manifest.read_manifest`: parse, count and digest), and planned
(:class:`cachepipe.plan.Plan` with a seeded shuffle, rank 0 of ``--world-size``, and its epoch-0
share computed). Beside them, ``group``: a listing of as many single objects, generated as it
is read, grouped into items with ``items="files"`` (:func:`cachepipe.catalog.group_items`, which
checks every key, and files against the folders of later keys) and counted, not kept; and
``list-files``/``list-folders``: :func:`cachepipe.listing.list_source` (what ``cachepipe index``
and a pass that is not streamed list with: retries, the catalog kept) over a store that generates
``--items`` objects as they are listed (``files``), or ``--items`` folders of ``--files`` objects
(``folders``), with no network: the listing's own CPU.

Each phase is timed once without tracing, then run again under :mod:`tracemalloc` for its peak
of Python allocations above what was held before it. The process's peak RSS
(``resource.getrusage``) is reported at the end.

Usage::

    .venv/bin/python benchmarks/bench_manifest.py                 # 1,000,000 items, ~1 min
    .venv/bin/python benchmarks/bench_manifest.py --items 1000 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachepipe.catalog import Catalog, group_items
from cachepipe.listing import list_source
from cachepipe.manifest import read_manifest, write_manifest
from cachepipe.plan import Plan
from cachepipe.stores.base import ObjectInfo

SOURCE = "s3://bench/dataset/"


def synthetic(items: int, files: int) -> Catalog:
    catalog = Catalog(mode="folders")
    rels = ["video.mp4", "text.txt", *(f"extra{k}.bin" for k in range(max(0, files - 2)))][:files]
    for i in range(items):
        etag = hashlib.md5(i.to_bytes(8, "little"), usedforsecurity=False).hexdigest()
        catalog.add(f"folder{i:07d}", [(rel, 1_000_000 + (i * 7919 + k) % 9_000_000, etag) for k, rel in enumerate(rels)])
    return catalog


class Generated:
    """A store whose listing is generated as it is read, in key order: ``keys`` (a function of
    the index) of ``count`` objects; ``start_after`` honoured, as S3's."""

    url = SOURCE

    def __init__(self, count: int, key: Callable[[int], str]) -> None:
        self.count, self.key = count, key

    def list(self, start_after: str | None = None) -> Any:
        key = self.key
        for i in range(self.count):
            name = key(i)
            if start_after is None or name > start_after:
                yield ObjectInfo(name, 110_000, None)


def measure(fn: Callable[[], Any]) -> tuple[float, int, Any]:
    """(seconds untraced, peak traced bytes above the start, result of the untraced run)."""
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    del result
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    traced = fn()
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return seconds, peak, traced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=2, help="files per item (default 2)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    catalog = synthetic(args.items, args.files)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory(prefix="cachepipe-bench-manifest-") as tmp:
        path = Path(tmp, "manifest.gz")
        digest_s, digest_peak, digest = measure(catalog.digest)
        write_s, write_peak, _ = measure(lambda: write_manifest(path, SOURCE, "folders", catalog))
        size = path.stat().st_size
        read_s, read_peak, manifest = measure(lambda: read_manifest(path))
        if manifest.digest != digest or len(manifest.catalog) != args.items:
            raise SystemExit(
                f"read back {len(manifest.catalog)} items, digest {manifest.digest}: expected {args.items}, {digest}"
            )

        def plan() -> int:
            p = Plan(manifest.catalog.sizes, epochs=1, shuffle=True, seed=0, rank=0, world_size=args.world_size)
            return len(p.share(0))

        plan_s, plan_peak, share = measure(plan)

    def group() -> int:
        listing = (ObjectInfo(f"train/shard{i // 1000:05d}/sample{i:08d}.jpg", 110_000) for i in range(args.items))
        return sum(1 for _ in group_items(listing, "files"))

    group_s, group_peak, grouped = measure(group)
    files = Generated(args.items, lambda i: f"train/shard{i // 1000:05d}/sample{i:08d}.jpg")
    list_files_s, list_files_peak, listed_files = measure(lambda: len(list_source(files, "files")))
    each = args.files
    folders = Generated(args.items * each, lambda i: f"folder{i // each:07d}/file{i % each}.bin")
    list_folders_s, list_folders_peak, listed_folders = measure(lambda: len(list_source(folders, "folders")))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    report = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "items": args.items,
        "files_per_item": args.files,
        "catalog_nbytes": catalog.nbytes,
        "manifest_bytes": size,
        "build_s": round(build_s, 3),
        "phases": {
            "digest": {"seconds": round(digest_s, 3), "peak_traced_bytes": digest_peak},
            "write": {"seconds": round(write_s, 3), "peak_traced_bytes": write_peak},
            "read": {"seconds": round(read_s, 3), "peak_traced_bytes": read_peak},
            "plan": {"seconds": round(plan_s, 3), "peak_traced_bytes": plan_peak, "share": share},
            "group": {"seconds": round(group_s, 3), "peak_traced_bytes": group_peak, "items": grouped},
            "list-files": {"seconds": round(list_files_s, 3), "peak_traced_bytes": list_files_peak, "items": listed_files},
            "list-folders": {
                "seconds": round(list_folders_s, 3),
                "peak_traced_bytes": list_folders_peak,
                "items": listed_folders,
            },
        },
        "peak_rss_bytes": peak_rss,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mib = 1024**2
    print(
        f"{args.items:,} items x {args.files} files: catalog {catalog.nbytes / mib:.1f} MiB in memory, "
        f"manifest {size / mib:.1f} MiB"
    )
    print(f"{'phase':12} {'seconds':>8} {'peak MiB (tracemalloc)':>24}")
    for name, row in report["phases"].items():
        print(f"{name:12} {row['seconds']:8.2f} {row['peak_traced_bytes'] / mib:24.1f}")
    print(f"process peak RSS {peak_rss / mib:.0f} MiB (includes building the synthetic catalog: {build_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
