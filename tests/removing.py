"""Removing a folder in tests as an operator would, while a pipeline still writes into it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def remove_tree(path: Path, attempts: int = 20) -> None:
    """``rm -rf path``, run again while it fails: a writer that creates a file in a folder between
    rm's listing of it and its ``rmdir`` makes rm fail with "Directory not empty", and an operator
    runs it again. ``shutil.rmtree`` is no stand-in: it raises on a file that vanished meanwhile."""
    for _ in range(attempts):
        if subprocess.run(["rm", "-rf", str(path)], check=False, capture_output=True).returncode == 0:
            return
    raise AssertionError(f"rm -rf {path} failed {attempts} times")
