"""The per-item file calls: every set behaves as :mod:`os` does; a cache on a memory file system
uses the set that keeps the interpreter's lock, one on a local disk keeps it while the calls are
quick (the speed is measured in benchmarks/, not here)."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import fsspec
import pytest

from cachepipe import Pipeline, fscalls
from cachepipe.cache import Cache
from cachepipe.fscalls import filesystem_at

SHM = "/dev/shm"  # noqa: S108 - tmpfs on every Linux: the memory file system case
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
SETS = {
    "releasing": fscalls.RELEASING,
    "holding": fscalls.HOLDING,
    "while quick": None if fscalls.HOLDING is None else fscalls.WhileQuick(fscalls.HOLDING).calls,
}


@pytest.fixture(params=SETS)
def calls(request) -> fscalls.FileCalls:
    assert SETS[request.param] is not None, "this C library has every call (glibc 2.28+)"
    return SETS[request.param]


def test_the_set_that_keeps_the_lock_exists_on_linux():
    assert sys.platform != "linux" or fscalls.HOLDING is not None


@pytest.mark.parametrize(
    ("fstype", "kind"),
    [
        ("tmpfs", "holding"),
        ("ramfs", "holding"),
        ("ext4", "while quick"),
        ("xfs", "while quick"),
        ("btrfs", "while quick"),
        ("nfs4", "releasing"),
        ("fuse.s3fs", "releasing"),
        ("", "releasing"),
    ],
)
def test_a_memory_file_system_keeps_the_lock_a_disk_while_quick_others_let_it_go(fstype, kind):
    calls = fscalls.file_calls_for(fstype)
    if kind == "while quick":
        assert isinstance(calls.open.__self__, fscalls.WhileQuick)  # type: ignore[attr-defined]
        assert calls != fscalls.file_calls_for(fstype)  # each cache its own recent mean
    else:
        assert calls is SETS[kind]


class FakeClock:
    """A clock that moves only when told (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fake_sets(clock: FakeClock, took: dict[str, float], used: list[str]) -> tuple[fscalls.FileCalls, fscalls.FileCalls]:
    """A held and a releasing set whose calls note in ``used`` which set served them; a held call
    moves ``clock`` by ``took[name]`` seconds (default 10 us), raises it if it is an exception,
    or calls it if it is a function."""

    def held(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            used.append(f"held {name}")
            spent = took.get(name, 10e-6)
            if isinstance(spent, BaseException):
                raise spent
            if callable(spent):
                spent()
            else:
                clock.now += spent
            return 1

        return call

    def releasing(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            used.append(f"releasing {name}")
            return 1

        return call

    names = fscalls.FileCalls._fields
    return fscalls.FileCalls(*(held(n) for n in names)), fscalls.FileCalls(*(releasing(n) for n in names))


def test_recent_mean_counts_a_rare_slow_call_as_bounded_and_follows_a_steady_one():
    mean = 0.0
    for _ in range(500):
        mean = fscalls.recent_mean(mean, 5e-6)
    assert mean == pytest.approx(5e-6, rel=1e-3)
    after_outlier = fscalls.recent_mean(mean, 2.0)  # a 2 s call counts as 4 x the limit
    assert after_outlier == pytest.approx(mean + (4 * fscalls.HOLD_MEAN_MAX_S - mean) * fscalls.HOLD_MEAN_WEIGHT)
    assert not fscalls.held_too_long(after_outlier, 0.0)
    for _ in range(500):
        mean = fscalls.recent_mean(mean, 3 * fscalls.HOLD_MEAN_MAX_S)
    assert fscalls.held_too_long(mean, 0.0)
    assert fscalls.held_too_long(0.0, fscalls.HOLD_DEBT_MAX_S * 1.01)
    assert not fscalls.held_too_long(fscalls.HOLD_MEAN_MAX_S, fscalls.HOLD_DEBT_MAX_S)


def test_the_debt_counts_slow_calls_only_and_drains_with_time():
    slow = 2 * fscalls.HOLD_SLOW_S
    assert fscalls.lock_debt(0.0, fscalls.HOLD_SLOW_S, 0.0) == 0.0  # not slow
    assert fscalls.lock_debt(0.0, slow, 0.0) == slow
    assert fscalls.lock_debt(0.005, slow, 0.1) == pytest.approx(0.005 - 0.1 * fscalls.HOLD_DEBT_DRAIN + slow)
    assert fscalls.lock_debt(0.005, 0.0, 3600.0) == 0.0  # not below 0
    assert fscalls.lock_debt(0.005, 0.0, math.inf) == 0.0  # the first call


def test_a_journal_commit_every_few_seconds_never_trips_the_rule():
    """40,000 quick calls a second (5 us) for a minute, and one 7 ms wait every 5 s (a journaled
    ext4's commit): the lock stays kept; with the waits every 0.2 s (3.5% of the time) it does not."""

    def trips(every_s: float) -> bool:
        mean = debt = 0.0
        for i in range(60 * 40_000):
            took = 0.007 if i % int(every_s * 40_000) == 0 else 5e-6
            mean, debt = fscalls.recent_mean(mean, took), fscalls.lock_debt(debt, took, 1 / 40_000)
            if fscalls.held_too_long(mean, debt):
                return True
        return False

    assert not trips(5.0)
    assert trips(0.2)


def test_the_lock_kept_in_slow_calls_before_a_pause_is_bounded():
    """However slow the calls, a pause begins once the lock was kept about 70 ms in slow calls,
    plus the one call that ends it."""
    for took in (60e-6, 0.3e-3, 0.9e-3, 1.5e-3, 5e-3, 0.019, 0.1, 2.0):
        clock, used = FakeClock(), []
        held, releasing = fake_sets(clock, {"open": took}, used)
        calls = fscalls.WhileQuick(held, releasing, clock).calls
        for _ in range(2000):
            calls.open("a", 0, 0o666)
        kept = used.index("releasing open")
        assert (kept - 1) * took <= 0.07, (took, kept)


def test_calls_keep_the_lock_while_quick_and_let_it_go_for_a_pause_after_a_slow_one():
    clock, took, used = FakeClock(), {}, []
    held, releasing = fake_sets(clock, took, used)
    calls = fscalls.WhileQuick(held, releasing, clock).calls
    calls.open("a", 0, 0o666)
    calls.pwrite(3, b"x" * fscalls.HOLD_MAX_WRITE, 0)
    calls.pwrite(3, b"x" * (fscalls.HOLD_MAX_WRITE + 1), 0)  # a large write lets it go anyway, untimed
    calls.close(3)
    calls.rename_new("a", "b")
    calls.mkdir("d", 0o777)
    assert used == ["held open", "held pwrite", "releasing pwrite", "held close", "held rename_new", "held mkdir"]

    used.clear()
    took["rename_new"] = fscalls.HOLD_DEBT_MAX_S * 1.5  # one call waits: the calls after it let the lock go
    calls.rename_new("a", "b")
    slow_ended = clock.now
    calls.open("a", 0, 0o666)
    clock.now = slow_ended + fscalls.HOLD_PAUSE_S - 0.001
    calls.close(3)
    del took["rename_new"]
    clock.now = slow_ended + fscalls.HOLD_PAUSE_S  # the pause is over: kept again
    calls.close(3)
    assert used == ["held rename_new", "releasing open", "releasing close", "held close"]


def test_a_steady_mean_over_the_limit_lets_the_lock_go_and_after_the_pause_quick_calls_keep_it():
    clock, took, used = FakeClock(), {"open": 2 * fscalls.HOLD_MEAN_MAX_S}, []
    held, releasing = fake_sets(clock, took, used)
    calls = fscalls.WhileQuick(held, releasing, clock).calls
    for _ in range(200):
        calls.open("a", 0, 0o666)
    first_released = used.index("releasing open")
    assert 10 < first_released < 200  # a few dozen such calls (none slow) lift the mean over the limit
    assert set(used[first_released:]) == {"releasing open"}
    used.clear()
    clock.now += fscalls.HOLD_PAUSE_S
    took["open"] = 5e-6
    for _ in range(3):
        calls.open("a", 0, 0o666)
    assert used == ["held open"] * 3  # the mean starts again from 0 after a pause


def test_a_failed_call_is_timed_too():
    clock, used = FakeClock(), []
    took: dict[str, Any] = {"open": FileNotFoundError(errno.ENOENT, "no")}
    held, releasing = fake_sets(clock, took, used)
    calls = fscalls.WhileQuick(held, releasing, clock).calls
    with pytest.raises(FileNotFoundError):
        calls.open("a", 0, 0o666)
    took["open"] = fscalls.HOLD_DEBT_MAX_S * 2
    calls.open("a", 0, 0o666)
    calls.open("a", 0, 0o666)
    assert used == ["held open", "held open", "releasing open"]


def test_slow_again_soon_after_a_pause_doubles_it_and_a_quiet_while_resets_it():
    clock, took, used = FakeClock(), {"open": fscalls.HOLD_DEBT_MAX_S * 2}, []
    held, releasing = fake_sets(clock, took, used)
    calls = fscalls.WhileQuick(held, releasing, clock).calls
    calls.open("a", 0, 0o666)  # slow: a pause of HOLD_PAUSE_S
    clock.now += fscalls.HOLD_PAUSE_S
    calls.open("a", 0, 0o666)  # kept again, and slow at once: twice as long
    clock.now += fscalls.HOLD_PAUSE_S
    calls.open("a", 0, 0o666)
    clock.now += fscalls.HOLD_PAUSE_S
    calls.open("a", 0, 0o666)  # the doubled pause is over: slow again, four times as long
    assert used == ["held open", "held open", "releasing open", "held open"]

    used.clear()
    clock.now += 4 * fscalls.HOLD_PAUSE_S
    took["open"] = 5e-6
    calls.open("a", 0, 0o666)  # quick calls for a pause's length
    clock.now += fscalls.HOLD_PAUSE_S
    took["open"] = fscalls.HOLD_DEBT_MAX_S * 2
    calls.open("a", 0, 0o666)  # slow after a quiet while: the first pause's length again
    clock.now += fscalls.HOLD_PAUSE_S
    calls.open("a", 0, 0o666)
    assert used == ["held open", "held open", "held open"]


def test_a_pause_is_begun_once_when_two_threads_find_it_due():
    """A held call during which another thread's slow call begins a pause (simulated: the call
    makes that other call itself): when it ends slow too, the pause is not doubled."""
    clock, used = FakeClock(), []
    calls_box: list[fscalls.FileCalls] = []

    def slow_and_another_inside() -> None:
        clock.now += fscalls.HOLD_DEBT_MAX_S * 2
        calls_box[0].mkdir("d", 0o777)  # "another thread's" slow call, ending inside this one

    took: dict[str, Any] = {"mkdir": fscalls.HOLD_DEBT_MAX_S * 2, "open": slow_and_another_inside}
    held, releasing = fake_sets(clock, took, used)
    calls_box.append(fscalls.WhileQuick(held, releasing, clock).calls)
    calls = calls_box[0]
    calls.open("a", 0, 0o666)
    paused_at = clock.now
    clock.now = paused_at + fscalls.HOLD_PAUSE_S - 0.001
    calls.close(3)
    clock.now = paused_at + fscalls.HOLD_PAUSE_S + 0.001  # one pause of HOLD_PAUSE_S, not two
    calls.close(3)
    assert used == ["held open", "held mkdir", "releasing close", "held close"]


@pytest.mark.parametrize("size", [0, 1, 4096, fscalls.HOLD_MAX_WRITE, fscalls.HOLD_MAX_WRITE + 1, 3 * 2**20])
@pytest.mark.parametrize("view", [False, True], ids=["bytes", "memoryview"])
def test_a_file_is_created_written_at_offsets_and_closed(tmp_path, calls, size, view):
    data = os.urandom(size)
    path = str(tmp_path / "f")
    fd = calls.open(path, CREATE, 0o640)
    try:
        half = size // 2
        first, second = (memoryview(data)[:half], memoryview(data)[half:]) if view else (data[:half], data[half:])
        assert calls.pwrite(fd, second, half) == size - half  # the second half first: offsets, not a position
        assert calls.pwrite(fd, first, 0) == half
    finally:
        calls.close(fd)
    assert Path(path).read_bytes() == data
    assert os.stat(path).st_mode & 0o777 == 0o640 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_errors_are_raised_as_os_raises_them(tmp_path, calls):
    missing = str(tmp_path / "no" / "f")
    with pytest.raises(FileNotFoundError) as info:
        calls.open(missing, CREATE, 0o666)
    assert (info.value.errno, info.value.filename) == (errno.ENOENT, missing)

    path = str(tmp_path / "f")
    calls.close(calls.open(path, CREATE, 0o666))
    with pytest.raises(FileExistsError) as exists:
        calls.open(path, CREATE, 0o666)
    assert exists.value.filename == path

    fd = os.open(path, os.O_RDONLY)
    with pytest.raises(OSError) as unwritable:  # noqa: PT011 - the errno is checked
        calls.pwrite(fd, b"x", 0)
    assert unwritable.value.errno == errno.EBADF
    calls.close(fd)
    with pytest.raises(OSError) as closed:  # noqa: PT011 - the errno is checked
        calls.close(fd)
    assert closed.value.errno == errno.EBADF


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh folder on tmpfs, removed after the test."""
    path = Path(tempfile.mkdtemp(dir=SHM))
    yield path
    shutil.rmtree(path)


def test_descriptors_are_not_inherited_and_a_nul_in_a_path_is_refused(tmp_path, calls):
    fd = calls.open(str(tmp_path / "f"), os.O_WRONLY | os.O_CREAT, 0o666)  # no O_CLOEXEC asked for
    try:
        assert not os.get_inheritable(fd)
    finally:
        calls.close(fd)
    for call in (lambda: calls.open(f"{tmp_path}/a\0b", CREATE, 0o666), lambda: calls.mkdir(f"{tmp_path}/a\0b", 0o777)):
        with pytest.raises(ValueError, match="null"):
            call()
    with pytest.raises(ValueError, match="null"):
        calls.rename_new(str(tmp_path / "f"), f"{tmp_path}/a\0b")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_folder_is_made_once(tmp_path, calls):
    path = str(tmp_path / "d")
    calls.mkdir(path, 0o750)
    assert os.stat(path).st_mode & 0o777 == 0o750 & ~_umask()
    with pytest.raises(FileExistsError) as exists:
        calls.mkdir(path, 0o777)
    assert exists.value.filename == path
    with pytest.raises(FileNotFoundError):
        calls.mkdir(str(tmp_path / "no" / "d"), 0o777)


@pytest.mark.parametrize("where", ["tmpfs", "tmp_path"])
def test_a_cache_chooses_its_calls_by_its_file_system(shm, tmp_path, where):
    root = shm / "c" if where == "tmpfs" else tmp_path / "c"
    cache = Cache(root, 2**20)
    assert cache.file_calls is fscalls.RELEASING  # until it is opened
    cache.open()
    try:
        fstype = filesystem_at(str(root))
        assert fstype == "tmpfs" or where == "tmp_path"  # pytest's folder may be on tmpfs too
        if not fscalls.lookups_stay_local(str(root)):  # pytest's folder on, or under, a network file system
            assert cache.file_calls is fscalls.RELEASING
        elif fstype in fscalls.MEMORY_FILESYSTEMS:
            assert cache.file_calls is fscalls.HOLDING
        else:
            assert isinstance(cache.file_calls.open.__self__, fscalls.WhileQuick)  # type: ignore[attr-defined]
    finally:
        cache.close()


MOUNTS = """\
22 1 8:1 / / rw - ext4 /dev/sda1 rw
23 22 0:5 / /dev rw - devtmpfs udev rw
24 23 0:26 / /dev/shm rw - tmpfs tmpfs rw
30 22 0:40 / /home rw - nfs4 server:/home rw
31 30 8:17 / /home/u/scratch rw - xfs /dev/sdb1 rw
32 22 0:41 / /mnt/s3 rw - fuse.s3fs s3fs rw
33 22 0:42 / /mnt/s3 rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize(
    ("path", "types"),
    [
        ("/", {"ext4"}),
        ("/dev/shm/c", {"ext4", "devtmpfs", "tmpfs"}),  # noqa: S108 - a path in the text above, not a file
        ("/home/u/scratch/c", {"ext4", "nfs4", "xfs"}),  # a local disk under an NFS home
        ("/home2/c", {"ext4"}),  # starts like /home, is not under it
        ("/mnt/s3/c", {"ext4", "fuse.s3fs", "tmpfs"}),  # one hidden by a later mount counts too
    ],
)
def test_the_file_systems_a_lookup_walks_are_those_mounted_at_the_path_or_above(path, types):
    assert fscalls.filesystems_walked([path], MOUNTS) == types


def test_a_link_into_a_network_mount_on_the_way_is_found(tmp_path):
    """The mount table (given, as the kernel would list it) says ``far`` is NFS; the cache is
    reached from ``entry`` through a link kept in ``far``: not local, though the path as given
    and as resolved never pass ``far``."""
    mounts = f"22 1 8:1 / / rw - ext4 /dev/sda1 rw\n40 22 0:50 / {tmp_path}/far rw - nfs4 server:/far rw\n"
    (tmp_path / "far").mkdir()
    (tmp_path / "near").mkdir()
    (tmp_path / "far" / "hop").symlink_to(tmp_path / "near")
    (tmp_path / "entry").symlink_to(tmp_path / "far" / "hop")
    assert os.path.realpath(tmp_path / "entry" / "c") == str(tmp_path / "near" / "c")
    assert not fscalls.lookups_stay_local(str(tmp_path / "entry" / "c"), mounts)
    assert fscalls.lookups_stay_local(str(tmp_path / "near" / "c"), mounts)


def test_a_walk_that_cannot_be_read_is_not_local(tmp_path):
    """A folder whose physical path is longer than PATH_MAX, reached by short links: the kernel
    walks it, but a step of it cannot be read by its whole path (ENAMETOOLONG)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    names = [f"{i:02d}" + "d" * 200 for i in range(24)]  # about 4,900 characters in all
    try:
        for name in names:
            os.mkdir(name, dir_fd=fd)
            fd, parent = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd), fd
            os.close(parent)
    finally:
        os.close(fd)
    (tmp_path / "x").symlink_to("/".join(names[:12]))
    os.symlink("/".join(names[12:]), os.path.join(tmp_path, "x", "y"))  # the link's own path is short through x
    deep = f"{tmp_path}/x/y/c"
    with pytest.raises(OSError, match="too long"):
        fscalls.paths_walked(deep)
    assert not fscalls.lookups_stay_local(deep, "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str, Path], None]]:
    """``mount(type, folder)``: a real mount of a fresh file system (the folder made, with its
    parents), undone after the test (lazily if busy); the test is skipped where this process may
    not mount (root is needed)."""
    done: list[Path] = []

    def make(fstype: str, where: Path) -> None:
        where.mkdir(parents=True, exist_ok=True)
        try:
            run = subprocess.run(["mount", "-t", fstype, "none", str(where)], capture_output=True, text=True, check=False)
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if run.returncode:
            pytest.skip(f"cannot mount {fstype} here (root is needed): {run.stderr.strip()}")
        done.append(where)

    yield make
    busy = [where for where in reversed(done) if subprocess.run(["umount", str(where)], check=False).returncode]
    for where in busy:
        subprocess.run(["umount", "-l", str(where)], check=False)
    assert not busy, f"still in use at the test's end: {busy}"


@pytest.mark.parametrize("how", ["mounted under it", "a link on it"])
def test_past_a_file_system_not_known_to_be_local_the_calls_let_the_lock_go(mount, tmp_path, how):
    """The cache's path passes a bpf file system, a type :data:`LOCAL_FILESYSTEMS` does not name
    (as an NFS home, or a link kept on NFS, would be): a tmpfs mounted under it, or reached by a
    link on it. Its cache writes by the calls that let the lock go, and the daemon's marker
    watch adds its watches by watchdog's own binding. A tmpfs reached directly keeps the lock."""
    from cachepipe.service import markers

    if not fscalls.lookups_stay_local(str(tmp_path)):
        pytest.skip("pytest's temporary folder is itself past a file system not known to be local")
    mount("bpf", tmp_path / "far")
    mount("tmpfs", tmp_path / "near")
    if how == "mounted under it":
        mount("tmpfs", tmp_path / "far" / "near")
        past = tmp_path / "far" / "near" / "c"
    else:
        (tmp_path / "far" / "hop").symlink_to(tmp_path / "near")
        (tmp_path / "entry").symlink_to(tmp_path / "far" / "hop")
        past = tmp_path / "entry" / "c"  # as given and resolved (near/c), local only
    direct = tmp_path / "near" / "c"
    assert filesystem_at(str(past.parent)) == filesystem_at(str(direct.parent)) == "tmpfs"
    watcher = markers.MarkerWatcher(lambda *_: None)
    watcher.start()
    try:
        for root, kept in ((past, False), (direct, True)):
            cache = Cache(root, 2**20)
            cache.open()
            try:
                assert cache.file_calls is (fscalls.HOLDING if kept else fscalls.RELEASING)
                watcher.watch("p", root, "folders")
                try:
                    assert (str(root) in markers._held_under) is kept
                finally:
                    watcher.unwatch("p")
            finally:
                cache.close()
    finally:
        watcher.stop()


def test_a_walk_follows_links_as_the_kernel_does(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "up").symlink_to("a/b")  # relative
    (tmp_path / "abs").symlink_to(tmp_path / "up")  # absolute, to a link
    (tmp_path / "loop").symlink_to("loop")
    t = str(tmp_path)
    ancestors = fscalls.paths_walked(t)
    assert ancestors[-1] == t and len(ancestors) == t.count("/")
    walked = fscalls.paths_walked(f"{t}/abs/../c")[len(ancestors) :]
    # an absolute link starts again from /; ".." after a link goes to its target's parent
    assert walked == [f"{t}/abs", *ancestors, f"{t}/up", f"{t}/a", f"{t}/a/b", f"{t}/a/c"]
    assert fscalls.paths_walked(f"{t}/new/./c")[len(ancestors) :] == [f"{t}/new", f"{t}/new/c"]  # not there yet
    assert len(fscalls.paths_walked(f"{t}/loop")) == len(ancestors) + 1 + fscalls.LINK_HOPS  # stops at the limit
    assert fscalls.paths_walked("/") == []


def counting(calls: fscalls.FileCalls, counts: Counter[str]) -> fscalls.FileCalls:
    """``calls``, each counted by name in ``counts`` as it is made."""

    def count(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            counts[name] += 1
            return call(*args)

        return counted

    return fscalls.FileCalls(*(count(name, call) for name, call in zip(fscalls.FileCalls._fields, calls, strict=True)))


def _memory_items(items: str, sizes: list[int]) -> dict[str, bytes]:
    """``memory://fscalls``: one item of each size (a folder of one file ``f`` for ``items``
    "folders"); returns the bytes expected of each item by name."""
    fs = fsspec.filesystem("memory")
    expected = {}
    for i, size in enumerate(sizes):
        expected[str(i)] = os.urandom(size)
        fs.pipe_file(f"/fscalls/{i}" + ("/f" if items == "folders" else ""), expected[str(i)])
    return expected


def _local_disk(path: Path) -> Path:
    """``path``, which must be on a local disk (not tmpfs) for a test of the disk's calls."""
    fstype = filesystem_at(str(path))
    if fstype in fscalls.MEMORY_FILESYSTEMS or fstype not in fscalls.LOCAL_FILESYSTEMS:
        pytest.skip(f"pytest's temporary folder is on {fstype!r}, not a local disk: --basetemp on one tests this")
    return path


def _consume_all(root: Path, items: str, **options: Any) -> tuple[dict[str, bytes], int]:
    """Every item of ``memory://fscalls`` through a pipeline caching in ``root`` (more
    ``options`` for it), read whole; checks each was deleted at its ack. Returns the bytes by
    name, and the requests made."""
    try:
        with Pipeline("memory://fscalls", root, "64MiB", items=items, **options) as pipe:
            got = {}
            for item in pipe:
                got[item.name] = Path(item.path if items == "files" else item / "f").read_bytes()
            assert sorted(p.name for p in root.iterdir()) == [".cachepipe"]  # each deleted at its ack
            return got, pipe.stats().requests
    finally:
        fsspec.filesystem("memory").rm("/fscalls", recursive=True)


@pytest.mark.parametrize("items", ["files", "folders"])
@pytest.mark.parametrize("where", ["tmpfs", "disk"])
def test_a_pipeline_writes_and_publishes_every_item_whole_by_the_calls_that_keep_the_lock(
    shm, tmp_path, monkeypatch, where, items
):
    """Items of one byte to several parts: every part is written, and every item published, by
    the calls that keep the lock (on a disk, while they are quick: here they count as quick
    whatever they take); every ack deletes its item."""
    counts: Counter[str] = Counter()
    monkeypatch.setattr(fscalls, "HOLDING", counting(fscalls.HOLDING, counts))
    monkeypatch.setattr(fscalls, "HOLD_DEBT_MAX_S", math.inf)  # a loaded machine's slow call must not decide here
    monkeypatch.setattr(fscalls, "HOLD_MEAN_MAX_S", math.inf)
    sizes = [1, 10, fscalls.HOLD_MAX_WRITE + 1, 3 * 2**20 + 7]  # the last in several 1 MiB parts
    expected = _memory_items(items, sizes)
    root = (shm if where == "tmpfs" else _local_disk(tmp_path)) / "c"
    got, parts = _consume_all(root, items, part_size="1MiB")
    assert got == expected
    assert parts > len(sizes)  # the last item came in several parts
    assert counts["open"] == counts["close"] == parts
    if where == "tmpfs":
        assert counts["pwrite"] >= parts
    else:  # a write of over HOLD_MAX_WRITE lets the lock go anyway, not through HOLDING
        assert counts["pwrite"] >= 2  # the items of 1 and 10 bytes, and any small piece of a part
    assert counts["rename_new"] == len(sizes)
    assert counts["mkdir"] == (len(sizes) if items == "folders" else 0)  # a folder item's own folder


def test_on_a_disk_a_slow_call_makes_the_calls_after_it_let_the_lock_go(tmp_path, monkeypatch):
    """The first create waits longer than HOLD_DEBT_MAX_S (delayed at the C library, keeping the
    lock): every later call of the pipeline goes through :mod:`os` for the pause, and every item
    arrives whole. One download thread makes every call, one after another."""
    _local_disk(tmp_path)
    held: Counter[str] = Counter()
    c_open, opens = fscalls._held.open, []
    usleep = fscalls.holding_function("usleep", [ctypes.c_uint], ctypes.c_int)  # waits keeping the lock, as a slow call would

    def slow_first_open(*args: Any) -> int:
        opens.append(args)
        if len(opens) == 1:
            usleep(int(2e6 * fscalls.HOLD_DEBT_MAX_S))
        return int(c_open(*args))

    monkeypatch.setattr(fscalls, "_held", SimpleNamespace(**{**vars(fscalls._held), "open": slow_first_open}))
    monkeypatch.setattr(fscalls, "HOLDING", counting(fscalls.HOLDING, held))
    expected = _memory_items("files", [1] * 20)
    got, parts = _consume_all(tmp_path / "c", "files", max_concurrency=1)
    assert got == expected
    assert parts == 20
    assert held == Counter({"open": 1})  # the slow create; its write, close and publish, and every later call, by os
    assert len(opens) == 1


@pytest.mark.parametrize("where", ["tmpfs", "disk"])
def test_a_nested_item_is_published_by_the_rename_that_lets_the_lock_go(shm, tmp_path, monkeypatch, where):
    """Its folders under the cache directory may lead anywhere (a mount, a link): the lookup must
    not keep every thread waiting. A flat item's rename keeps the lock."""
    counts: Counter[str] = Counter()
    monkeypatch.setattr(fscalls, "HOLDING", counting(fscalls.HOLDING, counts))
    monkeypatch.setattr(fscalls, "HOLD_DEBT_MAX_S", math.inf)
    monkeypatch.setattr(fscalls, "HOLD_MEAN_MAX_S", math.inf)
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/fscalls/flat", b"f")
    fs.pipe_file("/fscalls/deep/er/item", b"n")
    root = (shm if where == "tmpfs" else _local_disk(tmp_path)) / "c"
    try:
        with Pipeline("memory://fscalls", root, "64MiB", items="files") as pipe:
            got = {item.name: Path(item.path).read_bytes() for item in pipe}
    finally:
        fs.rm("/fscalls", recursive=True)
    assert got == {"flat": b"f", "deep/er/item": b"n"}
    assert counts["rename_new"] == 1  # the flat one's
