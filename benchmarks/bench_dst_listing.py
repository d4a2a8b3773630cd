"""Benchmark: what one ``cachepipe map`` rank's listing of a local DST costs.

Each rank of a map job lists the part of DST where its share's results can be
(:mod:`cachepipe.map.dstrange`: after a key below its first item, up to the first key past its
last one). On an object store the listing starts there; on a local (or mounted) filesystem it
was walked whole by each rank. This makes ``--items`` folders of ``--files`` files (results as
map writes them, ``DST/<item>/...``) and times, in a fresh process per tree and round, with
``PYTHONPATH=TREE``:

- ``whole``: the whole listing, drained;
- ``rank``: what one rank of ``--ranks`` lists, the middle one's share (a contiguous run of the
  sorted item names, as map's shares are), bounded as map bounds it;
- ``first``: a ``Pipeline`` over the same tree as its ``file://`` source (folders), from its open
  to its first item (``keys``: 1), in a cache of its own under ``--dir``.

Seconds, and the process's peak resident memory (the interpreter's included), medians of
``--runs`` rounds, the trees' order flipped every round; each tree against the first. The
files are in the page cache (warm)::

    git worktree add --detach /tmp/before HEAD~1
    python benchmarks/bench_dst_listing.py --trees /tmp/before . --items 100000 --files 3 --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench_reopen import _child
from common import check_positive, command_line, file_system_of, format_table, machine_info, progress, source_trees

_LIST = """
import json, resource, sys, time
from cachepipe.map.dstrange import bounded, dst_range
from cachepipe.stores import open_store
url, items, ranks, which = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
names = sorted(f"item{i:07d}" for i in range(items))
share = names[items * (ranks // 2) // ranks : items * (ranks // 2 + 1) // ranks]
if which == "first":
    import tempfile
    from cachepipe import Pipeline
    with tempfile.TemporaryDirectory(dir=sys.argv[5]) as cache:
        start = time.perf_counter()
        with Pipeline(url, cache, "1GiB") as pipe:
            keys = [next(iter(pipe))]
            took = time.perf_counter() - start
else:
    store = open_store(url, {})
    start = time.perf_counter()
    listing = store.list(dst_range(share).start_after) if which == "rank" else store.list()
    keys = [o.key for o in listing] if which == "whole" else list(bounded((o.key for o in listing), dst_range(share)))
    took = time.perf_counter() - start
    listing.close()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # bytes: the process's, interpreter included
print(json.dumps({"seconds": took, "peak_mib": peak / 2**20, "keys": len(keys)}))
"""

WHICH = ("whole", "rank", "first")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to compare, the first the baseline")
    p.add_argument("--items", type=int, default=100_000, help="item folders in DST (default 100000)")
    p.add_argument("--files", type=int, default=3, help="files per folder (default 3)")
    p.add_argument("--ranks", type=int, default=16, help="ranks of the job (default 16)")
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--dir", default=None, help="where DST goes (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args()
    check_positive(p, args, ("items", "files", "ranks", "runs"))
    trees = source_trees(p, args.trees)
    with tempfile.TemporaryDirectory(prefix="cachepipe-dst-", dir=args.dir) as tmp:
        dst = Path(tmp) / "dst"
        progress(f"writing {args.items} folders of {args.files} files")
        for i in range(args.items):
            folder = dst / f"item{i:07d}"
            folder.mkdir(parents=True)
            for k in range(args.files):
                (folder / f"out{k}").write_bytes(b"x")
        got: dict[tuple[str, str], list[dict]] = {}
        for run in range(args.runs):
            progress(f"round {run + 1} of {args.runs}")
            for tree in trees if run % 2 == 0 else trees[::-1]:
                for which in WHICH:
                    out = json.loads(_child(tree, _LIST, dst.as_uri(), str(args.items), str(args.ranks), which, tmp))
                    got.setdefault((tree, which), []).append(out)
        _report(args, trees, got, file_system_of(str(dst)))


def _report(args: argparse.Namespace, trees: list[str], got: dict[tuple[str, str], list[dict]], fs: str) -> None:
    if args.json:
        runs = {f"{tree} {which}": values for (tree, which), values in got.items()}
        print(json.dumps({"command": command_line(), "machine": machine_info(), "file_system": fs, "runs": runs}, indent=2))
        return
    rows = []
    for which in WHICH:
        base = statistics.median(r["seconds"] for r in got[(trees[0], which)])
        for tree in trees:
            runs = got[(tree, which)]
            seconds = statistics.median(r["seconds"] for r in runs)
            peak = statistics.median(r["peak_mib"] for r in runs)
            rows.append([which, tree, str(runs[0]["keys"]), f"{seconds * 1000:.0f}", f"{seconds / base:.2f}", f"{peak:.1f}"])
    head = f"a local DST of {args.items} folders x {args.files} files on {fs}; rank: the middle of {args.ranks}"
    print(f"{head}; first: a Pipeline to its first item (warm):")
    print("\n".join(format_table(["listing", "tree", "keys", "median ms", "vs first", "peak MiB"], rows)))
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}; {args.runs} interleaved rounds", flush=True)


if __name__ == "__main__":
    main()
