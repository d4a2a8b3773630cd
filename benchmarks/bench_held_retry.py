"""Benchmark: how long a node's takes wait for room that a consumer's late close frees, on NFS.

On NFS (and FUSE) a removed file that a process still holds open stays in its folder under a
hidden name (``.nfsXXXX``, ``.fuse_hidden*``) until it is closed, so an acknowledged item's
deletion fails meanwhile; the reaper holds its bytes (still counted) and tries the deletion
again (``cachepipe.removal.Reaper``). A download waiting for that room waits for the try after
the close.

Each run mounts the FUSE loopback ``tests/nfslike.py`` (root and libfuse 3 needed), puts the
cache of a :class:`~cachepipe.node.NodePipeline` on it (``--lanes`` lanes, a capacity of
``--room`` items as the cap counts them), over a local folder of ``--items`` folders of one file
of ``--size`` bytes, and runs one consumer thread per lane. Each consumer takes its next item,
then closes the file of the item before it, reads the new one and consumes it (acknowledges it
while its file is still open): it closes each file one step late. Reported per run: every
take's wait (from the call to ``take`` to its return), their median and maximum, and the takes
over 0.5 s.

Each tree in ``--trees`` runs in a fresh process with ``PYTHONPATH=TREE``, ``--runs`` rounds,
the trees' order flipped every round; the report gives each tree's medians over its rounds::

    git archive a4d7e35 | tar -x -C /tmp/before      # a tree to compare with
    python benchmarks/bench_held_retry.py --trees /tmp/before . --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

NFSLIKE = Path(__file__).resolve().parent.parent / "tests" / "nfslike.py"
SLOW = 0.5  # a take that waited longer counts as slow


def _mount(data: Path, mountpoint: Path) -> subprocess.Popen[bytes]:
    """Mount ``tests/nfslike.py`` of ``data`` at ``mountpoint``; its process."""
    data.mkdir()
    mountpoint.mkdir()
    fs = subprocess.Popen([sys.executable, str(NFSLIKE), str(data), str(mountpoint), "nfs"])
    deadline = time.monotonic() + 60
    while not os.path.ismount(mountpoint):
        if fs.poll() is not None or time.monotonic() > deadline:
            fs.kill()
            raise RuntimeError(f"could not mount {NFSLIKE} at {mountpoint} (root and libfuse 3 needed)")
        time.sleep(0.02)
    return fs


def _unmount(fs: subprocess.Popen[bytes], mountpoint: Path) -> None:
    subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)
    try:
        fs.wait(timeout=30)
    except subprocess.TimeoutExpired:
        fs.kill()
        fs.wait()


def one_run(items: int, size: int, lanes: int, room: float, work: Path) -> dict[str, object]:
    """One run on the tree imported: every take's wait in seconds, and the run's wall time."""
    from cachepipe.node import NodePipeline
    from cachepipe.plan import Cursor

    source = work / "src"
    for i in range(items):
        (source / f"i{i:04d}").mkdir(parents=True)
        (source / f"i{i:04d}" / "f").write_bytes(os.urandom(size))
    mountpoint = work / "nfs"
    fs = _mount(work / "nfs.data", mountpoint)
    try:
        cache = mountpoint / "c"
        cache.mkdir()
        block = min(max(os.statvfs(cache).f_frsize, 512), 64 * 1024)
        taken = -(-size // block) * block + block  # an item as the cap counts it: its file and its folder
        pipe = NodePipeline(str(source), cache, f"{int(room * taken)}B", ranks=list(range(lanes)), world_size=lanes)
        waits: list[float] = []
        errors: list[BaseException] = []

        def lane(rank: int) -> None:
            cursor, held = Cursor(0, 0), None
            try:
                while True:
                    start = time.monotonic()
                    got = pipe.take(rank, 0, cursor, timeout=120)
                    if got is not None:
                        waits.append(time.monotonic() - start)
                    if held is not None:
                        held.close()  # the previous item's file, one step late
                        held = None
                    if got is None:
                        return
                    held = open(got.item.path / "f", "rb")  # noqa: SIM115 - closed after the next take
                    held.read()
                    cursor = got.after
                    pipe.consume(rank, 0, cursor)  # acknowledged while its file is open
            except BaseException as exc:  # noqa: BLE001 - reported by the run
                errors.append(exc)
            finally:
                if held is not None:
                    held.close()

        start = time.monotonic()
        with pipe:
            threads = [threading.Thread(target=lane, args=(r,)) for r in range(lanes)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.monotonic() - start
        if errors:
            raise RuntimeError(f"a lane failed: {errors[0]!r}") from errors[0]
    finally:
        _unmount(fs, mountpoint)
    return {"waits": waits, "wall": wall}


def _summary(waits: list[float]) -> tuple[float, float, int]:
    return statistics.median(waits), max(waits), sum(w > SLOW for w in waits)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", default=["."], help="source trees to compare, the first the baseline")
    p.add_argument("--items", type=int, default=50, help="items, each a folder of one file (default 50)")
    p.add_argument("--size", type=int, default=256 * 1024, help="bytes per item (default 262144)")
    p.add_argument("--lanes", type=int, default=2, help="lanes of the node (default 2)")
    p.add_argument("--room", type=float, default=6, help="capacity in items (default 6)")
    p.add_argument("--runs", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--dir", default=None, help="where the source and the mount go (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print every run as JSON")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one run on the tree imported
    args = p.parse_args()
    if args.one:
        with tempfile.TemporaryDirectory(prefix="cachepipe-held-", dir=args.dir) as tmp:
            print(json.dumps(one_run(args.items, args.size, args.lanes, args.room, Path(tmp))))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import command_line, format_table, machine_info, progress, source_trees

    trees = source_trees(p, args.trees)
    runs: dict[str, list[dict[str, object]]] = {tree: [] for tree in trees}
    for run in range(args.runs):
        for tree in trees if run % 2 == 0 else trees[::-1]:
            progress(f"round {run + 1} of {args.runs}: {tree}")
            child = [sys.executable, __file__, "--one", *_passed(args)]
            env = {**os.environ, "PYTHONPATH": tree, "PYTHONSAFEPATH": "1"}
            done = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{tree}: child exited {done.returncode}: {done.stderr[-2000:]}")
            got = json.loads(done.stdout)
            median, longest, slow = _summary(got["waits"])
            progress(f"  takes {len(got['waits'])}, median {median:.3f} s, max {longest:.3f} s, over {SLOW} s {slow}")
            runs[tree].append(got)
    if args.json:
        print(json.dumps({"command": command_line(), "machine": machine_info(), "runs": runs}, indent=2))
        return
    rows = []
    for tree in trees:
        each = [_summary(r["waits"]) for r in runs[tree]]  # type: ignore[arg-type]
        rows.append([
            tree,
            f"{statistics.median(e[0] for e in each):.3f}",
            f"{statistics.median(e[1] for e in each):.3f}",
            f"{statistics.median(e[2] for e in each):g}",
            " ".join(str(e[2]) for e in each),
            f"{statistics.median(r['wall'] for r in runs[tree]):.1f}",  # type: ignore[misc]
        ])  # fmt: skip
    print(
        f"{args.lanes} lanes, {args.items} items of {args.size} B, room {args.room:g} items, on tests/nfslike.py; "
        f"each file closed one step late (after the next take):"
    )
    cols = ["tree", "median wait s", "max wait s", f"takes > {SLOW} s", "each round", "wall s"]
    print("\n".join(format_table(cols, rows)))
    m = machine_info()
    print(f"command: {command_line()}")
    print(f"machine: {m['cpus']} cores, {m['platform']}, Python {m['python']}; medians of {args.runs} interleaved rounds")
    print(f"load average at the end: {os.getloadavg()}", flush=True)


def _passed(args: argparse.Namespace) -> list[str]:
    """The options a child runs with."""
    given = ["--items", str(args.items), "--size", str(args.size), "--lanes", str(args.lanes), "--room", str(args.room)]
    return given + (["--dir", args.dir] if args.dir else [])


if __name__ == "__main__":
    main()
