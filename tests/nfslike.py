"""A file system whose ``flock`` is NFS's, for tests: a FUSE loopback of a folder (every call
passed to the folder's own file), run as a process of its own by :func:`mounts.nfs_like`.

``flock`` is answered as an NFS client answers it, which a local file system cannot show:

- ``nfs``: NFS emulates ``flock`` with byte-range locks (the server's), so an exclusive lock on
  a descriptor open for reading only is refused with ``EBADF`` (flock(2), "NFS details"); the
  others are the folder's own ``flock``, one lock per open file, as on NFS.
- ``nolock``: an NFSv3 mount whose lock service does not run (no ``rpc.statd``): every
  ``flock`` is refused with ``ENOLCK``.

A removed file that is still open stays in its folder under a hidden name until it is closed
(FUSE's ``.fuse_hidden*``, as NFS's ``.nfsXXXX``), so the folder cannot be removed meanwhile;
removing that name is refused with ``EBUSY``, as on NFS (FUSE alone would hide it again).

Usage: ``python tests/nfslike.py FOLDER MOUNTPOINT nfs|nolock`` (in the foreground; unmount with
``fusermount3 -u``). Needs libfuse 3 (Debian's ``fuse3``) and ``mfusepy``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
from typing import Any

import mfusepy as fuse

STAT = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_ino", "st_blksize")
STATFS = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_namemax")


class Loopback(fuse.Operations):
    """Every call on ``root``'s files; ``flock`` as ``locks`` says (see the module)."""

    use_ns = True

    def __init__(self, root: str, locks: str) -> None:
        self.root, self.locks = os.path.abspath(root), locks

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._path(path)) if fh is None else os.fstat(fh)
        times = {k: getattr(st, f"{k}_ns") for k in ("st_atime", "st_mtime", "st_ctime")}  # in ns (use_ns)
        return {k: getattr(st, k) for k in STAT} | times

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._path(path))]

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._path(path))
        return {k: getattr(sv, k) for k in STATFS}

    def mkdir(self, path: str, mode: int) -> None:
        os.mkdir(self._path(path), mode)

    def mknod(self, path: str, mode: int, dev: int) -> None:
        os.mknod(self._path(path), mode, dev)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._path(path))

    def unlink(self, path: str) -> None:
        os.unlink(self._path(path))

    def rename(self, old: str, new: str, flags: int = 0) -> None:
        if flags:  # RENAME_NOREPLACE, RENAME_EXCHANGE: not passed on here
            raise fuse.FuseOSError(errno.EINVAL)
        if all(os.path.basename(p).startswith(".fuse_hidden") for p in (old, new)):
            raise fuse.FuseOSError(errno.EBUSY)  # FUSE hiding a hidden open file again: NFS refuses its unlink
        os.rename(self._path(old), self._path(new))

    def link(self, target: str, source: str) -> None:
        os.link(self._path(source), self._path(target))

    def symlink(self, target: str, source: str) -> None:
        os.symlink(source, self._path(target))

    def readlink(self, path: str) -> str:
        return os.readlink(self._path(path))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._path(path), mode)

    def chown(self, path: str, uid: int, gid: int) -> None:
        os.chown(self._path(path), uid, gid, follow_symlinks=False)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._path(path) if fh is None else fh, length)

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> None:
        os.utime(self._path(path), ns=times, follow_symlinks=False)

    def open(self, path: str, flags: int) -> int:
        return os.open(self._path(path), flags)

    def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
        return os.open(self._path(path), flags | os.O_CREAT, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        return os.pwrite(fh, data, offset)

    def fsync(self, path: str, datasync: int, fh: int) -> None:
        os.fsync(fh)

    def flush(self, path: str, fh: int) -> None:
        pass

    def release(self, path: str, fh: int) -> None:
        os.close(fh)  # closing lets go of its flock, as on NFS

    def flock(self, path: str, fh: int, op: int) -> None:
        if self.locks == "nolock":
            raise fuse.FuseOSError(errno.ENOLCK)
        if op & fcntl.LOCK_EX and fcntl.fcntl(fh, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise fuse.FuseOSError(errno.EBADF)
        fcntl.flock(fh, op)  # LOCK_NB: refused at once; without: this call's thread waits


if __name__ == "__main__":
    root, mountpoint, locks = sys.argv[1:4]
    if locks not in ("nfs", "nolock"):
        sys.exit(f"locks {locks!r}: expected nfs or nolock")
    fuse.FUSE(Loopback(root, locks), mountpoint, foreground=True, nothreads=False)
