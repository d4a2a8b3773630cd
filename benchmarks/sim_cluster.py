"""Simulation: a cluster job past this machine, per-process mode against node mode (no network).

A job of ``--nodes`` nodes x ``--ranks`` ranks (GPUs) x ``--workers`` DataLoader workers over
``--items`` items, in two modes:

- *per-process*: every worker runs its own pipeline: it lists the whole source itself and has
  ``capacity / (ranks x workers)`` of the node's SSD as its cache (what exists today);
- *node*: the source is listed once per job into a manifest that every node fetches; one cache
  per node serves every rank and worker its plan share (the design of docs/architecture.md
  section 7; the node daemon's plan-share serving is NOT built yet).

Four sections, each saying what is computed, measured, sampled or scaled:

1. LIST requests at start (ListObjectsV2 returns at most 1,000 keys a request) and the manifest
   bytes every node fetches: counts are computed; the manifest's bytes per item are *measured*
   by writing a generated sample with cachepipe's own catalog writer
   (:func:`cachepipe.state.save_catalog`: gzip JSON lines ``[name, [[rel, size, etag], ...]]``).
2. GET requests/s against the source in steady state for ``--items-per-s`` per GPU, in total
   and per prefix, against S3's documented 5,500 GET/HEAD (3,500 PUT/COPY/POST/DELETE)
   requests/s per partitioned prefix: computed, for every mode's steady-state miss rate.
3. Cache hit rate across epochs, per-process against node mode, global shuffle against a
   node-local shuffle, at node capacity 50% and 100% of the node's share: *scaled* to
   ``--sim-nodes`` nodes x ``--ranks`` x ``--workers`` consumers over ``--sim-items`` equal-size
   items, shares from :mod:`cachepipe.plan` (checked against :class:`~cachepipe.plan.Plan`),
   replayed through :func:`cachepipe.retention.run` with Belady (``retain="auto"``, next uses
   from the plan), on a sample of nodes; plus the full-scale rate in closed form.
4. SlowDown: the retry schedule of :func:`cachepipe.backoff.backoff_delay` with the default
   ``retries``/``retry_backoff``/``retry_backoff_max``, and a Monte-Carlo (seeded, *sampled*)
   of every node's in-flight requests throttled at the same instant, retried with equal jitter
   against the same schedule without jitter: retries per 100 ms window.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/sim_cluster.py          # a few seconds
    PYTHONPATH=. .venv/bin/python benchmarks/sim_cluster.py --json
"""

from __future__ import annotations

import argparse
import inspect
import math
import random
import sys
import tempfile
import time
from array import array
from collections import Counter
from itertools import zip_longest
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import command_line, format_table, print_report

from cachepipe.backoff import backoff_delay
from cachepipe.catalog import Catalog
from cachepipe.config import PipelineConfig
from cachepipe.fetch_policy import MAX_PART
from cachepipe.plan import Plan, permutation, split
from cachepipe.retention import PlanFuture, run
from cachepipe.state import save_catalog

MB = 10**6
LIST_PAGE_KEYS = 1000  # ListObjectsV2 MaxKeys ceiling
S3_GET_PER_PREFIX = 5500  # GET/HEAD requests/s per partitioned prefix (S3 performance guidelines)
S3_PUT_PER_PREFIX = 3500  # PUT/COPY/POST/DELETE requests/s per partitioned prefix
BIN_S = 0.1  # Monte-Carlo histogram window
HORIZON = inspect.signature(PlanFuture).parameters["horizon"].default  # epochs of next uses the cache sees
DEFAULTS = {
    name: PipelineConfig.model_fields[name].default
    for name in ("retries", "retry_backoff", "retry_backoff_max", "max_large_requests")
} | {"part_size": MAX_PART}  # cachepipe's default part size for a node's cache (256 MiB and more)


# ---- 1. listing and manifest ---------------------------------------------------------
def manifest_bytes_per_item(sample: int, files_per_item: int, item_size: int, seed: int) -> dict[str, Any]:
    """Write ``sample`` generated items with cachepipe's catalog writer; measure the gzip bytes."""
    rng = random.Random(seed)
    catalog = Catalog(mode="folders" if files_per_item > 1 else "files")
    file_size = item_size // files_per_item
    for i in range(sample):
        files = [
            (
                "" if files_per_item == 1 else f"part-{j}.bin",
                max(1, int(rng.lognormvariate(0, 0.3) * file_size)),
                f"{rng.getrandbits(128):032x}",
            )
            for j in range(files_per_item)
        ]
        name = f"train/shard-{i // 10_000:05d}/sample-{i:09d}" + (".bin" if files_per_item == 1 else "")
        catalog.add(name, files)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog"
        save_catalog(path, "s3://bucket/train/", "folders" if files_per_item > 1 else "files", catalog)
        size = path.stat().st_size
    return {"sample_items": sample, "sample_bytes": size, "bytes_per_item": size / sample}


def listing(args: argparse.Namespace, per_item: float) -> dict[str, Any]:
    keys = args.items * args.files_per_item
    pages = max(1, math.ceil(keys / LIST_PAGE_KEYS))  # a whole listing (list_source) asks full pages from its first
    consumers = args.nodes * args.ranks * args.workers
    manifest = per_item * args.items
    manifest_gets = math.ceil(manifest / args.part_size)  # ranged GETs of part_size, as the fetcher splits files
    return {
        "keys": keys,
        "pages_per_listing": pages,
        "per_process": {"listings": consumers, "list_requests": consumers * pages, "manifest_bytes": 0, "manifest_gets": 0},
        "node": {
            "listings": 1,
            "list_requests": pages,
            "manifest_bytes_each": manifest,
            "manifest_bytes": manifest * args.nodes,
            "manifest_gets": manifest_gets * args.nodes,
        },
    }


# ---- 3. hit rates (scaled) -----------------------------------------------------------
class Shares:
    """Per-epoch shares of the scaled instance, from cachepipe.plan's own permutation and split
    (equal sizes: balance="bytes" walks round-robin, so "count" gives the same shares, faster)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.sizes = array("q", [1]) * n
        self._orders: dict[int, array[int]] = {}
        self._fixed: dict[tuple[int, int, int, int], bytearray] = {}
        self._ranks: dict[tuple[int, int, int, str], array[int]] = {}

    def order(self, epoch: int) -> array[int]:
        if epoch not in self._orders:
            self._orders[epoch] = permutation(self.n, self.seed, epoch)
        return self._orders[epoch]

    def share(self, epoch: int, world: int, rank: int, workers: int, worker: int, partition: str) -> array[int]:
        order = self.order(epoch)
        if partition == "fixed":  # Plan(partition="fixed"): the rank's and the worker's items are fixed for the run
            key = (world, rank, workers, worker)
            if key not in self._fixed:
                base = split(split(self.order(-1), self.sizes, world, rank, "count"), self.sizes, workers, worker, "count")
                mine = bytearray(self.n)
                for x in base:
                    mine[x] = 1
                self._fixed[key] = mine
            mine = self._fixed[key]
            return array("I", (x for x in order if mine[x]))
        rkey = (epoch, world, rank, partition)
        if rkey not in self._ranks:
            self._ranks[rkey] = split(order, self.sizes, world, rank, "count")
        return split(self._ranks[rkey], self.sizes, workers, worker, "count")

    def check(self, epochs: int, world: int, rank: int, workers: int, worker: int, partition: str) -> None:
        """The shares equal Plan's (balance="bytes", the default) for one consumer and epoch 1."""
        plan = Plan(
            self.sizes, epochs=epochs, shuffle=True, seed=self.seed, rank=rank, world_size=world,
            worker=worker, num_workers=workers, partition=partition,  # type: ignore[arg-type]
        )  # fmt: skip
        assert plan.share(1) == self.share(1, world, rank, workers, worker, partition), (world, rank, workers, worker, partition)


SCHEMES = [
    # name, cache, (world, rank of node n's consumer c, workers, worker, partition) as a function
    ("per-process, global shuffle", "process", "global"),
    ("per-process, rank-fixed (partition='fixed')", "process", "rank"),
    ("per-process, node-local shuffle", "process", "node-local"),
    ("node, global shuffle", "node", "global"),
    ("node, node-local shuffle", "node", "node-local"),
]


def consumer_params(kind: str, nodes: int, ranks: int, workers: int, node: int, c: int) -> tuple[int, int, int, int, str]:
    """(world, rank, num_workers, worker, partition) of local consumer ``c`` of ``node``."""
    if kind == "global":  # torchrun ranks, DataLoader workers, re-split every epoch
        return nodes * ranks, node * ranks + c // workers, workers, c % workers, "epoch"
    if kind == "rank":  # Plan(partition="fixed") per rank: a rank keeps its items, and each worker its part
        return nodes * ranks, node * ranks + c // workers, workers, c % workers, "fixed"
    # node-local: the node keeps its items (as one world of nodes; each local consumer its part)
    return nodes, node, ranks * workers, c, "fixed"


def expected_hit(cache: str, kind: str, frac: float, nodes: int, ranks: int, workers: int, horizon: int) -> float:
    """Steady-state hit rate in closed form. Each epoch an item lands on one of ``k`` caches at
    random (k = 1 when the cache keeps its items), so its next read at the same cache comes
    ``g`` epochs later with probability ``p (1-p)^(g-1)``, p = 1/k. Keeping it that long costs
    about ``g`` epochs of its room; Belady, seeing ``horizon`` epochs ahead, keeps the shortest
    gaps first until the room (``frac`` of a share, for one epoch) is spent."""
    local = ranks * workers
    ways = {
        ("process", "global"): nodes * local,
        ("process", "rank"): 1,  # partition="fixed" keeps a worker's items too
        ("process", "node-local"): 1,
        ("node", "global"): nodes,
        ("node", "node-local"): 1,
    }[(cache, kind)]
    p, room, hit = 1.0 / ways, frac, 0.0
    for g in range(1, horizon + 1):
        q = p * (1 - p) ** (g - 1)  # share of this epoch's reads whose previous read here was g epochs ago
        take = min(q, room / g)
        hit, room = hit + take, room - take * g
    return hit


def hit_rates(args: argparse.Namespace) -> dict[str, Any]:
    nodes, ranks, workers, epochs = args.sim_nodes, args.ranks, args.workers, args.epochs
    horizon = min(HORIZON, epochs - 1)  # what Belady can use: PlanFuture's horizon, or the epochs there are
    shares = Shares(args.sim_items, args.seed)
    for kind in ("global", "rank", "node-local"):
        shares.check(epochs, *consumer_params(kind, nodes, ranks, workers, nodes - 1, ranks * workers - 1))
    local = ranks * workers
    node_share = math.ceil(args.sim_items / nodes)
    rows = []
    for frac in (0.5, 1.0):
        node_cap = max(1, int(frac * node_share))
        proc_cap = max(1, node_cap // local)
        for name, cache, kind in SCHEMES:
            reads = [0] * epochs
            misses = [0] * epochs
            for node in range(args.sample_nodes):
                seqs = []
                for c in range(local):
                    world, rank, nw, w, part = consumer_params(kind, nodes, ranks, workers, node, c)
                    seqs.append([[(e, x) for x in shares.share(e, world, rank, nw, w, part)] for e in range(epochs)])
                if cache == "node":  # the node's requests: its consumers step together, interleaved
                    merged = [
                        s for e in range(epochs) for group in zip_longest(*(q[e] for q in seqs)) for s in group if s is not None
                    ]
                    caches = [(merged, node_cap)]
                else:  # one cache per consumer: a sample of the node's consumers, spread over its ranks
                    step = max(1, local // args.sample_consumers)
                    caches = [([s for e in range(epochs) for s in seqs[c][e]], proc_cap) for c in range(0, local, step)]
                for steps, cap in caches:
                    result = run("auto", [x for _e, x in steps], shares.sizes, cap)
                    for (e, _x), b in zip(steps, result.per_step, strict=True):
                        reads[e] += 1
                        misses[e] += b > 0
            rows.append(
                {
                    "scheme": name,
                    "capacity_of_node_share": frac,
                    "cache_items": node_cap if cache == "node" else proc_cap,
                    "hit_by_epoch": [1 - m / r for m, r in zip(misses, reads, strict=True)],
                    "expected_scaled": expected_hit(cache, kind, frac, nodes, ranks, workers, horizon),
                    "expected_full": expected_hit(cache, kind, frac, args.nodes, ranks, workers, HORIZON),
                }
            )
    return {
        "nodes": nodes,
        "consumers_per_node": local,
        "items": args.sim_items,
        "epochs": epochs,
        "horizon": horizon,
        "full_scale_horizon": HORIZON,
        "sampled_nodes": args.sample_nodes,
        "sampled_consumers_per_node": min(local, args.sample_consumers),
        "node_share_items": node_share,
        "rows": rows,
    }


# ---- 2. GET rates --------------------------------------------------------------------
def get_rates(args: argparse.Namespace, hits: dict[str, Any]) -> dict[str, Any]:
    gpus = args.nodes * args.ranks
    items_per_s = gpus * args.items_per_s
    file_size = args.item_size / args.files_per_item
    gets_per_item = args.files_per_item * max(1, math.ceil(file_size / args.part_size))
    demand = items_per_s * gets_per_item
    rows = [{"case": "every read a miss (epoch 1, or no retention)", "miss": 1.0}]
    rows += [
        {"case": f"{r['scheme']}, cap {r['capacity_of_node_share']:.0%}", "miss": 1 - r["expected_full"]} for r in hits["rows"]
    ]
    for row in rows:
        gets = demand * row["miss"]
        row["gets_per_s"] = gets
        row["bytes_per_s"] = items_per_s * args.item_size * row["miss"]
        row["prefixes_needed"] = max(1, math.ceil(gets / S3_GET_PER_PREFIX))
        row["gets_per_s_per_prefix_at_prefixes"] = gets / args.prefixes
    return {
        "gpus": gpus,
        "items_per_s": items_per_s,
        "gets_per_item": gets_per_item,
        "demand_gets_per_s": demand,
        "demand_bytes_per_s": items_per_s * args.item_size,
        "per_node_gets_per_s": demand / args.nodes,
        "rows": rows,
    }


# ---- 4. SlowDown ---------------------------------------------------------------------
def schedule(retries: int, base: float, cap: float) -> list[dict[str, float]]:
    out, lo_sum, hi_sum = [], 0.0, 0.0
    for a in range(retries):
        lo, hi = backoff_delay(a, base, cap, rand=lambda: 0.0), backoff_delay(a, base, cap, rand=lambda: 1.0)
        lo_sum, hi_sum = lo_sum + lo, hi_sum + hi
        out.append({"retry": a + 1, "min_s": lo, "max_s": hi, "cum_min_s": lo_sum, "cum_max_s": hi_sum})
    return out


def throttle(args: argparse.Namespace, jitter: bool) -> dict[str, Any]:
    """Every node's in-flight requests get SlowDown at t=0; the store keeps answering SlowDown
    until ``--throttle-s``; each request retries after ``backoff_delay`` until it gets through."""
    rng = random.Random(args.seed)
    rand = rng.random if jitter else (lambda: 1.0)
    base, cap, retries = DEFAULTS["retry_backoff"], DEFAULTS["retry_backoff_max"], DEFAULTS["retries"]
    bins: Counter[int] = Counter()
    fine: Counter[int] = Counter()
    failed = done = 0
    last = 0.0
    for _ in range(args.nodes * args.inflight):
        t, attempt = 0.0, 0
        while True:
            if attempt == retries:
                failed += 1
                break
            t += backoff_delay(attempt, base, cap, rand=rand)
            bins[int(t / BIN_S)] += 1
            fine[int(t / (BIN_S / 10))] += 1
            attempt += 1
            if t >= args.throttle_s:
                done += 1
                last = max(last, t)
                break
    peak_bin, peak = max(bins.items(), key=lambda kv: kv[1])
    after = [v for k, v in bins.items() if k * BIN_S >= args.throttle_s]
    return {
        "jitter": "equal" if jitter else "none",
        "retries": sum(bins.values()),
        "peak_per_100ms": peak,
        "peak_at_s": peak_bin * BIN_S,
        "peak_per_10ms": max(fine.values()),
        "peak_per_100ms_after_throttle": max(after, default=0),
        "windows_with_retries": len(bins),
        "all_through_by_s": last,
        "gave_up": failed,
    }


# ---- report --------------------------------------------------------------------------
def si(x: float) -> str:
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def render(rep: dict[str, Any]) -> str:
    p = rep["parameters"]
    out = [
        f"$ {rep['command']}",
        "parameters: " + ", ".join(f"{k}={v}" for k, v in p.items()),
        "",
        "1. start: LIST requests (<= 1,000 keys each) and manifest [computed; bytes/item measured]",
    ]
    li, m = rep["listing"], rep["manifest_sample"]
    out += format_table(
        ["mode", "listings", "LIST requests", "h at 5,500 req/s", "manifest bytes fetched", "manifest GETs"],
        [
            [
                "per-process",
                f"{li['per_process']['listings']:,}",
                f"{li['per_process']['list_requests']:,}",
                f"{li['per_process']['list_requests'] / S3_GET_PER_PREFIX / 3600:.1f}",
                "-",
                "-",
            ],
            [
                "node",
                "1",
                f"{li['node']['list_requests']:,}",
                f"{li['node']['list_requests'] / S3_GET_PER_PREFIX / 3600:.1f}",
                f"{si(li['node']['manifest_bytes'])}B ({si(li['node']['manifest_bytes_each'])}B x {p['nodes']:,} nodes)",
                f"{li['node']['manifest_gets']:,}",
            ],
        ],
        left=1,
    )
    out.append(
        f"manifest: {m['bytes_per_item']:.1f} B/item gzip (measured: {m['sample_items']:,} generated items, "
        f"{p['files_per_item']} file(s) each, random MD5 etags, via cachepipe.state.save_catalog); "
        "the LIST hours assume LIST counts against one prefix's GET/HEAD rate (S3 does not document its LIST rate)"
    )
    g = rep["gets"]
    out += [
        "",
        (
            f"2. steady-state GETs against the source [computed]: {g['gpus']:,} GPUs x {p['items_per_s']} items/s = "
            f"{si(g['items_per_s'])} items/s, {g['gets_per_item']} GET/item, {si(g['demand_bytes_per_s'])}B/s; "
            f"S3: {S3_GET_PER_PREFIX:,} GET/HEAD per prefix per s"
        ),
    ]
    out += format_table(
        [
            "case (miss rate: full-scale closed form)",
            "miss",
            "GET/s",
            "B/s",
            "prefixes needed",
            f"GET/s/prefix at {p['prefixes']}",
        ],
        [
            [
                r["case"],
                f"{r['miss']:.4f}",
                si(r["gets_per_s"]),
                si(r["bytes_per_s"]),
                f"{r['prefixes_needed']:,}",
                si(r["gets_per_s_per_prefix_at_prefixes"]),
            ]
            for r in g["rows"]
        ],
        left=1,
    )
    h = rep["hits"]
    out += [
        "",
        (
            f"3. hit rate [scaled: {h['nodes']} nodes x {h['consumers_per_node']} consumers, {h['items']:,} equal items, "
            f"{h['epochs']} epochs, Belady over plan shares; sampled {h['sampled_nodes']} node(s), "
            f"{h['sampled_consumers_per_node']} per-process caches each]"
        ),
        (
            f"steady state [closed form]: Belady keeping items <= {h['horizon']} epochs (scaled), "
            f"<= {h['full_scale_horizon']} (full scale: PlanFuture's horizon)"
        ),
    ]
    out += format_table(
        [
            "scheme",
            "cap",
            "cache items",
            *(f"hit ep {e + 1}" for e in range(h["epochs"])),
            "steady (scaled)",
            f"steady ({p['nodes']:,} nodes)",
        ],
        [
            [
                r["scheme"],
                f"{r['capacity_of_node_share']:.0%}",
                f"{r['cache_items']:,}",
                *(f"{x:.3f}" for x in r["hit_by_epoch"]),
                f"{r['expected_scaled']:.3f}",
                f"{r['expected_full']:.5f}",
            ]
            for r in h["rows"]
        ],
        left=2,
    )
    s = rep["slowdown"]
    out += [
        "",
        (
            f"4. SlowDown: backoff.backoff_delay schedule (retries={DEFAULTS['retries']}, "
            f"retry_backoff={DEFAULTS['retry_backoff']}, retry_backoff_max={DEFAULTS['retry_backoff_max']}) [computed]"
        ),
    ]
    out += format_table(
        ["retry", "wait min s", "wait max s", "total min s", "total max s"],
        [
            [str(r["retry"]), f"{r['min_s']:.2f}", f"{r['max_s']:.2f}", f"{r['cum_min_s']:.1f}", f"{r['cum_max_s']:.1f}"]
            for r in s["schedule"]
        ],
        left=1,
    )
    out.append(
        f"Monte-Carlo [sampled, seed {p['seed']}]: {p['nodes']:,} nodes x {p['inflight']} in-flight requests throttled at t=0, "
        f"SlowDown until t={p['throttle_s']} s"
    )
    cols = ["jitter", "retries", "peak/100ms", "peak at s", "peak/10ms", "peak/100ms after throttle"]
    cols += ["100ms windows used", "all through by s", "gave up"]
    rows = [
        [
            *(r["jitter"], f"{r['retries']:,}", f"{r['peak_per_100ms']:,}", f"{r['peak_at_s']:.1f}", f"{r['peak_per_10ms']:,}"),
            *(f"{r['peak_per_100ms_after_throttle']:,}", str(r["windows_with_retries"])),
            *(f"{r['all_through_by_s']:.2f}", str(r["gave_up"])),
        ]
        for r in s["monte_carlo"]
    ]
    out += format_table(cols, rows, left=1)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--nodes", type=int, default=1000, help="nodes in the job (default 1000)")
    add("--ranks", type=int, default=8, help="ranks (GPUs) per node (default 8)")
    add("--workers", type=int, default=8, help="DataLoader workers per rank (default 8)")
    add("--items", type=int, default=10_000_000, help="items in the dataset (default 10M)")
    add("--files-per-item", type=int, default=1, help="objects per item (default 1: items='files')")
    add("--item-size", type=int, default=1 * MB, help="bytes per item (default 1 MB)")
    add("--items-per-s", type=float, default=50.0, help="items/s consumed per GPU (default 50)")
    add("--part-size", type=int, default=DEFAULTS["part_size"], help="ranged-GET part size (default 8 MiB)")
    add("--prefixes", type=int, default=100, help="prefixes the keys are spread over, for the per-prefix column (default 100)")
    add("--manifest-sample", type=int, default=20_000, help="generated items whose catalog is measured (default 20000)")
    add("--sim-nodes", type=int, default=8, help="nodes of the scaled hit-rate instance (default 8)")
    add("--sim-items", type=int, default=100_000, help="items of the scaled instance (default 100000)")
    add("--sample-nodes", type=int, default=1, help="nodes of the scaled instance replayed (default 1)")
    add("--sample-consumers", type=int, default=16, help="per-process caches replayed per sampled node (default 16)")
    add("--epochs", type=int, default=3, help="epochs replayed (default 3)")
    add(
        "--inflight",
        type=int,
        default=DEFAULTS["max_large_requests"],
        help="requests in flight per node when throttled (default: max_large_requests, 16, as for the default items, "
        "items with a file over 256 KiB; items of smaller files go up to max_concurrency, 64)",
    )
    add("--throttle-s", type=float, default=3.0, help="seconds the store answers SlowDown (default 3)")
    add("--seed", type=int, default=0, help="seed of the plan, the sample and the Monte-Carlo (default 0)")
    add("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.sample_nodes <= args.sim_nodes:
        p.error("--sample-nodes must be between 1 and --sim-nodes")
    if args.epochs < 2:
        p.error("--epochs must be at least 2")
    t0 = time.perf_counter()
    sample = manifest_bytes_per_item(args.manifest_sample, args.files_per_item, args.item_size, args.seed)
    hits = hit_rates(args)
    report: dict[str, Any] = {
        "command": command_line(),
        "parameters": {k: v for k, v in vars(args).items() if k != "json"},
        "manifest_sample": sample,
        "listing": listing(args, sample["bytes_per_item"]),
        "gets": get_rates(args, hits),
        "hits": hits,
        "slowdown": {
            "schedule": schedule(DEFAULTS["retries"], DEFAULTS["retry_backoff"], DEFAULTS["retry_backoff_max"]),
            "monte_carlo": [throttle(args, jitter=True), throttle(args, jitter=False)],
        },
    }
    report["total_seconds"] = time.perf_counter() - t0
    print_report(report, render, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
