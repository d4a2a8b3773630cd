"""Retention through the real Pipeline: bytes downloaded over shuffled epochs, retain="auto" vs "none".

The data lives in fsspec's memory:// store (no server: what is measured is the cache's
decisions, not the link). The same plan is replayed offline by the pure simulator for the
Belady minimum, so the ratio auto/MIN is the cache's overhead over the optimum.

    .venv/bin/python benchmarks/bench_retain_pipeline.py [--items 200] [--epochs 3] [--share 0.5]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile

import fsspec

from cachepipe import Pipeline
from cachepipe.plan import Plan
from cachepipe.retention import belady_min


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--size", type=int, default=4096, help="bytes per item (equal sizes: MIN is optimal)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--share", type=float, default=0.5, help="cache capacity as a share of the data")
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()

    fs = fsspec.filesystem("memory")
    for i in range(args.items):
        fs.pipe_file(f"/bench-retain/item{i:05d}/f", bytes(args.size))
    data = args.items * args.size
    room = int(data * args.share)
    rows = []
    for retain in ("none", "auto"):
        with tempfile.TemporaryDirectory() as tmp:
            # the state budget (journal) is measured first, so that items get exactly `room` bytes
            probe = Pipeline("memory://bench-retain", f"{tmp}/probe", 1 << 40, rank=0, world_size=1).open()
            overhead = probe.stats().bytes_in_cache
            probe.close()
            with Pipeline(
                "memory://bench-retain",
                f"{tmp}/c",
                room + overhead,
                epochs=args.epochs,
                shuffle=True,
                seed=args.seed,
                rank=0,
                world_size=1,
                retain=retain,
            ) as pipe:
                for _ in pipe:
                    pass
                rows.append((retain, pipe.stats().bytes_downloaded))
    plan = Plan([args.size] * args.items, epochs=args.epochs, shuffle=True, seed=args.seed, rank=0, world_size=1)
    sequence = [step.item for step in plan]
    minimum = belady_min(sequence, [args.size] * args.items, room)
    rows.append(("MIN (offline, same plan)", minimum))
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"{args.items} items x {args.size} B, {args.epochs} shuffled epochs, capacity {args.share:.0%} of the data")
    print(f"{'policy':<26}{'bytes downloaded':>18}{'x data':>9}{'vs MIN':>9}")
    for name, nbytes in rows:
        print(f"{name:<26}{nbytes:>18}{nbytes / data:>9.3f}{nbytes / minimum:>9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
