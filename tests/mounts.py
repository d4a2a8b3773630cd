"""A file system of a test's own, mounted for the test (root only, as CI runs)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def mounted(path: Path, *commands: list[str]) -> Iterator[Path]:
    """Run ``commands`` (the last one mounts at ``path``, made here), yield ``path``, then
    unmount it (lazily: a file a failing test left open does not keep it). Skips the test
    where that cannot be done here: not root, or a command missing or refused."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip(f"{commands[-1][0]} needs root (CI runs as root)")
    for cmd in commands:
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except FileNotFoundError as exc:
            pytest.skip(f"no {cmd[0]} here: {exc}")
        if result.returncode != 0:
            pytest.skip(f"cannot {cmd[0]} here: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
