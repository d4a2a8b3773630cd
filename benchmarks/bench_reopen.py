"""Benchmark: how long a pipeline takes to open again over a cache that holds many small files.

A daemon restarted, a pod rescheduled, ``resume=True``, or a DataLoader worker at each
``set_epoch`` pass opens its cache again over the items it kept. The cache then checks each
kept item's files against the listing (one ``lstat`` per file), counts what else the folder
holds, and, with a capacity given as a share of the disk (``"50%"``), what the folder holds in
all. This measures ``Pipeline.open()`` alone (the imports and the process start excluded) over
``--items`` folders of ``--files`` files each (``--size`` bytes), all kept in the cache, with
``resume=True`` (the listing saved by the first owner is read, not listed again), for a
capacity in bytes and one given as a share.

Each tree in ``--trees`` fills its own cache once (not measured), then every round opens each
tree's cache once per capacity, in a fresh process with ``PYTHONPATH=TREE``, the order of the
trees flipped every round; medians, and each tree's over the first's. The files are in the
page cache (warm): a cold open adds the disk's reads::

    git worktree add --detach /tmp/before 99cbac3
    python benchmarks/bench_reopen.py --trees /tmp/before . --items 20000 --files 5 --runs 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import check_positive, command_line, file_system_of, format_table, machine_info, progress, source_trees

CAPACITIES = ("10GiB", "50%")

_FILL = """
import sys, time
from cachepipe import Pipeline
source, cache, items = sys.argv[1], sys.argv[2], int(sys.argv[3])
options = dict(resume=True, keep_on_close=True, shuffle=True, rank=0, world_size=1, auto_ack=False)
with Pipeline(source, cache, "10GiB", **options) as pipe:
    while pipe.stats().items_ready < items:
        time.sleep(0.2)
"""

_OPEN = """
import json, sys, time
from cachepipe import Pipeline
source, cache, capacity = sys.argv[1], sys.argv[2], sys.argv[3]
pipe = Pipeline(source, cache, capacity, resume=True, keep_on_close=True, shuffle=True, rank=0, world_size=1, auto_ack=False)
start = time.perf_counter()
pipe.open()
took = time.perf_counter() - start
stats = pipe.stats()
pipe.close()
print(json.dumps({"seconds": took, "downloaded": stats.bytes_downloaded}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kept_options(p, "folders kept in the cache (default 20000)")
    args = p.parse_args()
    check_positive(p, args, ("items", "files", "size", "runs"))
    trees = source_trees(p, args.trees)
    with tempfile.TemporaryDirectory(prefix="cachepipe-reopen-", dir=args.dir) as tmp:
        work = Path(tmp)
        source = _source(work / "data", args.items, args.files, args.size)
        caches = {tree: str(work / f"cache{i}") for i, tree in enumerate(trees)}
        for tree in trees:
            progress(f"filling the cache of {tree}")
            _child(tree, _FILL, source, caches[tree], str(args.items))
        times: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            progress(f"round {run + 1} of {args.runs}")
            for tree in trees if run % 2 == 0 else trees[::-1]:
                for capacity in CAPACITIES:
                    got = json.loads(_child(tree, _OPEN, source, caches[tree], capacity))
                    if got["downloaded"]:
                        raise RuntimeError(f"{tree}: the open downloaded {got['downloaded']} bytes: items were not reused")
                    times.setdefault((tree, capacity), []).append(got["seconds"])
        _report(args, trees, times, file_system_of(str(work)))
        progress(f"deleting {work}")


def _report(args: argparse.Namespace, trees: list[str], times: dict[tuple[str, str], list[float]], fs: str) -> None:
    """Print the medians (or, with ``--json``, every time)."""
    if args.json:
        seconds = {f"{tree} {capacity}": values for (tree, capacity), values in times.items()}
        report = {"command": command_line(), "machine": machine_info(), "file_system": fs, "items": args.items}
        print(json.dumps({**report, "files": args.items * args.files, "runs": args.runs, "seconds": seconds}, indent=2))
        return
    rows = []
    for capacity in CAPACITIES:
        base = statistics.median(times[(trees[0], capacity)])
        for tree in trees:
            median = statistics.median(times[(tree, capacity)])
            rows.append([capacity, tree, f"{median * 1000:.0f}", f"{median / base:.2f}"])
    print(f"open() over {args.items} kept folders, {args.items * args.files} files, on {fs} (warm):")
    print("\n".join(format_table(["capacity", "tree", "median ms", "vs first"], rows)))
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}; {args.runs} interleaved rounds", flush=True)


def kept_options(p: argparse.ArgumentParser, items: str) -> None:
    """The options of a comparison of trees over a ``file://`` source of folders kept in their
    caches (this script's and ``bench_epoch_start.py``'s): ``--trees``, ``--items`` (its help
    ``items``), ``--files``, ``--size``, ``--runs``, ``--dir``, ``--json``."""
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to compare, the first the baseline")
    p.add_argument("--items", type=int, default=20_000, help=items)
    p.add_argument("--files", type=int, default=5, help="files per folder (default 5)")
    p.add_argument("--size", type=int, default=100, help="bytes per file (default 100)")
    p.add_argument("--runs", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--dir", default=None, help="where the source and the caches go (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _source(root: Path, items: int, files: int, size: int) -> str:
    """``items`` folders of ``files`` files of ``size`` bytes under ``root``, as a ``file://`` URL."""
    body = b"x" * size
    for i in range(items):
        folder = root / f"item{i:07d}"
        folder.mkdir(parents=True)
        for k in range(files):
            (folder / f"f{k}").write_bytes(body)
    return f"file://{root}/"


def _child(tree: str, code: str, *argv: str, script: Path | None = None) -> str:
    """Run ``code`` in a fresh interpreter on ``tree``'s cachepipe; its standard output. With
    ``script``, the file that holds ``code`` is run (its functions can be pickled by name)."""
    env = {**os.environ, "PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
    run = [sys.executable, "-c", code] if script is None else [sys.executable, str(script)]
    done = subprocess.run([*run, *argv], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: child exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


if __name__ == "__main__":
    main()
