"""The cap in whole blocks, tried against real small filesystems (tmpfs): what the files and
folders under ``cache_dir`` take never exceeds the capacity, counted as the cache counts them
(the ``Sampler``'s walk: files in whole blocks, a block per folder) and as the disk loses it
(``statvfs``), with items whose shapes the ledger's charge must foresee."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from pathlib import Path

import pytest
from sampling import Sampler
from test_disk_faults import tmpfs
from waiting import wait_until

from cachepipe import ArchiveTooLargeError, Pipeline

KIB = 1024


class DiskLoss:
    """The peak of what the filesystem at ``mount`` lost (``statvfs`` free blocks) since this
    began, sampled every millisecond while it runs."""

    def __init__(self, mount) -> None:
        self.mount = mount
        self.peak = 0
        self._base = self._free()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-disk-loss")

    def _free(self) -> int:
        st = os.statvfs(self.mount)
        return st.f_bfree * st.f_frsize

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._base - self._free())

    def __enter__(self) -> DiskLoss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _put(root, key: str, data: bytes) -> None:
    path = root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def test_nested_single_object_items_are_charged_the_folders_their_names_make(tmp_path):
    # items="files" with keys in folders of their own: publishing d00/e/x.bin makes d00 and
    # d00/e, a block each on the disk (the Sampler's count, and ext4's). They were charged
    # nothing ("shared with other items"), so a cache of such small files held more than twice
    # its capacity: this test's peak was 151552 bytes under 65536 before they were charged.
    src = tmp_path / "src"
    data = {f"d{i:02d}/e/x.bin": bytes([i]) * 100 for i in range(16)}
    data |= {f"shared/y{i}.bin": b"y" * 10 for i in range(4)}  # a folder several items make
    for key, body in data.items():
        _put(src, key, body)
    with tmpfs(tmp_path / "disk", "4m") as disk:
        cache = disk / "cache"
        capacity = 64 * KIB
        got, pause = {}, threading.Event()
        with Pipeline(str(src), cache, capacity, items="files") as pipe, Sampler(cache) as sampler:
            for item in pipe:
                got[item.name] = Path(item).read_bytes()
                pause.wait(0.02)  # a slow consumer: the downloads run ahead, as far as the cap lets them
            stats = pipe.stats()
        assert got == data
        assert stats.bytes_downloaded == sum(map(len, data.values()))  # each once
        assert sampler.peak <= capacity, f"{sampler.peak} bytes under {capacity}"
        assert not [p for p in cache.iterdir() if p.name != ".cachepipe"]  # every folder made was removed


def test_a_reopened_cache_counts_the_folders_of_kept_nested_items_once(tmp_path):
    # The folders above kept single-object items are in those items' charges: the walk of the
    # cache folder at a reopen meets them, and must not count them as foreign files as well
    # (the cache would hold less than its capacity, and drop kept items to fit).
    src = tmp_path / "src"
    data = {f"d{i}/e/x.bin": bytes([i]) * 100 for i in range(4)} | {"top.bin": b"t" * 50}
    for key, body in data.items():
        _put(src, key, body)
    cache = tmp_path / "cache"
    options = {"items": "files", "keep_on_close": True, "auto_ack": False, "resume": True}
    with Pipeline(str(src), cache, "1MiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == len(data))
    (cache / "d0" / "mine.txt").write_bytes(b"m" * 10)  # a file not the cache's, in a folder of its items
    with Pipeline(str(src), cache, "1MiB", **options) as pipe:
        # mine.txt alone: its folder d0 is in d0/e/x.bin's charge
        assert pipe._cache.foreign == pipe._cache.block
        assert {item.name for item in pipe} == set(data)
        stats = pipe.stats()
    assert stats.items_reused == len(data) and stats.bytes_downloaded == 0


def _links_tar(n: int) -> bytes:
    """A tar of a small file and ``n`` symbolic links to it, each with a target of 201 bytes
    (``f/././...``): longer than a filesystem keeps in the inode (ext4: 59 bytes; tmpfs: 127),
    so each takes a block of its own."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("f")
        info.size = 10
        tar.addfile(info, io.BytesIO(b"y" * 10))
        for j in range(n):
            link = tarfile.TarInfo(f"l{j}")
            link.type = tarfile.SYMTYPE
            link.linkname = "f" + "/." * 100
            tar.addfile(link)
    return buf.getvalue()


def test_symbolic_links_an_archive_extracts_are_charged_the_blocks_they_take(tmp_path):
    # Each link of 201 bytes takes a page of the tmpfs (a block on ext4); the extraction's budget
    # and the item's measure counted links as nothing: in this test the disk lost 565248 bytes
    # under the capacity of 204800 before links were charged.
    src = tmp_path / "src"
    for i in range(12):
        _put(src, f"s{i:02d}.tar", _links_tar(20))
    with tmpfs(tmp_path / "disk", "8m") as disk:
        capacity = 200 * KIB
        got, pause = 0, threading.Event()
        with DiskLoss(disk) as loss:
            with Pipeline(str(src), disk / "cache", capacity, items="files", unpack=True, unpack_ratio=2.2) as pipe:
                for path in pipe:
                    assert os.readlink(path / "l19") == "f" + "/." * 100
                    got += 1
                    pause.wait(0.05)  # a slow consumer: the downloads run ahead, as far as the cap lets them
        assert got == 12
        assert loss.peak <= capacity, f"the disk lost {loss.peak} bytes under a capacity of {capacity}"


def test_an_extraction_counts_a_link_too_long_for_its_inode_as_a_block():
    from cachepipe.archive_members import _Budget
    from cachepipe.blocks import LINK_INLINE

    budget = _Budget(3 * 4096, 100, block=4096)  # its own folder: a block, from the start
    budget.add("a.tar", "f", 10)
    budget.add("a.tar", "short", 0, link=LINK_INLINE)  # kept in the inode: nothing
    assert budget.bytes == 2 * 4096
    budget.add("a.tar", "long", 0, link=LINK_INLINE + 1)
    assert budget.bytes == 3 * 4096
    with pytest.raises(ArchiveTooLargeError) as refused:
        budget.add("a.tar", "more", 0, link=201)
    said = "extracting its symbolic link (a target of 201 bytes: a block of 4096 bytes) would bring the item to 16384 bytes"
    assert said in str(refused.value)


@pytest.mark.parametrize("node", [False, True], ids=["pipeline", "node"])
def test_retention_keeps_room_for_downloads_counted_as_the_ledger_counts_them(tmp_path, node):
    # retain="auto" keeps room for the downloads ahead, so that retained items do not shrink the
    # prefetch window to nothing: 2 * large_requests (here 32) of the largest item (a quarter of
    # the cache at most), held against what the pinned items take in the ledger's bytes (their
    # files in whole blocks, their folders). It was reckoned from the largest item's listed
    # size: for items of three 512-byte files (16 KiB on 4 KiB blocks, 1536 bytes listed) it kept
    # 49152 bytes, room for three downloads where it means 32 (in a Pipeline and a NodePipeline).
    from cachepipe.blocks import footprint
    from cachepipe.node import NodePipeline

    src = tmp_path / "src"
    for i in range(8):
        for j in range(3):
            _put(src, f"d{i}/f{j}", bytes([i]) * 512)
    options = {"retain": "auto", "epochs": 2}
    if node:
        pipe = NodePipeline(str(src), tmp_path / "cache", "64MiB", ranks=[0], world_size=1, **options)
    else:
        pipe = Pipeline(str(src), tmp_path / "cache", "64MiB", **options)
    with pipe:
        cache = pipe._cache
        largest = footprint([512] * 3, 1, cache.block)
        assert cache._policy.reserve == min(cache.limit // 4, max(2 * pipe.config.large_requests, 16) * largest)
