"""The cache on the file systems of real nodes: small loop-mounted XFS, btrfs and ext4 images
(root only, as CI runs; skipped elsewhere by :func:`mounts.mounted`)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
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


def test_a_filesystem_remounted_read_only_mid_run_fails_the_ack_and_the_close_says_nothing_more(tmp_path, caplog):
    # ext4 mounted errors=remount-ro goes read-only at its first error (here one triggered through
    # /sys/fs/ext4/<dev>/trigger_fs_error). The ack's journal write fails with EROFS, as it should;
    # then the close raised a second "[Errno 30] Read-only file system", naming no file, from
    # blanking its lock's owner line (which a killed owner leaves too: the lock is the flock,
    # let go when its file closes), and that error replaced the ack's in a `with` block.
    src = local_source(tmp_path, 3)
    disk, commands = loop_image(tmp_path, ["mkfs.ext4", "-q", "-F"], 8 << 20)
    commands[-1][2] = "loop,errors=remount-ro"
    with mounted(disk, *commands):
        pipe = Pipeline(f"{src}/", disk / "cache", "1MiB", items="folders")
        with pipe:
            item = pipe.get(timeout=30)
            assert item is not None
            device = subprocess.run(["findmnt", "-no", "SOURCE", str(disk)], capture_output=True, text=True, check=True)
            (Path("/sys/fs/ext4") / Path(device.stdout.strip()).name / "trigger_fs_error").write_text("cachepipe test")
            with pytest.raises(OSError, match="Read-only file system"):
                pipe.ack(item.path)
        # the with block closed it without raising
        assert "could not blank" in caplog.text


@pytest.mark.parametrize("below", [".cachepipe", ".cachepipe/staging"])
def test_a_state_folder_on_another_mount_is_refused_at_open(tmp_path, below):
    # A mount inside cache_dir (a volume at its .cachepipe, or a tmpfs at its staging "for
    # speed"): at .cachepipe every item was downloaded whole, then failed its publish with
    # EXDEV, "Invalid cross-device link" from staging/1 to cache/item0; at staging the open
    # failed with a bare "[Errno 16] Device or resource busy" (its rmtree of a mount point).
    src = local_source(tmp_path, 2)
    cache = tmp_path / "cache"
    (cache / below).parent.mkdir(parents=True, exist_ok=True)
    with mounted(cache / below, ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache / below)]):
        top = subprocess.run(["findmnt", "-no", "TARGET", "-T", str(cache)], capture_output=True, text=True, check=True)
        pipe = Pipeline(f"{src}/", cache, "1MiB", items="folders")
        with pytest.raises(OSError, match="is on another mount than cache_dir") as err:
            pipe.open()
        assert err.value.errno == errno.EXDEV, err.value
        assert str(err.value) == (
            f"[Errno {errno.EXDEV}] cache_dir '{cache}': '{cache / below}' is on another mount than cache_dir "
            f"('{cache / below}', not '{top.stdout.strip()}'): an item is published by a rename from its staging folder there, "
            "which cannot cross mounts; mount nothing at or inside cache_dir's .cachepipe folder"
        )
        pipe.close()
    assert not [p for p in cache.iterdir() if p.name != ".cachepipe"]  # nothing downloaded
