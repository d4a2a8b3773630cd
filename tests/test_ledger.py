"""The capacity ledger's decisions, without disk or threads."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachepipe.cache.ledger import Ledger
from cachepipe.errors import ConfigError


def test_reserve_fits_release_and_reap():
    ledger = Ledger(capacity=100, foreign=10, overhead=20)
    assert (ledger.limit, ledger.free) == (70, 70)
    assert ledger.fits(70) and not ledger.fits(71)
    ledger.reserve(50)
    assert (ledger.used, ledger.free) == (80, 20)
    ledger.reaping_started(30)  # an item being deleted: its room is on its way, not free yet
    assert ledger.free == 20 and ledger.reaping == 30
    ledger.reaped(30, left=5)  # 5 bytes of it could not be deleted: foreign until the next open
    assert (ledger.reserved, ledger.reaping, ledger.foreign, ledger.free) == (20, 0, 15, 45)
    ledger.release(20)
    assert ledger.used == 35


def test_room_beside_held_leftovers():
    # 3 leftovers of 30 bytes hold 90 of 100: a 40-byte step can never fit beside them
    ledger = Ledger(capacity=100, overhead=5, reserved=90)
    assert ledger.room_beside(90) == 5
    assert ledger.room_beside(60) == 35  # one dropped: still less than 40
    assert ledger.room_beside(30) == 65  # two dropped: 40 fits, the rest is freed by acks


def test_over_capacity_counts_items_being_deleted_as_gone():
    ledger = Ledger(capacity=100, overhead=10, reserved=120)
    assert ledger.over_capacity()
    ledger.reaping_started(30)
    assert not ledger.over_capacity()


def test_no_room_for_any_item_is_a_config_error_naming_the_dir():
    ledger = Ledger(capacity=100, foreign=60)
    ledger.check_room("/c", overhead=39)
    with pytest.raises(ConfigError, match=r"'/c' holds 60 bytes .* needs 40 bytes .* capacity of 100"):
        ledger.check_room("/c", overhead=40)


# ---- what an item is charged: its files in whole blocks, a block per folder (cachepipe.blocks)


def test_footprint_rounds_each_file_up_to_whole_blocks():
    from cachepipe.blocks import footprint

    block = 4096  # ext4, XFS, btrfs
    assert footprint([1], 0, block) == 4096
    assert footprint([0], 0, block) == 0  # an empty file takes no block
    assert footprint([4096], 0, block) == 4096
    assert footprint([4097], 0, block) == 8192
    assert footprint([], 0, block) == 0
    assert footprint([512] * 8, 1, block) == 9 * 4096  # eight small files in their folder
    assert footprint([1, 4097, 0], 3, 512) == 512 + 9 * 512 + 3 * 512


def test_folders_made_counts_the_item_and_each_distinct_folder_below_it():
    from cachepipe.blocks import folders_made

    assert folders_made([""], is_file=True) == 0  # a single object: its file only
    assert folders_made([""], is_file=True, name="a/b/x.bin") == 2  # and the folders of its name
    assert folders_made(["x", "y"], is_file=False) == 1  # its own folder
    assert folders_made(["a/b/x", "a/b/y", "a/z", "c/w"], is_file=False) == 1 + 3  # a, a/b, c
    assert folders_made(["a/b/c/x"], is_file=False) == 4


def test_block_is_held_to_a_sane_range():
    from cachepipe.blocks import BLOCK_MAX, BLOCK_MIN, clamp_block

    assert clamp_block(4096) == 4096
    assert clamp_block(0) == BLOCK_MIN == 512  # not reported
    assert clamp_block(1 << 20) == BLOCK_MAX == 65536  # NFS: the server's I/O size, not a block


def test_catalog_charge_is_the_items_and_over_limit_finds_each_item_over_it():
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog()
    catalog.add("small", [("x", 10, None), ("d/y", 10, None)])  # 2 files + 2 folders
    catalog.add("big", [("x", 9000, None)])  # 3 blocks + 1 folder
    catalog.add("many", [(f"f{i}", 1, None) for i in range(8)])  # 8 files + 1 folder
    cache = Cache.__new__(Cache)  # charge() reads the block alone
    cache.block = 4096
    assert (
        [catalog.charge(i, 4096) for i in range(3)] == [cache.charge(item) for item in catalog] == [4 * 4096, 4 * 4096, 9 * 4096]
    )
    assert list(catalog.over_limit(9 * 4096, 4096)) == []
    assert list(catalog.over_limit(8 * 4096, 4096)) == [(2, 9 * 4096)]  # 8 bytes listed: over by its blocks
    assert list(catalog.over_limit(100, 0)) == [(1, 9000)]  # block 0: the listed sizes
    assert cache.charge(catalog[0], extra=1) == 5 * 4096  # extra rounded up to a whole block


def test_an_item_charged_in_other_blocks_gets_each_blocks_charge_every_time():
    """An item's charge is computed once per block (Item.footprint keeps it): a cache of another
    block (or one whose block its open changed) never reuses it, and ``extra`` is never kept in it."""
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog()
    catalog.add("item", [("x", 5000, None), ("d/e/y", 1, None), ("d/z", 0, None)])  # 3 files + 3 folders
    item = catalog[0]
    small, large = Cache.__new__(Cache), Cache.__new__(Cache)  # charge() reads the block alone
    small.block, large.block = 512, 4096
    for _ in range(2):  # each asked again after the other
        assert large.charge(item) == catalog.charge(0, 4096) == (2 + 1 + 3) * 4096  # an empty file: no block
        assert small.charge(item, extra=1) == catalog.charge(0, 512) + 512 == (10 + 1 + 3 + 1) * 512
        assert small.charge(item) == (10 + 1 + 3) * 512
        assert large.charge(item, extra=4097) == (6 + 2) * 4096
    small.block = 4096  # as Cache.open sets the block of its filesystem after an item was charged
    assert small.charge(item) == 6 * 4096
    fewer = dataclasses.replace(item, files=item.files[:1], size=5000)  # another item: charged anew
    assert fewer != item and large.charge(fewer) == (2 + 1) * 4096  # its one file and its folder


_SEGMENT = st.sampled_from(["a", "b", "c", "dd", "é"])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), mode=st.sampled_from(["folders", "files"]))
def test_every_item_s_footprint_is_the_catalog_s_charge_of_it_however_it_travels(data, mode):
    """Item.footprint (kept on the frozen item, per block) against Catalog.charge (from the
    columns) and blocks.footprint over the item's own files, for listings of nested names in
    both modes, empty files, several blocks: the same for every item, also for an item that
    crossed a pickle (a DataLoader worker started by spawn) before or after its footprint was
    kept, one made by dataclasses.replace, and its equality and hash are unaffected."""
    from cachepipe.blocks import folders_made, footprint
    from cachepipe.catalog import Catalog
    from cachepipe.stores.base import ObjectInfo

    paths = st.lists(_SEGMENT, min_size=2 if mode == "folders" else 1, max_size=4).map("/".join)
    keys = data.draw(st.lists(paths, min_size=1, max_size=12, unique=True))
    # no key may be both a file and a folder (the listing refuses such an item: unsafe)
    keys = sorted(k for k in keys if not any(other.startswith(k + "/") for other in keys))
    sizes = data.draw(st.lists(st.integers(0, 20000), min_size=len(keys), max_size=len(keys)))
    catalog = Catalog.from_listing([ObjectInfo(k, s) for k, s in zip(keys, sizes, strict=True)], mode=mode)
    blocks = data.draw(st.lists(st.sampled_from([512, 1024, 4096, 65536]), min_size=1, max_size=4))
    for i, item in enumerate(catalog):
        fresh = pickle.loads(pickle.dumps(item))  # noqa: S301 - its own bytes; before any footprint was kept
        for block in blocks:
            files = item.files
            direct = footprint([f.size for f in files], folders_made([f.rel for f in files], item.is_file, item.name), block)
            assert item.footprint(block) == catalog.charge(i, block) == direct
            assert item.footprint(block) == direct  # kept
            travelled = pickle.loads(pickle.dumps(item))  # noqa: S301 - its own bytes, with what it kept
            assert travelled == item and hash(travelled) == hash(item) and travelled.footprint(block) == direct
            assert fresh.footprint(block) == direct
        assert dataclasses.replace(item, size=item.size).footprint(blocks[0]) == catalog.charge(i, blocks[0])
