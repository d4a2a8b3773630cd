"""Object keys that would escape or collide in the cache, really stored in the moto server."""

from __future__ import annotations

import os

import pytest

from cachepipe import Pipeline, UnsafeKeyError


@pytest.mark.parametrize(
    "key, reason",
    [
        ("evil/../../escape.txt", "'..'"),
        ("evil/a//b", "empty path segment"),
        ("evil/a\\..\\b", "backslash"),
        ("evil/\x01ctl", "control character"),
        (".cachepipe/lock", "reserved"),
        ("evil/./x", "'.'"),
    ],
)
def test_unsafe_key_rejected_before_any_write(remote_source, tmp_path, key, reason):
    remote_source.folders(2, {"f": 10})
    remote_source.put(key, b"payload")
    cache = tmp_path / "cache"
    before = set(os.listdir(tmp_path))
    with pytest.raises(UnsafeKeyError) as info:
        Pipeline(remote_source.url, cache, "1MiB", storage_options=remote_source.options).open()
    assert repr(key) in str(info.value) and reason in str(info.value)
    assert set(os.listdir(tmp_path)) - before == {"cache"}
    assert os.listdir(cache) == [".cachepipe"] and set(os.listdir(cache / ".cachepipe")) <= {"lock", "journal"}


def test_file_and_folder_of_the_same_name_collide(remote_source, tmp_path):
    remote_source.put("item/a", b"file")
    remote_source.put("item/a/b", b"file below a file")
    with pytest.raises(UnsafeKeyError, match="collides") as info:
        Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=remote_source.options).open()
    assert "item/a/b" in str(info.value)


def test_console_folder_markers_are_not_items(remote_source, tmp_path):
    remote_source.put("item/", b"")  # what web consoles create for "new folder"
    remote_source.put("item/sub/", b"")
    remote_source.put("item/sub/f", b"data")
    with Pipeline(remote_source.url, tmp_path / "c", "1MiB", storage_options=remote_source.options) as pipe:
        items = [(p.name, p.files) for p in pipe]
    assert items == [("item", ("sub/f",))]
