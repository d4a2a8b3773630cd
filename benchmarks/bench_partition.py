"""Benchmark: bytes downloaded by all ranks, partition="epoch" against "fixed" (pure simulation).

Each rank of ``--ranks`` builds its :class:`cachepipe.plan.Plan` (seeded shuffle, ``--epochs``
epochs) and replays its access sequence through its own node cache with
:func:`cachepipe.retention.run`, run by the policy ``retain="auto"`` runs (online Belady, next
uses from the plan with :class:`~cachepipe.retention.PlanFuture`, ``--horizon`` epochs ahead).
The fetcher runs as far ahead as the capacity allows; the consumer acknowledges in order.

The node capacity is a share of a node's part of the data, ``data / ranks``, plus the largest
item (a bytes-balanced share may exceed ``data / ranks`` by up to one item): "100%" is a cache
that holds the node's share. (``retain="none"`` downloads every read: 3.000x over 3 epochs,
whatever the partition.) Printed: bytes downloaded by all ranks over all epochs, as a multiple of the data
(1.000 = every item once, the compulsory minimum), and per epoch.

Usage::

    .venv/bin/python benchmarks/bench_partition.py               # ~10 s
    .venv/bin/python benchmarks/bench_partition.py --items 4000 --json
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command_line, print_report

from cachepipe.plan import Plan
from cachepipe.retention import PlanFuture, make_policy, run

MiB = 2**20


def datasets(args: argparse.Namespace) -> dict[str, list[int]]:
    rng = random.Random(args.seed)
    return {
        "equal sizes": [MiB] * args.items,
        "variable sizes": [max(1, int(rng.lognormvariate(0, 1) * MiB)) for _ in range(args.items)],  # median 1 MiB
    }


def downloads(sizes: list[int], partition: str, share: float, args: argparse.Namespace) -> list[int]:
    """Bytes all ranks download in each epoch."""
    per_epoch = [0] * args.epochs
    capacity = int(share * sum(sizes) / args.ranks) + max(sizes)
    for rank in range(args.ranks):
        plan = Plan(
            sizes,
            epochs=args.epochs,
            shuffle=True,
            seed=args.seed,
            rank=rank,
            world_size=args.ranks,
            partition=partition,  # type: ignore[arg-type]
        )
        steps = list(plan)
        policy = make_policy("auto", plan.sizes, PlanFuture(plan, horizon=args.horizon))  # type: ignore[arg-type]
        result = run(policy, [s.item for s in steps], plan.sizes, capacity, ticks=[s.tick for s in steps])
        for step, got in zip(steps, result.per_step, strict=True):
            per_epoch[step.epoch] += got
    return per_epoch


def measure(args: argparse.Namespace) -> list[dict]:
    rows = []
    for name, sizes in datasets(args).items():
        data = sum(sizes)
        for share in args.capacity:
            for partition in ("epoch", "fixed"):
                per_epoch = downloads(sizes, partition, share, args)
                rows.append(
                    {
                        "data": name,
                        "capacity": share,
                        "partition": partition,
                        "x_data": sum(per_epoch) / data,
                        "epochs_x_data": [b / data for b in per_epoch],
                    }
                )
    return rows


def render(report: dict) -> str:
    lines = [f"$ {report['command']}", ""]
    epochs = len(report["rows"][0]["epochs_x_data"])
    head = f"{'data':<15} {'node capacity':>13} {'partition':>9} {'bytes/data':>10}"
    head += "".join(f" {f'epoch {e + 1}':>8}" for e in range(epochs))
    lines += [head, "-" * len(head)]
    for r in report["rows"]:
        line = f"{r['data']:<15} {r['capacity']:>13.0%} {r['partition']:>9} {r['x_data']:>10.3f}"
        line += "".join(f" {x:>8.3f}" for x in r["epochs_x_data"])
        lines.append(line)
    lines.append("")
    lines.append(f"{report['ranks']} ranks x {report['epochs']} epochs, {report['items']} items")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1000, help="catalog items (default 1000)")
    p.add_argument("--ranks", type=int, default=4, help="ranks, one node cache each (default 4)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    p.add_argument(
        "--capacity", type=float, nargs="+", default=[0.5, 1.0], help="node capacities, shares of data/ranks (default 0.5 1.0)"
    )
    p.add_argument("--seed", type=int, default=0, help="plan and size seed (default 0)")
    p.add_argument("--horizon", type=int, default=2, help="epochs of next uses the policy sees (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(args)
    report = {"command": command_line(), "ranks": args.ranks, "epochs": args.epochs, "items": args.items, "rows": rows}
    report["total_seconds"] = time.perf_counter() - t0
    print_report(report, render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
