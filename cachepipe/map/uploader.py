"""Writing results back: upload an item's output folder, then its completion marker.

An item is complete in the destination when ``DST/<item>/.cachepipe-done`` exists, for the
version of its input objects and the command that the marker records, if it records them. The
marker is written last, after every output of the item was uploaded, and lists them (relative
path and size, JSON) after the input's version (:attr:`cachepipe.map.plan.MapItem.version`, when
the source gives ETags) and the command's digest (:func:`cachepipe.map.plan.command_digest`: what
made the outputs); a run that dies in the middle of an upload leaves outputs without a marker, and
the next run does the item again, as it does an item whose input was rewritten since or that was
done by another command.

An attempt is told what ``DST/<item>/`` holds that it may delete (``held``): the objects of an
item that has a marker (a finished attempt's, of another command or input: the run's listing
decides, :meth:`cachepipe.map.remote._Remote._done`), and what a failed attempt of this run
uploaded; it leaves ``DST/<item>/`` holding its outputs and marker, and nothing else of those.
The order of :meth:`Uploader.upload_item`, so that a crash at any point leaves no marker that
lists an object that is not there, or that another attempt wrote:

1. the old marker, if ``DST/<item>/`` holds one, is deleted alone, first: from here on, the item
   has no marker and a rerun does it again (keeping, as for any item without a marker, what it
   does not write again);
2. the other objects there that are not outputs of this attempt are deleted (a batch per 1,000);
3. the outputs are uploaded (over the objects of the same names);
4. the marker is uploaded, listing them.

What ``DST/<item>/`` holds is known without a request per item: the run lists ``DST`` once at its
start (:meth:`cachepipe.map.remote._Remote._done`) and hands the keys under each item to run
that has a marker to the :class:`Uploader` (``held``), which adds the keys each attempt uploads (a retry of the item
deletes what the failed attempt left). An item with nothing in ``DST`` costs no delete. On a local
``DST`` each step is on disk before the next begins: a delete ``fsync``-s the folders it changed,
and the outputs' folders are ``fsync``-ed (the store's ``sync``, once per folder) before the
marker is put, the marker's after.

Uploads and deletes retry transient store errors with the same exponential backoff as downloads,
sleeping on the stop event.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backoff import backoff_delay
from ..catalog import check_key
from ..errors import CachePipeError, UnsafeKeyError, is_transient
from ..stores.base import TEMP_SUFFIX, WritableStore, takes_content_type
from ..wholefiles import naming

__all__ = [
    "DONE_MARKER",
    "MARKER_FORMAT",
    "MARKER_LIMIT",
    "MARKER_TYPE",
    "DestinationDeniedError",
    "DestinationError",
    "DestinationFullError",
    "OutputError",
    "Uploader",
    "collect_outputs",
    "marker_body",
    "marker_command",
    "marker_format",
    "marker_key",
    "marker_version",
]

log = logging.getLogger("cachepipe.map")

DONE_MARKER = ".cachepipe-done"
"""The object written last under ``DST/<item>/``: the item's results are complete."""


MARKER_TYPE = "application/json"
"""The media type of a completion marker, given where the store records one (S3, OBS): it is
uploaded from memory (``/proc/self/fd/N``), a name that the store could not guess it by."""

MARKER_LIMIT = 4096
"""Bytes read from the start of a completion marker to find its version and command, which it
holds first (the outputs it lists after them can make it megabytes long)."""
_HEAD = re.compile(
    rb'\{\s*(?:"version":\s*"(?P<version>[0-9a-f]{1,64})"\s*,?\s*)?(?:"command":\s*"(?P<command>[0-9a-f]{1,64})")?'
)
"""A marker's head: ``{"version": V, "command": C, ...``, each field there only if recorded."""

MARKER_FORMAT = 1
"""The completion marker's format. This version writes no ``"format"`` key (an earlier cachepipe
reads a marker whose head records neither version nor command as done); a later one that changes
the marker so that this one would misread it writes ``{"format": N`` first, and a run here
refuses it (:func:`marker_format`)."""
_FORMAT = re.compile(rb'\{\s*"format":\s*(?P<format>[0-9]{1,9})\b')


def marker_key(name: str) -> str:
    """The key of an item's completion marker, relative to the destination root."""
    return f"{name}/{DONE_MARKER}"


def marker_body(name: str, manifest: dict[str, int], version: str | None, command: str | None) -> bytes:
    """A completion marker: JSON, the input's ``version`` and the ``command`` digest first (when
    given; read back from the first :data:`MARKER_LIMIT` bytes), then the item's name, its
    outputs' total bytes, when it finished and ``files``, the outputs' relative paths and sizes."""
    record: dict[str, Any] = {} if version is None else {"version": version}
    if command is not None:
        record["command"] = command
    record |= {"item": name, "bytes": sum(manifest.values()), "finished": time.time(), "files": manifest}
    return json.dumps(record, indent=0).encode()


def _head_field(head: bytes, field: str) -> str | None:
    found = _HEAD.match(head)
    value = found.group(field) if found else None
    return value.decode() if value else None


def marker_version(head: bytes) -> str | None:
    """The input version that a completion marker starting with the bytes ``head`` records;
    None if it records none (written without ETags, or by an earlier cachepipe)."""
    return _head_field(head, "version")


def marker_format(head: bytes) -> int:
    """The format of a completion marker starting with the bytes ``head``: its leading
    ``"format"``, or :data:`MARKER_FORMAT` if it names none (this version's and earlier ones')."""
    found = _FORMAT.match(head)
    return int(found.group("format")) if found else MARKER_FORMAT


def marker_command(head: bytes) -> str | None:
    """The digest of the command (:func:`cachepipe.map.plan.command_digest`) that a completion
    marker starting with the bytes ``head`` records; None if it records none (written by an
    earlier cachepipe, which did not record it)."""
    return _head_field(head, "command")


class DestinationError(CachePipeError, OSError):
    """The destination refuses uploads in a way every later item would meet too: the run stops
    (items done are kept). Its two kinds::

        DestinationError
        ├── DestinationFullError    full (ENOSPC, EDQUOT) after the upload's retries
        └── DestinationDeniedError  writing refused (403 AccessDenied, expired credentials, EACCES)
    """


class DestinationFullError(DestinationError):
    """An upload still found the destination full (``ENOSPC``, ``EDQUOT``) after its retries: every
    later item would wait for it and fail the same way, so the run stops."""


class DestinationDeniedError(DestinationError, PermissionError):
    """An upload was refused (credentials that may read but not write ``DST``, or that expired:
    they pass the bucket's check): every later item's would be too, after its download and its
    command, so the run stops."""


class OutputError(UnsafeKeyError):
    """An output that cannot be uploaded: an unsafe name, a link leaving the output folder,
    a FIFO or device, or a reserved name (the marker's, ``*.cachepipe.tmp``)."""


def collect_outputs(root: Path) -> list[tuple[str, Path]]:
    """The files to upload from ``root``: ``(relative key, local path)`` in key order.

    Regular files are uploaded as they are; a symbolic link is uploaded as the file it points to
    when that is a regular file inside ``root`` (like ``cp -L``). Empty folders are not objects.

    Raises:
        OutputError: ``root`` itself replaced by a link (to a folder the command does not own:
            never followed), a link that leaves ``root`` or dangles, a FIFO, socket or device, a
            name that is not a safe key, or a file named like the marker or like a file being
            written to a local destination (``*.cachepipe.tmp``), or a folder that cannot be
            listed (permission denied, an I/O error: its files would be left out unsaid).
    """
    if os.path.islink(root):
        raise OutputError(".", f"the output folder was replaced by a link to {os.readlink(root)!r}: write the outputs into it")
    real_root = os.path.realpath(root)
    found: list[tuple[str, Path]] = []

    def unlisted(exc: OSError) -> None:  # os.walk would pass over the folder, its files left out unsaid
        if isinstance(exc, FileNotFoundError):
            return  # gone: nothing in it to upload, as before
        rel = Path(exc.filename or root).relative_to(root).as_posix()
        raise OutputError(rel, f"a folder of the outputs that cannot be listed ({exc.strerror or exc}): make it readable")

    for dirpath, dirs, files in os.walk(root, onerror=unlisted):
        dirs.sort()
        for name in dirs:
            if os.path.islink(os.path.join(dirpath, name)):
                raise OutputError(Path(dirpath, name).relative_to(root).as_posix(), "a link to a folder: only files are uploaded")
        for name in sorted(files):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            check_key(rel)
            if rel == DONE_MARKER:
                raise OutputError(rel, "reserved for the completion marker")
            if rel.endswith(TEMP_SUFFIX):
                raise OutputError(rel, f"names ending in {TEMP_SUFFIX!r} are reserved for files being written")
            target = Path(os.path.realpath(path))
            if os.path.commonpath([str(target), real_root]) != real_root:
                raise OutputError(rel, f"a link to {str(target)!r}, outside the output folder")
            if not target.is_file():
                raise OutputError(rel, "not a regular file (a FIFO, socket, device or dangling link)")
            found.append((rel, target))
    return found


@contextmanager
def _marker_file(body: bytes, folder: Path) -> Iterator[Path]:
    """A file holding ``body``, to upload as a completion marker: in memory (a ``memfd``, Linux),
    since the marker lists every output (tens of bytes each) and the outputs may fill their job's
    slot to its last byte, so a marker written beside them passed the cache's capacity; elsewhere
    (or where ``memfd_create`` is refused, or ``/proc`` is not mounted) ``folder/marker.json``,
    removed after."""
    fd = -1
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        try:
            fd = os.memfd_create("cachepipe-done", os.MFD_CLOEXEC)
        except OSError:  # a sandbox's seccomp filter: ENOSYS, EPERM
            fd = -1
    if fd >= 0:
        try:
            with open(fd, "wb", closefd=False) as fh:
                fh.write(body)
            yield Path(f"/proc/self/fd/{fd}")  # opened anew by the store, from its start
        finally:
            os.close(fd)
        return
    path = folder / "marker.json"
    try:
        with naming(f"cannot write the completion marker's file {str(path)!r}"):  # a full disk's error names no file
            path.write_bytes(body)
        yield path
    finally:
        path.unlink(missing_ok=True)


@dataclass
class UploadCounters:
    """Bytes and files uploaded, requests retried."""

    bytes: int = 0
    files: int = 0
    retries: int = 0


class Uploader:
    """Uploads output files to a destination store from a pool of threads.

    Args:
        dest: the destination, rooted at ``DST``.
        concurrency: files in flight across all items.
        retries, backoff, backoff_max: per-file retries of transient errors (as for downloads).
        stop: set to abandon uploads (backoff sleeps wake at once).
        command: the digest of what makes the outputs (:func:`cachepipe.map.plan.command_digest`),
            recorded in every marker (see :func:`marker_command`); None records none.
        held: the keys ``DST`` holds under each item to run (relative to ``DST``, as the run's
            listing found them; an item with none need not be there): what an attempt deletes
            unless it writes them again (see the module's notes).
    """

    def __init__(
        self,
        dest: WritableStore,
        concurrency: int,
        retries: int,
        backoff: float,
        backoff_max: float,
        stop: threading.Event,
        command: str | None = None,
        held: Mapping[str, Collection[str]] | None = None,
    ) -> None:
        self.dest = dest
        self.command = command
        self._typed = takes_content_type(dest)  # a put that records the marker's media type
        self._held = {name: set(keys) for name, keys in (held or {}).items() if keys}  # under the lock
        self._retries = retries
        self._backoff = backoff
        self._backoff_max = backoff_max
        self._stop = stop
        self._lock = threading.Lock()
        self.counters = UploadCounters()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="cachepipe-upload")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def upload_item(self, name: str, root: Path, marker_dir: Path, version: str | None = None) -> dict[str, int]:
        """Upload every output under ``root`` to ``DST/<name>/``, then the marker; return the manifest.

        Before the uploads, deletes what ``DST/<name>/`` holds that is not an output of this
        attempt, the old marker first and alone (the order and why: the module's notes). The
        marker is uploaded from memory where it can be (:func:`_marker_file`; else from a file in
        ``marker_dir``, removed after). ``version``: the input's (see :func:`marker_version`),
        recorded in the marker with :attr:`command`.

        Raises:
            OutputError: an output that cannot be uploaded (nothing is uploaded or deleted then).
            DestinationDeniedError: the destination refused a delete or an upload.
            OSError: a delete or an upload failed after its retries (no marker is written).
            InterruptedError: stopped.
        """
        outputs = collect_outputs(root)
        manifest = {rel: path.stat().st_size for rel, path in outputs}
        keys = [f"{name}/{rel}" for rel, _ in outputs]
        self._clear(name, keys)
        with self._lock:
            self._held.setdefault(name, set()).update(keys)  # a retry of the item deletes those it does not write again
        futures: list[Future[None]] = [self._pool.submit(self._put, path, f"{name}/{rel}") for rel, path in outputs]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for future in pending:
            future.cancel()
        wait(pending)
        for future in futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        if self._stop.is_set():
            raise InterruptedError(f"stopped while uploading {name}")
        self._sync(keys)  # the outputs on disk before the marker (a local DST)
        with self._lock:
            self._held[name].add(marker_key(name))  # a put that fails may have written it all the same
        with _marker_file(marker_body(name, manifest, version, self.command), marker_dir) as marker:
            self._put(marker, marker_key(name), count=False, content_type=MARKER_TYPE)
        self._sync([marker_key(name)])
        with self._lock:
            del self._held[name]  # done: not to run again in this run
        return manifest

    def _sync(self, keys: Sequence[str]) -> None:
        """The store's ``sync`` of ``keys``, where it has one (a local DST: their folders ``fsync``-ed)."""
        sync = getattr(self.dest, "sync", None)
        if sync is not None:
            sync(keys)

    def _clear(self, name: str, keys: Sequence[str]) -> None:
        """Delete what ``DST/<name>/`` holds that is not one of ``keys`` (this attempt's outputs):
        its marker first, alone, so that a crash between the two requests leaves no marker beside
        objects it lists that were deleted; then the rest, in one batch per 1,000 keys."""
        with self._lock:
            stale = self._held.get(name, set()).difference(keys)
        if not stale:
            return
        marker = marker_key(name)
        if marker in stale:
            self._delete(name, [marker])
        rest = sorted(stale - {marker})
        if rest:
            self._delete(name, rest)
        log.debug("%s: deleted %d object(s) that an earlier attempt left in the destination", name, len(stale))
        with self._lock:
            self._held[name] -= stale

    def _delete(self, name: str, keys: list[str]) -> None:
        def refused(exc: Exception, _attempts: int) -> Exception | None:
            if not isinstance(exc, PermissionError):
                return None
            more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
            return DestinationDeniedError(
                f"deleting {keys[0]}{more}, what an earlier attempt left in {name}/ under names this one does not write: the "
                f"destination refused it ({exc}); the run stops: give credentials that may delete there (s3:DeleteObject; "
                "a local or mounted DST: write permission on its folders) and run it again (items done are kept)"
            )

        what = f"deleting what an earlier attempt left in {name}/"
        self._retrying(lambda: self.dest.delete(keys, within=name), what, refused)

    def _put(self, path: Path, key: str, count: bool = True, content_type: str | None = None) -> None:
        def refused(exc: Exception, attempts: int) -> Exception | None:
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return DestinationFullError(
                    f"uploading {key}: the destination is full after {attempts} attempt(s) ({exc}); the run stops: "
                    "free space there and run it again (items done are kept)"
                )
            if isinstance(exc, PermissionError):  # the store's refusal (an output it cannot read: LocalFileError)
                return DestinationDeniedError(
                    f"uploading {key}: the destination refused it ({exc}); the run stops: give credentials "
                    "that may write there (s3:PutObject; a local or mounted DST: write permission on its "
                    "folders) and run it again (items done are kept)"
                )
            return None

        typed = {"content_type": content_type} if content_type is not None and self._typed else {}
        self._retrying(lambda: self.dest.put(path, key, **typed), f"uploading {key}", refused)
        log.debug("uploaded %s", key)
        if count:
            size = path.stat().st_size
            with self._lock:
                self.counters.bytes += size
                self.counters.files += 1

    def _retrying(self, call: Callable[[], None], what: str, refused: Callable[[Exception, int], Exception | None]) -> None:
        """Run ``call`` (``what`` it does, for the log and the stop's message) until it succeeds,
        retrying a transient error up to the uploader's ``retries`` with backoff, sleeping on the
        stop event. An error for good raises as ``refused(error, attempts)`` makes it (the
        destination full or refusing: the run stops), else as it came."""
        for attempt in range(self._retries + 1):
            if self._stop.is_set():
                raise InterruptedError(f"stopped before {what}")
            try:
                call()
            except Exception as exc:
                if not is_transient(exc) or attempt == self._retries:
                    translated = refused(exc, attempt + 1)
                    if translated is not None:
                        raise translated from exc
                    raise
                delay = backoff_delay(attempt, self._backoff, self._backoff_max)
                log.warning("retry %d/%d of %s in %.2fs: %s", attempt + 1, self._retries, what, delay, exc)
                with self._lock:
                    self.counters.retries += 1
                if self._stop.wait(delay):
                    raise InterruptedError(f"stopped before {what}") from exc
            else:
                return
