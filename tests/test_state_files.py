"""The files cachepipe writes outside its cache's journal: a manifest (``cachepipe index -o``,
the copies under a DataLoader's ``cache_dir``), the daemon's ``jobs.root/.manifests``.

Each is killed (SIGKILL, at a point the test holds), run out of disk (a real small tmpfs) and
written by two processes at once; the file at the final name is whole or absent, never half
(``state.atomic_write``: a locked temporary file beside it, renamed once whole).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from mounts import mounted, nfs_like
from waiting import wait_until

from cachepipe.cli import main
from cachepipe.client import ServiceError
from cachepipe.jobclient import JobClient
from cachepipe.manifest import index, read_manifest
from cachepipe.service.api import ApiServer
from cachepipe.service.config import ServiceConfig
from cachepipe.service.preflight import host_problems
from cachepipe.service.testing import DaemonProcess
from cachepipe.stores.fsspec import FsspecStore

KIB = 1024


def _dataset(root: Path, names: list[str]) -> str:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "a.txt").write_text(f"{name} a")
    return root.as_uri() + "/"


def _cli(*args: str, **kw) -> subprocess.Popen:
    """``cachepipe ARGS`` as a subprocess (the cachepipe this process imported: PYTHONPATH passed on)."""
    return subprocess.Popen([sys.executable, "-m", "cachepipe.cli", *args], stderr=subprocess.PIPE, text=True, **kw)


def _waits_on_a_lock(pid: int) -> bool:
    """Whether process ``pid`` is blocked waiting for a ``flock`` (a ``->`` line of /proc/locks)."""
    with open("/proc/locks") as fh:
        return any("->" in line and line.split()[5] == str(pid) for line in fh)


def test_two_index_runs_to_one_path_leave_the_second_s_manifest_whole(tmp_path):
    """Two ``cachepipe index -o`` to one path at once: both wrote the same temporary name
    (``.NAME.tmp``), opened with ``O_TRUNC``: the second truncated the file the first was
    writing and wrote its own into it; the first renamed the mix to the final name (and its
    later writes went into that file). Now the temporary file is locked while written: the
    second waits for the first, then writes its own whole."""
    first_src = _dataset(tmp_path / "first", ["a", "b"])
    second_src = _dataset(tmp_path / "second", ["c", "d", "e"])
    path = tmp_path / "m.json.gz"
    index(first_src, tmp_path / "first.json.gz")
    first_bytes = (tmp_path / "first.json.gz").read_bytes()
    temp = tmp_path / ".m.json.gz.tmp"
    with open(temp, "wb", buffering=0) as fh:  # the first run, under way: its temporary file half written
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(first_bytes[: len(first_bytes) // 2])
        second = _cli("index", second_src, "-o", str(path))
        wait_until(lambda: second.poll() is not None or _waits_on_a_lock(second.pid), 60, "the second run waiting or done")
        os.pwrite(fh.fileno(), first_bytes, 0)  # the first run's writes...
        os.ftruncate(fh.fileno(), len(first_bytes))
        with contextlib.suppress(FileNotFoundError):  # (before: the second renamed the file away)
            os.replace(temp, path)  # ...and its rename; its lock goes with the close
    assert second.wait(60) == 0, second.stderr.read() if second.stderr else ""
    second.stderr.close()
    manifest = read_manifest(path)  # before: refused, the gzip stream a mix of both runs'
    assert manifest.source == second_src and manifest.count == 3
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary file left


_HELD_WRITER = textwrap.dedent(
    """
    import os, sys
    from cachepipe.manifest import index

    calls = []

    def hold(frame, event, arg):  # the second os.write (the first began the gzip header): say so, then wait
        if event == "c_call" and arg is os.write:
            calls.append(arg)
            if len(calls) == 2:
                sys.setprofile(None)
                print("held", os.path.getsize(sys.argv[3]), flush=True)
                sys.stdin.readline()

    sys.setprofile(hold)
    index(*sys.argv[1:3])
    """
)


def test_an_index_run_killed_while_writing_leaves_the_earlier_manifest_and_the_next_run_cleans_up(tmp_path):
    """SIGKILL while ``index -o`` writes: the final name keeps the earlier manifest, whole; the
    temporary file it left is reused (and renamed) by the next run, not left beside it."""
    source = _dataset(tmp_path / "src", ["a", "b"])
    path = tmp_path / "m.json.gz"
    earlier = index(_dataset(tmp_path / "old", ["z"]), path)
    child = subprocess.Popen(
        [sys.executable, "-c", _HELD_WRITER, source, str(path), str(tmp_path / ".m.json.gz.tmp")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        held, size = child.stdout.readline().split()
        assert held == "held" and int(size) > 0  # part of the gzip header written
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    finally:
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
    assert (tmp_path / ".m.json.gz.tmp").exists()  # the killed run's
    assert read_manifest(path).digest == earlier.digest
    assert main(["index", source, "-o", str(path)]) == 0
    assert read_manifest(path).count == 2
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["m.json.gz"]


def _filled(disk: Path) -> None:
    with open(disk / "filler.bin", "wb", buffering=0) as fh, contextlib.suppress(OSError):
        while True:
            fh.write(b"x" * 4096)


def test_an_index_run_on_a_full_disk_names_the_manifest_and_leaves_the_earlier_one(tmp_path, capsys):
    """A full disk under ``index -o`` said a bare "[Errno 28] No space left on device"; it now
    names the manifest, the earlier one stays whole and nothing partial is left."""
    source = _dataset(tmp_path / "src", [f"item{i:04d}" for i in range(300)])
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "disk")]) as disk:
        earlier = index(_dataset(tmp_path / "old", ["z"]), disk / "m.json.gz")
        _filled(disk)
        assert main(["index", source, "-o", str(disk / "m.json.gz")]) == 1
        err = capsys.readouterr().err
        assert f"No space left on device: cannot write {str(disk / 'm.json.gz')!r}" in err, err
        assert read_manifest(disk / "m.json.gz").digest == earlier.digest
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin", "m.json.gz"]


def _jobs_config(tmp_path: Path, sock: Path, root: Path, source) -> Path:
    path = tmp_path / "cachepipe.yaml"
    jobs = {"root": str(root), "capacity": "1MiB", "sources": [source.url], "options": {"storage_options": source.options}}
    path.write_text(yaml.safe_dump({"socket": str(sock), "jobs": jobs}))
    return path


def _upload_held(sock: Path, body: bytes) -> socket.socket:
    """``PUT /v1/manifests`` of ``body`` on ``sock`` with all but its last byte sent: the daemon
    waits for the rest (the caller closes the connection)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(str(sock))
    head = (
        f"PUT /v1/manifests HTTP/1.1\r\nHost: cachepipe\r\nContent-Type: application/gzip\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    conn.sendall(head.encode() + body[:-1])
    return conn


def test_a_daemon_killed_during_a_manifest_upload_leaves_nothing_for_good(s3_source, tmp_path, short_dir):
    """A daemon killed while a manifest was uploaded to it left its temporary file
    (``jobs.root/.manifests/.upload-XXXX.json.gz``) for good, one more at each such kill. The next
    manifest written there removes those of writers that are gone (no daemon writes one: the
    folder's lock), before writing its own."""
    s3_source.folders(3, {"a.bin": KIB})
    sock, root = short_dir / "api.sock", tmp_path / "jobs"
    config = _jobs_config(tmp_path, sock, root, s3_source)
    mine = index(s3_source.url, tmp_path / "m.json.gz", storage_options=s3_source.options)
    body = (tmp_path / "m.json.gz").read_bytes()
    with DaemonProcess(config) as daemon, contextlib.closing(_upload_held(sock, body)):
        folder = root / ".manifests"
        wait_until(lambda: folder.is_dir() and list(folder.glob(".upload-*")), 60, "the upload's temporary file")
        daemon.signal(signal.SIGKILL)
        assert daemon.proc is not None and daemon.proc.wait(60) == -signal.SIGKILL
    # what the killed daemon left, beside the writers' lock file
    assert sorted(p.name.startswith(".upload-") for p in folder.iterdir() if p.name != ".lock") == [True]
    with (
        DaemonProcess(config),
        JobClient("train", {"source": s3_source.url, "world_size": 1, "ranks": [0]}, 0, socket=sock) as lane,
    ):
        assert lane.upload_manifest(body) == mine.digest
    assert sorted(p.name for p in folder.iterdir()) == [".lock", f"{mine.digest}.json.gz"]  # the lock file stays


def test_a_manifest_upload_to_a_full_disk_is_refused_naming_the_folder_and_leaves_nothing(s3_source, tmp_path, short_dir):
    s3_source.folders(3, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    mine = index(s3_source.url, tmp_path / "m.json.gz", storage_options=s3_source.options)
    body = (tmp_path / "m.json.gz").read_bytes()
    job = {"source": s3_source.url, "world_size": 1, "ranks": [0]}
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "disk")]) as disk:
        config = _jobs_config(tmp_path, sock, disk / "jobs", s3_source)
        (disk / "jobs" / ".manifests").mkdir(parents=True)
        _filled(disk)
        with DaemonProcess(config), JobClient("train", job, 0, socket=sock) as lane:
            with pytest.raises(ServiceError) as err:
                lane.upload_manifest(body)
            assert err.value.status == 507 and err.value.code == "insufficient_storage"  # before: 500 internal
            assert f"No space left on device: cannot keep the uploaded manifest in {str(disk / 'jobs' / '.manifests')!r}" in str(
                err.value
            )
            assert sorted(p.name for p in (disk / "jobs" / ".manifests").iterdir()) == [".lock"]  # an empty file
            (disk / "filler.bin").unlink()
            assert lane.upload_manifest(body) == mine.digest


def test_a_manifest_upload_under_way_is_never_removed_by_another_s_removal_of_leftovers(s3_source, tmp_path, short_dir):
    """The removal of what killed writers left in ``.manifests`` is skipped while another writer
    is under way (here another upload, held for its last byte): it completes. (Two daemons on
    one jobs.root, where this was seen first, are now refused: one daemon per root.)"""
    s3_source.folders(3, {"a.bin": KIB})
    root = tmp_path / "jobs"
    mine = index(s3_source.url, tmp_path / "m.json.gz", storage_options=s3_source.options)
    body = (tmp_path / "m.json.gz").read_bytes()
    sock = short_dir / "api.sock"
    config = _jobs_config(tmp_path, sock, root, s3_source)
    job = {"source": s3_source.url, "world_size": 1, "ranks": [0]}
    with DaemonProcess(config), contextlib.closing(_upload_held(sock, body)) as held:
        wait_until(lambda: list((root / ".manifests").glob(".upload-*")), 60, "the held upload's temporary file")
        with JobClient("train", job, 0, socket=sock) as lane:
            assert lane.upload_manifest(body) == mine.digest
        held.sendall(body[-1:])
        held.settimeout(60)
        assert held.recv(4096).startswith(b"HTTP/1.1 200 ")
    assert sorted(p.name for p in (root / ".manifests").iterdir()) == [".lock", f"{mine.digest}.json.gz"]


@pytest.mark.parametrize("kind", ["nfs", "nolock"])
def test_a_manifest_upload_to_a_jobs_root_without_folder_locks_is_kept(s3_source, tmp_path, kind):
    """The removal of what killed writers left in ``.manifests`` takes its lock; on NFS (no
    exclusive lock on a descriptor open for reading only, as a folder's) or without locks, every
    upload failed on it (a daemon's 500). On NFS the lock file is locked, and the leftovers are
    removed. On a FUSE file system whose flock is NFS's (``tests/nfslike.py``)."""
    from cachepipe.service.jobs import Jobs, JobsConfig

    s3_source.folders(3, {"a.bin": KIB})
    mine = index(s3_source.url, tmp_path / "m.json.gz", storage_options=s3_source.options)
    body = (tmp_path / "m.json.gz").read_bytes()
    with nfs_like(tmp_path / "nfs", kind) as nfs:
        root = nfs / "jobs"
        (root / ".manifests").mkdir(parents=True)
        (root / ".manifests" / ".upload-left.json.gz").write_bytes(b"a killed upload's")
        options = {"storage_options": s3_source.options}
        jobs = Jobs(JobsConfig(root=root, capacity="1MiB", sources=[s3_source.url], options=options))
        assert jobs.upload_manifest(io.BytesIO(body), len(body))["catalog"] == mine.digest
        names = sorted(p.name for p in (root / ".manifests").iterdir())
    if kind == "nfs":  # the lock file is locked there, as on NFS: the killed upload's copy is removed
        assert names == [".lock", f"{mine.digest}.json.gz"]
    else:  # whether another writer is under way cannot be known there: nothing is removed
        assert names == [".lock", ".upload-left.json.gz", f"{mine.digest}.json.gz"]


def test_an_index_run_to_a_url_whose_temporary_folder_is_full_names_it(tmp_path):
    """``index -o URL`` writes the manifest to a temporary folder, then uploads it; a full
    temporary folder said a bare "[Errno 28] No space left on device" (which disk?)."""
    source = _dataset(tmp_path / "src", [f"item{i:05d}" for i in range(3000)])
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "disk")]) as disk:
        (disk / "room").write_bytes(b"x" * 4096)
        _filled(disk)
        (disk / "room").unlink()  # a page free: Python takes TMPDIR as its temporary folder (it writes a probe file)
        run = _cli("index", source, "-o", "memory://manifests/m.json.gz", env={**os.environ, "TMPDIR": str(disk)})
        _, err = run.communicate(timeout=120)
        assert run.returncode == 1, err
        copy = rf"'{re.escape(str(disk))}/cachepipe-index-copy-\w+-m.json.gz'"
        assert re.search(rf"No space left on device: cannot write {copy}, the copy of memory://manifests/m.json.gz", err), err
        assert sorted(p.name for p in disk.iterdir()) == ["filler.bin"]


def test_a_daemon_never_replaces_the_socket_another_published_since_its_check(short_dir, tmp_path):
    """A daemon checks that no live daemon serves on its socket path, then gives its socket that
    name. It did so by a rename, which replaced a socket another daemon (started at the same
    moment) published in between: that one served on, unreachable. Now the name is a link,
    which fails on an existing one: the second to publish is refused, the first stays."""
    sock = short_dir / "api.sock"
    pipeline = {"source": str(tmp_path / "src"), "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    api = ApiServer(SimpleNamespace(running=True), ServiceConfig(socket=sock, pipelines={"p": pipeline}, markers=False))
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    published: list[int] = []

    def the_other_publishes(frame, event, arg) -> None:  # at the call that names our socket: in between
        if event == "c_call" and arg in (os.rename, os.link):
            sys.setprofile(None)
            other.bind(str(sock))
            other.listen()
            published.append(os.stat(sock).st_ino)

    try:
        api.bind()
        api.serve()
        sys.setprofile(the_other_publishes)
        try:
            with pytest.raises(OSError, match=r"is in use: another cachepipe daemon started serving on it"):
                api.publish()
        finally:
            sys.setprofile(None)
        assert [os.stat(sock).st_ino] == published  # the other's socket, still at the path
    finally:
        api.close()
        other.close()
    assert os.path.exists(sock) and sorted(p.name for p in short_dir.iterdir()) == ["api.sock"]  # ours removed


def test_an_upload_to_a_full_local_destination_names_the_file_and_leaves_no_temporary_file(tmp_path):
    """A local destination (``cachepipe map``'s DST, ``index -o``'s via a store) that filled up
    under an upload raised a bare "[Errno 28] No space left on device", naming no file: which
    DST, which output? Now the error names it; the file being written is removed."""
    local = tmp_path / "out.bin"
    local.write_bytes(os.urandom(200 * KIB))
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tmp_path / "disk")]) as disk:
        store = FsspecStore(str(disk / "dst"))
        with pytest.raises(OSError, match=rf"No space left on device: {re.escape(str(disk))}/dst/item/out.bin") as err:
            store.put(local, "item/out.bin")
        assert err.value.errno == errno.ENOSPC
        assert list((disk / "dst" / "item").iterdir()) == []  # no out.bin.cachepipe.tmp left


def test_writes_on_a_file_system_without_locks_leave_only_their_files(tmp_path):
    """Where ``flock`` is refused (``ENOLCK``) a write takes a temporary name of its own; the
    shared one it had opened to lock was left, empty, beside every file written: a manifest's
    ``.m.json.gz.tmp``, ``ITEM.cachepipe.tmp`` beside each object put to a local destination."""
    source = _dataset(tmp_path / "src", ["a", "b"])
    local = tmp_path / "f.bin"
    local.write_bytes(b"x" * KIB)
    with nfs_like(tmp_path / "nfs", "nolock") as nfs:
        (nfs / "out").mkdir()
        index(source, nfs / "out" / "m.json.gz")
        index(source, nfs / "out" / "m.json.gz")  # a second write over the first
        store = FsspecStore(str(nfs / "dst"))
        store.put(local, "item/f.bin")
        assert sorted(p.name for p in (nfs / "out").iterdir()) == ["m.json.gz"]
        assert sorted(p.name for p in (nfs / "dst" / "item").iterdir()) == ["f.bin"]


@pytest.mark.parametrize("kind", ["nfs", "nolock"])
def test_what_killed_writers_left_is_removed_on_nfs_and_kept_where_nothing_locks(tmp_path, monkeypatch, kind):
    """The temporary files that killed uploads left in a local destination (``*.cachepipe.tmp``,
    removed before ``cachepipe map`` reads it) and the copies of manifests killed ``index -o URL``
    runs left in the temporary folder are removed when no writer holds their lock. That check
    opened them for reading only, where NFS refuses an exclusive lock (EBADF): a map onto an NFS
    destination where a killed upload had left one failed at its start, and so did an index whose
    temporary folder is on NFS. Where nothing can be locked, they are kept (no writer can be told
    from a dead one), without an error. On a FUSE file system whose flock is NFS's."""
    source = _dataset(tmp_path / "src", ["a", "b"])
    with nfs_like(tmp_path / "nfs", kind) as nfs:
        dst, tmp = nfs / "dst", nfs / "tmp"
        (dst / "item").mkdir(parents=True)
        tmp.mkdir()
        (dst / "item" / "out.bin.cachepipe.tmp").write_bytes(b"a killed upload's")
        (tmp / "cachepipe-index-copy-x1-m.json.gz").write_bytes(b"a killed index's")
        live = os.open(dst / "item" / "b.bin.cachepipe.tmp", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            if kind == "nfs":
                fcntl.flock(live, fcntl.LOCK_EX)  # an upload under way
            monkeypatch.setattr(tempfile, "tempdir", str(tmp))
            removed = FsspecStore(str(dst)).remove_stale_temps()
            index(source, f"memory://{tmp_path.name}/m.json.gz")
        finally:
            os.close(live)
        items, copies = sorted(p.name for p in (dst / "item").iterdir()), [p.name for p in tmp.iterdir()]
    if kind == "nfs":
        assert removed == ["item/out.bin.cachepipe.tmp"]
        assert (items, copies) == (["b.bin.cachepipe.tmp"], [])
    else:
        assert removed == []
        assert (items, copies) == (["b.bin.cachepipe.tmp", "out.bin.cachepipe.tmp"], ["cachepipe-index-copy-x1-m.json.gz"])


def test_what_a_killed_writer_left_that_a_reader_holds_a_lease_on_is_kept_without_an_error(tmp_path):
    """Found in review: the test of a killed writer's lock opens its file for writing (NFS
    refuses the lock on a file open for reading only), and an open for writing, without waiting,
    of a file on which another process holds a read lease (what Samba's kernel oplocks and the
    kernel's NFS server's delegations take, for a client reading a destination it exports) is
    refused with EAGAIN: the sweep of a local destination before ``cachepipe map`` reads it
    raised "[Errno 11] Resource temporarily unavailable" (before the open for writing, the file
    was removed). A file in use so is kept now, and the sweep goes on to the others."""
    dst = tmp_path / "dst"
    (dst / "item").mkdir(parents=True)
    leased, other = dst / "item" / "a.bin.cachepipe.tmp", dst / "item" / "b.bin.cachepipe.tmp"
    leased.write_bytes(b"a killed upload's, read by a client")
    other.write_bytes(b"a killed upload's")
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, signal, sys
            signal.signal(signal.SIGIO, signal.SIG_IGN)  # the lease's break, asked by an open for writing
            fd = os.open({str(leased)!r}, os.O_RDONLY)
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            print("leased", flush=True)
            sys.stdin.read()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    removed = None
    try:
        if holder.stdout.readline().strip() == "leased":
            removed = FsspecStore(str(dst)).remove_stale_temps()  # before: BlockingIOError, [Errno 11]
    finally:
        _, refused = holder.communicate(timeout=30)  # its stdin closed: it ends
    if removed is None:
        pytest.skip(f"no leases on {tmp_path}: {refused.strip()}")
    assert removed == ["item/b.bin.cachepipe.tmp"]
    assert sorted(p.name for p in (dst / "item").iterdir()) == ["a.bin.cachepipe.tmp"]


def test_a_cache_on_nfs_works_and_one_where_nothing_locks_is_refused_naming_it(tmp_path):
    """A cache directory is one owner's, by an ``flock`` on ``.cachepipe/lock`` (and a map run's
    by one on its work folder's lock). On NFS, whose flock is emulated, a pipeline and a map run
    work. Where nothing can be locked (an NFS mount whose lock service does not run) both said
    a bare "[Errno 37] No locks available": now the ``cache_dir``, why, and what is expected.
    The daemon's check before it opens anything (``serve --check``) passed such a ``cache_dir``
    (``serve`` then exited 1): now it locks the file it makes there and says so, naming the field.
    On FUSE file systems whose flock is NFS's (``tests/nfslike.py``)."""
    from cachepipe import Pipeline
    from cachepipe.map import map_items

    source = _dataset(tmp_path / "src", ["a", "b", "c"])
    with nfs_like(tmp_path / "nfs") as nfs:
        with Pipeline(source, cache_dir=nfs / "cache", capacity="1MiB") as pipeline:
            assert sorted(Path(path).name for path in pipeline) == ["a", "b", "c"]
        result = map_items([sys.executable, "-c", "pass"], source, str(nfs / "out"), cache_dir=nfs / "work", capacity="1MiB")
        assert result.ok and result.items_done == 3
    with nfs_like(tmp_path / "nolock", "nolock") as nolock:
        runs = {
            "cache": lambda: Pipeline(source, cache_dir=nolock / "cache", capacity="1MiB").open(),
            "work": lambda: map_items(["true"], source, str(tmp_path / "out"), cache_dir=nolock / "work", capacity="1MiB"),
        }
        for name, run in runs.items():
            why = rf"\[Errno 37\] cache_dir {re.escape(repr(str(nolock / name)))}: its filesystem cannot lock files \(No locks"
            with pytest.raises(OSError, match=why) as refused:
                run()
            assert refused.value.errno == errno.ENOLCK
            assert str(refused.value).endswith(
                ": NFS without its lock service?); expected a directory on a filesystem with locks (flock): a local disk, "
                "or NFS with its lock service"
            ), refused.value
        assert not (tmp_path / "out").exists()
        LOCKS = "a local disk, or NFS with its lock service"  # noqa: N806 - a constant of this test
        # the daemon's check before it opens anything (serve, serve --check, a reload) says so, naming the field
        served = {"source": source, "cache_dir": str(nolock / "served"), "capacity": "1MiB"}
        problems = host_problems(ServiceConfig(socket=tmp_path / "api.sock", pipelines={"train": served}))
        field = f"pipelines.train.cache_dir {str(nolock / 'served')!r}: its filesystem cannot lock files"
        why = f"(tried an flock in {str(nolock)!r}: No locks available: NFS without its lock service?)"
        assert problems == [f"{field} {why}; expected a directory on a filesystem with locks (flock): {LOCKS}"]


@pytest.mark.parametrize("refusal", [errno.EPERM, errno.EOPNOTSUPP])
def test_a_daemon_publishes_its_socket_where_hard_links_are_refused(short_dir, tmp_path, monkeypatch, refusal):
    """The socket is published by a hard link (above); a filesystem or security module that
    refuses links (AppArmor without the ``l`` permission) would keep the daemon from starting:
    there it is renamed into place, as before. The refusal is the system call's (``os.link``)."""
    sock = short_dir / "api.sock"
    pipeline = {"source": str(tmp_path / "src"), "cache_dir": str(tmp_path / "cache"), "capacity": "1MiB"}
    api = ApiServer(SimpleNamespace(running=True), ServiceConfig(socket=sock, pipelines={"p": pipeline}, markers=False))

    def refused(src, dst, *args, **kwargs):
        raise OSError(refusal, os.strerror(refusal), src)

    try:
        api.bind()
        api.serve()
        monkeypatch.setattr(os, "link", refused)
        api.publish()
        monkeypatch.undo()
        assert sorted(p.name for p in short_dir.iterdir()) == ["api.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(sock))  # ours, serving
    finally:
        api.close()


@pytest.mark.parametrize("kind", ["nfs", "nolock"])
def test_one_daemon_per_jobs_root_where_flock_is_nfs_s_or_none(tmp_path, caplog, kind):
    """The daemon's lock on jobs.root is a file open for writing: NFS locks it (its locks are the
    server's), and a second daemon is refused; a mount without locks (ENOLCK) cannot, and the
    daemon starts all the same, saying that a second one would not be refused."""
    from cachepipe.service.jobs import Jobs, JobsConfig

    with nfs_like(tmp_path / "nfs", kind) as nfs:
        config = JobsConfig(root=nfs / "jobs", capacity="1MiB")
        first, second = Jobs(config), Jobs(config)
        try:
            first.start("/run/one.sock")
            if kind == "nfs":
                in_use = r"is in use by another cachepipe daemon \(pid \d+ on .*, socket /run/one.sock\)"
                with pytest.raises(OSError, match=in_use):
                    second.start("/run/two.sock")
            else:
                second.start("/run/two.sock")
                assert "cannot be locked (No locks available; an NFS mount without a lock daemon?)" in caplog.text
        finally:
            first.close()
            second.close()


@pytest.mark.parametrize("where", ["local", "nfs"])
def test_the_sweep_of_manifests_waits_for_a_writer_holding_the_lock_file_or_the_folder(tmp_path, caplog, where):
    """The removal of the manifests no job names (here at a daemon's start) is skipped while a
    writer is under way. It locked the ``.manifests`` folder's descriptor, open for reading only:
    NFS refuses an exclusive lock there (EBADF), and no manifest was ever removed on NFS. Now the
    lock is a file made for it (``.manifests/.lock``, open for writing); a writer holding it keeps
    the sweep from removing, and so does one holding the folder (a daemon of before this, beside
    this one during an upgrade). On a local disk, and on a FUSE file system whose flock is NFS's
    (``tests/nfslike.py``; there a folder's flock is FUSE's local one, which NFS's is not: the sweep
    locks the folder where it can, and the lock file everywhere)."""
    from cachepipe.service.jobs import Jobs, JobsConfig

    with contextlib.ExitStack() as stack:
        root = (stack.enter_context(nfs_like(tmp_path / "nfs")) if where == "nfs" else tmp_path) / "jobs"
        folder = root / ".manifests"
        folder.mkdir(parents=True)
        old = folder / f"{'a' * 32}.json.gz"  # a manifest no job names, written two days ago
        old.write_bytes(b"gz")
        then = os.stat(old).st_mtime - 2 * 86400
        os.utime(old, (then, then))
        config = JobsConfig(root=root, capacity="1MiB")
        caplog.set_level(logging.INFO, logger="cachepipe.service")
        for held, how in ((folder / ".lock", os.O_RDWR | os.O_CREAT), (folder, os.O_RDONLY | os.O_DIRECTORY)):
            writer = os.open(held, how, 0o644)  # another writer (an upload, a listing) under way: shared
            try:
                fcntl.flock(writer, fcntl.LOCK_SH)
                jobs = Jobs(config)
                try:
                    caplog.clear()
                    jobs.start("/run/one.sock")  # its start sweeps
                finally:
                    jobs.close()
                assert old.exists(), held  # before: removed under the writer that held the lock file
                assert f"manifests in {folder}: none removed now: a manifest is being written there" in caplog.text
            finally:
                os.close(writer)
        jobs = Jobs(config)
        try:
            jobs.start("/run/one.sock")
        finally:
            jobs.close()
        assert sorted(p.name for p in folder.iterdir()) == [".lock"]  # removed once no writer holds it; the lock file stays
