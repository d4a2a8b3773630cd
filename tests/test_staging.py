"""Publishing a staged item: the rename never replaces what is in the item's place."""

from __future__ import annotations

import os

import pytest

from cachepipe import fscalls
from cachepipe.cache.staging import in_folders, make_folders

RENAMES = {
    "renameat2": fscalls.rename_new,
    "check-then-rename": fscalls.rename_new,  # a platform without renameat2 (macOS, glibc before 2.28)
    "holding the lock": fscalls.HOLDING.rename_new if fscalls.HOLDING else None,
}


def rename_new(way, monkeypatch):
    if way == "check-then-rename":
        monkeypatch.setattr(fscalls, "_renameat2", None)
    assert RENAMES[way] is not None, "the C library has renameat2 here (glibc 2.28+)"
    return RENAMES[way]


@pytest.mark.parametrize("way", RENAMES)
@pytest.mark.parametrize("in_the_way", ["file", "empty folder", "folder"])
def test_a_publish_rename_never_replaces_what_is_in_the_way(tmp_path, monkeypatch, way, in_the_way):
    rename = rename_new(way, monkeypatch)
    src, dst = tmp_path / "staged", tmp_path / "item"
    src.mkdir()
    (src / "f").write_bytes(b"new")
    if in_the_way == "file":
        dst.write_bytes(b"theirs")
    else:
        dst.mkdir()
        if in_the_way == "folder":
            (dst / "g").write_bytes(b"theirs")
    with pytest.raises(FileExistsError) as info:
        rename(str(src), str(dst))
    assert info.value.filename2 == str(dst)
    assert (src / "f").read_bytes() == b"new"
    if in_the_way == "file":
        assert dst.read_bytes() == b"theirs"
    else:
        assert [p.name for p in dst.iterdir()] == ([] if in_the_way == "empty folder" else ["g"])


@pytest.mark.parametrize("way", RENAMES)
def test_a_publish_rename_moves_a_staged_item_into_a_free_place(tmp_path, monkeypatch, way):
    rename = rename_new(way, monkeypatch)
    (tmp_path / "staged").write_bytes(b"new")
    rename(str(tmp_path / "staged"), str(tmp_path / "item"))
    assert (tmp_path / "item").read_bytes() == b"new" and not (tmp_path / "staged").exists()
    with pytest.raises(FileNotFoundError) as info:
        rename(str(tmp_path / "staged"), str(tmp_path / "other"))
    assert info.value.filename == str(tmp_path / "staged")


@pytest.mark.parametrize("in_the_way", ["link", "file"])
def test_a_nested_items_folders_are_made_real_and_never_passed_through_a_link_or_a_file(tmp_path, in_the_way):
    root, outside = tmp_path / "c", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    make_folders(str(root), "a/b/c/item.bin")
    assert (root / "a" / "b" / "c").is_dir() and in_folders(str(root), "a/b/c/item.bin")
    if in_the_way == "link":
        os.symlink(outside, root / "x")
    else:
        (root / "x").write_bytes(b"not ours")
    with pytest.raises(FileExistsError) as err:
        make_folders(str(root), "x/y/item.bin")
    assert err.value.strerror == f"{root / 'x'} is not a folder (a symbolic link or a file)"
    assert (err.value.filename, err.value.filename2) == (str(root / "x"), None)  # as the publish reads it
    assert not in_folders(str(root), "x/y/item.bin") and not in_folders(str(root), "missing/item.bin")
    assert in_folders(str(root), "flat.bin") and os.listdir(outside) == []
