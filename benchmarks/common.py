"""Pieces shared by the benchmark scripts in this folder.

The scripts are run as ``python benchmarks/bench_x.py``, so this folder is on ``sys.path`` and
they import from here with ``from common import ...``. Nothing here measures anything; it is
the scaffolding around the measurements:

- the generated datasets (:class:`Case`, :func:`build_cases`) and their :func:`upload`;
- a moto S3 :class:`Server` on 127.0.0.1, in a child process or in a thread;
- a consumer that reads every byte (:func:`read_folder`) and the cache-peak sampler
  (:class:`PeakSampler`);
- the command-line options the dataset scripts share, and the report: command echo, machine,
  table layout, JSON or table output.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import multiprocessing
import os
import platform
import random
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

MIB = 1024**2
KIB = 1024
BUCKET = "bench"
CREDENTIALS = "bench"  # the local server accepts any key pair
READ_CHUNK = 1 * MIB
SAMPLE_INTERVAL = 0.005  # peak sampler period, seconds


# ---- datasets ------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """A generated dataset: ``folders`` folders, each with the files ``{name: bytes}``."""

    name: str
    folders: int
    files: dict[str, int]

    @property
    def prefix(self) -> str:
        """``bucket/name``: where :func:`upload` puts the dataset."""
        return f"{BUCKET}/{self.name}"

    @property
    def folder_bytes(self) -> int:
        return sum(self.files.values())

    @property
    def total_bytes(self) -> int:
        return self.folders * self.folder_bytes

    def describe(self, largest_first: bool = False) -> str:
        """``"4 folders x 2 files (1 KiB/1 MiB), 4.2 MB"``: the distinct file sizes, smallest first
        unless ``largest_first``."""
        each = "/".join(_human(s) for s in sorted(set(self.files.values()), reverse=largest_first))
        return f"{self.folders} folders x {len(self.files)} files ({each}), {self.total_bytes / 1e6:.1f} MB"


def _human(n: int) -> str:
    """``n`` bytes as a whole number of MiB or KiB when it is one, else in bytes."""
    for unit, size in (("MiB", MIB), ("KiB", KIB)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def build_cases(args: argparse.Namespace) -> list[Case]:
    """The ``video`` and ``small-files`` datasets, sized by the options of :func:`add_dataset_options`."""
    video = Case("video", args.folders, {"video.mp4": int(args.video_mib * MIB), "text.txt": 1 * KIB})
    small = Case("small-files", args.small_folders, {f"part{i:02d}.bin": args.small_kib * KIB for i in range(args.small_files)})
    return [video, small]


def upload(endpoint: str, cases: Iterable[Case]) -> None:
    """Create the bucket and put every file of ``cases`` (seeded random bytes) at ``case.prefix/folderNNN/``."""
    import boto3

    s3 = boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=CREDENTIALS, aws_secret_access_key=CREDENTIALS
    )
    s3.create_bucket(Bucket=BUCKET)
    jobs = []
    for case in cases:
        rng = random.Random(case.name)
        for i in range(case.folders):
            for rel, size in case.files.items():
                jobs.append((f"{case.name}/folder{i:03d}/{rel}", rng.randbytes(size)))
    with ThreadPoolExecutor(8) as pool:
        for _ in pool.map(lambda job: s3.put_object(Bucket=BUCKET, Key=job[0], Body=job[1]), jobs):
            pass


# ---- the S3 server -------------------------------------------------------------------
def _moto_server() -> Any:
    """A started ``ThreadedMotoServer`` on 127.0.0.1, a free port, werkzeug's request log off."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    return server


def _serve(conn: Any) -> None:
    """Child process: run a moto server, report its address, answer CPU queries until told to stop.

    Its stdout is the parent's, where a benchmark may print its JSON report; moto ``print``s a
    diagnostic when it cannot tell a request's service (the OBS SDK's V2 signatures, see
    ``bench_obs_vs_s3.py``), so the child writes to stderr instead."""
    sys.stdout = sys.stderr
    server = _moto_server()
    try:
        conn.send(server.get_host_and_port())
        while True:
            try:
                command = conn.recv()
            except EOFError:  # the parent went away
                return
            if command == "cpu":
                conn.send(time.process_time())
            else:
                return
    finally:
        server.stop()
        conn.close()


class Server:
    """A moto S3 server on 127.0.0.1, in a child process (``mode="subprocess"``) or in a thread
    of this one (any other mode); its address is :attr:`endpoint`. Call :meth:`stop` when done."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._proc: Any = None
        self._conn: Any = None
        self._server: Any = None
        if mode == "subprocess":
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            self._proc = ctx.Process(target=_serve, args=(child,), name="bench-moto", daemon=True)
            self._proc.start()
            child.close()
            try:
                if not self._conn.poll(60):
                    raise RuntimeError("the moto server process did not report its address within 60 s")
                host, port = self._conn.recv()
            except (EOFError, RuntimeError) as exc:
                self._proc.join(5)
                code = self._proc.exitcode
                self.stop()
                raise RuntimeError(f"the moto server process failed to start (exit code {code})") from exc
        else:
            self._server = _moto_server()
            host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far by the server process (None when it shares this process)."""
        if self._conn is None:
            return None
        self._conn.send("cpu")
        return float(self._conn.recv())

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._proc is not None:
            try:
                self._conn.send("stop")
            except OSError:
                pass
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.terminate()
                self._proc.join(5)
            self._conn.close()
            self._proc = None


# ---- the consumer and the cache-peak sampler -----------------------------------------
def read_folder(root: Path, rels: Iterable[str]) -> int:
    """Read every byte of the given files under ``root``; return the byte count."""
    buf = bytearray(READ_CHUNK)
    total = 0
    for rel in rels:
        with open(root / rel, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total


def tree_size(root: str, block: int = 0) -> int:
    """Bytes of the regular files under ``root``. Each directory is listed completely before the
    walk descends, and cachepipe's state folder (``.cachepipe``, holding staging) is walked
    before the items: so a file that a publish renames from staging into place, or an
    acknowledgement renames from its place into staging, is never counted twice (at worst
    missed by one sample). ``block`` (above 0): as a cache's capacity counts them, each file in
    whole blocks of it and a block for each folder under ``root`` (not ``root`` itself)."""
    total = 0
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name != ".cachepipe")
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        try:
            if entry.is_dir(follow_symlinks=False):
                total += block + tree_size(entry.path, block)
            elif entry.is_file(follow_symlinks=False):
                size = entry.stat(follow_symlinks=False).st_size
                total += -(-size // block) * block if block else size
        except FileNotFoundError:
            continue
    return total


class PeakSampler:
    """A thread that samples the bytes under ``root`` every ``interval`` seconds and keeps the
    peak (:attr:`peak`, over :attr:`samples` samples); a context manager. ``block``: counted as
    a cache's capacity counts them (see :func:`tree_size`). ``limit``: a function giving the
    bound in force (a capacity that changes while it samples); each sample over the larger of
    what it gave before and after the sample's walk is kept in :attr:`over` as ``(bytes, bound)``."""

    def __init__(
        self, root: Path, interval: float = SAMPLE_INTERVAL, block: int = 0, limit: Callable[[], int] | None = None
    ) -> None:
        self.root = str(root)
        self.interval = interval
        self.block = block
        self.limit = limit
        self.over: list[tuple[int, int]] = []
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler")

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            before = self.limit() if self.limit is not None else 0
            size = tree_size(self.root, self.block)
            self.peak = max(self.peak, size)
            self.samples += 1
            if self.limit is not None and size > (bound := max(before, self.limit())):
                self.over.append((size, bound))


# ---- command line --------------------------------------------------------------------
def add_dataset_options(p: argparse.ArgumentParser, defaults: Mapping[str, tuple[float, float]]) -> None:
    """Add ``--folders``, ``--video-mib``, ``--small-folders``, ``--small-files`` and ``--small-kib``
    (the sizes of :func:`build_cases`). ``defaults`` maps each dest to ``(default, with --quick)``,
    shown in the help; fill them in with :func:`apply_defaults`."""
    for dest, kind, what in (
        ("folders", int, "folders in the video case"),
        ("video_mib", float, "MiB of video.mp4 per folder"),
        ("small_folders", int, "folders in the small-files case"),
        ("small_files", int, "files per folder in the small-files case"),
        ("small_kib", int, "KiB per small file"),
    ):
        full, quick = defaults[dest]
        p.add_argument(f"--{dest.replace('_', '-')}", type=kind, help=f"{what} (default {full:g}; --quick {quick:g})")


def add_cachepipe_options(p: argparse.ArgumentParser) -> None:
    """Add ``--max-concurrency``, ``--max-large-requests`` and ``--part-size``, the Pipeline
    settings under test (defaults: the library's)."""
    from cachepipe.config import PipelineConfig

    fields = PipelineConfig.model_fields
    for name in ("max_concurrency", "max_large_requests"):
        default = fields[name].default
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"cachepipe {name} (default {default})")
    p.add_argument(
        "--part-size",
        default=None,
        help="cachepipe part_size (default: the library's, capacity/(2 x max_large_requests), 1-8 MiB)",
    )


def add_server_option(p: argparse.ArgumentParser) -> None:
    """Add ``--server {subprocess,inprocess}``, the ``mode`` of :class:`Server`."""
    p.add_argument(
        "--server",
        choices=("subprocess", "inprocess"),
        default="subprocess",
        help="run the moto server in a child process (default) or in a thread of this process",
    )


def apply_defaults(args: argparse.Namespace, defaults: Mapping[str, tuple[float, float]]) -> None:
    """Set each option of ``defaults`` left unset (None) to its default, or its ``--quick`` one."""
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)


def check_positive(p: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """Exit with a usage error unless every integer option in ``names`` is at least 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")


def source_trees(p: argparse.ArgumentParser, given: Sequence[str]) -> list[str]:
    """``--trees``, resolved; exit with a usage error naming one that is not a cachepipe source
    tree (no ``cachepipe/__init__.py``)."""
    trees = [str(Path(t).resolve()) for t in given]
    for tree in trees:
        if not (Path(tree) / "cachepipe" / "__init__.py").is_file():
            p.error(f"--trees {tree!r}: not a cachepipe source tree (no cachepipe/__init__.py)")
    return trees


def parse_capacity(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Check ``--capacity`` and ``--part-size`` (usage error if invalid); return the capacity in bytes."""
    from cachepipe import parse_size

    try:
        capacity = parse_size(args.capacity, "--capacity")
        if args.part_size is not None:
            parse_size(args.part_size, "--part-size")
    except ValueError as exc:
        p.error(str(exc))
    return capacity


# ---- report --------------------------------------------------------------------------
def command_line() -> str:
    """The command that started this process, quoted for a shell (for the report)."""
    return shlex.join(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist``, or ``"?"`` if it is not installed."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def machine_info() -> dict[str, Any]:
    """Cores, platform and Python version of this machine (for the report)."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(terse=True), "python": platform.python_version()}


def file_system_of(path: str) -> str:
    """What holds the folder ``path``: its file system type as the cache sees it
    (:func:`cachepipe.fscalls.filesystem_at`), and for ext3/ext4 whether it has a journal
    (``/proc/fs/jbd2`` lists the block devices, by their kernel names, that have one; an ext4
    made without one checks at every create that the inode it reuses was not deleted moments
    ago); "?" if unknown."""
    from cachepipe.fscalls import filesystem_at

    kind = filesystem_at(path)
    if kind not in ("ext3", "ext4"):
        return kind or "?"
    try:
        dev = os.stat(path).st_dev
        name = os.path.basename(os.path.realpath(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"))
    except OSError:
        return kind
    return f"{kind}, {'journaled' if os.path.exists(f'/proc/fs/jbd2/{name}-8') else 'no journal'}"


def provenance_lines(report: Mapping[str, Any]) -> list[str]:
    """The ``command:`` and ``date: ...; machine: ...`` lines under a table."""
    m = report["machine"]
    return [
        f"command: {report['command']}",
        f"date: {report['date']}; machine: {m['cpus']} cores, {m['platform']}, "
        f"Python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()),
    ]


def tree() -> str:
    """The cachepipe being measured: its folder and, in a git work tree, its commit."""
    import cachepipe  # here: the rest of this module serves runs without cachepipe too

    where = Path(cachepipe.__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = "?"
    return f"{where} ({rev})"


def print_seeds_report(
    tree: str, timeout: float, summary: dict[str, Any], rows: list[dict[str, Any]], render: Callable[[Any], str], as_json: bool
) -> None:
    """Print a stress script's report (``stress_node.py``, ``stress_pipeline.py``): the command,
    the ``tree`` measured, the date, the take ``timeout``, the ``summary`` and every seed's row;
    as JSON, or as ``render(report)``."""
    report = {
        "command": command_line(),
        "tree": tree,
        "date": date.today().isoformat(),
        "timeout": timeout,
        "summary": summary,
        "runs": rows,
    }
    print(json.dumps(report, indent=1) if as_json else render(report))


def seeds_footer(report: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """The last lines of a stress script's report (``stress_node.py``, ``stress_pipeline.py``):
    each seed's messages under ``keys`` and its peak over the capacity, then the command, the
    tree, the date and the take timeout."""
    lines = []
    for r in report["runs"]:
        for key in keys:
            lines.extend(f"seed {r['seed']} {key}: {message}" for message in r[key])
        if r["over_capacity"]:
            lines.append(f"seed {r['seed']}: peak {r['peak']} bytes over the capacity {r['capacity']}")
    return [
        *lines,
        f"command: {report['command']}",
        f"tree: {report['tree']}; date: {report['date']}; take timeout {report['timeout']:g} s",
    ]


def format_table(cols: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> list[str]:
    """Header, dashes, rows: columns as wide as their widest cell, the first ``left`` left-aligned
    and the rest right-aligned, two spaces apart."""
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=False)))

    return [line(cols), "  ".join("-" * w for w in widths), *(line(row) for row in rows)]


def progress(message: str) -> None:
    """A progress line on stderr (stdout carries the report)."""
    print(message, file=sys.stderr, flush=True)


def print_report(report: Mapping[str, Any], render: Callable[[Any], str], as_json: bool) -> None:
    """Print ``report`` as JSON, or as ``render(report)`` followed by its ``total_seconds``."""
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        print(f"total run time {report['total_seconds']:.1f} s")
