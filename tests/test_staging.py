"""Publishing a staged item: the rename never replaces what is in the item's place."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cachepipe import fscalls, state
from cachepipe.blocks import footprint
from cachepipe.cache.recovery import sort_leftovers
from cachepipe.cache.staging import in_folders, make_folders
from cachepipe.catalog import Catalog
from cachepipe.stores.base import ObjectInfo

RENAMES = {
    "renameat2": fscalls.rename_new,
    "check-then-rename": fscalls.rename_new,  # a platform without renameat2 (macOS, glibc before 2.28)
    "holding the lock": fscalls.HOLDING.rename_new if fscalls.HOLDING else None,
}

BLOCK = 4096
"""The block sort_leftovers is told to charge in (the cache passes its own: no default)."""


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


def _damage(item: Path, damage: str, outside: Path) -> None:
    """Change the kept folder ``item`` (files ``a``, 3 bytes, and ``sub/b``, 5) as ``damage`` says."""
    if damage == "a file missing":
        (item / "sub" / "b").unlink()
    elif damage == "a file of another size":
        (item / "a").write_bytes(b"xxxx")
    elif damage == "an extra file":
        (item / "c").write_bytes(b"")
    elif damage == "an extra file in a subfolder":
        (item / "sub" / "c").write_bytes(b"")
    elif damage == "a file under another name":
        (item / "a").rename(item / "A")
    elif damage == "a link in place of a file":
        (outside / "a").write_bytes(b"xxx")
        (item / "a").unlink()
        (item / "a").symlink_to(outside / "a")
    elif damage == "a link to a folder added":
        (item / "link").symlink_to(outside, target_is_directory=True)
    elif damage == "the folder a link":
        shutil.move(item, outside / "moved")
        item.symlink_to(outside / "moved", target_is_directory=True)
    elif damage == "the folder a file":
        shutil.rmtree(item)
        item.write_bytes(b"x" * 8)
    elif damage == "the folder gone":
        shutil.rmtree(item)


DAMAGES = [
    "a file missing",
    "a file of another size",
    "an extra file",
    "an extra file in a subfolder",
    "a file under another name",
    "a link in place of a file",
    "a link to a folder added",
    "the folder a link",
    "the folder a file",
    "the folder gone",
]


@pytest.mark.parametrize("rebuilt", [False, True], ids=["journal", "journal unreadable"])
@pytest.mark.parametrize("damage", ["none", *DAMAGES])
def test_a_kept_folder_is_reused_only_while_its_files_match_the_catalogs_columns_exactly(tmp_path, damage, rebuilt):
    # sort_leftovers checks a kept item against the catalog's columns (Catalog.file_sizes), not
    # an Item: every way the folder can differ from the listing still makes it no match.
    root, outside = tmp_path / "c", tmp_path / "outside"
    outside.mkdir()
    catalog = Catalog(mode="folders")
    catalog.add("item0", [("a", 3, None), ("sub/b", 5, None)])
    catalog.add("item1", [("c", 2, None)])
    (root / "item0" / "sub").mkdir(parents=True)
    (root / "item0" / "a").write_bytes(b"xxx")
    (root / "item0" / "sub" / "b").write_bytes(b"xxxxx")
    (root / "item1").mkdir()
    (root / "item1" / "c").write_bytes(b"xx")
    _damage(root / "item0", damage, outside)
    replay = state.Replay(published={"item0", "item1"})
    reuse, stale = sort_leftovers(root, replay, rebuilt, catalog, block=BLOCK)
    # a reused item is charged what it takes: its files in whole blocks and a block per folder it
    # makes (item0: two files, its folder and sub/; item1: one file and its folder)
    item0, item1 = footprint([3, 5], 2, BLOCK), footprint([2], 1, BLOCK)
    if damage == "none":
        assert (reuse, stale) == ({"item0": item0, "item1": item1}, [])
    elif rebuilt or damage == "the folder gone":  # not ours to remove (unreadable journal), or nothing there
        assert (reuse, stale) == ({"item1": item1}, [])
    else:
        assert (reuse, stale) == ({"item1": item1}, ["item0"])
    assert sorted(os.listdir(outside)) == {"a link in place of a file": ["a"], "the folder a link": ["moved"]}.get(damage, [])


@pytest.mark.parametrize("kept", ["same", "another size", "a folder", "a link", "missing"])
def test_a_kept_single_file_item_is_reused_only_as_a_regular_file_of_its_listed_size(tmp_path, kept):
    root = tmp_path / "c"
    (root / "sub").mkdir(parents=True)
    catalog = Catalog.from_listing([ObjectInfo("sub/x.tar", 4), ObjectInfo("y.tar", 2)], "files")
    (root / "y.tar").write_bytes(b"yy")
    if kept == "same":
        (root / "sub" / "x.tar").write_bytes(b"xxxx")
    elif kept == "another size":
        (root / "sub" / "x.tar").write_bytes(b"xxx")
    elif kept == "a folder":
        (root / "sub" / "x.tar").mkdir()
    elif kept == "a link":
        (root / "elsewhere").write_bytes(b"xxxx")
        (root / "sub" / "x.tar").symlink_to(root / "elsewhere")
    reuse, stale = sort_leftovers(root, state.Replay(published={"sub/x.tar", "y.tar"}), False, catalog, block=BLOCK)
    # a single-object item: its file in whole blocks, and a block for each folder of its name
    # (sub/x.tar: sub), which its eviction removes once empty
    assert reuse == ({"sub/x.tar": 2 * BLOCK, "y.tar": BLOCK} if kept == "same" else {"y.tar": BLOCK})
    assert stale == ([] if kept in ("same", "missing") else ["sub/x.tar"])


def test_a_kept_item_is_reused_only_at_the_version_the_journal_recorded_and_never_if_unsafe(tmp_path):
    root = tmp_path / "c"
    listing = [ObjectInfo("a/f", 1, "e1"), ObjectInfo("b/f", 1, "e2"), ObjectInfo("c/f", 1, None), ObjectInfo("d/f", 1, "e4")]
    catalog = Catalog.from_listing(listing)
    catalog.add("e", [("f", 1, None), ("f", 1, None)])  # a path listed twice: unsafe, never reused
    catalog.check_keys()
    for name in "abcde":
        (root / name).mkdir(parents=True)
        (root / name / "f").write_bytes(b"x")
    versions = {"a": catalog[0].version, "b": "0123456789abcdef", "d": None}
    assert versions["a"] is not None and catalog[3].version is not None and 4 in catalog.unsafe
    replay = state.Replay(published=set("abcde"), versions={k: v for k, v in versions.items() if v is not None})
    reuse, stale = sort_leftovers(root, replay, False, catalog, block=BLOCK)
    # a: the version recorded; b: another; c: no tags, none recorded; d: tagged, none recorded
    # (each reused item: its file's block and its folder's)
    assert (reuse, stale) == ({"a": 2 * BLOCK, "c": 2 * BLOCK}, ["b", "d", "e"])
