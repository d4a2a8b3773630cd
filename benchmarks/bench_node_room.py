"""Benchmark: how a node's lanes share a tight cache (issue #17's node mode; session s31).

Two scenarios over a ``memory://`` source, in one process, threads as consumers:

- ``lockstep``: RANKS ranks without DataLoader workers that step together (one collective per
  step, as DDP's all-reduce): each holds the item it trains on until every rank has its next.
  A rank whose share ends leaves the collective. Reports how many runs (seeds) hung: a lane
  that waited ``--timeout`` s for its item. Before items planned ahead were given back
  (``NodePipeline(give_back_after=...)``, default ``cachepipe.node.GIVE_BACK_AFTER``), the
  planner could fill the room ahead for a rank that waited for another, and every run hung.
- ``pace``: two lanes that consume each item once read, at different paces (``--paces``), and
  GETs that take ``--delay`` s. Reports the data downloaded over the data planned and the wall
  time, for each ``--give-back-after`` value, interleaved: giving back after a short wait
  treats a slow lane as stopped and downloads its items again.

Run against another tree with ``PYTHONPATH=TREE``; ``--give-back-after`` needs a tree that has
the setting (the ``give_back_after`` argument, or before it the module's ``GIVE_BACK_AFTER``;
it is skipped otherwise)::

    python benchmarks/bench_node_room.py                     # both scenarios
    python benchmarks/bench_node_room.py --scenarios pace --give-back-after 5 0
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import statistics
import tempfile
import threading
import time
from collections import Counter
from typing import Any

import fsspec

import cachepipe.node
from cachepipe.node import NodePipeline
from cachepipe.plan import Cursor
from cachepipe.stores import open_store


def _memory_source(name: str, sizes: list[int]) -> str:
    fs = fsspec.filesystem("memory")
    fs.store.clear()
    fs.pseudo_dirs[:] = [""]
    for i, size in enumerate(sizes):
        fs.pipe_file(f"/{name}/{i:05d}/f", b"x" * size)
    return f"memory://{name}"


class _Step:
    """A collective per step; a rank whose share is read leaves it."""

    def __init__(self, parties: int, timeout: float) -> None:
        self._cond, self._parties, self._timeout = threading.Condition(), parties, timeout
        self._arrived, self._round, self.broken = 0, 0, False

    def wait(self) -> None:
        with self._cond:
            round_ = self._round
            self._arrived += 1
            self._advance()
            if not self._cond.wait_for(lambda: self._round != round_ or self.broken, self._timeout) or self.broken:
                self.break_()
                raise TimeoutError("a rank did not reach the step")

    def leave(self) -> None:
        with self._cond:
            self._parties -= 1
            self._advance()

    def break_(self) -> None:
        with self._cond:
            self.broken = True
            self._cond.notify_all()

    def _advance(self) -> None:
        if self._arrived and self._arrived >= self._parties:
            self._arrived, self._round = 0, self._round + 1
            self._cond.notify_all()


def taken(size: float, cache: str) -> int:
    """What an item of one file of ``size`` bytes takes in the cache at ``cache``, as the cap
    counts it (since 2026-12-01): its file in whole blocks of the filesystem and a block for its
    folder (the block read as cachepipe reads it, held to 512 B..64 KiB). A tree of before counts
    ``size``: the same capacity holds a few more of its items."""
    block = min(max(os.statvfs(cache).f_frsize, 512), 64 * 1024)
    return -(-int(size) // block) * block + block


def lockstep(ranks: int, items: int, size: int, room: float, seed: int, timeout: float, retain: str) -> bool:
    """One run: True if every rank read its whole share (3 shuffled epochs), False if one hung.
    Items are ``size``..``2*size`` bytes; the capacity is ``room`` items of ``1.5*size``, as they
    take the disk (:func:`taken`)."""
    rng = random.Random(seed)
    url = _memory_source("lockstep", [size + rng.randrange(size) for _ in range(items)])
    with tempfile.TemporaryDirectory() as cache:
        pipe = NodePipeline(
            url, cache, f"{int(room * taken(1.5 * size, cache))}B", ranks=list(range(ranks)), world_size=ranks,
            epochs=3, shuffle=True, seed=seed, retain=retain,
        )  # fmt: skip
        step, errors = _Step(ranks, timeout + 5), []

        def rank(r: int) -> None:
            cursor = Cursor(0, 0)
            try:
                while (taken := pipe.take(r, 0, cursor, timeout=timeout)) is not None:
                    (taken.item.path / "f").read_bytes()
                    cursor = taken.after
                    step.wait()  # the item stays in hand until every rank has its next
                step.leave()
            except Exception as exc:  # noqa: BLE001 - a hung run is the measurement
                errors.append(exc)
                step.break_()

        with pipe:
            threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    return not errors


class _Slow:
    """A store whose GETs take ``delay`` seconds."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.url, self.delay, self.gets = inner, inner.url, delay, Counter()

    def list(self) -> Any:
        return self.inner.list()

    def get(self, key: str, out: Any, start: int, end: int, *, etag: str | None = None) -> Any:
        self.gets[key] += 1
        time.sleep(self.delay)
        return self.inner.get(key, out, start, end)

    def close(self) -> None:
        self.inner.close()


def pace(
    items: int, size: int, room: int, paces: list[float], delay: float, give_back_after: float | None = None
) -> tuple[float, float]:
    """One run: (downloaded over planned, wall seconds) for lanes at ``paces`` s per item;
    ``give_back_after``: the node's setting (None: the tree's default)."""
    url = _memory_source("pace", [size] * items)
    store = _Slow(open_store(url), delay)
    setting: dict[str, Any] = {}
    if give_back_after is not None:
        if "give_back_after" in inspect.signature(NodePipeline).parameters:
            setting["give_back_after"] = give_back_after
        else:  # a tree from before the argument: its module constant
            cachepipe.node.GIVE_BACK_AFTER = give_back_after
    with tempfile.TemporaryDirectory() as cache:
        pipe = NodePipeline(
            url,
            cache,
            f"{room * taken(size, cache)}B",
            ranks=list(range(len(paces))),
            world_size=len(paces),
            store=store,
            **setting,
        )

        def lane(r: int) -> None:
            cursor = Cursor(0, 0)
            while (taken := pipe.take(r, 0, cursor, timeout=120)) is not None:
                (taken.item.path / "f").read_bytes()
                cursor = taken.after
                pipe.consume(r, 0, cursor)
                time.sleep(paces[r])

        start = time.monotonic()
        with pipe:
            threads = [threading.Thread(target=lane, args=(r,)) for r in range(len(paces))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            downloaded = pipe.stats().bytes_downloaded
        return downloaded / (items * size), time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", default="lockstep,pace", help="comma-separated (default lockstep,pace)")
    parser.add_argument("--ranks", type=int, default=4, help="lockstep: ranks (default 4)")
    parser.add_argument("--room", type=float, default=5.3, help="lockstep: capacity in average items (default 5.3)")
    parser.add_argument("--seeds", type=int, default=6, help="lockstep: runs, one per seed (default 6)")
    parser.add_argument("--timeout", type=float, default=20.0, help="lockstep: a lane waiting this long hung (default 20 s)")
    parser.add_argument("--paces", type=float, nargs="+", default=[0.5, 3.0], help="pace: seconds per item of each lane")
    parser.add_argument("--delay", type=float, default=1.2, help="pace: seconds per GET (default 1.2)")
    parser.add_argument("--repeats", type=int, default=1, help="pace: interleaved runs per setting (default 1)")
    parser.add_argument(
        "--give-back-after",
        type=float,
        nargs="+",
        default=None,
        help="pace: give_back_after values to compare, in seconds (default: the tree's)",
    )
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    has_setting = hasattr(cachepipe.node, "GIVE_BACK_AFTER")
    if "lockstep" in scenarios:
        for retain in ("none", "auto"):
            t = time.monotonic()
            ok = [lockstep(args.ranks, 40, 100_000, args.room, seed, args.timeout, retain) for seed in range(args.seeds)]
            print(
                f"lockstep  {args.ranks} ranks, room {args.room} items, retain={retain}: "
                f"hung {ok.count(False)} of {len(ok)} runs ({time.monotonic() - t:.1f} s)",
                flush=True,
            )
    if "pace" in scenarios:
        settings = args.give_back_after if args.give_back_after and has_setting else [None]
        if args.give_back_after and not has_setting:
            print("pace: this tree has no GIVE_BACK_AFTER; its own behaviour is measured")
        results: dict[float | None, list[tuple[float, float]]] = {s: [] for s in settings}
        for _ in range(args.repeats):
            for setting in settings:
                results[setting].append(pace(24, 100_000, 2, args.paces, args.delay, setting))
        for setting, runs in results.items():
            label = "tree's" if setting is None else f"{setting:g} s"
            print(
                f"pace      lanes at {args.paces} s/item, GETs {args.delay} s, room 2 items, 24 items, give back after "
                f"{label}: downloaded {statistics.median(r[0] for r in runs):.2f}x, "
                f"wall {statistics.median(r[1] for r in runs):.1f} s (median of {len(runs)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
