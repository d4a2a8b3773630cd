import pytest

from cachepipe.catalog import check_key, group_items
from cachepipe.errors import UnsafeKeyError
from cachepipe.stores.base import ObjectInfo


def objs(*keys, size=1):
    return [ObjectInfo(k, size) for k in keys]


@pytest.mark.parametrize(
    "key, reason",
    [
        ("", "empty key"),
        ("/abs/x", "absolute"),
        ("a\\b/c", "backslash"),
        ("a/b\x00c", "NUL"),
        ("a/\x07", "control"),
        ("a//b", "empty path segment"),
        ("a/../b", "'..'"),
        ("../a", "'..'"),
        ("a/./b", "'.'"),
        ("a/" + "x" * 256, "longer than 255"),
        (".cachepipe/x", "reserved"),
    ],
)
def test_unsafe_keys_rejected_with_key_named(key, reason):
    with pytest.raises(UnsafeKeyError) as info:
        check_key(key)
    assert reason in str(info.value)
    assert repr(key) in str(info.value)


def test_safe_keys():
    assert check_key("folder1/video.mp4") == ["folder1", "video.mp4"]
    assert check_key("a b/ü.txt") == ["a b", "ü.txt"]
    assert check_key("..a/b..") == ["..a", "b.."]


def test_group_folders_streams_in_key_order():
    listing = objs("a-b/x", "a/1", "a/sub/2", "b/3", "loose.txt")
    items = list(group_items(listing))
    assert [i.name for i in items] == ["a-b", "a", "b"]
    a = items[1]
    assert [f.rel for f in a.files] == ["1", "sub/2"] and a.size == 2 and not a.is_file


def test_group_is_lazy():
    def gen():
        yield ObjectInfo("a/1", 1)
        yield ObjectInfo("b/1", 1)
        raise AssertionError("read past what was needed")

    it = group_items(gen())
    assert next(it).name == "a"


def test_directory_markers_skipped():
    items = list(group_items([ObjectInfo("a/", 0), ObjectInfo("a/f", 3), ObjectInfo("a/sub/", 0)]))
    assert [(i.name, [f.rel for f in i.files]) for i in items] == [("a", ["f"])]


def test_nonempty_key_with_trailing_slash_rejected():
    with pytest.raises(UnsafeKeyError, match="empty path segment"):
        list(group_items([ObjectInfo("a/f/", 5)]))


def test_file_and_folder_collision_rejected():
    with pytest.raises(UnsafeKeyError, match="collides") as info:
        list(group_items(objs("a/x", "a/x/y")))
    assert "a/x/y" in str(info.value)


def test_collision_in_files_mode():
    with pytest.raises(UnsafeKeyError, match="collides"):
        list(group_items(objs("s/000.tar", "s/000.tar/x"), "files"))


def test_files_mode():
    items = list(group_items(objs("000.tar", "001.tar", "sub/002.tar", size=5), "files"))
    assert [i.name for i in items] == ["000.tar", "001.tar", "sub/002.tar"]
    assert all(i.is_file and i.size == 5 and i.files[0].rel == "" for i in items)


def test_unsorted_listing_rejected():
    with pytest.raises(ValueError, match="out of order"):
        list(group_items(objs("b/1", "a/1")))
