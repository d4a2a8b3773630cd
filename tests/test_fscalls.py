"""The per-item file calls: both sets behave as :mod:`os` does, and a cache on a memory file system
uses the set that keeps the interpreter's lock (the speed is measured in benchmarks/, not here)."""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from cachepipe import Pipeline, fscalls
from cachepipe.cache import Cache
from cachepipe.fscalls import filesystem_at

SHM = "/dev/shm"  # noqa: S108 - tmpfs on every Linux: the memory file system case
CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
SETS = {"releasing": fscalls.RELEASING, "holding": fscalls.HOLDING}


@pytest.fixture(params=SETS)
def calls(request) -> fscalls.FileCalls:
    assert SETS[request.param] is not None, "this C library has every call (glibc 2.28+)"
    return SETS[request.param]


def test_the_set_that_keeps_the_lock_exists_on_linux():
    assert sys.platform != "linux" or fscalls.HOLDING is not None


@pytest.mark.parametrize(
    ("fstype", "holding"), [("tmpfs", True), ("ramfs", True), ("ext4", False), ("xfs", False), ("nfs4", False), ("", False)]
)
def test_only_a_memory_file_system_keeps_the_lock(fstype, holding):
    assert fscalls.file_calls_for(fstype) is (fscalls.HOLDING if holding else fscalls.RELEASING)


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
def test_a_cache_keeps_the_lock_on_a_memory_file_system_only(shm, tmp_path, where):
    root = shm / "c" if where == "tmpfs" else tmp_path / "c"
    cache = Cache(root, 2**20)
    assert cache.file_calls is fscalls.RELEASING  # until it is opened
    cache.open()
    try:
        fstype = filesystem_at(str(root))
        assert fstype == "tmpfs" or where == "tmp_path"  # pytest's folder may be on tmpfs too
        assert cache.file_calls is fscalls.file_calls_for(fstype)
    finally:
        cache.close()


def counting(calls: fscalls.FileCalls, counts: Counter[str]) -> fscalls.FileCalls:
    """``calls``, each counted by name in ``counts`` as it is made."""

    def count(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            counts[name] += 1
            return call(*args)

        return counted

    return fscalls.FileCalls(*(count(name, call) for name, call in zip(fscalls.FileCalls._fields, calls, strict=True)))


@pytest.mark.parametrize("items", ["files", "folders"])
def test_a_pipeline_on_tmpfs_writes_and_publishes_every_item_whole_by_the_calls_that_keep_the_lock(shm, monkeypatch, items):
    """Items of one byte to several parts: every part is written, and every item published, by
    the calls that keep the lock; every ack deletes its item."""
    counts: Counter[str] = Counter()
    monkeypatch.setattr(fscalls, "HOLDING", counting(fscalls.HOLDING, counts))
    fs = fsspec.filesystem("memory")
    sizes = [1, 10, fscalls.HOLD_MAX_WRITE + 1, 3 * 2**20 + 7]  # the last in several 1 MiB parts
    expected = {}
    for i, size in enumerate(sizes):
        key = f"fscalls/{i}" + ("/f" if items == "folders" else "")
        expected[str(i)] = os.urandom(size)
        fs.pipe_file(f"/{key}", expected[str(i)])
    try:
        with Pipeline("memory://fscalls", shm / "c", "64MiB", items=items, part_size="1MiB") as pipe:
            got = {}
            for item in pipe:
                got[item.name] = Path(item.path if items == "files" else item / "f").read_bytes()
            assert got == expected
            assert sorted(p.name for p in (shm / "c").iterdir()) == [".cachepipe"]  # each deleted at its ack
            parts = pipe.stats().requests
        assert parts > len(sizes)  # the last item came in several parts
        assert counts["open"] == counts["close"] == parts and counts["pwrite"] >= parts
        assert counts["rename_new"] == len(sizes)
        assert counts["mkdir"] == (len(sizes) if items == "folders" else 0)  # a folder item's own folder
    finally:
        fs.rm("/fscalls", recursive=True)
