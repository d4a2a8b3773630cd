"""A Python user's week with the iterator: what a plain ``for item in Pipeline(...)`` user ran
into, each over a local source (a real folder tree) unless the store's part matters."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from cachepipe import Pipeline


def _clips(src: Path, n: int) -> list[str]:
    """``n`` folder items ``clip<i>`` of a tar archive (one random member) and a text file."""
    names = []
    for i in range(n):
        folder = src / f"clip{i}"
        folder.mkdir(parents=True)
        body = io.BytesIO()
        with tarfile.open(fileobj=body, mode="w") as tar:
            data = os.urandom(2000)
            member = tarfile.TarInfo("frame.bin")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
        (folder / "video.tar").write_bytes(body.getvalue())
        (folder / "text.txt").write_text(str(i))
        names.append(folder.name)
    return names


def _mark(path: os.PathLike[str]) -> None:  # a prepare hook: leaves a file of its own in the item
    (Path(path) / "prepared").write_text("yes")


@pytest.mark.parametrize("how", ["unpack", "prepare"])
def test_items_kept_on_close_are_not_handed_to_a_pipeline_that_unpacks_or_prepares_as_they_were(tmp_path, how):
    # Kept on close by a plain pipeline, an item is on disk as listed. A pipeline with unpack (or a
    # prepare hook) reused it as it was: the archive delivered instead of its members, the hook never
    # run on it. It is downloaded again and goes through them.
    src, cache = tmp_path / "src", tmp_path / "cache"
    names = _clips(src, 3)
    with Pipeline(src, cache, "1MiB", keep_on_close=True, auto_ack=False) as pipe:
        assert pipe.get(timeout=30) is not None  # held at close: kept, as every item downloaded by then
    assert (cache / "clip0" / "video.tar").exists()
    options = {"unpack": True} if how == "unpack" else {"prepare": _mark, "prepare_reserve": 100}
    with Pipeline(src, cache, "1MiB", **options) as pipe:
        seen = {item.name: sorted(os.listdir(item)) for item in pipe}
        assert pipe.stats().items_reused == 0
    expected = ["frame.bin", "text.txt"] if how == "unpack" else ["prepared", "text.txt", "video.tar"]
    assert seen == dict.fromkeys(names, expected)

