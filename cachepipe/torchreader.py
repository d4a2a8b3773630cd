"""Which dataset reads a DataLoader worker's cache folder (per-process mode), and whether it is
making a sample: a note beside the folder, ``cache_dir/.rank<r>-worker<k>.reader``, that the
worker holding the folder writes, for a worker that finds the folder held
(:func:`cachepipe.torchlocal._open`) to tell a worker that stops (its iterator dropped: it makes
the sample in hand, then lets go) from one of a DataLoader that reads at the same time (refused):
of another dataset, or of the same one (two DataLoaders of one dataset).

The note is one line, ``"PID START DATASET WORKERS STATE HANDED"``: the holder's pid and start
time (clock ticks after boot, from ``/proc``), the identity of the dataset object it reads for,
the ``num_workers`` of its DataLoader (which stops them one after the other), ``busy`` (making
a sample), ``idle`` (its sample handed: collating and sending its batch, then waiting for its
DataLoader to ask for the next; :func:`main_thread_ticks` tells which) or ``close`` (closing its
pipeline), and the samples it handed, the last two rewritten in place (fixed width). Written
only where ``/proc`` is (Linux): elsewhere a held folder is not waited for.

Invariant: the folder's lock is the truth; a note only describes the live holder its pid and
start time name (a worker killed with its folder leaves a note that names no live holder, and
the next holder's replaces it). It is written after the lock is taken, renamed into place, so a
reader finds the last holder's note, this one's, or none.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

__all__: list[str] = []

log = logging.getLogger("cachepipe")

State = Literal["busy", "idle", "close"]
_STATES = ("busy", "idle", "close")


def note_path(folder: Path) -> Path:
    """Where the note on the worker folder ``folder`` is: beside it, in ``cache_dir``, not in the
    cache, which owns its folder (``.rank<r>-worker<k>.reader``)."""
    return folder.with_name(f".{folder.name}.reader")


def proc_stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (which may hold spaces): ``[state,
    ppid, ...]``, the start time (clock ticks after boot) at index 19; None if the process is
    gone or ``/proc`` cannot tell (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return fields if len(fields) > 19 else None


def main_thread_ticks(pid: int) -> int | None:
    """The CPU time (clock ticks, user and system) the main thread of the process ``pid`` has
    run; None if it is gone or ``/proc`` cannot tell. A DataLoader worker's main thread makes its
    samples, collates and sends its batches, and runs nothing while it waits for its DataLoader
    (its pipeline's downloads are other threads)."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # [state, ppid, ...]: utime at 11, stime at 12
    return int(fields[11]) + int(fields[12]) if len(fields) > 12 else None


def owner_pid(owner: str) -> int | None:
    """The pid of a :class:`~cachepipe.errors.CacheLockedError`'s owner (``"pid PID HOST"``) on
    this host, else None."""
    parts = owner.split()
    if len(parts) != 3 or parts[0] != "pid" or not parts[1].isdigit() or parts[2] != socket.gethostname():
        return None
    return int(parts[1])


class ReaderNote:
    """The note of this process on the worker folder ``folder`` it holds, for dataset ``dataset``,
    as one of the ``workers`` of its DataLoader.

    Starts ``busy`` with 0 samples handed; :meth:`idle` as the worker hands a sample, :meth:`busy`
    as it is asked for the next, :meth:`closing` before its pipeline closes, :meth:`close` after
    (the note stays: it names a holder that is gone). A note that cannot be written is logged
    once and not written: a worker that finds the folder held then waits for it up to
    ``SIBLING_WAIT`` before it is refused.
    """

    def __init__(self, folder: Path, dataset: str, workers: int) -> None:
        self._fd: int | None = None
        self._handed = 0
        fields = proc_stat("self")
        if fields is None:
            return  # no /proc: a worker that finds the folder held cannot tell its holder's parent either
        path = note_path(folder)
        tmp = path.with_name(f"{path.name}.tmp")  # one writer at a time: the folder's lock holder
        head = f"{os.getpid()} {fields[19]} {dataset} {workers} ".encode()
        fd = None
        try:
            with contextlib.suppress(FileNotFoundError):  # a killed holder's, or a symbolic link: not followed
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            os.write(fd, head + self._tail("busy"))
            os.replace(tmp, path)
        except OSError as exc:  # a full disk, a read-only cache_dir: the pass goes on, not noted
            if fd is not None:  # made here: removed
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            log.warning("cannot note which dataset reads %s (%s): a worker of another dataset waits for it", folder, exc)
            return
        self._fd, self._at = fd, len(head)

    def _tail(self, state: State) -> bytes:
        return f"{state:5} {self._handed:020d}\n".encode()

    def _set(self, state: State) -> None:
        if self._fd is None:
            return
        try:
            os.pwrite(self._fd, self._tail(state), self._at)
        except OSError as exc:  # a full disk does not fail a rewrite in place; an I/O error stops the notes
            log.warning("cannot note the state of the reader of a worker folder (%s): no longer noted", exc)
            self.close()

    def idle(self) -> None:
        """A sample handed: waiting for the DataLoader to ask for the next."""
        self._handed += 1
        self._set("idle")

    def busy(self) -> None:
        """Asked for the next sample: making it."""
        self._set("busy")

    def closing(self) -> None:
        """The pass ends: the pipeline closes (then the folder is let go)."""
        self._set("close")

    def close(self) -> None:
        """Stop writing (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True)
class Reader:
    """What the note on a held worker folder says of its live holder."""

    dataset: str  #: the identity of the dataset object the holder reads for
    workers: int  #: the ``num_workers`` of the holder's DataLoader
    state: State  #: making a sample (``busy``), waiting to be asked (``idle``), closing (``close``)
    handed: int  #: samples handed in this pass


def _read_note(path: Path) -> list[str] | None:
    """The words of the note at ``path``; None if there is none, or something else is there
    (a symbolic link, not followed; a named pipe, whose open would wait for a writer; a socket,
    which no open takes)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a link (not followed), a socket
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 4096).decode(errors="replace").split()
    finally:
        os.close(fd)


def reader(folder: Path, owner: str) -> Reader | None:
    """What the note on ``folder`` says, if it is the note of the live ``owner`` (``"pid PID
    HOST"``, its start time too, from ``/proc``); else None (not written yet, left by an earlier
    holder, or read while it was being rewritten)."""
    pid = owner_pid(owner)
    fields = None if pid is None else proc_stat(pid)
    if fields is None:
        return None
    said = _read_note(note_path(folder))
    if said is None:
        return None
    if len(said) != 6 or said[:2] != [str(pid), fields[19]] or not said[3].isdigit() or said[4] not in _STATES:
        return None
    if not said[5].isdigit():
        return None
    return Reader(said[2], int(said[3]), cast(State, said[4]), int(said[5]))
