"""A local filesystem's listing (``FsspecStore.list`` of ``file://``): walked in key order as it
is read, the same keys as fsspec's ``find`` sorted (which listed the whole tree into memory
first, so a map rank's listing of its part of a local DST walked all of it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import fsspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mounts import mounted
from test_fs_week import loop_image

from cachepipe.stores import open_store
from cachepipe.stores.fsspec import local_files

# characters on both sides of "/" in key order, and one beyond ASCII
NAMES = st.text(alphabet=" -.0_aé", min_size=1, max_size=3).filter(lambda n: n not in (".", ".."))
TREES = st.lists(st.lists(NAMES, min_size=1, max_size=4), min_size=1, max_size=12)


def _make(root: Path, paths: list[list[str]]) -> None:
    for parts in paths:
        path = root.joinpath(*parts)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"x" * len(parts))
        except (FileExistsError, NotADirectoryError, IsADirectoryError):
            continue  # a file where a folder is wanted, or the reverse: the tree keeps the first


@settings(max_examples=60, deadline=None, database=None)
@given(paths=TREES, after=st.one_of(st.none(), st.text(alphabet=" -./0_aé", max_size=6)))
def test_the_walk_lists_what_fsspec_finds_in_key_order_after_any_key(paths, after):
    root = Path(tempfile.mkdtemp())
    try:
        _make(root, paths)
        found = fsspec.filesystem("file").find(str(root), detail=True)
        expected = sorted((p[len(str(root)) + 1 :], v["size"]) for p, v in found.items() if v["type"] == "file")
        if after is not None:
            expected = [(k, size) for k, size in expected if k > after]
        assert list(local_files(str(root), after)) == expected
    finally:
        shutil.rmtree(root)


def test_a_listing_is_walked_as_it_is_read(tmp_path):
    """A file written after the listing's first object, in a folder it has not reached, is
    listed; one written where it has been, is not. (Before, the whole tree was found first: the
    second was not listed either.)"""
    for name in ("a", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_bytes(b"x")
    store = open_store(tmp_path.as_uri(), {})
    try:
        listing = store.list()
        assert next(listing).key == "a/f"
        (tmp_path / "a" / "g").write_bytes(b"x")  # behind the walk
        (tmp_path / "c" / "g").write_bytes(b"x")  # ahead of it
        assert [o.key for o in listing] == ["c/f", "c/g"]
    finally:
        store.close()


def test_links_are_neither_followed_nor_listed_and_a_missing_root_lists_nothing(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "f").write_bytes(b"x")
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"yy")
    os.symlink(tmp_path / "elsewhere", root / "dir-link")
    os.symlink(tmp_path / "elsewhere" / "f", root / "file-link")
    os.mkfifo(root / "fifo")
    assert list(local_files(str(root))) == [("d/f", 2)]
    assert list(local_files(str(tmp_path / "missing"))) == []
    assert list(local_files(str(root / "d" / "f"))) == []  # a file as the root: as fsspec's find, nothing


UNREADABLE = r"""
import os, sys
from cachepipe.stores import open_store
# imported and opened as root: nobody cannot read the interpreter's files here
stores = [open_store(url, {}) for url in sys.argv[1:]]
os.setgid(65534)
os.setuid(65534)  # nobody: the folder's mode applies (root reads every folder)
for store in stores:  # a line each
    try:
        print([o.key for o in store.list()])
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def _list_as_nobody(*urls: str) -> list[str]:
    """What :data:`UNREADABLE` prints of each of ``urls``, listed as nobody: a line each."""
    run = subprocess.run([sys.executable, "-c", UNREADABLE, *urls], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_a_folder_that_cannot_be_read_is_an_error_naming_it_not_a_gap_in_the_listing():
    """(Before, fsspec's find passed over a folder it could not list: its files were missing
    from the listing, and nothing said so.)"""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the listing as nobody")
    root = Path(tempfile.mkdtemp(dir="/tmp"))  # nobody must reach it: not under pytest's root-only folder
    try:
        root.chmod(0o755)
        for name in ("a", "b", "c"):
            (root / name).mkdir(mode=0o755)
            (root / name / "f").write_bytes(b"x")
            (root / name / "f").chmod(0o644)
        (root / "b").chmod(0o000)
        (said,) = _list_as_nobody(root.as_uri())
        assert "Permission denied" in said and f"{root}/b" in said, said
    finally:
        (root / "b").chmod(0o755)
        shutil.rmtree(root)


def test_fscks_lost_found_at_the_top_of_a_mounted_file_system_is_passed_over():
    """A data volume's mount point (ext4: mkfs makes ``lost+found`` there, root's alone) listed
    by another user: its files, ``lost+found`` passed over, as fsspec's find did (before the
    fix, the listing failed: ``Permission denied: '.../disk/lost+found'``). A folder so named
    elsewhere is no fsck's: an error, as any folder that cannot be read."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to mount and to run the listing as nobody")
    base = Path(tempfile.mkdtemp(dir="/tmp"))  # nobody must reach it: not under pytest's root-only folder
    try:
        base.chmod(0o755)
        disk, commands = loop_image(base, ["mkfs.ext4", "-q", "-F"], 8 << 20)
        plain = base / "plain"
        (plain / "lost+found").mkdir(parents=True, mode=0o700)
        (plain / "f").write_bytes(b"x")
        with mounted(disk, *commands):
            assert (disk / "lost+found").stat().st_mode & 0o077 == 0  # mkfs's: root's alone
            disk.chmod(0o755)
            (disk / "a").mkdir(mode=0o755)
            (disk / "a" / "f").write_bytes(b"xy")
            on_disk, elsewhere = _list_as_nobody(disk.as_uri(), plain.as_uri())
        assert on_disk == "['a/f']"
        assert "Permission denied" in elsewhere and f"{plain}/lost+found" in elsewhere, elsewhere
    finally:
        shutil.rmtree(base)
