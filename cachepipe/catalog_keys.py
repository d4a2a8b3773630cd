"""Which items of a :class:`~cachepipe.catalog.Catalog` hold keys that cannot be stored safely,
found over its columns (pure code, no I/O).

:class:`_KeyCheck` is the base class of :class:`~cachepipe.catalog.Catalog` (not used alone):
:meth:`_KeyCheck.check_keys` checks the items added without a check (a catalog read from a
file) as :meth:`~cachepipe.catalog.Catalog.from_listing` checks a listing's: every key with
:func:`~cachepipe.keys.check_key`, the keys of an item against each other with
:class:`~cachepipe.keys._TreeCheck`. A catalog of folders whose names and relative paths are
all one plain segment (the common one) is checked over its buffers at C speed
(:func:`_plain_segments`).
"""

from __future__ import annotations

import operator
import re
from array import array
from collections.abc import Iterator
from typing import Literal

from .catalog_columns import _Strings
from .errors import UnsafeKeyError
from .keys import _MAX_SEGMENT_BYTES, RESERVED_NAMES, _TreeCheck, check_key

__all__: list[str] = []

# keys._CONTROL's characters as UTF-8 bytes, and any lone surrogate (stored with "surrogatepass":
# U+D800-U+DFFF is ED A0-BF xx): check_key refuses most, and one of undecodable bytes (U+DC80-U+DCFF)
# where the bytes of its segment spell UTF-8, so a key with any is checked by check_key itself
_NOT_PLAIN_BYTES = re.compile(rb"[\x00-\x1f\x7f]|\xed[\xa0-\xbf]")


def _plain_segments(strings: _Strings, reserved: bool) -> bool:
    """Whether every string of ``strings`` is one path segment that :func:`check_key` takes
    whatever else is in the key: no ``/``, backslash, control character or lone surrogate, 1 to
    255 bytes, not ``.`` or ``..`` (and, with ``reserved``, none of :data:`RESERVED_NAMES` may
    occur at all).
    At C speed over the buffer: a byte below 0x80 is never part of a longer UTF-8 sequence, so
    a search of the bytes finds exactly the characters. False says "check one by one", not
    "unsafe"."""
    data, offsets = strings.data, strings.offsets
    if b"/" in data or b"\\" in data or _NOT_PLAIN_BYTES.search(data):
        return False
    if reserved and any(name.encode() in data for name in RESERVED_NAMES):
        return False
    lengths = list(map(operator.sub, offsets[1:], offsets[:-1]))
    if not lengths:
        return True
    if min(lengths) == 0 or max(lengths) > _MAX_SEGMENT_BYTES:
        return False
    return all(bytes(data[offsets[i] : offsets[i + 1]]) not in (b".", b"..") for i, n in enumerate(lengths) if n <= 2)


class _KeyCheck:
    """The key check of a catalog (see the module notes): :class:`~cachepipe.catalog.Catalog`'s base."""

    __slots__ = ("_unsafe",)  # the unsafe items' errors by position: check_keys writes them too

    # set by Catalog.__init__, which says what each holds
    mode: Literal["folders", "files"]
    _names: _Strings
    _rels: _Strings
    _first_file: array[int]
    _sorted: bool
    _unsafe: dict[int, UnsafeKeyError]

    def __len__(self) -> int:
        """The number of items (:meth:`cachepipe.catalog.Catalog.__len__`)."""
        raise NotImplementedError

    def name(self, i: int) -> str:
        """The name of item ``i`` (:meth:`cachepipe.catalog.Catalog.name`)."""
        raise NotImplementedError

    def check_keys(self) -> None:
        """Check every item's keys as :meth:`from_listing` does, for items added by :meth:`add`
        (in any order): an item with a key that is unsafe, collides or is listed twice is marked
        in :attr:`unsafe`, and so, in ``"folders"`` mode, is one whose name is not one folder
        (its keys would not all be under one first-level folder of the cache).

        A catalog of folders whose names and relative paths are all one plain segment (the
        common one) is checked over its buffers at C speed, and item by item only where an
        item lists a path twice (the one way such an item can be unsafe)."""
        found: dict[int, UnsafeKeyError] = {}
        if self.mode == "files":  # one key per item, its name; collisions are across items
            everything, last = _TreeCheck(), None
            order = range(len(self)) if self._sorted else sorted(range(len(self)), key=self.name)
            for i in order:
                key = self.name(i)
                try:
                    if key == last:
                        raise UnsafeKeyError(key, "listed twice")
                    everything.add(key, check_key(key))
                except UnsafeKeyError as exc:
                    found[i] = exc
                last = key
        else:
            plain = _plain_segments(self._names, reserved=True) and _plain_segments(self._rels, reserved=False)
            for i in self._repeated_paths() if plain else range(len(self)):
                if (error := self._folder_error(i)) is not None:
                    found[i] = error
        self._unsafe = dict(sorted(found.items()))

    def misfit(self) -> tuple[int, str] | None:
        """The first item (by position) of a form no listing is grouped into, as ``(position,
        what is wrong)``, or None: in ``"folders"`` mode, a name holding ``/`` (an item is one
        first-level folder), an item without a file, or one listing a file twice; in either mode,
        a name given to two items. Only a catalog built with :meth:`add` can hold one (a
        hand-built manifest): its items would be planned differently by a pipeline and by
        ``cachepipe map`` (which groups the keys again), so a manifest holding one is refused
        whole (:func:`cachepipe.manifest.read_manifest`). Keys that cannot be stored (``..``,
        an empty name: a listing of S3 can hold those) are not misfits but unsafe items
        (:meth:`check_keys`), refused or skipped each in its turn. Call after :meth:`check_keys`."""
        found: list[tuple[int, str]] = []
        first = self._first_file
        if self.mode == "folders":
            if b"/" in self._names.data:
                i = next(i for i in range(len(self)) if "/" in self.name(i))
                top, _, rest = self.name(i).partition("/")
                why = (
                    "has a name holding '/': an item of folders is one first-level folder of the source, named without "
                    f"'/' (its deeper path goes in its files' paths: item {top!r}, files {rest + '/...'!r})"
                )
                found.append((i, why))
            if any(map(operator.eq, first[:-1], first[1:])):
                found.append(
                    (next(i for i in range(len(self)) if first[i] == first[i + 1]), "has no file: an item lists one or more")
                )
            twice = next((i for i, error in self._unsafe.items() if error.reason == "listed twice"), None)
            if twice is not None:
                found.append((twice, f"lists a file twice ({self._unsafe[twice].key!r}): each file once"))
        if not self._sorted:  # (names in increasing order are each given once)
            seen: dict[str, int] = {}
            for b in range(len(self)):
                a = seen.setdefault(self.name(b), b)
                if a != b:
                    whole = ", all its files in one entry" if self.mode == "folders" else ""
                    found.append((b, f"is given to two items (entries {a + 1} and {b + 1}): each item once{whole}"))
                    break
        return min(found, default=None)

    def _repeated_paths(self) -> Iterator[int]:
        """The items with a relative path listed twice."""
        data, offsets, first = bytes(self._rels.data), self._rels.offsets, self._first_file  # bytes: slices hash
        for i in range(len(self)):
            start, end = first[i], first[i + 1]
            if end - start > 1 and len({data[offsets[j] : offsets[j + 1]] for j in range(start, end)}) < end - start:
                yield i

    def _folder_error(self, i: int) -> UnsafeKeyError | None:
        """What is wrong with the keys of folder item ``i`` (``name/rel`` each), or None."""
        rels, first = self._rels, self._first_file
        name = self.name(i)
        paths = [rels[j] for j in range(first[i], first[i + 1])]
        try:
            for rel in paths:
                check_key(f"{name}/{rel}")
                if "/" in name:
                    raise UnsafeKeyError(f"{name}/{rel}", f"its item's name {name!r} is not one folder")
            if len(paths) > 1:  # (the common flat item, one file or many, needs no tree)
                paths.sort()
                nested = any("/" in rel for rel in paths)
                tree = _TreeCheck() if nested else None
                for k, rel in enumerate(paths):
                    if k and rel == paths[k - 1]:
                        raise UnsafeKeyError(f"{name}/{rel}", "listed twice")
                    if tree is not None:
                        tree.add(f"{name}/{rel}", rel.split("/"))
        except UnsafeKeyError as exc:
            return exc
        return None
