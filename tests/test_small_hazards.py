"""Small hazards: temporary files a killed writer left for good (a manifest's local copy, a local
destination's ``.cachepipe.tmp``), a live capacity change that counted downloading bytes twice,
and the redaction of a one-character secret."""

from __future__ import annotations

import ctypes
import io
import logging
import os
import select
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import listed, via
from mounts import mounted
from waiting import wait_until

from cachepipe import Pipeline
from cachepipe.cache.room import room_at
from cachepipe.manifest import index, read_manifest
from cachepipe.map import map_items

CLI = [sys.executable, "-m", "cachepipe.cli"]
MIB = 1 << 20


def _dataset(root: Path, names: list[str]) -> str:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "a.txt").write_text(f"{name} a")
    return root.as_uri() + "/"


def test_a_killed_index_to_a_url_leaves_its_copy_only_until_the_next_index(
    tmp_path, s3_client, s3_options, fault_proxy, monkeypatch
):
    """``index -o s3://...`` killed while its upload is under way left its local copy in $TMPDIR
    for good; the next ``index -o URL`` now removes it, and never a live one's."""
    proxy, endpoint = fault_proxy
    source = _dataset(tmp_path / "src", ["s0", "s1"])
    s3_client.create_bucket(Bucket="out")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    held, gate = threading.Event(), threading.Event()

    def upload(head: str) -> bool:
        if head.startswith("PUT /out/"):
            held.set()
            return True
        return False

    proxy.hold(upload, gate)
    opts = [f"--dest-option={k}={v}" for k, v in {**s3_options, "endpoint_url": endpoint}.items()]
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [*CLI, "index", source, "-o", "s3://out/m.gz", *opts]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert held.wait(30), proc.communicate(timeout=30)
        copies = os.listdir(tmp)
        assert len(copies) == 1, copies  # the live upload's copy
        monkeypatch.setattr(tempfile, "tempdir", str(tmp))
        index(source, "s3://out/other.gz", dest_options=s3_options)  # another index meanwhile
        assert os.listdir(tmp) == copies  # the live writer's copy is kept
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        gate.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert os.listdir(tmp) == copies  # a SIGKILL leaves it
    index(source, "s3://out/m.gz", dest_options=s3_options)
    assert os.listdir(tmp) == []  # the next index removed it
    assert read_manifest("s3://out/m.gz", s3_options).count == 2


_PUT = "import sys; from cachepipe.stores.fsspec import FsspecStore; FsspecStore(sys.argv[1]).put(sys.argv[2], sys.argv[3])"


def _put_under_way(dst: Path, key: str, fifo: Path) -> tuple[subprocess.Popen, object]:
    """A subprocess putting ``key`` to the local destination ``dst`` from the FIFO ``fifo``: its
    first bytes (16 KiB at least) copied to ``<key>.cachepipe.tmp``, then it waits for more (the
    FIFO, open for writing, is returned with it)."""
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", _PUT, str(dst), str(fifo), key], env=env)
    writer = open(fifo, "wb", buffering=0)  # noqa: SIM115 - closed by the caller
    try:
        writer.write(FIRST)  # past the copy's 8 KiB buffer: at least 16 KiB of it reach the file
        temp = dst / f"{key}.cachepipe.tmp"
        wait_until(lambda: temp.exists() and temp.stat().st_size >= 16384, what=f"{temp} written")
    except BaseException:
        writer.close()
        proc.kill()
        proc.wait(30)
        raise
    return proc, writer


FIRST = b"x" * 32768


def test_a_map_run_removes_the_temporary_files_killed_uploads_left_in_a_local_destination(tmp_path, caplog):
    """A local DST's ``<name>.cachepipe.tmp`` left by a killed put stayed for good under an item
    done since (only a put of the same key would overwrite it), and a listing of DST (a pipeline
    or an index over it) took it for an object. A map run now removes those whose lock is free,
    never a live upload's, and listings leave them out."""
    for name in ("a", "b"):
        (tmp_path / "src" / name).mkdir(parents=True)
        (tmp_path / "src" / name / "f").write_bytes(name.encode() * 10)
    src, dst = str(tmp_path / "src"), tmp_path / "dst"
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB"}
    command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g"']
    assert map_items(command, src, str(dst), **options).items_done == 2
    killed, killed_fifo = _put_under_way(dst, "a/g", tmp_path / "killed")
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    killed_fifo.close()
    live, live_fifo = _put_under_way(dst, "b/h", tmp_path / "live")
    try:
        with caplog.at_level(logging.INFO, logger="cachepipe.stores.fsspec"):
            listed = index(dst.as_uri(), tmp_path / "m.gz", "files").catalog
        assert [n for n in listed.names if n.endswith(".tmp")] == []
        said = [r.getMessage() for r in caplog.records if "upload temporary file" in r.getMessage()]
        assert said == [
            f"{dst.as_uri()}: left out 2 upload temporary file(s) (*.cachepipe.tmp), first '{dst}/a/g.cachepipe.tmp'"
        ], said
        result = map_items(command, src, str(dst), **options)
        assert result.items_skipped == 2, result.failed
        assert not (dst / "a" / "g.cachepipe.tmp").exists()  # a killed upload's: removed
        assert (dst / "b" / "h.cachepipe.tmp").exists()  # a live one's: kept
    finally:
        live_fifo.close()
        assert live.wait(30) == 0
    assert (dst / "b" / "h").read_bytes() == FIRST and not (dst / "b" / "h.cachepipe.tmp").exists()


class _OpenGate:
    """fanotify permission events on opens of one folder (root, as CI runs): the first open of
    it by the thread of id ``tid`` (set before that thread opens it) waits until :meth:`allow`;
    every other open goes on at once. The walk of a folder begins with that open: a test runs
    what it wants between a reading taken before the walk and the walk itself."""

    FAN_CLOEXEC, FAN_CLASS_CONTENT, FAN_REPORT_TID = 0x1, 0x4, 0x100
    FAN_MARK_ADD, FAN_OPEN_PERM, FAN_ONDIR, FAN_ALLOW = 0x1, 0x10000, 0x40000000, 0x1
    EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
    RESPONSE = struct.Struct("=iI")  # struct fanotify_response

    def __init__(self, folder: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
        flags = self.FAN_CLOEXEC | self.FAN_CLASS_CONTENT | self.FAN_REPORT_TID
        self.fd = libc.fanotify_init(flags, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC)
        if self.fd < 0:
            pytest.skip(f"no fanotify permission events here: {os.strerror(ctypes.get_errno())}")
        if libc.fanotify_mark(self.fd, self.FAN_MARK_ADD, self.FAN_OPEN_PERM | self.FAN_ONDIR, -100, bytes(folder)) < 0:
            os.close(self.fd)
            pytest.skip(f"cannot watch opens of {folder}: {os.strerror(ctypes.get_errno())}")
        self.tid = -1
        self.opened = threading.Event()  # the thread tid's open waits
        self._held: int | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._serve, name="test-open-gate")
        self._thread.start()

    def _answer(self, fd: int) -> None:
        os.write(self.fd, self.RESPONSE.pack(fd, self.FAN_ALLOW))
        os.close(fd)

    def _serve(self) -> None:
        while self._stop_r not in select.select([self.fd, self._stop_r], [], [])[0]:
            data = os.read(self.fd, 4096)
            for at in range(0, len(data), self.EVENT.size):
                _, _, _, _, _, fd, tid = self.EVENT.unpack_from(data, at)
                if tid == self.tid and not self.opened.is_set():
                    self._held = fd
                    self.opened.set()
                else:
                    self._answer(fd)

    def allow(self) -> None:
        if self._held is not None:
            self._answer(self._held)
            self._held = None

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join(10)
        self.allow()
        os.close(self.fd)  # any open still waiting goes on
        os.close(self._stop_r)
        os.close(self._stop_w)


@pytest.mark.parametrize(("spec", "share"), [("50%", 2), ("1GiB", 1)], ids=["share", "bytes-over-the-filesystem"])
def test_a_live_capacity_counts_the_bytes_a_download_writes_during_its_measure_once(
    s3_source, fault_proxy, tmp_path, spec, share
):
    """A live set_capacity of a share (or of bytes over the filesystem's size, held to the room
    there) read the free space, then walked the cache folder: the bytes a download wrote in
    between were counted as free and as held, a capacity larger by (the share of) them. It now
    walks first, then reads the free space. Here the walk's first open waits (fanotify) while a
    4 MiB download is written."""
    proxy, endpoint = fault_proxy
    s3_source.folders(1, {"f": 4 * MIB})
    manifest = listed(s3_source, tmp_path)
    gate = threading.Event()
    proxy.hold(lambda head: head.startswith("GET ") and "item000/f" in head, gate)
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(tmp_path / "disk")]) as disk:
        root = disk / "c"
        options = via(s3_source, endpoint)
        pipe = Pipeline(s3_source.url, root, "50%", storage_options=options, manifest=manifest, max_concurrency=1)
        pipe.open()
        opens = _OpenGate(root)
        go = threading.Event()
        changing = threading.Thread(target=lambda: (go.wait(30), pipe.set_capacity(spec)), name="test-set-capacity")
        try:
            changing.start()
            opens.tid = changing.native_id
            go.set()
            assert opens.opened.wait(30)  # its walk begins: its free space read already, before this change
            gate.set()  # the download: 4 MiB written
            wait_until((root / "item000" / "f").exists, what="the item published")
            opens.allow()
            changing.join(30)
            expected = room_at(root, [root], caches=True) // share
            assert abs(pipe._cache.capacity - expected) < 64 * 1024, (pipe._cache.capacity, expected)
        finally:
            gate.set()
            go.set()
            opens.close()
            changing.join(30)
            pipe.close()


def test_an_obs_secret_too_short_to_be_one_is_not_replaced_in_messages(s3_client, s3_endpoint):
    """The OBS seam replaced every secret in its messages by ``***``: a one-character secret key
    (``e``) mangled every word holding that letter (``Th*** sp***cifi***d k***y``). Secrets shorter
    than 6 characters are now left (longer ones are still replaced: test_obs_store's
    test_check_mapping_table)."""
    from cachepipe.stores.obs import ObsStore

    s3_client.create_bucket(Bucket="obs-short")
    long_token = "tok-Long-Enough-0123456789"
    store = ObsStore(
        "obs://obs-short/", {"server": s3_endpoint, "access_key_id": "AK", "secret_access_key": "e", "security_token": long_token}
    )
    try:
        with pytest.raises(FileNotFoundError) as info:
            store.get("missing-key", io.BytesIO(), 0, 5)
        message = str(info.value)
        assert "The specified key does not exist" in message and "***" not in message, message
    finally:
        store.close()


def test_a_short_secret_is_replaced_where_it_stands_alone_and_a_long_one_wherever_it_is():
    # secrets under 6 characters were left in every message, a short proxy password shown where
    # a message quoted it; they are replaced where no letter or digit stands beside them
    from cachepipe.stores.obs_settings import redact

    secrets = ("e", "pw12", "Long-Secret-0123")
    said = "The specified key e does not exist; proxy 'user:pw12@host' (pw123); token=Long-Secret-0123x"
    assert redact(said, secrets) == "The specified key *** does not exist; proxy 'user:***@host' (pw123); token=***x"
    assert redact("e", ("",)) == "e"  # an empty secret (unset) replaces nothing


def test_an_index_to_a_url_writes_its_copy_in_a_temporary_folder_it_may_not_list(tmp_path):
    """A $TMPDIR that may be written but not listed (mode 1733, as a shared /tmp is made where
    users must not see each other's files): ``index -o URL`` wrote its copy there before it
    looked for the copies killed runs left, and failed with ``[Errno 13] Permission denied:
    '$TMPDIR'`` (exit 1, nothing written). That search is housekeeping: it is passed over, with
    a warning. (Root lists any folder: the CLI runs without CAP_DAC_OVERRIDE/READ_SEARCH.)"""
    capsh = shutil.which("capsh")
    if os.geteuid() != 0 or capsh is None:
        pytest.skip("needs root and capsh to run a process that permissions bind")
    source = _dataset(tmp_path / "src", ["s0"])
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir(mode=0o300)
    tmp.chmod(0o300)  # (mkdir's mode is masked by the umask)
    out.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [*CLI, "index", source, "-o", (out / "m.gz").as_uri()]
    drop = [capsh, "--drop=cap_dac_override,cap_dac_read_search", "--", "-c", shlex.join(argv)]
    done = subprocess.run(drop, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"not looking for copies of manifests that killed runs left in {tmp}" in done.stderr
    assert read_manifest((out / "m.gz").as_uri()).count == 1
    tmp.chmod(0o700)
    assert os.listdir(tmp) == []
