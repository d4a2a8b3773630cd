"""A cache whose disk another writer filled before it opened: the daemon starts and waits for
room, a pipeline opened in Python says at once which disk is full and what holds it, and the
cache's own kept items there are no full disk to it (a real tmpfs, filled and then freed)."""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import yaml
from conftest import via
from mounts import mounted
from test_service import inotify_watches, write_config
from test_unpack import archive_bytes
from waiting import wait_until

from cachepipe import ItemFailedError, Pipeline
from cachepipe.cache import tree_bytes
from cachepipe.client import Client
from cachepipe.service import roomwait
from cachepipe.service.roomwait import LOOK_EVERY, RETRY_AFTER, RoomWait
from cachepipe.service.testing import DaemonProcess
from cachepipe.sizes import format_size
from cachepipe.unpack import unpack_in_place


def tmpfs(path: Path, size: str = "256k"):
    return mounted(path, ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])


def fill(disk: Path) -> Path:
    """Another writer's file that takes every block left on ``disk``; returns its path."""
    filler = disk / "other-writer.bin"
    with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
        while True:
            out.write(b"\0" * 4096)
    return filler


def local_source(tmp_path: Path, count: int, size: int = 100) -> Path:
    src = tmp_path / "src"
    for i in range(count):
        (src / f"item{i}").mkdir(parents=True, exist_ok=True)
        (src / f"item{i}" / "a.bin").write_bytes(b"x" * size)
    return src


def daemon_config(tmp_path: Path, sock: Path, cache: Path, **daemon) -> Path:
    train = {"source": f"{local_source(tmp_path, 3)}/", "cache_dir": str(cache), "capacity": "64KiB", "items": "folders"}
    path = tmp_path / "cachepipe.yaml"
    path.write_text(yaml.safe_dump({"socket": str(sock), "pipelines": {"train": train}, **daemon}))
    return path


class Waiting(NamedTuple):
    disk: Path  # the tmpfs the cache is on
    config: Path  # the daemon's configuration file
    filler: Path  # the other writer's file that fills the disk
    daemon: DaemonProcess
    client: Client  # of pipeline "train"


@contextlib.contextmanager
def waiting_daemon(tmp_path: Path, short_dir: Path, **settings) -> Iterator[Waiting]:
    """A daemon (``settings``: its own) serving pipeline "train" of 3 items, whose cache is on a
    tmpfs that another writer filled before it started: the pipeline waits for room."""
    sock = short_dir / "api.sock"
    with tmpfs(tmp_path / "disk") as disk:
        config = daemon_config(tmp_path, sock, disk / "cache", **settings)
        filler = fill(disk)
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon, Client("train", sock) as client:
            assert client.status()["pipelines"]["train"]["state"] == "waiting for room"
            yield Waiting(disk, config, filler, daemon, client)


@contextlib.contextmanager
def to_a_busy_cache(config: Path, tmp_path: Path) -> Iterator[None]:
    """The daemon's configuration gives pipeline "train" a cache_dir that another process (this
    one, meanwhile) holds: a reload's new settings that fail to open."""
    settings = yaml.safe_load(config.read_text())
    settings["pipelines"]["train"]["cache_dir"] = str(tmp_path / "busy")
    config.write_text(yaml.safe_dump(settings))
    with Pipeline(f"{tmp_path / 'src'}/", tmp_path / "busy", "64KiB", items="folders"):
        yield


def waits_for_room_on(disk: Path, client: Client) -> None:
    """Pipeline "train" waits for room, its cache's disk ``disk`` full."""
    status = client.status()["pipelines"]["train"]
    assert status["state"] == "waiting for room", status
    assert status["error"].startswith(f"cache_dir '{disk}/cache': its disk is full"), status


def opens_and_serves(client: Client, daemon: DaemonProcess) -> None:
    """The waiting pipeline opens (within 30 s), hands its three items, and the daemon stops with 0."""
    wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "open", timeout=30, what="the pipeline opened")
    assert sorted(Path(item.path).name for item in client) == ["item0", "item1", "item2"]
    assert daemon.stop() == 0


def test_serve_on_a_full_cache_disk_starts_says_so_once_and_opens_once_there_is_room(tmp_path, short_dir):
    # A chaos run: another writer filled the cache's disk, and `cachepipe serve` exited 1 with
    # "[Errno 28] No space left on device: cannot write the cache's lock file", restarted by
    # systemd every 5 s, answering neither status nor health. It starts, answers, says once why
    # the pipeline waits (the disk, what holds it), a next waits as for items, and the pipeline
    # opens once the other writer frees its room.
    with waiting_daemon(tmp_path, short_dir, log_level="debug") as (disk, _config, filler, daemon, client):
        status = client.status()["pipelines"]["train"]
        said = (
            f"cache_dir '{disk}/cache': its disk is full (No space left on device): "
            f"the filesystem mounted at '{disk}' has 0 B free of 256.0 KiB; "
            "the cache holds 0 B of it, other files 256.0 KiB; free space there, or give a cache_dir on another filesystem"
        )
        assert (status["state"], status["error"]) == ("waiting for room", said)
        health = client.health()
        assert health == {"status": "degraded", "pipelines": {"train": f"waiting for room: {said}"}}
        with pytest.raises(TimeoutError):
            client.get(timeout=0.2)  # a next waits for it as for an item, then times out (408)
        assert "STATUS=train: waiting for room on its disk" in daemon.messages[-1]
        # a page freed: room for the listing's saved copy, not for the journal after it; tried again, quietly
        os.truncate(filler, filler.stat().st_size - 4096)
        wait_until(lambda: "still no room to open on" in daemon.log(), what="a try that found too little room")
        assert client.status()["pipelines"]["train"]["state"] == "waiting for room"
        filler.unlink()
        opens_and_serves(client, daemon)
    log = daemon.log()
    assert log.count("waits for room") == 1, log  # once, not once per look at the disk
    assert f"WARNING cachepipe.service: pipeline train waits for room, and opens once there is: {said}" in log
    assert "its disk has room now: opened" in log and "Traceback" not in log


def test_a_waiting_pipeline_is_not_tried_again_for_each_page_another_writer_frees(tmp_path, short_dir):
    # A try may list the source. After one that found too little room, the wait tried again at
    # each look (every 0.5 s) that saw the free space grown by any amount: a disk freed a file at
    # a time, or a quota used up (which the free space does not show) on a filesystem others
    # write to, listed the source twice a second. The next try is RETRY_AFTER seconds later at
    # the soonest, doubled after each such try.
    with waiting_daemon(tmp_path, short_dir, log_level="debug") as (_disk, _config, filler, daemon, client):
        os.truncate(filler, filler.stat().st_size - 4096)  # a page: too little for the open
        wait_until(lambda: "still no room to open on" in daemon.log(), what="a try that found too little room")
        deadline = time.monotonic() + RETRY_AFTER / 2
        while time.monotonic() < deadline:  # the other writer frees a page, then takes it again
            os.truncate(filler, filler.stat().st_size - 4096)
            time.sleep(LOOK_EVERY)
            with open(filler, "ab") as out, contextlib.suppress(OSError):
                out.write(b"\0" * 4096)
            time.sleep(LOOK_EVERY)
        assert daemon.log().count("still no room to open on") == 1, daemon.log()
        filler.unlink()
        wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "open", what="the pipeline opened")
        assert daemon.stop() == 0
    assert f"still no room to open on, tried again in {RETRY_AFTER:g} s at the soonest" in daemon.log()


def test_a_stop_while_a_pipeline_waits_for_room_ends_the_daemon_at_once(tmp_path, short_dir):
    # The wait for room runs on a thread of its own: a SIGTERM ends it (systemd's TimeoutStopSec
    # is 30 s), the exit status is 0, and nothing of the cache is left locked or staged.
    sock = short_dir / "api.sock"
    with tmpfs(tmp_path / "disk") as disk:
        config = daemon_config(tmp_path, sock, disk / "cache")
        fill(disk)
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon:
            with Client("train", sock) as client:
                assert client.status()["pipelines"]["train"]["state"] == "waiting for room"
            assert daemon.stop(timeout=20) == 0
        assert sorted(os.listdir(disk / "cache" / ".cachepipe")) == ["lock", "staging"]
        assert (disk / "cache" / ".cachepipe" / "lock").read_text().strip() == ""  # released
    assert "stopping (signal)" in daemon.log() and "Traceback" not in daemon.log()


def test_a_reload_that_moves_a_waiting_pipeline_to_a_disk_with_room_opens_it(tmp_path, short_dir):
    # What the warning advises ("give a cache_dir on another filesystem"), applied by a reload: the
    # wait on the full disk ends, and the pipeline opens in its new cache directory.
    with waiting_daemon(tmp_path, short_dir) as (_disk, config, _filler, daemon, client):
        settings = yaml.safe_load(config.read_text())
        settings["pipelines"]["train"]["cache_dir"] = str(tmp_path / "elsewhere")
        config.write_text(yaml.safe_dump(settings))
        daemon.reload()
        assert client.status()["pipelines"]["train"]["state"] == "open"
        assert sorted(Path(item.path).name for item in client) == ["item0", "item1", "item2"]
        assert daemon.stop() == 0
    assert "reloaded" in daemon.log() and "reopened train" in daemon.log() and "Traceback" not in daemon.log()


def test_a_reload_whose_new_settings_fail_while_the_disk_is_full_waits_for_room_with_the_old(tmp_path, short_dir):
    # A reload's new settings failed to open, and the old ones, reopened as its fallback, met
    # the disk another writer had filled since the start: the pipeline was down until the next
    # reload, where a start on that disk waits for room. The fallback waits for room too.
    sock = short_dir / "api.sock"
    with tmpfs(tmp_path / "disk") as disk:
        config = daemon_config(tmp_path, sock, disk / "cache")
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon, Client("train", sock) as client:
            assert client.status()["pipelines"]["train"]["state"] == "open"
            filler = fill(disk)
            with to_a_busy_cache(config, tmp_path):
                daemon.reload()
                wait_until(lambda: "failed train" in daemon.log(), what="the reload done")
            waits_for_room_on(disk, client)
            filler.unlink()
            opens_and_serves(client, daemon)
    log = daemon.log()
    assert "reload: pipeline train waits for room with its old settings" in log, log
    assert "cannot reopen with its old settings" not in log and "Traceback" not in log


def test_a_reload_whose_new_settings_fail_while_a_pipeline_waits_for_room_waits_on_with_the_old(tmp_path, short_dir):
    # A pipeline waiting for room (since the start, or since a reload's fallback), given settings
    # that fail to open (another process's cache_dir): its wait was ended and the pipeline was
    # down until the next reload, where one open went back to its old settings, and where a
    # first reload's fallback waited for room a second reload of the same file took it down.
    with waiting_daemon(tmp_path, short_dir) as (disk, config, filler, daemon, client):
        with to_a_busy_cache(config, tmp_path):
            for _ in range(2):  # the same file, reloaded twice
                assert "reload failed in part" in daemon.reload()
                waits_for_room_on(disk, client)
        filler.unlink()
        opens_and_serves(client, daemon)
    log = daemon.log()
    assert log.count("reload: pipeline train waits for room with its old settings") == 2, log
    assert "Traceback" not in log


def test_a_waiting_pipeline_whose_open_then_fails_otherwise_tries_again_as_systemd_would_restart(tmp_path, short_dir):
    # The disk had room again, but the open failed for another reason (the source empty for a
    # while, a store not answering after a reboot): the thread that waited for room died with a
    # traceback, the pipeline "waiting for room" for good, where a start failing so exits 1 and
    # systemd starts it again (every 5 s). It is tried again every RETRY_AFTER seconds, down
    # meanwhile with the error, and opens once the source is back; an error of the settings
    # stays down (a start exits 78 for it: not started again).
    src, away = tmp_path / "src", tmp_path / "away"
    with waiting_daemon(tmp_path, short_dir) as (disk, _config, filler, daemon, client):
        src.rename(away)
        src.mkdir()  # the source empty
        filler.unlink()
        wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "down", what="the failed open said")
        error = client.status()["pipelines"]["train"]["error"]
        assert error.startswith("EmptySourceError: ") and error.endswith(f"(tried again every {RETRY_AFTER:g} s)"), error
        # another writer fills the disk again meanwhile: the pipeline stayed "down" with the
        # EmptySourceError for good, and was not tried again until the disk had room; the
        # next try finds the disk full, and it waits for room again, saying why
        fill(disk)  # at the same path as before
        wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "waiting for room", timeout=30, what="waits")
        error = client.status()["pipelines"]["train"]["error"]
        assert error.startswith(f"cache_dir '{disk}/cache': its disk is full (No space left on device)"), error
        filler.unlink()
        src.rmdir()
        away.rename(src)
        opens_and_serves(client, daemon)
    log = daemon.log()
    assert "its open failed, tried again every" in log and "its disk has room now: opened" in log
    assert log.count("waits for room again") == 1, log
    assert "Traceback" not in log


def test_a_waiting_pipeline_whose_settings_are_refused_once_there_is_room_is_down_with_the_reason(tmp_path, short_dir):
    # The source's local folder gone when room came: the settings' check raised in the wait's
    # thread, outside its handling; the thread died with a traceback and the pipeline stayed
    # "waiting for room" for good. It is down, with the reason (as a start exits 78 for it).
    with waiting_daemon(tmp_path, short_dir) as (_disk, _config, filler, daemon, client):
        (tmp_path / "src").rename(tmp_path / "away")
        filler.unlink()
        wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "down", what="the refusal said")
        error = client.status()["pipelines"]["train"]["error"]
        assert error.startswith(f"ConfigError: source '{tmp_path}/src/': no such local path"), error
        assert daemon.stop() == 0
    assert "is down until a reload reopens it: ConfigError" in daemon.log() and "Traceback" not in daemon.log()


class _Unopened:
    """What a wait's ``make`` gives where its ``open_`` is a test's own."""

    def close(self) -> None:
        pass


def _opens(monkeypatch, disk: Path, open_) -> None:
    """Run a wait for room on the filesystem ``disk`` whose tries call ``open_`` (the test's own:
    the daemon's opens a pipeline), its times cut to a hundredth, until a try opens (within 10 s)."""
    monkeypatch.setattr(roomwait, "LOOK_EVERY", 0.01)
    monkeypatch.setattr(roomwait, "RETRY_AFTER", 0.05)
    monkeypatch.setattr(roomwait, "MOST_APART", 0.2)
    opened = threading.Event()

    def taken(_pipe: object) -> bool:
        opened.set()
        return True

    def said(_exc: BaseException) -> None:  # what the daemon says of a try: nothing here
        pass

    wait = RoomWait("train", disk / "cache", _Unopened, open_, taken, said, said, said)
    wait.start()
    try:
        assert opened.wait(10), "no try opened within 10 s"
    finally:
        wait.stop()


def test_a_wait_for_room_under_a_relative_path_not_made_yet_looks_at_the_working_folder_s_disk(tmp_path, monkeypatch):
    # The nearest existing folder of "cache/new" was looked for by cutting its last part: "" after
    # "cache", whose dirname is "" again, for ever (the daemon gives absolute paths; a caller may not).
    monkeypatch.chdir(tmp_path)
    wait = RoomWait("train", "cache/new", _Unopened, print, bool, print, print, print)
    room = wait._room()
    assert room is not None and room.total > 0


def test_a_wait_that_met_a_quota_used_up_tries_again_though_the_free_space_does_not_grow(monkeypatch, tmp_path):
    # A quota used up does not show in the free space, nor does one raised since (what the
    # message advises): after a try that met EDQUOT, the next was made only once the free space
    # grew, never on a filesystem no one else writes to. It is made at the times apart the wait
    # keeps (RETRY_AFTER, doubled up to MOST_APART) while the disk is not full. (This kernel
    # takes no quota on tmpfs, ext4 or XFS images: the first try's open says EDQUOT itself, on a
    # real filesystem whose free space stays as it is.)
    tries: list[int] = []

    def open_(pipe: object) -> None:
        tries.append(1)
        if len(tries) == 1:
            raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))  # the quota is raised after this try

    with tmpfs(tmp_path / "disk") as disk:
        _opens(monkeypatch, disk, open_)
    assert len(tries) == 2


def test_a_wait_whose_try_ended_after_another_writer_freed_room_tries_again(monkeypatch, tmp_path):
    # The room of a try that met a full disk was read after it ended (an open's listing retries
    # its writes for tens of seconds): room another writer freed meanwhile counted as room that
    # try had seen, and the next try waited for more than that, for good on a disk no one else
    # writes to. The room a try began with is kept where it was less.
    tries: list[int] = []
    with tmpfs(tmp_path / "disk") as disk:
        filler = fill(disk)
        os.truncate(filler, filler.stat().st_size - 8192)  # two pages: the disk is not full, the try is made

        def open_(pipe: object) -> None:
            tries.append(1)
            if len(tries) == 1:
                filler.unlink()  # freed by another writer while this try, which met the disk full, ran
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        _opens(monkeypatch, disk, open_)
    assert len(tries) == 2


def test_a_cache_whose_own_kept_items_fill_its_disk_opens_and_makes_room_by_its_recovery(tmp_path):
    # Items kept by the last owner (keep_on_close) and another writer's file filled the disk;
    # the data changed at the source since, so the next open's recovery removes those items.
    # It never got there: its lock file, emptied by the last release, took a new block for the
    # owner's line, and the open failed with ENOSPC. The line is written over the old one's
    # bytes now (a release blanks it, and keeps its block), and the open goes on to the recovery.
    src = local_source(tmp_path, 3, size=20_000)
    with tmpfs(tmp_path / "disk") as disk:
        options = {"items": "folders", "keep_on_close": True}
        with Pipeline(f"{src}/", disk / "cache", "200KiB", **options) as pipe:
            kept = [pipe.get(timeout=20) for _ in range(3)]  # published, never acknowledged: kept at close
        assert all(item is not None for item in kept)
        filler = fill(disk)
        for i in range(3):  # the data rewritten at the source (smaller: all of it fits the room freed): stale
            (src / f"item{i}" / "a.bin").write_bytes(b"y" * 10_000)
        with Pipeline(f"{src}/", disk / "cache", "200KiB", **{**options, "keep_on_close": False}) as pipe:
            item = pipe.get(timeout=20)
            assert item is not None and (item.path / "a.bin").read_bytes() == b"y" * 10_000
        filler.unlink()


def test_a_disk_out_of_inodes_at_the_plan_s_journaling_fails_the_open_at_once_naming_the_disk(tmp_path, caplog):
    # Three inodes left: the check before the listing passes (there are some), the journal's
    # rewrite at the recovery takes one and gives it back, and so does the one that records the
    # plan once the listing ends, whose temporary file then found none. That write ran inside the
    # listing's retries: the whole listing was done again 12 times over about 50 s, and the open
    # failed with the bare "[Errno 28] No space left on device: '.../.journal.tmp'". It fails at
    # once, as a full disk at open: naming the disk, its inodes, what to do.
    src = local_source(tmp_path, 3)
    with tmpfs(tmp_path / "disk", "1m,nr_inodes=64") as disk:
        (disk / "cache" / ".cachepipe").mkdir(parents=True)
        others = []
        with contextlib.suppress(OSError):
            while True:  # another writer's empty files, one per inode
                others.append(disk / f"other{len(others)}")
                others[-1].touch()
        for other in others[:3]:
            other.unlink(missing_ok=True)
        with pytest.raises(OSError, match="its disk is full") as err:
            Pipeline(f"{src}/", disk / "cache", "64KiB", items="folders").open()
        assert err.value.errno == errno.ENOSPC
        assert f", and no inode; could not write '{disk}/cache/.cachepipe/.journal.tmp'" in str(err.value), err.value
        assert not [r for r in caplog.records if "failed, retry" in r.getMessage()], caplog.text


def test_a_running_pipeline_whose_plan_meets_a_disk_out_of_inodes_waits_for_room_without_listing_again(
    s3_source, fault_proxy, tmp_path, caplog
):
    # The listing ends after the open (past its first page): recording the plan then met a disk
    # another writer had taken every inode of. Inside the listing's retries, the whole listing was
    # done again (12 times, then the pass failed). It is the plan's write alone that is tried
    # again, as downloads wait for room, and the pass goes on once there is.
    proxy, endpoint = fault_proxy
    s3_source.folders(150, {"f": 10})  # the first page (100 keys) at the open, the rest after it
    gate = threading.Event()
    proxy.hold(lambda head: "continuation-token" in head.split("\r\n", 1)[0], gate)
    # room for the first page's 99 items at once: 8 KiB each in whole blocks (a page for its file, one for its folder)
    with tmpfs(tmp_path / "disk", "2m,nr_inodes=400") as disk:
        pipe = Pipeline(s3_source.url, disk / "cache", "1MiB", items="folders", storage_options=via(s3_source, endpoint))
        with pipe:
            # the first page's items downloaded: no download under way takes or gives back an inode meanwhile
            # (99: the 100th key's folder may go on in the next page)
            wait_until(lambda: pipe.stats().items_ready == 99, what="the first page's items ready")
            others = []
            with contextlib.suppress(OSError):
                while True:  # another writer's empty files, one per inode
                    others.append(disk / f"other{len(others)}")
                    others[-1].touch()
            gate.set()  # the rest is listed; the plan's journaling finds no inode
            wait_until(lambda: ".journal.tmp" in caplog.text, what="the plan's write failed")  # logged, then or now
            for other in others:
                other.unlink(missing_ok=True)
            got = []
            while (item := pipe.get(timeout=30)) is not None:
                got.append(item.name)
                pipe.ack(item)
        assert sorted(got) == [f"item{i:03d}" for i in range(150)]
        gate.set()
    assert not [r for r in caplog.records if "failed, retry" in r.getMessage()], caplog.text
    assert "listed whole, but its plan could not be recorded, retry 1/" in caplog.text


def test_a_running_pipeline_whose_plan_meets_a_disk_out_of_inodes_for_good_fails_after_its_retries(
    s3_source, fault_proxy, tmp_path, caplog
):
    # The plan's write is tried again as a download's local disk error is, `retries` times: a
    # disk that stays out of inodes then fails the pass, said as a full disk, in its turn after
    # the items listed before it, instead of leaving the consumer waiting for an end of the
    # listing that never comes. (Nothing is consumed until the listing thread gave up: an
    # acknowledged item gives its inodes back.)
    proxy, endpoint = fault_proxy
    s3_source.folders(150, {"f": 10})
    gate = threading.Event()
    proxy.hold(lambda head: "continuation-token" in head.split("\r\n", 1)[0], gate)
    options = {"items": "folders", "retries": 2, "on_error": "skip", "storage_options": via(s3_source, endpoint)}
    with tmpfs(tmp_path / "disk", "2m,nr_inodes=400") as disk:  # the first page's 99 items at once, 8 KiB each in blocks
        with Pipeline(s3_source.url, disk / "cache", "1MiB", **options) as pipe:
            wait_until(lambda: pipe.stats().items_ready == 99, what="the first page's items ready")
            with contextlib.suppress(OSError):
                for n in itertools.count():  # another writer's empty files, one per inode, left there
                    (disk / f"other{n}").touch()
            gate.set()

            def listing_ended() -> bool:
                return not any(t.name == "cachepipe-listing" for t in threading.enumerate())

            wait_until(listing_ended, what="the listing thread's end")
            assert "its plan could not be recorded, retry 2/2" in caplog.text
            with pytest.raises(OSError, match="its disk is full") as err:
                for _item in pipe:  # the items listed before, then the listing's error
                    pass
        assert f"could not write '{disk}/cache/.cachepipe/.journal.tmp'" in str(err.value), err.value
    assert not [r for r in caplog.records if "failed, retry" in r.getMessage()], caplog.text


def test_a_full_disk_met_by_the_journal_at_open_names_the_disk_and_what_holds_it(tmp_path):
    # The disk has room for the lock, not for the journal's rewrite at recovery (its items kept,
    # the same data: reused, nothing freed): the open failed with "No space left on device" and
    # the journal's temporary file. It names the cache, the disk, what holds it, what to do.
    src = local_source(tmp_path, 2, size=20_000)
    with tmpfs(tmp_path / "disk") as disk:
        options = {"items": "folders", "keep_on_close": True, "resume": True}
        with Pipeline(f"{src}/", disk / "cache", "200KiB", **options) as pipe:
            assert pipe.get(timeout=20) is not None and pipe.get(timeout=20) is not None
        (disk / "cache" / ".cachepipe" / "held").unlink()  # the note of its size: its removal at open frees a page
        filler = fill(disk)
        with pytest.raises(OSError, match="its disk is full") as err:
            Pipeline(f"{src}/", disk / "cache", "200KiB", **options).open()
        assert err.value.errno == errno.ENOSPC
        message = str(err.value)
        assert message.startswith(
            f"[Errno 28] cache_dir '{disk}/cache': its disk is full (No space left on device): the filesystem mounted at '{disk}'"
        )
        assert f"cannot write '{disk}/cache/.cachepipe/journal'" in message, message
        # its items and state, in the pages they take (what deleting them frees; a folder takes none on tmpfs)
        held = tree_bytes(disk / "cache", disk=True)
        assert 40 * 1024 <= held < 64 * 1024, held  # two items of 20,000 bytes: 5 pages each
        assert f"; the cache holds {format_size(held)} of it, other files " in message, message
        assert message.endswith("free space there, or give a cache_dir on another filesystem")
        filler.unlink()


def test_a_full_disk_under_a_bind_mount_is_named_by_that_mount_s_point(tmp_path):
    # The message named the highest folder on the disk's device: for a cache under a bind mount
    # of a folder of the same filesystem (as a container's volume is), the folder mounted over,
    # not the mount the user gave. It names the point /proc/self/mountinfo lists.
    src = local_source(tmp_path, 1)
    with tmpfs(tmp_path / "disk") as disk:
        (disk / "data").mkdir()
        bind = ["mount", "--bind", str(disk / "data"), str(disk / "volume")]
        with mounted(disk / "volume", bind) as volume:
            filler = fill(disk)
            with pytest.raises(OSError, match="its disk is full") as err:
                Pipeline(f"{src}/", volume / "cache", "64KiB", items="folders").open()
            assert f"the filesystem mounted at '{volume}' has 0 B free of 256.0 KiB" in str(err.value)
            filler.unlink()


# ---- a full disk while an archive is extracted ----------------------------------------------
@pytest.mark.parametrize("fmt", ["tar.gz", "zip"])
def test_a_full_disk_during_an_extraction_names_the_member_s_file_and_leaves_the_item_as_it_was(tmp_path, fmt):
    # The item failed with a bare "[Errno 28] No space left on device": no file, no member.
    frames = {"meta.json": b"{}", "frames/all.bin": bytes(400_000)}  # 400 KB of zeros: a small archive
    with tmpfs(tmp_path / "disk") as disk:
        (disk / "item").mkdir()
        (disk / "item" / f"clip.{fmt}").write_bytes(archive_bytes(frames, fmt))
        with pytest.raises(OSError, match="No space left on device") as err:
            unpack_in_place(disk / "item", name="clips/item7", limit_bytes=10 << 20)
        assert err.value.errno == errno.ENOSPC
        assert str(err.value) == (
            f"[Errno 28] No space left on device: cannot write '{disk}/item.unpacked/frames/all.bin', member "
            f"'frames/all.bin' of archive 'clip.{fmt}' of item 'clips/item7'"
        )
        assert sorted(os.listdir(disk)) == ["item"]  # the extraction removed: nothing left behind
        assert os.listdir(disk / "item") == [f"clip.{fmt}"]


def test_an_item_whose_extraction_meets_a_full_disk_fails_naming_the_file_and_leaves_nothing_in_staging(tmp_path):
    # A pipeline with unpack=True: the item failed by its name with a bare "[Errno 28]"; what its
    # extraction wrote is removed with the failure, and the cache serves on.
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "clip.tar.gz").write_bytes(archive_bytes({"frames/all.bin": bytes(300_000)}, "tar.gz"))
    with tmpfs(tmp_path / "disk", "512k") as disk:
        filler = disk / "other-writer.bin"
        filler.write_bytes(bytes(300_000))  # the extraction's reserve fits the capacity, not the disk
        with Pipeline(f"{src}/", disk / "cache", "400KiB", items="folders", unpack=True, unpack_ratio=1000) as pipe:
            with pytest.raises(ItemFailedError) as failed:
                pipe.get(timeout=60)  # a guard against a hang, not a timing assertion
            assert failed.value.item == "a"
            cause = failed.value.__cause__
            assert isinstance(cause, OSError) and cause.errno == errno.ENOSPC
            assert re.fullmatch(
                rf"\[Errno 28\] No space left on device: cannot write '{disk}/cache/\.cachepipe/staging/\d+\.unpacked/"
                r"frames/all\.bin', member 'frames/all\.bin' of archive 'clip\.tar\.gz' of item 'a'",
                str(cause),
            ), cause
            staging = disk / "cache" / ".cachepipe" / "staging"
            assert [p for p in staging.iterdir() if not p.name.startswith("x")] == []  # nothing left behind
            assert pipe.get(timeout=60) is None


def test_a_full_disk_under_the_completion_marker_s_file_names_the_file(tmp_path):
    # `cachepipe map` writes an item's completion marker into its slot where it cannot keep it in
    # memory (no /proc, or memfd_create refused); on a full disk that failed with a bare
    # "[Errno 28] No space left on device". Here /proc is hidden (a mount namespace of the
    # child's own), so the marker takes that way.
    child = (
        "import sys\n"
        "from pathlib import Path\n"
        "from cachepipe.map.uploader import _marker_file\n"
        "try:\n"
        "    with _marker_file(b'{}' * 5000, Path(sys.argv[1])):\n"
        "        print('written')\n"
        "except OSError as exc:\n"
        "    print(exc)\n"
    )
    with tmpfs(tmp_path / "disk") as disk:
        fill(disk)
        hide_proc = f'mount -t tmpfs -o size=4k none /proc && exec {sys.executable} -c "$0" "$1"'
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        run = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", hide_proc, child, str(disk)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if run.returncode != 0 and "unshare" in run.stderr:
            pytest.skip(f"no mount namespace here: {run.stderr.strip()}")
        assert run.stdout.strip() == (
            f"[Errno 28] No space left on device: cannot write the completion marker's file '{disk}/marker.json'"
        ), run.stdout + run.stderr
        assert not (disk / "marker.json").exists()


def test_serve_on_a_disk_out_of_inodes_names_the_disk_where_the_cache_dir_is_not_made_yet(tmp_path, short_dir):
    # A fresh cache_dir on a disk with no inode left (or, on ext4, no block for a folder): the
    # daemon makes the folder to watch its markers before the pipeline opens, and that mkdir's
    # ENOSPC was said bare ("pipelines.train.cache_dir: cannot create it: [Errno 28] No space left
    # on device: '.../cache'"): neither the disk nor what holds it, as the pipeline's open says.
    sock = short_dir / "api.sock"
    with mounted(
        tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=256k,nr_inodes=8", "tmpfs", str(tmp_path / "disk")]
    ) as disk:
        config = daemon_config(tmp_path, sock, disk / "cache")
        others = []
        with contextlib.suppress(OSError):
            while True:  # another writer's empty files, until no inode is left
                (path := disk / f"other-{len(others)}").touch()
                others.append(path)
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon, Client("train", sock) as client:
            status = client.status()["pipelines"]["train"]
            assert status["state"] == "waiting for room", status
            assert status["error"] == (
                f"cache_dir '{disk}/cache': its disk is full (No space left on device): the filesystem mounted at "
                f"'{disk}' has 256.0 KiB free of 256.0 KiB, and no inode; could not write '{disk}/cache'; the cache holds 0 B "
                "of it, other files 0 B; "
                "free space there, or give a cache_dir on another filesystem"
            ), status
            for path in others:  # the inodes freed: the folder is made, and the pipeline opens
                path.unlink()
            wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "open", what="the pipeline opened")
            assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def test_a_filesystem_that_reports_no_size_is_no_full_disk(tmp_path):
    # ramfs (and a FUSE filesystem that answers no statfs) reports 0 blocks, 0 free and 0 inodes:
    # it counts no room, it is not out of it. The open failed at once, "its disk is full ... has
    # 0 B free of 0 B" (the daemon waited for room for good); and a capacity in bytes was held to
    # the room there, nothing but what the cache held.
    src = local_source(tmp_path, 2)
    with mounted(tmp_path / "disk", ["mount", "-t", "ramfs", "ramfs", str(tmp_path / "disk")]) as disk:
        assert os.statvfs(disk).f_blocks == 0
        with Pipeline(f"{src}/", disk / "cache", "1MiB", items="folders") as pipe:
            assert pipe.stats().capacity == 1 << 20
            assert sorted(item.path.name for item in pipe) == ["item0", "item1"]


def test_a_reload_that_turns_markers_on_while_the_wait_opens_the_pipeline_watches_it(s3_source, fault_proxy, tmp_path, short_dir):
    # The wait opens the pipeline in its own thread, outside the reload's lock: a reload that
    # turned markers on while that open listed (a large bucket: minutes) watched the pipelines
    # open then, not the one the wait opened next; its cache directory and items were never
    # watched, and a consumer's .done acknowledged nothing until another reload.
    proxy, endpoint = fault_proxy
    s3_source.folders(1, {"a.bin": 100})
    sock = short_dir / "api.sock"
    listing = lambda head: "list-type=2" in head.split("\r\n", 1)[0]  # noqa: E731 - a one-line match
    gate = threading.Event()
    with tmpfs(tmp_path / "disk") as disk:
        train = {"cache_dir": str(disk / "cache"), "capacity": "64KiB"}
        config = write_config(tmp_path, sock, endpoint, {"train": train}, markers=False)
        filler = fill(disk)
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon, Client("train", sock, auto_ack=False) as client:
            try:
                assert client.status()["pipelines"]["train"]["state"] == "waiting for room"
                proxy.hold(listing, gate)
                filler.unlink()  # room: the wait opens the pipeline, whose listing the proxy holds
                wait_until(lambda: any(listing(head) for head in proxy.requests), what="the wait's listing")
                settings = yaml.safe_load(config.read_text())
                settings["markers"] = True
                config.write_text(yaml.safe_dump(settings))
                daemon.reload()
            finally:
                gate.set()
            wait_until(lambda: client.status()["pipelines"]["train"]["state"] == "open", what="the pipeline opened")
            assert inotify_watches(daemon.pid) == 1  # its cache directory
            item = client.get(timeout=30)
            (item.path / ".done").touch()
            wait_until(lambda: client.status()["pipelines"]["train"]["stats"]["items_acked"] == 1, what="the .done's ack")
            assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()


def test_a_full_disk_s_blocks_reserved_for_root_are_not_said_to_be_other_files(tmp_path):
    # ext4 keeps 5% of its blocks for root by default (mkfs.ext4 -m), which df shows as used and
    # not available: the message counted them among "other files" (50 GiB of a 1 TiB disk that
    # nobody wrote), and a user looked for files that are not there. They are said as what
    # they are. Here 10% of a small ext4, filled by another user (nobody) up to what it may use.
    src = local_source(tmp_path, 1)
    image, disk = tmp_path / "disk.img", tmp_path / "disk"
    image.write_bytes(b"")
    os.truncate(image, 8 << 20)
    with mounted(disk, ["mkfs.ext4", "-q", "-F", "-m", "10", str(image)], ["mount", "-o", "loop", str(image), str(disk)]):
        # the file opened here, written by a child that is nobody (the reserve is kept from the writer, not the owner);
        # started as root, which it then stops being: nobody may not load the interpreter (pyenv's under /root)
        filler = "import contextlib, os, sys\nos.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
        filler += "with contextlib.suppress(OSError):\n    while True: os.write(int(sys.argv[1]), bytes(4096))\n"
        with open(disk / "other-writer.bin", "wb") as out:
            subprocess.run([sys.executable, "-c", filler, str(out.fileno())], check=True, pass_fds=(out.fileno(),))
        assert os.statvfs(disk).f_bavail == 0
        with pytest.raises(OSError, match="its disk is full") as err:
            Pipeline(f"{src}/", disk / "cache", "1MiB", items="folders").open()
        st = os.statvfs(disk)  # as the message saw it (root's open took a few blocks of the reserve)
        reserved, used = (st.f_bfree - st.f_bavail) * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize
        assert reserved > 0
        message = str(err.value)
        held = tree_bytes(disk / "cache", disk=True)  # its lock and state folder, in the blocks they take
        assert 0 < held <= 16 * 1024, held
        assert f"the cache holds {format_size(held)} of it, other files {format_size(used - held)}, " in message, message
        assert f"and {format_size(reserved)} is reserved for root (not free to other users); " in message, message


def test_a_pipeline_the_wait_opens_while_the_daemon_stops_is_closed(s3_source, fault_proxy, tmp_path, short_dir):
    # A stop closes the pipelines one by one after the marker watcher stopped; a wait for room
    # whose open ended meanwhile (another pipeline's close held by a download the store does
    # not abort) handed its pipeline over to a watcher already stopped: its thread died with a
    # traceback, and the pipeline stayed open, its cache locked, until the process ended.
    proxy, endpoint = fault_proxy
    s3_source.folders(1, {"a.bin": 1024})
    sock = short_dir / "api.sock"
    listing = lambda head: "list-type=2" in head.split("\r\n", 1)[0]  # noqa: E731 - a one-line match
    download = lambda head: head.startswith("GET ") and "/item000/" in head.split("\r\n", 1)[0]  # noqa: E731
    got, listed = threading.Event(), threading.Event()
    proxy.hold(download, got)  # the first pipeline's download, which its close waits for (obstore's GET)
    with tmpfs(tmp_path / "disk") as disk:
        pipelines = {
            "first": {"storage_options": {"endpoint_url": endpoint, "engine": "obstore"}},
            "train": {"cache_dir": str(disk / "cache"), "capacity": "64KiB"},
        }
        config = write_config(tmp_path, sock, endpoint, pipelines)
        filler = fill(disk)
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon:
            try:
                with Client("train", sock) as client:
                    assert client.status()["pipelines"]["train"]["state"] == "waiting for room"
                wait_until(lambda: any(download(head) for head in proxy.requests), what="the first pipeline's download")
                before = sum(listing(head) for head in proxy.requests)
                proxy.hold(listing, listed)
                filler.unlink()  # room: the wait opens its pipeline, whose listing the proxy holds
                wait_until(lambda: sum(listing(head) for head in proxy.requests) > before, what="the wait's listing")
                daemon.signal(signal.SIGTERM)
                wait_until(lambda: inotify_watches(daemon.pid) == 0, what="the marker watcher stopped")
                listed.set()  # the wait's open ends while the stop waits for the first pipeline's close
                wait_until(lambda: "its disk has room now" in daemon.log() or "Traceback" in daemon.log(), what="opened")
            finally:
                listed.set()
                got.set()
            assert daemon.proc.wait(30) == 0
    log = daemon.log()
    assert "Traceback" not in log, log
    assert log.count("closed s3://data/video/") == 2, log  # both pipelines, the one the wait opened too
