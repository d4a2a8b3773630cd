"""The cache on the file systems of real nodes: small loop-mounted XFS, btrfs and ext4 images
(root only, as CI runs; skipped elsewhere by :func:`mounts.mounted`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from mounts import mounted
from test_full_disk_start import local_source

from cachepipe import Pipeline
from cachepipe.sizes import format_size


def loop_image(tmp_path: Path, mkfs: list[str], size: int) -> tuple[Path, list[list[str]]]:
    """The mount point and the commands (for :func:`mounted`) of a file system made by ``mkfs``
    on a sparse image of ``size`` bytes."""
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    image.write_bytes(b"")
    os.truncate(image, size)
    return disk, [[*mkfs, str(image)], ["mount", "-o", "loop", str(image), str(disk)]]


def fill(disk: Path) -> None:
    """Write one file on ``disk`` until the file system refuses more."""
    fd = os.open(disk / "other-writer.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, bytes(chunk))
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_full_btrfs_says_its_space_kept_back_as_such_not_as_root_s(tmp_path):
    # btrfs counts as free (statfs f_bfree) the room of its metadata chunks, which no file's data
    # gets (f_bavail 0): the message said "78.7 MiB is reserved for root (not free to other
    # users)" of a full 128 MiB btrfs, which keeps nothing for root (root's writes fail too).
    src = local_source(tmp_path, 1)
    disk, commands = loop_image(tmp_path, ["mkfs.btrfs", "-q", "-f"], 128 << 20)  # btrfs's smallest
    with mounted(disk, *commands):
        fill(disk)
        st = os.statvfs(disk)
        assert st.f_bavail == 0 and st.f_bfree > 0
        with pytest.raises(OSError, match="its disk is full") as err:
            Pipeline(f"{src}/", disk / "cache", "1MiB", items="folders").open()
        st = os.statvfs(disk)  # as the message saw it
        kept = format_size((st.f_bfree - st.f_bavail) * st.f_frsize)
        message = str(err.value)
        assert "reserved for root" not in message, message
        assert f", and {kept} is kept back by the filesystem (counted free, given to no file); " in message, message
