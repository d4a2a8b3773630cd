"""Object keys that would escape or collide in the cache, really stored in the moto server."""

from __future__ import annotations

import os

import pytest

from cachepipe import Pipeline, UnsafeKeyError


@pytest.mark.parametrize(
    ("key", "reason"),
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


@pytest.mark.parametrize("resume", [False, True], ids=["streamed", "resumable"])
def test_a_local_name_that_is_not_utf8_is_delivered_journaled_and_resumed(tmp_path, resume):
    src = os.fsencode(tmp_path / "src")
    for name, body in ((b"caf\xe9", b"x" * 10), (b"plain", b"y" * 10)):  # Latin-1 "café": not UTF-8
        os.makedirs(src + b"/" + name)
        with open(src + b"/" + name + b"/f", "wb") as fh:
            fh.write(body)
    url, cache = f"file://{os.fsdecode(src)}", tmp_path / "c"
    with Pipeline(url, cache, "1MiB", resume=resume, auto_ack=False) as pipe:
        first = pipe.get(timeout=30)
        assert os.fsencode(first.name) == b"caf\xe9" and (first / "f").read_bytes() == b"x" * 10
        pipe.ack(first)  # journaled under the same bytes
    with Pipeline(url, cache, "1MiB", resume=True) as pipe:
        names = [p.name for p in pipe]
    assert names == ["plain"]  # the ack of the first pass was read back
