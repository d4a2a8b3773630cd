"""The on-disk cache: ownership lock, capacity ledger, staging, atomic publish, eviction.

This module is the only code that writes the ledger or deletes cached files. Layout::

    cache_dir/
      .cachepipe/lock          flock'ed by the owner; holds "pid host"
      .cachepipe/staging/N     downloads in progress (removed on open and close)
      .cachepipe/kept          names left by keep_on_close, adopted by the next owner
      <item>/...               published items

Invariant: the bytes of regular files under ``cache_dir`` never exceed the capacity. Space is
reserved (from listed sizes) before a download starts and released only after the files are
deleted. Bytes found at open that cachepipe does not manage ("foreign") count against the
capacity and are never deleted.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import threading
from pathlib import Path

from .catalog import Item, check_key
from .config import Share
from .errors import CacheLockedError, ConfigError, UnsafeKeyError, VerificationError

__all__ = ["Cache", "tree_bytes"]

log = logging.getLogger("cachepipe.cache")

STATE_DIR = ".cachepipe"


def tree_bytes(root: Path) -> int:
    """Total size in bytes of the regular files under ``root`` (symlinks not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except FileNotFoundError:
                continue  # removed while we walked
            if not os.path.islink(os.path.join(dirpath, name)):
                total += st.st_size
    return total


def _rmtree(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class Cache:
    """A size-capped cache directory owned by one pipeline at a time.

    Args:
        root: the cache directory (created if missing).
        capacity: bytes, or a :class:`~cachepipe.config.Share` of the filesystem's free space,
            resolved by :meth:`open`.
    """

    def __init__(self, root: Path, capacity: int | Share) -> None:
        self.root = Path(root).absolute()
        self.state = self.root / STATE_DIR
        self.staging_root = self.state / "staging"
        self._capacity_spec = capacity
        self.capacity = 0
        self.foreign = 0  # bytes present at open that we do not manage
        self._reserved = 0
        self._published: dict[str, int] = {}  # item name -> size
        self._adoptable: dict[str, int] = {}  # items a keep_on_close owner left -> bytes present
        self._cond = threading.Condition()
        self._closed = False
        self._seq = 0
        self._lock_fd: int | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def open(self) -> None:
        """Take the ownership lock, clear staging leftovers, resolve and check the capacity."""
        self.state.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            if self.staging_root.exists():
                shutil.rmtree(self.staging_root)
            self.staging_root.mkdir()
            if isinstance(self._capacity_spec, Share):
                usage = shutil.disk_usage(self.root)
                self.capacity = int(usage.free * self._capacity_spec.fraction)
            else:
                self.capacity = self._capacity_spec
            kept = self.state / "kept"
            names = [n for n in (kept.read_text(encoding="utf-8").splitlines() if kept.exists() else []) if _safe_name(n)]
            self._adoptable = {n: tree_bytes(self.root / n) for n in names if (self.root / n).exists()}
            self._reserved = sum(self._adoptable.values())
            self.foreign = tree_bytes(self.root) - self._reserved
            if self.foreign >= self.capacity:
                raise ConfigError(
                    f"cache_dir {str(self.root)!r} already holds {self.foreign} bytes not managed by "
                    f"cachepipe, not less than the capacity of {self.capacity} bytes; "
                    "empty it or raise the capacity"
                )
        except BaseException:
            self._unlock()
            raise

    def _lock(self) -> None:
        path = self.state / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CacheLockedError(str(self.root), f"pid {owner}" if owner[:1].isdigit() else owner) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def interrupt(self) -> None:
        """Wake every thread blocked in :meth:`reserve`; from now on it returns False."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self, keep: bool = False) -> None:
        """Interrupt waiters, delete staging and (unless ``keep``) published items; unlock.

        Call only once no thread writes into staging any more.
        """
        self.interrupt()
        if self._lock_fd is None:
            return
        try:
            kept = self.state / "kept"
            if keep:
                _atomic_write(kept, "".join(f"{n}\n" for n in [*self._published, *self._adoptable]))
            else:
                for name in list(self._published):
                    self.evict(name)
                for name in list(self._adoptable):
                    self._drop_adoptable(name)
                kept.unlink(missing_ok=True)
            try:
                shutil.rmtree(self.staging_root)
            except FileNotFoundError:
                pass
            except OSError as exc:  # not fatal: the next open removes staging leftovers
                log.warning("could not remove staging %s: %s", self.staging_root, exc)
        finally:
            self._unlock()

    # ---- the ledger ------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Bytes that can still be reserved right now."""
        with self._cond:
            return self.capacity - self.foreign - self._reserved

    @property
    def used(self) -> int:
        """Bytes accounted under the cache directory: foreign + reserved (staging, ready, handed out)."""
        with self._cond:
            return self.foreign + self._reserved

    @property
    def limit(self) -> int:
        """The largest item that can ever fit: capacity minus foreign bytes."""
        return self.capacity - self.foreign

    def reserve(self, size: int) -> bool:
        """Block until ``size`` bytes fit under the capacity and reserve them.

        Returns False (reserving nothing) if the cache is closed meanwhile.
        """
        with self._cond:
            while not self._closed and self.foreign + self._reserved + size > self.capacity:
                self._cond.wait()
            if self._closed:
                return False
            self._reserved += size
            return True

    def _release(self, size: int) -> None:
        with self._cond:
            self._reserved -= size
            self._cond.notify_all()

    # ---- staging and publish ---------------------------------------------------------
    def stage(self, item: Item) -> Path:
        """Create the staging area for ``item``: its folders and empty files of the listed sizes.

        Returns the staging path (a directory, or a file for single-object items).
        """
        with self._cond:
            self._seq += 1
            path = self.staging_root / str(self._seq)
        if item.is_file:
            with open(path, "wb"):
                pass
            return path
        path.mkdir()
        for f in item.files:
            target = path / f.rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb"):
                pass
        return path

    def item_path(self, item: Item) -> Path:
        """Where ``item`` is (or will be) published."""
        return self.root / item.name

    def adopt(self, item: Item) -> Path | None:
        """Take over ``item`` if a previous owner left it (keep_on_close) with the listed sizes.

        Returns its path, or None when there is nothing to adopt (the caller downloads it).
        """
        if item.name not in self._adoptable:
            return None
        path = self.item_path(item)
        if self._adoptable[item.name] == item.size and _matches(path, item):
            with self._cond:
                self._published[item.name] = self._adoptable.pop(item.name)
            return path
        self._drop_adoptable(item.name)  # a stale copy of ours: drop it and download afresh
        return None

    def _drop_adoptable(self, name: str) -> None:
        size = self._adoptable.pop(name)
        try:
            self._remove_files(name)
        finally:
            self._release(size)

    def publish(self, staged: Path, item: Item) -> Path:
        """Verify sizes, then atomically rename the staged item into place; return its path.

        Raises:
            VerificationError: a file's size differs from the listing.
            FileExistsError: something not managed by this cache is in the way.
        """
        for f in item.files:
            local = staged / f.rel if f.rel else staged
            actual = os.stat(local).st_size
            if actual != f.size:
                raise VerificationError(errno.EIO, f"{f.key}: got {actual} bytes, listing says {f.size}")
        final = self.item_path(item)
        if os.path.lexists(final):
            raise FileExistsError(errno.EEXIST, f"cannot publish item {item.name!r}: {final} exists and is not managed by cachepipe")
        final.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staged, final)
        with self._cond:
            self._published[item.name] = item.size
        return final

    def discard(self, staged: Path, size: int) -> None:
        """Delete a staging area and release its reservation."""
        try:
            _rmtree(staged)
        finally:
            self._release(size)

    def unreserve(self, size: int) -> None:
        """Release a reservation that was never staged."""
        self._release(size)

    def evict(self, name: str) -> None:
        """Delete a published item and release its space.

        Raises:
            KeyError: ``name`` is not a published item of this cache.
        """
        with self._cond:
            size = self._published.pop(name)
        try:
            self._remove_files(name)
        finally:
            self._release(size)

    def _remove_files(self, name: str) -> None:
        path = self.root / name
        if os.path.lexists(path):
            _rmtree(path)
        parent = path.parent  # nested single-file items: drop the folders we made, if now empty
        while parent != self.root and self.root in parent.parents:
            try:
                parent.rmdir()
            except OSError as exc:
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                    break
                raise
            parent = parent.parent

    @property
    def published_count(self) -> int:
        with self._cond:
            return len(self._published)


def _safe_name(name: str) -> bool:
    """A name read back from our own state file is trusted only if it is a safe key."""
    try:
        check_key(name)
    except UnsafeKeyError:
        return False
    return True


def _matches(path: Path, item: Item) -> bool:
    """True when ``path`` holds exactly the item's files with the listed sizes."""
    try:
        if item.is_file:
            return path.is_file() and path.stat().st_size == item.size
        expected = {f.rel: f.size for f in item.files}
        found = {}
        for dirpath, _dirs, files in os.walk(path):
            for name in files:
                p = Path(dirpath, name)
                found[p.relative_to(path).as_posix()] = p.stat().st_size
        return found == expected
    except OSError:
        return False


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
