"""The path-like behaviour shared by items handed out in-process and by the daemon."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["PathItem"]


class PathItem(os.PathLike[str]):
    """An item usable wherever a path is: ``open(item / "text.txt")``, ``os.fspath(item)``.

    Subclasses set ``path`` (a :class:`~pathlib.Path`) and add their own attributes.
    """

    __slots__ = ()
    path: Path

    def __fspath__(self) -> str:
        return str(self.path)

    def __truediv__(self, other: str | os.PathLike[str]) -> Path:
        return self.path / other

    def __str__(self) -> str:
        return str(self.path)
