"""Benchmark: cachepipe against a plain sequential copy and the original design, on a local S3.

One run starts a moto S3 server on 127.0.0.1 (a free port), uploads two generated datasets and
measures three ways of delivering every folder to a consumer that reads every byte:

- ``cachepipe``: :class:`cachepipe.Pipeline` (one recursive listing, then concurrent ranged GETs
  into a size-capped cache, items handed out in listing order);
- ``sequential``: one recursive listing, then for each folder in order, s3fs ``get_file`` of each
  of its files into a local folder, read, delete: one folder at a time, no size calls;
- ``original``: the ModelArts producer/consumer this project replaces, ported call for call from
  ``mox.file`` to s3fs: list the folders, one size (HEAD) call per file before anything is
  copied, then a producer thread copies one folder at a time (``get`` of the folder, files in
  parallel) into the cache while the consumer reads, sleep-polling every 0.1 s when full.

Each case is measured ``--repeats`` times with the methods interleaved (the order rotates every
repeat) and the median is reported. Every measurement uses a fresh s3fs instance
(``skip_instance_cache=True``, listings cache invalidated), so no run reuses another's
connections or listings. The peak bytes in cachepipe's cache dir come from one extra, untimed
run per case with a thread sampling the directory every 5 ms (walking ~1,000 small files
every 5 ms would otherwise take the GIL from the run being timed).

By default the server runs in a child process, so that the client's CPU seconds and GIL are its
own, as with a real remote store; ``--server inprocess`` runs it in a thread of this process.

Usage::

    .venv/bin/python benchmarks/bench_pipeline.py              # ~1-2 min on 2 cores
    .venv/bin/python benchmarks/bench_pipeline.py --repeats 5
    .venv/bin/python benchmarks/bench_pipeline.py --quick --repeats 1 --json
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from common import (
    MIB,
    Case,
    PeakSampler,
    Server,
    add_cachepipe_options,
    add_dataset_options,
    add_server_option,
    apply_defaults,
    build_cases,
    check_positive,
    command_line,
    format_table,
    machine_info,
    parse_capacity,
    print_report,
    progress,
    provenance_lines,
    read_folder,
    upload,
)

METHODS = ("cachepipe", "sequential", "original")
DEFAULTS = {"folders": (24, 4), "video_mib": (8.0, 1.0), "small_folders": (40, 4), "small_files": (20, 5), "small_kib": (50, 8)}
"""The dataset options: (default, with --quick)."""
ORIGINAL_POLL = 0.1  # the original producer's sleep when the cache is full (its default)


class BenchTimeout(TimeoutError):
    """The whole run exceeded ``--time-limit``."""


# ---- request counting ----------------------------------------------------------------
class RequestCounter(logging.Handler):
    """Counts S3 API calls made through s3fs (it logs ``CALL: <method> ...`` for each) and by
    cachepipe's direct S3 path (``direct <method>: ...``)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.calls: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg in ("CALL: %s - %s - %s", "direct %s: %s") and record.args:
            method = str(record.args[0])
            self.calls[method] = self.calls.get(method, 0) + 1

    def take(self) -> dict[str, int]:
        with self.lock:
            calls, self.calls = self.calls, {}
        return calls


# ---- the three methods ---------------------------------------------------------------
@dataclass
class Run:
    """One measurement: wall and CPU seconds, what was delivered, and how many requests it took."""

    wall_s: float = 0.0
    first_item_s: float | None = None
    cpu_s: float = 0.0
    cpu_user_s: float = 0.0
    cpu_sys_s: float = 0.0
    minor_faults: int = 0
    server_cpu_s: float | None = None
    items: int = 0
    bytes: int = 0
    requests: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    consumer_wait_s: float | None = None


def fresh_fs(endpoint: str) -> Any:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint, skip_instance_cache=True)
    fs.invalidate_cache()
    return fs


def run_cachepipe(endpoint: str, case: Case, work: Path, capacity: int, args: argparse.Namespace, run: Run, t0: float) -> None:
    from cachepipe import Pipeline

    options = {"endpoint_url": endpoint, "skip_instance_cache": True}
    with Pipeline(
        f"s3://{case.prefix}/",
        cache_dir=work / "cache",
        capacity=capacity,
        storage_options=options,
        max_concurrency=args.max_concurrency,
        max_large_requests=args.max_large_requests,
        part_size=args.part_size,
    ) as pipe:
        for item in pipe:
            if run.first_item_s is None:
                run.first_item_s = time.perf_counter() - t0
            run.bytes += read_folder(item.path, item.files)
            run.items += 1
        run.consumer_wait_s = pipe.stats().consumer_wait_seconds


def run_sequential(endpoint: str, case: Case, work: Path, capacity: int, args: argparse.Namespace, run: Run, t0: float) -> None:
    fs = fresh_fs(endpoint)
    folders: dict[str, list[str]] = {}
    for path in fs.find(case.prefix):  # one recursive listing, in key order
        folder, _, rel = path[len(case.prefix) + 1 :].partition("/")
        folders.setdefault(folder, []).append(rel)
    for folder, rels in folders.items():
        local = work / folder
        for rel in rels:
            (local / rel).parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(f"{case.prefix}/{folder}/{rel}", str(local / rel))
        if run.first_item_s is None:
            run.first_item_s = time.perf_counter() - t0
        run.bytes += read_folder(local, rels)
        run.items += 1
        shutil.rmtree(local)


class OriginalPipeline:
    """The original design (seed ``Pipeline``/``ObsClient``/``EvsClient``), ported from ``mox.file``
    to s3fs one call for one call: ``list_directory`` -> ``ls``/``find``, ``is_directory`` ->
    ``isdir``, ``get_size`` -> ``info(refresh=True)`` (a HEAD, as mox makes), ``copy_parallel``
    -> ``get(recursive=True)`` (the folder's files in parallel).

    Two deviations, neither changes its timing: the producer sleeps on a stop event instead of
    ``time.sleep`` (so that an aborted run ends), and the size counter it shares with the
    consumer is updated under a lock (the seed's unlocked ``+=``/``-=`` can lose an update).
    """

    def __init__(
        self, fs: Any, root: str, evs_root: Path, memory: int, timeout: float = 300, interval: float = ORIGINAL_POLL
    ) -> None:
        self.fs, self.root, self.evs_root = fs, root, evs_root
        self.memory, self.timeout, self.interval = memory, timeout, interval
        self.queue: queue.Queue[tuple[Path | None, int | None]] = queue.Queue()
        self.directory = self._list_directory()  # ObsClient: every folder and its size, up front
        self.size = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        max_size = max(size for *_, size in self.directory)
        if memory < max_size:
            raise ValueError(f"memory {memory} should be bigger than the largest folder ({max_size})")

    # ObsClient
    def _list_directory(self) -> list[tuple[str, str, int]]:
        directory = []
        for folder_path in self.fs.ls(self.root, detail=False):
            if self.fs.isdir(folder_path):
                directory.append((folder_path.rsplit("/", 1)[-1], folder_path, self._get_size(folder_path)))  # noqa: PERF401 - the loop is what is measured or tested: items taken one at a time
        return directory

    def _get_size(self, path: str) -> int:
        if self.fs.isdir(path):
            return sum(self._get_size_file(f) for f in self.fs.find(path) if not self.fs.isdir(f))
        return self._get_size_file(path)

    def _get_size_file(self, path: str) -> int:
        return int(self.fs.info(path, refresh=True)["size"])

    # EvsClient
    def _work(self) -> None:
        for rel, absolute, size in self.directory:
            while True:
                if self._stop.is_set():
                    return
                with self._lock:
                    full = self.size + size > self.memory
                if not full:
                    self._copy(rel, absolute, size)
                    break
                self._stop.wait(self.interval)
        self.queue.put((None, None))

    def _copy(self, rel: str, absolute: str, size: int) -> None:
        evs_folder = self.evs_root / rel
        self.fs.get(absolute + "/", str(evs_folder) + "/", recursive=True)
        self.queue.put((evs_folder, size))
        with self._lock:
            self.size += size

    def _remove(self, folder: Path, size: int) -> None:
        shutil.rmtree(folder, True)
        with self._lock:
            self.size -= size

    def __iter__(self) -> Iterator[tuple[Path, int]]:
        producer = threading.Thread(target=self._work, name="bench-original-producer")
        producer.start()
        try:
            while True:
                path, size = self.queue.get(timeout=self.timeout)
                if path is None or size is None:
                    break
                yield path, size
                self._remove(path, size)
        finally:
            self._stop.set()
            producer.join()


def run_original(endpoint: str, case: Case, work: Path, capacity: int, args: argparse.Namespace, run: Run, t0: float) -> None:
    fs = fresh_fs(endpoint)
    evs = work / "evs"
    evs.mkdir()
    for folder, _size in OriginalPipeline(fs, case.prefix, evs, capacity):
        if run.first_item_s is None:
            run.first_item_s = time.perf_counter() - t0
        run.bytes += read_folder(folder, tuple(case.files))
        run.items += 1


RUNNERS: dict[str, Callable[..., None]] = {"cachepipe": run_cachepipe, "sequential": run_sequential, "original": run_original}


def measure(
    method: str, server: Server, counter: RequestCounter, case: Case, tmp: Path, capacity: int, args: argparse.Namespace
) -> Run:
    """Run ``method`` once on ``case`` and check that it delivered the whole dataset."""
    work = Path(tempfile.mkdtemp(prefix=f"{method}-", dir=tmp))
    run = Run()
    counter.take()
    server_cpu = server.cpu_seconds()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    try:
        RUNNERS[method](server.endpoint, case, work, capacity, args, run, t0)
        run.wall_s = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        run.cpu_user_s = after.ru_utime - usage.ru_utime
        run.cpu_sys_s = after.ru_stime - usage.ru_stime
        run.cpu_s = run.cpu_user_s + run.cpu_sys_s
        run.minor_faults = after.ru_minflt - usage.ru_minflt
        if server_cpu is not None:
            run.server_cpu_s = server.cpu_seconds() - server_cpu  # type: ignore[operator]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    run.calls = counter.take()
    run.requests = sum(run.calls.values())
    if (run.items, run.bytes) != (case.folders, case.total_bytes):
        raise RuntimeError(
            f"{method} on {case.name}: delivered {run.items} folders / {run.bytes} bytes, "
            f"expected {case.folders} / {case.total_bytes}"
        )
    return run


def measure_peak(server: Server, case: Case, tmp: Path, capacity: int, args: argparse.Namespace) -> tuple[int, int]:
    """One untimed cachepipe run with the sampler on its cache dir: (peak bytes, samples)."""
    from cachepipe import Pipeline

    work = Path(tempfile.mkdtemp(prefix="peak-", dir=tmp))
    try:
        options = {"endpoint_url": server.endpoint, "skip_instance_cache": True}
        with PeakSampler(work / "cache") as sampler:
            with Pipeline(
                f"s3://{case.prefix}/",
                cache_dir=work / "cache",
                capacity=capacity,
                storage_options=options,
                max_concurrency=args.max_concurrency,
                max_large_requests=args.max_large_requests,
                part_size=args.part_size,
            ) as pipe:
                for item in pipe:
                    read_folder(item.path, item.files)
        return sampler.peak, sampler.samples
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- reporting -----------------------------------------------------------------------
def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise(case: Case, method: str, runs: list[Run], capacity: int) -> dict[str, Any]:
    wall = statistics.median(r.wall_s for r in runs)
    return {
        "case": case.name,
        "method": method,
        "runs": [asdict(r) for r in runs],
        "median_wall_s": wall,
        "mb_per_s": case.total_bytes / wall / 1e6,
        "ratio_to_sequential": None,
        "median_first_item_s": _median([r.first_item_s for r in runs]),
        "median_cpu_s": _median([r.cpu_s for r in runs]),
        "median_cpu_user_s": _median([r.cpu_user_s for r in runs]),
        "median_cpu_sys_s": _median([r.cpu_sys_s for r in runs]),
        "median_minor_faults": _median([r.minor_faults for r in runs]),
        "median_server_cpu_s": _median([r.server_cpu_s for r in runs]),
        "median_requests": _median([r.requests for r in runs]),
        "median_consumer_wait_s": _median([r.consumer_wait_s for r in runs]),
        "peak_cache_bytes": None,
        "capacity_bytes": capacity,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(report: dict[str, Any]) -> str:
    cols = ["case", "method", "median s", "MB/s", "x seq", "1st item s", "CPU s", "srv CPU s", "requests", "peak cache MiB"]
    rows = []
    for r in report["results"]:
        peak = "-" if r["peak_cache_bytes"] is None else f"{r['peak_cache_bytes'] / MIB:.1f} / {r['capacity_bytes'] / MIB:.0f}"
        rows.append(
            [
                r["case"],
                r["method"],
                _fmt(r["median_wall_s"], ".2f"),
                _fmt(r["mb_per_s"], ".1f"),
                _fmt(r["ratio_to_sequential"], ".2f"),
                _fmt(r["median_first_item_s"], ".3f"),
                _fmt(r["median_cpu_s"], ".2f"),
                _fmt(r["median_server_cpu_s"], ".2f"),
                _fmt(r["median_requests"], ".0f"),
                peak,
            ]
        )
    s = report["settings"]
    cpu_note = (
        "client process (all its threads, getrusage); srv CPU s: the moto server process"
        if s["server"] == "subprocess"
        else "this process, moto server threads included"
    )
    notes = [
        "",
        *provenance_lines(report),
        f"load average (1/5/15 min) at start {report['machine']['loadavg_start']}, at end {report['machine'].get('loadavg_end')}",
        *(f"case {name}: {desc}" for name, desc in report["cases"].items()),
        (
            f"median of {s['repeats']} interleaved runs per method; MB = 10^6 bytes delivered to a consumer "
            "that reads every byte; x seq = throughput / the sequential copy's (>1 is faster)"
        ),
        f"1st item s: from start (listing included) to the first folder in the consumer's hands; CPU s: user+sys of the {cpu_note}",  # noqa: E501 - kept whole
        (
            "requests: S3 API calls made by s3fs and cachepipe's direct path; peak cache: cachepipe's cache dir, sampled every 5 ms in one "  # noqa: E501 - kept whole
            f"extra untimed run, against the capacity; cachepipe max_concurrency={s['max_concurrency']}, part_size={s['part_size'] or 'default'}"  # noqa: E501 - kept whole
        ),
    ]
    return "\n".join(format_table(cols, rows) + notes)


# ---- main ----------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataset_options(p, DEFAULTS)
    p.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs per method and case; the median is reported (default 3)"
    )
    p.add_argument("--capacity", default="64MiB", help="cache capacity for cachepipe and the original (default 64MiB)")
    add_cachepipe_options(p)
    p.add_argument("--cases", default="video,small-files", help="comma-separated cases to run (default both)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated methods (default {','.join(METHODS)})")
    add_server_option(p)
    p.add_argument("--no-peak", action="store_true", help="skip the extra untimed run that samples the cache peak")
    p.add_argument("--time-limit", type=float, help="abort (cleaning up) after this many seconds (default 300; --quick 100)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout instead of the table")
    p.add_argument("--quick", action="store_true", help="a tiny dataset, for the smoke test")
    args = p.parse_args(argv)
    apply_defaults(args, {**DEFAULTS, "time_limit": (300.0, 100.0)})
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for what, got, valid in (("case", args.cases, ("video", "small-files")), ("method", args.methods, METHODS)):
        bad = [g for g in got if g not in valid]
        if bad or not got:
            p.error(f"--{what}s {','.join(got)!r}: expected a comma-separated subset of {','.join(valid)}")
    check_positive(p, args, ("folders", "small_folders", "small_files", "small_kib", "repeats", "max_concurrency"))
    if args.video_mib <= 0 or args.time_limit <= 0:
        p.error("--video-mib and --time-limit must be positive")
    args.capacity_bytes = parse_capacity(p, args)
    return args


def _set_dummy_credentials() -> None:
    """The local server accepts anything; make sure no real credentials or profile are used."""
    os.environ["AWS_ACCESS_KEY_ID"] = "bench"
    os.environ["AWS_SECRET_ACCESS_KEY"] = "bench"
    os.environ["AWS_DEFAULT_REGION"] = "us-east-1"
    os.environ.pop("AWS_PROFILE", None)
    os.environ.pop("AWS_SESSION_TOKEN", None)


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`BenchTimeout` in the main thread after ``seconds``; the stack unwinds, so
    pipelines close, threads stop, the server stops and temp dirs are removed."""

    def expire(signum: int, frame: object) -> None:
        raise BenchTimeout(f"benchmark exceeded its time limit of {seconds:g} s (--time-limit)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _source_revision() -> str | None:
    """The git commit of the cachepipe sources measured, '+dirty' when they differ from it (read-only git calls)."""
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "--no-optional-locks", "-C", str(root), "status", "--porcelain", "--", "cachepipe"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _set_dummy_credentials()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    counter = RequestCounter()
    s3fs_log = logging.getLogger("s3fs")
    s3fs_log.setLevel(logging.DEBUG)
    s3fs_log.propagate = False
    s3fs_log.addHandler(counter)
    direct_log = logging.getLogger("cachepipe.stores.s3direct")
    direct_log.setLevel(logging.DEBUG)
    direct_log.propagate = False
    direct_log.addHandler(counter)

    import boto3  # noqa: F401  (imported before timing starts)
    import moto
    import s3fs

    import cachepipe
    from cachepipe import Pipeline  # noqa: F401  (the same: cachepipe imports its public names on first use)

    cases = [c for c in build_cases(args) if c.name in args.cases]
    for case in cases:
        if case.folder_bytes > args.capacity_bytes:
            raise SystemExit(f"--capacity {args.capacity}: smaller than one {case.name} folder ({case.folder_bytes} bytes)")
    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": {**machine_info(), "loadavg_start": _loadavg()},
        "versions": {
            "cachepipe": f"{cachepipe.__version__} ({_source_revision() or 'revision unknown'})",
            "s3fs": s3fs.__version__,
            "moto": moto.__version__,
        },
        "settings": {
            "repeats": args.repeats,
            "capacity_bytes": args.capacity_bytes,
            "server": args.server,
            "max_concurrency": args.max_concurrency,
            "max_large_requests": args.max_large_requests,
            "part_size": args.part_size,
        },
        "cases": {c.name: c.describe() for c in cases},
        "results": [],
    }
    runs: dict[tuple[str, str], list[Run]] = {(c.name, m): [] for c in cases for m in args.methods}
    peaks: dict[str, int] = {}
    started = time.perf_counter()
    with time_limit(args.time_limit), tempfile.TemporaryDirectory(prefix="cachepipe-bench-") as tmp:
        server = Server(args.server)
        try:
            progress(f"moto S3 server ({args.server}) at {server.endpoint}; uploading {', '.join(c.describe() for c in cases)}")
            upload(server.endpoint, cases)
            progress(f"uploaded in {time.perf_counter() - started:.1f} s")
            for rep in range(args.repeats):
                order = args.methods[rep % len(args.methods) :] + args.methods[: rep % len(args.methods)]
                for case in cases:
                    for method in order:
                        run = measure(method, server, counter, case, Path(tmp), args.capacity_bytes, args)
                        runs[(case.name, method)].append(run)
                        progress(
                            f"repeat {rep + 1}/{args.repeats} {case.name:11} {method:10} {run.wall_s:6.2f} s "
                            f"first item {_fmt(run.first_item_s, '.3f')} s, cpu {run.cpu_user_s:.2f} usr + {run.cpu_sys_s:.2f} sys s, "  # noqa: E501 - kept whole
                            f"{run.minor_faults} page faults, {run.requests} requests"
                        )
            if "cachepipe" in args.methods and not args.no_peak:
                for case in cases:
                    peak, samples = measure_peak(server, case, Path(tmp), args.capacity_bytes, args)
                    peaks[case.name] = peak
                    progress(
                        f"peak {case.name}: {peak} bytes in the cache dir over {samples} samples (capacity {args.capacity_bytes})"
                    )
        finally:
            server.stop()
    for case in cases:
        rows = {m: summarise(case, m, runs[(case.name, m)], args.capacity_bytes) for m in args.methods}
        base = rows.get("sequential")
        for method, row in rows.items():
            if base is not None:
                row["ratio_to_sequential"] = base["median_wall_s"] / row["median_wall_s"]
            if method == "cachepipe":
                row["peak_cache_bytes"] = peaks.get(case.name)
            report["results"].append(row)
    report["total_seconds"] = time.perf_counter() - started
    report["machine"]["loadavg_end"] = _loadavg()
    print_report(report, render_table, args.json)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchTimeout as exc:
        print(f"bench_pipeline: {exc}", file=sys.stderr)
        sys.exit(3)
