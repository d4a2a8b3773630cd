"""Benchmark: bytes downloaded over shuffled epochs by each retention policy (pure simulation).

Each case builds a :class:`cachepipe.plan.Plan` (seeded shuffle, several epochs), takes the
access sequence of one rank, and replays it through a cache of a given capacity with
:func:`cachepipe.retention.run`: the fetcher runs as far ahead as the capacity allows (a fast
network, the worst case for retention), and the consumer acknowledges in order. Rows:

- ``auto``: online Belady exactly as the cache would run it: next uses from the plan
  (:class:`~cachepipe.retention.PlanFuture`, ``--horizon`` epochs ahead), prefetch waits while
  a pinned item is the better victim, ``reserve=0``;
- ``auto+reserve``: the same, keeping ``--reserve-items`` items' worth of bytes for prefetching;
- ``lru``, ``none``: for comparison;
- ``MIN``: offline Belady on the same sequence without prefetch (with equal sizes: the minimum
  any cache of this capacity can reach; with variable sizes: MIN's heuristic, the optimum being
  NP-hard); ``compulsory``: each distinct item once (a lower bound for any cache).

"data" is the bytes the rank reads per epoch; capacities are shares of it. Columns: total bytes
downloaded as a multiple of the data, the ratio to MIN, bytes downloaded in epochs 2 and 3 (as
multiples of the data), and the lead of the downloads of epochs 2+: how many
steps ahead of the consumer each started (p10 / median; 0 means the consumer waited for the
whole download).

Usage::

    .venv/bin/python benchmarks/bench_retention.py               # ~10 s
    .venv/bin/python benchmarks/bench_retention.py --items 5000 --seed 3 --json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command_line, print_report

from cachepipe.plan import Plan
from cachepipe.retention import PlanFuture, belady_min, compulsory_bytes, make_policy, run

MiB = 2**20


@dataclass
class Case:
    name: str
    sizes: list[int]
    capacity_share: float
    world_size: int = 1
    partition: str = "epoch"


def build_cases(args: argparse.Namespace) -> list[Case]:
    rng = random.Random(args.seed)
    n = args.items
    equal = [MiB] * n
    variable = [max(1, int(rng.lognormvariate(0, 1) * MiB)) for _ in range(n)]  # median 1 MiB, heavy tail
    return [
        Case("equal sizes, capacity 50%", equal, 0.5),
        Case("variable sizes, capacity 50%", variable, 0.5),
        Case("equal sizes, data fits (100%)", equal, 1.0),
        Case("equal, rank 0 of 4, reshard every epoch, capacity 50%", equal, 0.5, 4, "epoch"),
        Case("equal, rank 0 of 4, partition=fixed, capacity 50%", equal, 0.5, 4, "fixed"),
    ]


def measure(case: Case, args: argparse.Namespace) -> dict:
    plan = Plan(
        case.sizes, epochs=args.epochs, shuffle=True, seed=args.seed, rank=0, world_size=case.world_size, partition=case.partition
    )  # type: ignore[arg-type]
    steps = list(plan)
    seq = [s.item for s in steps]
    ticks = [s.tick for s in steps]
    sizes = plan.sizes
    share_bytes = sum(sizes[x] for x in seq) // args.epochs  # bytes this rank reads per epoch
    capacity = max(int(share_bytes * case.capacity_share), *(sizes[x] for x in seq))
    epoch_of = [s.epoch for s in steps]
    reserve = args.reserve_items * max(sizes[x] for x in seq)
    rows = []
    optimum = belady_min(seq, sizes, capacity)
    for label, name, res in [
        ("auto", "auto", 0),
        (f"auto+reserve {args.reserve_items}", "auto", reserve),
        ("lru", "lru", 0),
        ("none", "none", 0),
    ]:
        t0 = time.perf_counter()
        policy = make_policy(name, sizes, PlanFuture(plan, horizon=args.horizon), reserve=res)  # type: ignore[arg-type]
        result = run(policy, seq, sizes, capacity, ticks=ticks)
        seconds = time.perf_counter() - t0
        per_epoch = [0] * args.epochs
        for i, b in enumerate(result.per_step):
            per_epoch[epoch_of[i]] += b
        leads = sorted(result.lead[i] for i in range(len(seq)) if epoch_of[i] >= 1 and result.lead[i] >= 0)
        rows.append(
            {
                "policy": label,
                "bytes": result.bytes,
                "x_data": result.bytes / share_bytes,
                "vs_min": result.bytes / optimum,
                "epochs_x_data": [b / share_bytes for b in per_epoch],
                "lead_p10": leads[len(leads) // 10] if leads else None,
                "lead_median": statistics.median(leads) if leads else None,
                "us_per_step": seconds / len(seq) * 1e6,
            }
        )
    rows.append({"policy": "MIN (offline)", "bytes": optimum, "x_data": optimum / share_bytes, "vs_min": 1.0})
    low = compulsory_bytes(seq, sizes)
    rows.append({"policy": "compulsory", "bytes": low, "x_data": low / share_bytes, "vs_min": low / optimum})
    return {
        "case": case.name,
        "items_read": len(seq),
        "data_bytes": share_bytes,
        "capacity": capacity,
        "reserve_bytes": reserve,
        "rows": rows,
    }


def render(report: dict) -> str:
    lines = [f"$ {report['command']}", ""]
    head = f"{'policy':<20} {'bytes/data':>10} {'vs MIN':>8} {'epoch 2':>8} {'epoch 3':>8} {'lead p10':>9} {'lead med':>9} {'us/step':>8}"  # noqa: E501 - kept whole
    for case in report["cases"]:
        lines.append(
            f"## {case['case']}: {case['items_read']} reads, data {case['data_bytes'] / MiB:.0f} MiB/epoch, capacity {case['capacity'] / MiB:.0f} MiB"  # noqa: E501 - kept whole
        )
        lines.append(head)
        for r in case["rows"]:
            ep = r.get("epochs_x_data", [])
            cells = [f"{ep[i]:.3f}" if len(ep) > i else "" for i in (1, 2)]
            lead = [f"{r[k]:.0f}" if r.get(k) is not None else "" for k in ("lead_p10", "lead_median")]
            us = f"{r['us_per_step']:.1f}" if "us_per_step" in r else ""
            lines.append(
                f"{r['policy']:<20} {r['x_data']:>10.3f} {r['vs_min']:>8.4f} {cells[0]:>8} {cells[1]:>8} {lead[0]:>9} {lead[1]:>9} {us:>8}"  # noqa: E501 - kept whole
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--items", type=int, default=1000, help="catalog items (default 1000)")
    p.add_argument("--epochs", type=int, default=3, help="epochs (default 3)")
    p.add_argument("--seed", type=int, default=0, help="plan and size seed (default 0)")
    p.add_argument(
        "--reserve-items", type=int, default=16, help="prefetch reserve of the second auto row, in largest items (default 16)"
    )
    p.add_argument("--horizon", type=int, default=2, help="epochs of next uses the online policy sees (default 2)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    report = {
        "command": command_line(),
        "cases": [measure(case, args) for case in build_cases(args)],
    }
    report["total_seconds"] = time.perf_counter() - t0
    print_report(report, render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
