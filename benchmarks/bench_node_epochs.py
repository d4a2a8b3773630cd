"""Benchmark: do a node's lanes stop while the node plans its next epoch? (no network)

An 8-GPU node serving a catalog of a million items (``--items``; an image dataset) plans each
epoch's shares for every lane: about 2 s of CPU per million items on the 2-core VM, plus the
next-use lookups of ``retain="auto"``. Each run opens a ``NodePipeline`` over a generated
catalog of 1-byte items on tmpfs (``--ranks`` ranks of a job of that many, no DataLoader
workers, shuffled, ``--epochs`` epochs), starts every lane ``--before`` steps before the end of
its first epoch, and lets each lane take ``--steps`` items, ``take_many(64)`` at a time, each
batch consumed at once. A watcher notes when the planner enters epoch 1 (a lane's next step to
plan is in it: the node computes an epoch's shares then). Reported per run: the longest
``take_many`` that overlapped the ``--window`` seconds after that (what a training process
would wait), the longest of the others (the run's noise: the start, the garbage collector, a
busy machine), the median, the longest pause of the collector, and, measured alone in the same
process, the CPU time to plan one epoch. Each run is a fresh process; runs of ``none`` and
``auto`` alternate.

Run against another tree with ``PYTHONPATH=TREE``::

    python benchmarks/bench_node_epochs.py                   # 1,000,000 items, 3 runs of each
    python benchmarks/bench_node_epochs.py --quick           # the smoke test's sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path
from typing import Any

from bench_core import GeneratedStore
from common import command_line, format_table, machine_info, progress, provenance_lines

import cachepipe
from cachepipe.lanes import NodePlan
from cachepipe.node import NodePipeline
from cachepipe.plan import Cursor


class _Pauses:
    """The longest garbage collection while it is entered."""

    def __init__(self) -> None:
        self.longest, self._start = 0.0, 0.0

    def __enter__(self) -> _Pauses:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.longest = max(self.longest, time.perf_counter() - self._start)


def run(items: int, ranks: int, epochs: int, retain: str, before: int, steps: int, window: float) -> dict[str, Any]:
    """One run (see the module notes); in a fresh process."""
    where = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(dir=where) as d:
        pipe = NodePipeline(
            "gen://bench",
            Path(d) / "c",
            "1GiB",  # a million names budget about 160 MB of journal
            ranks=list(range(ranks)),
            world_size=ranks,
            store=GeneratedStore(items),
            epochs=epochs,
            shuffle=True,
            seed=1,
            retain=retain,
        )
        t0 = time.perf_counter()
        with pipe:
            opened = time.perf_counter() - t0
            plan, schedule = pipe.node_plan, pipe._queues.schedule  # noqa: SLF001 - where the planner is
            starts = [Cursor(0, max(0, len(plan.lane_share(lane, 0)) - before)) for lane in range(ranks)]
            takes: list[tuple[float, float]] = []  # (start, end) of every take_many
            taken = [0] * ranks
            errors: list[BaseException] = []
            crossed: list[float] = []  # when a lane's next step to plan entered epoch 1
            done = threading.Event()

            def lane(rank: int) -> None:
                cursor = starts[rank]
                try:
                    while taken[rank] < steps:
                        t = time.perf_counter()
                        got = pipe.take_many(rank, 0, cursor, 64, timeout=120)
                        takes.append((t, time.perf_counter()))
                        if not got:
                            return
                        cursor = got[-1].after
                        taken[rank] += len(got)
                        pipe.consume(rank, 0, cursor)
                except Exception as exc:  # noqa: BLE001 - raised below: a run that fails is not a figure
                    errors.append(exc)

            def watch() -> None:
                while not done.wait(0.001):
                    if max(c.epoch for c in schedule.cursors) >= 1:
                        crossed.append(time.perf_counter())
                        return

            threads = [threading.Thread(target=lane, args=(rank,)) for rank in range(ranks)]
            watcher = threading.Thread(target=watch)
            t1 = time.perf_counter()
            with _Pauses() as pauses:
                watcher.start()
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
                done.set()
                watcher.join()
            wall = time.perf_counter() - t1
            if errors:
                raise errors[0]
    alone = NodePlan([1] * items, ranks=list(range(ranks)), world_size=ranks, epochs=epochs, shuffle=True, seed=1)
    c0 = time.process_time()
    alone.prepare(0)
    plan_cpu = time.process_time() - c0
    cross = crossed[0] if crossed else None
    near = [b - a for a, b in takes if cross is not None and b > cross and a < cross + window]
    elsewhere = [b - a for a, b in takes if cross is None or not (b > cross and a < cross + window)]
    return {
        "retain": retain,
        "items": items,
        "open_s": opened,
        "wall_s": wall,
        "taken": sum(taken),
        "crossed_after_s": None if cross is None else cross - t1,
        "longest_near_crossing_s": max(near, default=0.0),
        "takes_near_crossing": len(near),
        "longest_elsewhere_s": max(elsewhere, default=0.0),
        "median_take_ms": statistics.median(b - a for a, b in takes) * 1000,
        "longest_gc_s": pauses.longest,
        "plan_epoch_cpu_s": plan_cpu,
    }


def _child(conn: Any, args: tuple) -> None:
    conn.send(run(*args))
    conn.close()


def in_child(*args: Any) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, args))
    proc.start()
    child.close()
    try:
        got = parent.recv()
    except EOFError:
        raise RuntimeError(f"the measuring process died (exit {proc.exitcode})") from None
    finally:
        proc.join()
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000, help="catalog items (default 1,000,000)")
    p.add_argument("--ranks", type=int, default=8, help="the node's ranks, the whole job (default 8)")
    p.add_argument("--epochs", type=int, default=5, help="epochs of the plan (default 5)")
    p.add_argument("--before", type=int, default=2000, help="steps before the end of epoch 0 each lane starts at (default 2000)")
    p.add_argument("--steps", type=int, default=6000, help="items each lane takes (default 6000)")
    p.add_argument("--window", type=float, default=5.0, help="seconds after the planner enters epoch 1 (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each retain setting, alternating (default 3)")
    p.add_argument("--retain", nargs="+", default=["none", "auto"], choices=["none", "auto"])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.items, args.before, args.steps, args.repeats = 4000, 100, 300, 1
    rows: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for retain in args.retain:
            progress(f"run {repeat + 1}/{args.repeats}, retain={retain}")
            rows.append(in_child(args.items, args.ranks, args.epochs, retain, args.before, args.steps, args.window))
    report = {
        "command": command_line(),
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "versions": {"cachepipe": cachepipe.__version__},
        "runs": rows,
    }
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    for line in provenance_lines(report):
        print(line)
    cols = ["retain", "items", "open s", "lane items", "crossed at s", "near: longest take s", "takes", "elsewhere: longest s"]
    cols += ["median take ms", "longest GC s", "plan epoch CPU s"]
    table = [
        [
            r["retain"],
            f"{r['items']:,}",
            f"{r['open_s']:.1f}",
            f"{r['taken']:,}",
            "-" if r["crossed_after_s"] is None else f"{r['crossed_after_s']:.1f}",
            f"{r['longest_near_crossing_s']:.3f}",
            str(r["takes_near_crossing"]),
            f"{r['longest_elsewhere_s']:.3f}",
            f"{r['median_take_ms']:.2f}",
            f"{r['longest_gc_s']:.3f}",
            f"{r['plan_epoch_cpu_s']:.2f}",
        ]
        for r in rows
    ]
    for line in format_table(cols, table):
        print(line)
    for retain in args.retain:
        near = [r["longest_near_crossing_s"] for r in rows if r["retain"] == retain]
        other = [r["longest_elsewhere_s"] for r in rows if r["retain"] == retain]
        print(
            f"retain={retain}, medians of {len(near)} runs: longest take within {args.window:g} s of the planner entering "
            f"epoch 1 {statistics.median(near):.3f} s; elsewhere {statistics.median(other):.3f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
