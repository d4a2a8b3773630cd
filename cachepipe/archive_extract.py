"""One item's extraction into its folder: each member checked, then written, never past its budget.

:class:`_Extraction` writes the members of a tar stream or a zip file into ``out_dir``: each is
checked first (:mod:`cachepipe.archive_members`: name, link, budget; a file another archive of
the item wrote is refused), tar members then go through ``tarfile``'s ``data`` filter, zip members
are written here, each target checked with ``realpath`` to stay inside ``out_dir``. A member whose
path the file system cannot make is refused as an :class:`~cachepipe.errors.ArchiveError` that
says why (:meth:`_Extraction.unwritable`). What was written is counted in an :class:`UnpackResult`.
"""

from __future__ import annotations

import bz2
import errno
import gzip
import io
import lzma
import os
import stat
import tarfile
import threading
import zipfile
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, cast

from .archive_members import _Budget, _check_link, _check_name
from .archive_volumes import _CHUNK, _check_stop
from .errors import ArchiveError, ArchiveTooLargeError, UnsafeMemberError
from .filesystems import LINK_HOPS

__all__ = ["UnpackResult"]

_PROBE = 8 << 20
"""Most bytes of a tar member refused for its size that are read (and dropped) to tell an archive
cut short inside that member (refused as truncated) from one that is too large: about 0.03 s of
gzip. An archive cut further into the member is refused as too large, as before: reading more
would make every bomb slower to refuse (a GiB of zeros took 3.5 s as gzip, 21 s as xz and
minutes as bzip2, whose reader copies what is left of its buffer at every read)."""
_DECODERS: dict[str, Callable[[IO[bytes]], io.BufferedIOBase]] = {
    "tar.gz": lambda raw: gzip.GzipFile(fileobj=raw, mode="rb"),
    "tar.bz2": lambda raw: bz2.BZ2File(raw, "rb"),
    "tar.xz": lambda raw: lzma.LZMAFile(raw, "rb"),  # noqa: SIM115 - closed by _Extraction.tar
}
"""Compressed tars are read through these, not tarfile's own stream reader: they check the
compression's own CRC (gzip's, which tarfile's reader ignores) and raise :class:`EOFError` where
the compressed data ends early; a read returns at most what is asked for (tarfile's reader
inflated a whole compressed read at once: a 1 MiB read of zeros is ~1 GB in memory)."""


class _Stopped(Exception):
    """A stop, as a decoder's reads see it (:class:`_Stoppable`)."""


class _Stoppable:
    """The volumes' reader as a decoder reads it: a stop raises :class:`_Stopped`, not the
    reader's :class:`InterruptedError`, which the decoder's buffered reader retries for ever."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw

    def read(self, size: int = -1) -> bytes:
        try:
            return self.raw.read(size)
        except InterruptedError as exc:
            raise _Stopped from exc


class _StrictTarInfo(tarfile.TarInfo):
    """A tar header as tarfile reads it, but one that is missing, cut short or invalid is
    a :class:`tarfile.ReadError` wherever it is: tarfile takes one after the first member for
    the archive's end, so a tar cut at a member's boundary, or with a damaged header, extracted
    in part without a word. Its end-of-archive block (zeros) still ends it."""

    @classmethod
    def fromtarfile(cls, tarfile_: tarfile.TarFile) -> _StrictTarInfo:
        try:
            return super().fromtarfile(tarfile_)
        except tarfile.HeaderError as exc:
            if type(exc) is tarfile.EOFHeaderError:  # type: ignore[attr-defined] # the end-of-archive block
                raise
            what = "unexpected end of data" if str(exc) in ("empty header", "truncated header") else "bad header"
            raise tarfile.ReadError(f"{what} at byte {tarfile_.offset} of the tar: {exc}") from None
        except ValueError as exc:  # a GNU sparse map or size that is no number: tarfile's int() fails on it
            kept: list[tarfile.TarInfo] = tarfile_.members  # type: ignore[attr-defined] # tarfile's list, untyped by typeshed
            after = f"the member after {kept[-1].name!r}" if kept else "its first member"
            raise tarfile.ReadError(
                f"bad header at byte {tarfile_.offset} of the tar ({after}): {type(exc).__name__}: {exc}"
            ) from None


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


def _inside(root: Path, path: Path) -> bool:
    real_root = os.path.realpath(root)
    return os.path.commonpath([os.path.realpath(path), real_root]) == real_root


class _Extraction:
    def __init__(
        self, out_dir: Path, budget: _Budget, result: UnpackResult, stop: threading.Event | None = None, item: str = ""
    ) -> None:
        self.out = out_dir
        self.item = item  # the item's name as listed, for error messages
        self.stop = stop  # checked before each member and each read (a member's data may be buffered)
        self.budget = budget
        self.result = result
        # rel path -> archive that wrote it, kept while an archive follows (a later one may not overwrite it):
        # not for the last archive, so that one archive's memory does not grow with its members
        self.written: dict[str, str] = {}
        self.recording = True  # record what this archive writes in ``written``: another one follows
        self.links: dict[str, tuple[str, str]] = {}  # where a symbolic link was made (its real path) -> (archive, member)

    def claim(self, archive: str, name: str, rel: str) -> None:
        owner = self.written.get(rel)
        if owner is not None and owner != archive:
            raise UnsafeMemberError(archive, name, f"collides with {rel!r} extracted from {owner!r}")
        if self.recording:
            self.written[rel] = archive

    def linked_size(self, archive: str, name: str, target: str, linkname: str) -> int:
        """The size of the file that the hard link member ``name`` links to (``target``, its path
        in the item): a regular file extracted before it, read on disk (no record of every
        member's size is kept), reached inside the item."""
        path = self.out / target
        try:
            info = os.lstat(path)
        except OSError:
            info = None
        if info is None or not stat.S_ISREG(info.st_mode) or not _inside(self.out, path):
            raise UnsafeMemberError(archive, name, f"hard link to {linkname!r}, which is not a file extracted before it")
        return info.st_size

    @staticmethod
    def _hard_link(target: Path, path: Path) -> None:
        """Make ``path`` a hard link to the file ``target`` (both checked inside the item), in place
        of what a member before it wrote there, as GNU tar does. Not by ``TarFile.extract``: where
        ``os.link`` fails (a path written before, EEXIST; a full disk), tarfile looks for the target
        among the archive's headers (reading the rest of a stream), which the unpack does not keep,
        and drops the error it then raises (``errorlevel`` 1): the link and the members after it
        were missing, or a whole archive said corrupt (``seeking backwards``)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with suppress(FileNotFoundError):
            if not stat.S_ISDIR(os.lstat(path).st_mode):  # a folder stays: the link fails on it (EEXIST)
                path.unlink()
        os.link(target, path)

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

    def no_room(self, archive: str, name: str, exc: OSError) -> OSError | None:
        """The error that ``exc``, raised writing member ``name``, stands for when it is a full
        disk's (``ENOSPC``, ``EDQUOT``) that names no file (a write's, or a close's flush): the same
        errno, naming the file and the member, as :func:`~cachepipe.wholefiles.naming` does. None
        for any other error, which stays as it is (one of reading the archive is not a write)."""
        if type(exc) is not OSError or exc.filename is not None or exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            return None
        target = self.out / _check_name(archive, name)
        what = f"cannot write {str(target)!r}, member {_abridged(name)} of archive {archive!r} of item {self.item!r}"
        return OSError(exc.errno, f"{exc.strerror or exc}: {what}")

    def made_link(self, archive: str, name: str, rel: str) -> None:
        """The member ``name`` made a symbolic link at ``rel``: :meth:`check_links` will follow it."""
        where = os.path.join(os.path.realpath((self.out / rel).parent), rel.rsplit("/", 1)[-1])
        self.links[where] = (archive, name)

    def check_links(self) -> None:
        """Once every archive of the item is extracted: refuse a symbolic link that leaves the item
        when followed (:func:`_leaves`). Each was checked when it was made, alone: one that goes
        through a link made after it, or was made through a link, could point out of the item."""
        if not self.links:
            return
        root = os.path.realpath(self.out)
        for dirpath, dirs, files in os.walk(root):  # links to folders are listed in dirs, not followed
            for entry in dirs + files:
                path = os.path.join(dirpath, entry)
                if os.path.islink(path) and _leaves(root, os.path.relpath(path, root)):
                    archive, member = self.links.get(path, ("?", os.path.relpath(path, root)))
                    raise UnsafeMemberError(
                        archive, member, f"link to {os.readlink(path)!r}, which leads outside the item through other links"
                    )

    def _origin(self, archive: str, rel: str) -> str:
        """Where the file ``rel`` came from, when another archive of the item wrote it."""
        owner = self.written.get(rel, archive)
        return "" if owner == archive else f" extracted from {owner!r}"

    def tar(self, archive: str, stream: io.RawIOBase, fmt: str) -> None:
        # a binary file at run time; typeshed does not declare RawIOBase an IO[bytes] (its read may return None)
        binary = cast("IO[bytes]", stream)
        if fmt == "tar.zst":
            try:
                import zstandard
            except ImportError as exc:
                raise ArchiveError(f"{archive}: a zstd archive needs the 'zstandard' package (pip install zstandard)") from exc
            source: IO[bytes] = zstandard.ZstdDecompressor().stream_reader(binary, read_across_frames=True, closefd=False)
        else:  # the volumes' reader itself is not closed here: its MD5s are read after
            source = cast("IO[bytes]", _DECODERS[fmt](cast("IO[bytes]", _Stoppable(binary)))) if fmt in _DECODERS else binary
        try:
            with (
                source if source is not binary else nullcontext(),
                tarfile.open(fileobj=source, mode="r|", tarinfo=_StrictTarInfo) as tar,
            ):
                while (member := tar.next()) is not None:
                    # tarfile keeps every header it reads (a shard of 50,000 images: 80 MB): all but the
                    # last dropped, which names the place of a bad header (_StrictTarInfo)
                    del tar.members[:-1]  # type: ignore[attr-defined] # tarfile's list, untyped by typeshed
                    self._tar_member(archive, tar, member)
                self._tar_end(tar)
        except _Stopped:
            raise InterruptedError(errno.EINTR, "extraction stopped") from None

    def _tar_end(self, tar: tarfile.TarFile) -> None:
        """Read what follows the end-of-archive block to the end of the stream (which checks a
        compressed one's CRC): zeros only, the padding of the last record, and at most
        :data:`_PROBE` bytes of it. Anything else is a :class:`tarfile.ReadError`: a damaged
        header read as the end, or another archive appended (tar extracts the first only)."""
        stream, seen = tar.fileobj, 0
        while chunk := stream.read(_CHUNK):
            _check_stop(self.stop)
            seen += len(chunk)
            if chunk.count(0) != len(chunk) or seen > _PROBE:
                raise tarfile.ReadError(
                    f"{'more than ' + str(_PROBE) + ' bytes' if seen > _PROBE else 'data'} after its end-of-archive blocks, "
                    "at byte " + str(tar.offset) + ": a header damaged, or another archive appended to it"
                )

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
                size = self.linked_size(archive, name, target, member.linkname)
        if not member.isdir():
            self.claim(archive, name, rel)
        if member.isreg() and not self.budget.fits(size, rel):
            _read_data(tar, member, self.stop)  # an archive that ends just inside it: truncated, not too large
        link = len(os.fsencode(member.linkname)) if member.issym() else 0  # its target, as written
        self.budget.add(archive, name, size, rel, member.isdir(), link)
        try:
            if member.islnk():
                tarfile.data_filter(member, str(self.out))  # the checks of extract's filter (FilterError)
                self._hard_link(self.out / target, self.out / rel)
            else:
                tar.extract(member, self.out, filter="data")
        except tarfile.FilterError as exc:
            raise UnsafeMemberError(archive, name, f"refused by tarfile's data filter: {exc}") from exc
        except OSError as exc:
            error = self.unwritable(archive, name, member.isdir(), exc) or self.no_room(archive, name, exc)
            if error is None:
                raise
            raise error from exc
        if member.issym():
            self.made_link(archive, name, rel)
        if member.isreg() or member.islnk():
            self.result.bytes += size
        self.result.members += 1

    def zip(self, archive: str, stream: io.RawIOBase) -> None:
        with zipfile.ZipFile(io.BufferedReader(stream, _CHUNK)) as zf:
            infos = zf.infolist()
            seen: set[str] = set()
            planned = self.budget.copy(self.budget.max_members - self.budget.members)
            total = self.budget.total(
                (_check_name(archive, i.filename), 0 if i.is_dir() else i.file_size, i.is_dir()) for i in infos
            )
            for info in infos:  # refuse a bomb from the central directory, before writing anything
                rel = _check_name(archive, info.filename)
                if rel in seen and not info.is_dir():
                    raise UnsafeMemberError(archive, info.filename, "a second entry with the same name")
                seen.add(rel)
                size = 0 if info.is_dir() else info.file_size
                if not planned.fits(size, rel, info.is_dir()):
                    raise planned.over(archive, info.filename, size, total, rel)
                planned.add(archive, info.filename, size, rel, info.is_dir())
            for info in infos:
                try:
                    self._zip_member(archive, zf, info)
                except OSError as exc:
                    name = info.filename
                    error = self.unwritable(archive, name, info.is_dir(), exc) or self.no_room(archive, name, exc)
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
            self.budget.add(archive, name, 0, rel, is_dir=True)
            target.mkdir(parents=True, exist_ok=True)
            self.result.members += 1
            return
        self.claim(archive, name, rel)
        if kind == stat.S_IFLNK:
            if info.file_size > 4096:
                raise UnsafeMemberError(archive, name, "symbolic link with a target longer than 4096 bytes")
            link = zf.read(info).decode("utf-8", "surrogateescape")
            _check_link(archive, name, rel, link, hard=False)
            self.budget.add(archive, name, 0, rel, link=len(os.fsencode(link)))
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(target):
                os.unlink(target)
            os.symlink(link, target)
            self.made_link(archive, name, rel)
            self.result.members += 1
            return
        self.budget.add(archive, name, info.file_size, rel)
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
        self.result.bytes += written
        self.result.members += 1


def _leaves(root: str, rel: str) -> bool:
    """Whether the symbolic link at ``rel`` (its folders real ones) in the folder ``root`` leads
    outside ``root``: its target followed a segment at a time, as the kernel does, through every
    link on the way, a ``..`` above ``root`` or an absolute target leaves it. Unlike
    :func:`os.path.realpath`, a way out and back in by ``root``'s own name leaves it too (the item
    is renamed after its extraction). A loop (more than :data:`~.filesystems.LINK_HOPS` links) leads nowhere, not out."""
    target = os.readlink(os.path.join(root, rel))
    if target.startswith("/"):
        return True
    todo = [*rel.split("/")[:-1], *target.split("/")][::-1]  # the next segment last
    done: list[str] = []
    hops = 0
    while todo:
        segment = todo.pop()
        if segment in ("", "."):
            continue
        if segment == "..":
            if not done:
                return True
            done.pop()
            continue
        here = os.path.join(root, *done, segment)
        if not os.path.islink(here):
            done.append(segment)
            continue
        hops += 1
        target = os.readlink(here)
        if target.startswith("/"):
            return True
        if hops > LINK_HOPS:
            return False
        todo.extend(target.split("/")[::-1])
    return False


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
