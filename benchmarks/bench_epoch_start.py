"""Benchmark: how long a ``set_epoch`` pass of a DataLoader takes to its first batch over kept items.

With ``CachePipeDataset`` in per-process mode, each DataLoader worker of a pass (workers not
persistent) opens a pipeline of its own over its folder ``cache_dir/rank<r>-worker<k>``, which
with ``retain="auto"`` holds what the last pass kept. The worker then checks its kept items
(one ``lstat`` a file) and, with a capacity given as a share of the disk (``"50%"``), measures
what every worker's folder holds, its siblings' too, as the room the share is of. This measures
``iter(loader)`` to the first batch after ``set_epoch(n)`` (the process start, the imports and
the dataset's making excluded; the workers' start, their pipelines' opening and the first
batch's items included), over a ``file://`` source of ``--items`` folders of ``--files`` files
each (``--size`` bytes), every item kept by the pass before (``partition="fixed"``: a worker
reads the same share every epoch; ``retain="auto"``, its share fits: nothing is downloaded
again, which each pass checks in its workers' pipeline stats), for a capacity in bytes and one
given as a share.

Each tree in ``--trees`` fills its own ``cache_dir`` with a first pass (epoch 0, not measured),
then every round runs one pass per capacity and loader on each tree, each in a fresh process
with ``PYTHONPATH=TREE``, the order of the trees flipped every round; each pass runs to its end
(so that the next one opens over a pass closed cleanly, as in training); medians, and each
tree's over the first's. Beside them, ``made ms``: making the dataset and calling
``set_epoch``, which a training run does once, not per pass (where the dataset reads the
manifest that its forked workers plan from). ``--start-method`` starts the workers by
``spawn`` or ``forkserver`` instead of ``fork`` (set as the default start method, as Python
3.14 does with ``forkserver``, and given as the loader's ``multiprocessing_context``; the pass
then runs from a script file, so that its ``transform`` can be pickled to the workers). The
files are in the page cache (warm)::

    git worktree add --detach /tmp/before 99cbac3
    python benchmarks/bench_epoch_start.py --trees /tmp/before . --runs 7 --loaders DataLoader StatefulDataLoader
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench_reopen import _child, _source, kept_options
from common import check_positive, command_line, file_system_of, format_table, machine_info, progress, source_trees

CAPACITIES = ("10GiB", "50%")
LOADERS = ("DataLoader", "StatefulDataLoader")
START_METHODS = ("fork", "spawn", "forkserver")
Times = dict[tuple[str, str, str], list[dict[str, Any]]]  # (tree, loader, capacity): each pass's report

_PASS = """
import json, multiprocessing, sys, time
import torch
from cachepipe.torch import CachePipeDataset
source, cache, capacity, epoch, workers, batch, loader, manifest, method = sys.argv[1:]

def seen(path):  # in the worker: (worker, bytes its pipeline downloaded so far); the pipeline is private
    info = torch.utils.data.get_worker_info()
    return info.id, info.dataset._pipe.stats().bytes_downloaded

if __name__ == "__main__":
    multiprocessing.set_start_method(method, force=True)  # the default, which the dataset sees
    options = dict(epochs=None, shuffle=True, seed=0, partition="fixed", retain="auto", rank=0, world_size=1)
    if manifest != "-":
        options["manifest"] = manifest  # what set_epoch listed in the first pass, not listed again
    making = time.perf_counter()
    dataset = CachePipeDataset(source, cache, capacity, transform=seen, **options)
    dataset.set_epoch(int(epoch))
    made = time.perf_counter() - making  # once per training run, not per pass: it reads the manifest
    if loader == "StatefulDataLoader":
        from torchdata.stateful_dataloader import StatefulDataLoader as Loader
    else:
        Loader = torch.utils.data.DataLoader
    loader = Loader(
        dataset, batch_size=int(batch), num_workers=int(workers), persistent_workers=False, multiprocessing_context=method
    )
    start = time.perf_counter()
    batches = iter(loader)
    ids, got = next(batches)
    first = time.perf_counter() - start
    downloaded, samples = {int(ids[0]): int(got.max())}, len(ids)
    for ids, got in batches:  # to the end: the pass closes, as a training loop's does
        downloaded[int(ids[0])] = max(downloaded.get(int(ids[0]), 0), int(got.max()))
        samples += len(ids)
    took = time.perf_counter() - start
    report = {"first": first, "pass": took, "made": made, "downloaded": sum(downloaded.values()), "samples": samples}
    print(json.dumps({**report, "manifest": dataset.options["manifest"]}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    kept_options(p, "folders in the source (default 20000)")
    p.add_argument("--workers", type=int, default=4, help="DataLoader workers (default 4)")
    p.add_argument("--batch", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--loaders", nargs="+", choices=LOADERS, default=["DataLoader"], help="loaders (default DataLoader)")
    p.add_argument("--capacities", nargs="+", default=list(CAPACITIES), help="capacities (default: 10GiB 50%%)")
    p.add_argument("--start-method", choices=START_METHODS, default="fork", help="how workers are started (default fork)")
    args = p.parse_args()
    check_positive(p, args, ("items", "files", "size", "workers", "batch", "runs"))
    trees = source_trees(p, args.trees)
    with tempfile.TemporaryDirectory(prefix="cachepipe-epoch-", dir=args.dir) as tmp:
        work = Path(tmp)
        source = _source(work / "data", args.items, args.files, args.size)
        caches = {tree: str(work / f"cache{i}") for i, tree in enumerate(trees)}
        manifests, epochs = {}, dict.fromkeys(trees, 0)
        for tree in trees:
            progress(f"filling the cache of {tree} (epoch 0)")
            filled = _pass(args, tree, source, caches[tree], args.capacities[0], epoch=0, loader=LOADERS[0], manifest="-")
            if filled["downloaded"] != args.items * args.files * args.size:  # so that the 0 checked below means reused
                raise RuntimeError(f"{tree}: epoch 0 downloaded {filled['downloaded']} bytes, not the source's")
            manifests[tree] = filled["manifest"]
        times: Times = {}
        for run in range(args.runs):
            progress(f"round {run + 1} of {args.runs}")
            for tree in trees if run % 2 == 0 else trees[::-1]:
                for loader in args.loaders:
                    for capacity in args.capacities:
                        epochs[tree] += 1
                        where = (source, caches[tree], capacity)
                        got = _pass(args, tree, *where, epoch=epochs[tree], loader=loader, manifest=manifests[tree])
                        if got["downloaded"]:
                            raise RuntimeError(f"{tree}: epoch {epochs[tree]} downloaded {got['downloaded']} bytes: not reused")
                        times.setdefault((tree, loader, capacity), []).append(got)
        _report(args, trees, times, file_system_of(str(work)))
        progress(f"deleting {work}")


def _pass(args: argparse.Namespace, tree: str, *where: str, epoch: int, loader: str, manifest: str) -> dict[str, Any]:
    """One set_epoch pass in a fresh process on ``tree`` (``where``: the source, the cache folder
    and the capacity): its times, what it downloaded and read, the manifest it planned from."""
    argv = (*where, str(epoch), str(args.workers), str(args.batch), loader, manifest, args.start_method)
    script = Path(where[1]).with_name("pass.py")  # a file: spawned workers import their transform from it
    script.write_text(_PASS)
    got: dict[str, Any] = json.loads(_child(tree, _PASS, *argv, script=script))
    if got["samples"] != args.items:
        raise RuntimeError(f"{tree}: epoch {epoch} read {got['samples']} samples, not the {args.items} items")
    return got


def _report(args: argparse.Namespace, trees: list[str], times: Times, fs: str) -> None:
    """Print the medians (or, with ``--json``, every time)."""
    if args.json:
        first = {f"{tree} {loader} {capacity}": [t["first"] for t in got] for (tree, loader, capacity), got in times.items()}
        whole = {f"{tree} {loader} {capacity}": [t["pass"] for t in got] for (tree, loader, capacity), got in times.items()}
        made = {f"{tree} {loader} {capacity}": [t["made"] for t in got] for (tree, loader, capacity), got in times.items()}
        report = {"command": command_line(), "machine": machine_info(), "file_system": fs, "items": args.items}
        sizes = {"files": args.items * args.files, "workers": args.workers, "batch": args.batch, "runs": args.runs}
        sizes["start_method"] = args.start_method
        times_of = {"first_batch_seconds": first, "pass_seconds": whole, "dataset_made_seconds": made}
        print(json.dumps({**report, **sizes, **times_of}, indent=2))
        return
    rows = []
    for loader in args.loaders:
        for capacity in args.capacities:
            base = statistics.median(t["first"] for t in times[(trees[0], loader, capacity)])
            for tree in trees:
                first = statistics.median(t["first"] for t in times[(tree, loader, capacity)])
                whole = statistics.median(t["pass"] for t in times[(tree, loader, capacity)])
                made = statistics.median(t["made"] for t in times[(tree, loader, capacity)])
                rows.append(
                    [loader, capacity, tree, f"{first * 1000:.0f}", f"{first / base:.2f}", f"{whole:.1f}", f"{made * 1000:.0f}"]
                )
    over = f"{args.items} kept folders ({args.items * args.files} files), {args.workers} workers ({args.start_method})"
    print(f"first batch of a set_epoch pass over {over}, on {fs} (warm):")
    print(
        "\n".join(format_table(["loader", "capacity", "tree", "first batch ms", "vs first", "pass s", "made ms"], rows, left=3))
    )
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}; {args.runs} interleaved rounds", flush=True)


if __name__ == "__main__":
    main()
