"""The ``cachepipe`` command::

    cachepipe serve --config /etc/cachepipe/cachepipe.yaml [--check]
    cachepipe next    [--pipeline NAME] [--timeout S] [--json | --with-lease]  prints the item's local path
    cachepipe ack     PATH [--lease ID]                            evict a finished item
    cachepipe release PATH [--lease ID]                            give it back to the queue
    cachepipe renew   PATH [--lease ID]                            extend its lease
    cachepipe status  [--json]
    cachepipe wait    [--timeout S]                                until the daemon serves (scripts)
    cachepipe delete-job NAME [--force]                            end a job, deleting its cached items
    cachepipe index SRC -o DEST [--items folders|files]          list SRC once into a manifest
    cachepipe map SRC DST --cache DIR --capacity SIZE [--jobs N] [--unpack] ... -- CMD ARGS...
    cachepipe print-unit [NAME]      print a shipped systemd unit (default cachepipe.service)
    cachepipe print-config           print the example daemon config, every field documented

Client commands take ``--socket PATH`` (or ``http://HOST:PORT``); default ``$CACHEPIPE_SOCKET``,
else ``/run/cachepipe/cachepipe.sock``; and ``--startup-timeout S`` (default 10): how long to keep
trying while the daemon is starting or restarting (no socket yet, refused, or "stopping"; 0: fail
at once). ``wait`` waits ``--timeout`` seconds (default 30) for a daemon to serve.

Exit status: 0 success; 1 error (daemon unreachable, item failed...); 2 usage; 3 ``next``:
every item was delivered; 4 ``next``: no item within ``--timeout``; 5 ``ack``/``release``/
``renew`` refused (not handed out, or the lease expired and the item went to another consumer),
``delete-job`` refused (the job's lanes have not all consumed their share: ``--force``);
``wait``: 0 the daemon serves (it prints its health: ``ok``, or ``degraded`` when a pipeline is
down), 4 not serving within ``--timeout``, 1 cannot reach it for another reason (no permission
on its socket...). ``serve``: 78 invalid configuration, or one this host cannot run (a
``socket_group`` that does not exist, a directory it cannot create or write: what ``--check``
reports), or the ``service`` extra is not installed (one line naming the module and
``pip install 'cachepipe[service]'``); 1 the daemon could not start (store unreachable...).
Every command: 130 interrupted (Ctrl-C), one line, no traceback.
``index``: 0 written (it prints the count, bytes and digest), 1 the source or destination
failed (nothing to list, denied, unreachable...), 2 usage (a ``--storage-option`` not KEY=VALUE).
``map``: 0 when every item succeeded, 1 if any failed, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import __version__
from .client import DEFAULT_STARTUP_TIMEOUT
from .errors import UnknownItemError

if TYPE_CHECKING:
    from .client import Client

__all__ = ["EXIT_CONFIG", "EXIT_END", "EXIT_INTERRUPTED", "EXIT_REFUSED", "EXIT_TIMEOUT", "main"]

EXIT_END = 3
EXIT_TIMEOUT = 4
EXIT_REFUSED = 5
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command that Ctrl-C ended
EXIT_CONFIG = 78  # serve: invalid configuration, or this host cannot run it (the systemd unit does not restart)
_SERVICE_MODULES = frozenset({"prometheus_client"})  # the `service` extra: what `serve` needs beyond the core


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachepipe", description="Stream object-store datasets through a size-capped local cache."
    )
    parser.add_argument("--version", action="version", version=f"cachepipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve", usage="cachepipe serve --config FILE [--check]", help="run the daemon in the foreground (systemd: Type=notify)"
    )
    serve.add_argument(  # not required=True: its absence is explained (below), not only named
        "--config",
        "-c",
        metavar="FILE",
        help="config file (YAML, or TOML by its .toml suffix); `cachepipe print-config` prints an example",
    )
    serve.add_argument("--check", action="store_true", help="validate the config and exit")
    serve.add_argument("stray", nargs="*", help=argparse.SUPPRESS)  # a config given without --config: said (below)

    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--socket",
        "-s",
        default=None,
        help="daemon socket path or http://HOST:PORT (default: $CACHEPIPE_SOCKET or /run/cachepipe/cachepipe.sock)",
    )
    client.add_argument(
        "--startup-timeout",
        type=_seconds,
        default=DEFAULT_STARTUP_TIMEOUT,
        metavar="S",
        help=f"keep trying this long while the daemon starts or restarts (default {DEFAULT_STARTUP_TIMEOUT:g}; 0: fail at once)",
    )

    nxt = sub.add_parser("next", parents=[client], help="take the next item and print its local path")
    nxt.add_argument("--pipeline", "-p", default=None, help="pipeline name (default: the daemon's only one)")
    nxt.add_argument("--timeout", "-t", type=_seconds, default=None, help="seconds to wait for an item (default: no limit)")
    shown = nxt.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print the item as JSON (name, path, lease, size, files)")
    shown.add_argument(
        "--with-lease",
        action="store_true",
        help="print 'LEASE PATH': the lease id (no spaces in it), one space, the path (for a .done holding the lease)",
    )

    for verb, text in (
        ("ack", "acknowledge an item: the daemon deletes it"),
        ("release", "give an item back to the queue"),
        ("renew", "extend an item's lease"),
    ):
        cmd = sub.add_parser(verb, parents=[client], help=text)
        cmd.add_argument("path", help="the item's local path, as printed by `cachepipe next`")
        cmd.add_argument("--lease", "-l", default=None, help="lease id from `cachepipe next --json` (refused if it expired)")

    status = sub.add_parser("status", parents=[client], help="show the daemon's pipelines and jobs, with their counters")
    status.add_argument("--json", action="store_true", help="print the full status as JSON")

    delete = sub.add_parser("delete-job", parents=[client], help="end a job: its downloads stop, its cached items are deleted")
    delete.add_argument("job", metavar="NAME", help="the job's name, as `cachepipe status` lists it")
    delete.add_argument(
        "--force", "-f", action="store_true", help="delete it even if its lanes have not all consumed their share"
    )

    wait = sub.add_parser("wait", parents=[client], help="wait until the daemon serves (exit 0), or --timeout passes (4)")
    wait.add_argument("--timeout", "-t", type=_seconds, default=30.0, help="seconds to wait (default 30)")

    idx = sub.add_parser("index", help="list a source once and write its manifest (Pipeline(manifest=...))")
    idx.add_argument("source", metavar="SRC", help="dataset URL (s3://, obs://, file://, ...)")
    idx.add_argument(
        "--output", "-o", required=True, action=_OneOutput, metavar="DEST", help="manifest path or object URL (s3://b/p/m.gz)"
    )
    idx.add_argument("--items", choices=("folders", "files"), default="folders", help="item mode (default folders)")
    idx.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="storage option for SRC and DEST (repeat; VALUE parsed as JSON when it can be)",
    )
    idx.add_argument(
        "--dest-option", action="append", default=[], metavar="KEY=VALUE", help="storage option for DEST only (repeat)"
    )

    from .map.cli import add_map_parser

    add_map_parser(sub)

    unit = sub.add_parser("print-unit", help="print a systemd unit shipped with cachepipe")
    unit.add_argument(
        "name", nargs="?", default="cachepipe.service", help="cachepipe.service (default) or cachepipe@.service (one per config)"
    )
    sub.add_parser("print-config", help="print the example daemon config (/etc/cachepipe/cachepipe.yaml)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cachepipe`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    _print_names_as_bytes()
    try:
        return _run(args, exits=argv is None)
    except KeyboardInterrupt:  # Ctrl-C on a `next` waiting for its item or its daemon, a long `index`: no traceback
        print(f"cachepipe {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace, exits: bool) -> int:
    """The command ``args`` names; its exit status. ``exits``: the process exits after it (the
    console script's run, not a call of :func:`main` with arguments)."""
    if args.command == "serve":
        if args.stray:  # argparse would say "unrecognized arguments" under the top-level usage, naming no option
            stray = args.stray[0]
            hint = f"give the config file as --config {stray}" if args.config is None else f"the config is --config {args.config}"
            print(f"cachepipe serve: unexpected argument {stray!r}: {hint}", file=sys.stderr)
            return 2
        if args.config is None:
            print(
                "cachepipe serve: --config FILE is required: the daemon's socket and pipelines (or jobs section), "
                "in YAML or TOML. `cachepipe print-config > cachepipe.yaml` writes an example with every field "
                "documented; then `cachepipe serve --check --config cachepipe.yaml`",
                file=sys.stderr,
            )
            return 2
        try:
            from .service.main import check, serve
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] not in _SERVICE_MODULES:
                raise
            print(
                f"cachepipe serve: the Python module {exc.name!r} is not installed; it comes with the service extra: "
                "pip install 'cachepipe[service]'",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        return check(args.config) if args.check else serve(args.config)
    if args.command == "index":
        return _index(args)
    if args.command == "map":
        from .map.cli import run_map_command

        return run_map_command(args, exits=exits)
    if args.command in ("print-unit", "print-config"):
        return _print_shipped(args.name if args.command == "print-unit" else None)
    from .client import Client, ServiceError, default_socket

    address = args.socket or default_socket()
    # `wait` waits its --timeout for a daemon (its --startup-timeout does not apply); the others their --startup-timeout
    waits, option = (args.timeout, "--timeout") if args.command == "wait" else (args.startup_timeout, "--startup-timeout")
    told = waits > 0 and "://" not in address and not os.path.exists(address)
    if told:
        print(  # else it waits the whole startup timeout in silence before its error
            f"cachepipe {args.command}: no daemon socket at {address} yet; waiting up to {waits:g} s for "
            f"a daemon to start there ({option}; --socket or $CACHEPIPE_SOCKET for another one)",
            file=sys.stderr,
        )
    try:
        with Client(getattr(args, "pipeline", None), args.socket, auto_ack=False, startup_timeout=args.startup_timeout) as client:
            client._waits_told = told  # noqa: SLF001 - the wait said above is not logged again by the client
            if args.command == "wait":
                print(client.wait_ready(args.timeout).get("status", "ok"))
            elif args.command == "next":
                item = client.get(timeout=args.timeout)
                if item is None:
                    print("cachepipe: every item was delivered", file=sys.stderr)
                    return EXIT_END
                print(json.dumps(item.to_json()) if args.json else f"{item.lease} {item.path}" if args.with_lease else item.path)
            elif args.command in ("ack", "release", "renew"):
                getattr(client, args.command)(args.path, args.lease)
            elif args.command == "delete-job":
                return _delete_job(client, args.job, args.force)
            else:
                info = client.status()
                print(json.dumps(info, indent=2) if args.json else format_status(info))
    except TimeoutError as exc:
        print(f"cachepipe: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except UnknownItemError as exc:
        print(f"cachepipe: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except (ConnectionError, ServiceError, ValueError) as exc:
        print(f"cachepipe: {exc}", file=sys.stderr)
        return 1
    return 0


def _print_names_as_bytes() -> None:
    """Print a path as the bytes of its name: one of undecodable bytes (a Latin-1 ``café``, which
    Python holds as ``"caf\\udce9"``) is written as those bytes, which a shell consumer can open,
    under any locale; a strict stdout (``en_US.UTF-8``'s) refused it after ``next`` took the item.
    (``python -m cachepipe.map``, the other entry point, does the same.)"""
    if isinstance(sys.stdout, io.TextIOWrapper):  # not a stream a caller put in its place
        sys.stdout.reconfigure(errors="surrogateescape")


def _delete_job(client: Client, name: str, force: bool) -> int:
    """``cachepipe delete-job``: delete job ``name``, unless (without ``force``) its lanes have not
    all consumed their share: its cached items would go, and its lanes would register it again
    and download from the start. A name the daemon does not know is its error (naming its jobs)."""
    job = None if force else client.status().get("jobs", {}).get(f"job/{name}")
    if job is not None and (left := len(job["lanes"]) - job.get("lanes_done", 0)) > 0:
        endless = " (its plan has no end: epochs null)" if job["spec"].get("epochs", 1) is None else ""
        print(
            f"cachepipe: job {name!r}: {left} of its {len(job['lanes'])} lanes have not consumed their "
            f"share{endless}, {job.get('waiting', 0)} waiting for an item now; deleting it deletes its cached items, and "
            "a lane still reading registers it again and downloads from the start. --force deletes it anyway",
            file=sys.stderr,
        )
        return EXIT_REFUSED
    client.delete_job(name)
    return 0


def _index(args: argparse.Namespace) -> int:
    """``cachepipe index``: list, write the manifest, print what it holds."""
    from .config import check_destination, check_source, format_size
    from .manifest import index

    try:
        options = dict(_storage_option(o) for o in args.storage_option)
        dest_options = {**options, **dict(_storage_option(o) for o in args.dest_option)}
    except ValueError as exc:  # a usage error, as argparse's own: exit 2
        print(f"cachepipe index: {exc}; see cachepipe index --help", file=sys.stderr)
        return 2
    try:
        check_source(args.source)  # `bucket/video/` is `s3://bucket/video/`, as for Pipeline
        check_destination(args.output, "manifest")  # `s3:/bucket/m.gz` would be a local folder 's3:'
        manifest = index(args.source, args.output, args.items, options, dest_options=dest_options)
    except (OSError, ValueError, ImportError) as exc:  # ImportError: the scheme's backend is not installed (gs://)
        print(f"cachepipe index: {exc}", file=sys.stderr)
        return 1
    total = sum(manifest.catalog.sizes)
    print(
        f"{manifest.count} {manifest.items} ({format_size(total)}) of {manifest.source} -> {manifest.location}, "
        f"digest {manifest.digest}"
    )
    return 0


class _OneOutput(argparse.Action):
    """``index -o DEST``, given once, and not a ``KEY=VALUE``: ``map``'s ``-o`` is a storage
    option, and carried over to ``index`` it would be taken as the manifest's path (a second
    ``-o`` replacing the first, the manifest written to a file named ``anon=true``)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, value: Any, option: str | None = None
    ) -> None:
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None:
            parser.error(f"{option} given twice ({earlier!r}, then {value!r}): index writes one manifest{_OPTION_HINT}")
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[^/]*", value):
            parser.error(
                f"{option} {value!r}: expected the manifest's path or object URL, not KEY=VALUE (a file so named: "
                f"./{value}){_OPTION_HINT}"
            )
        setattr(namespace, self.dest, value)


_OPTION_HINT = "; a storage option is --storage-option KEY=VALUE (in map, -o is that; in index, -o is --output)"


def _storage_option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(KEY, VALUE)``, the value parsed as JSON when it can be."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ValueError(f"storage option {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _seconds(text: str) -> float:
    """An argparse type: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0, like 10 or 0.5")
    return value


def _print_shipped(unit: str | None) -> int:
    """``print-unit`` (a unit name, ``.service`` optional) or ``print-config`` (None): the file's bytes."""
    from . import data

    name = data.CONFIG if unit is None else unit if unit.endswith(".service") else f"{unit}.service"
    if unit is not None and name not in data.units():
        sys.stderr.write(f"cachepipe: no unit {unit!r}: expected one of {', '.join(data.units())}\n")
        return 2
    sys.stdout.flush()
    sys.stdout.buffer.write(data.read(name))
    sys.stdout.buffer.flush()
    return 0


_PIPELINE_HEAD = (
    "PIPELINE",
    "STATE",
    "READY",
    "LEASED",
    "HANDED",
    "ACKED",
    "REDELIVERED",
    "FAILED",
    "CACHED",
    "CAPACITY",
    "SOURCE",
)
# a job's consumers are its lanes (rank, worker): DONE counts those that consumed their whole share
_JOB_HEAD = (
    "JOB",
    "STATE",
    "LANES",
    "DONE",
    "WAITING",
    "READY",
    "TAKEN",
    "CONSUMED",
    "FAILED",
    "SKIPPED",
    "CACHED",
    "CAPACITY",
    "SOURCE",
)


def format_status(info: dict[str, Any]) -> str:
    """The readable text of ``cachepipe status``: a line on the daemon, a table of its pipelines
    (when it has some; a daemon of jobs alone, none registered, says so in their place), a table
    of its jobs (when it has some), and the error of each pipeline that is down."""
    from .sizes import format_size  # not on the path of `next` and `ack`

    def sizes(stats: dict[str, Any]) -> list[str]:
        return [format_size(stats[key]) if key in stats else "-" for key in ("bytes_in_cache", "capacity")]

    pipelines, jobs = sorted(info.get("pipelines", {}).items()), sorted(info.get("jobs", {}).items())
    up = info.get("uptime_seconds", 0)
    lines = [
        f"cachepipe {info.get('version', '?')}, pid {info.get('pid', '?')}, up {_duration(up)}, socket {info.get('socket', '?')}"
    ]
    rows = []
    for name, p in pipelines:
        s = p.get("stats") or {}
        counts = _counts(
            s.get("items_ready"),
            p.get("leased"),
            s.get("items_handed"),
            s.get("items_acked"),
            s.get("items_redelivered"),
            s.get("items_failed"),
        )
        progress = p.get("pass") or {}
        state = "done" if progress.get("complete") else p.get("state", "?")  # a pass complete is served no more
        rows.append((name, state, *counts, *sizes(s), p.get("source", "")))
    if pipelines:
        lines += _table(_PIPELINE_HEAD, rows)
    elif not jobs:  # a config has pipelines or jobs: no pipelines is a daemon of jobs, none registered yet
        lines.append(
            "no pipelines: this daemon serves jobs only, and none is registered now (CachePipeDataset(node=SOCKET) "
            "registers its job at its first iteration, docs/multinode.md; `cachepipe status` then shows a row per job)"
        )
    rows = []
    for name, j in jobs:
        s, lanes, done = j.get("stats") or {}, len(j.get("lanes", ())), j.get("lanes_done")
        counts = _counts(
            lanes,
            done,
            j.get("waiting"),
            s.get("items_ready"),
            s.get("items_handed"),
            s.get("items_acked"),
            s.get("items_failed"),
            s.get("items_skipped"),
        )
        state = "done" if lanes and done == lanes else "open"
        rows.append((j.get("job", name.removeprefix("job/")), state, *counts, *sizes(s), (j.get("spec") or {}).get("source", "")))
    if jobs:
        lines += ["", *_table(_JOB_HEAD, rows)] if pipelines else _table(_JOB_HEAD, rows)
    lines += [f"{name}: {p['error']}" for name, p in pipelines if p.get("error")]
    lines += [_complete(name, p["pass"]) for name, p in pipelines if (p.get("pass") or {}).get("complete")]
    return "\n".join(lines)


def _complete(name: str, progress: dict[str, Any]) -> str:
    """The note under the table on a pipeline whose pass is complete: the counters above count
    since the daemon started, and are zero after a restart over a finished pass."""
    done, items, epochs = progress.get("acknowledged"), progress.get("items"), progress.get("epochs")
    read = epochs - progress.get("start_epoch", 0)  # epochs start_epoch to epochs - 1 (absent: a daemon before it was said)
    what = f"{done} of {items * read} items acknowledged" if done is not None and items else f"{epochs} epoch(s)"
    return (
        f"{name}: the pass is complete ({what}, as its cache_dir records it; the counters above count since the "
        "daemon started): nothing more is handed out; `resume: false` or a new cache_dir starts a new pass"
    )


def _counts(*values: Any) -> list[str]:
    """Table cells of counters: ``-`` for one the daemon did not give."""
    return ["-" if v is None else str(v) for v in values]


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """``head`` and ``rows`` as aligned lines: the first two columns and the last to the left,
    the others (numbers and sizes) to the right."""
    rows = [head, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    last = len(head) - 1
    return [
        "  ".join(
            (cell.ljust(w) if i < 2 or i == last else cell.rjust(w)) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{days}d{hours}h" if days else f"{hours}h{minutes}m" if hours else f"{minutes}m{secs}s"


if __name__ == "__main__":
    sys.exit(main())
