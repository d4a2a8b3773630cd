"""A Python user's week with the iterator: what a plain ``for item in Pipeline(...)`` user ran
into, each over a local source (a real folder tree) unless the store's part matters."""

from __future__ import annotations

import io
import os
import tarfile
import traceback
from pathlib import Path

import pytest

from cachepipe import ConfigError, Pipeline, UnsafeKeyError
from cachepipe.listing import FIRST_PAGE_OBJECTS


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


def test_a_listing_stopped_after_open_is_raised_by_every_later_get_not_taken_for_the_end(tmp_path):
    # Beyond the first listing page, an item with a key that cannot be stored stops the streamed
    # listing (on_error="raise"): raised once the items before it are delivered. A get after it
    # returned None, as at the end of a complete pass, and a second loop ended without a word: a
    # consumer thread that came later, or a loop run again, took a pass cut short for a whole one.
    src = tmp_path / "src"
    for i in range(FIRST_PAGE_OBJECTS + 20):
        (src / f"item{i:04d}").mkdir(parents=True)
        (src / f"item{i:04d}" / "f").write_bytes(b"x")
    bad = src / f"item{FIRST_PAGE_OBJECTS + 10:04d}"
    (bad / "f").rename(bad / "a\\b")  # a backslash: refused as a key
    with Pipeline(src, tmp_path / "cache", "1MiB") as pipe:
        delivered = []
        with pytest.raises(UnsafeKeyError, match="contains a backslash"):  # noqa: PT012 - raised by the loop, in its turn
            for item in pipe:
                delivered.append(item.name)  # noqa: PERF401 - the loop is what is tested
        assert len(delivered) == FIRST_PAGE_OBJECTS + 10
        frames = []
        for _ in range(2):
            with pytest.raises(UnsafeKeyError, match="contains a backslash") as raised:
                pipe.get(timeout=30)
            frames.append(len(traceback.extract_tb(raised.value.__traceback__)))
        assert frames[0] == frames[1]  # raised from where it was reported each time, its traceback not grown
        with pytest.raises(UnsafeKeyError, match="contains a backslash"):
            next(iter(pipe))


def test_a_loop_over_a_pipeline_its_first_loop_closed_raises_instead_of_ending_at_once(tmp_path):
    # Iterated without `with`, a loop opens the pipeline and closes it when it ends, by a break
    # too. A second loop over it ended at once, without an error, as if every item had been
    # delivered; it raises, as get() does on a closed pipeline.
    src = tmp_path / "src"
    for i in range(4):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "f").write_bytes(b"x")
    pipe = Pipeline(src, tmp_path / "cache", "1MiB")
    for _item in pipe:
        break
    with pytest.raises(RuntimeError, match="is closed: create a new Pipeline"):
        next(iter(pipe))
    with pytest.raises(RuntimeError, match="is closed"):
        pipe.get()


def _one_large_of_four(tmp_path: Path) -> Path:
    """A local source of four items of 100 bytes but ``item2``, of 9,000."""
    src = tmp_path / "src"
    for i in range(4):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "f").write_bytes(bytes(9000 if i == 2 else 100))
    return src


def test_a_state_loaded_where_a_smaller_capacity_leaves_an_item_out_says_so(tmp_path):
    # A state loads into a pipeline of another capacity; but one whose capacity leaves an item
    # out of its plan (on_oversize="skip", planning alone) has a plan of fewer items, and the
    # refusal said only "n_items=4, this plan has n_items=3", not why nor what to do.
    src = _one_large_of_four(tmp_path)
    options = {"epochs": 2, "shuffle": True, "seed": 5, "rank": 0, "world_size": 1}
    with Pipeline(src, tmp_path / "a", "1MiB", auto_ack=False, **options) as pipe:
        pipe.ack(pipe.get(timeout=30))
        state = pipe.state_dict()
    again = Pipeline(src, tmp_path / "b", 8000, on_oversize="skip", **options)
    again.load_state_dict(state)
    with pytest.raises(
        ConfigError,
        match=r"n_items=3: cannot resume: 1 item\(s\) of the state's plan \(the largest 9000 bytes\) "
        r"do not fit this cache's capacity of 8000 bytes .*resume with a capacity that holds them",
    ):
        again.open()


def test_a_pass_resumed_where_a_smaller_capacity_leaves_an_item_out_says_so(tmp_path):
    # resume=True over a cache kept by a pass of 4 items, reopened with a capacity that leaves
    # one out (on_oversize="skip"): the refusal said only "n_items 4 there, 3 here; sizes_digest
    # ... differ", not that an item was left out for the capacity, nor what to do.
    src = _one_large_of_four(tmp_path)
    options = {"epochs": 2, "shuffle": True, "seed": 5}
    with Pipeline(src, tmp_path / "a", "1MiB", auto_ack=False, keep_on_close=True, **options) as pipe:
        pipe.ack(pipe.get(timeout=30))
    with pytest.raises(
        ConfigError,
        match=r"n_items 4 there, 3 here.* 1 item\(s\) of the listing \(the largest 9000 bytes\) do not fit this "
        r"cache's capacity of 8000 bytes and were left out of this one \(on_oversize='skip'\); resume with a capacity",
    ):
        Pipeline(src, tmp_path / "a", 8000, on_oversize="skip", resume=True, **options).open()
