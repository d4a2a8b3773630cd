"""Publishing a staged item: the rename never replaces what is in the item's place."""

from __future__ import annotations

import pytest

from cachepipe.cache import staging


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "check-then-rename"])
@pytest.mark.parametrize("in_the_way", ["file", "empty folder", "folder"])
def test_a_publish_rename_never_replaces_what_is_in_the_way(tmp_path, monkeypatch, native, in_the_way):
    if not native:  # a platform without renameat2 (macOS, glibc before 2.28)
        monkeypatch.setattr(staging, "_renameat2", None)
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
        staging.rename_new(str(src), str(dst))
    assert info.value.filename2 == str(dst)
    assert (src / "f").read_bytes() == b"new"
    if in_the_way == "file":
        assert dst.read_bytes() == b"theirs"
    else:
        assert [p.name for p in dst.iterdir()] == ([] if in_the_way == "empty folder" else ["g"])


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "check-then-rename"])
def test_a_publish_rename_moves_a_staged_item_into_a_free_place(tmp_path, monkeypatch, native):
    if not native:
        monkeypatch.setattr(staging, "_renameat2", None)
    (tmp_path / "staged").write_bytes(b"new")
    staging.rename_new(str(tmp_path / "staged"), str(tmp_path / "item"))
    assert (tmp_path / "item").read_bytes() == b"new" and not (tmp_path / "staged").exists()
    with pytest.raises(FileNotFoundError) as info:
        staging.rename_new(str(tmp_path / "staged"), str(tmp_path / "other"))
    assert info.value.filename == str(tmp_path / "staged")
