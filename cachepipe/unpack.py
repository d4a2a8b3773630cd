"""Safe extraction of downloaded archives: :func:`unpack_item` (for ``cachepipe map --unpack``) and
:func:`unpack_in_place`, which puts the extraction in the item's place (for ``Pipeline(unpack=True)``).

Formats, recognised by the first bytes of the (first volume of the) archive, not by its name:
tar, gzip/bzip2/xz-compressed tar (``.tar``, ``.tar.gz``/``.tgz``, ``.tar.bz2``, ``.tar.xz``),
zstd-compressed tar (``.tar.zst``, needs the optional ``zstandard`` package) and zip.

**Split volumes.** Files named ``<stem>-00``, ``<stem>-01``... (two or more digits),
``<stem>.partaa``, ``<stem>.partab``... (``split`` letters or digits after ``.part``) or
``<stem>.001``, ``<stem>.002``... in one folder are the volumes of one archive ``<stem>``. They
must be numbered without gaps; they are read in order through :class:`ConcatReader`, one file
object over all of them, straight into the extractor: no concatenated copy is written.

**Checksums.** A ``<file>.md5`` sidecar (``<md5>``, ``<md5>  <name>`` as ``md5sum`` prints it,
or ``<name> <md5>``) or an ``md5sums``/``MD5SUMS`` file anywhere in the item gives the MD5 of
the volume or archive with that file name. Each one that has an entry is verified, while it
streams into the extractor (one read of the data); a mismatch raises :class:`ChecksumError`
and leaves ``out_dir`` empty.

**Safety.** Every member is checked before anything is written for it, and the whole
extraction is undone on the first rejection (``out_dir`` is left empty). Rejected, with an
:class:`UnsafeMemberError` naming the archive, the member and the reason: absolute names,
``..`` segments, NUL or control characters, symbolic or hard links whose target is absolute or
resolves outside ``out_dir``, device files, FIFOs and sockets, zip entries repeated under one
name, a file that another archive of the item already wrote. :class:`ArchiveTooLargeError`:
more than ``max_members`` members, or an extracted total over ``limit_bytes`` (a tar bomb) —
checked from the declared sizes *before* a member is written, so ``out_dir`` never holds more
than ``limit_bytes``; the error names the size the extraction would reach (for a zip, also the
total of its central directory) and the caller's ``advice`` (the option that sets the limit).
A tar member refused for its size is read first (and dropped, at most :data:`_PROBE` bytes, 8 MiB):
an archive that ends within them is refused as truncated, which no limit would extract.
Tar members then go through Python's ``tarfile`` ``data`` filter as a second line (it resolves
links and existing paths with ``realpath``); zip members are written by this module, each
target checked with ``realpath`` to stay inside ``out_dir``.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import logging
import os
import re
import shutil
import stat
import tarfile
import threading
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal, cast

from .errors import ArchiveError, ArchiveTooLargeError, ChecksumError, UnsafeMemberError

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

__all__ = [
    "DEFAULT_MAX_MEMBERS",
    "ArchiveError",
    "ArchiveTooLargeError",
    "ChecksumError",
    "ConcatReader",
    "UnpackResult",
    "UnsafeMemberError",
    "adopt_others",
    "archive_format",
    "is_checksum_file",
    "split_volume",
    "unpack_in_place",
    "unpack_item",
]

log = logging.getLogger("cachepipe.unpack")

DEFAULT_MAX_MEMBERS = 10_000_000
"""Most members one item may extract (inodes are a resource too); the Something-Something v2
archive, for one, holds about 220,000 files."""

_CHUNK = 1 << 20
_SNIFF = 512
_PROBE = 8 << 20
"""Most bytes of a tar member refused for its size that are read (and dropped) to tell an archive
cut short inside that member (refused as truncated) from one that is too large: about 0.03 s of
gzip. An archive cut further into the member is refused as too large, as before: reading more
would make every bomb slower to refuse (a GiB of zeros took 3.5 s as gzip, 21 s as xz and
minutes as bzip2, whose reader copies what is left of its buffer at every read)."""
_TarMode = Literal["r|", "r|gz", "r|bz2", "r|xz"]
_TAR_MODES: dict[str, _TarMode] = {"tar": "r|", "tar.gz": "r|gz", "tar.bz2": "r|bz2", "tar.xz": "r|xz"}

_VOLUME_PATTERNS = (
    re.compile(r"^(?P<stem>.+)-(?P<idx>[0-9]{2,})$"),
    re.compile(r"^(?P<stem>.+)\.part(?P<idx>[a-z]{2,}|[0-9]{2,})$"),
    re.compile(r"^(?P<stem>.+)\.(?P<idx>[0-9]{3})$"),
)
_CHECKSUM_NAMES = frozenset({"md5sums", "md5sums.txt", "md5sum.txt", "checksums.md5"})
_MD5_RE = re.compile(r"^[0-9a-fA-F]{32}$")


@dataclass
class UnpackResult:
    """What :func:`unpack_item` did.

    Attributes:
        archives: the archives extracted, each named by its first volume (relative to the item).
        members: files, links and folders written.
        bytes: bytes of regular files written.
        verified: volumes whose MD5 was checked (and matched).
        other: files of the item that are neither archives nor checksum files (left alone).
    """

    archives: list[str] = field(default_factory=list)
    members: int = 0
    bytes: int = 0
    verified: list[str] = field(default_factory=list)
    other: list[str] = field(default_factory=list)


# ---- names (pure) -----------------------------------------------------------------------
def split_volume(name: str) -> tuple[str, str] | None:
    """``(stem, index)`` when the file name ``name`` looks like a volume of a split archive.

    >>> split_volume("data.tar.gz-01"), split_volume("data.tar.gz.partab"), split_volume("a.tar")
    (('data.tar.gz', '01'), ('data.tar.gz', 'ab'), None)
    """
    base = name.rsplit("/", 1)[-1]
    if is_checksum_file(base):
        return None
    for pattern in _VOLUME_PATTERNS:
        match = pattern.match(base)
        if match:
            return match.group("stem"), match.group("idx")
    return None


def is_checksum_file(name: str) -> bool:
    """True for ``*.md5`` sidecars and ``md5sums``-style lists."""
    base = name.rsplit("/", 1)[-1]
    return base.lower().endswith(".md5") or base.lower() in _CHECKSUM_NAMES


def _index_value(index: str) -> int:
    if index.isdigit():
        return int(index)
    value = 0
    for ch in index:
        value = value * 26 + (ord(ch) - ord("a"))
    return value


def order_volumes(stem: str, parts: Iterable[tuple[str, str]]) -> list[str]:
    """Sort ``(path, index)`` volumes of ``stem``; raise :class:`ArchiveError` on a gap or mixed numbering."""
    parts = list(parts)
    kinds = {(idx.isdigit(), len(idx) if not idx.isdigit() else 0) for _p, idx in parts}
    if len(kinds) > 1:
        raise ArchiveError(f"split archive {stem!r}: volumes numbered in different styles: {sorted(p for p, _ in parts)}")
    ordered = sorted(parts, key=lambda pi: _index_value(pi[1]))
    values = [_index_value(idx) for _p, idx in ordered]
    for (path, _idx), prev, cur in zip(ordered[1:], values[:-1], values[1:], strict=True):
        if cur == prev:
            raise ArchiveError(f"split archive {stem!r}: two volumes with the same number ({path!r})")
        if cur != prev + 1:
            raise ArchiveError(f"split archive {stem!r}: a volume is missing before {path!r}")
    return [p for p, _ in ordered]


def parse_checksums(text: str, default_name: str | None) -> dict[str, str]:
    """MD5s by file name from a sidecar or an ``md5sums`` list; ``default_name`` for a bare digest."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        words = line.strip().split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) == 1 and _MD5_RE.match(words[0]) and default_name:
            found[default_name] = words[0].lower()
        elif len(words) >= 2 and _MD5_RE.match(words[0]):
            found[" ".join(words[1:]).lstrip("*").rsplit("/", 1)[-1]] = words[0].lower()
        elif len(words) >= 2 and _MD5_RE.match(words[-1]):
            found[" ".join(words[:-1]).rsplit("/", 1)[-1]] = words[-1].lower()
    return found


# ---- reading volumes ----------------------------------------------------------------------
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


def archive_format(head: bytes) -> str | None:
    """``"tar"``, ``"tar.gz"``, ``"tar.bz2"``, ``"tar.xz"``, ``"tar.zst"``, ``"zip"`` or None, from the first bytes."""
    if head[:2] == b"\x1f\x8b":
        return "tar.gz"
    if head[:3] == b"BZh":
        return "tar.bz2"
    if head[:6] == b"\xfd7zXZ\x00":
        return "tar.xz"
    if head[:4] == b"\x28\xb5\x2f\xfd":
        return "tar.zst"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return "zip"
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "tar"
    return None


def _sniff(path: Path) -> str | None:
    with open(path, "rb") as fh:
        return archive_format(fh.read(_SNIFF))


# ---- member checks -------------------------------------------------------------------------
class _Budget:
    def __init__(self, limit_bytes: int, max_members: int, advice: str | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.max_members = max_members
        self.advice = advice  # what to raise, appended to a refusal for bytes
        self.bytes = 0
        self.members = 0

    def over(self, archive: str, member: str, size: int, total: int | None = None) -> ArchiveTooLargeError:
        """The refusal of ``member`` (``size`` bytes); ``total``: the archive's whole extracted size, when known."""
        whole = f" (its files total {total} bytes)" if total is not None else ""
        return ArchiveTooLargeError(
            archive,
            member,
            f"extracting its {size} bytes would bring the item to {self.bytes + size} bytes{whole}, over the limit of "
            f"{self.limit_bytes} bytes" + (f"; {self.advice}" if self.advice else ""),
        )

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes stay within ``limit_bytes``."""
        return self.bytes + size <= self.limit_bytes

    def add(self, archive: str, member: str, size: int) -> None:
        if self.members + 1 > self.max_members:
            raise ArchiveTooLargeError(archive, member, f"more than {self.max_members} members")
        if not self.fits(size):
            raise self.over(archive, member, size)
        self.members += 1
        self.bytes += size


def _check_name(archive: str, name: str) -> str:
    """The member's relative path (``/``-separated, no ``./``), or raise :class:`UnsafeMemberError`."""
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UnsafeMemberError(archive, name, "NUL or a control character in the name")
    if name.startswith("/") or re.match(r"^[A-Za-z]:[/\\]", name):
        raise UnsafeMemberError(archive, name, "absolute path")
    segments = [s for s in name.split("/") if s not in ("", ".")]
    if ".." in segments:
        raise UnsafeMemberError(archive, name, "'..' path segment (would write outside the item)")
    return "/".join(segments)


def _check_link(archive: str, name: str, rel: str, target: str, hard: bool) -> str:
    """The link target relative to the item root, or raise if it is absolute or leaves the item."""
    if not target:
        raise UnsafeMemberError(archive, name, "link with an empty target")
    if target.startswith("/"):
        raise UnsafeMemberError(archive, name, f"link to the absolute path {target!r}")
    base = [] if hard else rel.split("/")[:-1]
    parts: list[str] = list(base)
    for seg in target.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if not parts:
                raise UnsafeMemberError(archive, name, f"link to {target!r}, outside the item")
            parts.pop()
        else:
            parts.append(seg)
    return "/".join(parts)


def _inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(path), real_root]) == real_root


# ---- extraction ----------------------------------------------------------------------------
def _check_stop(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise InterruptedError(errno.EINTR, "extraction stopped")


class _Extraction:
    def __init__(
        self, out_dir: Path, budget: _Budget, result: UnpackResult, stop: threading.Event | None = None, item: str = ""
    ) -> None:
        self.out = out_dir
        self.item = item  # the item's name as listed, for error messages
        self.stop = stop  # checked before each member and each read (a member's data may be buffered)
        self.budget = budget
        self.result = result
        self.written: dict[str, str] = {}  # rel path -> archive that wrote it
        self.sizes: dict[str, int] = {}  # rel path -> size, for hard links

    def claim(self, archive: str, name: str, rel: str) -> None:
        owner = self.written.get(rel)
        if owner is not None and owner != archive:
            raise UnsafeMemberError(archive, name, f"collides with {rel!r} extracted from {owner!r}")
        self.written[rel] = archive

    def unwritable(self, archive: str, name: str, is_dir: bool, exc: OSError) -> ArchiveError | None:
        """The :class:`ArchiveError` that ``exc``, raised writing member ``name`` (a folder if
        ``is_dir``), stands for when the member's path cannot be made: a file where the member
        needs a folder or the reverse (names of the archive that clash), a name or path over the
        file system's limits. None for any other error (a full disk...), which stays as it is."""
        rel = _check_name(archive, name)  # checked before: only normalised here
        where = f"archive {archive!r} of item {self.item!r}: member {_abridged(name)}"
        if exc.errno == errno.ENAMETOOLONG:
            return ArchiveError(f"{where} cannot be extracted: {_too_long(self.out, rel)}")
        if exc.errno not in (errno.ENOTDIR, errno.EEXIST, errno.EISDIR):
            return None
        parts = rel.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if os.path.lexists(self.out / folder) and not (self.out / folder).is_dir():
                return ArchiveError(
                    f"{where} needs a folder {folder!r}, but {folder!r} is a file{self._origin(archive, folder)}; "
                    "rename one of the two"
                )
        target = self.out / rel
        if not is_dir and target.is_dir() and not target.is_symlink():
            return ArchiveError(
                f"{where} is a file, but {rel!r} is a folder of members extracted before it; rename one of the two"
            )
        if is_dir and os.path.lexists(target) and not target.is_dir():
            return ArchiveError(f"{where} is a folder, but {rel!r} is a file{self._origin(archive, rel)}; rename one of the two")
        return None

    def _origin(self, archive: str, rel: str) -> str:
        """Where the file ``rel`` came from, when another archive of the item wrote it."""
        owner = self.written.get(rel, archive)
        return "" if owner == archive else f" extracted from {owner!r}"

    def tar(self, archive: str, stream: io.RawIOBase, fmt: str) -> None:
        # a binary file at run time; typeshed does not declare RawIOBase an IO[bytes] (its read may return None)
        binary = cast("IO[bytes]", stream)
        mode: _TarMode
        if fmt == "tar.zst":
            try:
                import zstandard
            except ImportError as exc:
                raise ArchiveError(f"{archive}: a zstd archive needs the 'zstandard' package (pip install zstandard)") from exc
            source: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(binary, read_across_frames=True, closefd=False)
            mode = "r|"
        else:
            source, mode = binary, _TAR_MODES[fmt]
        # tarfile's own buffer size: its stream inflates a whole compressed read at once and copies
        # what is left after each member read; a 1 MiB read of zeros is ~1 GB in memory.
        with tarfile.open(fileobj=source, mode=mode) as tar:
            for member in tar:
                self._tar_member(archive, tar, member)

    def _tar_member(self, archive: str, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        _check_stop(self.stop)
        name = member.name
        rel = _check_name(archive, name)
        if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
            kind = "device file" if (member.ischr() or member.isblk()) else "FIFO" if member.isfifo() else "special file"
            raise UnsafeMemberError(archive, name, f"{kind}: only files, folders and links inside the item are extracted")
        if not rel:
            return  # the archive's root folder entry ('./')
        size = member.size if member.isreg() else 0
        if member.issym() or member.islnk():
            target = _check_link(archive, name, rel, member.linkname, hard=member.islnk())
            if member.islnk():
                if target not in self.sizes:
                    raise UnsafeMemberError(
                        archive, name, f"hard link to {member.linkname!r}, which is not a file extracted before it"
                    )
                size = self.sizes[target]
        if not member.isdir():
            self.claim(archive, name, rel)
        if member.isreg() and not self.budget.fits(size):
            _read_data(tar, member, self.stop)  # an archive that ends just inside it: truncated, not too large
        self.budget.add(archive, name, size)
        try:
            tar.extract(member, self.out, filter="data")
        except tarfile.FilterError as exc:
            raise UnsafeMemberError(archive, name, f"refused by tarfile's data filter: {exc}") from exc
        except OSError as exc:
            error = self.unwritable(archive, name, member.isdir(), exc)
            if error is None:
                raise
            raise error from exc
        if member.isreg() or member.islnk():
            self.sizes[rel] = size
            self.result.bytes += size
        self.result.members += 1

    def zip(self, archive: str, stream: io.RawIOBase) -> None:
        with zipfile.ZipFile(io.BufferedReader(stream, _CHUNK)) as zf:
            infos = zf.infolist()
            seen: set[str] = set()
            planned = _Budget(self.budget.limit_bytes, self.budget.max_members - self.budget.members, self.budget.advice)
            planned.bytes = self.budget.bytes
            total = self.budget.bytes + sum(0 if i.is_dir() else i.file_size for i in infos)
            for info in infos:  # refuse a bomb from the central directory, before writing anything
                rel = _check_name(archive, info.filename)
                if rel in seen and not info.is_dir():
                    raise UnsafeMemberError(archive, info.filename, "a second entry with the same name")
                seen.add(rel)
                size = 0 if info.is_dir() else info.file_size
                if planned.bytes + size > planned.limit_bytes:
                    raise planned.over(archive, info.filename, size, total)
                planned.add(archive, info.filename, size)
            for info in infos:
                try:
                    self._zip_member(archive, zf, info)
                except OSError as exc:
                    error = self.unwritable(archive, info.filename, info.is_dir(), exc)
                    if error is None:
                        raise
                    raise error from exc

    def _zip_member(self, archive: str, zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> None:
        _check_stop(self.stop)
        name = info.filename
        rel = _check_name(archive, name)
        mode = info.external_attr >> 16
        kind = (stat.S_IFMT(mode) if info.create_system == 3 else 0) or stat.S_IFREG
        if info.is_dir():
            kind = stat.S_IFDIR
        if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
            what = {stat.S_IFCHR: "device file", stat.S_IFBLK: "device file", stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket"}.get(
                kind, "special file"
            )
            raise UnsafeMemberError(archive, name, f"{what}: only files, folders and links inside the item are extracted")
        if not rel:
            return
        target = self.out / rel
        if not _inside(self.out, target.parent if kind != stat.S_IFDIR else target):
            raise UnsafeMemberError(archive, name, "its folder resolves outside the item (through a link)")
        if kind == stat.S_IFDIR:
            self.budget.add(archive, name, 0)
            target.mkdir(parents=True, exist_ok=True)
            self.result.members += 1
            return
        self.claim(archive, name, rel)
        if kind == stat.S_IFLNK:
            if info.file_size > 4096:
                raise UnsafeMemberError(archive, name, "symbolic link with a target longer than 4096 bytes")
            link = zf.read(info).decode("utf-8", "surrogateescape")
            _check_link(archive, name, rel, link, hard=False)
            self.budget.add(archive, name, 0)
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(target):
                os.unlink(target)
            os.symlink(link, target)
            self.result.members += 1
            return
        self.budget.add(archive, name, info.file_size)
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target):
            os.unlink(target)  # never write through an existing link
        written = 0
        with zf.open(info) as src, open(target, "xb") as dst:
            while chunk := src.read(_CHUNK):
                written += len(chunk)
                if written > info.file_size:
                    raise ArchiveTooLargeError(archive, name, f"inflates beyond its declared {info.file_size} bytes")
                dst.write(chunk)
        self.sizes[rel] = written
        self.result.bytes += written
        self.result.members += 1


def _abridged(name: str, most: int = 120) -> str:
    """``name`` quoted, with its middle left out when it is longer than ``most`` characters."""
    if len(name) <= most:
        return repr(name)
    return f"{name[: most // 2] + '...' + name[-most // 2 :]!r} ({len(os.fsencode(name))} bytes)"


def _too_long(out: Path, rel: str) -> str:
    """Which limit of the file system the path of member ``rel`` under ``out`` passes (ENAMETOOLONG)."""
    longest = max(len(os.fsencode(part)) for part in rel.split("/"))
    path = len(os.fsencode(out / rel))
    name_max: int | None = None
    path_max: int | None = None
    try:
        name_max, path_max = os.pathconf(out, "PC_NAME_MAX"), os.pathconf(out, "PC_PATH_MAX")
    except (OSError, ValueError):  # limits unknown (not POSIX, or not told)
        pass
    if name_max is not None and longest > name_max:
        return (
            f"a name in its path is {longest} bytes; a name may be at most {name_max} bytes on the cache's file system: "
            "shorten it in the archive"
        )
    if path_max is not None and path >= path_max:
        return (
            f"its path in the cache would be {path} bytes; a path must be shorter than {path_max} bytes on the cache's "
            "file system: shorten its names in the archive, or the cache directory's path"
        )
    return "its path is too long for the cache's file system; shorten its names in the archive"


def _archive_sets(root: Path) -> tuple[list[list[str]], dict[str, str], list[str]]:
    """Archives of a folder item (each a list of volume paths in order), MD5s by file name, other files."""
    files: list[str] = []
    for dirpath, dirs, names in os.walk(root):
        dirs.sort()
        for name in sorted(names):
            path = Path(dirpath, name)
            if not path.is_symlink() and path.is_file():
                files.append(path.relative_to(root).as_posix())
    checksums: dict[str, str] = {}
    volumes: dict[str, list[tuple[str, str]]] = {}
    singles: list[str] = []
    for rel in files:
        if is_checksum_file(rel):
            base = rel.rsplit("/", 1)[-1]
            default = base[:-4] if base.lower().endswith(".md5") else None
            with open(root / rel, "rb") as fh:
                text = fh.read(16 * 1024 * 1024).decode("utf-8", "replace")
            for fname, digest in parse_checksums(text, default).items():
                if checksums.get(fname, digest) != digest:
                    raise ArchiveError(f"two checksum files disagree on the MD5 of {fname!r}")
                checksums[fname] = digest
            continue
        split = split_volume(rel)
        if split is not None:
            folder = rel.rsplit("/", 1)[0] if "/" in rel else ""
            volumes.setdefault(f"{folder}/{split[0]}" if folder else split[0], []).append((rel, split[1]))
        else:
            singles.append(rel)
    sets: list[list[str]] = []
    other: list[str] = []
    for stem, parts in sorted(volumes.items()):
        sets.append(order_volumes(stem, parts))
    for rel in singles:
        if _sniff(root / rel) is not None:
            sets.append([rel])
        else:
            other.append(rel)
    sets.sort(key=lambda s: s[0])
    return sets, checksums, other


def _clear(out_dir: Path) -> None:
    for entry in os.scandir(out_dir):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
        else:
            os.unlink(entry.path)


def unpack_item(
    item_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    limit_bytes: int,
    max_members: int = DEFAULT_MAX_MEMBERS,
    stop: threading.Event | None = None,
    advice: str | None = None,
    name: str | None = None,
) -> UnpackResult:
    """Extract the archive(s) of a downloaded item into ``out_dir``, safely (see the module docstring).

    Args:
        item_path: a single archive file, or a folder holding archives, split volumes,
            ``.md5`` sidecars and ``md5sums`` files. Other files are left alone (listed in
            :attr:`UnpackResult.other`). The item is only read.
        out_dir: where every archive of the item is extracted (created if missing; must be empty).
        limit_bytes: most bytes of files the extraction may write; a member that would pass
            it is refused before it is written.
        max_members: most members (files, folders, links) to extract.
        advice: what to raise when the extraction passes ``limit_bytes`` (the option that set
            it), appended to the :class:`ArchiveTooLargeError`, which also names the size the
            extraction would reach (for a zip, the total of its central directory).
        stop: once set, the extraction stops at the next member or read with
            :class:`InterruptedError` (and ``out_dir`` is emptied, as on any error).
        name: the item's name as listed, which error messages give (default: the last
            segment of ``item_path``).

    Returns:
        an :class:`UnpackResult`.

    Raises:
        ArchiveError: no archive in the item, a truncated or corrupt one, gaps in split volumes,
            members that cannot be written as named (a file ``a`` and a member ``a/b``, a name
            over the file system's limit); :class:`UnsafeMemberError` or
            :class:`ArchiveTooLargeError` for a refused member.
        ChecksumError: a volume does not match its MD5.
        OSError: reading the item or writing ``out_dir`` failed.

    On any error ``out_dir`` is left empty.
    """
    item = Path(item_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise ValueError(f"out_dir {str(out)!r} is not empty")
    if item.is_dir():
        sets, checksums, other = _archive_sets(item)
        root = item
    else:
        sets, checksums, other, root = [[item.name]], {}, [], item.parent
    result = UnpackResult(other=other)
    if not sets:
        raise ArchiveError(
            f"item {name or item.name!r}: no archive found (recognised: tar, tar.gz/tgz, tar.bz2, tar.xz, tar.zst, zip, "
            "and their split volumes)" + (f"; files: {other[:5]}" if other else "")
        )
    for rel in other:
        log.info("%s: %s is not an archive; not extracted", item, rel)
    extraction = _Extraction(out, _Budget(limit_bytes, max_members, advice), result, stop, name or item.name)
    try:
        for volumes in sets:
            _unpack_one(root, volumes, checksums, extraction)
    except BaseException:
        _clear(out)
        raise
    return result


def unpack_in_place(
    path: str | os.PathLike[str],
    *,
    name: str | None = None,
    limit_bytes: int,
    max_members: int = DEFAULT_MAX_MEMBERS,
    stop: threading.Event | None = None,
    advice: str | None = None,
) -> UnpackResult:
    """Replace a downloaded item by its extracted contents: :func:`unpack_item`, then a rename.

    The archives are extracted into ``<path>.unpacked`` beside the item (same filesystem). A
    folder item's files that are neither archives nor checksum files
    (:attr:`UnpackResult.other`) are moved into it; the archives, volumes and checksum files
    are deleted, and the extraction is renamed to ``path``. A single archive file becomes a
    folder at ``path``. Files are moved, never copied: at any moment the item takes its own
    bytes plus at most ``limit_bytes``.

    Args:
        path: the item: a folder, or one archive file.
        name: the item's name as listed, when ``path`` is stored under another name (a staging
            number): error messages give it, and a single archive file is extracted under its
            last segment (``shards/a.tar`` -> ``a.tar``). Default: the last segment of ``path``.
        limit_bytes, max_members, stop, advice: as for :func:`unpack_item`.

    Raises:
        as :func:`unpack_item`; :class:`ArchiveError` also when a file of the item has the path
        of an extracted member; FileExistsError when ``<path>.unpacked`` exists. On an archive
        error ``path`` is left as it was; on any error the extraction is removed.
    """
    item = Path(path)
    out = item.with_name(f"{item.name}.unpacked")
    if os.path.lexists(out):
        raise FileExistsError(errno.EEXIST, f"cannot unpack {str(item)!r}: {str(out)!r} exists")
    source = item
    if not item.is_dir():  # give the archive its own name, in a folder of its own: the item's root
        source = item.with_name(f"{item.name}.archive") / (name or item.name).rsplit("/", 1)[-1]
        source.parent.mkdir()
        os.rename(item, source)
    try:
        result = unpack_item(source, out, limit_bytes=limit_bytes, max_members=max_members, stop=stop, advice=advice, name=name)
        adopt_others(item, out, result.other, move=True)
    except BaseException:
        if os.path.lexists(out):
            shutil.rmtree(out)
        if source is not item:
            os.rename(source, item)
            source.parent.rmdir()
        raise
    shutil.rmtree(item if source is item else source.parent)
    os.rename(out, item)
    return result


def adopt_others(item: str | os.PathLike[str], out: str | os.PathLike[str], others: list[str], *, move: bool) -> None:
    """Put the folder item's files that are not archives (:attr:`UnpackResult.other`) beside
    its extraction in ``out``: moved (``move``), or else hard-linked (copied across filesystems),
    leaving the item whole.

    Raises:
        ArchiveError: a path that an extracted member (a file, a link, or a file where a folder
            is needed) already holds; nothing is put then.
    """
    item, out = Path(item), Path(out)
    for rel in others:
        parts = rel.split("/")
        for depth in range(1, len(parts) + 1):
            here = out.joinpath(*parts[:depth])
            if os.path.lexists(here) and (depth == len(parts) or here.is_symlink() or not here.is_dir()):
                raise ArchiveError(
                    f"file {rel!r} of the item collides with {'/'.join(parts[:depth])!r} extracted from its archive(s): "
                    "rename one of them"
                )
    for rel in others:
        target = out / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        (os.rename if move else _link_or_copy)(item / rel, target)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
        shutil.copy2(source, target)


def _unpack_one(root: Path, volumes: list[str], checksums: dict[str, str], extraction: _Extraction) -> None:
    label = volumes[0] if len(volumes) == 1 else f"{volumes[0]} (+{len(volumes) - 1} volumes)"
    paths = [root / v for v in volumes]
    with ConcatReader(paths) as sniffer:
        fmt = archive_format(sniffer.read(_SNIFF))
    with ConcatReader(paths, extraction.stop) as reader:
        if fmt is None:
            raise ArchiveError(f"{label}: not a recognised archive (tar, tar.gz, tar.bz2, tar.xz, tar.zst or zip)")
        expected = {i: checksums[p.name] for i, p in enumerate(paths) if p.name in checksums}
        if fmt == "zip":
            _verify(label, paths, expected, _hash_files(paths, expected))  # zip seeks: check before extracting
            try:
                extraction.zip(label, reader)
            except (zipfile.BadZipFile, zlib.error, EOFError) as exc:  # no central directory, a member's CRC...
                raise _corrupt(extraction.item, label, exc) from exc
        else:
            try:
                extraction.tar(label, reader, fmt)
            except Exception as exc:
                if expected and reader.hashed:
                    try:
                        reader.drain()
                    except OSError:
                        pass
                    else:
                        _verify(label, paths, expected, {i: reader.md5s[i].hexdigest() for i in expected}, cause=exc)
                if isinstance(exc, (tarfile.TarError, EOFError)) or type(exc).__name__ == "ZstdError":
                    raise _corrupt(extraction.item, label, exc) from exc
                raise
            if expected:
                reader.drain()
                digests = {i: reader.md5s[i].hexdigest() for i in expected} if reader.hashed else _hash_files(paths, expected)
                _verify(label, paths, expected, digests)
    extraction.result.archives.append(volumes[0])
    extraction.result.verified.extend(volumes[i] for i in sorted(expected))


def _corrupt(item: str, archive: str, exc: BaseException) -> ArchiveError:
    """The error for an archive whose reader failed with ``exc`` (it ends early, or does not decode)."""
    return ArchiveError(
        f"archive {archive!r} of item {item!r} is truncated or corrupt: {type(exc).__name__}: {exc}; "
        "replace it at the source with a complete copy"
    )


def _read_data(tar: tarfile.TarFile, member: tarfile.TarInfo, stop: threading.Event | None) -> None:
    """Read the data of the regular file ``member`` (the current one of a stream), at most
    :data:`_PROBE` bytes, and drop it; :class:`tarfile.ReadError` where the archive ends early.
    Read from the archive's stream itself, ``stop`` checked before each read: tarfile's
    ``extractfile`` wraps it in a buffered reader, which retries a stop's
    :class:`InterruptedError` for ever. The tar object is not used after this (the member is
    refused), so its idea of the stream's position does not matter."""
    stream = tar.fileobj
    left = min(member.size, _PROBE)
    while left > 0:
        _check_stop(stop)
        chunk = stream.read(min(left, _CHUNK))
        if not chunk:
            raise tarfile.ReadError("unexpected end of data")
        left -= len(chunk)


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
