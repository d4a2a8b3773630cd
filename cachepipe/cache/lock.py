"""The ownership lock of a cache directory: one owner at a time, in any process on the host.

Invariant: while :meth:`OwnerLock.acquire` holds, no other process holds the ``flock`` on
``.cachepipe/lock``; the kernel releases it when the owner closes it or dies (``kill -9``
included), so a crashed owner never blocks the next one. Nor does a live owner hold a cache
directory inside this one or around it: each cache counts the other's files as its own or as
foreign, and one would evict the other's items.

The nested check runs after this owner's lock is taken, so of two owners opening nested
directories at once, the later to check sees the other (both may refuse; never neither). It
probes each other ``.cachepipe/lock`` with a shared, non-blocking ``flock``: refused means a
live owner holds it (any process, this one included: ``flock`` locks belong to open files).
The probe holds that lock for a moment; an owner opening that directory in that moment is
refused as if it were in use, which is right, since it would nest with this live one.

:func:`unusable_dir` says why a cache directory cannot be created or taken (a read-only
filesystem, no permission, a file on its path, a filesystem that cannot lock files: an NFS mount
whose lock service does not run, :func:`lock_file`), naming the ``cache_dir`` given rather than the
state folder or lock file the failing call was about.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
from pathlib import Path

from ..errors import CacheLockedError
from ..wholefiles import NO_LOCKS

STATE_DIR = ".cachepipe"  # the cache's state folder
LOCK = "lock"  # the file in STATE_DIR that the owner locks
UNKNOWN_OWNER = "another process"  # a lock whose owner's pid neither its line nor the kernel's list of locks tells
# what a cache_dir (or jobs.root) whose filesystem cannot lock files is told to be instead
EXPECTED_LOCKS = "expected a directory on a filesystem with locks (flock): a local disk, or NFS with its lock service"

__all__ = ["EXPECTED_LOCKS", "UNKNOWN_OWNER", "OwnerLock", "lock_file", "unusable_dir"]

log = logging.getLogger("cachepipe.cache")


class OwnerLock:
    """``flock`` on ``path``, which holds ``"pid host"`` of the owner while held (nothing but
    blanks after a release, or where a full disk kept a new cache's owner from writing it).

    Args:
        path: the lock file (created if missing).
        root: the cache directory, for the error message.
    """

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock.

        Raises:
            CacheLockedError: another live process holds it (naming its pid and host).
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            lock_file(fd, str(self.path))
        except BlockingIOError:
            owner = _owner(fd)
            os.close(fd)
            raise CacheLockedError(str(self.root), owner) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd  # held from here: release() closes it whatever happens next
        try:
            nested = nested_owner(self.root)
        except BaseException:
            self.release()
            raise
        if nested is not None:
            self.release()
            other, who, around = nested
            relation = "contains it" if around else "lies inside it"
            raise CacheLockedError(str(self.root), f"{who}, which owns the cache directory {str(other)!r} that {relation}")
        line = f"{os.getpid()} {socket.gethostname()}\n".encode()
        try:
            # over the line an earlier owner left (blanked by its release), then cut to length: a
            # full disk gives no new block, and the file keeps the one it had
            os.pwrite(fd, line, 0)
            os.ftruncate(fd, len(line))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                self.release()
                raise OSError(exc.errno, f"{exc.strerror}: cannot write the cache's lock file {str(self.path)!r}") from exc
            # the file had no line (a new cache, or one an earlier version released): the lock is
            # held all the same; only another process refused it is told "another process"
            log.info("%s: the disk is full: the lock is held without this owner's pid in it (%s)", self.path, exc.strerror)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Blank the owner line and release the lock (idempotent). The line is overwritten with
        spaces, not cut: the file keeps its block, so that the next owner writes its own line
        over it even on a full disk (where a filesystem writes no block in place, copy on write,
        and refuses that, the file is emptied instead). Where neither can be done (a filesystem
        remounted read-only), the line stays, as a killed owner's does, logged, not raised: the
        lock is the ``flock``, let go all the same."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            size = os.fstat(fd).st_size
            try:
                os.pwrite(fd, b" " * size, 0)
            except OSError:
                os.ftruncate(fd, 0)
        except OSError as exc:
            log.warning("%s: could not blank the owner's line (%s); the lock is released all the same", self.path, exc)
        finally:
            os.close(fd)  # closing releases the flock


def lock_file(fd: int, path: str) -> None:
    """Lock the file open (for writing) as ``fd`` exclusively, without waiting (``flock``).

    Raises:
        BlockingIOError: another open file holds its lock.
        OSError: ``ENOLCK`` naming ``path``, where its filesystem cannot lock files
            (:data:`~cachepipe.wholefiles.NO_LOCKS`: an NFS mount whose lock service does not run);
            :func:`unusable_dir` says so. Another error as it is.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in NO_LOCKS:  # BlockingIOError (EAGAIN) among them
            raise
        raise OSError(errno.ENOLCK, f"{exc.strerror} (flock)", path) from exc


def nested_owner(root: Path) -> tuple[Path, str, bool] | None:
    """A live owner of a cache directory around ``root`` or inside it: ``(directory, "pid N host",
    around)``, or None. Never blocks. Looks at every ancestor of ``root`` (as resolved) and at
    every folder under it (a walk of its folders, no symlinks followed, no state folders entered)."""
    real = Path(os.path.realpath(root))
    for parent in real.parents:
        who = _held(parent / STATE_DIR / LOCK)
        if who is not None:
            return parent, who, True
    top = str(real)
    folders = [top]
    while folders:  # os.scandir alone (os.walk also sorts every file of every item folder)
        folder = folders.pop()
        try:
            entries = os.scandir(folder)
        except OSError:
            continue  # removed meanwhile, or not ours to list: as os.walk
        with entries:
            for entry in entries:
                try:
                    if entry.name == STATE_DIR:
                        if folder != top and entry.is_dir() and (who := _held(Path(entry.path, LOCK))) is not None:
                            return Path(folder), who, False
                    elif entry.is_dir(follow_symlinks=False):
                        folders.append(entry.path)
                except OSError:
                    continue
    return None


def _held(lock: Path) -> str | None:
    """``"pid N host"`` (or ``"another process"``) when a live owner holds ``lock``, else None."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None  # no cache there
    except PermissionError:
        return None  # another user's file: its owner cannot be told; its own open refuses us if it comes later
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _owner(fd)
        except OSError as exc:
            if exc.errno in NO_LOCKS:  # a filesystem without locks: its owner, if any, cannot be told
                return None
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _owner(fd: int) -> str:
    """Who holds the ``flock`` of the lock file open as ``fd`` (held by another process):
    ``"pid N host"`` as its line says; where it has none (taken a moment ago, its line not yet
    written, or never: its disk was full), the pid the kernel lists for the lock
    (:func:`_locker`) on this host; else :data:`UNKNOWN_OWNER`."""
    line = os.pread(fd, 256, 0).decode(errors="replace").strip()
    if line[:1].isdigit():
        return f"pid {line}"
    pid = _locker(fd)
    return UNKNOWN_OWNER if pid is None else f"pid {pid} {socket.gethostname()}"


def _locker(fd: int) -> int | None:
    """The pid that holds an exclusive ``flock`` on the file open as ``fd``, as ``/proc/locks``
    lists it (``1: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF``: Linux, this host's locks);
    None where it is not listed (another OS) or its pid is not seen from here (0, or the lock
    left out: another pid namespace), or the lock was let go meanwhile, or where two holders
    are listed for it (two files of one number on one device: btrfs subvolumes). The device there is
    the filesystem's (its superblock's), which its files' own may not be (every file of btrfs,
    a file of an overlayfs whose layers are on other filesystems): that of the mount the file
    was opened through (:func:`_mount_device`) is looked for too."""
    st = os.fstat(fd)
    devices = {f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}", _mount_device(fd)}
    keys = {f"{device}:{st.st_ino}" for device in devices if device}
    holders: set[int] = set()
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as listed:
            for entry in listed:
                fields = entry.split()  # a process waiting for a lock is listed with "->" after the number
                if fields[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and len(fields) > 5 and fields[5] in keys:
                    holders.add(int(fields[4]))
    except (OSError, ValueError):
        return None
    # two holders: one is another file's (a btrfs subvolume's file of the same number, under the same device)
    pid = holders.pop() if len(holders) == 1 else 0
    return pid if pid > 0 else None


def _mount_device(fd: int) -> str:
    """``MAJ:MIN`` (hexadecimal, as ``/proc/locks`` writes it) of the filesystem of the mount
    the file open as ``fd`` was opened through (its ``mnt_id`` in ``/proc/self/fdinfo``, its
    device in ``/proc/self/mountinfo``); "" where ``/proc`` does not tell."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as info:
            mount = next((line.split()[1] for line in info if line.startswith("mnt_id:")), None)
        if mount is None:
            return ""
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mounts:
            for line in mounts:
                fields = line.split(maxsplit=3)
                if len(fields) > 2 and fields[0] == mount:
                    major, minor = (int(n) for n in fields[2].split(":"))
                    return f"{major:02x}:{minor:02x}"
    except (OSError, ValueError, IndexError):
        return ""
    return ""


_UNUSABLE = {errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR, errno.EEXIST, errno.ENOLCK}


def unusable_dir(given: str | os.PathLike[str], exc: OSError, field: str = "cache_dir") -> OSError | None:
    """The error to raise, chained to ``exc``, when creating or taking the cache directory
    ``given`` (its ``.cachepipe`` folder, its lock file) failed with ``exc`` because the directory
    cannot be used: ``<field> <given>: <why>; expected ...``, with ``exc``'s errno, so that it is
    the same builtin (``PermissionError``, ``FileNotFoundError``, ``OSError`` with ``EROFS``...).
    None for any other failure (a full disk, an I/O error): raise ``exc`` as it is."""
    if exc.errno not in _UNUSABLE:
        return None
    path = os.path.abspath(given)
    existing = path  # the nearest folder on the path that exists (or what is there instead)
    while True:
        try:
            mode = os.stat(existing).st_mode
            break
        except (FileNotFoundError, NotADirectoryError):
            existing = os.path.dirname(existing)
        except OSError:
            mode = stat.S_IFDIR
            break
    created = existing != path
    expected = "expected a directory this user can write to"
    if not stat.S_ISDIR(mode):
        why = f"{existing!r} on its path is not a directory" if created else f"{existing!r} is not a directory"
    elif exc.errno == errno.EROFS:
        why = f"cannot be created: {existing!r} is on" if created else "on"
        why, expected = f"{why} a read-only filesystem", "expected a directory on a writable filesystem"
    elif exc.errno == errno.ENOLCK:  # lock_file's: the owner's lock, without which a second owner is not kept out
        why = f"its filesystem cannot lock files ({exc.strerror}, {exc.filename!r}: NFS without its lock service?)"
        expected = EXPECTED_LOCKS
    elif exc.errno in (errno.EACCES, errno.EPERM):
        at = f" at {exc.filename!r}" if exc.filename and exc.filename != path and not created else ""
        why = f"cannot be created under {existing!r}: " if created else ""
        why += f"permission denied for this user (uid {os.geteuid()}){at}"
    elif created:  # ENOENT with the folder above there: its filesystem makes no folders (/proc, /sys)
        why = f"cannot be created under {existing!r}: its filesystem does not allow it ({exc.strerror})"
    else:
        why = f"{exc.strerror}: {exc.filename!r}"  # removed while it was taken
    return OSError(exc.errno, f"{field} {os.fspath(given)!r}: {why}; {expected}")
