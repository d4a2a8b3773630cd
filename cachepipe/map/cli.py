"""The command line of ``cachepipe map`` (see :mod:`cachepipe.map` for what it does): its
options, and :func:`run_map_command`, which runs :func:`~cachepipe.map.run.map_items` from them."""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..errors import CachePipeError, ConfigError, closest

__all__ = ["add_map_parser", "main", "run_map_command"]

_DESCRIPTION = """\
Run CMD once per item of SRC (a first-level folder, or an object with --items files) with the
item's local path as {} and an empty output folder as {out}; upload what CMD writes to
DST/<item>/, then the marker DST/<item>/.cachepipe-done; delete input and output. Bytes under
--cache never exceed --capacity: each of --jobs jobs keeps a reserve for its outputs
(--out-reserve or --out-ratio), downloads get the rest. Items already done in DST by the same
command (CMD ARGS compared as text, and --unpack) are skipped; an item done by another command,
or whose input changed, is run again and its outputs replaced (the summary and --dry-run say
how many): to keep them, rerun the exact command that made them. Across nodes, W processes
given --rank 0..W-1 --world-size W (or run by torchrun, a Kubernetes Indexed Job or a Slurm
array) each take a disjoint, byte-balanced share of SRC."""

_EPILOG = """\
examples:
  cachepipe map s3://b/shards/ s3://b/clips/ --items files --unpack --cache /mnt/ssd/c \\
      --capacity 20GiB --jobs 4 --out-ratio 2 -- python split.py {} {out}
  cachepipe map s3://b/ss/ s3://b/ss-video/ --items files --unpack --cache /tmp/c --capacity 50GiB

exit status: 0 every item done (or already done); 1 an item failed (--dry-run: would be refused) or an error;
2 usage; 130 interrupted (Ctrl-C); 143 terminated (SIGTERM: stopped as Ctrl-C stops it; a second signal
while it stops is ignored, a third, or SIGKILL, ends it at once)
"""


def _add_options(parser: argparse.ArgumentParser | Any, suppress: bool) -> None:
    d = (lambda _v: argparse.SUPPRESS) if suppress else (lambda v: v)
    parser.add_argument("--cache", dest="cache", default=d(None), metavar="DIR", help="cache directory (required)")
    parser.add_argument("--capacity", default=d(None), help="hard cap on bytes under --cache: '20GiB', '80%%' (required)")
    parser.add_argument("--jobs", "-j", type=int, default=d(1), help="commands running at once (default 1)")
    parser.add_argument("--out-reserve", default=d(None), metavar="SIZE", help="space for one item's outputs, e.g. '2GiB'")
    parser.add_argument(
        "--out-ratio",
        type=float,
        default=d(None),
        metavar="R",
        help="space for one item's outputs, as R x the command's input (the item, or its extracted files; default 1.0)",
    )
    parser.add_argument(
        "--out-margin",
        default=d(None),
        metavar="SIZE",
        help="extra space per job for writes between two size checks (default min(reserve, 64MiB))",
    )
    parser.add_argument(
        "--items",
        choices=("folders", "files"),
        default=d("folders"),
        help="an item is a first-level folder (default) or an object",
    )
    parser.add_argument(
        "--manifest",
        default=d(None),
        metavar="FILE|URL",
        help="plan from this listing of SRC (written by `cachepipe index`) instead of listing SRC: give every rank the same one",
    )
    parser.add_argument(
        "--unpack",
        action="store_true",
        default=d(False),
        help=(
            "extract archives (tar, tar.gz, tar.zst, zip, split volumes) before CMD; without CMD the extracted files are uploaded"
        ),
    )
    parser.add_argument(
        "--unpack-ratio",
        type=float,
        default=d(None),
        metavar="R",
        help=(
            "space for one item's extracted files, as R x its size "
            "(default 1.25: archives of video, images, audio; compressible data needs its compression ratio)"
        ),
    )
    parser.add_argument("--timeout", type=float, default=d(None), metavar="S", help="seconds per attempt of CMD")
    parser.add_argument("--retries", type=int, default=d(2), help="more attempts of a failed item (default 2)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        default=d(False),
        help="list what would run (marking the items done before, to run again) and what it could delete, and exit",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", default=d(True), help="no progress bar")
    parser.add_argument(
        "--storage-option",
        "-o",
        action="append",
        default=d([]),
        metavar="KEY=VALUE",
        help="storage option for SRC and DST (repeat; VALUE parsed as JSON when it can be)",
    )
    parser.add_argument(
        "--dest-option", action="append", default=d([]), metavar="KEY=VALUE", help="storage option for DST only (repeat)"
    )
    parser.add_argument("--upload-concurrency", type=int, default=d(8), help="files uploaded at once (default 8)")
    parser.add_argument(
        "--upload-part-size", default=d("16MiB"), metavar="SIZE", help="multipart part size, 5MiB to 5GiB (default 16MiB)"
    )
    parser.add_argument("--max-concurrency", type=int, default=d(64), help="download requests in flight (default 64)")
    parser.add_argument(
        "--max-large-requests",
        type=int,
        default=d(16),
        help="of those, most for items with a file over 256 KiB (default 16)",
    )
    parser.add_argument(
        "--verify",
        choices=("size", "etag"),
        default=d("size"),
        help="check each input file's size (default), or also its MD5 against its ETag where that is an MD5 (else fetched again)",
    )
    parser.add_argument(
        "--rank",
        type=int,
        default=d(None),
        metavar="R",
        help=(
            "this process's share of SRC, 0 <= R < --world-size (default: from RANK, JOB_COMPLETION_INDEX "
            "or SLURM_ARRAY_TASK_ID; else 0 of 1)"
        ),
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=d(None),
        metavar="W",
        help=(
            "processes sharing SRC, each with its own --rank (default: from WORLD_SIZE, CACHEPIPE_WORLD_SIZE "
            "or SLURM_ARRAY_TASK_COUNT)"
        ),
    )
    parser.add_argument("--verbose", "-v", action="count", default=d(0), help="log each item (-vv: each file uploaded)")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="dataset URL (s3://, obs://, file://, ...)")
    parser.add_argument("dest", metavar="DST", help="results URL: item X goes to DST/X/")
    _add_options(parser, suppress=False)
    parser.add_argument(
        "cmd",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ARGS",
        help="command run per item ({} item path, {out} output folder, {name} item name)",
    )


def add_map_parser(subparsers: Any) -> None:
    """Add the ``map`` subcommand to a ``cachepipe`` argparse ``subparsers`` object."""
    parser = subparsers.add_parser(
        "map",
        help="run a command on every item and upload its results",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)


class _UsageError(ConfigError):
    """A command line that is not one: exit status 2, as argparse's own errors."""


def _option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise _UsageError(f"storage option {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _option_errors(exc: ValueError) -> str | None:
    """An option's value refused by :class:`~cachepipe.map.plan.MapConfig` (pydantic), one line
    per error naming the flag (``--jobs 0: ...``); None for any other ValueError."""
    from pydantic import ValidationError

    if not isinstance(exc, ValidationError):
        return None
    named = {"source": "SRC", "dest": "DST", "command": "CMD"}
    lines = []
    for err in exc.errors(include_url=False):
        message = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a check of several options: its input is all of them, credentials included
            lines.append(message)
            continue
        field = str(err["loc"][0])
        flag = named.get(field) or f"--{field.replace('_', '-')}"
        given = os.fspath(err["input"]) if isinstance(err["input"], os.PathLike) else err["input"]  # a path as typed
        lines.append(f"{flag} {given!r}: {message}")
    return "; ".join(lines)


class _Terminated(KeyboardInterrupt):
    """SIGTERM (``docker stop``, ``kubectl delete``, ``timeout``): stopped like Ctrl-C, so that the
    commands' process groups are killed and the slots cleared; exit status 143."""


_ALREADY = (
    b"cachepipe map: already stopping (commands killed, uploads in flight ending); "
    b"a third signal (or SIGKILL) ends it at once, and the next run resumes\n"
)
_FORCED = b"cachepipe map: ended at once by a third signal, uploads in flight cut short; the next run resumes\n"


class _StopSignals:
    """SIGTERM and Ctrl-C (SIGINT) during a run: the first raises in the main thread
    (:class:`_Terminated`, or ``KeyboardInterrupt`` as Python's own handler does), and the run
    stops; each one after it is ignored, noted once on stderr, until the process exits. Raised
    into the stop, a second one cut it short (the jobs not joined, the slots left, an error of
    what was half closed), and one that came once the handlers were put back killed the process
    (exit -15, not 143). So in a process that ends with the run (``exits``: the command line's
    own), the handlers are put back only if no signal came; after a stop both signals stay
    ignored until it exits (SIGKILL still ends it at once; the next run resumes). Called from
    Python (``exits`` false), the caller's handlers are put back whatever came: ignored, its
    Ctrl-C and SIGTERM would be lost for as long as it runs. SIGINT is taken only from Python's
    own handler (one that ignores it, as in a background job, is kept).

    A third signal during the stop ends the process at once (``os._exit``, with the first
    signal's status, 143 or 130), as SIGKILL would, in a process that ends with the run: a stop
    held by an upload that hangs can take minutes (the store's timeouts and retries), and a user
    who pressed Ctrl-C twice should not need to find the process's pid. What it leaves (a
    command's slot, a download, an upload without its marker) is what the next run clears."""

    def __init__(self, exits: bool) -> None:
        self._exits = exits
        self.stopping = False
        self._later = 0  # signals after the first
        self._status = 130
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopSignals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            if sig == signal.SIGTERM or signal.getsignal(sig) is signal.default_int_handler:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, previous in self._previous.items():
            # after a stop in a process that exits, ignored at the system's level: the interpreter's exit
            # puts back the default action of a signal whose handler is a Python function (not of one ignored)
            signal.signal(sig, signal.SIG_IGN if self.stopping and self._exits else previous)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stopping:
            self._later += 1
            if self._later == 1:
                os.write(2, _ALREADY)  # not print: the main thread may be inside a print to stderr
            elif self._exits:
                os.write(2, _FORCED)
                os._exit(self._status)
            return
        self.stopping = True
        self._status = 143 if signum == signal.SIGTERM else 130
        raise _Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def run_map_command(args: argparse.Namespace, exits: bool = False) -> int:
    """Run ``cachepipe map`` from parsed arguments; print the summary; return the exit status.
    SIGTERM stops the run as Ctrl-C does (exit status 143); a signal after the first, while
    the run stops, is ignored (see :class:`_StopSignals`). ``exits``: the process exits once
    this returns (the command line's own run): after a stop, both signals stay ignored until
    then; else the caller's handlers are put back."""
    if threading.current_thread() is not threading.main_thread():
        return _run_map_command(args)  # signal handlers belong to the main thread
    try:
        with _StopSignals(exits):
            return _run_map_command(args)
    except KeyboardInterrupt as exc:  # between the command's own handling and the handlers' end: still a clean stop
        return _stopped(exc)


def _stopped(exc: KeyboardInterrupt) -> int:
    """Say that a signal stopped the run (one write: a note of a later signal's comes whole
    before or after it); return the exit status, 143 for SIGTERM, 130 for Ctrl-C."""
    how, status = ("terminated (SIGTERM)", 143) if isinstance(exc, _Terminated) else ("interrupted", 130)
    sys.stderr.write(f"cachepipe map: {how}; run the same command again to resume\n")
    sys.stderr.flush()
    return status


def _check_dest_given(dest: str) -> None:
    """Refuse as a usage error a DST that is the command's first word: DST left out
    (``cachepipe map SRC --cache C --capacity N -- cp -r {} {out}``), argparse takes the word
    after ``--`` as DST. Said when DST names a program on ``PATH`` and is neither a URL nor a
    path (no ``/``) nor an existing file or folder."""
    if "://" not in dest and "/" not in dest and not os.path.exists(dest) and shutil.which(dest):
        raise _UsageError(
            f"DST {dest!r} is a command: give DST before the options and '--' "
            "(cachepipe map SRC DST --cache DIR --capacity SIZE -- CMD ARGS)"
        )


def _run_map_command(args: argparse.Namespace) -> int:
    from .result import format_plan, format_summary
    from .run import map_items  # the pipeline: imported by the command that runs it, not by `cachepipe --help`

    rest = list(args.cmd or [])
    if "--" in rest:  # argparse hands everything after SRC DST here: options, then '--', then CMD
        cut = rest.index("--")
        options, command = rest[:cut], rest[cut + 1 :]
    elif rest and rest[0].startswith("-"):
        options, command = rest, []
    else:
        options, command = [], rest
    late = argparse.ArgumentParser(prog="cachepipe map", add_help=False)
    _add_options(late, suppress=True)
    try:
        _check_dest_given(args.dest)
        parsed, unknown = late.parse_known_args(options)
        if unknown:
            flags = [a for a in late._option_string_actions if a.startswith("--")]  # noqa: SLF001 - argparse's own table
            meant = [f"{a} (did you mean {m}?)" for a in unknown if a.startswith("--") and (m := closest(a, flags))]
            hint = f"; {', '.join(meant)}" if meant else ": put the command after '--'"
            raise _UsageError(f"unrecognized arguments {unknown}{hint}")
        for key, value in vars(parsed).items():
            setattr(args, key, value)
        if not args.cache or not args.capacity:
            raise _UsageError("--cache and --capacity are required")
        if not command and not args.unpack:  # map_items says the same, as a ValueError: here a usage error
            raise _UsageError("nothing to do: give a command after '--' (cachepipe map SRC DST ... -- CMD {}), or --unpack")
        if args.rank is not None or args.world_size is not None:  # a flag refused: usage, as --jobs 0 is
            from .share import resolve_rank

            try:
                resolve_rank(os.environ, args.rank, args.world_size)
            except ConfigError as exc:
                raise _UsageError(str(exc)) from exc
        if args.verbose:
            logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
            logging.getLogger("cachepipe").setLevel(logging.DEBUG if args.verbose > 1 else logging.INFO)
        storage = dict(_option(o) for o in args.storage_option)
        dest_options = {**storage, **dict(_option(o) for o in args.dest_option)}
        options_map: dict[str, Any] = {
            "jobs": args.jobs,
            "items": args.items,
            "manifest": args.manifest,
            "unpack": args.unpack,
            "timeout": args.timeout,
            "retries": args.retries,
            "dry_run": args.dry_run,
            "progress": args.progress and not args.dry_run,
            "storage_options": storage,
            "dest_options": dest_options,
            "upload_concurrency": args.upload_concurrency,
            "upload_part_size": args.upload_part_size,
            "max_concurrency": args.max_concurrency,
            "max_large_requests": args.max_large_requests,
            "verify": args.verify,
            "rank": args.rank,
            "world_size": args.world_size,
        }
        for key in ("out_reserve", "out_ratio", "out_margin", "unpack_ratio"):
            if getattr(args, key) is not None:
                options_map[key] = getattr(args, key)
        result = map_items(command or None, args.source, args.dest, cache_dir=args.cache, capacity=args.capacity, **options_map)
    except KeyboardInterrupt as exc:
        return _stopped(exc)
    except _UsageError as exc:
        print(f"cachepipe map: {exc}; see cachepipe map --help", file=sys.stderr)
        return 2
    except ValueError as exc:
        usage = _option_errors(exc)
        if usage is None:
            print(f"cachepipe map: {exc}", file=sys.stderr)
            return 1
        print(f"cachepipe map: {usage}", file=sys.stderr)
        return 2
    except (TypeError, OSError, CachePipeError, ImportError) as exc:  # ImportError: a scheme's backend not installed (gs://)
        print(f"cachepipe map: {exc}", file=sys.stderr)
        return 1
    if args.dry_run:
        print(format_plan(result, args.dest))
        return 1 if result.refused else 0
    print(format_summary(result), file=sys.stderr)
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cachepipe.map SRC DST ...``: the ``map`` subcommand on its own. Given ``argv``
    (a call from Python), the caller's signal handlers are put back after a stop (see
    :func:`run_map_command`)."""
    parser = argparse.ArgumentParser(
        prog="cachepipe map", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_arguments(parser)
    args = parser.parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # a name of undecodable bytes printed as its bytes, as cachepipe's main does
        sys.stdout.reconfigure(errors="surrogateescape")
    return run_map_command(args, exits=argv is None)  # no argv: this process's own command line, which exits after it


if __name__ == "__main__":
    sys.exit(main())
