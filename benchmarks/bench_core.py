"""Core overheads without a network: hand-off rate, and memory for a very large catalog.

    .venv/bin/python benchmarks/bench_core.py                 # 20,000 hand-offs, 1,000,000-item catalog
    .venv/bin/python benchmarks/bench_core.py --quick --json  # what the smoke test runs
    .venv/bin/python benchmarks/bench_core.py --no-handoff    # the catalog measurements only

Three measurements, each in a fresh child process (so RSS and CPU are its own):

- ``handoff``: items per second through ``Pipeline`` when downloads cost nothing: a
  ``memory://`` source of tiny one-file folders, a consumer that takes and acks each. Run with
  the cache on the project disk and on tmpfs (``/dev/shm``), beside the **floor**: the same
  file-system calls per item (mkdir, create and write, rename, unlink, rmdir) made by one plain
  Python loop, no threads. The ratio to the floor is the pipeline's own overhead.
- ``catalog-stream``: a generated listing of ``--catalog`` one-file folders (no I/O to list);
  the default pass streams it (see ``cachepipe/listing.py``). Reports the time to the first item
  and the peak RSS after ``--consume`` items, while the listing runs ahead as far as it may.
- ``catalog-full``: the same listing with ``shuffle=True``, which needs the whole catalog before
  the first download: time to open (wall and CPU seconds: on a shared machine the CPU seconds
  vary less) and peak RSS.

``--no-handoff`` runs only the two catalog measurements.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any, BinaryIO

from common import command_line, format_table, machine_info, progress, provenance_lines

from cachepipe import Pipeline
from cachepipe.stores.base import ObjectInfo


class GeneratedStore:
    """A source of ``n`` folders ``s0000000/f`` of ``size`` bytes each, listed from a generator."""

    url = "gen://bench"

    def __init__(self, n: int, size: int = 1) -> None:
        self.n, self.size = n, size

    def list(self):
        etag = "0" * 32
        for i in range(self.n):
            yield ObjectInfo(f"s{i:07d}/f", self.size, etag)

    def get(self, key: str, out: BinaryIO, start: int, end: int) -> int:
        return out.write(b"x" * (end - start))

    def close(self) -> None:
        pass


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_handoff(n: int, where: str) -> dict[str, Any]:
    import fsspec

    fs = fsspec.filesystem("memory")
    for i in range(n):
        fs.pipe_file(f"/handoff/{i:07d}/f", b"x")
    with tempfile.TemporaryDirectory(dir=where) as d:
        t0, c0 = time.perf_counter(), _cpu()
        with Pipeline("memory://handoff", Path(d) / "c", "64MiB") as pipe:
            count = sum(1 for _ in pipe)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    fs.rm("/handoff", recursive=True)
    assert count == n, (count, n)
    return {"items": n, "wall_s": wall, "items_per_s": n / wall, "cpu_s": cpu}


def run_floor(n: int, where: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=where) as d:
        t0 = time.perf_counter()
        for i in range(n):
            staged, final = f"{d}/s{i}", f"{d}/f{i}"
            os.mkdir(staged)
            with open(f"{staged}/f", "wb") as fh:
                fh.write(b"x")
            os.rename(staged, final)
            os.unlink(f"{final}/f")
            os.rmdir(final)
        wall = time.perf_counter() - t0
    return {"items": n, "wall_s": wall, "items_per_s": n / wall}


def run_catalog(n: int, consume: int, shuffle: bool) -> dict[str, Any]:
    rss0 = _rss_mib()
    with tempfile.TemporaryDirectory() as d:
        t0, c0 = time.perf_counter(), _cpu()
        with Pipeline("gen://bench", Path(d) / "c", "256MiB", store=GeneratedStore(n), shuffle=shuffle) as pipe:
            opened, opened_cpu = time.perf_counter() - t0, _cpu() - c0
            first = None
            for k, _item in enumerate(pipe):
                if first is None:
                    first = time.perf_counter() - t0
                if k + 1 >= consume:
                    break
            listed = pipe.stats().items_listed
            rss = _rss_mib()
    return {
        "catalog": n,
        "consumed": consume,
        "open_s": opened,
        "open_cpu_s": opened_cpu,
        "first_item_s": first,
        "items_listed_at_end": listed,
        "peak_rss_mib": rss,
        "rss_before_mib": rss0,
    }


def _child(conn: Any, fn: str, args: tuple) -> None:
    try:
        conn.send(("ok", globals()[fn](*args)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the run
        conn.send(("error", repr(exc)))


def in_child(fn: str, *args: Any, limit: float) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child, fn, args))
    proc.start()
    try:
        if not parent.poll(limit):
            raise TimeoutError(f"{fn}{args} did not finish in {limit} s")
        status, value = parent.recv()
    finally:
        proc.kill() if proc.is_alive() else None
        proc.join()
    if status != "ok":
        raise RuntimeError(f"{fn}{args} failed: {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--handoff", type=int, default=20_000, help="items in the hand-off measurement (default 20000)")
    p.add_argument("--catalog", type=int, default=1_000_000, help="items in the generated catalog (default 1000000)")
    p.add_argument("--consume", type=int, default=20_000, help="items consumed from the streamed catalog (default 20000)")
    p.add_argument("--no-handoff", action="store_true", help="skip the hand-off measurement (catalog only)")
    p.add_argument("--no-full", action="store_true", help="skip the full (shuffled) catalog measurement")
    p.add_argument("--limit", type=float, default=600, help="seconds per measurement (default 600)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.handoff, args.catalog, args.consume, args.limit = 300, 5_000, 200, 120
    disk = tempfile.gettempdir()
    places = [("disk", disk)] + ([("tmpfs", "/dev/shm")] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else [])
    import cachepipe

    report: dict[str, Any] = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {"cachepipe": cachepipe.__version__},
        "handoff": {},
        "catalog": {},
        "load_average": {"start": list(os.getloadavg())},
    }
    for label, where in [] if args.no_handoff else places:
        progress(f"handoff on {label} ({where}), {args.handoff} items")
        got = in_child("run_handoff", args.handoff, where, limit=args.limit)
        floor = in_child("run_floor", args.handoff, where, limit=args.limit)
        report["handoff"][label] = {
            **got,
            "floor_items_per_s": floor["items_per_s"],
            "of_floor": got["items_per_s"] / floor["items_per_s"],
        }
    progress(f"streamed catalog of {args.catalog} items, consuming {args.consume}")
    report["catalog"]["stream"] = in_child("run_catalog", args.catalog, args.consume, False, limit=args.limit)
    if not args.no_full:
        progress(f"full (shuffled) catalog of {args.catalog} items")
        report["catalog"]["full"] = in_child("run_catalog", args.catalog, min(args.consume, 1000), True, limit=args.limit)
    report["load_average"]["end"] = list(os.getloadavg())
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [
        [label, f"{r['items_per_s']:,.0f}", f"{r['floor_items_per_s']:,.0f}", f"{r['of_floor']:.2f}", f"{r['cpu_s']:.1f}"]
        for label, r in report["handoff"].items()
    ]
    lines = []
    if rows:
        lines += ["hand-off through Pipeline (memory:// source, 1-byte one-file folders):"]
        lines += [*format_table(["cache on", "items/s", "fs floor items/s", "x floor", "CPU s"], rows), ""]
    rows = [
        [
            mode,
            f"{r['catalog']:,}",
            f"{r['open_s']:.2f}",
            f"{r['open_cpu_s']:.2f}",
            f"{r['first_item_s']:.2f}",
            f"{r['consumed']:,}",
            f"{r['items_listed_at_end']:,}",
            f"{r['peak_rss_mib']:.0f}",
        ]
        for mode, r in report["catalog"].items()
    ]
    lines += ["generated catalog:"]
    lines += format_table(
        ["listing", "items", "open s", "open CPU s", "1st item s", "consumed", "listed by then", "peak RSS MiB"], rows
    )
    load = report["load_average"]
    lines += ["", *provenance_lines(report)]
    lines += [
        f"load average (1/5/15 min) at start {[round(x, 2) for x in load['start']]}, at end {[round(x, 2) for x in load['end']]}"
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
