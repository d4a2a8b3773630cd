"""Benchmark: cachepipe reading the same data through ``s3://`` (s3fs) and ``obs://`` (the OBS SDK).

One run starts one moto S3 server (``ThreadedMotoServer`` on 127.0.0.1, a free port), uploads two
generated datasets once, and measures :class:`cachepipe.Pipeline` delivering every folder to a
consumer that reads every byte, through each backend:

- ``s3``: ``Pipeline("s3://bench/<case>/", storage_options={"endpoint_url": ...})``: s3fs
  (aiobotocore), one fresh filesystem instance per run (``skip_instance_cache=True``);
- ``obs``: ``Pipeline("obs://bench/<case>/", storage_options={"server": ...})``: the Huawei OBS
  SDK (``esdk-obs-python``), a fresh ``ObsClient`` per run.

Both backends get the same Pipeline settings (capacity, max_concurrency, part_size) and talk to
the same server, so the difference is the client stack alone. Each case and backend is run
``--repeats`` times, the backends interleaved (the order alternates every repeat); the table
shows the median wall time (listing included; each backend first reads a 1 KiB warm-up folder,
untimed, so that imports and first connections are not counted), MB/s (10^6 bytes delivered) and, on the obs row,
obs throughput divided by s3 throughput (>1: obs is faster).

Known artefact of the local server: the OBS SDK signs with the V2 scheme (``AWS key:signature``),
and moto mistakes a V2 signature containing exactly four ``/`` for a V4 credential scope, answering
HTTP 500 (about 1 request in 1,400). cachepipe retries those like any 5xx, with backoff; the
``retries`` column counts them, and they cost the obs runs a little time that real OBS would not.

By default the server runs in a child process, so that the client's CPU time and GIL are its own,
as with a real remote store; ``--server inprocess`` runs it in a thread of this process.

Usage::

    .venv/bin/python benchmarks/bench_obs_vs_s3.py              # ~1 min on 2 cores
    .venv/bin/python benchmarks/bench_obs_vs_s3.py --repeats 5
    .venv/bin/python benchmarks/bench_obs_vs_s3.py --quick --json
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

from common import (
    BUCKET,
    CREDENTIALS,
    KIB,
    Case,
    Server,
    add_cachepipe_options,
    add_dataset_options,
    add_server_option,
    apply_defaults,
    build_cases,
    check_positive,
    command_line,
    dist_version,
    format_table,
    machine_info,
    parse_capacity,
    print_report,
    progress,
    provenance_lines,
    read_folder,
    upload,
)

BACKENDS = ("s3", "obs")
DEFAULTS = {"folders": (16, 3), "video_mib": (8.0, 1.0), "small_folders": (40, 3), "small_files": (20, 4), "small_kib": (50, 8)}
"""The dataset options: (default, with --quick)."""

WARMUP = Case("warmup", 1, {"f": 1 * KIB})
"""Uploaded too and read once per backend before timing: imports, the fsspec IO thread, first connections."""


# ---- one measurement -----------------------------------------------------------------
@dataclass
class Run:
    wall_s: float
    first_item_s: float
    cpu_s: float
    bytes_read: int
    items: int
    requests: int
    retries: int


def storage_options(backend: str, endpoint: str) -> dict[str, Any]:
    if backend == "s3":
        return {"endpoint_url": endpoint, "key": CREDENTIALS, "secret": CREDENTIALS, "skip_instance_cache": True}
    return {"server": endpoint, "access_key_id": CREDENTIALS, "secret_access_key": CREDENTIALS}


def measure(backend: str, case: Case, endpoint: str, tmp: Path, args: argparse.Namespace) -> Run:
    """Deliver every folder of ``case`` through cachepipe on ``backend``; read every byte."""
    from cachepipe import Pipeline

    cache = tmp / f"cache-{backend}-{case.name}"
    read = items = 0
    first = None
    cpu0, t0 = time.process_time(), time.perf_counter()
    with Pipeline(
        f"{backend}://{BUCKET}/{case.name}/",
        cache,
        args.capacity,
        storage_options=storage_options(backend, endpoint),
        max_concurrency=args.max_concurrency,
        max_large_requests=args.max_large_requests,
        part_size=args.part_size,
    ) as pipe:
        for path in pipe:
            if first is None:
                first = time.perf_counter() - t0
            read += read_folder(path, path.files)
            items += 1
        stats = pipe.stats()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if read != case.total_bytes or items != case.folders:
        raise RuntimeError(
            f"{backend} {case.name}: read {read} bytes in {items} folders, expected {case.total_bytes} bytes in {case.folders}"
        )
    return Run(wall, first or 0.0, cpu, read, items, stats.requests, stats.retries)


# ---- report --------------------------------------------------------------------------
def summarise(case: Case, backend: str, runs: list[Run]) -> dict[str, Any]:
    wall = statistics.median(r.wall_s for r in runs)
    return {
        "case": case.name,
        "backend": backend,
        "runs": [asdict(r) for r in runs],
        "median_wall_s": wall,
        "mb_per_s": case.total_bytes / wall / 1e6,
        "obs_to_s3": None,
        "median_first_item_s": statistics.median(r.first_item_s for r in runs),
        "median_cpu_s": statistics.median(r.cpu_s for r in runs),
        "median_requests": statistics.median(r.requests for r in runs),
        "retries": sum(r.retries for r in runs),
    }


def render_table(report: dict[str, Any]) -> str:
    cols = ["case", "backend", "median s", "MB/s", "obs/s3", "1st item s", "CPU s", "GETs", "retries"]
    rows = [
        [
            r["case"],
            r["backend"],
            f"{r['median_wall_s']:.2f}",
            f"{r['mb_per_s']:.1f}",
            "-" if r["obs_to_s3"] is None else f"{r['obs_to_s3']:.2f}",
            f"{r['median_first_item_s']:.3f}",
            f"{r['median_cpu_s']:.2f}",
            f"{r['median_requests']:.0f}",
            str(r["retries"]),
        ]
        for r in report["results"]
    ]
    s = report["settings"]
    cpu = (
        "client process only (server in a child process)"
        if s["server"] == "subprocess"
        else "this process, server threads included"
    )
    return "\n".join(
        [
            *format_table(cols, rows),
            "",
            *provenance_lines(report),
            *(f"case {name}: {desc}" for name, desc in report["cases"].items()),
            (
                f"median of {s['repeats']} interleaved runs per backend; MB = 10^6 bytes read by a consumer that reads every "
                "byte; obs/s3 = obs MB/s / s3 MB/s (>1: obs faster); 1st item s: start (listing included) to the first "
                f"folder in hand; CPU s: {cpu}; GETs: ranged GETs per run; retries: transient errors retried, all runs"
            ),
            (
                f"cachepipe capacity={s['capacity']}, max_concurrency={s['max_concurrency']}, "
                f"part_size={s['part_size'] or 'default'}; one moto server at 127.0.0.1 ({s['server']})"
            ),
        ]
    )


# ---- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_options(p, DEFAULTS)
    p.add_argument("--repeats", type=int, help="interleaved runs per backend and case, median reported (default 3; --quick 1)")
    p.add_argument("--capacity", default="64MiB", help="cache capacity (default 64MiB)")
    add_cachepipe_options(p)
    add_server_option(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of the table")
    p.add_argument("--quick", action="store_true", help="a tiny dataset and one repeat, for the smoke test")
    args = p.parse_args(argv)
    apply_defaults(args, {**DEFAULTS, "repeats": (3, 1)})
    check_positive(p, args, ("folders", "small_folders", "small_files", "small_kib", "repeats", "max_concurrency"))
    if args.video_mib <= 0:
        p.error(f"--video-mib {args.video_mib}: expected a positive number")
    capacity = parse_capacity(p, args)
    biggest = max(c.folder_bytes for c in build_cases(args))
    if biggest > capacity:
        p.error(f"--capacity {args.capacity}: smaller than one folder ({biggest} bytes)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for name in ("OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY", "OBS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)  # only the dummy key pair in storage_options reaches the local server
    import cachepipe

    cases = build_cases(args)
    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {
            "cachepipe": cachepipe.__version__,
            "s3fs": dist_version("s3fs"),
            "esdk-obs-python": dist_version("esdk-obs-python"),
            "moto": dist_version("moto"),
        },
        "settings": {
            "repeats": args.repeats,
            "capacity": args.capacity,
            "max_concurrency": args.max_concurrency,
            "max_large_requests": args.max_large_requests,
            "part_size": args.part_size,
            "server": args.server,
        },
        "cases": {c.name: c.describe(largest_first=True) for c in cases},
        "results": [],
    }
    runs: dict[tuple[str, str], list[Run]] = {(c.name, b): [] for c in cases for b in BACKENDS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachepipe-bench-obs-") as tmp:
        server = Server(args.server)
        try:
            progress(f"moto server at {server.endpoint}; uploading {'; '.join(c.describe(largest_first=True) for c in cases)}")
            upload(server.endpoint, [*cases, WARMUP])
            progress(f"uploaded in {time.perf_counter() - started:.1f} s")
            for backend in BACKENDS:
                measure(backend, WARMUP, server.endpoint, Path(tmp), args)
            for rep in range(args.repeats):
                order = BACKENDS if rep % 2 == 0 else BACKENDS[::-1]
                for case in cases:
                    for backend in order:
                        run = measure(backend, case, server.endpoint, Path(tmp), args)
                        runs[(case.name, backend)].append(run)
                        progress(
                            f"repeat {rep + 1}/{args.repeats} {case.name:11} {backend:3} {run.wall_s:6.2f} s, "
                            f"{case.total_bytes / run.wall_s / 1e6:7.1f} MB/s, cpu {run.cpu_s:.2f} s"
                        )
        finally:
            server.stop()
    for case in cases:
        rows = {b: summarise(case, b, runs[(case.name, b)]) for b in BACKENDS}
        rows["obs"]["obs_to_s3"] = rows["obs"]["mb_per_s"] / rows["s3"]["mb_per_s"]
        report["results"].extend(rows.values())
    report["total_seconds"] = time.perf_counter() - started
    print_report(report, render_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
