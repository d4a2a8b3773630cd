"""A Python user's week with the iterator: what a plain ``for item in Pipeline(...)`` user ran
into, each over a local source (a real folder tree) unless the store's part matters."""

from __future__ import annotations

import io
import os
import tarfile
import traceback
from pathlib import Path

import pytest
from sampling import block_of

from cachepipe import ConfigError, Pipeline, UnsafeKeyError
from cachepipe.blocks import footprint, round_up
from cachepipe.cache import Cache
from cachepipe.catalog import Catalog
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


def _one_large_of_four(tmp_path: Path) -> tuple[Path, int, int]:
    """A local source of four items of 100 bytes but ``item2``, and a capacity that leaves
    ``item2`` out of a plan made over the listing alone. Returns ``(source, item2's size, the
    capacity)``. In whole blocks, measured on a cache opened beside the test's over the same
    items: the capacity holds the state and three blocks (a small item takes two: its file's
    block and its folder's); the plan is made before the state's files are measured (the
    journal's budget and the state folder alone), beside which ``item2`` is a block too large."""
    block = block_of(tmp_path)
    catalog = Catalog(mode="folders")
    for i in range(4):
        catalog.add(f"item{i}", [("f", 100, None)])  # the budget counts names, not sizes
    probe = Cache(tmp_path / "probe", 1 << 20)
    probe.open()
    try:
        probe.recover(catalog, resume=False)
        state = probe.capacity - probe.limit
    finally:
        probe.close()
    planned_beside = round_up(Cache.journal_budget(catalog), block) + block
    capacity = state + 3 * block
    large = capacity - planned_beside  # its file alone fills the room the plan sees; its folder is over it
    src = tmp_path / "src"
    for i in range(4):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "f").write_bytes(bytes(large if i == 2 else 100))
    return src, large, capacity


def _left_out(whose: str, large: int, capacity: int, block: int) -> str:
    """The refusal's reason: item2 left out, named with both its sizes and the capacity."""
    return (
        rf"1 item\(s\) of {whose} do not fit this cache and were left out of this one \(on_oversize='skip'\): the "
        rf"largest, 'item2', is {large} bytes listed, {footprint([large], 1, block)} bytes in the filesystem's blocks "
        rf"of {block} bytes .*larger than the cache capacity of {capacity} bytes less \d+ bytes taken by other files "
        r"and cachepipe's state; resume with a capacity that holds them"
    )


def test_a_state_loaded_where_a_smaller_capacity_leaves_an_item_out_says_so(tmp_path):
    # A state loads into a pipeline of another capacity; but one whose capacity leaves an item
    # out of its plan (on_oversize="skip", planning alone) has a plan of fewer items, and the
    # refusal said only "n_items=4, this plan has n_items=3", not why nor what to do. It names
    # the item's size as listed and what it takes in whole blocks, which decided it.
    src, large, capacity = _one_large_of_four(tmp_path)
    options = {"epochs": 2, "shuffle": True, "seed": 5, "rank": 0, "world_size": 1}
    with Pipeline(src, tmp_path / "a", "1MiB", auto_ack=False, **options) as pipe:
        pipe.ack(pipe.get(timeout=30))
        state = pipe.state_dict()
    again = Pipeline(src, tmp_path / "b", capacity, on_oversize="skip", **options)
    again.load_state_dict(state)
    with pytest.raises(
        ConfigError, match=r"n_items=3: cannot resume: " + _left_out("the state's plan", large, capacity, block_of(tmp_path))
    ):
        again.open()


def test_a_pass_resumed_where_a_smaller_capacity_leaves_an_item_out_says_so(tmp_path):
    # resume=True over a cache kept by a pass of 4 items, reopened with a capacity that leaves
    # one out (on_oversize="skip"): the refusal said only "n_items 4 there, 3 here; sizes_digest
    # ... differ", not that an item was left out for the capacity, nor what to do.
    src, large, capacity = _one_large_of_four(tmp_path)
    options = {"epochs": 2, "shuffle": True, "seed": 5}
    with Pipeline(src, tmp_path / "a", "1MiB", auto_ack=False, keep_on_close=True, **options) as pipe:
        pipe.ack(pipe.get(timeout=30))
    with pytest.raises(
        ConfigError, match=r"n_items 4 there, 3 here.*\. " + _left_out("the listing", large, capacity, block_of(tmp_path))
    ):
        Pipeline(src, tmp_path / "a", capacity, on_oversize="skip", resume=True, **options).open()
