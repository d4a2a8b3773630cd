"""The capacity ledger's decisions, without disk or threads."""

from __future__ import annotations

import pytest

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
