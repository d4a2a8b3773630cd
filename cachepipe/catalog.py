"""From a listing to items: grouping, sizes and safe local names (pure code, no I/O).

An item is either a first-level folder under the prefix (every object under ``<name>/``,
recursively) or, with ``items="files"``, a single object. Each object key is checked here,
once, before anything touches the disk: a key that could escape the cache directory or
collide with another after mapping is rejected with :class:`~cachepipe.errors.UnsafeKeyError`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

from .errors import UnsafeKeyError
from .stores.base import ObjectInfo

__all__ = ["FileEntry", "Item", "RESERVED_NAMES", "check_key", "group_items"]

#: top-level names cachepipe keeps for itself inside the cache directory
RESERVED_NAMES = frozenset({".cachepipe"})
_MAX_SEGMENT_BYTES = 255


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One object of an item.

    Attributes:
        key: the object key relative to the source prefix.
        rel: the local path relative to the item (``""`` for a single-file item).
        size: bytes.
        etag: the store's entity tag, or None.
    """

    key: str
    rel: str
    size: int
    etag: str | None = None


@dataclass(frozen=True, slots=True)
class Item:
    """One unit of delivery: a folder of files, or a single file.

    Attributes:
        name: the item's name, also its path relative to the cache directory.
        files: its objects, in key order.
        size: total bytes of its files.
        is_file: True for a single-object item (``items="files"``).
    """

    name: str
    files: tuple[FileEntry, ...]
    size: int
    is_file: bool = False


def check_key(key: str) -> list[str]:
    """Return the ``/``-separated segments of ``key``, or raise :class:`UnsafeKeyError`.

    Rejected: empty keys, absolute keys, backslashes, NUL and other control characters,
    empty, ``.`` or ``..`` segments, segments over 255 bytes, and the reserved top-level name
    ``.cachepipe``.
    """
    if not key:
        raise UnsafeKeyError(key, "empty key")
    if key.startswith("/"):
        raise UnsafeKeyError(key, "absolute path")
    if "\\" in key:
        raise UnsafeKeyError(key, "contains a backslash")
    if any(ord(c) < 32 or ord(c) == 127 for c in key):
        raise UnsafeKeyError(key, "contains NUL or a control character")
    segments = key.split("/")
    for seg in segments:
        if seg == "":
            raise UnsafeKeyError(key, "empty path segment ('//' or a trailing '/')")
        if seg in (".", ".."):
            raise UnsafeKeyError(key, f"'{seg}' path segment")
        if len(seg.encode("utf-8", "surrogateescape")) > _MAX_SEGMENT_BYTES:
            raise UnsafeKeyError(key, f"a path segment is longer than {_MAX_SEGMENT_BYTES} bytes")
    if segments[0] in RESERVED_NAMES:
        raise UnsafeKeyError(key, f"'{segments[0]}' is reserved for cachepipe's own state")
    return segments


class _TreeCheck:
    """Detects keys that collide after mapping: a file that is also a directory of another key."""

    def __init__(self) -> None:
        self.files: set[str] = set()
        self.dirs: set[str] = set()

    def add(self, key: str, segments: list[str]) -> None:
        path = "/".join(segments)
        if path in self.dirs or path in self.files:
            raise UnsafeKeyError(key, "collides with another key (a file and a folder of the same name)")
        for i in range(1, len(segments)):
            parent = "/".join(segments[:i])
            if parent in self.files:
                raise UnsafeKeyError(key, f"collides with the file {parent!r} (a file and a folder of the same name)")
            self.dirs.add(parent)
        self.files.add(path)


def _is_dir_marker(obj: ObjectInfo) -> bool:
    return obj.key.endswith("/") and obj.size == 0


def group_items(objects: Iterable[ObjectInfo], mode: Literal["folders", "files"] = "folders") -> Iterator[Item]:
    """Group a listing into items, streaming: each item is yielded once its last object is seen.

    ``objects`` must be in strictly increasing key order (every store lists that way); then all
    objects of a folder are contiguous. Zero-byte directory markers are skipped. Objects directly
    under the prefix (no folder) are ignored in ``"folders"`` mode.

    Raises:
        UnsafeKeyError: a key that is unsafe or collides (see :func:`check_key`).
        ValueError: the listing is not in key order.
    """
    last_key: str | None = None
    current: str | None = None
    files: list[FileEntry] = []
    tree = _TreeCheck()
    for obj in objects:
        if last_key is not None and obj.key <= last_key:
            raise ValueError(f"listing out of order: {obj.key!r} after {last_key!r}")
        last_key = obj.key
        if _is_dir_marker(obj):
            continue
        segments = check_key(obj.key)
        if mode == "files":
            if obj.key.endswith("/"):
                raise UnsafeKeyError(obj.key, "empty path segment ('//' or a trailing '/')")
            tree.add(obj.key, segments)
            yield Item(obj.key, (FileEntry(obj.key, "", obj.size, obj.etag),), obj.size, is_file=True)
            continue
        if len(segments) < 2:
            continue  # a loose object beside the folders: not part of any item
        name = segments[0]
        if name != current:
            if files:
                yield Item(current, tuple(files), sum(f.size for f in files))  # type: ignore[arg-type]
            current, files, tree = name, [], _TreeCheck()
        tree.add(obj.key, segments[1:])
        files.append(FileEntry(obj.key, "/".join(segments[1:]), obj.size, obj.etag))
    if files:
        yield Item(current, tuple(files), sum(f.size for f in files))  # type: ignore[arg-type]
