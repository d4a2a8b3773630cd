"""Disk faults on a small real filesystem (tmpfs) shared with another "tenant"."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import subprocess
import sys
import threading

import pytest
from mounts import mounted
from sampling import Sampler, block_of, charge
from waiting import wait_until

from cachepipe import OversizeError, Pipeline
from cachepipe.cache.lock import unusable_dir
from cachepipe.service.config import ServiceConfig
from cachepipe.service.preflight import host_problems

KIB = 1024


def tmpfs(path, size: str, options: str = ""):
    return mounted(path, ["mount", "-t", "tmpfs", "-o", f"size={size}{options}", "tmpfs", str(path)])


@pytest.mark.parametrize("download_processes", [0, 2], ids=["threads", "worker-processes"])
def test_enospc_frees_staging_backs_off_and_recovers(s3_source, tmp_path, download_processes):
    data = s3_source.folders(8, {"f": 40 * KIB})
    with tmpfs(tmp_path / "disk", "256k") as disk:
        tenant = disk / "other-tenant.bin"
        tenant.write_bytes(b"t" * (220 * KIB))  # the shared disk is nearly full
        got = {}
        # the capacity fits the disk, but another tenant has taken most of it for now
        with Pipeline(
            s3_source.url,
            disk / "cache",
            "200KiB",
            storage_options=s3_source.options,
            retry_backoff=0.05,
            retry_backoff_max=0.2,
            retries=100,
            download_processes=download_processes,  # a worker's failed write counts as the disk's, not the store's
        ) as pipe:
            wait_until(lambda: pipe.stats().disk_errors >= 2)
            assert pipe.stats().items_ready == 0  # nothing partial was published
            staging = disk / "cache" / ".cachepipe" / "staging"
            tenant.unlink()  # the other tenant frees space: downloads resume by themselves
            for path in pipe:
                got[path.name] = (path / "f").read_bytes()
            stats = pipe.stats()
            # no download left behind; "xN" are acknowledged items that the reaper is deleting
            assert [p.name for p in staging.iterdir() if not p.name.startswith("x")] == []
        assert got == {n: files["f"] for n, files in data.items()}
        assert stats.disk_errors >= 2 and stats.items_failed == 0


def test_min_free_pauses_until_space_returns(s3_source, tmp_path):
    data = s3_source.folders(4, {"f": 20 * KIB})
    with tmpfs(tmp_path / "disk", "1m") as disk:
        tenant = disk / "other-tenant.bin"
        tenant.write_bytes(b"t" * (700 * KIB))
        with Pipeline(s3_source.url, disk / "cache", "512KiB", storage_options=s3_source.options, min_free="300KiB") as pipe:
            wait_until(lambda: pipe.stats().disk_pauses == 1)
            assert pipe.stats().requests == 0
            tenant.unlink()
            names = [p.name for p in pipe]
        assert names == sorted(data)


def test_capacity_beyond_the_disk_is_warned_about(s3_source, tmp_path, caplog):
    s3_source.folders(1, {"f": 10})
    with tmpfs(tmp_path / "disk", "256k") as disk:
        (disk / "other.bin").write_bytes(b"x" * 128 * KIB)
        with Pipeline(s3_source.url, disk / "cache", "200KiB", storage_options=s3_source.options) as pipe:
            list(pipe)
    assert "exceeds the space available" in caplog.text


def test_an_item_larger_than_the_filesystem_is_refused_at_once(s3_source, tmp_path, caplog):
    """A capacity beyond the filesystem's size let an item larger than the whole filesystem be
    downloaded, meet a full disk and be retried for about a minute before it failed. The
    capacity is now held to the filesystem (to the room there, the test below): such an item is
    oversize, refused at open."""
    s3_source.folders(1, {"f": 300 * KIB})
    with tmpfs(tmp_path / "disk", "256k") as disk:
        pipe = Pipeline(s3_source.url, disk / "cache", "1MiB", storage_options=s3_source.options)
        with pytest.raises(OversizeError, match=r"item000.* larger than the cache capacity of \d+ bytes"):
            pipe.open()
    assert "exceeds the size of the filesystem" in caplog.text


def test_a_capacity_beyond_the_filesystem_is_held_to_the_room_beside_what_else_lives_there(s3_source, tmp_path, caplog):
    """A capacity beyond the filesystem's size was held to that size, though another tenant's
    files (or a filesystem's blocks kept for root) take part of it for good: the cap could be
    reached only by filling the disk, and an item larger than the room left was downloaded into
    a full disk and retried. It is now held to the room there, the space free and what the cache
    holds, said in a warning naming both figures: such an item is oversize, refused at open."""
    s3_source.folders(1, {"f": 156 * KIB})  # fits the filesystem's size, not the room beside the tenant's file
    with tmpfs(tmp_path / "disk", "256k") as disk:
        (disk / "other.bin").write_bytes(b"x" * 96 * KIB)  # another tenant's, for good
        pipe = Pipeline(s3_source.url, disk / "cache", "1MiB", storage_options=s3_source.options)
        with caplog.at_level(logging.WARNING, logger="cachepipe"), pytest.raises(OversizeError) as err:
            pipe.open()  # before: opened, and the download met a full disk
    said = re.search(r"held to the room there, (\d+) bytes: (\d+) bytes free and (\d+) bytes that it holds", caplog.text)
    assert said is not None, caplog.text  # before: "the cache holds at most that" (the filesystem's 262144 bytes)
    room, free, held = (int(x) for x in said.groups())
    assert room == free + held <= 256 * KIB - 96 * KIB
    assert f"larger than the cache capacity of {room} bytes" in str(err.value)


@contextlib.contextmanager
def immutable(path, moved_to, content=None):
    """``chattr +i``: not even root may unlink the file (a filesystem fault, not a patch).
    ``moved_to()``: where the file may be by the end, to make it mutable again. ``content``: the
    bytes the file holds once immutable, written first; a download retrying into it may truncate
    it (its open has O_TRUNC) until it is immutable, so it is written again until it holds them."""
    while True:
        if content is not None:
            path.write_bytes(content)
        if subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False).returncode != 0:
            pytest.skip(f"chattr +i is not supported on the filesystem of {path}")
        if content is None or path.stat().st_size == len(content):
            break
        subprocess.run(["chattr", "-i", str(path)], capture_output=True, check=False)
    try:
        yield
    finally:
        for found in [path, *moved_to()]:
            subprocess.run(["chattr", "-i", str(found)], capture_output=True, check=False)


def test_an_item_that_cannot_be_deleted_stays_counted_and_the_rest_flows(s3_source, tmp_path, caplog):

    size = 1024 * KIB  # reaped after an ack (cache.REAP_MIN_BYTES); smaller items are deleted in place
    data = s3_source.folders(6, {"f": size})
    cache = tmp_path / "cache"
    # three items and the state (its folders, lock, journal and budget), in whole blocks
    capacity = 3 * charge(tmp_path, [size], 1) + 8 * block_of(tmp_path)
    got = []
    with (
        Sampler(cache, block=block_of(tmp_path)) as sampler,
        Pipeline(s3_source.url, cache, capacity, storage_options=s3_source.options, auto_ack=False) as pipe,
    ):
        first = pipe.get(timeout=30)
        with immutable(first.path / "f", lambda: (cache / ".cachepipe" / "staging").glob("x*/f")):
            pipe.ack(first)  # moved aside at once; the reaper's unlink then fails
            assert not os.path.lexists(first.path)
            wait_until(lambda: "could not delete" in caplog.text)
            while (item := pipe.get(timeout=30)) is not None:
                # hold it until the producer has filled what it believes is free: the item it
                # could not delete must still count, or a third item would pass the cap
                wait_until(lambda: (s := pipe.stats()).items_ready >= 1 or s.items_handed + s.items_ready == 6)
                seen = sampler.samples
                wait_until(lambda: sampler.samples >= seen + 3)  # noqa: B023 - the lambda is called at once, inside this iteration
                got.append(item.name)
                pipe.ack(item)
    assert got == sorted(data)[1:]
    assert f"{size + block_of(tmp_path)} bytes left" in caplog.text  # its file and its folder, as charged
    assert sampler.peak <= capacity, f"cache reached {sampler.peak} bytes, capacity {capacity}"
    assert not any(p for p in cache.rglob("*") if p.is_file() and ".cachepipe" not in p.parts)


def _staging_that_cannot_be_deleted(s3_source, fault_proxy, tmp_path, caplog, check):
    """item000..002 of 1 MiB and item003 of 10 KiB; a cache for two of the big ones, one download
    thread. item002's GETs are throttled while it waits in staging; its staging file is then made
    immutable: it can be neither written (EPERM: item002 fails) nor deleted. ``check(pipe)`` runs
    once item001 is acknowledged too."""
    from conftest import via

    proxy, endpoint = fault_proxy
    s3_source.folders(3, {"f": 1024 * KIB})
    s3_source.put("item003/f", b"x" * (10 * KIB))
    staging = tmp_path / "c" / ".cachepipe" / "staging"
    options = {"max_concurrency": 1, "ordered": False, "auto_ack": False, "on_error": "skip", "retries": 1000}
    options |= {"retry_backoff": 0.05, "retry_backoff_max": 0.1, "storage_options": via(s3_source, endpoint)}
    with Pipeline(s3_source.url, tmp_path / "c", "2200KiB", **options) as pipe:
        wait_until(lambda: pipe.stats().items_ready == 2)  # item000 and item001; item002 waits for room
        first = pipe.get(timeout=30)
        proxy.inject("503", 10**9)  # item002's GETs are throttled: it stays in staging, retrying
        pipe.ack(first)
        wait_until(lambda: any(staging.glob("[0-9]*/f")))
        stuck = next(staging.glob("[0-9]*/f"))
        with immutable(stuck, list, content=b"p" * (512 * KIB)):  # as if a part had been written
            proxy.clear()
            wait_until(lambda: "could not delete" in caplog.text)
            second = pipe.get(timeout=30)
            assert second.name == "item001"
            pipe.ack(second)
            check(pipe)


def test_a_staging_area_that_cannot_be_deleted_fails_its_item_and_the_rest_flows(s3_source, fault_proxy, tmp_path, caplog):
    """The item fails; the download thread that finished it stays, and fetches the next item."""

    def check(pipe):
        got = pipe.get(timeout=30)
        assert got is not None and got.name == "item003"
        pipe.ack(got)
        assert pipe.stats().items_failed == 1

    _staging_that_cannot_be_deleted(s3_source, fault_proxy, tmp_path, caplog, check)


def test_a_staging_area_that_cannot_be_deleted_stays_counted(s3_source, fault_proxy, tmp_path, caplog):
    """Its reservation is released once, and what could not be deleted counts against the cap."""

    def check(pipe):
        wait_until(lambda: pipe.stats().bytes_in_cache < 1024 * KIB)  # item000 and item001 are deleted
        assert pipe.stats().bytes_in_cache >= 512 * KIB  # item002's staged part is still on disk
        assert f"{512 * KIB + block_of(tmp_path)} bytes left" in caplog.text  # the file and its folder

    _staging_that_cannot_be_deleted(s3_source, fault_proxy, tmp_path, caplog, check)


def test_a_staging_area_that_cannot_be_deleted_after_a_write_error_fails_its_item_and_stays_counted(
    s3_source, fault_proxy, tmp_path, caplog
):
    """item000's file is made immutable while its body trickles in, so a write into it fails
    (EPERM, a local write error: the item is restarted) and it cannot be deleted. The item
    fails, its reservation is given back and what is left counts against the cap. (Before, the
    item was restarted into a new staging area beside the old one's bytes, counted nowhere.)"""
    from conftest import via

    proxy, endpoint = fault_proxy
    proxy.trickle_bytes = 1024  # about 1 MB/s: the 1 MiB body takes a second
    s3_source.folders(1, {"f": 1024 * KIB})
    s3_source.put("item001/f", b"x" * (10 * KIB))
    proxy.inject("trickle", 10**9)
    staging = tmp_path / "c" / ".cachepipe" / "staging"
    options = {"max_concurrency": 1, "auto_ack": False, "on_error": "skip", "retries": 3, "retry_backoff": 0.05}
    with Pipeline(s3_source.url, tmp_path / "c", "4MiB", storage_options=via(s3_source, endpoint), **options) as pipe:
        wait_until(lambda: any(f.stat().st_size for f in staging.glob("[0-9]*/f")))
        stuck = next(f for f in staging.glob("[0-9]*/f") if f.stat().st_size)
        with immutable(stuck, list):
            got = pipe.get(timeout=30)
            assert got is not None and got.name == "item001"
            stats = pipe.stats()
            assert (stats.items_failed, stats.disk_errors) == (1, 1)  # before: (0, 1), item000 handed out after item001
            block = block_of(tmp_path)
            left = -(-stuck.stat().st_size // block) * block + block  # its file and its folder, in whole blocks
            assert stats.bytes_in_cache >= left
            assert f"{stuck.parent} ({left} bytes left" in caplog.text
            pipe.ack(got)


def test_an_item_whose_local_path_is_over_the_file_systems_limit_fails_at_once(s3_source, tmp_path):
    """Every segment of the key is under 255 bytes, the whole path over PATH_MAX (4,096): the
    item can never be staged, so it fails at once and is not retried as a disk error (before,
    it was, ``retries`` times with backoff, holding back the items after it)."""
    s3_source.put("a/" + "/".join(["D" * 200] * 21) + "/f", b"x")
    s3_source.put("b/f", b"y")
    with Pipeline(
        s3_source.url, tmp_path / "c", "1MiB", storage_options=s3_source.options, on_error="skip", retries=3, retry_backoff=2
    ) as pipe:
        assert [p.name for p in pipe] == ["b"]
        stats = pipe.stats()
    assert stats.items_failed == 1 and stats.disk_errors == 0


ACK_NOT_JOURNALED = r"""
import resource, signal, sys, time
from pathlib import Path
from cachepipe import Pipeline
source, cache = sys.argv[1], Path(sys.argv[2])
with Pipeline(source, cache, "1MiB") as pipe:
    items = iter(pipe)
    next(items)
    while pipe.stats().items_ready < 2:
        time.sleep(0.01)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (cache.joinpath(".cachepipe", "journal").stat().st_size, hard))
    try:
        next(items)  # acknowledges the first item: its journal write fails
    except OSError as exc:
        print("raised", exc.errno)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    print(" ".join(p.name for p in pipe))
"""


def test_an_auto_ack_that_could_not_be_journaled_gives_the_item_back(tmp_path):
    """The loop's ack of an item fails on the journal's write (the kernel refuses to grow a file
    past RLIMIT_FSIZE, in a process of its own): the error is raised, nothing changed, and the
    item is given back, so the next loop delivers it. (While the loop let a refused ack's error
    through without giving the item back, it stayed leased to nobody and the pass ended without it.)"""
    source = tmp_path / "src"
    for i in range(3):
        (source / f"item{i}").mkdir(parents=True)
        (source / f"item{i}" / "f").write_bytes(b"x" * 100)
    run = subprocess.run(
        [sys.executable, "-c", ACK_NOT_JOURNALED, str(source), str(tmp_path / "cache")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["raised 27", "item0 item1 item2"], run.stdout + run.stderr


def test_a_full_disk_at_open_names_the_cache(s3_source, tmp_path):
    """A disk already full when the pipeline opens failed with a bare "[Errno 28] No space left
    on device", raised from the lock file's write, naming no path; then with the lock file's
    path, which said neither which disk nor what fills it. It names cache_dir, the disk, what
    holds it and what to do (and is raised before the listing)."""
    s3_source.folders(1, {"f": KIB})
    with tmpfs(tmp_path / "disk", "64k") as disk:
        (disk / "cache").mkdir()
        filler = disk / "filler.bin"
        with open(filler, "wb", buffering=0) as fh, contextlib.suppress(OSError):
            while True:
                fh.write(b"x" * 4096)
        with pytest.raises(OSError, match="its disk is full") as err:
            Pipeline(s3_source.url, disk / "cache", "32KiB", storage_options=s3_source.options).open()
        assert err.value.errno == errno.ENOSPC
        assert str(err.value) == (
            f"[Errno 28] cache_dir '{disk}/cache': its disk is full (No space left on device): "
            f"the filesystem mounted at '{disk}' has 0 B free "
            "of 64.0 KiB; the cache holds 0 B of it, other files 64.0 KiB; free space there, or give a cache_dir on "
            "another filesystem"
        )


def test_a_cache_dir_on_a_read_only_filesystem_is_named_with_the_reason(tmp_path):
    """A bare "[Errno 30] Read-only file system: '.../cache'" before, and at the mount point
    itself it named '<mount>/.cachepipe', a path the user never gave; neither said cache_dir."""
    with tmpfs(tmp_path / "disk", "64k", ",ro") as disk:
        for given, why in [
            (disk / "cache", f"cannot be created: '{disk}' is on a read-only filesystem"),
            (disk, "on a read-only filesystem"),
        ]:
            with pytest.raises(OSError, match="read-only filesystem") as err:
                Pipeline("memory://cachepipe-test-none/", given, "32KiB").open()
            assert str(err.value) == (
                f"[Errno {errno.EROFS}] cache_dir '{given}': {why}; expected a directory on a writable filesystem"
            )
            assert err.value.errno == errno.EROFS and isinstance(err.value.__cause__, OSError)


def test_a_cache_dir_whose_filesystem_makes_no_folders_is_not_said_to_be_missing(tmp_path):
    """Under /proc, even root cannot make a folder: a bare "No such file or directory: '/proc/x'"
    before, which reads as "create it"."""
    with pytest.raises(FileNotFoundError) as err:
        Pipeline("memory://cachepipe-test-none/", "/proc/cachepipe-test-x", "32KiB").open()
    assert str(err.value) == (
        "[Errno 2] cache_dir '/proc/cachepipe-test-x': cannot be created under '/proc': its filesystem does not "
        "allow it (No such file or directory); expected a directory this user can write to"
    )
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"cache_dir '.*/file/cache': '.*/file' on its path is not a directory"):
        Pipeline("memory://cachepipe-test-none/", tmp_path / "file" / "cache", "32KiB").open()


def test_a_cache_dir_this_user_may_not_create_is_said_so(tmp_path):
    """What the cache's open raises for EACCES (as root the kernel never refuses it, so the
    error is made here): the field, the value given, and the folder it cannot be made in."""
    (tmp_path / "locked").mkdir()
    denied = PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "locked" / "cache"))
    error = unusable_dir(tmp_path / "locked" / "cache" / "x", denied)
    assert isinstance(error, PermissionError)
    assert str(error) == (
        f"[Errno {errno.EACCES}] cache_dir '{tmp_path}/locked/cache/x': cannot be created under "
        f"'{tmp_path}/locked': permission denied for this user (uid {os.geteuid()}); expected a directory this "
        "user can write to"
    )
    assert unusable_dir(tmp_path, OSError(errno.ENOSPC, "No space left on device")) is None  # said as it is


def test_serve_check_says_a_cache_dir_is_on_a_read_only_filesystem(tmp_path):
    """The host check said "'<dir>' is not writable by this user (uid 0); create it beforehand":
    wrong advice for root on a read-only mount."""
    with tmpfs(tmp_path / "disk", "64k", ",ro") as disk:
        for given, why in [
            (disk / "cache", f"cannot be created: '{disk}' is on a read-only filesystem"),
            (disk, "on a read-only filesystem"),
        ]:
            config = ServiceConfig.model_validate(
                {
                    "socket": str(tmp_path / "api.sock"),
                    "pipelines": {"a": {"source": "memory://cachepipe-test-none/", "cache_dir": str(given), "capacity": "1MiB"}},
                }
            )
            expected = "expected a directory on a writable filesystem"
            assert host_problems(config) == [f"pipelines.a.cache_dir '{given}': {why}; {expected}"]


def test_serve_check_says_jobs_root_is_on_a_read_only_filesystem(tmp_path):
    """jobs.root was not checked: on a read-only filesystem (a path outside a systemd unit's
    ReadWritePaths) the daemon started, `serve --check` passed, and every job's registration
    failed with HTTP 500 "Read-only file system"."""
    with tmpfs(tmp_path / "disk", "64k", ",ro") as disk:
        config = ServiceConfig.model_validate(
            {"socket": str(tmp_path / "api.sock"), "jobs": {"root": str(disk / "jobs"), "capacity": "1MiB"}}
        )
        assert host_problems(config) == [
            (
                f"jobs.root '{disk}/jobs': cannot be created: '{disk}' is on a read-only filesystem; "
                "expected a directory on a writable filesystem"
            )
        ]


def test_serve_check_lets_a_full_cache_disk_pass_with_a_warning(tmp_path, caplog):
    """A cache_dir on a full filesystem (here out of inodes: no new folder) is no problem of the
    configuration: its pipeline waits for room (min_free) and goes on. The probe of the host check
    refused it as "not a filesystem that stores files", so serve exited 78, which systemd never
    restarts, and every reload was refused while the disk was full."""
    with tmpfs(tmp_path / "disk", "1m", ",nr_inodes=4") as disk:
        (disk / "cache").mkdir()
        with contextlib.suppress(OSError):
            for n in range(4):
                (disk / "cache" / f"tenant-{n}").write_bytes(b"")
        with pytest.raises(OSError, match="No space left on device"):
            (disk / "cache" / "more").mkdir()  # the filesystem is full
        config = ServiceConfig.model_validate(
            {
                "socket": str(tmp_path / "api.sock"),
                "pipelines": {
                    "a": {"source": "memory://cachepipe-test-none/", "cache_dir": str(disk / "cache"), "capacity": "1MiB"}
                },
            }
        )
        assert host_problems(config) == []
        assert f"'{disk / 'cache'}' is full now (No space left on device)" in caplog.text
        assert not [n for n in os.listdir(disk / "cache") if not n.startswith("tenant-")]  # nothing of the probe's left


def test_a_share_of_the_disk_keeps_its_size_when_the_cache_opens_again_over_its_items(s3_source, tmp_path):
    """Found in review (a team's first week): ``capacity="90%"`` was resolved at each open
    against the free space, of which the cache's own items had taken their part: a pipeline
    opened again over the items it kept (a daemon restarted, a ``set_epoch`` pass with
    ``retain="auto"``, ``resume=True``) got 90% of what they left, dropped most of them and
    downloaded them again."""
    s3_source.folders(16, {"f": 32 * KIB})
    options = {"storage_options": s3_source.options, "keep_on_close": True, "resume": True}
    with tmpfs(tmp_path / "disk", "1m") as disk:
        with Pipeline(s3_source.url, disk / "cache", "90%", **options) as pipe:
            wait_until(lambda: pipe.stats().items_ready == 16)  # all fetched ahead, none handed out
            first = pipe.stats().capacity
        with Pipeline(s3_source.url, disk / "cache", "90%", **options) as pipe:
            assert len(list(pipe)) == 16
            stats = pipe.stats()
    assert stats.capacity == pytest.approx(first, rel=0.02)
    assert stats.items_reused == 16 and stats.bytes_downloaded == 0


def test_a_map_run_over_what_a_killed_run_left_gets_its_share_of_the_disk(tmp_path):
    """``cachepipe map --capacity 90%`` was resolved against the free space alone: a rerun
    after a killed run, whose downloads and outputs were still in the cache folder, got 90% of
    what they left. They are this run's room, as a pipeline's own items are its own."""
    from cachepipe.map import map_items

    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"x" * 1000)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        empty = map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst1"), cache_dir=disk / "c1", capacity="90%")
        left = disk / "c2" / "left-by-a-killed-run"
        left.parent.mkdir()
        left.write_bytes(b"x" * (400 * 1024))  # what a run killed mid-way left in its cache folder
        rerun = map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst2"), cache_dir=disk / "c2", capacity="90%")
    assert empty.items_done == rerun.items_done == 1
    assert rerun.capacity == pytest.approx(empty.capacity, rel=0.02)


def item_name(path):
    return path.name


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "two-ranks"])
def test_dataloader_workers_keep_their_share_of_the_disk_when_they_open_again_over_their_items(
    s3_source, fault_proxy, tmp_path, ranks
):
    """Found in review: a capacity given as a share of the disk ("90%") was resolved by each
    DataLoader worker's pipeline against the free space and its own folder, in which its
    siblings' items (and other ranks') were space taken: a set_epoch pass with retain="auto"
    opened again over the items the last one kept got a smaller share (at most 283 KB, where
    468 KB was due, for a worker holding 412 KB), dropped some and downloaded them again (10
    of the 20 items, with one rank)."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from cachepipe.torch import CachePipeDataset

    proxy, endpoint = fault_proxy
    # 720 KiB in whole blocks (a 32 KiB file and its folder, 4 KiB pages): each worker's share
    # nearly full, beside its state and the two blocks of its folder and reader note (195a07f)
    names = sorted(s3_source.folders(20, {"f": 32 * KIB}))
    options = {"storage_options": {**s3_source.options, "endpoint_url": endpoint}, "world_size": ranks}
    plan = {"epochs": 3, "retain": "auto", "partition": "fixed", "shuffle": True, "seed": 1}
    with tmpfs(tmp_path / "disk", "1m") as disk:
        datasets = [
            CachePipeDataset(s3_source.url, disk / "cache", f"{90 // ranks}%", item_name, rank=rank, **options, **plan)
            for rank in range(ranks)
        ]
        loaders = [torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2) for dataset in datasets]
        for epoch in range(2):  # not the plan's last: each pass keeps what it retained for the next
            got = []
            for dataset, loader in zip(datasets, loaders, strict=True):
                dataset.set_epoch(epoch)
                got += list(loader)
            assert sorted(got) == names, epoch
        held = len(list((disk / "cache").glob("rank*-worker*/item*")))
    gets = [head.split()[1].split("/")[-2] for head in proxy.requests if head.startswith("GET") and "/item" in head.split()[1]]
    assert sorted(gets) == names  # each once: every pass after the first found all its items kept
    assert held == len(names)


def test_an_item_over_a_worker_s_share_of_the_disk_is_said_to_be_over_that_share_of_what(tmp_path):
    """A worker's share of a capacity given as a share of the disk is named with the bytes it
    was of (free or cached in cache_dir): "90% / num_workers 2" alone cannot be checked."""
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    from cachepipe.torch import CachePipeDataset

    for name, size in (("a", 600_000), ("b", 1000)):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(b"x" * size)
    with tmpfs(tmp_path / "disk", "1m") as disk:
        dataset = CachePipeDataset(str(tmp_path / "src"), disk / "cache", "90%", item_name, rank=0, world_size=1)
        it = iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2))
        try:
            with pytest.raises(Exception, match="OversizeError") as failed:  # re-raised by the DataLoader
                list(it)
        finally:
            it._shutdown_workers()  # the worker error leaves the loader's queue threads to its shutdown
    said = re.search(
        r"item 'a' is 600000 bytes listed, \d+ bytes in the filesystem's blocks of 4096 bytes \([^)]*\), larger than this "
        r"DataLoader worker's share of the cache \(capacity 90% of "
        r"(\d+) bytes free or cached in cache_dir / num_workers 2\) of (\d+) bytes",
        str(failed.value),
    )
    assert said, failed.value
    room, share = int(said[1]), int(said[2])
    assert 1024 * KIB - 64 * KIB < room <= 1024 * KIB  # the disk, less a few pages of state at most
    assert share == int(room * 0.9) // 2


def test_a_cache_of_small_files_stays_under_its_capacity_in_the_blocks_they_take(s3_source, tmp_path):
    """The cap counted the files' sizes: items of eight 512 B files (4 KiB listed) took 36 KiB
    each on a filesystem of 4 KiB blocks, so a capacity near the disk's size filled the disk
    (ENOSPC, its free space 0) while the ledger was far under it. Each item is charged its files
    in whole blocks and its folder now: the disk never holds more than the capacity."""
    data = s3_source.folders(32, {f"f{i}": 512 for i in range(8)})
    with tmpfs(tmp_path / "disk", "512k") as disk:
        capacity = 480 * KIB
        taken = charge(disk, [512] * 8, 1)  # an item: 36 KiB on 4 KiB pages
        used = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                st = os.statvfs(disk)
                used.append((st.f_blocks - st.f_bfree) * st.f_frsize)
                stop.wait(0.002)

        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            with Pipeline(s3_source.url, disk / "cache", capacity, storage_options=s3_source.options, auto_ack=False) as pipe:
                names = []
                for item in pipe:
                    # hold it until the cache is full: no room for one more item in the ledger (or,
                    # counted in sizes, never: until the disk is), or every item is out
                    wait_until(
                        lambda: (
                            (s := pipe.stats()).bytes_in_cache + taken > capacity
                            or s.disk_errors
                            or s.items_handed + s.items_ready == len(data)
                        )
                    )
                    names.append(item.name)
                    pipe.ack(item)
                stats = pipe.stats()
        finally:
            stop.set()
            sampler.join()
    assert names == sorted(data) and stats.items_failed == stats.disk_errors == 0, stats
    assert max(used) <= capacity, f"the disk held {max(used)} bytes, the capacity is {capacity}"
    assert max(used) > capacity // 2, "the cache never filled: the test did not exercise the cap"


def test_a_rank_s_manifests_are_counted_in_its_capacity(tmp_path):
    """Found in review: per-process mode writes each rank's manifest into cache_dir
    (``manifest-rank<r>-*.json.gz``, by the first set_epoch or under torch.distributed) and no
    capacity counted it: two ranks given half the disk each, their caches full, held the whole
    disk and the manifests besides. A rank's manifests are now reserved from its capacity before
    its workers' shares are dealt: everything under cache_dir stays under the capacities."""
    pytest.importorskip("torch", reason="PyTorch is not installed")
    from cachepipe.torch import CachePipeDataset

    # items of one 4 KiB file (8 KiB with its folder) and many empty ones with long names: the
    # manifest lists each (several blocks), the cache charges the item 8 KiB
    for i in range(160):
        folder = tmp_path / "src" / f"item{i:03d}"
        folder.mkdir(parents=True)
        (folder / "f").write_bytes(b"x" * 4 * KIB)
        for j in range(12):
            (folder / f"{j:02d}-{os.urandom(24).hex()}").touch()
    with tmpfs(tmp_path / "disk", "1m") as disk:
        capacity = 512 * KIB  # each rank's: the two fit the disk
        datasets = [
            CachePipeDataset(str(tmp_path / "src"), disk / "cache", capacity, item_name, rank=r, world_size=2, auto_ack=False)
            for r in range(2)
        ]
        for dataset in datasets:
            dataset.set_epoch(0)  # lists the source into this rank's manifest under cache_dir
        manifests = sorted(p.name for p in (disk / "cache").glob("manifest-rank*.json.gz"))
        assert [name[:14] for name in manifests] == ["manifest-rank0", "manifest-rank1"]
        pipes = [dataset.pipeline() for dataset in datasets]
        try:
            for pipe in pipes:
                pipe.open()
            for rank, pipe in enumerate(pipes):  # each fetches ahead until its ledger has no room for one
                # more item, and its downloads are done (reserved when they start)
                staging = disk / "cache" / f"rank{rank}-worker0" / ".cachepipe" / "staging"

                def full(pipe=pipe, staging=staging):
                    s = pipe.stats()
                    done = s.bytes_in_cache + 8 * KIB > s.capacity and not any(staging.iterdir())
                    return done or s.disk_errors or s.items_ready == 80

                wait_until(full)
            held = Sampler(disk / "cache")._bytes()  # every file and folder there, counted as the cap counts them
            stats = [pipe.stats() for pipe in pipes]
        finally:
            for pipe in pipes:
                pipe.close()
    assert [s.disk_errors for s in stats] == [0, 0]
    assert all(s.items_ready < 80 for s in stats), "a rank's cache never filled: the test did not exercise the cap"
    assert held <= 2 * capacity, f"cache_dir held {held} bytes, the ranks' capacities are {2 * capacity}"
