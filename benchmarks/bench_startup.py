"""Benchmark: how long cachepipe takes to start, per source tree (session s35).

Wall times of fresh Python processes, as a user (or the test suite) starts them:

- ``help``: ``python -m cachepipe --help``;
- ``status``: ``python -m cachepipe status -s SOCK`` against a running daemon;
- ``serve``: ``cachepipe serve`` of one ``file://`` pipeline, from the start until it reports
  ``READY=1`` (as systemd's ``Type=notify`` sees it; ``cachepipe.service.testing.DaemonProcess``).

Each tree in ``--trees`` runs with ``PYTHONPATH=TREE``, interleaved round by round (the order
flips every round), ``--runs`` rounds; medians, and each tree's over the first's. With
``--bytecode both``, every measurement runs twice: without cached bytecode (the environment's
``PYTHONDONTWRITEBYTECODE=1``: each process compiles cachepipe from source) and with bytecode
cached under a temporary ``PYTHONPYCACHEPREFIX`` (what ``make test`` sets), written by a
first, unmeasured start of each::

    git worktree add --detach /tmp/before 278bd33
    python benchmarks/bench_startup.py --trees /tmp/before . --runs 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import check_positive, command_line, format_table, machine_info, progress, source_trees

from cachepipe.service.testing import DaemonProcess

KINDS = ("help", "status", "serve")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to compare, the first the baseline")
    p.add_argument("--runs", type=int, default=9, help="interleaved rounds (default 9)")
    p.add_argument("--bytecode", choices=["off", "on", "both"], default="both", help="cached bytecode (default both)")
    args = p.parse_args()
    check_positive(p, args, ("runs",))
    trees = source_trees(p, args.trees)
    modes = ["off", "on"] if args.bytecode == "both" else [args.bytecode]
    with tempfile.TemporaryDirectory(prefix="cachepipe-startup-") as tmp:
        work = Path(tmp)
        config = _config(work, "status")
        serve = _config(work, "serve")
        times: dict[tuple[str, str, str], list[float]] = {}
        with DaemonProcess(config):  # the daemon each tree's `status` asks
            for tree in trees:  # the bytecode cached, not measured
                if "on" in modes:
                    for kind in KINDS:
                        _measure(kind, _env(tree, "on", work), work, serve)
            for run in range(args.runs):
                progress(f"round {run + 1} of {args.runs}")
                order = trees if run % 2 == 0 else trees[::-1]
                for mode in modes:
                    for tree in order:
                        env = _env(tree, mode, work)
                        for kind in KINDS:
                            times.setdefault((mode, kind, tree), []).append(_measure(kind, env, work, serve))
    rows = []
    for mode in modes:
        for kind in KINDS:
            base = statistics.median(times[(mode, kind, trees[0])])
            for tree in trees:
                median = statistics.median(times[(mode, kind, tree)])
                rows.append([kind, "cached" if mode == "on" else "none", tree, f"{median * 1000:.0f}", f"{median / base:.2f}"])
    print("\n".join(format_table(["what", "bytecode", "tree", "median ms", "vs first"], rows, left=3)))
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}; {args.runs} interleaved rounds")


def _config(work: Path, name: str) -> Path:
    """A daemon configuration ``name`` (its own socket and cache) of one ``file://`` pipeline
    over a few small items."""
    data = work / "data"
    for i in range(4):
        (data / f"item{i}").mkdir(parents=True, exist_ok=True)
        (data / f"item{i}" / "f").write_bytes(b"x" * 1000)
    config = work / f"{name}.yaml"
    config.write_text(
        f"socket: {work / name}.sock\n"
        f"pipelines:\n  train:\n    source: file://{data}/\n    cache_dir: {work / name}-cache\n    capacity: 1MiB\n"
    )
    return config


def _env(tree: str, bytecode: str, work: Path) -> dict[str, str | None]:
    """The environment's changes for ``tree`` with or without cached bytecode (None: unset)."""
    tree_only = {"PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}  # not the working directory's cachepipe first
    if bytecode == "on":
        return {**tree_only, "PYTHONDONTWRITEBYTECODE": None, "PYTHONPYCACHEPREFIX": str(work / "pycache")}
    return {**tree_only, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": None}


def _measure(kind: str, changes: dict[str, str | None], work: Path, serve: Path) -> float:
    """Seconds of one start of ``kind`` with the environment ``changes``."""
    if kind == "serve":
        command = [sys.executable, "-m", "cachepipe.cli", "serve", "--config", str(serve)]
        daemon = DaemonProcess(serve, env=changes, command=command)
        start = time.perf_counter()
        daemon.start()
        took = time.perf_counter() - start
        if daemon.stop() != 0:
            raise RuntimeError(f"the daemon did not stop cleanly: {daemon.log()}")
        daemon.close()
        return took
    args = ["--help"] if kind == "help" else ["status", "-s", str(work / "status.sock")]
    env = {k: v for k, v in {**os.environ, **changes}.items() if v is not None}
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "cachepipe", *args], env=env, stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
