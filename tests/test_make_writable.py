"""``cachepipe.map.job.make_writable``: what a command left read-only in its slot or its input is
made deletable again, by file descriptor, never through a link, without leaking descriptors."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from conftest import as_a_user

from cachepipe.map.job import make_writable

WALK = r"""
import json, os, stat, sys
from cachepipe.map import job
root, outside, no_proc = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if no_proc:  # a host without /proc mounted: the fallback by name
    isdir = os.path.isdir
    os.path.isdir = lambda p: False if str(p).startswith("/proc") else isdir(p)
for folder, mode in [("a", 0o000), ("a/b", 0o000), ("a/b/c", 0o500), ("d", 0o300), ("e", 0o600)]:
    os.mkdir(os.path.join(root, folder))
    with open(os.path.join(root, folder, "f"), "w"):
        pass
for folder, mode in reversed([("a", 0o000), ("a/b", 0o000), ("a/b/c", 0o500), ("d", 0o300), ("e", 0o600)]):
    os.chmod(os.path.join(root, folder), mode)
os.symlink(outside, os.path.join(root, "link"))  # a link to a folder outside, among the folders
fds = len(os.listdir("/proc/self/fd"))
job.make_writable(root)
modes = {}
for dirpath, dirs, files in os.walk(root):
    for name in dirs:
        path = os.path.join(dirpath, name)
        modes[os.path.relpath(path, root)] = stat.S_IMODE(os.lstat(path).st_mode)
os.chmod(os.path.join(root, "a", "b", "c"), 0)
os.chmod(os.path.join(root, "a", "b"), 0o500)
os.chown(os.path.join(root, "a", "b"), 12345, 12345)  # now one it may not change: the walk fails
try:
    job.make_writable(root)
    failed = None
except PermissionError as exc:
    failed = str(exc)
print(json.dumps([modes, fds, len(os.listdir("/proc/self/fd")), failed]))
"""


@pytest.mark.parametrize("no_proc", [False, True], ids=["proc", "no-proc"])
def test_every_real_folder_is_made_writable_by_its_owner_without_following_links(tmp_path, no_proc):
    """Run as a user (root opens any folder): folders it may not read (``chmod 000``) are changed
    through ``O_PATH`` and ``/proc/self/fd``, or by name where ``/proc`` is missing; a link to a
    folder outside is not followed; no descriptor is left open, after a walk that failed too."""
    root, outside = tmp_path / "slot", tmp_path / "outside"
    root.mkdir()
    outside.mkdir(mode=0o500)
    argv = [*as_a_user(), sys.executable, "-c", WALK, str(root), str(outside), "1" if no_proc else "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    modes, before, after, failed = json.loads(proc.stdout)
    assert modes == {"a": 0o700, "a/b": 0o700, "a/b/c": 0o700, "d": 0o700, "e": 0o700, "link": 0o777}
    assert stat.S_IMODE(outside.stat().st_mode) == 0o500
    assert failed is not None and "Operation not permitted" in failed and str(root / "a" / "b") in failed, failed
    assert after == before


def test_a_folder_swapped_for_a_link_after_it_was_looked_at_is_not_followed(tmp_path, monkeypatch):
    """A command's process still running swaps a read-only folder of its output for a link to a
    folder outside the cache, just after the walk looked at it. The walk checked each folder
    with ``lstat`` and then changed it by its path (``chmod``), which follows the link: the
    folder outside was made writable. The swap is made at the system-call boundary, right after
    the first call that looks at the folder (``lstat``, or ``open`` for a walk by descriptor)."""
    root, outside = tmp_path / "out", tmp_path / "outside"
    (root / "victim").mkdir(parents=True)
    (root / "victim").chmod(0o500)
    outside.mkdir(mode=0o500)
    real = {"lstat": os.lstat, "open": os.open}
    swapped = []

    def swap_after(call: str):
        def looked(path, *args, **kwargs):
            result = real[call](path, *args, **kwargs)
            if not swapped and os.path.basename(os.fsdecode(path)) == "victim":
                swapped.append(call)
                os.rename(root / "victim", root / "moved")  # still in the tree
                os.symlink(outside, root / "victim")
            return result

        return looked

    monkeypatch.setattr(os, "lstat", swap_after("lstat"))
    monkeypatch.setattr(os, "open", swap_after("open"))
    make_writable(root)
    monkeypatch.undo()
    assert swapped
    assert stat.S_IMODE(outside.stat().st_mode) == 0o500
    assert stat.S_IMODE((root / "moved").stat().st_mode) == 0o700  # the folder it looked at


def test_a_link_in_place_of_the_folder_or_under_it_is_not_followed(tmp_path):
    """``path`` itself a link, or a link among its folders: the folder it points to keeps its mode."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o500)
    (tmp_path / "slot").mkdir()
    (tmp_path / "slot" / "link").symlink_to(outside)
    (tmp_path / "top").symlink_to(outside)
    make_writable(tmp_path / "slot")
    make_writable(tmp_path / "top")
    make_writable(tmp_path / "gone")  # removed meanwhile: nothing to do
    assert stat.S_IMODE(outside.stat().st_mode) == 0o500


OUT_OF_DESCRIPTORS = r"""
import os, resource, sys
from cachepipe.map import job
root = sys.argv[1]
os.makedirs(os.path.join(root, "a", "b"))
before = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
# the root's descriptor and its listing's fit; the first subfolder's listing (scandir dup()s) does not
resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 3, hard))
try:
    job.make_writable(root)
except OSError as exc:
    print("raised", exc.errno)
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
print(sorted(int(fd) for fd in os.listdir("/proc/self/fd")) == before)
"""


def test_a_folder_that_cannot_be_listed_closes_its_descriptor(tmp_path):
    """Before, a subfolder opened and then not listed (EMFILE from scandir's dup, EIO) was left
    open: make_writable raised without closing it (one descriptor leaked per call)."""
    (tmp_path / "root").mkdir()
    run = subprocess.run(
        [sys.executable, "-c", OUT_OF_DESCRIPTORS, str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["raised", "24", "True"], run.stdout
