"""Stress: randomized seeds against a real NodePipeline over a local folder; hangs, stalls, reads.

Each seed makes a source folder of item folders (random sizes) in a temporary directory, opens a
:class:`~cachepipe.node.NodePipeline` over it (a plain path as the source) with 1-8 lanes (ranks
x DataLoader workers), and runs one consumer thread per lane that walks its lane with
``take(rank, worker, cursor, timeout=--timeout)`` and ``consume``: random holds (it keeps its item
while it pauses), random pauses after consuming, and random restarts from a position it took
before (a consumer restarted from a checkpoint). It checks:

- each position a lane takes holds exactly the item :class:`cachepipe.plan.Plan` gives that
  ``(rank, worker)`` at that position (a Plan built with the same options), with its bytes;
- no take times out (``--timeout``, default 22 s): a take that does is a **hang**; the script then
  closes the pipeline (which ends every waiting take) and goes on with the next seed;
- the bytes under the cache directory (sampled by a thread every 2 ms, walked as
  ``tests/sampling.py`` does, counted as the capacity counts them: each file in whole blocks of
  the filesystem, a block per folder) never exceed the capacity.

It reports per mode the seeds run, the seeds that hung, the seeds that **stalled** (a take waited
more than 4 s without hanging), the store reads (``stats().bytes_downloaded`` over the bytes of
every step the lanes took; 1.00x is each step's item read once), and the steps taken.

Modes (``--mode``; "largest" is the largest item a lane's plan holds, in what it takes on the
disk as the capacity counts it: its files in whole blocks, and its folder; "state" is what the
cache counts for its own state files, measured by opening a probe pipeline over the seed's
source):

- ``roomy``: 1-8 lanes, capacity 3-6 largest items per lane + state;
- ``tight``: 1-8 lanes, capacity the sum of each lane's largest item + state (every lane can hold
  its largest item at once, nothing more);
- ``tiny``: 6-8 lanes, capacity 2 x the node's largest item + state (lanes wait for each other;
  holds are short, so nothing may hang). A lane holds one item at a time, for at most 0.3 s
  before it consumes it, so a take that waits its turn behind every other lane waits for at
  most 7 such holds and their downloads (from a local folder): a **stall** here is not a
  legitimate wait but a wait that a timer of the node ended (the give-back,
  ``give_back_after``, 5 s), a defect. Every stall seen (seeds 0-89: 1, 3, 8, 21, 22, 23, 34,
  35, 38, 56, 59, 79; all ``retain="auto"``, takes of 5.0-6.0 s) was one: a download held up
  only by retained items while no item was pinned, the lanes that would read them waiting
  behind it (fixed in ``Cache.acquire``; after it, 0 stalls and a longest take of 1.0 s over
  seeds 0-89);
- ``hazard``: 2 ranks stepping together like DDP: rank 0 has large items (16-64 KiB) and holds
  each one until rank 1 has taken the same step; rank 1 has small items (1-8 KiB), consumes each
  before it waits for rank 0, and restarts from an earlier position up to 4 times (rank 0 keeps
  holding while rank 1 reads its way back). Capacity: the largest item of each rank + state, so
  rank 0's next item, planned ahead, cannot fit beside the one it holds and rank 1's. No hang is
  legitimate: rank 1's item always has room. Nor is a **stall**: each rank holds one item at a
  time, rank 1's fits beside rank 0's once what neither holds is dropped, given back or asked
  back, and rank 0 moves on as soon as rank 1 has taken the step (a wait for its ack lasts a
  moment); a take over 4 s is a wait that a timer of the node ended (the give-back,
  ``give_back_after``, 5 s), a defect. Stalls seen at seeds 0-89: 24, 31, 32, 36, 37, 56, 57,
  58, 60, 66, 75, 77 (all ``retain="none"``, takes of 5.0-5.1 s). Each traced (15 stalls at 11
  of seeds 0-59, all ``retain="none"``: rank 1's download waiting beside the items it shelved
  when it moved back; and 1 of 3 traced runs of seed 26, ``retain="auto"``: rank 0's next item
  took the room rank 1 freed while rank 0 waited for an earlier one) was one of two defects,
  fixed in ``Cache._in_the_way`` (urgent) and ``LaneQueues._ask_back``; after them, 0 stalls
  and a longest take of 0.2 s over seeds 0-89.

A seed whose pipeline refuses the capacity (an item too large for it) is counted under "errors".

Run against another tree with ``PYTHONPATH=TREE``::

    python benchmarks/stress_node.py --mode hazard --seeds 0 30
    python benchmarks/stress_node.py --mode tight --seeds 0 10 --json
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (  # benchmarks/common.py (PeakSampler: the cache walk that counts no file twice)
    PeakSampler,
    format_table,
    print_seeds_report,
    seeds_footer,
    tree,
)

from cachepipe.blocks import clamp_block, footprint
from cachepipe.node import NodePipeline
from cachepipe.plan import Cursor, Plan

KIB = 1024
STALL = 4.0  # a take that waited longer stalled
MODES = ("roomy", "tight", "tiny", "hazard")


# ---- the source ----------------------------------------------------------------------
def content(name: str, rel: str, size: int) -> bytes:
    """The bytes of file ``rel`` of item ``name``: its name repeated, so a swapped item shows."""
    seed = f"{name}/{rel};".encode()
    return (seed * (size // len(seed) + 1))[:size]


def make_source(root: Path, sizes: list[int], rng: random.Random) -> list[str]:
    """Item folders ``i00000``... under ``root``, item ``i`` of ``sizes[i]`` bytes in one or two
    files; returns the item names (sorted, as the catalog lists them)."""
    names = []
    for i, size in enumerate(sizes):
        name = f"i{i:05d}"
        folder = root / name
        folder.mkdir(parents=True)
        split = rng.randrange(1, size) if size > 1 and rng.random() < 0.5 else size
        for rel, part in (("a.bin", split), ("b.bin", size - split)):
            if part:
                (folder / rel).write_bytes(content(name, rel, part))
        names.append(name)
    return names


def check_item(taken: Any, name: str) -> str | None:
    """None if the item handed out is ``name`` with every byte of its files, else what is wrong."""
    if taken.item.name != name:
        return f"got {taken.item.name}, expected {name}"
    for rel in taken.item.files:
        data = (taken.item.path / rel).read_bytes()
        if data != content(name, rel, len(data)):
            return f"{name}/{rel}: wrong bytes"
    return None


# ---- one seed ------------------------------------------------------------------------
@dataclass
class Setup:
    """What a seed runs: the node's lanes, the items, the plan options and the capacity."""

    ranks: list[int]
    world_size: int
    num_workers: int
    sizes: list[int]
    options: dict[str, Any]  # the plan's
    retain: str
    capacity: int = 0  # set by :func:`size_capacity` once the source is made
    lanes: list[tuple[int, int]] = field(default_factory=list)
    factor: int = 0  # roomy: largest items per lane


def plan_of(setup: Setup, rank: int, worker: int) -> Plan:
    return Plan(
        setup.sizes, rank=rank, world_size=setup.world_size, worker=worker, num_workers=setup.num_workers, **setup.options
    )


def choose(mode: str, rng: random.Random) -> Setup:
    """The seed's node, items, plan options and capacity for ``mode``."""
    if mode == "hazard":
        count = 2 * rng.randint(6, 16)
        # balance="count", no shuffle: item i goes to rank i % 2, so rank 0's items are the large ones
        sizes = [rng.randint(16 * KIB, 64 * KIB) if i % 2 == 0 else rng.randint(KIB, 8 * KIB) for i in range(count)]
        options = {"epochs": rng.randint(1, 2), "shuffle": False, "balance": "count"}
        setup = Setup([0, 1], 2, 1, sizes, options, rng.choice(["none", "auto"]))
    else:
        if mode == "tiny":
            lanes = rng.randint(6, 8)
            workers = rng.choice([w for w in (1, 2, 3, 4) if lanes % w == 0])
            node_ranks = lanes // workers
        else:
            workers = rng.randint(1, 3)
            node_ranks = rng.randint(1, max(1, 8 // workers))
        world = rng.randint(node_ranks, node_ranks + 2)
        first = rng.randint(0, world - node_ranks)
        count = rng.randint(min(2 * world * workers, 40), 40)
        sizes = [rng.choice([rng.randint(100, 2 * KIB), rng.randint(2 * KIB, 32 * KIB)]) for _ in range(count)]
        options = {
            "epochs": rng.randint(1, 3),
            "shuffle": rng.random() < 0.7,
            "seed": rng.randrange(1000),
            "balance": rng.choice(["bytes", "count"]),
            "partition": rng.choice(["epoch", "fixed"]),
        }
        setup = Setup(list(range(first, first + node_ranks)), world, workers, sizes, options, rng.choice(["none", "auto"]))
    setup.lanes = [(r, k) for r in setup.ranks for k in range(setup.num_workers)]
    if mode == "roomy":
        setup.factor = rng.randint(3, 6)
    elif mode == "hazard":
        assert all(sizes[s.item] >= 16 * KIB for s in plan_of(setup, 0, 0)), "rank 0's items are the large ones"
    return setup


def size_capacity(mode: str, setup: Setup, charges: list[int], state: int) -> None:
    """Set ``setup.capacity`` for ``mode`` (see the module notes) from what each item takes on the
    disk as the capacity counts it (``charges``) and what the cache counts for its state."""
    largest = {lane: max((charges[s.item] for s in plan_of(setup, *lane)), default=0) for lane in setup.lanes}
    if mode == "roomy":
        setup.capacity = setup.factor * max(largest.values()) * len(setup.lanes) + state
    elif mode == "tiny":
        setup.capacity = 2 * max(charges) + state
    elif mode == "hazard":
        setup.capacity = largest[(0, 0)] + largest[(1, 0)] + state
    else:
        setup.capacity = sum(largest.values()) + state


def charges_of(source: Path, names: list[str], block: int) -> list[int]:
    """What each item folder under ``source`` takes in a cache of ``block`` -byte blocks, as its
    capacity counts it (:meth:`Cache.charge`: its files in whole blocks, its folder)."""
    return [footprint((f.stat().st_size for f in (source / name).iterdir()), 1, block) for name in names]


def state_of(source: Path, probe: Path) -> int:
    """What a node's cache over ``source`` counts for its own state (its state files and the
    journal's budget; the lock file's ``"pid host"`` is this process's, as the seed's): the
    capacity less the largest item a probe cache at ``probe`` takes."""
    capacity = 1 << 30
    with NodePipeline(str(source), probe, capacity, ranks=[0], world_size=1) as pipe:
        state = capacity - pipe._cache.limit  # noqa: SLF001 - the limit OversizeError checks; not in Stats
    shutil.rmtree(probe, ignore_errors=True)
    return state


class Aborted(Exception):
    """The seed is over (a lane hung or failed): a consumer stops."""


class Lanes:
    """What the consumer threads share: positions (for the hazard's lockstep), the abort, results."""

    def __init__(self, setup: Setup, timeout: float) -> None:
        self.setup, self.timeout = setup, timeout
        self.cond = threading.Condition()
        self.position = dict.fromkeys(setup.lanes, -1)  # ordinal of the position each lane took last
        self.finished: set[tuple[int, int]] = set()
        self.abort = threading.Event()
        self.hung: list[str] = []
        self.wrong: list[str] = []
        self.errors: list[str] = []
        self.longest = 0.0
        self.steps = 0
        self.step_bytes = 0
        self.restarts = 0

    def took(self, lane: tuple[int, int], ordinal: int, waited: float, size: int) -> None:
        with self.cond:
            self.position[lane] = ordinal
            self.longest = max(self.longest, waited)
            self.steps += 1
            self.step_bytes += size
            self.cond.notify_all()

    def done(self, lane: tuple[int, int]) -> None:
        with self.cond:
            self.finished.add(lane)
            self.cond.notify_all()

    def wait_for(self, other: tuple[int, int], ordinal: int) -> None:
        """Wait until lane ``other`` took position ``ordinal`` or later, or finished (a collective)."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: self.abort.is_set() or other in self.finished or self.position[other] >= ordinal, self.timeout + 5
            )
        if self.abort.is_set():
            raise Aborted
        if not ok:
            self.fail(self.errors, f"lane {other} did not reach step {ordinal} within {self.timeout + 5:g} s (no take hung)")
            raise Aborted

    def fail(self, where: list[str], message: str) -> None:
        with self.cond:
            where.append(message)
            self.abort.set()
            self.cond.notify_all()


def consumer(pipe: NodePipeline, shared: Lanes, lane: tuple[int, int], names: list[str], mode: str, seed: int) -> None:
    """Walk lane ``(rank, worker)`` to its end with random holds, pauses and restarts."""
    rank, worker = lane
    rng = random.Random(f"{seed}/{rank}.{worker}")
    order = [Cursor(s.epoch, s.index) for s in plan_of(shared.setup, rank, worker)]
    expected = {c: names[s.item] for c, s in zip(order, plan_of(shared.setup, rank, worker), strict=True)}
    sizes = {c: shared.setup.sizes[s.item] for c, s in zip(order, plan_of(shared.setup, rank, worker), strict=True)}
    ordinal = {c: i for i, c in enumerate(order)}
    hazard = mode == "hazard"
    restarts_left = (rng.randint(1, 4) if rank == 1 else 0) if hazard else rng.randint(0, 3)
    restart_p = 0.25 if hazard else 0.05
    hold_p, pause_p = (0.0, 0.1) if hazard else (0.15, 0.15)
    cursor, taken_at = Cursor(0, 0), []
    try:
        while not shared.abort.is_set():
            start = time.monotonic()
            try:
                taken = pipe.take(rank, worker, cursor, timeout=shared.timeout)
            except TimeoutError:
                shared.fail(shared.hung, f"lane {rank}.{worker} at {tuple(cursor)}: no item within {shared.timeout:g} s")
                return
            waited = time.monotonic() - start
            if taken is None:
                if cursor in ordinal:
                    shared.fail(shared.wrong, f"lane {rank}.{worker} at {tuple(cursor)}: the end, expected {expected[cursor]}")
                break
            if taken.cursor != cursor or taken.cursor not in expected:
                shared.fail(shared.wrong, f"lane {rank}.{worker}: asked {tuple(cursor)}, handed {tuple(taken.cursor)}")
                return
            wrong = check_item(taken, expected[cursor])
            if wrong is not None:
                shared.fail(shared.wrong, f"lane {rank}.{worker} at {tuple(cursor)}: {wrong}")
                return
            shared.took(lane, ordinal[cursor], waited, sizes[cursor])
            taken_at.append(cursor)
            if hazard and rank == 0:
                shared.wait_for((1, 0), ordinal[cursor])  # holds its item until rank 1 has taken this step
            elif rng.random() < hold_p:
                time.sleep(rng.uniform(0, 0.3))  # holds its item while it pauses
            if restarts_left and len(taken_at) > 1 and rng.random() < restart_p:
                restarts_left -= 1
                with shared.cond:
                    shared.restarts += 1
                cursor = rng.choice(taken_at[:-1])  # a checkpoint taken earlier: the lane moves back there
                continue
            pipe.consume(rank, worker, taken.after)
            cursor = taken.after
            if hazard and rank == 1 and cursor in ordinal:
                shared.wait_for((0, 0), ordinal[cursor] - 1)  # steps together with rank 0, holding nothing
            elif rng.random() < pause_p:
                time.sleep(rng.uniform(0, 0.3))
    except Aborted:
        return
    except RuntimeError as exc:
        if not shared.abort.is_set():  # closed after another lane hung: expected then
            shared.fail(shared.errors, f"lane {rank}.{worker}: {exc!r}")
        return
    except Exception as exc:  # noqa: BLE001 - any failure of a lane is a finding of the seed
        shared.fail(shared.errors, f"lane {rank}.{worker}: {exc!r}")
        return
    shared.done(lane)


def run_seed(mode: str, seed: int, timeout: float) -> dict[str, Any]:
    rng = random.Random(f"{mode}/{seed}")
    setup = choose(mode, rng)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stress-node-") as tmp:
        source = Path(tmp, "source")
        names = make_source(source, setup.sizes, rng)
        block = clamp_block(os.statvfs(tmp).f_frsize)  # the cache's filesystem: the caches are under tmp
        size_capacity(mode, setup, charges_of(source, names, block), state_of(source, Path(tmp, "probe")))
        cache = Path(tmp, "cache")
        shared = Lanes(setup, timeout)
        pipe = NodePipeline(
            str(Path(tmp, "source")), cache, f"{setup.capacity}B", ranks=setup.ranks, world_size=setup.world_size,
            num_workers=setup.num_workers, retain=setup.retain, **setup.options,
        )  # fmt: skip
        downloaded = 0
        with PeakSampler(cache, interval=0.002, block=block) as peak:
            try:
                pipe.open()
                threads = [
                    threading.Thread(target=consumer, args=(pipe, shared, lane, names, mode, seed), name=f"lane-{lane}")
                    for lane in setup.lanes
                ]
                for t in threads:
                    t.start()
                while any(t.is_alive() for t in threads) and not shared.abort.wait(0.05):
                    pass
                downloaded = pipe.stats().bytes_downloaded
            except Exception as exc:  # noqa: BLE001 - a pipeline that refuses the seed is a finding
                shared.fail(shared.errors, f"open: {exc!r}")
                threads = []
            finally:
                pipe.close()  # ends every take still waiting (a hung seed)
            for t in threads:
                t.join(10)
            if any(t.is_alive() for t in threads):
                shared.errors.append("a lane thread did not end within 10 s of close()")
    return {
        "seed": seed,
        "lanes": len(setup.lanes),
        "ranks": setup.ranks,
        "world_size": setup.world_size,
        "num_workers": setup.num_workers,
        "items": len(setup.sizes),
        "options": {**setup.options, "retain": setup.retain},
        "capacity": setup.capacity,
        "peak": peak.peak,
        "samples": peak.samples,
        "over_capacity": peak.peak > setup.capacity,
        "hung": shared.hung,
        "stalled": not shared.hung and shared.longest > STALL,
        "longest_take_s": round(shared.longest, 3),
        "wrong": shared.wrong,
        "errors": shared.errors,
        "steps": shared.steps,
        "restarts": shared.restarts,
        "bytes_downloaded": downloaded,
        "step_bytes": shared.step_bytes,
        "seconds": round(time.monotonic() - started, 2),
    }


# ---- report --------------------------------------------------------------------------
def summary(mode: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    read = sum(r["bytes_downloaded"] for r in rows)
    stepped = sum(r["step_bytes"] for r in rows)
    return {
        "mode": mode,
        "seeds": len(rows),
        "hung": sum(bool(r["hung"]) for r in rows),
        "stalled": sum(r["stalled"] for r in rows),
        "wrong": sum(bool(r["wrong"]) for r in rows),
        "over_capacity": sum(r["over_capacity"] for r in rows),
        "errors": sum(bool(r["errors"]) for r in rows),
        "bytes_downloaded": read,
        "reads": round(read / stepped, 3) if stepped else None,
        "steps": sum(r["steps"] for r in rows),
        "restarts": sum(r["restarts"] for r in rows),
        "hung_seeds": [r["seed"] for r in rows if r["hung"]],
        "stalled_seeds": [r["seed"] for r in rows if r["stalled"]],
        "seconds": round(sum(r["seconds"] for r in rows), 1),
    }


def render(report: dict[str, Any]) -> str:
    cols = ["mode", "seeds", "hung", "stalled", "wrong", "over cap", "errors", "read MB", "reads", "steps", "restarts", "s"]
    s = report["summary"]
    row = [
        s["mode"], str(s["seeds"]), str(s["hung"]), str(s["stalled"]), str(s["wrong"]), str(s["over_capacity"]),
        str(s["errors"]), f"{s['bytes_downloaded'] / 1e6:.1f}", "-" if s["reads"] is None else f"{s['reads']:.2f}x",
        str(s["steps"]), str(s["restarts"]), f"{s['seconds']:.0f}",
    ]  # fmt: skip
    lines = [
        *format_table(cols, [row], left=0),
        f"hung seeds: {s['hung_seeds'] or '-'}; stalled seeds (a take waited > {STALL:g} s): {s['stalled_seeds'] or '-'}",
    ]
    return "\n".join([*lines, *seeds_footer(report, ("hung", "wrong", "errors"))])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default="hazard", help="the scenario (default hazard; see the module notes)")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 30], metavar=("FROM", "TO"), help="seeds FROM..TO-1 (default 0 30)")
    p.add_argument("--timeout", type=float, default=22.0, help="a take waiting this long hung (default 22 s)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if args.seeds[0] >= args.seeds[1]:
        p.error(f"--seeds {args.seeds[0]} {args.seeds[1]}: expected FROM < TO")
    rows = []
    for seed in range(*args.seeds):
        row = run_seed(args.mode, seed, args.timeout)
        state = "HUNG" if row["hung"] else "stalled" if row["stalled"] else "ok"
        if row["wrong"] or row["errors"] or row["over_capacity"]:
            state += " FAILED"
        print(
            f"{args.mode} seed {seed}: {state}, {row['lanes']} lanes, {row['steps']} steps, "
            f"longest take {row['longest_take_s']:.1f} s, {row['seconds']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    print_seeds_report(tree(), args.timeout, summary(args.mode, rows), rows, render, args.json)
    return 1 if any(r["wrong"] or r["errors"] or r["over_capacity"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
