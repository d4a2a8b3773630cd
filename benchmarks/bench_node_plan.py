"""Time and memory of a node's plan (``cachepipe.lanes.NodePlan``) over 1,000,000 items: 8
ranks x 8 DataLoader workers (64 lanes) of a 64-rank job, 3 shuffled epochs, both partitions.
No network. Run each partition in a fresh process for its own peak RSS::

    PYTHONPATH=. .venv/bin/python benchmarks/bench_node_plan.py [--items N]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from cachepipe.lanes import NodePlan


def measure(n: int, partition: str) -> dict[str, float]:
    sizes = [1000 + (i * 7919) % 1000 for i in range(n)]
    t = time.perf_counter()
    plan = NodePlan(
        sizes, ranks=list(range(8)), world_size=64, num_workers=8, epochs=3, shuffle=True, seed=1, partition=partition
    )
    plan.share(0)
    first = time.perf_counter() - t
    t = time.perf_counter()
    plan.share(1)
    nxt = time.perf_counter() - t
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"first_epoch_s": first, "next_epoch_s": nxt, "node_items": len(plan.share(0)), "peak_rss_mib": rss}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=1_000_000)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.items, args.child)))
        return
    print(f"NodePlan: {args.items:,} items, 64 lanes (8 ranks x 8 workers) of a 64-rank job, shuffled")
    print(f"{'partition':<10} {'1st epoch s':>12} {'next epoch s':>13} {'node items':>11} {'peak RSS MiB':>13}")
    for partition in ("epoch", "fixed"):
        out = subprocess.run(
            [sys.executable, __file__, "--items", str(args.items), "--child", partition],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout)
        times = f"{r['first_epoch_s']:>12.1f} {r['next_epoch_s']:>13.1f}"
        print(f"{partition:<10} {times} {r['node_items']:>11,} {r['peak_rss_mib']:>13.0f}")


if __name__ == "__main__":
    main()
