"""The marker watch's inotify layer (cachepipe/service/inotify.py) against the kernel: watches
shared by callbacks, each callback's own mask, the end of a watch, overflow, wake-up, errors."""

from __future__ import annotations

import errno
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_service import inotify_watches

from cachepipe.service.inotify import IN_IGNORED, IN_Q_OVERFLOW, Event, Inotify

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")

IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_ONLYDIR = 0x8, 0x100, 0x200, 0x01000000


@pytest.fixture
def inotify():
    made = Inotify()
    yield made
    made.close()


def read_all(inotify: Inotify) -> list[Event]:
    """Every event queued now."""
    events: list[Event] = []
    while select.select([inotify.fd], [], [], 0)[0]:
        events += inotify.read()
    return events


def test_callbacks_on_one_folder_share_its_watch_and_get_the_events_of_their_own_mask(inotify, tmp_path):
    creates, deletes = [], []
    wd = inotify.add(bytes(tmp_path), IN_CREATE | IN_ONLYDIR, creates.append, 1)
    assert inotify.add(bytes(tmp_path), IN_DELETE, deletes.append, 2) == wd  # the same inode: the same watch
    assert inotify_watches(os.getpid()) == 1
    (tmp_path / "f").write_bytes(b"x")
    (tmp_path / "f").unlink()
    for event in inotify.read():
        inotify.handle(event)
    assert [(e.wd, e.name, e.mask & 0xFFF) for e in creates] == [(wd, b"f", IN_CREATE)]  # IN_MASK_ADD: both masks kept
    assert [(e.wd, e.name, e.mask & 0xFFF) for e in deletes] == [(wd, b"f", IN_DELETE)]
    inotify.remove([(wd, 1)])
    assert inotify_watches(os.getpid()) == 1  # the other callback still has it
    inotify.remove([(wd, 1), (wd, 3)])  # removed before, never added: passed over
    inotify.remove([(wd, 2)])
    assert inotify_watches(os.getpid()) == 0  # the last callback took the watch with it
    assert [e.mask for e in read_all(inotify)] == [IN_IGNORED]


def test_a_watched_folder_deleted_ends_its_watch_and_a_later_removal_passes_over_it(inotify, tmp_path):
    (tmp_path / "item").mkdir()
    seen = []
    wd = inotify.add(bytes(tmp_path / "item"), IN_CREATE | IN_CLOSE_WRITE | IN_ONLYDIR, seen.append, 7, hold=True)
    (tmp_path / "item" / ".done").write_bytes(b"")
    (tmp_path / "item" / ".done").unlink()
    (tmp_path / "item").rmdir()
    events = inotify.read()
    for event in events:
        inotify.handle(event)
    assert [(e.name, e.mask & 0xFFF) for e in seen] == [(b".done", IN_CREATE), (b".done", IN_CLOSE_WRITE)]
    assert events[-1].mask & IN_IGNORED and events[-1].wd == wd and inotify._watches == {}
    inotify.remove([(wd, 7)])  # the kernel ended it: no error (rm_watch would say EINVAL)
    assert inotify_watches(os.getpid()) == 0


def test_a_refused_watch_raises_with_its_errno_and_path(inotify, tmp_path):
    (tmp_path / "file").write_bytes(b"")
    for path, code in ((tmp_path / "gone", errno.ENOENT), (tmp_path / "file", errno.ENOTDIR)):
        with pytest.raises(OSError, match="inotify_add_watch") as raised:
            inotify.add(bytes(path), IN_CREATE | IN_ONLYDIR, print, 1)
        assert raised.value.errno == code and raised.value.filename == str(path), raised.value
    assert inotify._watches == {}


def test_an_overflow_of_the_kernels_queue_is_an_event(inotify, tmp_path):
    limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    if limit > 100_000:
        pytest.skip(f"fs.inotify.max_queued_events is {limit}: too many files to make")
    inotify.add(bytes(tmp_path), IN_CREATE, lambda _: None, 1)
    for n in range(limit + 1):
        os.close(os.open(tmp_path / str(n), os.O_CREAT | os.O_WRONLY, 0o600))
    assert any(e.mask & IN_Q_OVERFLOW and e.wd == -1 for e in read_all(inotify))


def test_wake_ends_a_read_that_waits_and_close_releases_every_descriptor(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    inotify = Inotify()
    inotify.add(bytes(tmp_path), IN_CREATE, lambda _: None, 1)
    got: list[list[Event]] = []
    reader = threading.Thread(target=lambda: got.append(inotify.read()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # it waits for events
    inotify.wake()
    reader.join(10)
    assert not reader.is_alive() and got == [[]]
    inotify.close()
    inotify.close()  # twice: nothing more
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_instance_closed_refuses_every_call_and_never_reaches_the_next_instance_s_descriptor(tmp_path):
    """Before, a call after close() went to the closed descriptor's number, which the next
    instance (a restarted watch) is usually given: add() put a watch into that instance, with its
    callback kept by the closed one (the watch's events were never handled, and the watch was
    never removed), and wake() wrote into whatever file held the wake pipe's number."""
    old = Inotify()
    old.close()
    new = Inotify()
    try:
        for call in (
            lambda: old.add(bytes(tmp_path), IN_CREATE, print, 1),
            old.read,
            old.wake,
            lambda: old.remove([(1, 1)]),
        ):
            with pytest.raises(RuntimeError, match=r"used after close\(\)"):
                call()
        assert inotify_watches(os.getpid()) == 0  # nothing reached the new instance
    finally:
        new.close()


OUT_OF_DESCRIPTORS = r"""
import os, resource
from cachepipe.service.inotify import Inotify
before = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 2, hard))  # the instance's descriptor fits, its wake pipe not
try:
    Inotify()
except OSError as exc:
    print("raised", exc.errno)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(sorted(int(fd) for fd in os.listdir("/proc/self/fd")) == before)
"""


def test_an_instance_that_cannot_be_made_whole_leaves_no_descriptor_open():
    """Before, a wake pipe that could not be made (EMFILE) left the inotify descriptor open."""
    run = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["raised", str(errno.EMFILE), "True"], run.stdout


def test_a_callback_that_raises_does_not_keep_the_event_from_the_others_on_its_watch(inotify, tmp_path):
    """Before, the first callback's error skipped the rest of the watch's callbacks for that
    event: an item whose folder another pipeline's callback shared could miss its marker."""
    seen = []

    def broken(event: Event) -> None:
        raise ValueError("a defect in one callback")

    inotify.add(bytes(tmp_path), IN_CREATE, broken, 1)
    inotify.add(bytes(tmp_path), IN_CREATE, seen.append, 2)
    (tmp_path / "f").write_bytes(b"")
    [event] = [e for e in read_all(inotify) if e.mask & IN_CREATE]
    with pytest.raises(ValueError, match="a defect in one callback"):
        inotify.handle(event)
    assert [e.name for e in seen] == [b"f"]
