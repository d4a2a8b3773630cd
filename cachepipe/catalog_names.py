"""The names of a :class:`~cachepipe.catalog.Catalog`'s items as a sequence (:class:`Names`):
of all of them, or of those at some positions (the items a retention policy plans over), found
by name with the catalog's binary search.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from typing import Protocol, overload

__all__ = ["Names"]


class _Catalog(Protocol):
    """What :class:`Names` reads of its catalog (a :class:`~cachepipe.catalog.Catalog`)."""

    def __len__(self) -> int: ...

    def name(self, i: int) -> str: ...

    def find(self, name: str) -> int: ...

    def find_many(self, names: Sequence[str]) -> list[int]: ...


class Names(Sequence[str]):
    """The names of a catalog's items, or of the items at ``indices`` (increasing positions), by
    position; :meth:`index` finds a name by binary search (see :meth:`Catalog.find`).

    Raises:
        ValueError: ``indices`` are not increasing positions of ``catalog``.
    """

    __slots__ = ("_catalog", "_indices")

    def __init__(self, catalog: _Catalog, indices: Sequence[int] | None = None) -> None:
        if indices is not None:
            for k, i in enumerate(indices):
                if not 0 <= i < len(catalog) or (k and i <= indices[k - 1]):
                    raise ValueError(f"indices[{k}] = {i}: expected increasing positions below {len(catalog)}")
        self._catalog, self._indices = catalog, indices

    def __len__(self) -> int:
        return len(self._catalog) if self._indices is None else len(self._indices)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self._indices is None:
            return self._catalog.name(i)
        return self._catalog.name(self._indices[i])

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) >= 0

    def index(self, name: str, start: int = 0, stop: int | None = None) -> int:
        """The position of ``name``.

        Raises:
            ValueError: ``name`` is not one of these names (or not within ``start:stop``).
        """
        j = self._find(name) if isinstance(name, str) else -1
        if j not in range(*slice(start, stop).indices(len(self))):
            raise ValueError(f"{name!r} is not in the catalog")
        return j

    def find_many(self, names: Sequence[str]) -> list[int]:
        """The position here of each of ``names``, or -1 (see :meth:`Catalog.find_many`)."""
        found = self._catalog.find_many(names)
        if self._indices is None:
            return found
        indices = self._indices
        for k, i in enumerate(found):
            if i >= 0:
                j = bisect_left(indices, i)
                found[k] = j if j < len(indices) and indices[j] == i else -1
        return found

    def _find(self, name: str) -> int:
        i = self._catalog.find(name)
        if i < 0 or self._indices is None:
            return i
        j = bisect_left(self._indices, i)
        return j if j < len(self._indices) and self._indices[j] == i else -1
