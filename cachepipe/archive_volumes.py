"""Reading an archive's volumes as one file, and checking them against their MD5s.

:class:`ConcatReader` is one read-only file object over the volumes of one archive, in order,
fed straight to the extractor (no concatenated copy is written); while it reads from the start
without a seek, it computes each volume's MD5 on the way, so that a volume is verified in the
same read that extracts it (:func:`_verify`; :func:`_hash_files` reads them again where the
extractor seeks: a zip). A set stop event ends every read with :class:`InterruptedError`.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .archive_names import archive_format
from .errors import ChecksumError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = ["ConcatReader"]

_CHUNK = 1 << 20
_SNIFF = 512


class ConcatReader(io.RawIOBase):
    """One read-only, seekable file object over ``paths`` in order (the volumes of one archive).

    Opens one volume at a time. While reads are sequential from the start, it feeds each
    volume's bytes to its MD5 (``md5s``); a seek turns hashing off (:attr:`hashed` False).
    Once ``stop`` is set, reads raise :class:`InterruptedError`.
    """

    def __init__(self, paths: Sequence[Path], stop: threading.Event | None = None) -> None:
        super().__init__()
        self.paths = list(paths)
        self.stop = stop
        self.sizes = [os.stat(p).st_size for p in self.paths]
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.total = sum(self.sizes)
        self.md5s = [hashlib.md5(usedforsecurity=False) for _ in self.paths]
        self.hashed = True
        self._pos = 0
        self._index = -1
        self._fh: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset, io.SEEK_END: self.total + offset}[whence]
        if target < 0:
            raise OSError(errno.EINVAL, f"negative seek position {target}")
        if target != self._pos:
            self.hashed = False
            self._pos = target
        return self._pos

    def readinto(self, buffer: WriteableBuffer) -> int:
        """Fill ``buffer`` from as many volumes as it takes; short only at the end."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view) and self._pos < self.total:
            filled += self._read_volume(view[filled:])
        return filled

    def _read_volume(self, view: memoryview) -> int:
        _check_stop(self.stop)
        index = bisect.bisect_right(self.starts, self._pos) - 1
        while self._pos >= self.starts[index] + self.sizes[index]:
            index += 1  # skip empty volumes
        if index != self._index:
            if self._fh is not None:
                self._fh.close()
            self._fh = open(self.paths[index], "rb")  # noqa: SIM115 - kept open across reads
            self._index = index
        fh = self._fh
        if fh is None:  # close() was called
            raise ValueError(f"{self.paths[index]}: read from a closed ConcatReader")
        offset = self._pos - self.starts[index]
        if fh.tell() != offset:
            fh.seek(offset)
        n = fh.readinto(view[: min(len(view), self.sizes[index] - offset)])
        if not n:
            raise OSError(errno.EIO, f"{self.paths[index]}: volume shorter than when opened")
        if self.hashed:
            self.md5s[index].update(view[:n])
        self._pos += n
        return n

    def drain(self) -> None:
        """Read to the end (so that every volume's MD5 covers all of it)."""
        while self.read(_CHUNK):
            pass

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        super().close()


def _sniff(path: Path) -> str | None:
    with open(path, "rb") as fh:
        return archive_format(fh.read(_SNIFF))


def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise InterruptedError(errno.EINTR, "extraction stopped")


def _hash_files(paths: list[Path], which: dict[int, str]) -> dict[int, str]:
    digests = {}
    for i in which:
        md5 = hashlib.md5(usedforsecurity=False)
        with open(paths[i], "rb") as fh:
            while chunk := fh.read(_CHUNK):
                md5.update(chunk)
        digests[i] = md5.hexdigest()
    return digests


def _verify(
    label: str, paths: list[Path], expected: dict[int, str], actual: dict[int, str], cause: BaseException | None = None
) -> None:
    bad = [i for i in expected if actual[i] != expected[i]]
    if bad:
        i = bad[0]
        error = ChecksumError(
            f"{label}: volume {paths[i].name!r} has MD5 {actual[i]}, its checksum file says {expected[i]}"
            + (f" ({len(bad)} volumes differ)" if len(bad) > 1 else ""),
        )
        if cause is not None:
            raise error from cause
        raise error
