"""The path-like behaviour shared by items handed out in-process and by the daemon."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PathItem"]


class PathItem(os.PathLike[str]):
    """An item usable wherever a path is: ``open(item / "text.txt")``, ``os.fspath(item)``.

    Subclasses call ``__init__`` with the local path and add their own attributes. The
    :class:`~pathlib.Path` of :attr:`path` is made on first use: many items are handed on as
    strings only (``os.fspath``), and making one costs a few microseconds per item. ``str(item)``
    and ``os.fspath(item)`` give the path as it was given (cachepipe gives absolute, normal ones);
    :attr:`path` is its ``Path``.

    Raises:
        TypeError: ``path`` is not a string or a path-like of one.
    """

    __slots__ = ("_local", "_path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        local = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
        if not isinstance(local, str):
            raise TypeError(f"an item's path must be a string or a path-like of one, not {path!r}")
        self._local = local
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        """The local path (a folder, or a file for single-object items)."""
        if self._path is None:
            self._path = Path(self._local)
        return self._path

    def __fspath__(self) -> str:
        return self._local

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __str__(self) -> str:
        return self._local
