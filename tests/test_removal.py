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
