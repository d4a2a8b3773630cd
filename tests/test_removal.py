"""The reaper: acknowledged items are deleted off the consumer's thread, space released after."""

from __future__ import annotations

import os
import threading

from cachepipe.removal import Reaper, rmtree


def _item(root, name: str, size: int) -> str:
    path = root / name
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "f").write_bytes(b"x" * size)
    return str(path)


def test_reaper_deletes_in_order_and_releases_each_size_after_its_files_are_gone(tmp_path):
    released = []

    def release(size: int, left: int) -> None:
        released.append((size, left, os.path.lexists(tmp_path / f"i{size}")))

    reaper = Reaper(release)
    for size in (1, 2, 3):
        assert reaper.put(_item(tmp_path, f"i{size}", size), size)
    reaper.stop()  # drains the queue before it returns
    assert released == [(1, 0, False), (2, 0, False), (3, 0, False)]
    assert os.listdir(tmp_path) == []
    assert not any(t.name == "cachepipe-reaper" for t in threading.enumerate())


def test_reaper_refuses_work_once_stopped_and_starts_no_thread_for_nothing(tmp_path):
    reaper = Reaper(lambda size, left: None)  # noqa: ARG005 - stands in for a callable with this signature
    reaper.stop()
    assert not reaper.put(_item(tmp_path, "late", 1), 1)  # the caller deletes it itself
    assert os.path.exists(tmp_path / "late")
    assert not any(t.name == "cachepipe-reaper" for t in threading.enumerate())
    reaper.stop()  # idempotent


def test_rmtree_of_a_missing_path_is_a_no_op(tmp_path):
    rmtree(tmp_path / "missing")
    rmtree(str(tmp_path / "missing"))


def test_rmtree_by_names_deletes_whatever_the_consumer_left_in_the_folder(tmp_path):
    """The names given are unlinked without listing the folder; whatever else is there (a file
    added, a folder in place of a name, a name already gone) is found by listing it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"mine")
    cases = {
        "exactly": ["a", "b"],
        "added": ["a", "b", "extra"],
        "gone": ["b"],
        "folder": ["b"],  # "a" is a folder with a file in it
        "link": ["b"],  # "a" is a link to a folder outside
    }
    for case, files in cases.items():
        item = tmp_path / case
        item.mkdir()
        for name in files:
            (item / name).write_bytes(b"x")
        if case == "folder":
            (item / "a").mkdir()
            (item / "a" / "f").write_bytes(b"x")
        if case == "link":
            (item / "a").symlink_to(outside, target_is_directory=True)
        rmtree(item, ("a", "b"))
        assert not os.path.lexists(item), case
    assert (outside / "keep").read_bytes() == b"mine"


def test_rmtree_by_names_never_follows_a_link_in_place_of_the_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a").write_bytes(b"mine")
    (tmp_path / "item").symlink_to(outside, target_is_directory=True)
    rmtree(tmp_path / "item", ("a",))
    assert not os.path.lexists(tmp_path / "item")
    assert (outside / "a").read_bytes() == b"mine"
