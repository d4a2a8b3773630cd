"""The policy of file-marker acks (pure bookkeeping: the watching is in
:mod:`cachepipe.service.markers`, which re-exports every name of this module).

What a ``.done`` holds (:func:`read_marker`) says whose it is: a lease
acknowledges only the hand-out with that lease, and a ``.done`` holding anything else (an
earlier daemon's lease, after a restart or a rebuild; an expired one) acknowledges nothing, is
logged and counted, and stays. An empty one acknowledges the item's holder, as markers always did.

Provenance of an empty marker: an event is processed some time after it happened (inotify,
the watcher's batched reads), so "a ``.done`` exists and the item is handed out now" does not prove a
consumer made it. It acknowledges only the hand-out it was made for: at each hand-out the
daemon records the lease and what ``<item>/.done`` was then (:class:`HandOuts`); a marker event
acknowledges that lease (never a later one) and only if the ``.done`` is not one that was there
at hand-out. So a ``.done`` that is one of the item's own files (a dataset that ships one,
listed in the catalog or present when the item was published) never acknowledges it: ack such
an item over the API or by deleting it. A marker left by a consumer whose lease expired does
not acknowledge the next consumer's hand-out either. Deleting an item acknowledges the lease
recorded at its hand-out too.

:func:`acked_by` is the pure policy (which event acknowledges which item), :func:`marker_counts`
the pure provenance rule; :class:`HandOuts` records hand-outs.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, NamedTuple

__all__ = [
    "MARKER",
    "HandOut",
    "HandOuts",
    "Verdict",
    "acked_by",
    "marker_counts",
    "marker_identity",
    "read_marker",
]

log = logging.getLogger("cachepipe.service.markers")  # the marker acks' logger, as before the split

MARKER = ".done"
STATE_DIR = ".cachepipe"  # the cache's own state folder: never an item
Kind = Literal["created", "deleted"]


def acked_by(root: str, path: str, kind: Kind, is_directory: bool, items: str) -> tuple[str, str] | None:
    """The item a filesystem event acknowledges, as ``(item path, "marker" | "deleted")``, or None.

    Paths are strings (absolute and normal; an event's path is its watched folder's and the name
    inotify reports): the watcher judges an event for every deletion in a cache directory, and
    :mod:`pathlib` would cost the daemon more per item than the rest of the judging
    (``benchmarks/README.md``).

    Args:
        root: the cache directory.
        path: the path the event is about.
        kind: ``"created"`` (also a file closed after writing, or moved into place) or
            ``"deleted"`` (also moved away).
        is_directory: whether ``path`` is a directory.
        items: the pipeline's ``items`` setting, ``"folders"`` or ``"files"``.
    """
    prefix = root.rstrip("/") + "/"
    if not path.startswith(prefix):
        return None
    parts = path[len(prefix) :].split("/")
    if parts[0] == STATE_DIR or any(part in ("", ".", "..") for part in parts):
        return None
    if items == "folders":
        if kind == "created" and not is_directory and len(parts) == 2 and parts[1] == MARKER:
            return prefix + parts[0], "marker"
        if kind == "deleted" and is_directory and len(parts) == 1:
            return path, "deleted"
        return None
    if kind == "deleted" and not is_directory:
        return path, "deleted"
    return None


MarkerId = tuple[int, int, int]  # (st_dev, st_ino, st_ctime_ns) of a marker file


def marker_identity(item: str | os.PathLike[str]) -> MarkerId | None:
    """Which ``<item>/.done`` exists now (device, inode, change time), or None if none does."""
    try:
        st = os.lstat(f"{os.fspath(item)}/{MARKER}")
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


MARKER_BYTES = 256
"""The most a ``.done`` holding a lease can hold (a lease id is about 20 characters)."""


def read_marker(item: str | os.PathLike[str]) -> tuple[MarkerId | None, str]:
    """Which ``<item>/.done`` exists now (:func:`marker_identity`) and the lease it holds: its
    content without surrounding white space (``echo`` adds a newline), "" if it is empty, or not a
    regular file (a link is not followed, a pipe is not waited on). Reads at most
    :data:`MARKER_BYTES` + 1 bytes: more cannot be a lease."""
    path = f"{os.fspath(item)}/{MARKER}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None, ""
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # unreadable (EACCES): judged as an empty marker, by its identity
            log.debug("cannot read %s: %s", path, exc)
        return marker_identity(item), ""
    try:
        st = os.fstat(fd)
        data = os.read(fd, MARKER_BYTES + 1) if stat.S_ISREG(st.st_mode) else b""
    finally:
        os.close(fd)
    return (st.st_dev, st.st_ino, st.st_ctime_ns), data.strip().decode("utf-8", "backslashreplace")


class HandOut(NamedTuple):
    """What the daemon knew when it handed an item out.

    Attributes:
        lease: the lease the item was handed out under.
        shipped: ``.done`` is one of the item's own files (it came with the dataset).
        before: the ``<item>/.done`` that existed at hand-out (:func:`marker_identity`), if any.
        markers: its consumer may acknowledge it by a ``.done`` (False: ``Client(markers=False)``,
            the item's folder is not watched).
    """

    lease: str
    shipped: bool
    before: MarkerId | None
    markers: bool = True


def marker_counts(handout: HandOut | None, now: MarkerId | None, holds: str = "") -> bool:
    """Whether the marker ``now`` (the ``.done`` seen when its event is processed), which holds
    ``holds`` (:func:`read_marker`), is a consumer's acknowledgement of ``handout``: it exists,
    the item does not ship a ``.done`` of its own, and it holds that hand-out's lease, or holds
    nothing and is not the one that existed when the item was handed out."""
    if handout is None or now is None or handout.shipped:
        return False
    return holds == handout.lease if holds else now != handout.before


class Verdict(NamedTuple):
    """What an event acknowledges (:meth:`HandOuts.lease_for`).

    Attributes:
        lease: the lease it acknowledges, or None.
        why: why none, for the log.
        held: the lease (or whatever else) a refused ``.done`` holds when it is not the item's: an
            earlier daemon's, a rebuilt pipeline's or an expired lease, warned of and counted.
    """

    lease: str | None
    why: str = ""
    held: str | None = None


class HandOuts:
    """The hand-outs of every served pipeline, by item path (absolute and normal, a string),
    thread-safe.

    The daemon records a batch of them at each hand-out (:meth:`record`, before the consumer
    learns the paths), forgets them once the items are acknowledged or released, and asks
    :meth:`lease_for` which lease a marker or deletion event acknowledges. Paths are strings,
    not :class:`~pathlib.Path` objects, and a batch is one lock round: the batched hand-out
    pays for neither per item (benchmarks/README.md, ``bench_service.py``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_path: dict[str, HandOut] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_path)

    def record(self, handed: Iterable[tuple[str, str, Iterable[str], bool, bool]]) -> list[str]:
        """Items were just handed out, each ``(path, lease, files, look, markers)``: its path, the
        lease it went out under, its files (relative), whether to look up the ``.done`` there now,
        and whether its consumer may acknowledge it by one (:attr:`HandOut.markers`). Without a
        look (no marker watch, or the item's first hand-out since its download: nobody has had its
        path; a file-system call saved per item) no ``.done`` counts as there before: a watch
        started later by a reload counts any it sees.

        Returns the paths of those that replaced a hand-out still recorded: its lease expired
        (nothing ends a hand-out then but the next one), so what watched it must end too."""
        new = {
            path: HandOut(lease, MARKER in files, marker_identity(path) if look else None, markers)
            for path, lease, files, look, markers in handed
        }
        with self._lock:
            replaced = [path for path in new if path in self._by_path]
            self._by_path.update(new)
        return replaced

    def forget(self, ended: Iterable[tuple[str, str | None]]) -> list[str]:
        """The hand-outs of ``ended``, ``(path, lease)`` each, ended (acknowledged or released);
        with a lease, only that one. Returns the paths that were recorded (and are now forgotten)."""
        gone = []
        with self._lock:
            for path, lease in ended:
                handout = self._by_path.get(path)
                if handout is not None and (lease is None or handout.lease == lease):
                    del self._by_path[path]
                    gone.append(path)
        return gone

    def under(self, root: Path) -> dict[str, HandOut]:
        """The items handed out from the cache directory ``root`` (absolute and normal), by path."""
        with self._lock:
            return {path: self._by_path[path] for path in self._under(root)}

    def forget_under(self, root: Path) -> None:
        """Every hand-out of the pipeline cached in ``root`` ended (it closed or was rebuilt)."""
        with self._lock:
            for path in self._under(root):
                del self._by_path[path]

    def _under(self, root: Path) -> list[str]:
        prefix = str(root).rstrip("/") + "/"
        return [p for p in self._by_path if p.startswith(prefix)]

    def lease_for(self, item: str, how: str) -> Verdict:
        """What an event at ``item`` acknowledges.

        ``how`` is ``"marker"`` (judged by :func:`marker_counts` on the ``.done`` there now and
        what it holds) or ``"deleted"`` (the item is gone: it acknowledges the lease recorded at
        its hand-out).
        """
        with self._lock:
            handout = self._by_path.get(item)
        if handout is None:
            return Verdict(None, "not handed out")
        if how != "marker":
            return Verdict(handout.lease)
        if handout.shipped:
            return Verdict(None, f"{MARKER} is one of the item's own files (ack it over the API or by deleting it)")
        now, holds = read_marker(item)
        if marker_counts(handout, now, holds):
            return Verdict(handout.lease)
        if now is None:
            return Verdict(None, f"the {MARKER} is gone")
        if now == handout.before:
            return Verdict(None, f"this {MARKER} was there before the item was handed out")
        return Verdict(None, f"its {MARKER} holds another lease than the one the item is handed out under", holds)
