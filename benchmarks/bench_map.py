"""Benchmark: ``cachepipe map`` on a generated dataset against a local S3 (moto) server.

One run starts a moto S3 server on 127.0.0.1 (in a child process by default), uploads
``--folders`` folders of one ``--size`` file each, and runs, for each ``--jobs`` value, the
command line ``python -m cachepipe.map SRC DST --cache ... --capacity ... --jobs N
--out-ratio 1 -- python split.py`` as a child process, where ``split.py`` reads its input and
writes it back as four "clips" (outputs as large as the input). While it runs, a thread of this
process samples the bytes under the cache directory every 5 ms. Reported per run: wall time,
MB/s downloaded and uploaded (input and output bytes over the wall time, markers excluded),
items/s, the peak bytes sampled against the capacity, and the split of the capacity between
downloads and the per-job output slots. Every output is checked to be in the bucket afterwards.

Usage::

    .venv/bin/python benchmarks/bench_map.py                  # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_map.py --quick --json
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

from common import (
    BUCKET,
    CREDENTIALS,
    MIB,
    Case,
    PeakSampler,
    Server,
    command_line,
    format_table,
    machine_info,
    print_report,
    progress,
    provenance_lines,
    upload,
)

SPLIT = r"""
import os
data = open("in.bin", "rb").read()
out = os.environ["CACHEPIPE_OUT"]
quarter = len(data) // 4 + 1
for n in range(4):
    with open(os.path.join(out, f"clip{n}.bin"), "wb") as fh:
        fh.write(data[n * quarter:(n + 1) * quarter])
"""


def run_map(endpoint: str, case: Case, jobs: int, capacity: int, margin: int, work: Path) -> dict[str, Any]:
    """One ``cachepipe map`` run as a child process, sampled; returns its measurements."""
    cache = work / f"cache-{jobs}"
    dst = f"s3://{BUCKET}/{case.name}-out-{jobs}/"
    script = work / "split.py"
    script.write_text(SPLIT)
    command = [
        sys.executable,
        "-m",
        "cachepipe.map",
        f"s3://{case.prefix}/",
        dst,
        "--cache",
        str(cache),
        "--capacity",
        str(capacity),
        "--jobs",
        str(jobs),
        "--out-ratio",
        "1",
        "--out-margin",
        str(margin),
        "--no-progress",
        "-o",
        f"endpoint_url={endpoint}",
        "-o",
        f"key={CREDENTIALS}",
        "-o",
        f"secret={CREDENTIALS}",
        "--",
        sys.executable,
        str(script),
    ]
    with PeakSampler(cache) as sampler:
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
        wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"cachepipe map failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    summary = proc.stderr.strip().splitlines()[-1]
    match = re.search(r"(\d+) done, (\d+) failed.*\((\d+) files\).*peak job (\d+) of (\d+) bytes", summary)
    if not match or int(match.group(1)) != case.folders or int(match.group(2)) != 0:
        raise RuntimeError(f"unexpected summary: {summary}")
    check_outputs(endpoint, case, dst)
    out_bytes = case.total_bytes  # four clips that add up to each input
    return {
        "jobs": jobs,
        "wall_s": round(wall, 3),
        "items": case.folders,
        "bytes_in": case.total_bytes,
        "bytes_out": out_bytes,
        "mb_in_per_s": round(case.total_bytes / 1e6 / wall, 2),
        "mb_out_per_s": round(out_bytes / 1e6 / wall, 2),
        "items_per_s": round(case.folders / wall, 2),
        "capacity": capacity,
        "peak_cache_bytes": sampler.peak,
        "peak_fraction": round(sampler.peak / capacity, 3),
        "samples": sampler.samples,
        "reserve": int(match.group(5)),
        "margin": margin,
        "download_capacity": capacity - jobs * (int(match.group(5)) + margin),
        "peak_job_bytes": int(match.group(4)),
    }


def check_outputs(endpoint: str, case: Case, dst: str) -> None:
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=CREDENTIALS, aws_secret_access_key=CREDENTIALS
    )
    prefix = dst.removeprefix(f"s3://{BUCKET}/")
    keys = [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    if len(keys) != case.folders * 5:  # four clips and a marker per item
        raise RuntimeError(f"{dst}: expected {case.folders * 5} objects, found {len(keys)}")


def render(report: dict[str, Any]) -> str:
    cols = (
        "jobs",
        "items",
        "wall s",
        "MB/s in",
        "MB/s out",
        "items/s",
        "peak MiB",
        "capacity MiB",
        "peak/cap",
        "downloads MiB",
        "slot MiB",
    )
    rows = [
        (
            str(r["jobs"]),
            str(r["items"]),
            f"{r['wall_s']:.2f}",
            f"{r['mb_in_per_s']:.1f}",
            f"{r['mb_out_per_s']:.1f}",
            f"{r['items_per_s']:.1f}",
            f"{r['peak_cache_bytes'] / MIB:.1f}",
            f"{r['capacity'] / MIB:.1f}",
            f"{r['peak_fraction']:.0%}",
            f"{r['download_capacity'] / MIB:.1f}",
            f"{(r['reserve'] + r['margin']) / MIB:.1f}",
        )
        for r in report["results"]
    ]
    head = [f"cachepipe map: {report['case']}; moto S3 server ({report['server']}); outputs = inputs (ratio 1)", ""]
    notes = [
        "",
        "peak: bytes under the cache dir sampled every 5 ms (never above capacity: the hard cap);",
        "downloads: the capacity less jobs x slot (reserve + margin) set aside for outputs",
        *provenance_lines(report),
    ]
    return "\n".join(head + format_table(cols, rows, left=1) + notes)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folders", type=int, default=None, help="items (default 24; --quick 8)")
    p.add_argument("--size", type=float, default=None, help="MiB per item (default 4; --quick 1)")
    p.add_argument("--capacity", type=float, default=None, help="cache capacity in MiB (default 40; --quick 10)")
    p.add_argument("--margin", type=float, default=None, help="--out-margin in MiB (default 1; --quick 0.25)")
    p.add_argument("--jobs", default="1,2,4", help="comma-separated --jobs values (default 1,2,4)")
    p.add_argument("--quick", action="store_true", help="a small dataset (for a smoke run)")
    p.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess", help="where the moto server runs")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args()
    folders = args.folders or (8 if args.quick else 24)
    size = int((args.size or (1 if args.quick else 4)) * MIB)
    capacity = int((args.capacity or (10 if args.quick else 40)) * MIB)
    margin = int((args.margin or (0.25 if args.quick else 1)) * MIB)
    jobs = [int(j) for j in args.jobs.split(",")]
    case = Case("map", folders, {"in.bin": size})

    import moto
    import s3fs

    started = time.perf_counter()
    server = Server(args.server)
    try:
        progress(f"moto S3 server ({args.server}) at {server.endpoint}; uploading {case.describe()}")
        upload(server.endpoint, [case])
        results = []
        with tempfile.TemporaryDirectory(prefix="bench-map-") as tmp:
            for n in jobs:
                progress(f"cachepipe map --jobs {n} ...")
                results.append(run_map(server.endpoint, case, n, capacity, margin, Path(tmp)))
    finally:
        server.stop()
    report = {
        "case": case.describe(),
        "server": args.server,
        "results": results,
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {"s3fs": s3fs.__version__, "moto": moto.__version__},
        "total_seconds": round(time.perf_counter() - started, 1),
    }
    print_report(report, render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
