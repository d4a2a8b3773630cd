"""The names of an archive's files and the format of its first bytes (pure: no I/O).

A split archive's volumes are ``<stem>-00``, ``<stem>-01``... (two or more digits),
``<stem>.partaa``, ``<stem>.partab``... or ``<stem>.001``, ``<stem>.002``...: :func:`split_volume`
names the stem and index of one, :func:`order_volumes` puts an archive's volumes in order and
refuses a gap. A ``*.md5`` sidecar or an ``md5sums`` list (:func:`is_checksum_file`) gives MD5s
by file name (:func:`parse_checksums`). :func:`archive_format` tells a format from its first
bytes, never from a name. :mod:`cachepipe.unpack` re-exports the public names.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import ArchiveError

__all__ = ["archive_format", "is_checksum_file", "order_volumes", "parse_checksums", "split_volume"]

_VOLUME_PATTERNS = (
    re.compile(r"^(?P<stem>.+)-(?P<idx>[0-9]{2,})$"),
    re.compile(r"^(?P<stem>.+)\.part(?P<idx>[a-z]{2,}|[0-9]{2,})$"),
    re.compile(r"^(?P<stem>.+)\.(?P<idx>[0-9]{3})$"),
)
_CHECKSUM_NAMES = frozenset({"md5sums", "md5sums.txt", "md5sum.txt", "checksums.md5"})
_MD5_RE = re.compile(r"^[0-9a-fA-F]{32}$")


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
