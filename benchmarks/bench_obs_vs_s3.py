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
import json
import logging
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

MIB = 1024**2
KIB = 1024
BUCKET = "bench"
BACKENDS = ("s3", "obs")
READ_CHUNK = 1 * MIB
CREDENTIALS = "bench"  # the local server accepts any key pair

_SERVER_CODE = """
import logging, sys
logging.getLogger("werkzeug").setLevel(logging.ERROR)
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
host, port = server.get_host_and_port()
print(f"http://{host}:{port}", flush=True)
sys.stdin.read()  # serve until the parent closes our stdin (or exits)
server.stop()
"""


# ---- datasets ------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A generated dataset: ``folders`` folders, each with the files ``{name: bytes}``."""

    name: str
    folders: int
    files: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return self.folders * sum(self.files.values())

    def describe(self) -> str:
        each = "/".join(_human(s) for s in sorted(set(self.files.values()), reverse=True))
        return f"{self.folders} folders x {len(self.files)} files ({each}), {self.total_bytes / 1e6:.1f} MB"


def _human(n: int) -> str:
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def build_cases(args: argparse.Namespace) -> list[Case]:
    video = Case("video", args.folders, {"video.mp4": int(args.video_mib * MIB), "text.txt": 1 * KIB})
    small = Case("small-files", args.small_folders, {f"part{i:02d}.bin": args.small_kib * KIB for i in range(args.small_files)})
    return [video, small]


WARMUP = Case("warmup", 1, {"f": 1 * KIB})
"""Uploaded too and read once per backend before timing: imports, the fsspec IO thread, first connections."""


def upload(endpoint: str, cases: list[Case]) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      aws_access_key_id=CREDENTIALS, aws_secret_access_key=CREDENTIALS)
    s3.create_bucket(Bucket=BUCKET)
    jobs = []
    for case in cases:
        rng = random.Random(case.name)
        for i in range(case.folders):
            for rel, size in case.files.items():
                jobs.append((f"{case.name}/folder{i:03d}/{rel}", rng.randbytes(size)))
    with ThreadPoolExecutor(8) as pool:
        for _ in pool.map(lambda job: s3.put_object(Bucket=BUCKET, Key=job[0], Body=job[1]), jobs):
            pass


# ---- the server ----------------------------------------------------------------------
class Server:
    """A moto S3 server on 127.0.0.1: in a child process (default) or in a thread of this one."""

    def __init__(self, mode: str) -> None:
        self._proc: subprocess.Popen[str] | None = None
        self._server: Any = None
        if mode == "subprocess":
            self._proc = subprocess.Popen([sys.executable, "-c", _SERVER_CODE], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True)
            assert self._proc.stdout is not None
            self.endpoint = self._proc.stdout.readline().strip()
            if not self.endpoint.startswith("http://"):
                self.stop()
                raise RuntimeError("the moto server process did not start (see its stderr above)")
        else:
            from moto.server import ThreadedMotoServer

            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            self._server.start()
            host, port = self._server.get_host_and_port()
            self.endpoint = f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._proc is not None:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.terminate()
                self._proc.wait(5)
            self._proc.stdout.close()
            self._proc = None


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
    buf = bytearray(READ_CHUNK)
    read = items = 0
    first = None
    cpu0, t0 = time.process_time(), time.perf_counter()
    with Pipeline(f"{backend}://{BUCKET}/{case.name}/", cache, args.capacity, storage_options=storage_options(backend, endpoint),
                  max_concurrency=args.max_concurrency, part_size=args.part_size) as pipe:
        for path in pipe:
            if first is None:
                first = time.perf_counter() - t0
            for rel in path.files:
                with open(path / rel, "rb", buffering=0) as fh:
                    while n := fh.readinto(buf):
                        read += n
            items += 1
        stats = pipe.stats()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    if read != case.total_bytes or items != case.folders:
        raise RuntimeError(f"{backend} {case.name}: read {read} bytes in {items} folders, "
                           f"expected {case.total_bytes} bytes in {case.folders}")
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
    rows = [[r["case"], r["backend"], f"{r['median_wall_s']:.2f}", f"{r['mb_per_s']:.1f}",
             "-" if r["obs_to_s3"] is None else f"{r['obs_to_s3']:.2f}", f"{r['median_first_item_s']:.3f}",
             f"{r['median_cpu_s']:.2f}", f"{r['median_requests']:.0f}", str(r["retries"])] for r in report["results"]]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    s = report["settings"]
    cpu = "client process only (server in a child process)" if s["server"] == "subprocess" else "this process, server threads included"
    return "\n".join([
        line(cols), "  ".join("-" * w for w in widths), *(line(row) for row in rows), "",
        f"command: {report['command']}",
        f"date: {report['date']}; machine: {report['machine']['cpus']} cores, {report['machine']['platform']}, "
        f"Python {report['machine']['python']}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
        *(f"case {name}: {desc}" for name, desc in report["cases"].items()),
        f"median of {s['repeats']} interleaved runs per backend; MB = 10^6 bytes read by a consumer that reads every "
        "byte; obs/s3 = obs MB/s / s3 MB/s (>1: obs faster); 1st item s: start (listing included) to the first "
        f"folder in hand; CPU s: {cpu}; GETs: ranged GETs per run; retries: transient errors retried, all runs",
        f"cachepipe capacity={s['capacity']}, max_concurrency={s['max_concurrency']}, part_size={s['part_size']}; "
        f"one moto server at 127.0.0.1 ({s['server']})",
    ])


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


# ---- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--folders", type=int, help="folders in the video case (default 16; --quick 3)")
    p.add_argument("--video-mib", type=float, help="MiB of video.mp4 per folder (default 8; --quick 1)")
    p.add_argument("--small-folders", type=int, help="folders in the small-files case (default 40; --quick 3)")
    p.add_argument("--small-files", type=int, help="files per folder in the small-files case (default 20; --quick 4)")
    p.add_argument("--small-kib", type=int, help="KiB per small file (default 50; --quick 8)")
    p.add_argument("--repeats", type=int, help="interleaved runs per backend and case, median reported (default 3; --quick 1)")
    p.add_argument("--capacity", default="64MiB", help="cache capacity (default 64MiB)")
    p.add_argument("--max-concurrency", type=int, default=16, help="cachepipe max_concurrency (default 16)")
    p.add_argument("--part-size", default="8MiB", help="cachepipe part_size (default 8MiB)")
    p.add_argument("--server", choices=("subprocess", "inprocess"), default="subprocess",
                   help="run the moto server in a child process (default) or in a thread of this process")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of the table")
    p.add_argument("--quick", action="store_true", help="a tiny dataset and one repeat, for the smoke test")
    args = p.parse_args(argv)
    for name, full, quick in (("folders", 16, 3), ("video_mib", 8.0, 1.0), ("small_folders", 40, 3),
                              ("small_files", 20, 4), ("small_kib", 50, 8), ("repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("folders", "small_folders", "small_files", "small_kib", "repeats", "max_concurrency"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    if args.video_mib <= 0:
        p.error(f"--video-mib {args.video_mib}: expected a positive number")
    from cachepipe import parse_size

    try:
        capacity = parse_size(args.capacity, "--capacity")
        parse_size(args.part_size, "--part-size")
    except ValueError as exc:
        p.error(str(exc))
    biggest = max(sum(c.files.values()) for c in build_cases(args))
    if biggest > capacity:
        p.error(f"--capacity {args.capacity}: smaller than one folder ({biggest} bytes)")
    return args


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for name in ("OBS_ACCESS_KEY_ID", "OBS_SECRET_ACCESS_KEY", "OBS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)  # only the dummy key pair in storage_options reaches the local server
    import cachepipe

    cases = build_cases(args)
    report: dict[str, Any] = {
        "command": shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv])),
        "date": date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(terse=True), "python": platform.python_version()},
        "versions": {"cachepipe": cachepipe.__version__, "s3fs": _version("s3fs"),
                     "esdk-obs-python": _version("esdk-obs-python"), "moto": _version("moto")},
        "settings": {"repeats": args.repeats, "capacity": args.capacity, "max_concurrency": args.max_concurrency,
                     "part_size": args.part_size, "server": args.server},
        "cases": {c.name: c.describe() for c in cases},
        "results": [],
    }
    runs: dict[tuple[str, str], list[Run]] = {(c.name, b): [] for c in cases for b in BACKENDS}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachepipe-bench-obs-") as tmp:
        server = Server(args.server)
        try:
            progress(f"moto server at {server.endpoint}; uploading {'; '.join(c.describe() for c in cases)}")
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
                        progress(f"repeat {rep + 1}/{args.repeats} {case.name:11} {backend:3} {run.wall_s:6.2f} s, "
                                 f"{case.total_bytes / run.wall_s / 1e6:7.1f} MB/s, cpu {run.cpu_s:.2f} s")
        finally:
            server.stop()
    for case in cases:
        rows = {b: summarise(case, b, runs[(case.name, b)]) for b in BACKENDS}
        rows["obs"]["obs_to_s3"] = rows["obs"]["mb_per_s"] / rows["s3"]["mb_per_s"]
        report["results"].extend(rows.values())
    report["total_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render_table(report))
        print(f"total run time {report['total_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
