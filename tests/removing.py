"""Removing or replacing a folder in tests as an operator would, while a pipeline still writes into it."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def remove_tree(path: Path, attempts: int = 20) -> None:
    """``rm -rf path``, run again while it fails: a writer that creates a file in a folder between
    rm's listing of it and its ``rmdir`` makes rm fail with "Directory not empty", and an operator
    runs it again. ``shutil.rmtree`` is no stand-in: it raises on a file that vanished meanwhile."""
    for _ in range(attempts):
        if subprocess.run(["rm", "-rf", str(path)], check=False, capture_output=True).returncode == 0:
            return
    raise AssertionError(f"rm -rf {path} failed {attempts} times")


def replace_tree(path: Path, aside: Path) -> None:
    """Put a new empty folder at ``path`` and the old one at ``aside``, in one step (Linux
    ``renameat2(RENAME_EXCHANGE)``): a pipeline never sees the path missing in between, as it
    could between a rename aside and a ``mkdir``, which it would report as removed."""
    aside.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(aside), _AT_FDCWD, os.fsencode(path), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {aside} and {path}: {os.strerror(err)}")
