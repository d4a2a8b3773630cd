"""The reaper: acknowledged items are deleted off the consumer's thread, space released after."""

from __future__ import annotations

import itertools
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from mounts import nfs_like
from waiting import wait_until

from cachepipe.cache.eviction import deleters_for
from cachepipe.filesystems import mount_of
from cachepipe.fscalls import filesystem_at, filesystem_type
from cachepipe.removal import Reaper, rmtree, tree_bytes


def _item(root, name: str, size: int) -> str:
    path = root / name
    (path / "sub").mkdir(parents=True)
    (path / "sub" / "f").write_bytes(b"x" * size)
    return str(path)


def test_reaper_deletes_in_order_and_releases_each_size_after_its_files_are_gone(tmp_path):
    released = []

    def release(size: int, left: int) -> None:
        released.append((size, left, os.path.lexists(tmp_path / f"i{size}")))

    reaper = Reaper(release)
    for size in (1, 2, 3):
        assert reaper.put(_item(tmp_path, f"i{size}", size), size)
    reaper.stop()  # drains the queue before it returns
    assert released == [(1, 0, False), (2, 0, False), (3, 0, False)]
    assert os.listdir(tmp_path) == []
    assert not any(t.name == "cachepipe-reaper" for t in threading.enumerate())


def test_reaper_refuses_work_once_stopped_and_starts_no_thread_for_nothing(tmp_path):
    reaper = Reaper(lambda size, left: None)  # noqa: ARG005 - stands in for a callable with this signature
    reaper.stop()
    assert not reaper.put(_item(tmp_path, "late", 1), 1)  # the caller deletes it itself
    assert os.path.exists(tmp_path / "late")
    assert not any(t.name == "cachepipe-reaper" for t in threading.enumerate())
    reaper.stop()  # idempotent


def test_tree_bytes_counts_each_file_once_never_follows_a_link_and_leaves_out_what_it_is_told(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (outside / "big").write_bytes(b"x" * 1000)
    (root / "top").write_bytes(b"x" * 1)
    (root / "a" / "f").write_bytes(b"x" * 10)
    (root / "a" / "b" / "g").write_bytes(b"x" * 100)
    (root / "a" / "to-dir").symlink_to(outside, target_is_directory=True)
    (root / "to-file").symlink_to(outside / "big")
    assert tree_bytes(root) == 111
    assert tree_bytes(root, skip={"a/b"}) == 11
    assert tree_bytes(root, skip={"a", "top"}) == 0
    assert tree_bytes(root / "top") == 0  # a file is no tree (as os.walk had it)
    assert tree_bytes(tmp_path / "missing") == 0


def test_tree_bytes_counts_a_file_with_holes_at_what_the_disk_gave_it_when_asked(tmp_path):
    # A download whose parts came out of order has holes: it takes less of the free space than
    # its size, which is what a share of the disk adds back as room (room_at).
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(4 * 1024 * 1024)
        f.seek(1024 * 1024)
        f.write(b"x" * 4096)
    (tmp_path / "dense").write_bytes(b"x" * 5000)
    assert tree_bytes(tmp_path) == 4 * 1024 * 1024 + 5000
    given = os.stat(tmp_path / "sparse").st_blocks * 512
    assert 0 < given < 1024 * 1024  # the file system keeps holes (tmp_path's does)
    assert tree_bytes(tmp_path, allocated=True) == given + 5000


def test_rmtree_of_a_missing_path_is_a_no_op(tmp_path):
    rmtree(tmp_path / "missing")
    rmtree(str(tmp_path / "missing"))


def test_rmtree_by_names_deletes_whatever_the_consumer_left_in_the_folder(tmp_path):
    """The names given are unlinked without listing the folder; whatever else is there (a file
    added, a folder in place of a name, a name already gone) is found by listing it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"mine")
    cases = {
        "exactly": ["a", "b"],
        "added": ["a", "b", "extra"],
        "gone": ["b"],
        "folder": ["b"],  # "a" is a folder with a file in it
        "link": ["b"],  # "a" is a link to a folder outside
    }
    for case, files in cases.items():
        item = tmp_path / case
        item.mkdir()
        for name in files:
            (item / name).write_bytes(b"x")
        if case == "folder":
            (item / "a").mkdir()
            (item / "a" / "f").write_bytes(b"x")
        if case == "link":
            (item / "a").symlink_to(outside, target_is_directory=True)
        rmtree(item, ("a", "b"))
        assert not os.path.lexists(item), case
    assert (outside / "keep").read_bytes() == b"mine"


@pytest.mark.parametrize("where", ["top", "nested"])
@pytest.mark.parametrize("caller", ["rmtree", "staging.clear", "remove_slot"])
def test_a_folder_whose_listed_file_is_removed_meanwhile_is_deleted(tmp_path, where, caller):
    """On NFS a removed file still open stays listed as ``.nfsXXXX`` until its last close, when
    the client removes it: a deletion that listed it and then unlinks it met ENOENT. The reaper
    took that for a failed deletion (an ERROR, the folder left in staging until the next open:
    test_an_item_acknowledged_while_its_file_is_open_on_nfs_frees_its_room_once_closed failed on
    the FUSE mount, 2 runs of 2), an open clearing staging then failed (FileExistsError at its
    mkdir), and map's slot removal raised it. A profile hook removes a listed file (``.nfs1``)
    just before the first unlink, as that last close does."""
    from cachepipe.cache.staging import clear
    from cachepipe.map.job import remove_slot

    call = {"rmtree": rmtree, "staging.clear": clear, "remove_slot": remove_slot}[caller]
    item = tmp_path / "item"
    folder = item / "sub" if where == "nested" else item
    folder.mkdir(parents=True)
    for name in ("a", ".nfs1", "z"):
        (folder / name).write_bytes(b"x")
    gone = threading.Event()

    def hook(frame, event: str, arg: object) -> None:
        if event == "c_call" and getattr(arg, "__name__", None) == "unlink" and not gone.is_set():
            gone.set()
            os.unlink(folder / ".nfs1")  # (a profile hook is not called inside itself)

    sys.setprofile(hook)
    try:
        call(item)
    finally:
        sys.setprofile(None)
    assert gone.is_set()
    if caller == "staging.clear":  # made anew, empty
        assert os.listdir(item) == [] and os.listdir(tmp_path) == ["item"]
    else:
        assert not os.path.lexists(item)


def test_rmtree_by_names_never_follows_a_link_in_place_of_the_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "a").write_bytes(b"mine")
    (tmp_path / "item").symlink_to(outside, target_is_directory=True)
    rmtree(tmp_path / "item", ("a",))
    assert not os.path.lexists(tmp_path / "item")
    assert (outside / "a").read_bytes() == b"mine"


SHM = "/dev/shm"  # noqa: S108 - tmpfs on every Linux: the memory file system case
MOUNTINFO = """\
22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 22 0:21 / /dev/shm rw,nosuid,nodev shared:2 - tmpfs tmpfs rw
30 22 0:30 / /mnt/data rw - xfs /dev/nvme0n1 rw
31 30 0:31 / /mnt/data/fast rw - tmpfs tmpfs rw
32 30 0:32 / /mnt/data/fast rw - ramfs ramfs rw
33 22 0:33 / /mnt/with\\040space rw - tmpfs tmpfs rw
34 22 0:34 / /mnt/over/fast rw - tmpfs tmpfs rw
35 22 0:35 / /mnt/over rw - xfs /dev/nvme1n1 rw
36 22 0:36 / /mnt/nbsp\xa0x rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "fstype"),
    [
        ("/", "ext4"),
        ("/home/u/cache", "ext4"),
        (f"{SHM}/cache", "tmpfs"),
        ("/mnt/data", "xfs"),
        ("/mnt/database/cache", "ext4"),  # starts like /mnt/data, is not under it
        ("/mnt/data/fast/c", "ramfs"),  # mounted twice on one point: the last mount is the one seen
        ("/mnt/with space/c", "tmpfs"),
        ("/mnt/nbsp\xa0x/c", "tmpfs"),  # fields are split at spaces only
        ("/mnt/nbsp/c", "ext4"),
    ],
)
def test_the_file_system_of_a_path_is_its_longest_mount_point(path, fstype):
    assert filesystem_type(path, MOUNTINFO) == fstype


def test_the_file_system_of_a_path_is_its_devices_mount_where_it_is_listed():
    """/mnt/over was mounted over /mnt/over/fast: a path under both is on the later mount,
    which only its device number tells (st_dev, "major:minor" in mountinfo)."""
    assert filesystem_type("/mnt/over/fast/c", MOUNTINFO, "0:35") == "xfs"
    assert filesystem_type("/mnt/over/fast/c", MOUNTINFO) == "tmpfs"  # by the mount point alone
    assert filesystem_type("/mnt/data/c", MOUNTINFO, "9:99") == "xfs"  # a device not listed: by the mount point


def test_the_mount_of_a_path_is_named_by_its_point():
    """A bind mount of a folder of the root filesystem (254:0) on /srv/vol is listed with the
    root's device: the longest point of that device holds the path. A btrfs subvolume's files
    have a device listed nowhere: the longest mount point holds them."""
    binds = MOUNTINFO + "40 22 254:0 /srv/x /srv/vol rw - ext4 /dev/vda rw\n41 22 0:50 / /mnt/b rw - btrfs /dev/vdb rw\n"
    assert mount_of("/srv/vol/cache", binds, "254:0") == ("/srv/vol", "ext4")
    assert mount_of("/mnt/b/subvol/cache", binds, "0:51") == ("/mnt/b", "btrfs")
    assert mount_of("/mnt/over/fast/c", binds, "0:35") == ("/mnt/over", "xfs")  # the later mount, hiding the longer
    assert mount_of("/x", "") == ("", "")


def test_two_deleters_on_memory_file_systems_and_four_elsewhere():
    assert [deleters_for(t) for t in ("tmpfs", "ramfs", "ext4", "xfs", "")] == [2, 2, 4, 4, 4]
    assert filesystem_type("/x", "") == "" and filesystem_type("/x", "garbage line\n") == ""
    assert filesystem_at(SHM) == "tmpfs"  # read from this machine's mounts, where /dev/shm is tmpfs


def publish_all(cache, catalog) -> None:
    """Recover ``cache`` (opened) over ``catalog`` from nothing, and publish each item (a file
    ``f`` of 10 bytes), in catalog order."""
    cache.recover(catalog, resume=False)
    for step, item in enumerate(catalog):
        assert cache.acquire(item, step) is True
        staged = Path(cache.stage(item))
        (staged / "f").write_bytes(b"x" * 10)
        cache.publish(staged, item)


@pytest.mark.parametrize("where", ["tmp_path", SHM])
def test_only_a_few_threads_delete_acknowledged_items_at_once(where, tmp_path):
    """Eight threads acknowledge an item each at once, as the daemon's request threads do, and
    only as many as suit the file system delete at once (:func:`deleters_for`: the daemon's
    batched hand-out ran 1.5-1.7 times as fast on tmpfs; benchmarks/README.md). A profile hook holds
    each thread in the ``rmdir`` that ends an item's deletion until as many as allowed have been in
    it at once (however late a stalled machine lets them come), then 0.5 s longer or until one more
    than allowed is in it: without the limit the others meet them there."""
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    root = tmp_path / "c" if where == "tmp_path" else Path(tempfile.mkdtemp(dir=where)) / "c"
    inside = most = 0
    met = threading.Condition()
    try:
        allowed = deleters_for(filesystem_at(str(root.parent)))
        catalog = Catalog(mode="folders")
        for i in range(8):
            catalog.add(f"i{i}", [("f", 10, None)])
        cache = Cache(root, 1 << 20)
        cache.open()

        def hook(frame, event: str, arg: object) -> None:
            nonlocal inside, most
            if getattr(arg, "__name__", None) != "rmdir":
                return
            with met:
                if event == "c_call":
                    inside += 1
                    most = max(most, inside)
                    met.notify_all()
                    # hold until the allowed number met (bounded: a limit set too low fails below) ...
                    met.wait_for(lambda: most >= allowed or inside > allowed, timeout=30)
                    # ... and a little longer, the others' chance to come in too if nothing stops them
                    met.wait_for(lambda: inside > allowed, timeout=0.5)
                elif event in ("c_return", "c_exception"):
                    inside -= 1

        try:
            publish_all(cache, catalog)
            start = threading.Barrier(8, timeout=30)

            def ack(step: int) -> None:
                sys.setprofile(hook)  # this thread's calls only
                start.wait()
                cache.evict_many([(f"i{step}", 0, step)])
                sys.setprofile(None)

            threads = [threading.Thread(target=ack, args=(step,)) for step in range(8)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            assert not any(thread.is_alive() for thread in threads)
            assert most == allowed  # as many at once as allowed, never more
            assert not cache.record.published
            assert sorted(os.listdir(root)) == [".cachepipe"]
        finally:
            cache.close()
    finally:
        if where != "tmp_path":
            shutil.rmtree(root.parent)


def test_close_waits_for_the_deletion_of_items_acknowledged_before(tmp_path):
    """A daemon's reload closes a pipeline while a request thread may still delete the items of
    acks journaled before: their files must go while the cache is still owned, not under the
    next owner's recovery. A profile hook holds the ack's ``rmdir`` until close has waited."""
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog(mode="folders")
    catalog.add("i0", [("f", 10, None)])
    root = tmp_path / "c"
    cache = Cache(root, 1 << 20)
    cache.open()
    held, go = threading.Event(), threading.Event()

    def hook(frame, event: str, arg: object) -> None:
        if event == "c_call" and getattr(arg, "__name__", None) == "rmdir":
            held.set()
            go.wait(30)

    def ack() -> None:
        sys.setprofile(hook)
        cache.evict_many([("i0", 0, 0)])
        sys.setprofile(None)

    cache.recover(catalog, resume=False)
    item = catalog[0]
    assert cache.acquire(item, 0) is True
    staged = Path(cache.stage(item))
    (staged / "f").write_bytes(b"x" * 10)
    cache.publish(staged, item)
    acker, closer = threading.Thread(target=ack), threading.Thread(target=cache.close)
    acker.start()
    try:
        assert held.wait(30)
        closer.start()
        closer.join(0.3)
        assert closer.is_alive()  # waiting for the deletion
    finally:
        go.set()
        acker.join(30)
        if closer.ident is None:  # never started: close here
            cache.close()
        else:
            closer.join(30)
    assert not acker.is_alive() and not closer.is_alive()
    assert not (root / "i0").exists()


def held_in_first_rmdir(
    target, held: threading.Event, go: threading.Event, failed: list[BaseException], waiting: threading.Event | None = None
) -> threading.Thread:
    """``target`` in a thread whose first ``rmdir`` waits for ``go`` (``held`` set then); what it
    raises is put in ``failed``. ``waiting``: set when the thread blocks in a condition's wait."""

    def hook(frame, event, arg) -> None:
        if event != "c_call":
            return
        name = getattr(arg, "__name__", None)
        if name == "rmdir" and not held.is_set():
            held.set()
            go.wait(30)
        elif waiting is not None and name == "acquire" and frame.f_code.co_name == "wait":
            waiting.set()  # Condition.wait, about to block

    def run() -> None:
        sys.setprofile(hook)
        try:
            target()
        except Exception as exc:  # noqa: BLE001 - what it raised, checked by the caller
            failed.append(exc)
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("ends", ["ack", "drop"])
def test_an_item_ended_while_close_deletes_the_rest_is_deleted_once_before_close_lets_the_cache_go(tmp_path, ends):
    """A job deleted while a lane consumes (`cachepipe delete-job --force`; a daemon's pipeline
    closed without keep_on_close while a client acks): close deletes the published items it
    listed, and one of them acknowledged meanwhile was looked up again (KeyError): the close
    failed half done, the other items left on disk, the store not closed. And the ack's own
    deletion must end before close lets the cache go; so must a drop's, a node's lane that
    waits for room giving back an item planned ahead for another lane (``Cache.give_up``: close
    let the cache go, the journal closed and the folder's lock released for the job registered
    again, while the drop still deleted, whose journal record then failed). Profile hooks hold
    close in the deletion of its first item while another thread ends the last, hold that
    deletion, and let it go once close has ended or waits."""
    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog(mode="folders")
    for name in ("i0", "i1", "i2"):
        catalog.add(name, [("f", 10, None)])
    root = tmp_path / "c"
    cache = Cache(root, 1 << 20)
    cache.open()
    publish_all(cache, catalog)
    end = (lambda: cache.evict_many([("i2", 0, 2)])) if ends == "ack" else (lambda: cache.give_up("i2"))
    failed: list[BaseException] = []
    closing, close_go, close_waits, ending, end_go = (threading.Event() for _ in range(5))
    closer = held_in_first_rmdir(cache.close, closing, close_go, failed, close_waits)
    try:
        assert closing.wait(30)  # close holds the list of items it deletes, and deletes the first
        close_waits.clear()  # (its first wait, for acks begun before it, is behind it)
        ender = held_in_first_rmdir(end, ending, end_go, failed)
        assert ending.wait(30)  # i2 acknowledged or dropped, its files being deleted
        close_go.set()
        wait_until(lambda: not closer.is_alive() or close_waits.is_set(), what="close to end or to wait")
        assert closer.is_alive() and cache._lock.held  # waiting for that deletion
    finally:
        close_go.set()
        end_go.set()
        closer.join(30)
        ender.join(30)
    assert not closer.is_alive() and not ender.is_alive() and failed == []
    assert sorted(os.listdir(root)) == [".cachepipe"]  # every item gone
    assert not cache._lock.held  # released: the next owner can open it


def _folders(root: Path, count: int, size: int) -> str:
    for i in range(count):
        (root / f"f{i:02d}").mkdir(parents=True)
        (root / f"f{i:02d}" / "a.bin").write_bytes(bytes([i]) * size)
    return root.as_uri() + "/"


@pytest.mark.parametrize("size", [20_000, 1 << 20], ids=["in place", "by the reaper"])
def test_an_item_acknowledged_while_its_file_is_open_on_nfs_frees_its_room_once_closed(tmp_path, size):
    """On NFS a removed file that is still open stays in its folder (``.nfsXXXX``, whose removal
    is refused with ``EBUSY``) until it is closed, so the folder of an item acknowledged while
    its consumer still reads it cannot be deleted then. Each such item was counted as foreign
    bytes until the next open: a consumer that closes an item's file after taking the next one
    shrank the cache by an item per item, until the next did not fit and the pipeline raised
    OversizeError ("larger than the cache capacity less ... taken by other files"). Now the
    reaper deletes it once the file is closed, and its room comes back. On a FUSE file system
    that keeps removed open files as NFS does (``tests/nfslike.py``)."""
    from cachepipe import Pipeline

    source = _folders(tmp_path / "src", 12, size)
    with nfs_like(tmp_path / "nfs") as nfs, Pipeline(source, nfs / "c", capacity=f"{9 * size}B", auto_ack=False) as pipe:
        staging = nfs / "c" / ".cachepipe" / "staging"
        held = None
        names = []
        while (item := pipe.get(timeout=60)) is not None:
            reading = open(Path(item.path) / "a.bin", "rb")  # noqa: SIM115 - held past the ack, closed below
            pipe.ack(item)  # while its file is open
            if held is not None:
                held.close()  # the previous item's, once the next one is taken
            held = reading
            names.append(item.name)
        held.close()
        assert names == [f"f{i:02d}" for i in range(12)]
        wait_until(lambda: not os.listdir(staging), 60, "every acknowledged item deleted from staging")


def test_a_held_path_is_tried_again_soon_then_at_waits_that_double_up_to_retry_seconds():
    """What a deletion left because a file of it is open (NFS's ``.nfsXXXX``) was tried again
    once a second, so a download waiting for its room waited up to a second after the file was
    closed (a consumer that closes each file at its next step: a take in five about 1 s on
    ``tests/nfslike.py``, ``benchmarks/bench_held_retry.py``). Now each path's first try comes
    after a few hundredths of a second, and each wait doubles up to ``RETRY_SECONDS``."""
    from cachepipe.removal import RETRY_SECONDS, retry_delay

    waits = [retry_delay(tries) for tries in range(12)]
    assert 0 < waits[0] <= 0.05
    assert all(b == min(2 * a, RETRY_SECONDS) for a, b in itertools.pairwise(waits))
    assert waits[-1] == RETRY_SECONDS == retry_delay(10**6)  # a path held for days: once a second, no overflow


def test_a_deletion_refused_for_a_file_still_open_on_nfs_is_tried_again_soon_then_less_often(tmp_path, caplog):
    """The reaper tries again what a deletion left because a file of it is still open (on NFS
    a removed open file stays in its folder as ``.nfsXXXX``) on each path's own schedule
    (``retry_delay``): tries while the file is open come at waits that double from a few
    hundredths of a second (they came once a second, the first a second after the deletion), and
    the held bytes are released by a try after the file is closed. Counted by the tries the
    reaper logs at debug level. On ``tests/nfslike.py``."""
    caplog.set_level(logging.DEBUG, logger="cachepipe.cache")
    holds: list[tuple[int, int]] = []

    def tries(outcome: str) -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.msg.startswith(f"{outcome} %s at try")]

    with nfs_like(tmp_path / "nfs") as nfs:
        item = _item(nfs, "i", 20_000)
        reading = open(Path(item) / "sub" / "f", "rb")  # noqa: SIM115 - held past the deletion, closed below
        reaper = Reaper(lambda size, left: None, hold=lambda change, left: holds.append((change, left)))  # noqa: ARG005
        try:
            assert reaper.put(item, 20_000)
            wait_until(lambda: len(tries("could not delete")) >= 3, 60, "three tries again while the file is open")
            reading.close()
            wait_until(lambda: tries("deleted"), 60, "a try again after the file closed")
        finally:
            reading.close()
            reaper.stop()
        assert not os.path.exists(item)
    held = holds[0][0]
    assert held > 0 and holds == [(held, 0), (-held, 0)]  # held, then released (not left as foreign by stop)
    waited = [r.args[2] for r in tries("could not delete") + tries("deleted")]  # type: ignore[index]
    first = waited[0]
    assert 0 < first <= 0.05 and waited[:3] == [first, 2 * first, 4 * first]
    assert [r.args[1] for r in tries("could not delete")][:3] == [1, 2, 3]  # type: ignore[index]


def test_a_cache_reopened_on_nfs_while_a_file_of_a_deleted_item_is_still_open_opens(tmp_path):
    """A pipeline closed while its consumer still holds a file of an item open (a notebook's
    array of it, a DataLoader worker not yet gone): on NFS the item's folder cannot be deleted
    (``.nfsXXXX``) and stays in the staging folder. The next open of that cache directory
    (a new Pipeline, the daemon's reload) removed staging first and failed on it with a bare
    "[Errno 16] Device or resource busy: '.nfs...'". Now what cannot be deleted is set aside
    beside staging, and a later open deletes it. On ``tests/nfslike.py``."""
    from cachepipe import Pipeline

    source = _folders(tmp_path / "src", 3, 20_000)
    with nfs_like(tmp_path / "nfs") as nfs:
        state = nfs / "c" / ".cachepipe"
        with Pipeline(source, nfs / "c", capacity="1MiB", auto_ack=False) as pipe:
            item = pipe.get(timeout=60)
            reading = open(Path(item.path) / "a.bin", "rb")  # noqa: SIM115 - held past the close, closed below
        try:
            with Pipeline(source, nfs / "c", capacity="1MiB") as pipe:
                assert [item.name for item in pipe] == ["f00", "f01", "f02"]
        finally:
            reading.close()
        with Pipeline(source, nfs / "c", capacity="1MiB") as pipe:
            assert [item.name for item in pipe] == ["f00", "f01", "f02"]
        assert not [name for name in os.listdir(state) if name.startswith("staging")]  # all gone at the close


def test_a_stale_item_whose_file_is_still_open_on_nfs_does_not_fail_the_next_open(tmp_path):
    """An item kept at close (``keep_on_close``) whose object changed since is stale at the next
    open, which deletes it; on NFS a file of it that a reader still holds (a process of the
    earlier run not yet gone) stays in its folder as ``.nfsXXXX``, and the open failed with a
    bare "[Errno 39] Directory not empty" (or "[Errno 16] Device or resource busy"). Now what cannot be deleted is moved
    aside into staging (counted with the state folder, deleted by a later open) and the item is
    downloaded again. On ``tests/nfslike.py``."""
    from cachepipe import Pipeline

    source = _folders(tmp_path / "src", 3, 20_000)
    with nfs_like(tmp_path / "nfs") as nfs:
        with Pipeline(source, nfs / "c", capacity="1MiB", auto_ack=False, keep_on_close=True) as pipe:
            item = pipe.get(timeout=60)
        reading = open(Path(item.path) / "a.bin", "rb")  # noqa: SIM115 - held past the next open, closed below
        (tmp_path / "src" / "f00" / "a.bin").write_bytes(b"changed")
        try:
            with Pipeline(source, nfs / "c", capacity="1MiB") as pipe:
                got = {item.name: (Path(item.path) / "a.bin").read_bytes() for item in pipe}
        finally:
            reading.close()
        assert sorted(got) == ["f00", "f01", "f02"] and got["f00"] == b"changed"


@pytest.mark.parametrize(
    ("mode", "size"), [("folders", 20_000), ("files", 20_000), ("files", 1 << 20)], ids=["folder", "small file", "large file"]
)
def test_the_room_held_for_an_acknowledged_item_whose_file_is_open_on_nfs_is_all_it_takes(tmp_path, mode, size):
    """While an item acknowledged with its file still open is on disk (on NFS a removed open
    file stays listed, as ``.nfsXXXX``, until it is closed), the ledger holds what is left of
    it, and releases it once the file is closed. For a folder item that was counted as the files
    under the folder but not the folder's own block (four of them: 114688 bytes on disk, 102400
    counted). A single-file item's unlink succeeds: the file stays as ``.nfsXXXX`` beside where
    it was (in staging, or in the cache directory for a small one deleted in place), and its room
    was released at once (four of them: the cache directory held every byte of them beyond what
    the ledger counted). The hard cap is measured as ``tests/sampling.py`` measures it. On
    ``tests/nfslike.py``."""
    from sampling import Sampler

    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog(mode=mode)
    for i in range(4):
        catalog.add(f"i{i}", [("f" if mode == "folders" else "", size, None)])
    with nfs_like(tmp_path / "nfs") as nfs:
        root = nfs / "c"
        cache = Cache(root, 1 << 30)
        cache.open()
        files = []
        try:
            cache.recover(catalog, resume=False)
            for step, item in enumerate(catalog):
                assert cache.acquire(item, step) is True
                staged = Path(cache.stage(item))
                (staged / "f" if mode == "folders" else staged).write_bytes(b"x" * size)
                cache.publish(staged, item)
            on_disk = Sampler(root, block=cache.block)._bytes
            assert on_disk() <= cache.used
            for item in catalog:
                path = root / item.name
                files.append(open(path / "f" if mode == "folders" else path, "rb"))  # noqa: SIM115 - closed below
                cache.evict(item.name)
            wait_until(lambda: cache.ledger.reaping == 0, 60, "the deletions to end or be left to the reaper")
            assert on_disk() <= cache.used  # what is left in staging (or beside it) is counted
            for f in files:
                f.close()
            wait_until(lambda: cache.ledger.reserved == 0, 60, "the room held to be released once the files closed")
            assert on_disk() <= cache.used
        finally:
            for f in files:
                f.close()
            cache.close()


def test_a_resume_beside_a_staging_set_aside_on_nfs_is_planned_as_without_it(tmp_path):
    """A staging that an open could not delete (a file of an acknowledged item still open on
    NFS) is set aside as ``staging.N`` until a later open. It was counted in the state that the
    plan is judged beside, so an item near the limit was left out of the plan while it was
    there and a resume was refused ("holds a pass of another plan: n_items 2 there, 1 here"),
    for a file still open. Now it is left out of the plan's judgement, as the journal's temporary
    file is, and recovery's count skips the item in its turn (on_oversize='skip')."""
    from cachepipe import Pipeline

    mib = 1 << 20
    source = tmp_path / "src"
    for name, size in (("f00", mib), ("f01", 5 * mib // 2)):
        (source / name).mkdir(parents=True)
        (source / name / "a.bin").write_bytes(b"x" * size)
    options = {"capacity": f"{3 * mib}B", "auto_ack": False, "resume": True, "on_oversize": "skip"}
    with nfs_like(tmp_path / "nfs") as nfs:
        with Pipeline(source.as_uri() + "/", nfs / "c", **options) as pipe:
            item = pipe.get(timeout=60)
            reading = open(Path(item.path) / "a.bin", "rb")  # noqa: SIM115 - held past the next open, closed below
            pipe.ack(item)
        try:
            with Pipeline(source.as_uri() + "/", nfs / "c", **options) as pipe:
                assert (nfs / "c" / ".cachepipe" / "staging.1").exists()
                assert [item.name for item in pipe] == []  # f01 does not fit beside it: skipped in its turn
        finally:
            reading.close()


def test_an_item_whose_move_aside_failed_and_that_is_moved_aside_after_all_stays_counted(tmp_path):
    """An acknowledged item is moved aside into staging to be deleted; if that rename fails it
    is deleted in place, and where that fails too because a file of it is still open (NFS), it
    is moved aside after all (``Eviction.remove``). Its room was then released at once, with its
    bytes still in staging until a later open (the cache directory held more than the ledger
    counted). Now it is deleted from there as any item moved aside: held until the file is
    closed. A profile hook makes the first rename fail (a folder with a file where it goes), as a
    transient failure would. On ``tests/nfslike.py``."""
    from sampling import Sampler

    from cachepipe.cache import Cache
    from cachepipe.catalog import Catalog

    catalog = Catalog(mode="folders")
    catalog.add("i0", [("f", 10, None)])  # publish_all's
    blocker: list[Path] = []

    def hook(frame, event: str, arg: object) -> None:
        name = getattr(arg, "__name__", None)
        if event == "c_call" and name == "rename" and frame.f_code.co_name == "move_away" and not blocker:
            blocker.append(Path(frame.f_locals["aside"]))
            (blocker[0] / "in-the-way").mkdir(parents=True)  # renaming a folder onto it fails: ENOTEMPTY

    with nfs_like(tmp_path / "nfs") as nfs:
        root = nfs / "c"
        cache = Cache(root, 1 << 30)
        cache.open()
        reading = None
        try:
            publish_all(cache, catalog)
            reading = open(root / "i0" / "f", "rb")  # noqa: SIM115 - held past the ack, closed below
            sys.setprofile(hook)
            try:
                cache.evict("i0")
            finally:
                sys.setprofile(None)
            assert blocker
            rmtree(blocker[0])
            wait_until(lambda: cache.ledger.reaping == 0, 60, "the deletion to end or be left to the reaper")
            assert Sampler(root, block=cache.block)._bytes() <= cache.used
            reading.close()
            wait_until(lambda: cache.ledger.reserved == 0, 60, "the room released once the file closed")
        finally:
            if reading is not None:
                reading.close()
            cache.close()


def test_many_paths_still_held_when_the_reaper_stops_are_said_in_one_error_line(tmp_path, caplog):
    """Five deleted items whose files a consumer still holds open when the reaper stops (a
    pipeline closed under a notebook's arrays): one ERROR line says how many paths, how many
    bytes and the first; each path at debug level. (Before: an ERROR line per path.) On
    ``tests/nfslike.py``."""
    caplog.set_level(logging.DEBUG, logger="cachepipe.cache")
    holds: list[tuple[int, int]] = []
    with nfs_like(tmp_path / "nfs") as nfs:
        items = [_item(nfs, f"i{n}", 20_000) for n in range(5)]
        reading = [open(Path(item) / "sub" / "f", "rb") for item in items]  # noqa: SIM115 - held past the stop
        reaper = Reaper(lambda size, left: None, hold=lambda change, left: holds.append((change, left)))  # noqa: ARG005
        try:
            for item in items:
                assert reaper.put(item, 20_000)
            wait_until(lambda: len(holds) == 5, 60, "five paths held")
            reaper.stop()
        finally:
            for f in reading:
                f.close()
            reaper.stop()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    left = -sum(change for change, _ in holds[5:])
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"could not delete 5 paths at the reaper's stop ({left} bytes left, counted as foreign")
    each = [
        r
        for r in caplog.records
        if r.levelno == logging.DEBUG and re.fullmatch(r"could not delete \S+ \(\d+ bytes left\)", r.getMessage())
    ]
    assert len(each) == 5, [r.getMessage() for r in caplog.records]
