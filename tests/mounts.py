"""A file system of a test's own, mounted for the test (root only, as CI runs)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
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


@contextlib.contextmanager
def nfs_like(path: Path, locks: str = "nfs") -> Iterator[Path]:
    """Mount at ``path`` (made here) a loopback of the folder ``<path>.data`` whose ``flock`` is
    an NFS client's (``tests/nfslike.py``: ``locks`` "nfs" or "nolock"; what it says is in
    ``<path>.log``), yield ``path``, then
    unmount it and end its process. Skips the test where FUSE cannot be had: not root, no
    libfuse 3 (Debian's ``fuse3``) or no ``/dev/fuse``."""
    if os.geteuid() != 0:
        pytest.skip("a FUSE mount in tests needs root (CI runs as root)")
    try:
        import mfusepy  # noqa: F401  (raises where libfuse cannot be found)
    except (ImportError, OSError) as exc:
        pytest.skip(f"no FUSE here (mfusepy, libfuse 3): {exc}")
    data = path.with_name(path.name + ".data")
    data.mkdir()
    path.mkdir()
    script = Path(__file__).with_name("nfslike.py")
    log = path.with_name(path.name + ".log")  # what it says (a file: a pipe left unread would fill and stop it)
    with log.open("w") as err:
        fs = subprocess.Popen([sys.executable, str(script), str(data), str(path), locks], stderr=err)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(path):
            if fs.poll() is not None:
                pytest.skip(f"cannot mount FUSE here: {log.read_text().strip()}")
            assert time.monotonic() < deadline, "the FUSE file system did not mount in 60 s"
            time.sleep(0.02)
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        try:
            fs.wait(timeout=30)
        except subprocess.TimeoutExpired:
            fs.kill()
            fs.wait()
