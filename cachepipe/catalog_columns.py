"""The buffers that hold a :class:`~cachepipe.catalog.Catalog`'s columns (pure code, no I/O):
many short strings in one UTF-8 buffer with offsets (:class:`_Strings`: names, relative paths,
entity tags that are not an MD5), and an entity tag as a kind and 16 bytes (the digest of one
that is an MD5 in 32 lowercase hex digits, :func:`_md5_digest`; else the index of its text).
"""

from __future__ import annotations

from array import array

__all__: list[str] = []

_UTF8_ERRORS = "surrogatepass"  # any str round-trips, even one with lone surrogates
_ETAG_NONE, _ETAG_MD5, _ETAG_TEXT = 0, 1, 2
_DIGEST = 16  # bytes per file in the digest column
_NO_DIGEST = bytes(_DIGEST)


def _md5_digest(etag: str | None) -> bytes | None:
    """The 16 bytes of an entity tag that is an MD5 in 32 lowercase hex digits (so that
    ``digest.hex()`` gives it back exactly), else None."""
    if etag is None or len(etag) != 32:
        return None
    try:
        digest = bytes.fromhex(etag)
    except ValueError:
        return None
    return digest if len(digest) == _DIGEST and digest.hex() == etag else None


class _Strings:
    """Many short strings in one UTF-8 buffer: string ``i`` is ``data[offsets[i]:offsets[i + 1]]``."""

    __slots__ = ("data", "offsets")

    def __init__(self) -> None:
        self.data = bytearray()
        self.offsets = array("q", [0])

    def append(self, text: str) -> None:
        self.data += text.encode("utf-8", _UTF8_ERRORS)
        self.offsets.append(len(self.data))

    def raw(self, i: int) -> bytearray:
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def __getitem__(self, i: int) -> str:
        return self.data[self.offsets[i] : self.offsets[i + 1]].decode("utf-8", _UTF8_ERRORS)

    @property
    def nbytes(self) -> int:
        return len(self.data) + self.offsets.itemsize * len(self.offsets)
