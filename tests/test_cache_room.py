"""The note of its size a cache leaves when it closes (cachepipe.cache.room): a share of the
disk measured before the next owner's recovery reads it instead of walking the folder."""

from __future__ import annotations

import os
import shutil

import pytest
from test_disk_faults import immutable, tmpfs
from waiting import wait_until

from cachepipe import Pipeline
from cachepipe.blocks import clamp_block
from cachepipe.cache import tree_bytes
from cachepipe.cache.room import held_in


def _walked(cache) -> int:
    """What a walk of ``cache`` finds its files and folders take from the disk (``st_blocks``)."""
    return tree_bytes(cache, disk=True, block=clamp_block(os.statvfs(cache).f_frsize))


def _keep(s3_source, cache, n: int = 3) -> None:
    options = {"storage_options": s3_source.options, "keep_on_close": True, "auto_ack": False, "resume": True}
    with Pipeline(s3_source.url, cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready >= n)


def test_a_cache_that_closes_notes_what_its_folder_holds_and_the_note_stands_until_the_folder_changes(s3_source, tmp_path):
    data = s3_source.folders(3, {"a": 1000, "b": 2000})
    cache = tmp_path / "c"
    cache.mkdir()
    (cache / "foreign").write_bytes(b"x" * 500)  # not the cache's: counted as held, as a walk counts it
    _keep(s3_source, cache)
    assert (cache / ".cachepipe" / "held").is_file()
    walked = _walked(cache)
    assert held_in(cache) == walked >= 3 * 3000 + 500
    # what the note stands for: a change deep in an item, which neither the journal nor the
    # folder's change time shows, is not seen (a folder is measured so only when it is a cache's)
    (cache / min(data) / "a").write_bytes(b"x" * 9000)  # of 1000 bytes: in more blocks
    grown = _walked(cache)
    assert held_in(cache) == walked < grown
    # a file added at the top of the folder changes its change time: walked again
    (cache / "more").write_bytes(b"x" * 7)
    assert held_in(cache) == _walked(cache) > grown


def test_the_note_is_not_trusted_once_the_journal_changes_or_when_it_cannot_be_read(s3_source, tmp_path):
    s3_source.folders(3, {"a": 1000})
    cache = tmp_path / "c"
    _keep(s3_source, cache)
    note = cache / ".cachepipe" / "held"
    walked = _walked(cache)
    held, _, marks = note.read_text().partition(" ")
    note.write_text(f"{int(held) + 1} {marks}")  # a note that lies, while its marks hold: trusted
    assert held_in(cache) == walked + 1
    with open(cache / ".cachepipe" / "journal", "a") as journal:  # an owner of an older version, say
        journal.write("")
        os.utime(journal.fileno())
    assert held_in(cache) == _walked(cache) == walked
    note.write_text("garbage\n")
    assert held_in(cache) == _walked(cache)
    note.unlink()
    assert held_in(cache) == _walked(cache)


def test_an_open_cache_has_no_note_to_trust_and_notes_again_when_it_closes(s3_source, tmp_path):
    # The next owner rewrites the journal when its recovery ends: from then on it is walked,
    # so a killed owner's folder is never measured by a note older than its downloads.
    data = s3_source.folders(4, {"a": 1000})
    cache = tmp_path / "c"
    _keep(s3_source, cache, 2)
    options = {"storage_options": s3_source.options, "keep_on_close": True, "auto_ack": False, "resume": True}
    with Pipeline(s3_source.url, cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 4)
        (cache / "foreign").write_bytes(b"x" * 300)  # changes the folder; the journal was rewritten anyway
        assert held_in(cache) == _walked(cache)
        (cache / min(data) / "deep").write_bytes(b"x" * 11)
        assert held_in(cache) == _walked(cache)
    # noted at its close, walked then: a consumer's file left in an item too (the next owner's
    # recovery finds that item changed and deletes it: what it frees)
    assert held_in(cache) == _walked(cache)


def test_a_kept_item_deleted_before_the_close_is_not_noted_as_held(s3_source, tmp_path):
    # Deleted by its consumer instead of acknowledged (or after the daemon stopped watching): still
    # published at the close, it was noted at its listed size, and the note, taken after the folder
    # changed, was trusted: a share of the disk counted its bytes as held and as free both.
    data = s3_source.folders(3, {"a": 1000})
    cache = tmp_path / "c"
    options = {"storage_options": s3_source.options, "keep_on_close": True, "auto_ack": False, "resume": True}
    with Pipeline(s3_source.url, cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready >= 3)
        shutil.rmtree(cache / min(data))
    assert (cache / ".cachepipe" / "held").is_file()
    assert held_in(cache) == _walked(cache)


def test_an_owner_that_changed_the_folder_without_rewriting_the_journal_leaves_no_note_to_trust(s3_source, tmp_path):
    # Recovery deletes stale items before it rewrites the journal: an owner stopped in between (a
    # rewrite that fails here; a kill) changed the folder, below its top for nested single-file
    # items, while the journal and the folder's change time stayed as the note says.
    for i in range(3):
        s3_source.put(f"d/x{i}.bin", bytes([i]) * 1000)
    cache = tmp_path / "c"
    options = {"storage_options": s3_source.options, "keep_on_close": True, "auto_ack": False, "items": "files"}
    with Pipeline(s3_source.url, cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready >= 3)
    assert held_in(cache) == _walked(cache)
    s3_source.put("d/x0.bin", b"z" * 1000)  # rewritten at the same size: the kept copy is stale
    (cache / ".cachepipe" / ".journal.tmp").mkdir()  # where the journal's rewrite writes: it fails
    with pytest.raises(IsADirectoryError):
        Pipeline(s3_source.url, cache, "1MiB", **options).open()
    assert not (cache / "d" / "x0.bin").exists()  # deleted as stale
    assert held_in(cache) == _walked(cache)


def test_staging_a_close_could_not_remove_is_not_noted_as_held(s3_source, tmp_path):
    # The next open removes it before it measures the folder: noted, it was counted as held
    # there and as free both.
    s3_source.folders(2, {"a": 1000})
    cache = tmp_path / "c"
    stuck = cache / ".cachepipe" / "staging" / "stuck"
    options = {"storage_options": s3_source.options, "keep_on_close": True, "auto_ack": False}
    with Pipeline(s3_source.url, cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready >= 2)
        stuck.mkdir()
        with immutable(stuck / "part", list, b"x" * 5000):
            pipe.close()
    assert (cache / ".cachepipe" / "held").is_file() and stuck.is_dir()
    shutil.rmtree(cache / ".cachepipe" / "staging")  # what the next open does first
    assert held_in(cache) == _walked(cache)


def test_what_a_closed_cache_is_noted_to_hold_is_what_deleting_it_frees(s3_source, tmp_path):
    """The note held each kept item at its charge in the ledger, a block for each of its folders:
    on tmpfs, where a folder takes no page, a cache of folder items was noted larger than it was,
    and a share of the disk measured on reopen counted room that was not there. The note and the
    walk measure what the files and folders take now: what deleting them frees, to the byte."""
    s3_source.folders(4, {"a": 100, "d/e/b": 5000})
    with tmpfs(tmp_path / "disk", "4m") as disk:
        cache = disk / "c"
        _keep(s3_source, cache, 4)
        assert (cache / ".cachepipe" / "held").is_file()
        noted, walked = held_in(cache), tree_bytes(cache, disk=True, block=4096)
        st = os.statvfs(disk)
        before = st.f_bfree * st.f_frsize
        for entry in os.scandir(cache):
            (shutil.rmtree if entry.is_dir(follow_symlinks=False) else os.unlink)(entry.path)
        st = os.statvfs(disk)
        assert noted == walked == st.f_bfree * st.f_frsize - before
