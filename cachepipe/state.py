"""Durable cache state: an append-only journal of publishes and acks, and the saved catalog.

Files under ``cache_dir/.cachepipe/``::

    journal   one event per line, appended with a single write() and flushed:
                "I <name>"  about to publish (the rename may or may not have happened)
                "J <version> <name>"  the same, of the version the listing names (Item.version)
                "P <name>"  published (after an "A": kept on disk for a later step)
                "R <version> <name>"  published, of that version (written by a compaction)
                "A <epoch> <name>"  acknowledged in that epoch of the current pass
                "D <name>"  deleted without an ack (closing without keep_on_close, a leftover
                            in the way, a retention victim), written once its files are moved away
                "C <epoch> <index>"  every step of the plan before this position is consumed
                "K <json>"  the plan's configuration, for checking a resume against it
                "N <pass>"  a new pass starts: earlier acks and positions no longer count
                "V <n>"  the journal's format version (JOURNAL_VERSION); none written yet: see load
    catalog   the listing, written atomically once per listing (only with resume)

Why a journal and not SQLite: every byte under ``cache_dir`` counts against the hard cap, so
the state must have a size known in advance. The journal grows by at most four short lines
per step of the plan and is compacted (rewritten atomically) at every open and whenever it
outgrows its budget; a SQLite WAL's growth
is harder to bound. A line is written by one ``write`` call, so a killed process leaves whole
lines; a torn last line (power loss) is ignored, and an append that fails on a full disk is
cut back to the last whole line (:meth:`Journal.append`). Any other damage makes :func:`load` raise
:class:`StateCorrupt`, and the cache then rebuilds its state from the files on disk.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import io
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

from .catalog import Catalog
from .errors import ConfigError
from .wholefiles import naming, open_temp

__all__ = [
    "EVENT_OVERHEAD",
    "VERSION_OVERHEAD",
    "Journal",
    "Replay",
    "StateCorrupt",
    "StateTooNew",
    "catalog_header",
    "load",
    "load_catalog",
    "read_catalog_header",
    "read_catalog_items",
    "save_catalog",
    "temp_name",
    "write_catalog",
]

CATALOG_VERSION = 1
JOURNAL_VERSION = 1
"""The journal's format. This version writes no ``V`` line (an earlier cachepipe takes one for
damage); a later one that changes the format so that this one would misread it writes
``V <its version>`` first, and :func:`load` refuses a journal whose ``V`` is over this."""
EVENT_OVERHEAD = 48  # bytes per step besides 4 x the name: kinds, spaces, newlines, epoch and index numbers
# and, for an item with a version, the version (16 hex digits and a space) on its intent ("J"),
# or on its compacted publish record ("R")
VERSION_OVERHEAD = 17


class StateCorrupt(ValueError):
    """A state file is unreadable or was written by something else."""


class StateTooNew(StateCorrupt):
    """A state file of a later format version than this cachepipe reads (not damage: a later
    cachepipe wrote it)."""


@dataclass
class Replay:
    """What the journal says: the current pass, and item names by state."""

    pass_no: int = 0
    published: set[str] = field(default_factory=set)
    publishing: set[str] = field(default_factory=set)  # intent logged, outcome unknown
    acked: set[tuple[int, str]] = field(default_factory=set)  # (epoch, name)
    cursor: tuple[int, int] = (0, 0)  # (epoch, index): every step before it is consumed
    plan: str = ""  # the plan configuration (JSON) the cursor refers to
    versions: dict[str, str] = field(default_factory=dict)  # name -> version of an item published or publishing


def load(path: Path) -> Replay:
    """Replay the journal at ``path`` (missing: an empty state).

    Raises:
        StateCorrupt: the journal is damaged (its state is then rebuilt from the files).
        ConfigError: a later cachepipe wrote it (a ``V`` line over :data:`JOURNAL_VERSION`):
            not damage, and not to be rebuilt over, which would lose that version's state.
    """
    replay = Replay()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return replay
    lines = data.split(b"\n")
    if lines and lines[-1] != b"":
        lines = lines[:-1]  # a torn last line: the write that was cut never completed
    for number, raw in enumerate(lines, 1):
        if not raw:
            continue
        try:
            kind, arg = raw.decode("utf-8", "surrogateescape").split(" ", 1)
        except ValueError as exc:
            raise StateCorrupt(f"{path}: line {number} is not a journal event: {raw[:60]!r}") from exc
        if kind in ("J", "R"):
            version, _, arg = arg.partition(" ")
            if not arg:
                raise StateCorrupt(f"{path}: line {number}: {kind} event without a name: {raw[:60]!r}")
            replay.versions[arg] = version
        elif kind == "I":
            replay.versions.pop(arg, None)  # of a version not known (no tags, or an older journal)
        if kind in ("I", "J"):
            replay.publishing.add(arg)
        elif kind in ("P", "R"):
            replay.publishing.discard(arg)
            replay.published.add(arg)
        elif kind == "A":
            epoch, _, name = arg.partition(" ")
            replay.published.discard(name)
            replay.acked.add((_int(epoch, path, number), name))
        elif kind == "C":
            epoch, _, index = arg.partition(" ")
            moved_on = _int(epoch, path, number) > replay.cursor[0]
            replay.cursor = (_int(epoch, path, number), _int(index, path, number))
            if moved_on:  # only then can older acks go: rebuilding on every C line is quadratic
                replay.acked = {a for a in replay.acked if a[0] >= replay.cursor[0]}
        elif kind == "K":
            replay.plan = arg
        elif kind == "D":
            replay.published.discard(arg)
            replay.publishing.discard(arg)
            replay.versions.pop(arg, None)
        elif kind == "N":
            replay.pass_no = _int(arg, path, number)
            replay.acked.clear()
            replay.cursor, replay.plan = (0, 0), ""
        elif kind == "V":
            if (written := _int(arg, path, number)) > JOURNAL_VERSION:
                raise ConfigError(
                    f"{path}: written by a later cachepipe (journal version {written}; this one reads "
                    f"{JOURNAL_VERSION}): open its cache directory with that version, or remove the directory to start over"
                )
        else:
            raise StateCorrupt(f"{path}: line {number}: unknown event {kind!r}")
    return replay


def _int(text: str, path: Path, number: int) -> int:
    try:
        return int(text)
    except ValueError as exc:
        raise StateCorrupt(f"{path}: line {number}: {text!r} is not a number") from exc


class Journal:
    """Appends events; :meth:`rewrite` compacts it atomically to a given state."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._size = 0  # bytes of whole lines in the file: counted here, not asked of the OS after every append
        self._torn = False  # a failed append may have left a partial line after _size bytes
        self._deferred: list[bytes] = []  # events written with the next write (see defer)
        self._lock = threading.Lock()

    def rewrite(self, replay: Replay) -> None:
        """Replace the journal by the minimal one describing ``replay``, then open it for appends."""
        with self._lock:
            lines = [f"N {replay.pass_no}"]
            if replay.plan:
                lines.append(f"K {replay.plan}")
            lines.append(f"C {replay.cursor[0]} {replay.cursor[1]}")
            # acks first: an "A" ends an item's published state, and an item acked and kept for a
            # later step (retention) is both acked and published
            lines += [f"A {e} {n}" for e, n in sorted(replay.acked)]
            versions = replay.versions
            lines += [f"R {versions[n]} {n}" if n in versions else f"P {n}" for n in sorted(replay.published)]
            # intents whose renames are under way
            lines += [f"J {versions[n]} {n}" if n in versions else f"I {n}" for n in sorted(replay.publishing)]
            data = ("\n".join(lines) + "\n").encode("utf-8", "surrogateescape")
            atomic_write(self.path, data)  # on failure the old file and descriptor stay in use
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            finally:
                self._close()  # the old descriptor is of a replaced file: appends to it would be lost
            self._fd = fd
            self._size, self._torn = len(data), False
            self._deferred.clear()  # the rewrite holds what they said

    def append(self, kind: str, arg: str) -> None:
        """Append one event with a single ``write``: whole, or not at all.

        A write that fails or is cut short (a full disk) is undone by truncating the file back
        to its last whole line before the error is raised, so the next event never lands on a
        partial one. If even that fails, every later append retries it first and raises until
        it succeeds. A process killed mid-write leaves at most a torn last line, which
        :func:`load` drops.

        Raises:
            OSError: the event was not written (ENOSPC, EIO...); the file ends on a whole line.
        """
        self._write(f"{kind} {arg}\n".encode("utf-8", "surrogateescape"))

    def append_many(self, events: Sequence[tuple[str, str]]) -> None:
        """Append ``(kind, arg)`` events with a single ``write`` (a batch of acks): all of them, or
        none (as :meth:`append`). A process killed mid-write leaves a prefix of them, whole
        lines and at most one torn last line, which :func:`load` drops: each event stands alone.

        Raises:
            OSError: no event was written; the file ends on a whole line.
        """
        if events:
            self._write("".join(f"{kind} {arg}\n" for kind, arg in events).encode("utf-8", "surrogateescape"))

    def defer(self, kind: str, arg: str) -> None:
        """Queue one event to be written in front of the next write (its own, a later append's,
        or :meth:`flush` at :meth:`close`): an event whose loss recovery tolerates costs no write
        of its own. A rewrite drops the queue: it holds what the events said."""
        self.defer_many(kind, [arg])

    def defer_many(self, kind: str, args: Sequence[str]) -> None:
        """:meth:`defer` an event of ``kind`` for each of ``args``, in one round of the lock."""
        if args:
            data = "".join(f"{kind} {arg}\n" for arg in args).encode("utf-8", "surrogateescape")
            with self._lock:
                self._deferred.append(data)

    def flush(self) -> None:
        """Write the deferred events now (see :meth:`defer`). Raises OSError (they stay queued)."""
        self._write(b"")

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._fd is None:
                raise RuntimeError("journal is not open")
            if self._deferred:
                data = b"".join(self._deferred) + data
            if not data:
                return
            if self._torn:
                self._truncate()
            try:
                written = os.write(self._fd, data)
            except OSError:
                self._torn = True  # a failed write may still have put bytes in the file
                self._truncate()
                raise
            if written != len(data):
                self._torn = True
                self._truncate()
                raise OSError(errno.ENOSPC, f"{self.path}: short write to the journal ({written} of {len(data)} bytes)")
            self._size += written
            self._deferred.clear()

    def _truncate(self) -> None:
        """Cut the file back to :attr:`size` (its last whole line); clears the torn flag."""
        assert self._fd is not None  # noqa: S101 - narrows a type for mypy; not input validation
        os.ftruncate(self._fd, self._size)
        self._torn = False

    @property
    def is_open(self) -> bool:
        """Whether appends can be made (after the first :meth:`rewrite`, until :meth:`close`)."""
        return self._fd is not None

    @property
    def size(self) -> int:
        """Bytes in the journal file (0 when closed)."""
        return self._size if self._fd is not None else 0

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def save_catalog(path: Path, source: str, mode: str, catalog: Catalog) -> None:
    """Write the listing atomically, gzip-compressed (it counts against the capacity), in the
    format of :func:`write_catalog`. Streamed: the whole text is never held in memory."""
    atomic_write(path, lambda fh: write_catalog(fh, catalog_header(source, mode, catalog), catalog))


def catalog_header(source: str, mode: str, catalog: Catalog, **extra: Any) -> dict[str, Any]:
    """The header line of a saved catalog: ``version``, ``source``, ``items`` (the mode),
    ``count``, ``digest`` (:meth:`Catalog.digest`), then ``extra`` fields."""
    return {
        "version": CATALOG_VERSION,
        "source": source,
        "items": mode,
        "count": len(catalog),
        "digest": catalog.digest(),
        **extra,
    }


def write_catalog(fh: BinaryIO, header: dict[str, Any], catalog: Catalog) -> None:
    """Write ``catalog`` to ``fh`` as gzip JSON lines: the ``header`` line (see
    :func:`catalog_header`), then one line per item: ``[name, [[rel, size, etag], ...]]``.
    Streamed, and byte-for-byte the same for the same header and catalog (gzip ``mtime`` 0).
    The format of both the cache's saved catalog and a manifest (:mod:`cachepipe.manifest`)."""
    dumps = json.JSONEncoder(separators=(",", ":")).encode
    with gzip.GzipFile(fileobj=fh, mode="wb", mtime=0) as gz, io.TextIOWrapper(gz, encoding="utf-8", newline="\n") as text:
        text.write(json.dumps(header) + "\n")
        for entry in catalog.entries():
            text.write(dumps(entry) + "\n")


def read_catalog_header(text: IO[str], where: str) -> dict[str, Any]:
    """The header of a catalog file opened as text (``gzip.open(..., "rt")``), checked for its
    version and fields; the file is left at the first item.

    Raises:
        StateCorrupt: not a catalog of this version, or unreadable.
    """
    try:
        header = json.loads(text.readline())
    except (OSError, EOFError, ValueError) as exc:
        raise StateCorrupt(f"{where}: unreadable catalog: {exc}") from exc
    if not isinstance(header, dict) or header.get("version") != CATALOG_VERSION:
        version = header.get("version") if isinstance(header, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > CATALOG_VERSION:
            raise StateTooNew(
                f"{where}: written by a later cachepipe (catalog version {version}; this one reads {CATALOG_VERSION})"
            )
        raise StateCorrupt(f"{where}: not a cachepipe catalog of version {CATALOG_VERSION} (version {version!r})")
    if header.get("items") not in ("folders", "files") or not isinstance(header.get("count"), int):
        raise StateCorrupt(f"{where}: catalog header without a valid items mode and count: {header!r}")
    return header


def _entries(text: IO[str]) -> Iterator[Any]:
    """The items of a catalog file, one parsed line each, parsed about 256 KiB of lines at a
    time (one ``json.loads`` call each: a call per line was a tenth of the read)."""
    while lines := text.readlines(1 << 18):
        yield from json.loads(f"[{','.join(lines)}]")


def read_catalog_items(text: IO[str], header: dict[str, Any], where: str) -> Catalog:
    """The items after :func:`read_catalog_header`, checked against the header's ``count`` and
    (when present) ``digest``: a truncated or altered file is refused. Its keys are checked as
    a listing's are (:meth:`Catalog.check_keys`): an item with one that cannot be stored in a
    cache is kept, marked, and never written.

    Raises:
        StateCorrupt: unreadable, truncated, or not the catalog its header describes.
    """
    catalog = Catalog(mode="files" if header["items"] == "files" else "folders")
    try:
        catalog.add_many(_entries(text))
    except (OSError, EOFError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise StateCorrupt(f"{where}: unreadable catalog: {exc}") from exc
    if len(catalog) != header["count"]:
        raise StateCorrupt(f"{where}: catalog has {len(catalog)} items, header says {header['count']}")
    if "digest" in header and catalog.digest() != header["digest"]:
        raise StateCorrupt(f"{where}: catalog content has digest {catalog.digest()}, header says {header['digest']!r}")
    catalog.check_keys()
    return catalog


def load_catalog(path: Path, source: str, mode: str) -> Catalog | None:
    """The saved listing for (``source``, ``mode``), or None if there is none or it is for another source."""
    where = str(path)
    try:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            try:
                header = json.loads(fh.readline())
            except (OSError, EOFError, ValueError) as exc:
                raise StateCorrupt(f"{where}: unreadable catalog: {exc}") from exc
            if not isinstance(header, dict):
                raise StateCorrupt(f"{where}: unreadable catalog: header {header!r} is not an object")
            if header.get("version") != CATALOG_VERSION or header.get("source") != source or header.get("items") != mode:
                return None
            if not isinstance(header.get("count"), int):
                raise StateCorrupt(f"{where}: catalog header without a count: {header!r}")
            return read_catalog_items(fh, header, where)
    except FileNotFoundError:
        return None


def temp_name(name: str) -> str:
    """The name of the temporary file :func:`atomic_write` writes a file of ``name`` through
    (beside it), which a writer killed before its rename leaves, for the next write to reuse."""
    return f".{name}.tmp"


def atomic_write(path: Path, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder (``.NAME.tmp``, locked
    while written: :func:`open_temp`), ``fsync`` and ``os.replace``; the temporary file is removed
    on any error. ``data`` is the bytes, or a function that writes them to the open file. Every
    write is an ``os.write`` call (a full disk raises at the call that met it, as an
    :class:`OSError` naming ``path``)."""

    def unique() -> str:
        return str(path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp"))

    fd, tmp = open_temp(str(path.with_name(temp_name(path.name))), unique, 0o644)
    try:
        with naming(f"cannot write {str(path)!r}"):  # a write's or fsync's: a full disk, said with the path
            os.ftruncate(fd, 0)  # what a killed writer wrote
            out = _FdWriter(fd)
            if callable(data):
                data(out)  # type: ignore[arg-type]
            else:
                out.write(data)
            os.fsync(fd)
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    finally:
        os.close(fd)


class _FdWriter(io.RawIOBase):
    """A write-only file over a descriptor: each write is one or more ``os.write`` calls."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self._fd = fd

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.write(self._fd, view[done:])
        return done
