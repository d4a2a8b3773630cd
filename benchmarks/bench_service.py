"""Benchmark: the cost of the daemon's hand-off path, through its Unix socket.

Starts a moto S3 server (in a thread of this process; it is idle while we measure), uploads
``--items`` tiny items (one object of ``--size`` bytes each), and runs ``cachepipe serve`` as a
subprocess with three pipelines over that prefix (``rt``, ``par`` and ``batch``, separate
caches, capacity far above the dataset; ``batch`` alone with ``--batched-only``, which measures
2. for ``get_many`` and 3. only). Once the status shows every item of every pipeline ready (so
download time is excluded), it measures:

1. round trips from one client (:class:`cachepipe.client.Client`, one keep-alive connection):
   ``next`` then ``ack`` as two requests, ``--round-trips`` times; then ``next`` of one item
   carrying the previous item's ack (``get_many(1, ack=[previous])``; what ``for item in
   Client(...)`` did for every item before it took batches), for the rest of the items.
   Before them, ``--shell`` items taken as a shell loop does: ``cachepipe next`` then
   ``cachepipe ack``, a process each. Reported as p50/p99/mean in microseconds per item.
2. items/s sustained by ``--consumers`` consumer processes in parallel until a pipeline is
   exhausted, twice: each looping ``for item in Client("par")`` (auto-ack; the loop takes batches
   sized by its body, here up to 64 items a request, their acks carried by the next), then each
   taking ``--batch`` items per request from pipeline ``batch``
   (``Client.get_many``, each batch acknowledged by the next request). All processes start on
   one signal once connected; the time is from that signal to the last consumer's last item.
   With the daemon's CPU microseconds per item over the same span, and the consumers' (their
   own processes' CPU while taking items, summed): on a machine of few cores they share it.
3. the **deletion floor**: the file-system calls that acknowledging one of these items costs the
   daemon (open the item's folder, unlink its file, close, rmdir), made for ``--items`` folders of
   the same shape, written and synced beforehand as the prefetched ones were, by ``--consumers``
   plain threads (the daemon deletes on the request thread of each consumer). No hand-out can
   run faster than its items are deleted, so the batched rate's ratio to it (``of_floor``) is
   what the daemon's own work costs on top (figures: benchmarks/README.md).
   ``--cache-root /dev/shm`` puts the daemon's caches (and the floor's folders) on tmpfs.
   The report names the caches' file system, and for ext4 whether it has a journal: an ext4
   made without one scans, at every create, past the inodes deleted in the last minutes, which
   a cache that fills pays twice per item (benchmarks/README.md, "A cache that fills on a disk").

``--fills`` measures the steady state of a source larger than its cache instead: each cache
holds an eighth of the items (their charge in whole blocks, a block per folder, plus the
cache's state: :func:`fills_capacity`), and the timed part starts once every cache is full (the
next item does not fit, every reserved item published), so the daemon's pipelines download the
rest while serving, each ack freeing one item's room. Without it (**roomy**, the default) every
item is prefetched into a capacity of 4 GiB and the timed part downloads nothing. The report
says which regime ran. The in-process baseline runs in the same regime.

Usage::

    .venv/bin/python benchmarks/bench_service.py               # 2,000 items, 1,000 round trips, 8 consumers
    .venv/bin/python benchmarks/bench_service.py --quick       # a smoke run (60 items)
    .venv/bin/python benchmarks/bench_service.py --json
    .venv/bin/python benchmarks/bench_service.py --local --no-markers --items 20000   # items from a local folder
    .venv/bin/python benchmarks/bench_service.py --local --no-markers --items 20000 --cache-root /dev/shm  # caches on tmpfs
    .venv/bin/python benchmarks/bench_service.py --local --no-markers --items 20000 --batched-only  # get_many alone
    .venv/bin/python benchmarks/bench_service.py --local --items 20000 --batched-only --api-acks  # Client(markers=False)
    .venv/bin/python benchmarks/bench_service.py --local --items 20000 --batched-only --fills  # a cache that fills
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path
from typing import Any

os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")

import yaml
from common import file_system_of
from netlink import cpu_seconds

from cachepipe.blocks import clamp_block, footprint, round_up
from cachepipe.cache.core import journal_budget_of
from cachepipe.client import Client
from cachepipe.service.testing import DaemonProcess

BUCKET = "bench"
WARMUP = 20
ROOMY = "4GiB"
"""The capacity of a cache that every item fits in (the default regime)."""
FILLS_SHARE = 8
"""``--fills``: a cache holds 1/FILLS_SHARE of the items."""
STATE_SLACK = 16
"""``--fills``: blocks for the cache's state files beside its journal's budget (the state
folder, its lock, staging: 16 blocks on tmpfs with ``--local``, where the cache then holds
exactly 1/FILLS_SHARE of the items)."""

CONSUMER = r"""
import json, sys, time
from cachepipe.client import Client
pipeline, batch, markers = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "markers"
client = Client(pipeline=pipeline, socket=sys.argv[1], timeout=120, **({} if markers else {"markers": False})).open()
client.status()  # connected before the start signal
print("ready", flush=True)
sys.stdin.readline()
start, cpu = time.monotonic(), time.process_time()
count = 0
if batch == 1:
    for item in client:
        count += 1
else:
    got = client.get_many(batch, timeout=120)
    while got:
        count += len(got)
        got = client.get_many(batch, timeout=120, ack=got)  # this batch acknowledged by the next request
print(json.dumps({"start": start, "end": time.monotonic(), "count": count, "cpu": time.process_time() - cpu}), flush=True)
"""


def upload(endpoint: str, items: int, size: int) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    s3.create_bucket(Bucket=BUCKET)
    body = os.urandom(size)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: s3.put_object(Bucket=BUCKET, Key=f"tiny/item{i:05d}/data.bin", Body=body), range(items)))


def item_charge(where: str, size: int) -> int:
    """What a cache on ``where``'s file system charges one item (a folder of one ``size``-byte
    file): the file in whole blocks, and a block for its folder (:func:`cachepipe.blocks.footprint`)."""
    return footprint([size], 1, clamp_block(os.statvfs(where).f_frsize))


def fills_capacity(where: str, items: int, size: int, versions: bool) -> int:
    """``--fills``: a capacity that holds 1/:data:`FILLS_SHARE` of ``items`` items on ``where``,
    beside the cache's state (its journal's budget for names ``itemNNNNN``, with versions for
    an S3 source, ``versions``, and :data:`STATE_SLACK` blocks for its files), so a pass over
    them fills it and then waits for an ack per item."""
    block = clamp_block(os.statvfs(where).f_frsize)
    state = round_up(journal_budget_of(len("item00000") * items, items, versions), block) + STATE_SLACK * block
    return -(-items // FILLS_SHARE) * item_charge(where, size) + state


STILL_POLLS = 5
"""``--fills``: polls (0.1 s apart) that must find a full cache's ready items unchanged before
the timed part starts: the cache fills by reservations first, their downloads published after."""


def settled(stats: dict[str, Any], items: int, size: int, charge: int | None) -> bool:
    """A pipeline's ``stats`` say the timed part may start: every item ready (``charge`` None,
    the roomy regime), or its cache full: the next item (``charge`` bytes) does not fit, and
    the bytes downloaded are the ready items' (``size`` each: nothing is taken before the timed
    part). A full cache is counted by its reservations, so an item reserved may still be on its
    way: :func:`wait_ready` waits for its ready items to stay the same too."""
    if charge is None:
        return stats["items_ready"] >= items
    full = stats["capacity"] - stats["bytes_in_cache"] < charge
    return full and stats["bytes_downloaded"] == stats["items_ready"] * size


def wait_ready(
    client: Client, items: int, timeout: float, size: int = 0, charge: int | None = None, pid: int | None = None
) -> tuple[float, float | None]:
    """Poll the status until every pipeline is :func:`settled` (a full cache: at
    :data:`STILL_POLLS` polls in a row with the same ready items). Returns the seconds waited,
    and the daemon's (``pid``) CPU microseconds per item downloaded from the first poll that
    found an item ready to the end (its start and listing left out; None without ``pid``, or if
    the first such poll found every item ready)."""
    start = time.monotonic()
    seen: list[list[int]] = []
    first: tuple[float, int] | None = None  # the daemon's CPU s and the ready items at the first poll with one
    while True:
        pipes = client.status()["pipelines"]
        ready = sum(p["stats"]["items_ready"] for p in pipes.values())
        if pid is not None and first is None and ready:
            first = (_daemon_cpu(pid), ready)
        if all(settled(p["stats"], items, size, charge) for p in pipes.values()):
            seen.append([p["stats"]["items_ready"] for p in pipes.values()])
            if charge is None or seen[-STILL_POLLS:] == [seen[-1]] * STILL_POLLS:
                waited = time.monotonic() - start
                if pid is None or first is None or ready == first[1]:
                    return waited, None
                return waited, round((_daemon_cpu(pid) - first[0]) / (ready - first[1]) * 1e6, 1)
        else:
            seen.clear()
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"items not all ready after {timeout} s: {json.dumps(pipes)[:400]}")
        time.sleep(0.1)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return {
        "n": len(us),
        "p50_us": round(us[len(us) // 2], 1),
        "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
        "mean_us": round(statistics.fmean(us), 1),
    }


def shell_round_trips(sock: str, count: int) -> dict[str, float]:
    """What a shell loop pays per item: ``cachepipe next`` then ``cachepipe ack``, a process each
    (``python -m cachepipe``: the console script's imports), ``count`` items of pipeline ``rt``."""
    cli = [sys.executable, "-m", "cachepipe"]
    samples: list[int] = []
    for _ in range(count):
        t0 = time.perf_counter_ns()
        taken = subprocess.run(
            [*cli, "next", "--socket", sock, "--pipeline", "rt", "--timeout", "30"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        subprocess.run([*cli, "ack", taken.stdout.strip(), "--socket", sock], capture_output=True, check=True, timeout=60)
        samples.append(time.perf_counter_ns() - t0)
    return percentiles(samples)


def round_trips(sock: str, count: int) -> dict[str, dict[str, float]]:
    """Latencies from one client: the protocol floor, next, ack, both, and next carrying the ack."""
    floor: list[int] = []
    take: list[int] = []
    ack: list[int] = []
    both: list[int] = []
    combined: list[int] = []
    with Client("rt", sock, auto_ack=False) as client:
        for i in range(WARMUP + count):
            t0 = time.perf_counter_ns()
            client.health()
            t1 = time.perf_counter_ns()
            item = client.get(timeout=30)
            t2 = time.perf_counter_ns()
            assert item is not None
            client.ack(item)
            t3 = time.perf_counter_ns()
            if i >= WARMUP:
                floor.append(t1 - t0)
                take.append(t2 - t1)
                ack.append(t3 - t2)
                both.append(t3 - t1)
    client = Client("rt", sock, timeout=30).open()
    t0 = time.perf_counter_ns()
    got = client.get_many(1, timeout=30)
    while got:  # one item per request, each ack piggybacked on the next
        got = client.get_many(1, timeout=30, ack=got)
        now = time.perf_counter_ns()
        combined.append(now - t0)
        t0 = now
    client.close()
    return {
        "GET /v1/health (protocol floor)": percentiles(floor),
        "next (lease an item)": percentiles(take),
        "ack (evict the item)": percentiles(ack),
        "next+ack, two requests": percentiles(both),
        "next+ack, ack piggybacked on next": percentiles(combined[1:]),  # the first carries no ack
    }


def write_local(root: str, items: int, size: int) -> None:
    """The same items as :func:`upload`, as files under ``root`` (the ``--local`` source)."""
    body = os.urandom(size)
    for i in range(items):
        os.makedirs(f"{root}/item{i:05d}")
        with open(f"{root}/item{i:05d}/data.bin", "wb") as fh:
            fh.write(body)


def in_process(
    source: dict[str, Any], tmp: str, items: int, count: int, capacity: int | str, size: int, charge: int | None
) -> dict[str, float]:
    """Baseline: Pipeline.get + Pipeline.ack in this process, same data, same filesystem, same
    regime (``capacity``; ``charge`` as :func:`settled`: None waits for ``items`` ready)."""
    from dataclasses import asdict

    from cachepipe import Pipeline

    samples: list[int] = []
    with Pipeline(
        cache_dir=f"{tmp}/inproc",
        capacity=capacity,
        **source,
        auto_ack=False,
        lease_timeout=600,
        keep_on_close=True,
    ) as pipe:
        deadline, seen = time.monotonic() + 600, []
        while True:  # as wait_ready
            stats = asdict(pipe.stats())
            seen = [*seen, stats["items_ready"]] if settled(stats, items, size, charge) else []
            if seen and (charge is None or seen[-STILL_POLLS:] == [seen[-1]] * STILL_POLLS):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("in-process pipeline: items not ready after 600 s")
            time.sleep(0.1)
        for i in range(WARMUP + count):
            t0 = time.perf_counter_ns()
            item = pipe.get(timeout=30)
            assert item is not None
            pipe.ack(item)
            if i >= WARMUP:
                samples.append(time.perf_counter_ns() - t0)
    return percentiles(samples)


def _daemon_cpu(pid: int) -> float:
    seconds = cpu_seconds(pid)
    if seconds is None:
        raise RuntimeError(f"the daemon (pid {pid}) exited during the measurement")
    return seconds


def parallel(
    sock: str, consumers: int, items: int, pipeline: str, batch: int, daemon_pid: int, markers: bool = True
) -> dict[str, Any]:
    """``consumers`` processes exhaust ``pipeline``, each looping ``for item in client`` (``batch``
    1: the loop sizes its own batches, acks carried by the next request) or taking up to
    ``batch`` per request (``get_many``, each batch acknowledged by the next request); with the
    daemon's CPU seconds meanwhile.
    ``markers=False``: the consumers are ``Client(markers=False)`` (their items not watched)."""
    how = "markers" if markers else "api-acks"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONSUMER, sock, pipeline, str(batch), how],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(consumers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"  # noqa: PT018 - one invariant
        cpu0, go = _daemon_cpu(daemon_pid), time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = []
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"a consumer failed with status {proc.returncode}")
            results.append(json.loads(out))
        daemon_cpu = _daemon_cpu(daemon_pid) - cpu0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    total = sum(r["count"] for r in results)
    if total != items:
        raise RuntimeError(f"consumers got {total} items, expected {items}")
    seconds = max(r["end"] for r in results) - go
    return {
        "consumers": consumers,
        "batch": batch,
        "items": total,
        "seconds": round(seconds, 3),
        "items_per_s": round(total / seconds, 1),
        "daemon_cpu_us_per_item": round(daemon_cpu / total * 1e6, 1),
        "consumers_cpu_us_per_item": round(sum(r["cpu"] for r in results) / total * 1e6, 1),
        "per_consumer": sorted(r["count"] for r in results),
    }


def deletion_floor(where: str, items: int, size: int, threads: int) -> dict[str, Any]:
    """Items/s at which ``threads`` plain threads delete ``items`` one-file folders under
    ``where`` by the daemon's calls for an acknowledged item (open the folder, unlink its file,
    close, rmdir); the folders are written and synced first, as the prefetched items were."""
    body = os.urandom(size)
    with tempfile.TemporaryDirectory(prefix="floor-", dir=where) as d:
        for i in range(items):
            os.mkdir(f"{d}/item{i:05d}")
            with open(f"{d}/item{i:05d}/data.bin", "wb") as fh:
                fh.write(body)
        os.sync()

        def delete(first: int) -> None:
            for i in range(first, items, threads):
                path = f"{d}/item{i:05d}"
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    os.unlink("data.bin", dir_fd=fd)
                finally:
                    os.close(fd)
                os.rmdir(path)

        workers = [threading.Thread(target=delete, args=(k,)) for k in range(threads)]
        t0 = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        seconds = time.perf_counter() - t0
    return {"threads": threads, "items": items, "seconds": round(seconds, 3), "items_per_s": round(items / seconds, 1)}


def measure(
    args: argparse.Namespace, tmp: str, caches: str, source: dict[str, Any]
) -> tuple[tuple[float, float | None], dict, list]:
    """Start the daemon over ``source`` (``source`` and ``storage_options`` of a pipeline), its
    caches in ``caches``, wait until every item is on disk (``--fills``: until every cache is
    full), then measure; returns ((prefetch seconds, the daemon's CPU µs per item downloaded
    meanwhile: :func:`wait_ready`), latencies, parallel runs)."""
    sock = f"{tmp}/api.sock"
    capacity = args.capacity_bytes
    charge = item_charge(caches, args.size) if args.fills else None
    config = {
        "socket": sock,
        "log_level": "warning",
        "markers": not args.no_markers,
        "pipelines": {
            name: {**source, "cache_dir": f"{caches}/{name}", "capacity": capacity}
            for name in (("batch",) if args.batched_only else ("rt", "par", "batch"))
        },
    }
    Path(tmp, "cachepipe.yaml").write_text(yaml.safe_dump(config))
    latencies: dict[str, dict[str, float]] = {}
    par = []
    with DaemonProcess(Path(tmp, "cachepipe.yaml")) as daemon, Client("batch", sock) as probe:
        prefetch_s, prefetch_cpu = wait_ready(probe, args.items, 600, args.size, charge, daemon.pid)
        if not args.batched_only:
            shell = shell_round_trips(sock, args.shell)
            latencies = round_trips(sock, args.round_trips)
            latencies["shell: cachepipe next, cachepipe ack"] = shell
            par.append(parallel(sock, args.consumers, args.items, "par", 1, daemon.pid, not args.api_acks))
        par.append(parallel(sock, args.consumers, args.items, "batch", args.batch, daemon.pid, not args.api_acks))
        code = daemon.stop()
        if code != 0:
            raise RuntimeError(f"the daemon exited with {code}:\n{daemon.log()}")
    if not args.batched_only:
        wanted = args.round_trips + WARMUP
        baseline = in_process(source, caches, wanted, args.round_trips, capacity, args.size, charge)
        latencies["in-process Pipeline.get+ack (baseline)"] = baseline
    floor = deletion_floor(caches, args.items, args.size, args.consumers)
    batched = par[-1]
    batched["deletion_floor_items_per_s"] = floor["items_per_s"]
    batched["of_floor"] = round(batched["items_per_s"] / floor["items_per_s"], 2)
    return (prefetch_s, prefetch_cpu), latencies, par


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000, help="items per pipeline (default 2000)")
    parser.add_argument("--size", type=int, default=1024, help="bytes per item (default 1024)")
    parser.add_argument("--round-trips", type=int, default=1000, help="next+ack round trips (default 1000)")
    parser.add_argument(
        "--shell", type=int, default=20, help="items taken by `cachepipe next` and `cachepipe ack` processes (default 20)"
    )
    parser.add_argument("--consumers", type=int, default=8, help="parallel consumer processes (default 8)")
    parser.add_argument("--batch", type=int, default=64, help="items per request in the batched run (default 64)")
    parser.add_argument(
        "--no-markers", action="store_true", help="run the daemon with markers: false (no inotify watch of the caches)"
    )
    parser.add_argument(
        "--api-acks",
        action="store_true",
        help="the consumer processes are Client(markers=False): they acknowledge over the API, and the daemon "
        "does not watch their items for a .done",
    )
    parser.add_argument(
        "--local",
        action="store_true",
        help="read the items from files in a local folder instead of the moto server (the same hand-out path: "
        "only the prefetch, which is not timed, differs); for runs of many items",
    )
    parser.add_argument(
        "--cache-root",
        default="",
        help="folder to put the daemon's caches in (default: beside the socket, under /tmp, on the project disk; "
        "/dev/shm for tmpfs)",
    )
    parser.add_argument(
        "--batched-only",
        action="store_true",
        help="measure the batched hand-out (and the deletion floor) only: one pipeline, no round trips, no iterator run",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 60 items, 30 round trips, 2 consumers, 1 item by the shell's commands"
    )
    parser.add_argument(
        "--fills",
        action="store_true",
        help=f"a cache that fills: each holds 1/{FILLS_SHARE} of the items (and its state), and the timed part starts "
        "once it is full, so the pipelines download the rest while serving (default: every item prefetched into "
        f"{ROOMY}, no download timed)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.items, args.round_trips, args.consumers, args.shell = 60, 30, 2, 1
    if args.shell < 1:
        parser.error(f"--shell {args.shell}: expected a number of items >= 1")
    if args.shell + args.round_trips + WARMUP + 2 > args.items:
        parser.error(f"--items must exceed --round-trips and --shell together by at least {WARMUP + 2}")
    if args.cache_root and not os.path.isdir(args.cache_root):
        parser.error(f"--cache-root {args.cache_root!r} is not a folder")

    with (
        tempfile.TemporaryDirectory(prefix="cp-bench-", dir="/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="cp-bench-caches-", dir=args.cache_root or tmp) as caches,
    ):
        args.capacity_bytes = fills_capacity(caches, args.items, args.size, not args.local) if args.fills else ROOMY
        cache_fs = file_system_of(caches)
        if args.local:
            t0 = time.monotonic()
            write_local(f"{tmp}/data", args.items, args.size)
            upload_s = time.monotonic() - t0
            measured = measure(args, tmp, caches, {"source": f"{tmp}/data"})
        else:
            import logging

            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.WARNING)  # the moto server logs every request at INFO
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            try:
                host, port = server.get_host_and_port()
                endpoint = f"http://{host}:{port}"
                t0 = time.monotonic()
                upload(endpoint, args.items, args.size)
                upload_s = time.monotonic() - t0
                source = {"source": f"s3://{BUCKET}/tiny/", "storage_options": {"endpoint_url": endpoint}}
                measured = measure(args, tmp, caches, source)
            finally:
                server.stop()
    (prefetch_s, prefetch_cpu), latencies, par = measured

    command = " ".join(
        shlex.quote(a)
        for a in [os.path.relpath(sys.executable), os.path.relpath(__file__), *(argv if argv is not None else sys.argv[1:])]
    )
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": command,
        "items": args.items,
        "item_bytes": args.size,
        "upload_seconds": round(upload_s, 1),
        "prefetch_seconds": round(prefetch_s, 1),
        "prefetch_daemon_cpu_us_per_item": prefetch_cpu,
        "cache_root": args.cache_root or "/tmp",
        "cache_file_system": cache_fs,
        "regime": "fills" if args.fills else "roomy",
        "capacity_bytes": args.capacity_bytes,
        "latencies": latencies,
        "parallel": par,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"cachepipe service benchmark, {result['date']}, {result['machine']}")
    print(f"command: {command}")
    if args.fills:
        regime = (
            f"fills: each cache holds 1/{FILLS_SHARE} of them ({result['capacity_bytes']:,} bytes with its state), "
            "the timed part from a full cache, downloading the rest"
        )
    else:
        regime = f"roomy: all prefetched into {ROOMY} before timing"
    print(
        f"{args.items} items of {args.size} B per pipeline, {regime} "
        f"({'written' if args.local else 'upload'} {result['upload_seconds']} s, "
        f"{'filled' if args.fills else 'prefetch'} {result['prefetch_seconds']} s, "
        f"daemon CPU {prefetch_cpu} us per item downloaded); caches in {result['cache_root']} ({cache_fs})"
    )
    print()
    if latencies:
        print(f"{'one client, Unix socket, keep-alive':<44} {'n':>6} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}")
        for label, row in latencies.items():
            print(f"{label:<44} {row['n']:>6} {row['p50_us']:>9} {row['p99_us']:>9} {row['mean_us']:>9}")
        print()
    for row in par:
        how = "the loop (for item in client)" if row["batch"] == 1 else f"get_many({row['batch']}), acks with the next"
        print(
            f"{row['consumers']} consumer processes, {how}: {row['items']} items in {row['seconds']} s = "
            f"{row['items_per_s']} items/s, daemon CPU {row['daemon_cpu_us_per_item']} us/item, "
            f"consumers' CPU {row['consumers_cpu_us_per_item']} us/item "
            f"(per consumer: {row['per_consumer']})"
        )
        if "of_floor" in row:
            print(
                f"  deletion floor ({row['consumers']} plain threads deleting such items in {result['cache_root']}): "
                f"{row['deletion_floor_items_per_s']} items/s; the batched hand-out is {row['of_floor']} of it"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
