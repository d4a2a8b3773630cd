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
A tar member refused for its size is read first (and dropped, at most :data:`~cachepipe.archive_extract._PROBE` bytes, 8 MiB):
an archive that ends within them is refused as truncated, which no limit would extract.
Tar members then go through Python's ``tarfile`` ``data`` filter as a second line (it resolves
links and existing paths with ``realpath``); zip members are written by this module, each
target checked with ``realpath`` to stay inside ``out_dir``.
"""

from __future__ import annotations

import errno
import gzip
import logging
import lzma
import os
import shutil
import tarfile
import threading
import zipfile
import zlib
from pathlib import Path

from .archive_extract import (
    UnpackResult,
    _Extraction,
    _read_data,  # noqa: F401 - importable from here, as before (a test reads it)
)
from .archive_members import _Budget
from .archive_names import archive_format, is_checksum_file, order_volumes, parse_checksums, split_volume
from .archive_volumes import _SNIFF, ConcatReader, _hash_files, _sniff, _verify
from .errors import ArchiveError, ArchiveTooLargeError, ChecksumError, UnsafeMemberError

# the archives' names, ConcatReader, UnpackResult and the errors: importable from here, as before
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
    block: int = 0,
) -> UnpackResult:
    """Extract the archive(s) of a downloaded item into ``out_dir``, safely (see the module docstring).

    Args:
        item_path: a single archive file, or a folder holding archives, split volumes,
            ``.md5`` sidecars and ``md5sums`` files. Other files are left alone (listed in
            :attr:`UnpackResult.other`). The item is only read.
        out_dir: where every archive of the item is extracted (created if missing; must be empty).
        limit_bytes: most bytes of files the extraction may write; a member that would pass
            it is refused before it is written.
        block: with a block size (bytes, above 0), ``limit_bytes`` counts what the extraction
            takes on the disk as the cache's ledger does (:func:`~cachepipe.blocks.footprint`):
            each file rounded up to whole blocks, a block for ``out_dir`` and for each folder
            made under it. 0: the files' bytes alone (``cachepipe map``).
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
    extraction = _Extraction(out, _Budget(limit_bytes, max_members, advice, block), result, stop, name or item.name)
    try:
        for index, volumes in enumerate(sets):
            extraction.recording = index < len(sets) - 1  # what the last archive writes, no later one meets
            _unpack_one(root, volumes, checksums, extraction)
        extraction.check_links()
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
    block: int = 0,
) -> UnpackResult:
    """Replace a downloaded item by its extracted contents: :func:`unpack_item`, then a rename.

    The archives are extracted into ``<path>.unpacked`` beside the item (same filesystem). A
    folder item's files that are neither archives nor checksum files
    (:attr:`UnpackResult.other`) are moved into it; the archives, volumes and checksum files
    are deleted, and the extraction is renamed to ``path``. A single archive file becomes a
    folder at ``path``. Files are moved, never copied: at any moment the item takes its own
    bytes plus at most ``limit_bytes`` (with ``block``, in whole blocks: the folder a single
    archive file is moved into for its extraction counted in them).

    Args:
        path: the item: a folder, or one archive file.
        name: the item's name as listed, when ``path`` is stored under another name (a staging
            number): error messages give it, and a single archive file is extracted under its
            last segment (``shards/a.tar`` -> ``a.tar``). Default: the last segment of ``path``.
        limit_bytes, max_members, stop, advice, block: as for :func:`unpack_item`.

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
        limit_bytes -= block  # that folder takes a block while the extraction is written
    try:
        result = unpack_item(
            source, out, limit_bytes=limit_bytes, max_members=max_members, stop=stop, advice=advice, name=name, block=block
        )
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
                if _undecodable(exc):
                    raise _corrupt(extraction.item, label, exc) from exc
                raise
            if expected:
                reader.drain()
                digests = {i: reader.md5s[i].hexdigest() for i in expected} if reader.hashed else _hash_files(paths, expected)
                _verify(label, paths, expected, digests)
    extraction.result.archives.append(volumes[0])
    extraction.result.verified.extend(volumes[i] for i in sorted(expected))


def _undecodable(exc: BaseException) -> bool:
    """Whether ``exc``, raised extracting a tar, is its reader's (cut short, or does not decode),
    not a read or write of a file: tarfile's, a decoder's (bz2's is a bare :class:`OSError`)."""
    if isinstance(exc, (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile)):
        return True
    return type(exc).__name__ == "ZstdError" or (type(exc) is OSError and exc.errno is None and exc.filename is None)


def _corrupt(item: str, archive: str, exc: BaseException) -> ArchiveError:
    """The error for an archive whose reader failed with ``exc`` (it ends early, or does not decode)."""
    return ArchiveError(
        f"archive {archive!r} of item {item!r} is truncated or corrupt: {type(exc).__name__}: {exc}; "
        "replace it at the source with a complete copy"
    )
