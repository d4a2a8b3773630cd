"""Pipeline(unpack=True): archives extracted before hand-out, against the moto server.

Formats, checksums and every unsafe member are covered without network in test_unpack.py; here:
what a consumer receives, how a refused archive fails its item only, and the cap during
extraction.
"""

from __future__ import annotations

import math
import os
import random
import threading

import pytest
from sampling import Sampler, block_of, charge
from test_unpack import archive_bytes, link, md5_sidecar, media_clip, read_tree, tar_bytes, volumes, zip_bytes

from cachepipe import (
    ArchiveError,
    ArchiveTooLargeError,
    ChecksumError,
    ItemFailedError,
    Pipeline,
    PipelineConfig,
    UnsafeMemberError,
)
from cachepipe.config import UNPACK_RATIO

rng = random.Random(8)
CLIPS = {"clips/a.mp4": rng.randbytes(3000), "clips/b.mp4": rng.randbytes(2000), "meta.json": b'{"fps": 30}'}
TEXT = b"a person folds a towel"


SMALL_MEMBERS_RATIO = 8.0
"""The unpack_ratio of these tests' archives: their members are a few KB, which in whole blocks
(4 KiB, and a block per folder, as the cache counts them) take several times the archive's
size. The default (1.25) is for members far larger than a block, as its own tests check
(test_archives_of_video_clips_pass_with_the_default_reserve)."""


def reserved(tmp_path, file_sizes: list[int], archive: int, folders: int = 1) -> int:
    """What the cache reserves for an item of ``file_sizes`` (``folders``: its own) whose archive
    is ``archive`` bytes, with :data:`SMALL_MEMBERS_RATIO`: its files in whole blocks and its
    folders, the ratio's reserve in whole blocks, and the extraction's own folder."""
    block = block_of(tmp_path)
    return charge(tmp_path, file_sizes, folders) + -(-math.ceil(SMALL_MEMBERS_RATIO * archive) // block) * block + block


def unpacking(source, cache, capacity, **options) -> Pipeline:
    options.setdefault("unpack_ratio", SMALL_MEMBERS_RATIO)
    return Pipeline(source.url, cache, capacity, storage_options=source.options, unpack=True, **options)


def drain(pipe: Pipeline) -> tuple[dict[str, dict[str, bytes]], dict[str, BaseException]]:
    """Every item's delivered files by item name, and every failed item's cause (``on_error="raise"``
    raises each failure from ``get``; the next ``get`` goes on with the following item)."""
    delivered, failed = {}, {}
    while True:
        try:
            item = pipe.get(timeout=60)  # a guard against a hang, not a timing assertion
        except ItemFailedError as exc:
            failed[exc.item] = exc.__cause__
            continue
        if item is None:
            return delivered, failed
        delivered[item.name] = read_tree(item.path)
        pipe.ack(item)


def sizes(tree: dict[str, dict[str, bytes]]) -> dict[str, dict[str, int]]:
    return {name: {rel: len(data) for rel, data in files.items()} for name, files in tree.items()}


def leftovers(cache) -> list[str]:
    """Everything under the cache directory but its state folder, and everything in staging but
    the acknowledged items that the reaper is deleting (``staging/xN``)."""
    staging = cache / ".cachepipe" / "staging"
    staged = [p for p in staging.iterdir() if not p.name.startswith("x")] if staging.exists() else []
    tops = [p for p in cache.iterdir() if p.name != ".cachepipe"] + staged
    return sorted(p.relative_to(cache).as_posix() for top in tops for p in [top, *top.rglob("*")])


def test_folders_arrive_extracted_with_their_other_files_and_the_cap_holds(remote_source, tmp_path):
    for i in range(4):
        remote_source.put(f"clip{i}/video.tar.gz", tar_bytes(CLIPS, "w:gz"))
        remote_source.put(f"clip{i}/text.txt", TEXT)
    expected = {f"clip{i}": {**CLIPS, "text.txt": TEXT} for i in range(4)}
    packed = len(tar_bytes(CLIPS, "w:gz"))
    # room for the state (its folders, lock, journal and budget) and two items at a time, in whole blocks
    cache, capacity = tmp_path / "c", 8 * block_of(tmp_path) + 2 * reserved(tmp_path, [packed, len(TEXT)], packed)
    with Sampler(cache, expected=sizes(expected), block=block_of(tmp_path)) as sampler:
        with unpacking(remote_source, cache, capacity) as pipe:
            delivered, failed = drain(pipe)
    assert delivered == expected and not failed  # the archive is gone, text.txt is kept
    assert sampler.peak <= capacity and not sampler.partial
    assert not cache.joinpath(".cachepipe", "staging").exists()


def _count_files(path) -> None:
    assert not list(path.glob("*.tar.gz*")), "prepare runs on the extracted item"
    (path / "n_files").write_text(str(sum(1 for p in path.rglob("*") if p.is_file())))


def test_split_volumes_with_md5_sidecars_arrive_extracted_then_prepared(s3_source, tmp_path):
    names = [f"x.tar.gz-{i:02d}" for i in range(3)]
    for item in ("a", "b"):
        for name, part in volumes(tar_bytes(CLIPS, "w:gz"), names).items():
            s3_source.put(f"{item}/{name}", part)
            s3_source.put(f"{item}/{name}.md5", md5_sidecar(name, part).encode())
    with unpacking(s3_source, tmp_path / "c", "1MiB", prepare=_count_files, prepare_ratio=1.2) as pipe:
        delivered, failed = drain(pipe)
    assert delivered == {item: {**CLIPS, "n_files": b"3"} for item in ("a", "b")} and not failed


@pytest.mark.parametrize("on_error", ["skip", "raise"])
def test_a_volume_that_does_not_match_its_md5_fails_its_item_only(s3_source, tmp_path, on_error):
    names = [f"x.tar.gz-{i:02d}" for i in range(3)]
    for item in ("a", "b", "c"):
        for name, part in volumes(tar_bytes(CLIPS, "w:gz"), names).items():
            s3_source.put(f"{item}/{name}.md5", md5_sidecar(name, part).encode())
            damaged = item == "b" and name == names[1]  # at the source
            s3_source.put(f"{item}/{name}", part[:50] + bytes([part[50] ^ 1]) + part[51:] if damaged else part)
    cache = tmp_path / "c"
    with Sampler(cache, expected={"b": {}}) as sampler:  # a file of "b" seen outside staging would be a published part
        with unpacking(s3_source, cache, "1MiB", on_error=on_error) as pipe:
            delivered, failed = drain(pipe)
            stats = pipe.stats()
    assert sorted(delivered) == ["a", "c"] and not sampler.partial
    if on_error == "skip":
        assert not failed and stats.items_failed == 1 and stats.items_skipped == 1
    else:
        assert isinstance(failed["b"], ChecksumError) and "'x.tar.gz-01' has MD5" in str(failed["b"])


def test_tar_and_zip_shards_arrive_as_folders_named_like_the_archive(s3_source, tmp_path):
    s3_source.put("shards/000.tar", tar_bytes(CLIPS))
    s3_source.put("shards/001.zip", zip_bytes(list(CLIPS.items())))
    s3_source.put("shards/002.tgz", tar_bytes({"x.txt": TEXT}, "w:gz"))
    cache = tmp_path / "c"
    with unpacking(s3_source, cache, "1MiB", items="files") as pipe:
        seen = {}
        for got in pipe:
            assert got.path.is_dir() and got.path.parent == cache / "shards"
            seen[got.path.name] = read_tree(got.path)
    assert seen == {"000.tar": CLIPS, "001.zip": CLIPS, "002.tgz": {"x.txt": TEXT}}


def test_unsafe_members_fail_their_item_by_name_and_nothing_is_written_outside(s3_source, tmp_path):
    s3_source.put("slip.zip", zip_bytes([("ok.txt", b"fine"), ("../../evil", b"x")]))
    s3_source.put("dotdot.tar", tar_bytes({"ok.txt": b"fine", "a/../../evil": b"x"}))
    s3_source.put("escape.tar", tar_bytes({"ok.txt": b"fine"}, "w", [link("d/l", "../../evil")]))
    s3_source.put("good.tar", tar_bytes(CLIPS))
    cache = tmp_path / "deep" / "c"
    with unpacking(s3_source, cache, "1MiB", items="files") as pipe:
        delivered, failed = drain(pipe)
        assert leftovers(cache) == []  # nothing of the failed items, not even their safe members
    assert list(delivered) == ["good.tar"]
    assert {name: (type(exc), exc.member) for name, exc in failed.items()} == {
        "slip.zip": (UnsafeMemberError, "../../evil"),
        "dotdot.tar": (UnsafeMemberError, "a/../../evil"),
        "escape.tar": (UnsafeMemberError, "d/l"),
    }
    assert "outside the item" in str(failed["escape.tar"])
    assert not list(tmp_path.rglob("*evil*"))


def test_members_that_cannot_be_written_fail_their_item_by_name_not_by_staging_path(s3_source, tmp_path):
    s3_source.put("clash/x.tar", tar_bytes({"a": b"1", "a/b": b"2"}))  # 'a' a file, then a folder
    s3_source.put("long/x.zip", zip_bytes([("d/" + "n" * 300, b"x")]))  # a name over NAME_MAX
    s3_source.put("good/x.tar", tar_bytes(CLIPS))
    cache = tmp_path / "c"
    with unpacking(s3_source, cache, "1MiB") as pipe:
        delivered, failed = drain(pipe)
        assert leftovers(cache) == []
    assert list(delivered) == ["good"] and all(isinstance(exc, ArchiveError) for exc in failed.values())
    assert str(failed["clash"]).startswith("archive 'x.tar' of item 'clash': member 'a/b' needs a folder 'a'"), str(failed)
    assert str(failed["long"]).startswith("archive 'x.zip' of item 'long': member 'd/nnn"), str(failed)
    assert f"a name may be at most {os.pathconf(tmp_path, 'PC_NAME_MAX')} bytes" in str(failed["long"])
    assert not [exc for exc in failed.values() if ".cachepipe" in str(exc) or str(tmp_path) in str(exc)]


def test_a_tar_bomb_fails_before_its_member_is_written_and_the_cap_holds(s3_source, tmp_path):
    bomb = tar_bytes({"small.txt": TEXT, "zeros.bin": bytes(2_000_000)}, "w:gz")
    assert len(bomb) < 5000
    for i in range(6):
        s3_source.put(f"item{i}/video.tar.gz", bomb if i == 2 else tar_bytes(CLIPS, "w:gz"))
    packed = len(tar_bytes(CLIPS, "w:gz"))
    cache, capacity = tmp_path / "c", 8 * block_of(tmp_path) + 2 * reserved(tmp_path, [packed], packed)  # two items at a time
    with Sampler(cache, block=block_of(tmp_path)) as sampler:
        with unpacking(s3_source, cache, capacity) as pipe:
            delivered, failed = drain(pipe)
    assert sorted(delivered) == [f"item{i}" for i in range(6) if i != 2]
    error = failed["item2"]
    assert isinstance(error, ArchiveTooLargeError) and error.member == "zeros.bin" and "over the limit" in str(error)
    assert sampler.peak <= capacity and sampler.samples > 0


def test_an_archive_of_small_members_is_refused_at_its_reserve_in_whole_blocks(s3_source, tmp_path):
    """The extraction counted its members' bytes against the reserve, the item was then measured
    in whole blocks: an archive of many small files extracted under its reserve, took several
    times it on the disk (past the capacity it was reserved under), and failed after with
    PrepareOverflowError. Each member is counted in whole blocks, each folder at one: the
    member that passes the reserve is refused before it is written."""
    block = block_of(tmp_path)
    members = {f"labels/{i:02d}.txt": rng.randbytes(100) for i in range(32)}  # 3,200 bytes
    packed = tar_bytes(members, "w:gz")
    s3_source.put("many/labels.tar.gz", packed)
    s3_source.put("one/clip.tar.gz", tar_bytes({"clip.mp4": rng.randbytes(3000)}, "w:gz"))
    ratio = 2.0
    assert ratio * len(packed) > 3200  # room for the members' bytes, not their blocks
    cache = tmp_path / "c"
    with Sampler(cache, block=block) as sampler:
        with unpacking(s3_source, cache, "1MiB", unpack_ratio=ratio) as pipe:
            delivered, failed = drain(pipe)
    assert list(delivered) == ["one"]
    error = failed["many"]
    assert isinstance(error, ArchiveTooLargeError), repr(error)
    assert f"in whole blocks of {block} bytes" in str(error) and "raise unpack_ratio" in str(error)
    assert f"more where its files are small: each takes whole blocks of {block} bytes" in str(error)  # not "compressed"
    reserve = -(-math.ceil(ratio * len(packed)) // block) * block + block  # and the extraction's own folder
    assert f"over the limit of {reserve} bytes" in str(error)
    assert sampler.samples > 0


def test_an_item_with_no_archive_fails_clearly(s3_source, tmp_path):
    s3_source.put("plain/text.txt", TEXT)
    s3_source.put("packed/video.tar", tar_bytes(CLIPS))
    with unpacking(s3_source, tmp_path / "c", "1MiB") as pipe:
        delivered, failed = drain(pipe)
    assert list(delivered) == ["packed"]
    assert isinstance(failed["plain"], ArchiveError) and str(failed["plain"]).startswith("item 'plain': no archive found")
    assert "text.txt" in str(failed["plain"])


def test_a_split_volume_as_a_files_item_fails_before_it_is_downloaded(s3_source, tmp_path):
    for name, part in volumes(tar_bytes(CLIPS), ["x.tar-00", "x.tar-01"]).items():
        s3_source.put(f"volumes/{name}", part)
    s3_source.put("notes.txt", TEXT)
    good = tar_bytes(CLIPS)
    s3_source.put("shard.tar", good)
    with unpacking(s3_source, tmp_path / "c", "1MiB", items="files") as pipe:
        delivered, failed = drain(pipe)
        downloaded = pipe.stats().bytes_downloaded
    assert list(delivered) == ["shard.tar"]
    assert set(failed) == {"volumes/x.tar-00", "volumes/x.tar-01", "notes.txt"}
    assert "items='folders'" in str(failed["volumes/x.tar-00"]) and isinstance(failed["volumes/x.tar-01"], ArchiveError)
    assert "notes.txt: not a recognised archive" in str(failed["notes.txt"])
    assert downloaded == len(good) + len(TEXT)  # the volumes were refused before their download


def test_an_item_over_half_the_capacity_gets_what_room_is_left_for_its_extraction(s3_source, tmp_path):
    big = os.urandom(9000)
    s3_source.put("one/big.bin", big)
    s3_source.put("one/text.tar.gz", tar_bytes({"text.txt": TEXT}, "w:gz"))
    # item size + its default reserve (ratio 1.25) is more than the capacity: the
    # reserve is cut to what the capacity leaves, instead of waiting forever for the space
    # (the state: up to 6 blocks; the extraction: its folder and text.txt, 2 blocks)
    block = block_of(tmp_path)
    capacity = charge(tmp_path, [9000, len(tar_bytes({"text.txt": TEXT}, "w:gz"))], 1) + 9 * block
    with unpacking(s3_source, tmp_path / "c", capacity, unpack_ratio=UNPACK_RATIO) as pipe:
        delivered, failed = drain(pipe)
    assert delivered == {"one": {"text.txt": TEXT, "big.bin": big}} and not failed


@pytest.mark.parametrize("fmt", ["tar.gz", "tar.zst", "zip"])
def test_archives_of_video_clips_pass_with_the_default_reserve(s3_source, tmp_path, fmt):
    # issue #16: clips barely compress, but their files still come out 1-2% larger than the
    # archive; a reserve of exactly the archive's size refused most of them
    clips = {f"clip{i}": {f"clips/{n}.mp4": media_clip(rng, 20_000 + 3000 * n) for n in range(3)} for i in range(4)}
    for item, files in clips.items():
        s3_source.put(f"{item}/clips.{fmt}", archive_bytes(files, fmt))
    cache, capacity = tmp_path / "c", 256 * 1024
    with Sampler(cache, expected=sizes(clips), block=block_of(tmp_path)) as sampler:
        with unpacking(s3_source, cache, capacity, unpack_ratio=UNPACK_RATIO) as pipe:
            delivered, failed = drain(pipe)
    assert not failed and delivered == clips
    assert sampler.peak <= capacity and not sampler.partial


def test_an_archive_that_outgrows_its_reserve_names_the_option_and_the_size(s3_source, tmp_path):
    text = b"a person folds a towel\n" * 2000
    packed = tar_bytes({"captions.txt": text}, "w:gz")
    s3_source.put("captions/all.tar.gz", packed)
    with unpacking(s3_source, tmp_path / "c", "1MiB", unpack_ratio=UNPACK_RATIO) as pipe:
        delivered, failed = drain(pipe)
    error = failed["captions"]
    assert not delivered and isinstance(error, ArchiveTooLargeError) and error.member == "captions.txt"
    reserve = math.ceil(1.25 * len(packed))
    block = block_of(tmp_path)
    taken = block + -(-len(text) // block) * block  # its file in whole blocks, and the extraction's folder
    assert f"extracting its {len(text)} bytes" in str(error) and f"would bring the item to {taken} bytes" in str(error)
    assert f"unpack_ratio 1.25 reserves {reserve} bytes for this item of {len(packed)} bytes: raise unpack_ratio" in str(error)
    with unpacking(s3_source, tmp_path / "c2", "1MiB", unpack_ratio=len(text) / len(packed) + 0.1) as pipe:  # as advised
        delivered, failed = drain(pipe)
    assert delivered == {"captions": {"captions.txt": text}} and not failed
    capacity = 10 * block + charge(tmp_path, [len(packed)], 1)  # the state, the item, and a few blocks
    with unpacking(s3_source, tmp_path / "c3", capacity, unpack_ratio=100) as pipe:  # the capacity cuts the reserve
        delivered, failed = drain(pipe)
    asked = -(-100 * len(packed) // block) * block + block  # in whole blocks, with the extraction's folder
    said = str(failed["captions"])
    assert "the capacity leaves only" in said and f"(unpack_ratio 100 asks for {asked}): raise capacity" in said


def test_a_truncated_archive_fails_as_truncated_not_as_outgrowing_its_reserve(s3_source, tmp_path):
    packed = tar_bytes({"captions.txt": b"a person folds a towel\n" * 2000}, "w:gz")
    s3_source.put("captions/all.tar.gz", packed[: len(packed) // 2])  # an upload cut short
    s3_source.put("clips/video.tar.gz", tar_bytes(CLIPS, "w:gz"))
    with unpacking(s3_source, tmp_path / "c", "1MiB") as pipe:
        delivered, failed = drain(pipe)
    assert list(delivered) == ["clips"]
    error = failed["captions"]
    assert isinstance(error, ArchiveError) and not isinstance(error, ArchiveTooLargeError)
    assert str(error).startswith("archive 'all.tar.gz' of item 'captions' is truncated or corrupt: "), str(error)
    assert "unpack_ratio" not in str(error)


def test_config_default_reserve_and_what_unpack_is_not_combined_with(tmp_path):
    base = {"source": "s3://b/p/", "cache_dir": tmp_path, "capacity": "1GiB"}
    cfg = PipelineConfig(**base, unpack=True)
    assert cfg.prepare_extra(1000) == 1250  # unpack_ratio 1.25 by default
    assert cfg.model_dump()["prepare_ratio"] == 0.0 and cfg.model_dump()["unpack"] is True  # the fields are as given
    assert PipelineConfig(**base, unpack=True, unpack_ratio=3).prepare_extra(1000) == 3000
    assert PipelineConfig(**base, unpack=True, prepare_ratio=3).prepare_extra(1000) == 1250 + 3000  # prepare's room comes on top
    assert PipelineConfig(**base, unpack=True, prepare_reserve="4KiB").prepare_extra(1000) == 1250 + 4096
    assert PipelineConfig(**base).prepare_extra(1000) == 0 and PipelineConfig(**base).unpack is False
    assert PipelineConfig(**base, prepare=print, prepare_ratio=0.5).prepare_extra(1000) == 500
    with pytest.raises(ValueError, match="unpack with retain='auto' is not supported yet: use retain='none'"):
        PipelineConfig(**base, unpack=True, retain="auto")


def test_close_during_an_extraction_stops_it_and_runs_nothing_after_it(s3_source, tmp_path):
    # A profile hook holds the extraction in the file creation of its second member until the
    # extraction's stop flag is set (close() sets it, then waits for the extraction's thread): the
    # close comes while the extraction is under way, whatever the machine's speed.
    s3_source.put("a/many.tar.gz", tar_bytes({f"m/{i:05d}": b"x" for i in range(1500)}, "w:gz"))
    cache, prepared = tmp_path / "c", []
    held, stops, created = threading.Event(), [], []

    def hook(frame, event: str, arg: object) -> None:
        if event != "c_call" or getattr(arg, "__name__", None) != "open" or frame.f_code.co_name != "makefile":
            return  # only tarfile creating a member's file
        created.append(frame.f_locals["targetpath"])
        if len(created) == 2:
            caller = frame
            while caller.f_code.co_name != "_tar_member":
                caller = caller.f_back
            stop = caller.f_locals["self"].stop  # the flag the extraction checks before each member
            stops.append(stop.is_set())
            held.set()
            stops.append(stop.wait(30))  # bounded: a close that never sets it fails the test, not hangs it

    threading.setprofile(hook)  # each thread the pipeline starts from now on (the extraction's, when it starts)
    try:
        pipe = unpacking(s3_source, cache, "16MiB", prepare=prepared.append, prepare_ratio=20)
        pipe.open()
        staging = cache / ".cachepipe" / "staging"
        try:
            assert held.wait(60), "the extraction did not reach its second member"  # a guard against a hang
            assert [p for p in staging.iterdir() if p.name.endswith(".unpacked") and any(p.rglob("*"))]  # under way
        finally:
            pipe.close()
    finally:
        threading.setprofile(None)
    assert stops == [False, True]  # held until close() set the stop flag, then let go
    assert len(created) == 2  # the extraction stopped at the next member
    assert prepared == []  # and the hook was not run on its result
    assert not staging.exists() and leftovers(cache) == []
