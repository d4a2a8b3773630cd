"""Publishing a staged item: the rename never replaces what is in the item's place."""

from __future__ import annotations

import pytest

from cachepipe import fscalls

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
