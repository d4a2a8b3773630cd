"""Object keys as local names: which are safe (pure code, no I/O).

Each object key is checked once, before anything touches the disk (:func:`check_key`): a key
that could escape the cache directory is refused with the
:class:`~cachepipe.errors.UnsafeKeyError` that names the key and the reason; :class:`_TreeCheck`
refuses a key that collides with another after mapping (a file and a folder of the same name).
:mod:`cachepipe.grouping` marks the item of such a key unsafe; :mod:`cachepipe.catalog`
re-exports the public names.
"""

from __future__ import annotations

import heapq
import re

from .errors import UnsafeKeyError

__all__ = ["RESERVED_NAMES", "check_key"]

#: top-level names cachepipe keeps for itself inside the cache directory
RESERVED_NAMES = frozenset({".cachepipe"})
_MAX_SEGMENT_BYTES = 255
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_key(key: str) -> list[str]:
    """Return the ``/``-separated segments of ``key``, or raise :class:`UnsafeKeyError`.

    Rejected: empty keys, absolute keys, backslashes, NUL and other control characters, lone
    surrogates (but those of undecodable bytes, U+DC80 to U+DCFF, as ``os.fsdecode`` makes them,
    and only where ``os.fsdecode`` would: never bytes that spell UTF-8, another key's name),
    empty, ``.`` or ``..`` segments, segments over 255 bytes, and the reserved top-level name
    ``.cachepipe``.
    """
    if not key:
        raise UnsafeKeyError(key, "empty key")
    if key.startswith("/"):
        raise UnsafeKeyError(key, "absolute path")
    if "\\" in key:
        raise UnsafeKeyError(key, "contains a backslash")
    if _CONTROL.search(key):
        raise UnsafeKeyError(key, "contains NUL or a control character")
    if not key.isascii():
        try:
            encoded = key.encode("utf-8", "surrogateescape")  # what os.fsencode makes of a path here
        except UnicodeEncodeError:
            raise UnsafeKeyError(key, "contains a lone surrogate: no file name can hold it") from None
        if encoded.decode("utf-8", "surrogateescape") != key:  # "\udcc3\udca9" is the bytes of "é"
            raise UnsafeKeyError(key, "its undecodable bytes (U+DC80-U+DCFF) spell UTF-8: its file name is another key's")
    segments = key.split("/")
    # The common case in one pass at C speed (a segment of at most 63 characters is at most
    # 252 bytes); the loop below names the first bad segment.
    if "" in segments or "." in segments or ".." in segments or max(map(len, segments)) * 4 > _MAX_SEGMENT_BYTES:
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
    """Detects keys that collide after mapping: a file that is also a folder of another key.

    Keys are added in strictly increasing order (a listing's), so a file comes before every key
    under it, and those come before any key at or after ``file + "0"`` ("0" follows "/"). A file
    is remembered only until the keys pass that point: memory for the few files whose names
    prefix the keys that follow, not for every key listed (a listing of millions of single
    files)."""

    def __init__(self) -> None:
        self._open: set[str] = set()  # files that a later key may still be under
        self._ends: list[tuple[str, str]] = []  # heap of (file + "0", file): past it, the file is closed

    def add(self, key: str, segments: list[str]) -> None:
        """Add the file ``key`` at the path ``segments`` (relative to what is checked)."""
        path, ends, open_ = "/".join(segments), self._ends, self._open
        while ends and ends[0][0] <= path:
            open_.discard(heapq.heappop(ends)[1])
        if open_:
            for i in range(1, len(segments)):
                parent = "/".join(segments[:i])
                if parent in open_:
                    raise UnsafeKeyError(key, f"collides with the file {parent!r} (a file and a folder of the same name)")
        open_.add(path)
        heapq.heappush(ends, (path + "0", path))
