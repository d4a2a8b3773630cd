"""``cachepipe map`` end to end against the moto server, with real subprocess commands.

The two workflows this feature exists for run as one command each (``python -m cachepipe.map``,
the ``map`` subcommand on its own): splitting tar shards of videos into clips (seed 000) and
unpacking split ``tar.gz`` volumes with ``.md5`` files and writing the files back (seed 003).
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import as_a_user, listed, via
from mounts import nfs_like
from sampling import Sampler
from test_unpack import archive_bytes, md5_sidecar, media_clip, tar_bytes, volumes
from waiting import wait_until

from cachepipe.blocks import clamp_block, round_up
from cachepipe.cache import Cache, tree_bytes
from cachepipe.errors import (
    CacheLockedError,
    ConfigError,
    StoreUnavailableError,
)
from cachepipe.map import WORK_DIR, map_items, plan_items
from cachepipe.map import child as map_child
from cachepipe.map import job as map_job
from cachepipe.map.child import Watcher
from cachepipe.map.cli import main
from cachepipe.map.run import _take_lock
from cachepipe.map.uploader import (
    DONE_MARKER,
    MARKER_LIMIT,
    DestinationDeniedError,
    DestinationFullError,
    OutputError,
    Uploader,
    collect_outputs,
    marker_version,
)
from cachepipe.state import EVENT_OVERHEAD, VERSION_OVERHEAD
from cachepipe.stores.base import ObjectInfo
from cachepipe.stores.fsspec import FsspecStore

KIB = 1024
MIB = 1024 * KIB

# Seed 000's extract-segments.sh, as a tiny Python script: each sample.mp4 in the working
# directory (the unpacked shard) becomes 10 KB "clips" <stem>/<n>.mp4, each with a copy of the
# sample's metadata, in $CACHEPIPE_OUT. Every run is logged (outside the cache) for counting.
SPLIT = r"""
import glob, os, sys
out, log = os.environ["CACHEPIPE_OUT"], sys.argv[1]
for mp4 in sorted(glob.glob("*.mp4")):
    stem = mp4[:-4]
    data, meta = open(mp4, "rb").read(), open(stem + ".info.json", "rb").read()
    os.makedirs(os.path.join(out, stem))
    for n, start in enumerate(range(0, len(data), 10_000)):
        open(os.path.join(out, stem, f"{n:06d}.mp4"), "wb").write(data[start:start + 10_000])
        open(os.path.join(out, stem, f"{n:06d}.info.json"), "wb").write(meta)
with open(log, "a") as fh:
    fh.write(os.environ["CACHEPIPE_NAME"] + "\n")
"""


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cachepipe.map", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def storage_args(options: dict) -> list[str]:
    return [arg for key, value in options.items() for arg in ("-o", f"{key}={value}")]


def bucket(s3_client, prefix: str) -> dict[str, bytes]:
    keys = [
        o["Key"]
        for page in s3_client.get_paginator("list_objects_v2").paginate(Bucket="data", Prefix=prefix)
        for o in page.get("Contents", [])
    ]
    return {k[len(prefix) :]: s3_client.get_object(Bucket="data", Key=k)["Body"].read() for k in keys}


def runs(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


def assert_cache_clean(cache: Path) -> None:
    assert sorted(os.listdir(cache)) == [".cachepipe", WORK_DIR]
    assert os.listdir(cache / WORK_DIR) == ["lock"]
    assert tree_bytes(cache / WORK_DIR) == 0


# ---- seed 000: tar shards of videos, split into clips ---------------------------------------------------
def test_video_shards_split_into_clips_and_rerun_skips_them(remote_source, s3_client, tmp_path):
    rng = __import__("random").Random(0)
    expected: dict[str, bytes] = {}
    for s in range(4):
        shard = f"yt8m-lo-{s:06d}.tar"
        samples = {}
        for v in range(3):
            video, meta = rng.randbytes(25_000 + 1000 * v), f'{{"id": "{s}-{v}"}}'.encode()
            samples[f"vid{s}{v}.mp4"], samples[f"vid{s}{v}.info.json"] = video, meta
            for n, start in enumerate(range(0, len(video), 10_000)):
                expected[f"{shard}/vid{s}{v}/{n:06d}.mp4"] = video[start : start + 10_000]
                expected[f"{shard}/vid{s}{v}/{n:06d}.info.json"] = meta
        remote_source.put(shard, tar_bytes(samples))
    script, log, cache = tmp_path / "split.py", tmp_path / "runs.log", tmp_path / "cache"
    script.write_text(SPLIT)
    dst = remote_source.url.replace("/video/", "/clips/")
    # counted as the cache counts (files in whole blocks, a block per folder): the two jobs' slots
    # (extraction, outputs at 2.5x, margin, their folders), a shard and the run's state
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    capacity = 1 * MIB + 32 * block
    command = [
        remote_source.url,
        dst,
        "--cache",
        str(cache),
        "--capacity",
        str(capacity),
        "--items",
        "files",
        "--unpack",
        "--jobs",
        "2",
        "--out-ratio",
        "2.5",
        "--out-margin",
        "64KiB",
        "--no-progress",
        *storage_args(remote_source.options),
        "--",
        sys.executable,
        str(script),
        str(log),
    ]

    with Sampler(cache, block=block) as sampler:
        proc = cli(*command)
    assert proc.returncode == 0, proc.stderr
    assert "4 done, 0 failed, 0 already done" in proc.stderr
    assert sampler.samples > 10 and 0 < sampler.peak <= capacity

    results = bucket(s3_client, "clips/")
    markers = {k: json.loads(v) for k, v in results.items() if k.endswith(DONE_MARKER)}
    assert {k: v for k, v in results.items() if not k.endswith(DONE_MARKER)} == expected
    assert sorted(markers) == [f"yt8m-lo-{s:06d}.tar/{DONE_MARKER}" for s in range(4)]
    for key, marker in markers.items():
        shard = key.split("/")[0]
        assert marker["files"] == {k.split("/", 1)[1]: len(v) for k, v in expected.items() if k.startswith(shard + "/")}
    assert sorted(runs(log)) == [f"yt8m-lo-{s:06d}.tar" for s in range(4)]
    assert_cache_clean(cache)

    again = cli(*command)  # idempotent: every item is complete in DST, nothing is downloaded or run
    assert again.returncode == 0, again.stderr
    assert "0 done, 0 failed, 4 already done; 0 B in, 0 B out" in again.stderr
    assert len(runs(log)) == 4


def test_a_destination_bucket_that_does_not_exist_fails_before_anything_runs(remote_source, tmp_path):
    """A mistyped destination bucket: before, every item was downloaded and its command run,
    and then each upload failed (NoSuchBucket). Now the run checks the bucket first (one HEAD)
    and stops at once, naming it: exit 1, no command run."""
    remote_source.folders(3, {"a.bin": 300})
    log = tmp_path / "runs.log"
    dst = remote_source.url.replace("//data/", "//no-such-bucket/")
    proc = cli(
        remote_source.url, dst, "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--no-progress",
        *storage_args(remote_source.options), "--", sys.executable, "-c", COPY, str(log),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert "no-such-bucket" in proc.stderr and ("no such bucket" in proc.stderr or "does not exist" in proc.stderr), proc.stderr
    assert not log.exists()  # no item was run


# ---- seed 003: split tar.gz volumes with md5 files, extracted and written back ------------------------------
def test_split_targz_volumes_with_md5_files_unpacked_and_written_back(s3_source, s3_client, tmp_path):
    rng = __import__("random").Random(3)
    videos = {f"20bn-something-something-v2/{n}.webm": rng.randbytes(rng.randint(2000, 9000)) for n in range(1, 13)}
    good = tar_bytes(videos, "w:gz")
    bad = tar_bytes({"other/x.webm": rng.randbytes(5000)}, "w:gz")
    for stem, data, count in (("20bn-something-something-v2", good, 6), ("other-v1", bad, 3)):
        for name, part in volumes(data, [f"{stem}-{i:02d}" for i in range(count)]).items():
            s3_source.put(f"md5/{name}.md5", md5_sidecar(name, part).encode())
            damaged = name == "other-v1-01"  # in transit
            s3_source.put(f"compressed/{name}", part[:100] + bytes([part[100] ^ 1]) + part[101:] if damaged else part)

    # as in the seed, the results go beside compressed/ and md5/, under SRC: they are not listed as items
    s3_source.put("video/earlier-run/x.webm", b"old")
    block = clamp_block(os.statvfs(tmp_path).f_frsize)  # the capacity counts whole blocks, a block per folder
    proc = cli(
        s3_source.url,
        s3_source.url + "video/",
        "--cache",
        str(tmp_path / "cache"),
        "--capacity",
        str(256 * KIB + 32 * block),
        "--items",
        "files",
        "--unpack",
        "--out-ratio",
        "1.3",
        "--no-progress",
        *storage_args(s3_source.options),
    )

    assert proc.returncode == 1, proc.stderr
    assert "1 done, 1 failed" in proc.stderr
    assert "compressed/other-v1: ChecksumError" in proc.stderr and "'other-v1-01' has MD5" in proc.stderr
    results = bucket(s3_client, "video/video/")
    item = "compressed/20bn-something-something-v2"
    assert {k: v for k, v in results.items() if not k.endswith(DONE_MARKER)} == {
        **{f"{item}/{k}": v for k, v in videos.items()},
        "earlier-run/x.webm": b"old",
    }
    assert sorted(k for k in results if k.endswith(DONE_MARKER)) == [f"{item}/{DONE_MARKER}"]  # nothing for the damaged one
    assert_cache_clean(tmp_path / "cache")


# ---- issue #16: archives with the default reserves ---------------------------------------------------------------
COPY_TREE = ["--", "sh", "-c", 'cp -r . "$CACHEPIPE_OUT/"']


def test_clip_archives_copied_out_with_the_defaults_and_a_too_small_reserve_named(s3_source, s3_client, tmp_path):
    rng = __import__("random").Random(16)
    clips = {
        fmt: {f"clips/{n}.mp4": media_clip(rng, 20_000 + 3000 * n) for n in range(3)} for fmt in ("tar.gz", "tar.zst", "zip")
    }
    for fmt, files in clips.items():
        s3_source.put(f"shards/clips.{fmt}", archive_bytes(files, fmt))
    text = b"a person folds a towel\n" * 2000
    captions = tar_bytes({"captions.txt": text}, "w:gz")  # compresses a hundredfold: more than the default reserve
    s3_source.put("shards/captions.tar.gz", captions)
    cache, capacity = tmp_path / "cache", 1 * MIB
    block = clamp_block(os.statvfs(tmp_path).f_frsize)  # the cap, the reserves and the extraction count whole blocks
    with Sampler(cache, block=block) as sampler:
        proc = cli(
            s3_source.url + "shards/",
            "s3://data/out/",
            "--cache",
            str(cache),
            "--capacity",
            "1MiB",
            "--items",
            "files",
            "--unpack",
            "--no-progress",
            *storage_args(s3_source.options),
            *COPY_TREE,
        )
    assert proc.returncode == 1 and "3 done, 1 failed" in proc.stderr, proc.stderr
    results = bucket(s3_client, "out/")
    assert {k: v for k, v in results.items() if not k.endswith(DONE_MARKER)} == {
        f"clips.{fmt}/{rel}": data for fmt, files in clips.items() for rel, data in files.items()
    }
    # the extraction's folder and its one member, in whole blocks
    reached = block + round_up(len(text), block)
    assert "captions.tar.gz: ArchiveTooLargeError" in proc.stderr and f"would bring the item to {reached} bytes" in proc.stderr
    assert (
        f"unpack_ratio (--unpack-ratio) 1.25 reserves {round_up(math.ceil(1.25 * len(captions)), block)} bytes "
        f"for this item of {len(captions)} bytes" in proc.stderr
    )
    assert sampler.peak <= capacity
    assert_cache_clean(cache)


def test_split_targz_volumes_with_md5_sidecars_copied_out_with_the_defaults(s3_source, s3_client, tmp_path):
    # as reported: every item failed with "peak job 30000 of 15291 bytes reserved" (the extraction
    # and its copy shared one reserve of 1.0x the input)
    rng = __import__("random").Random(15)
    expected = {}
    for item in ("a", "b", "c"):
        # members of 10-30 KB: the default unpack_ratio holds them in whole blocks (4 KiB ones, on most filesystems)
        videos = {f"{item}/{n}.webm": rng.randbytes(rng.randint(10_000, 30_000)) for n in range(4)}
        names = [f"{item}.tar.gz-{i:02d}" for i in range(3)]
        for name, part in volumes(tar_bytes(videos, "w:gz"), names).items():
            s3_source.put(f"arch/{item}/{name}", part)
            s3_source.put(f"arch/{item}/{name}.md5", md5_sidecar(name, part).encode())
        expected.update({f"{item}/{k}": v for k, v in videos.items()})
    proc = cli(
        "s3://data/video/arch/",
        "s3://data/extracted/",
        "--unpack",
        "--cache",
        str(tmp_path / "cache"),
        "--capacity",
        "1MiB",
        "--no-progress",
        *storage_args(s3_source.options),
        *COPY_TREE,
    )
    assert proc.returncode == 0, proc.stderr
    assert "3 done, 0 failed" in proc.stderr
    results = bucket(s3_client, "extracted/")
    assert {k: v for k, v in results.items() if not k.endswith(DONE_MARKER)} == expected
    assert_cache_clean(tmp_path / "cache")


def test_dry_run_predicts_what_the_run_refuses(s3_source, s3_client, tmp_path, capsys):
    s3_source.put("small/a.bin", b"a" * 1000)
    s3_source.put("big/a.bin", os.urandom(950 * KIB))  # more than the 896 KiB left for downloads
    args = [
        s3_source.url,
        "s3://data/out/",
        "--cache",
        str(tmp_path / "cache"),
        "--capacity",
        "1MiB",
        "--out-reserve",
        "64KiB",
        "--out-margin",
        "64KiB",
        "--no-progress",
        *storage_args(s3_source.options),
    ]
    command = ["--", "sh", "-c", 'cp a.bin "$CACHEPIPE_OUT/"']
    code = main([*args, "--dry-run", *command])
    out = capsys.readouterr().out.splitlines()
    # in whole blocks, as the downloads' cache counts: the journal's budget, the state's folders and files (the state
    # folder, its lock, journal and staging folder) and the work folder; the slot's own 4 folders beside its reserve
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    budget = 2 * (4 * len("big" + "small") + (EVENT_OVERHEAD + VERSION_OVERHEAD) * 2) + 256
    state = round_up(budget, block) + 5 * block
    largest = 896 * KIB - 4 * block - state
    charge = round_up(950 * KIB, block) + block  # the file, and its folder
    why = (
        f"item is {950 * KIB} bytes listed, {charge} bytes in the filesystem's blocks of {block} bytes, more than the "
        f"{largest} bytes the capacity leaves for downloads"
    )
    assert code == 1
    assert out[0] == "would run: small -> s3://data/out/small/"
    assert (
        out[1].startswith(f"would refuse: big: {why}")
        and out[2] == "1 items to run, 1 would be refused, 0 already done, of 2 listed"
    )
    assert not (tmp_path / "cache").exists()
    assert main([*args, *command]) == 1  # the run refuses it, for the same reason
    assert f"big: {why}" in capsys.readouterr().err
    assert sorted(bucket(s3_client, "out/")) == [f"small/{DONE_MARKER}", "small/a.bin"]


def test_a_refusal_for_the_capacity_names_the_least_capacity_that_would_do(s3_source, tmp_path, capsys):
    """It said "raise capacity or lower jobs/out_reserve", leaving the user to work out by how
    much (the daemon's refusal says "give at least N bytes")."""
    s3_source.put("small/a.bin", b"a" * 1000)
    s3_source.put("big/a.bin", b"b" * 950 * KIB)

    def dry_run(capacity: str) -> list[str]:
        args = [s3_source.url, "s3://data/out/", "--cache", str(tmp_path / "cache"), "--capacity", capacity]
        args += ["--out-reserve", "64KiB", "--out-margin", "64KiB", "--no-progress", "--dry-run"]
        main([*args, *storage_args(s3_source.options), "--", "true"])
        return capsys.readouterr().out.splitlines()

    refused = dry_run("1MiB")[1]
    least = int(re.search(r"; give capacity \(--capacity\) at least (\d+) bytes, or lower jobs/out_reserve$", refused)[1])
    assert refused.startswith("would refuse: big: item is") and least > 1024 * KIB
    assert dry_run(str(least - 1))[1].startswith("would refuse: big: ")
    assert dry_run(str(least))[:2] == ["would run: big -> s3://data/out/big/", "would run: small -> s3://data/out/small/"]


# ---- crash in the middle, run again -------------------------------------------------------------------------
MANY_OUTPUTS = r"""
import os, sys
out, name = os.environ["CACHEPIPE_OUT"], os.environ["CACHEPIPE_NAME"]
data = open("in.bin", "rb").read()
for n in range(20):
    open(os.path.join(out, f"part{n:02d}.bin"), "wb").write(data[n * 100:(n + 1) * 100] + name.encode())
with open(sys.argv[1], "a") as fh:
    fh.write(name + "\n")
"""


def test_kill_9_mid_upload_then_rerun_completes_each_item_once(s3_source, s3_client, tmp_path):
    data = s3_source.folders(6, {"in.bin": 2000})
    script, log, cache = tmp_path / "many.py", tmp_path / "runs.log", tmp_path / "cache"
    script.write_text(MANY_OUTPUTS)
    block = clamp_block(os.statvfs(tmp_path).f_frsize)  # outputs and the cap count whole blocks
    command = [
        sys.executable,
        "-m",
        "cachepipe.map",
        s3_source.url,
        "s3://data/out/",
        "--cache",
        str(cache),
        "--capacity",
        str(64 * block),
        "--out-reserve",
        str(20 * block),  # 20 outputs of 101 bytes: a block each
        "--upload-concurrency",
        "1",
        "--no-progress",
        "-vv",
        *storage_args(s3_source.options),
        "--",
        sys.executable,
        str(script),
        str(log),
    ]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    uploading = []
    for line in proc.stderr:
        if " uploading " in line:
            uploading.append(line.split()[-1])
        if len(uploading) == 3 and line.rstrip().endswith(f" uploaded {uploading[2]}/part05.bin"):
            proc.send_signal(signal.SIGKILL)  # mid-upload of the third item: 6 of its 20 files are up
            break
    proc.wait(30)
    proc.stderr.close()
    assert len(uploading) == 3, "the map run ended before its third upload"

    def state() -> tuple[dict[str, dict], dict[str, bytes]]:
        objects = bucket(s3_client, "out/")
        markers = {k.split("/")[0]: json.loads(v) for k, v in objects.items() if k.endswith(DONE_MARKER)}
        return markers, objects

    markers, objects = state()
    assert uploading[2] not in markers and any(k.startswith(uploading[2] + "/") for k in objects)  # a partial upload, no marker
    for name, marker in markers.items():  # a marker only where every output is up
        assert all(len(objects[f"{name}/{rel}"]) == size for rel, size in marker["files"].items())
    finished_before = set(markers)
    ran_before = runs(log)

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert rerun.returncode == 0, rerun.stderr
    markers, objects = state()
    assert sorted(markers) == sorted(data)
    for name, marker in markers.items():
        assert len(marker["files"]) == 20
        for n in range(20):
            assert objects[f"{name}/part{n:02d}.bin"] == data[name]["in.bin"][n * 100 : (n + 1) * 100] + name.encode()
    ran_after = runs(log)[len(ran_before) :]
    assert sorted(ran_after) == sorted(set(data) - finished_before)  # the rest, each once; finished ones not again
    assert f"{len(finished_before)} already done" in rerun.stderr
    assert_cache_clean(cache)


# ---- failures, retries, timeouts, dry run (the CLI in-process) ------------------------------------------------
FAILING = r"""
import os, sys, time
name = os.environ["CACHEPIPE_NAME"]
counter = os.path.join(sys.argv[1], name)
with open(counter, "a") as fh:
    fh.write("x")
attempt = len(open(counter).read())
if name == "flaky" and attempt == 1:
    sys.exit(4)
if name == "bad":
    print("boom: cannot decode", name, file=sys.stderr)
    sys.exit(3)
if name == "slow":
    os.close(2)  # stderr closed, still running: the timeout must not depend on it
    time.sleep(30)
open(os.path.join(os.environ["CACHEPIPE_OUT"], "result.txt"), "w").write(name)
"""


def test_failures_retries_and_timeouts_are_reported_and_the_run_goes_on(s3_source, s3_client, tmp_path, capsys):
    # Two runs into one DST: the failures and the retry without a timeout (a short one would also
    # count the Python start-up of the items that succeed), then the item that always overruns
    # alone, under --timeout 1.
    for name in ("bad", "flaky", "ok"):
        s3_source.put(f"quick/{name}/in.txt", name.encode())
    s3_source.put("slow/slow/in.txt", b"slow")
    script, attempts = tmp_path / "failing.py", tmp_path / "attempts"
    script.write_text(FAILING)
    attempts.mkdir()

    def run(prefix: str, *options: str) -> tuple[int, str]:
        code = main(
            [
                s3_source.url + prefix,
                "s3://data/out/",
                "--cache",
                str(tmp_path / "cache"),
                "--capacity",
                "1MiB",
                "--jobs",
                "2",
                "--retries",
                "1",
                *options,
                "--out-reserve",
                "64KiB",
                "--no-progress",
                *storage_args(s3_source.options),
                "--",
                sys.executable,
                str(script),
                str(attempts),
            ]
        )
        return code, capsys.readouterr().err

    code, err = run("quick/")
    assert code == 1
    assert "2 done, 1 failed, 0 already done" in err
    assert "exited with status 3 (after 2 attempt(s))" in err and "    | boom: cannot decode bad" in err
    code, err = run("slow/", "--timeout", "1")
    assert code == 1
    assert "0 done, 1 failed, 0 already done" in err
    assert "timed out after 1.0 s (after 2 attempt(s))" in err
    assert {p.name: len(p.read_text()) for p in attempts.iterdir()} == {"bad": 2, "flaky": 2, "ok": 1, "slow": 2}
    assert sorted(bucket(s3_client, "out/")) == [f"flaky/{DONE_MARKER}", "flaky/result.txt", f"ok/{DONE_MARKER}", "ok/result.txt"]
    assert_cache_clean(tmp_path / "cache")


def test_dry_run_lists_what_would_run_and_touches_nothing(s3_source, s3_client, tmp_path, capsys):
    s3_source.folders(3, {"a.bin": 100})
    s3_client.put_object(Bucket="data", Key=f"out/item001/{DONE_MARKER}", Body=b"{}")
    code = main(
        [
            s3_source.url,
            "s3://data/out/",
            "--cache",
            str(tmp_path / "cache"),
            "--capacity",
            "1MiB",
            "--dry-run",
            *storage_args(s3_source.options),
            "--",
            "false",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[:3] == [
        "would run: item000 -> s3://data/out/item000/",
        "would run: item002 -> s3://data/out/item002/",
        "2 items to run, 1 already done, of 3 listed",
    ]
    assert not (tmp_path / "cache").exists()
    assert sorted(bucket(s3_client, "out/")) == [f"item001/{DONE_MARKER}"]


COPY = (
    "import os, shutil, sys; shutil.copy('a.bin', os.path.join(os.environ['CACHEPIPE_OUT'], 'out.bin')); "
    "open(sys.argv[1], 'a').write(os.environ['CACHEPIPE_NAME'] + ' ')"
)


class FlakyDest(FsspecStore):
    """The destination refuses the first upload of item000's output with a 503."""

    failed = 0

    def put(self, local_path, key):
        if key == "item000/out.bin" and not self.failed:
            self.failed += 1
            raise StoreUnavailableError("store unavailable (HTTP 503) for s3://data/out/item000/out.bin")
        super().put(local_path, key)


class RewrittenAfterListing:
    """The source, with ``item001/a.bin`` rewritten (the same size) once it has been listed,
    before any download: what a writer does to a dataset while a map job runs."""

    def __init__(self, source) -> None:
        self._source = source
        self._inner = FsspecStore(source.url, source.options)
        self.url = self._inner.url

    def list(self):
        yield from self._inner.list()
        self._source.put("item001/a.bin", b"x" * 300)

    def get(self, key, out, start, end, *, etag=None):
        return self._inner.get(key, out, start, end, etag=etag)

    def close(self):
        self._inner.close()


def test_an_object_rewritten_after_the_listing_fails_its_item_and_the_others_are_done(s3_source, s3_client, tmp_path):
    """map's planned source hands the listed ETag on to the store: the rewritten object is
    refused (If-Match), its item fails as changed, and no output of it is written."""
    data = s3_source.folders(3, {"a.bin": 300})
    log = tmp_path / "runs.log"
    result = map_items(
        [sys.executable, "-c", COPY, str(log)],
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        out_reserve="4KiB",
        storage_options=s3_source.options,
        store=RewrittenAfterListing(s3_source),
    )
    assert result.items_done == 2
    (failure,) = result.failed
    assert failure.name == "item001" and "ObjectChangedError" in failure.error and "changed since it was listed" in failure.error
    assert sorted(runs(log)) == ["item000", "item002"]
    assert bucket(s3_client, "out/item002/")["out.bin"] == data["item002"]["a.bin"]


def test_verify_etag_refetches_an_input_whose_bytes_arrived_wrong(s3_source, s3_client, fault_proxy, tmp_path):
    """A body corrupted on its way with its length intact went into the command and its
    outputs: map had no ``verify``. With ``verify="etag"`` (``--verify etag``) each input file's
    MD5 is checked against its ETag before the command runs, and a mismatch is fetched again."""
    proxy, endpoint = fault_proxy
    data = s3_source.folders(3, {"a.bin": 30 << 10})
    manifest = listed(s3_source, tmp_path)  # the run plans from it: only the items' GETs go through the proxy
    proxy.inject("corrupt", 2)
    result = map_items(
        [sys.executable, "-c", COPY, str(tmp_path / "runs.log")],
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        out_reserve="64KiB",
        manifest=manifest,
        verify="etag",
        max_concurrency=1,
        storage_options=via(s3_source, endpoint),
        dest_options=s3_source.options,  # uploads straight to the server, not through the proxy
    )
    assert (result.items_done, result.failed) == (3, [])
    assert proxy.injected["corrupt"] == 2
    for name, files in data.items():
        assert bucket(s3_client, f"out/{name}/")["out.bin"] == files["a.bin"]


@pytest.mark.parametrize("unpack", [False, True])
def test_an_item_with_an_unsafe_key_is_refused_and_the_others_are_done(s3_source, s3_client, tmp_path, unpack):
    # The whole run stopped (UnsafeKeyError, exit 1) before doing anything.
    data = s3_source.folders(3, {"a.bin": 300})
    s3_source.put("item001/b//c.bin", b"x")
    log = tmp_path / "runs.log"
    args = ([sys.executable, "-c", COPY, str(log)], s3_source.url, "s3://data/out/")
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "out_reserve": "4KiB"}
    if unpack:  # files grouped by volume: planned otherwise; the object alone is refused
        options |= {"items": "files", "unpack": True, "dry_run": True}
        dry = map_items(*args, **options, storage_options=s3_source.options)
        assert list(dry.refused) == ["item001/b//c.bin"] and len(dry.planned) == 3 and dry.items_listed == 4
        return
    dry = map_items(*args, **options, dry_run=True, storage_options=s3_source.options)
    assert list(dry.refused) == ["item001"] and "unsafe object key 'item001/b//c.bin'" in dry.refused["item001"]
    result = map_items(*args, **options, storage_options=s3_source.options)
    assert result.items_done == 2
    (failure,) = result.failed
    assert failure.name == "item001" and "unsafe object key 'item001/b//c.bin': empty path segment" in failure.error
    assert sorted(runs(log)) == ["item000", "item002"]
    assert bucket(s3_client, "out/item002/")["out.bin"] == data["item002"]["a.bin"]
    assert not bucket(s3_client, "out/item001/")


def test_a_grouped_item_holding_a_file_and_a_folder_of_one_name_is_refused_and_the_others_are_done(
    s3_source, s3_client, tmp_path
):
    # --items files --unpack groups volumes with their checksum files: e/md5sums (a file) and
    # e/md5sums/bad.tar.gz.001.md5 (under a folder of that name) in one item cannot both be
    # stored in its folder. The pipeline found it when the listing reached that item, and the
    # whole run stopped (UnsafeKeyError, raised by map_items), the items before it included.
    for folder, stem in (("d", "good"), ("e", "bad")):
        data = tar_bytes({f"{stem}.bin": os.urandom(3000)}, "w:gz")  # incompressible: within --unpack-ratio
        for name, part in volumes(data, [f"{stem}.tar.gz.{i:03d}" for i in range(1, 3)]).items():
            s3_source.put(f"{folder}/{name}", part)
    s3_source.put("e/md5sums", b"")
    s3_source.put("e/md5sums/bad.tar.gz.001.md5", b"0" * 32 + b"  bad.tar.gz.001\n")
    args = ([sys.executable, "-c", "pass"], s3_source.url, "s3://data/out/")
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "items": "files", "unpack": True}
    result = map_items(*args, **options, storage_options=s3_source.options)
    assert result.items_done == 1
    (failure,) = result.failed
    assert failure.name == "e/bad.tar.gz" and "'e/md5sums/bad.tar.gz.001.md5': collides with the file" in failure.error
    assert list(bucket(s3_client, "out/")) == [f"d/good.tar.gz/{DONE_MARKER}"]
    assert_cache_clean(tmp_path / "cache")
    dry = map_items(*args, **options, dry_run=True, storage_options=s3_source.options)  # planned refused, as unsafe keys
    assert list(dry.refused) == ["e/bad.tar.gz"] and "collides with the file 'e/md5sums'" in dry.refused["e/bad.tar.gz"]


def test_a_failed_upload_is_retried_without_running_the_command_again(s3_source, s3_client, tmp_path, capsys):
    data = s3_source.folders(2, {"a.bin": 300})
    log = tmp_path / "runs.log"
    dest = FlakyDest("s3://data/out/", s3_source.options)
    result = map_items(
        [sys.executable, "-c", COPY, str(log)],
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        out_reserve="4KiB",
        storage_options=s3_source.options,
        dest_store=dest,
        request_retries=0,
        progress=True,
    )
    assert result.ok and result.items_done == 2 and result.items_retried == 1 and dest.failed == 1
    bar = capsys.readouterr().err
    assert "cachepipe map: 100%" in bar and "2/2" in bar and "done=2, failed=0, in=0.0MB, out=0.0MB" in bar
    assert sorted(runs(log)) == ["item000", "item001"]  # the command ran once per item
    assert bucket(s3_client, "out/item000/")["out.bin"] == data["item000"]["a.bin"]


# ---- the cap for outputs ----------------------------------------------------------------------------------------
# Each writer writes its total in chunks, then waits to be stopped: what the watcher measures does
# not depend on when it measures (a writer that kept writing would pass the margin if the watcher
# ran late on a busy machine, as the margin's rule says).
WRITER = r"""
import os, sys, time
name = os.environ["CACHEPIPE_NAME"]
where = "." if name == "grows-input" else os.environ["CACHEPIPE_OUT"]  # the input folder counts too
total, chunk = {"small": (60_000, 20_000)}.get(name, (220_000, 20_000))
with open(os.path.join(where, "out.bin"), "wb") as fh:
    for _ in range(total // chunk):
        fh.write(os.urandom(chunk))
        fh.flush()
if name != "small":
    time.sleep(30)  # over the reserve: the watcher must stop it
"""


def test_outputs_over_their_reserve_are_stopped_and_the_cap_holds(s3_source, s3_client, tmp_path, caplog):
    for name in ("grows-input", "hog", "small"):
        s3_source.put(f"{name}/in.bin", os.urandom(1000))
    cache, capacity = tmp_path / "cache", 1536 * KIB
    block = clamp_block(os.statvfs(tmp_path).f_frsize)  # what a job's slot holds is measured in whole blocks, as the cap
    with Sampler(cache, block=block) as sampler:
        result = map_items(
            [sys.executable, "-c", WRITER],
            s3_source.url,
            "s3://data/out/",
            cache_dir=cache,
            capacity=capacity,
            jobs=3,
            out_reserve="200KiB",
            out_margin="128KiB",
            storage_options=s3_source.options,
        )
    assert result.items_done == 1 and {f.name for f in result.failed} == {"grows-input", "hog"}
    written = round_up(220_000, block)  # out.bin, in the slot's out or in the input folder
    for failure in result.failed:
        assert (
            failure.attempts == 1
            and "OutputTooLargeError: item" in failure.error
            and f"outputs reached {written} bytes, over its reserve of 204800 bytes" in failure.error
            and "slot" not in failure.error
        )
    assert result.peak_job_bytes == written + 4 * block  # passed the reserve, within the margin (the slot's folders too)
    killed = [
        r.getMessage() for r in caplog.records if r.getMessage().endswith("passed its reserve of 204800 bytes: command killed")
    ]
    assert len(killed) == 2  # by the watcher, not measured after the command ended by itself
    assert result.download_capacity == capacity - 3 * (328 * KIB + 4 * block)
    assert sampler.peak <= capacity
    assert sorted(bucket(s3_client, "out/")) == [f"small/{DONE_MARKER}", "small/out.bin"]
    assert_cache_clean(cache)


def test_a_job_s_files_are_counted_in_whole_blocks_as_the_cap_counts_them(tmp_path):
    """A job's slot was measured in the files' bytes while the cap counts what they take on the
    disk: 64 outputs of one byte (64 bytes, 64 blocks) passed an out_reserve of 16 KiB, and an
    archive of 64 one-byte members passed its extraction's reserve of 1.25 times its size (in
    listed bytes: the extraction's budget counted no blocks), each taking 64 blocks in a slot
    whose share of the capacity was a few: by that much the cap could be passed. Now both are
    measured as the cache counts (whole blocks, a block per folder): the item fails, naming its
    reserve and the block."""
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"x" * 100)
    many = 'for i in $(seq 64); do printf x > "$CACHEPIPE_OUT/$i"; done'
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "retries": 0}
    result = map_items(["sh", "-c", many], str(tmp_path / "src"), str(tmp_path / "dst"), out_reserve="16KiB", **options)
    (failure,) = result.failed
    # stopped by the watcher on the way, or measured once the command ended: a count of whole blocks either way
    said = rf"outputs reached (\d+) bytes, over its reserve of {round_up(16 * KIB, block)} bytes, counted in the filesystem's"
    reached = re.search(said + rf" blocks of {block} bytes", failure.error)
    assert "OutputTooLargeError" in failure.error and reached and int(reached[1]) % block == 0, failure.error
    (tmp_path / "archives").mkdir()
    archive = tar_bytes({f"{i}.txt": b"x" for i in range(64)}, "w:gz")
    (tmp_path / "archives" / "tiny.tar.gz").write_bytes(archive)
    options["items"] = "files"
    result = map_items(None, str(tmp_path / "archives"), str(tmp_path / "out"), unpack=True, **options)
    (failure,) = result.failed
    assert "ArchiveTooLargeError" in failure.error and f"in whole blocks of {block} bytes" in failure.error, failure.error
    assert f"reserves {round_up(math.ceil(1.25 * len(archive)), block)} bytes for this item" in failure.error
    assert not (tmp_path / "out").exists() and not (tmp_path / "dst").exists()
    assert_cache_clean(tmp_path / "cache")


# A burst past the margin: 400,000 bytes written outside the cache, then renamed into the output
# folder at once. One write of that size in the slot was not enough: the watcher could see it half
# written (262,144 bytes, inside the margin) on a busy machine, and stopped it before the burst.
BURST = r"""
import os, sys, time
with open(sys.argv[1], "wb") as fh:
    fh.write(os.urandom(400_000))
    fh.flush()
    os.fsync(fh.fileno())
os.rename(sys.argv[1], os.path.join(os.environ["CACHEPIPE_OUT"], "out.bin"))
time.sleep(30)  # over the reserve: the watcher must stop it
"""


def test_outputs_that_pass_the_margin_say_the_cap_may_have_been_passed(s3_source, tmp_path):
    s3_source.put("burst/in.bin", os.urandom(1000))
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    result = map_items(
        [sys.executable, "-c", BURST, str(tmp_path / "burst.bin")],  # beside the cache, on its filesystem
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="4MiB",
        out_reserve="200KiB",
        out_margin="128KiB",
        storage_options=s3_source.options,
    )
    (failure,) = result.failed
    assert f"outputs reached {round_up(400_000, block)} bytes, over its reserve of 204800 bytes" in failure.error
    slot = 328 * KIB + 4 * block  # the reserve and the margin, and the slot's own folders
    over = round_up(400_000, block) + 4 * block - slot
    assert (
        f"passed the job's slot of {slot} bytes (reserve + margin + the slot's own folders), so the cache may have held "
        f"up to {over} bytes more than its capacity"
        in failure.error
        and "raise out_margin (--out-margin)" in failure.error
    )
    assert_cache_clean(tmp_path / "cache")


# ---- what a command leaves running ------------------------------------------------------------------------------
# "quiet" leaves a process that let go of CMD's stderr: it would outlive the item and write into the
# cache (into the next item's slot, past the cap); "held" leaves one that keeps stderr: its job would
# stall until it ends, and then it would write $1 (the leftover is killed, never waited out).
# Each writes the leftover's pid as its output.
LEAVE_BEHIND = (
    'if [ "$CACHEPIPE_NAME" = quiet ]; then sleep 300 >/dev/null 2>&1 & else (sleep 30; echo waited out > "$1") & fi; '
    'echo $! > "$CACHEPIPE_OUT/pid"'
)


def leave_a_process_behind(item_path: str, out_path: str) -> None:
    """The map function of the leftover test: starts a process that would outlive it; runs in a spawned process."""
    proc = subprocess.Popen(["sleep", "300"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    Path(out_path, "pid").write_text(str(proc.pid))


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between the open and the read
        return False


def running_after(pids: dict[str, int], seconds: float) -> list[str]:
    """The names of ``pids`` that still run after waiting up to ``seconds`` for them all to end.

    A SIGKILL sent is not a process gone: the victim ends when it is next scheduled, which a
    loaded machine may put off. Each pidfd becomes readable when its process ends (a zombie too);
    a process that survives keeps its own open, and is named once the bound passes.
    """
    fds: dict[int, str] = {}
    try:
        for where, pid in pids.items():
            try:
                fds[os.pidfd_open(pid)] = where
            except ProcessLookupError:
                pass  # gone and reaped
        deadline = time.monotonic() + seconds
        while fds and (remaining := deadline - time.monotonic()) > 0:
            ended, _, _ = select.select(list(fds), [], [], remaining)
            for fd in ended:
                del fds[fd]
                os.close(fd)
        return sorted(where for fd, where in fds.items() if alive(pids[where]))
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.skipif(not hasattr(os, "pidfd_open") or not Path("/proc/self/stat").exists(), reason="needs Linux pidfds and /proc")
def test_what_a_command_or_fn_leaves_running_is_killed_when_it_exits(tmp_path):
    src, cache, waited_out = tmp_path / "src", tmp_path / "cache", tmp_path / "waited-out"
    for name in ("held", "quiet"):
        (src / name).mkdir(parents=True)
        (src / name / "in.txt").write_text(name)
    fn_result = map_items(
        leave_a_process_behind, str(src), str(tmp_path / "fn-dst"), cache_dir=cache, capacity="1MiB", jobs=2, out_reserve="1KiB"
    )
    result = map_items(
        ["sh", "-c", LEAVE_BEHIND, "sh", str(waited_out)],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=cache,
        capacity="1MiB",
        jobs=2,
        out_reserve="1KiB",
    )
    pids = {p.parent.parent.name + "/" + p.parent.name: int(p.read_text()) for p in tmp_path.glob("*dst/*/pid")}
    try:
        assert fn_result.ok and result.ok and len(pids) == 4
        assert not waited_out.exists()  # "held" did not wait for its leftover to let go of stderr
        assert running_after(pids, 30) == []  # killed: each ends within the bound (a guard, not a timing assertion)
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


WRITER_FOREVER = """
import os, time
for _ in range(1200):  # a minute: a worker a wrapper script started, writing its outputs bit by bit
    with open(os.path.join(os.environ["CACHEPIPE_OUT"], "part"), "a") as out:
        out.write("x" * 10)
    time.sleep(0.05)
"""


def processes_writing_into(cache: Path) -> dict[str, int]:
    """Processes whose ``CACHEPIPE_OUT`` names a slot of ``cache``'s map work folder, by pid."""
    marker = f"CACHEPIPE_OUT={cache / WORK_DIR}/".encode()
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker in environ.read_bytes():
                found[environ.parent.name] = int(environ.parent.name)
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_what_the_commands_of_a_killed_run_started_does_not_live_on(tmp_path, sig):
    """A command run through a wrapper (``sh -c 'worker; echo done'``): the map process's death
    signal reaches ``sh`` only. Before, SIGTERM (docker stop, kubectl delete) ended map at once,
    and the worker wrote on into the cache, past its cap, into the next run's slots. Now SIGTERM
    stops the run as Ctrl-C does (exit 143, every command's group killed); after a SIGKILL, which
    nothing can catch, the next run on the cache kills what the last one left running."""
    src, cache, script = tmp_path / "src", tmp_path / "cache", tmp_path / "worker.py"
    (src / "a").mkdir(parents=True)
    (src / "a" / "in.txt").write_text("a")
    script.write_text(WRITER_FOREVER)
    options = ["--cache", str(cache), "--capacity", "1MiB", "--out-reserve", "100KiB", "--no-progress", "-v"]
    command = [sys.executable, "-m", "cachepipe.map", str(src), str(tmp_path / "dst"), *options, "--"]
    proc = subprocess.Popen([*command, "sh", "-c", f"{sys.executable} {script}; echo done"], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: list(cache.glob(f"{WORK_DIR}/*/out/part")), what="the worker writing its output")
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    left = processes_writing_into(cache)
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "terminated (SIGTERM)" in stderr, stderr
        assert running_after(left, 10) == []
        return
    assert left, "the worker did not outlive the killed run: this test no longer shows what it is for"
    try:
        rerun = subprocess.run([*command, "true"], capture_output=True, text=True, timeout=60, check=False)
        assert rerun.returncode == 0, rerun.stderr
        # (the command's own process, killed by its parent-death signal, may be among those found, or not yet gone)
        assert re.search(r"killed \d+ processes", rerun.stderr) and running_after(left, 10) == []
    finally:
        for pid in left.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_state_of_the_downloads_pipeline_is_part_of_the_sizing_so_the_dry_run_predicts_the_run(tmp_path, capsys):
    """Before, map's sizing left out the journal budget the downloads' pipeline reserves (about
    160 bytes per item): the dry run said every item would run, and the run crashed part-way
    (400 tiny items), or stopped at open for an item that fitted the sizing but not beside the
    state. Now both refuse alike, naming the state."""
    many, one = tmp_path / "many", tmp_path / "one"
    many.mkdir()
    for i in range(400):
        (many / f"f{i:03d}.bin").write_bytes(b"x" * 10)
    (one / "big").mkdir(parents=True)
    (one / "big" / "in.bin").write_bytes(b"x" * 19_900)
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    for src, said in (
        (many, "bytes for the state of a run over 400 items"),
        (one, f"item is 19900 bytes listed, {round_up(19_900, block) + block} bytes in the filesystem's blocks of {block} bytes"),
    ):
        items = ["--items", "files"] if src == many else []
        sized = map_items(["true"], str(src), str(tmp_path / "dst"), cache_dir=tmp_path / "cache", capacity="1GiB",
                          out_reserve=20000, items="files" if src == many else "folders", dry_run=True)  # fmt: skip
        # 8 blocks beside the job's slot: room for an item of 10 bytes, not beside the state of 400 of them; for
        # the state of one item, not beside it
        capacity = str(sized.reserve + sized.margin + 8 * block)
        args = [str(src), str(tmp_path / "dst"), "--cache", str(tmp_path / "cache"), "--capacity", capacity]
        args += ["--out-reserve", "20000", "--no-progress", *items]
        for dry in (["--dry-run"], []):
            assert main([*args, *dry, "--", "true"]) == 1
            err = capsys.readouterr()
            assert said in err.err + err.out and "Traceback" not in err.err


def mount_namespace(pid: int) -> int | None:
    """The mount namespace of process ``pid`` (its inode), or None if it is gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def test_leftovers_are_looked_for_in_this_mount_namespace_only(tmp_path):
    """In another mount namespace (a container, systemd's PrivateTmp) the same path can be another
    folder with a live run of its own: its commands are not this cache's leftovers."""
    from cachepipe.map.child import kill_leftovers

    work = tmp_path / WORK_DIR
    env = {**os.environ, "CACHEPIPE_OUT": f"{work}/0/out"}
    here = subprocess.Popen(["sleep", "60"], env=env)
    elsewhere = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep", "60"], env=env)
    try:
        wait_until(lambda: processes_writing_into(tmp_path).keys() >= {str(here.pid), str(elsewhere.pid)})
        # unshare(1) runs in this namespace until its unshare(2) call: a look before that finds both
        wait_until(lambda: mount_namespace(elsewhere.pid) != mount_namespace(os.getpid()), what="unshare's own namespace")
        assert sorted(kill_leftovers(work)) == [here.pid]  # before: both
        assert here.wait(10) == -signal.SIGKILL and elsewhere.poll() is None
    finally:
        for proc in (here, elsewhere):
            proc.kill()
            proc.wait()


def test_usage_errors_exit_2_naming_the_option_and_an_empty_source_is_an_error(tmp_path, capsys):
    """Before: every one of these exited 1, the refused value as pydantic's raw text, and a source
    under which nothing is listed (a mistyped prefix) ran nothing and exited 0."""
    src, empty = tmp_path / "src", tmp_path / "empty"
    (src / "a").mkdir(parents=True)
    (src / "a" / "in.txt").write_text("a")
    empty.mkdir()
    sized = ["--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    for args, said in (
        ([str(src), str(tmp_path / "dst"), "--", "true"], "--cache and --capacity are required"),
        ([str(src), str(tmp_path / "dst"), *sized, "--bogus", "--", "true"], "unrecognized arguments ['--bogus']"),
        ([str(src), str(tmp_path / "dst"), *sized, "--jobs", "0", "--", "true"], "--jobs 0: Input should be greater than"),
    ):
        assert main(args) == 2
        assert said in capsys.readouterr().err
    assert main([str(empty), str(tmp_path / "dst"), *sized, "--", "true"]) == 1
    assert f"no items under {str(empty)!r}" in capsys.readouterr().err
    # a misspelt option was told to go after '--'; a flat prefix to check the bucket and prefix
    assert main([str(src), str(tmp_path / "dst"), "--cache", "c", "--capactiy", "1MiB", "--", "true"]) == 2
    assert "unrecognized arguments ['--capactiy', '1MiB']; --capactiy (did you mean --capacity?)" in capsys.readouterr().err
    assert main([str(src / "a"), str(tmp_path / "dst"), *sized, "--", "true"]) == 1
    assert "the 1 object it lists lies directly under it, none in a folder" in capsys.readouterr().err


class Bug(BaseException):
    """A bug in a job (not an item's failure): the run stops, like on Ctrl-C."""


def test_a_command_that_starts_as_the_run_stops_is_killed(tmp_path, monkeypatch):
    # Job a crashes while job b ends its extraction; b's CMD starts just after the stop killed the
    # running commands. It must be killed too, not waited for (the stop would take its 30 s).
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a", "b"):
        (src / f"{name}.tar").write_bytes(tar_bytes({f"{name}.txt": b"x"}))
    b_unpacked, stopped = threading.Event(), threading.Event()
    unpack, kill_all = map_job.unpack_item, Watcher.kill_all

    def kill_all_then_tell(self):
        kill_all(self)
        stopped.set()

    def unpack_then_wait(item_path, *args, **kwargs):
        if item_path.name == "a.tar":
            assert b_unpacked.wait(10)
            raise Bug("job a crashed")
        result = unpack(item_path, *args, **kwargs)
        b_unpacked.set()
        assert stopped.wait(10)
        return result

    monkeypatch.setattr(map_job, "unpack_item", unpack_then_wait)
    monkeypatch.setattr(Watcher, "kill_all", kill_all_then_tell)
    started = time.monotonic()
    with pytest.raises(Bug):
        map_items(
            ["sleep", "30"],
            str(src),
            str(tmp_path / "dst"),
            cache_dir=tmp_path / "cache",
            capacity="1MiB",
            items="files",
            unpack=True,
            jobs=2,
        )
    assert time.monotonic() - started < 15


def test_a_download_side_error_is_raised_not_taken_for_the_end(tmp_path, monkeypatch):
    # The pipeline hands a planning error to the job that takes its turn. A RuntimeError there
    # (other than "closed", which only a stopping run sees) used to end that job quietly: the
    # items after it were dropped and the run reported success.
    src = tmp_path / "src"
    for n in range(4):
        (src / f"item{n}").mkdir(parents=True)
        (src / f"item{n}" / "f").write_bytes(b"x")
    acquire_many, calls = Cache.acquire_many, []

    def acquire_first_then_fail(self, items, *args):  # the planner's reservation of its runs: the first item, then an error
        calls.append([item.name for item, _extra in items])
        if len(calls) == 2:
            raise RuntimeError("planning broke")
        return acquire_many(self, items[:1], *args)

    monkeypatch.setattr(Cache, "acquire_many", acquire_first_then_fail)
    with pytest.raises(RuntimeError, match="planning broke"):
        map_items(["true"], str(src), str(tmp_path / "dst"), cache_dir=tmp_path / "cache", capacity="1MiB")


class DeniedDest(FsspecStore):
    """Checking item00's marker is refused; every other check meets a 503 (retried with backoff).

    Each key's checks are counted; item00's refusal waits (bounded) until the 15 other checks the
    pool started have been made, so that they are in flight (retrying) when it comes.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks: dict[str, int] = {}
        self.changed = threading.Condition()
        self.denied_all = False  # set by the test once it gave up on the run: end the retries at once

    def list(self):  # every item has a marker, so that each is checked
        for n in range(48):
            yield ObjectInfo(f"item{n:02d}/{DONE_MARKER}", 100)

    def exists(self, key):
        return self._check(key)

    def get(self, key, out, start=0, end=None, **kwargs):  # a marker's check reads its head (its command)
        return self._check(key)

    def _check(self, key):
        with self.changed:
            self.checks[key] = self.checks.get(key, 0) + 1
            self.changed.notify_all()
            if key == f"item00/{DONE_MARKER}":
                self.changed.wait_for(lambda: len(self.checks) >= 16, timeout=30)
                raise PermissionError("access denied to item00's marker")
            if self.denied_all:
                raise PermissionError(f"the test is over: access denied to {key}")
        raise StoreUnavailableError(f"store unavailable (HTTP 503) for {key}")


def test_a_marker_check_that_fails_stops_the_other_checks_at_once(tmp_path):
    # 48 checks on 16 threads; the 15 in flight with item00's meet a 503 and would wait 30-60 s
    # (backoff 60, the most allowed) before their one retry. The refusal must end the run at once,
    # not after the checks in flight went through their retries: Ctrl-C takes the same path.
    # A run that does not stop them is still running when the bound below gives up on it, or
    # checked some marker twice; the bound only keeps such a run from hanging the suite.
    src = tmp_path / "src"
    for n in range(48):
        (src / f"item{n:02d}").mkdir(parents=True)
        (src / f"item{n:02d}" / "f").write_bytes(b"x")
    dest, raised = DeniedDest(str(tmp_path / "dst")), []

    def run() -> None:
        try:
            map_items(
                ["true"],
                str(src),
                str(tmp_path / "dst"),
                cache_dir=tmp_path / "cache",
                capacity="1MiB",
                dest_store=dest,
                request_retries=1,
                retry_backoff=60,
                retry_backoff_max=600,
            )
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            raised.append(exc)

    runner = threading.Thread(target=run, name="test-map-run", daemon=True)
    runner.start()
    runner.join(60)  # a guard against a hang, not a timing assertion: a stopped run ends at once
    try:
        assert not runner.is_alive(), "the checks in flight went on retrying after item00's refusal"
        [error] = raised
        assert isinstance(error, PermissionError) and "item00" in str(error)
        assert len(dest.checks) >= 16  # item00's and the 15 in flight with it (queued ones may start as the pool ends)
        assert {key: n for key, n in dest.checks.items() if n > 1} == {}  # none was retried
    finally:
        with dest.changed:
            dest.denied_all = True  # a run that did not stop: its retries fail for good, so it ends


# ---- the Python API -----------------------------------------------------------------------------------------------
def reverse_files(item_path: str, out_path: str) -> None:
    """The map function of the API test; runs in a spawned process."""
    item, out = Path(item_path), Path(out_path)
    if (item / "broken").exists():
        raise ValueError(f"cannot process {item.name}")
    for f in sorted(item.rglob("*")):
        (out / f"{f.name}.rev").write_bytes(f.read_bytes()[::-1])
    if item.name == "big":
        (out / "big.bin").write_bytes(bytes(11 * MIB))  # uploaded in three parts of 5 MiB


def test_python_function_api_with_a_multipart_output(s3_source, s3_client, tmp_path):
    s3_source.put("big/in.bin", b"0123456789")
    s3_source.put("broken/broken", b"x")
    s3_source.put("small/a.txt", b"hello")
    result = map_items(
        reverse_files,
        s3_source.url,
        "s3://data/out/",
        cache_dir=tmp_path / "cache",
        capacity="40MiB",
        jobs=2,
        out_reserve="12MiB",
        out_margin="1MiB",
        upload_part_size="5MiB",
        retries=0,
        storage_options=s3_source.options,
    )
    assert result.items_done == 2 and result.files_out == 3 and result.bytes_out == 11 * MIB + 15
    [failure] = result.failed
    assert failure.name == "broken" and "ValueError: cannot process broken" in failure.stderr_tail
    out = bucket(s3_client, "out/")
    assert out["small/a.txt.rev"] == b"olleh" and out["big/in.bin.rev"] == b"9876543210"
    assert s3_client.head_object(Bucket="data", Key="out/big/big.bin")["ETag"].strip('"').endswith("-3")
    assert json.loads(out[f"big/{DONE_MARKER}"])["files"] == {"big.bin": 11 * MIB, "in.bin.rev": 10}


def test_python_dash_m_runs_the_command_line_module_once():
    # cachepipe/__init__.py must not import cachepipe.map.__main__ (nor cachepipe.map.cli): runpy would then run it a second
    # time as __main__, with a RuntimeWarning ("found in sys.modules ...") on every run
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: cachepipe map")
    assert proc.stderr == ""


# ---- planning and refusals (no server) -------------------------------------------------------------------------------
def test_plan_groups_split_volumes_and_attaches_checksum_files():
    keys = [
        "compressed/x-00",
        "compressed/x-01",
        "md5/x-00.md5",
        "md5/x-01.md5",
        "shards/a.tar",
        "shards/b.tar.gz.partaa",
        "shards/b.tar.gz.partab",
        "shards/md5sums",
        "stray.md5",
    ]
    plan = {mi.name: mi for mi in plan_items([ObjectInfo(k, 10) for k in keys], "files", unpack=True)}
    assert sorted(plan) == ["compressed/x", "shards/a.tar", "shards/b.tar.gz"]
    assert [o.key for o in plan["compressed/x"].objects] == [
        "compressed%2Fx/compressed/x-00",
        "compressed%2Fx/compressed/x-01",
        "compressed%2Fx/md5/x-00.md5",
        "compressed%2Fx/md5/x-01.md5",
    ]
    assert plan["compressed/x"].size == 40 and plan["compressed/x"].keys["compressed%2Fx/md5/x-01.md5"] == "md5/x-01.md5"
    assert sorted(plan["shards/b.tar.gz"].keys.values()) == ["shards/b.tar.gz.partaa", "shards/b.tar.gz.partab", "shards/md5sums"]
    assert [mi.name for mi in plan_items([ObjectInfo(k, 1) for k in keys], "folders", unpack=True)] == [
        "compressed",
        "md5",
        "shards",
    ]
    assert len(plan_items([ObjectInfo(k, 1) for k in keys], "files", unpack=False)) == len(keys)
    (reserved,) = plan_items([ObjectInfo(f"{WORK_DIR}/x", 1)], "folders", unpack=False)
    assert reserved.unsafe is not None and "reserved for cachepipe map" in reserved.unsafe


def test_map_fetches_with_a_pipelines_part_size_unless_given(tmp_path):
    # The pipeline under a map run sizes its ranged GETs as any pipeline does (by the capacity,
    # auto_part_size), not by a fixed 8 MiB of its own; an explicit part_size is parsed and kept.
    from cachepipe.map.plan import MapConfig

    base = {"source": "s3://b/in/", "dest": "s3://b/out/", "cache_dir": tmp_path, "capacity": "64MiB"}
    assert MapConfig(**base).part_size is None
    assert MapConfig(**base, part_size="2MiB").part_size == 2 * 1024**2
    with pytest.raises(ValueError, match="part_size"):
        MapConfig(**base, part_size="2 lumps")


def test_a_function_from_an_interactive_main_is_refused_before_anything_runs(tmp_path):
    """fn defined under ``python -c`` (or in a REPL or a notebook): the spawned child cannot
    import it. Before, every item failed 3 times with "fn exited with status 1" and an empty
    tail (the AttributeError went to the terminal). A script's own __main__ still works, and
    map's own sizing of a small capacity no longer warns as if the user had left out a unit."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"x")
    body = (
        "from cachepipe.map import map_items\n"
        "def fn(item, out):\n"
        "    open(out + '/g', 'w').write('k')\n"
        f"r = map_items(fn, {str(src)!r}, {str(tmp_path / 'dst')!r}, cache_dir={str(cache)!r}, capacity='1MiB')\n"
        "print('done', r.items_done)\n"
    )
    interactive = subprocess.run([sys.executable, "-c", body], capture_output=True, text=True, timeout=120, check=False)
    assert interactive.returncode == 1 and not cache.exists()
    assert "is defined in __main__ of an interactive session (python -c, a REPL, a notebook)" in interactive.stderr
    script = tmp_path / "job.py"
    main = body.replace("r = map_items", "if __name__ == '__main__':\n    r = map_items").replace("print(", "    print(")
    script.write_text(main)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and "done 1" in run.stdout, run.stderr
    package = tmp_path / "pkg"  # python -m pkg: its __main__ is no file the child runs again either
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(body)
    command = [sys.executable, "-m", "pkg"]
    as_module = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert as_module.returncode == 1 and "is defined in __main__ of" in as_module.stderr, as_module.stderr
    assert "capacity" not in run.stderr  # before: "capacity 1048574 is 1048574 bytes, less than 1 MiB", of map's own sizing


def test_a_script_that_calls_map_outside_its_main_guard_is_refused_before_anything_runs(tmp_path):
    """First-hour review: without the ``if __name__ == "__main__":`` guard, each spawned child ran
    the script again, so map_items again, and every item failed after its download, with the
    cache lock's error in the tails. Now the call is refused at once, naming the line. Called at
    the top level of a module being imported, the run hung; it is refused too."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"x")
    call = f"map_items(fn, {str(src)!r}, {str(tmp_path / 'dst')!r}, cache_dir={str(cache)!r}, capacity='1MiB')"
    head = "import sys\nfrom cachepipe.map import map_items\ndef fn(item, out):\n    open(out + '/g', 'w').write('k')\n"
    decorator_line = 8 if sys.version_info >= (3, 11) else 9
    bodies = {  # the line of the top-level statement named
        "top level": (f"{call}\n", 5),
        "in a function called at top level": (f"def main():\n    {call}\ntry:\n    main()\nfinally:\n    pass\n", 8),
        # Python 3.10 gives a decorator's call the line of its `def`, 3.11 and newer the decorator's
        "in a decorator": (f"def deco(f):\n    {call}\n    return f\n@deco\ndef g():\n    pass\n", decorator_line),
    }
    script = tmp_path / "job.py"
    for what, (body, line) in bodies.items():
        script.write_text(head + body)
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 1 and not cache.exists(), (what, run.stderr)
        said = f"RuntimeError: {script}, line {line}: a child process that runs fn starts by running the main script again"
        assert said in run.stderr, (what, run.stderr)
        assert 'is not under the script\'s `if __name__ == "__main__":` guard' in run.stderr, what
    # imported, not run: before, the run hung (its threads that look fn up waited for the import, which waited for them)
    (tmp_path / "imported.py").write_text(head + f"{call}\n")
    command = [sys.executable, "-c", "import imported"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert run.returncode == 1 and not cache.exists(), run.stderr
    assert "its module 'imported' is still being imported (map_items is called from its top level)" in run.stderr
    show = f"print('done', {call}.items_done)"
    guards = {  # any if that tests __name__ on the way, or any if at the top level (it may be a guard): the run goes on
        "guarded": f"if sys.argv and __name__ == '__main__':\n    {show}\n",
        "guarded in the function": f"def main():\n    if __name__ == '__main__':\n        {show}\nmain()\n",
        "a guard by another name": f"IS_MAIN = __name__ == '__main__'\nif IS_MAIN:\n    {show}\n",
    }
    for what, body in guards.items():
        shutil.rmtree(tmp_path / "dst", ignore_errors=True)
        script.write_text(head + body)
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0 and "done 1" in run.stdout, (what, run.stderr)


def test_a_cache_dir_whose_filesystem_makes_no_folders_is_named_as_a_pipeline_s_is(tmp_path):
    """A --cache under /proc gave a bare 'No such file or directory: /proc/x/.cachepipe-map', which
    reads as "create it"; a Pipeline's cache_dir is named with the reason (cache.lock.unusable_dir)."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"x")
    cache = "/proc/cachepipe-test-no-such-folder"
    with pytest.raises(FileNotFoundError, match=rf"cache_dir '{cache}': cannot be created under '/proc': its filesystem"):
        map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst"), cache_dir=cache, capacity="1MiB")


def test_a_capacity_with_no_room_for_downloads_is_told_the_least_that_runs(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(b"x" * 1000)
    options = {"cache_dir": tmp_path / "cache", "jobs": 4, "out_reserve": "60KiB"}
    with pytest.raises(ConfigError, match="leaves no room for downloads") as refused:
        map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst"), capacity="100KiB", **options)
    least = int(re.search(r"raise capacity to at least (\d+) bytes", str(refused.value))[1])
    below = map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst"), capacity=least - 1, **options)
    assert below.items_failed == 1  # one byte less: the item does not fit beside the jobs' reserves and the state
    assert map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst"), capacity=least, **options).items_done == 1


def test_refusals_before_anything_runs(tmp_path):
    src, dst, cache = tmp_path / "src", str(tmp_path / "dst"), tmp_path / "cache"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_bytes(b"x" * 1000)
    with pytest.raises(ConfigError, match="leaves no room for downloads after setting aside 1 jobs x") as refused:
        map_items(["true"], str(src), dst, cache_dir=cache, capacity="100KiB", jobs=4, out_reserve="60KiB")
    assert "raise capacity to at least" in str(refused.value)
    with pytest.raises(ValueError, match="out_reserve or out_ratio, not both"):
        map_items(["true"], str(src), dst, cache_dir=cache, capacity="1MiB", out_reserve="1KiB", out_ratio=2)
    with pytest.raises(TypeError, match="define it at module level"):
        map_items(lambda _item, _out: None, str(src), dst, cache_dir=cache, capacity="1MiB")
    with pytest.raises(ConfigError, match="nothing to do"):
        map_items(None, str(src), dst, cache_dir=cache, capacity="1MiB")
    assert not cache.exists()  # refused before touching the disk
    (cache / WORK_DIR).mkdir(parents=True)
    fd = _take_lock(cache / WORK_DIR, cache)
    try:
        with pytest.raises(CacheLockedError, match="another cachepipe map run"):
            map_items(["true"], str(src), dst, cache_dir=cache, capacity="1MiB")
    finally:
        os.close(fd)
    result = map_items(["sh", "-c", 'cp f "$CACHEPIPE_OUT/g"'], str(src), dst, cache_dir=cache, capacity="1MiB")
    assert result.ok and (Path(dst) / "a" / "g").read_bytes() == b"x" * 1000 and (Path(dst) / "a" / DONE_MARKER).exists()


# ---- review: a process that left the command's group ----------------------------------------------------------
ESCAPE = r"""
import os, subprocess, sys
# a helper started in a session of its own (start_new_session=True, setsid, a daemon): out of the
# command's process group, still holding the command's stderr
helper = subprocess.Popen(["sleep", "120"], start_new_session=True)
for folder in (os.environ["CACHEPIPE_OUT"], sys.argv[1]):
    open(os.path.join(folder, os.environ["CACHEPIPE_NAME"] + ".pid"), "w").write(str(helper.pid))
"""


@pytest.mark.skipif(not hasattr(os, "pidfd_open") or not Path("/proc/self/stat").exists(), reason="needs Linux pidfds and /proc")
def test_a_process_that_left_the_commands_group_holding_its_stderr_does_not_stall_the_job(tmp_path):
    """Before, the job read CMD's stderr until EOF: a process CMD started in a session of its own
    held it, so the job waited for that process to end (forever, for a daemon), item after item,
    and Ctrl-C or SIGTERM waited too. Now, once CMD exits, the job waits a moment for the EOF, then
    kills what still runs with this slot's $CACHEPIPE_OUT and goes on."""
    src, pid_dir = tmp_path / "src", tmp_path / "pids"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "in.txt").write_text(name)
    pid_dir.mkdir()
    result: list = []
    runner = threading.Thread(
        target=lambda: result.append(
            map_items(
                [sys.executable, "-c", ESCAPE, str(pid_dir)],
                str(src),
                str(tmp_path / "dst"),
                cache_dir=tmp_path / "cache",
                capacity="1MiB",
                out_reserve="1KiB",
            )
        ),
        name="test-map-run",
        daemon=True,
    )
    started = time.monotonic()
    runner.start()
    runner.join(30)  # a guard: a stalled run waits for the helpers, 120 s each
    pids = {p.stem: int(p.read_text()) for p in pid_dir.iterdir()}
    try:
        assert not runner.is_alive(), "the job waited for a process that left the command's group"
        assert time.monotonic() - started < 20
        [done] = result
        assert done.ok and done.items_done == 2 and sorted(pids) == ["a", "b"]
        assert sorted(p.name for p in (tmp_path / "dst").glob("*/*.pid")) == ["a.pid", "b.pid"]
        assert running_after(pids, 10) == []
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        runner.join(30)
        for p in pid_dir.iterdir():  # a helper started after the kill above
            if alive(int(p.read_text())):
                os.kill(int(p.read_text()), signal.SIGKILL)
        runner.join(30)


# ---- an input rewritten since its item was done ---------------------------------------------------------------
def test_a_rerun_does_again_an_item_whose_input_was_rewritten_since_it_was_done(remote_source, s3_client, tmp_path):
    """A rerun skipped every item whose completion marker existed: an item whose objects were
    rewritten since (here at the same size) kept the results of its old input, silently. The
    marker now records the input's version (its ETags), and an item of another version is done
    again; a marker that records none (an earlier cachepipe's) still counts as done."""
    data = remote_source.folders(3, {"f": 1000})
    dst = remote_source.url.replace("/video/", "/copies/")
    command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g"']
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "storage_options": remote_source.options}
    assert map_items(command, remote_source.url, dst, **options).items_done == 3
    new = bytes(reversed(data["item001"]["f"]))
    remote_source.put("item001/f", new)
    s3_client.put_object(Bucket="data", Key=f"copies/item002/{DONE_MARKER}", Body=b'{"item": "item002"}')  # no version
    result = map_items(command, remote_source.url, dst, **options)
    assert (result.items_done, result.items_skipped) == (1, 2), result.failed
    copies = bucket(s3_client, "copies/")
    assert copies["item001/g"] == new and copies["item000/g"] == data["item000"]["f"]


def test_a_marker_s_version_is_read_from_its_head_however_many_outputs_it_lists(tmp_path):
    """A rerun reads MARKER_LIMIT bytes of each marker: the version comes first in it, so a
    marker listing thousands of outputs (over a megabyte here) still tells it."""
    outputs = tmp_path / "out"
    outputs.mkdir()
    for i in range(6000):
        (outputs / f"clip-{i:06d}-{'x' * 200}.mp4").write_bytes(b"")
    dest, slot = tmp_path / "dst", tmp_path / "slot"
    dest.mkdir(), slot.mkdir()
    uploader = Uploader(FsspecStore(str(dest)), 4, 0, 0.01, 0.01, threading.Event())
    try:
        uploader.upload_item("item", outputs, slot, version="0123456789abcdef")
    finally:
        uploader.close()
    marker = (dest / "item" / DONE_MARKER).read_bytes()
    assert len(marker) > 2**20 and marker_version(marker[:MARKER_LIMIT]) == "0123456789abcdef"
    assert marker_version(json.dumps({"bytes": 0, "files": {}, "item": "old"}, indent=0, sort_keys=True).encode()) is None


# ---- review: a destination in the source, spelled another way --------------------------------------------------
def test_a_destination_in_the_source_is_found_however_the_paths_are_spelled(tmp_path, monkeypatch):
    """``cachepipe map data ./data/results``: before, the two spellings were compared as text, so
    the results were not recognised as lying in the source: a rerun listed them as an item
    ("results") and ran the command on them; the source itself given as ``file://`` + its path
    was not refused, and results went into the source's own items."""
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        (tmp_path / "data" / name / "f").write_text(name)
    command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g"']
    for _ in range(2):
        result = map_items(command, "data", "./data/results", cache_dir="cache", capacity="1MiB")
        assert result.ok and result.items_listed == 2, result.failed
    assert result.items_skipped == 2 and result.items_done == 0
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["a", "b", "results"]
    for same in (f"file://{tmp_path}/data/", str(tmp_path / "data")):
        with pytest.raises(ConfigError, match="is the source itself"):
            map_items(command, "data", same, cache_dir="cache", capacity="1MiB")


# ---- review: refused options, named without the other options -------------------------------------------------
def test_a_refused_combination_of_options_names_them_and_never_echoes_the_storage_options(tmp_path, capsys):
    """Before, an error of MapConfig's cross-field check (``--out-reserve`` with ``--out-ratio``,
    ``--upload-part-size`` under 5 MiB) was printed as "the options {...}: ...", every option's
    value, the storage options' secret key included, and its str() from map_items too."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_text("a")
    secret = "wJalrXUtnFEMI-K7MDENG"
    base = [str(tmp_path / "src"), str(tmp_path / "dst"), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    for options, said in (
        (
            ["--out-reserve", "1KiB", "--out-ratio", "2"],
            "--out-ratio 2.0: give out_reserve or out_ratio, not both (--out-reserve or --out-ratio)",
        ),
        (["--upload-part-size", "1KiB"], "--upload-part-size '1KiB': upload_part_size 1024: expected at least 5 MiB"),
    ):
        assert main([*base, *options, "-o", f"secret={secret}", "--no-progress", "--", "true"]) == 2
        err = capsys.readouterr().err
        assert said in err and secret not in err and "the options" not in err, err
    with pytest.raises(ValueError, match="not both") as raised:
        map_items(
            ["true"], str(tmp_path / "src"), str(tmp_path / "dst"), cache_dir=tmp_path / "cache", capacity="1MiB",
            out_reserve="1KiB", out_ratio=2, storage_options={"secret": secret},
        )  # fmt: skip
    assert secret not in str(raised.value)
    assert not (tmp_path / "cache").exists()


# ---- review: placeholders replaced once -------------------------------------------------------------------------
def test_placeholders_are_replaced_once_not_inside_what_replaced_them(tmp_path):
    """Before, ``{out}``, ``{name}`` and ``{}`` were replaced one after the other, each in the result
    of the last: an item named ``clip{}.mp4`` reached the command as ``clip<its path>.mp4``."""
    src = tmp_path / "src"
    (src / "clip{}").mkdir(parents=True)
    (src / "clip{}" / "f").write_text("x")
    result = map_items(
        ["sh", "-c", 'printf "%s|%s" "$1" "$2" > "$CACHEPIPE_OUT/args"', "sh", "{name}", "{}"],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        out_reserve="4KiB",
    )
    assert result.ok, result.failed
    name, item = (tmp_path / "dst" / "clip{}" / "args").read_text().split("|")
    assert name == "clip{}" and item.endswith("/clip{}")


def test_a_malformed_storage_option_is_a_usage_error(tmp_path, capsys):
    """``-o foo`` (no ``=``) exited 1, as a failed run does; map.md gives 2 for a value an option refuses."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_text("a")
    base = [str(tmp_path / "src"), str(tmp_path / "dst"), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    for flag in ("-o", "--dest-option"):
        assert main([*base, flag, "endpoint_url", "--no-progress", "--", "true"]) == 2
        assert "storage option 'endpoint_url': expected KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_an_output_folder_replaced_by_a_link_is_not_followed(tmp_path):
    """A command that replaces its output folder with a link to a folder elsewhere: before, the
    files there were uploaded as the item's results (every link inside the folder is checked to
    stay in it, the folder itself was not), and the watcher, which follows no link, did not
    count them."""
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_text("a")
    elsewhere.mkdir()
    (elsewhere / "not-an-output.txt").write_text("private")
    result = map_items(
        ["sh", "-c", 'rmdir "$CACHEPIPE_OUT" && ln -s "$1" "$CACHEPIPE_OUT"', "sh", str(elsewhere)],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        out_reserve="4KiB",
    )
    [failure] = result.failed
    assert failure.name == "a" and "OutputError" in failure.error and "link" in failure.error, failure
    assert not (tmp_path / "dst").exists() and (elsewhere / "not-an-output.txt").read_text() == "private"


def test_a_local_destination_s_temporary_file_left_by_a_killed_upload_is_overwritten_by_the_next(tmp_path):
    """A local destination's output is written to a temporary name and renamed; a SIGKILL during
    the copy left that file (``<name>.cachepipe-<random id>.tmp``) for good, beside the results.
    Its name is now the same at every put of the key, so the next put overwrites it; it is
    locked while written, so a second put of the key at the same time waits for the first."""
    import fcntl

    dest, local = tmp_path / "dst", tmp_path / "part.bin"
    (dest / "item").mkdir(parents=True)
    local.write_bytes(b"new")
    temp = dest / "item" / "part.bin.cachepipe.tmp"
    temp.write_bytes(b"what a killed upload wrote, longer than the new bytes")
    FsspecStore(str(dest)).put(local, "item/part.bin")
    assert sorted(p.name for p in (dest / "item").iterdir()) == ["part.bin"]
    assert (dest / "item" / "part.bin").read_bytes() == b"new"

    done = threading.Event()
    with open(temp, "wb") as other:  # another put of the key, under way
        fcntl.flock(other, fcntl.LOCK_EX)
        thread = threading.Thread(target=lambda: (FsspecStore(str(dest)).put(local, "item/part.bin"), done.set()))
        thread.start()
        assert not done.wait(0.3)  # it waits for the put under way (a guard: a put that did not wait is done by now)
        other.write(b"the other put's")
        other.flush()
        os.replace(temp, dest / "item" / "part.bin")
    thread.join(10)
    assert done.is_set() and (dest / "item" / "part.bin").read_bytes() == b"new"  # its own file, after the other's
    assert sorted(p.name for p in (dest / "item").iterdir()) == ["part.bin"]


def test_outputs_named_like_a_file_being_written_are_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "clip.mp4.cachepipe.tmp").write_bytes(b"x")
    with pytest.raises(OutputError, match=r"clip.mp4.cachepipe.tmp.*reserved for files being written"):
        collect_outputs(tmp_path / "out")


def test_unpack_keeps_a_folder_item_s_files_that_are_not_archives(s3_source, s3_client, tmp_path):
    """A folder item of an archive and a caption arrived as the extraction alone: the caption was
    dropped without a word (``Pipeline(unpack=True)`` keeps it, and docs/archives.md says so). A
    caption at the path of an extracted member fails its item, naming both."""
    # incompressible, and large beside a block: within the default unpack reserve in whole blocks, with x.bin's
    # rounding up, the folder d and y.txt's block
    frame = __import__("random").Random(7).randbytes(50_000)
    s3_source.put("clips/a/frames.tar.gz", tar_bytes({"x.bin": frame, "d/y.txt": b"hello"}, "w:gz"))
    s3_source.put("clips/a/text.txt", b"a caption")
    s3_source.put("clips/b/frames.tar", tar_bytes({"text.txt": b"extracted"}, "w"))
    s3_source.put("clips/b/text.txt", b"beside it")
    for command in ([], COPY_TREE):
        out = f"out{len(command)}/"
        proc = cli(
            s3_source.url + "clips/",
            s3_source.url + out,
            "--cache",
            str(tmp_path / "cache"),
            "--capacity",
            "1MiB",
            "--unpack",
            "--retries",
            "0",
            "--no-progress",
            *storage_args(s3_source.options),
            *command,
        )
        assert proc.returncode == 1 and "1 done, 1 failed" in proc.stderr, proc.stderr
        assert "file 'text.txt' of the item collides with 'text.txt' extracted from its archive(s)" in proc.stderr
        results = bucket(s3_client, s3_source.url.split("/", 3)[3] + out)
        assert {k: v for k, v in results.items() if not k.endswith(DONE_MARKER)} == {
            "a/x.bin": frame,
            "a/d/y.txt": b"hello",
            "a/text.txt": b"a caption",
        }
    assert_cache_clean(tmp_path / "cache")


def test_a_key_is_not_run_as_code_where_a_placeholder_is_put_into_a_script(tmp_path, monkeypatch):
    """``sh -c 'ls {}'`` put the item's path into the shell's script as text: a key such as
    ``x$(touch pwned)y`` ran its command substitution. Such an item now fails, naming the
    characters and the variable to read instead; a plain name in a script, and any name in an
    argument that is not code, run as before."""
    src, marks = tmp_path / "src", tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("PWNED", str(marks / "pwned"))  # the commands inherit the environment
    for name in ("x$(touch $PWNED)y", "plain-1.0", "with space"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_text(name)
    script = ["sh", "-c", f'cat {{}}/f > /dev/null && touch "{marks}/ran-$CACHEPIPE_NAME"']
    result = map_items(script, str(src), str(tmp_path / "dst"), cache_dir=tmp_path / "cache", capacity="1MiB", retries=0)
    assert sorted(f.name for f in result.failed) == sorted(["x$(touch $PWNED)y", "with space"])
    assert all("UnsafeArgumentError" in f.error and 'read "$CACHEPIPE_ITEM" in the script' in f.error for f in result.failed)
    assert sorted(p.name for p in marks.iterdir()) == ["ran-plain-1.0"]  # no "pwned": the code was not run
    argv = ["cp", "{}/f", "{out}/copy"]  # no shell: any name is one argument
    result = map_items(argv, str(src), str(tmp_path / "dst2"), cache_dir=tmp_path / "cache", capacity="1MiB", retries=0)
    assert result.ok and result.items_done == 3, result.failed


def test_a_full_destination_stops_the_run_and_a_rerun_with_space_finishes_it(tmp_path):
    """A local destination that filled up cost each item its uploads' retries three times over
    (about 3 minutes an item with the defaults) and the run went on through every item. An
    upload that still finds it full after its retries now stops the run, saying so; a run
    after space was freed finishes it, keeping the items done."""
    from test_disk_faults import tmpfs

    src = tmp_path / "src"
    for i in range(4):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "f").write_bytes(os.urandom(40 * 1024))
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "request_retries": 2, "retry_backoff": 0.01, "jobs": 1}
    with tmpfs(tmp_path / "dst", "200k") as dst:
        tenant = dst / "other-tenant.bin"
        tenant.write_bytes(b"t" * 130 * 1024)  # room for one item's output
        with pytest.raises(DestinationFullError, match=r"the destination is full after 3 attempt\(s\).*the run stops"):
            map_items(["cp", "f", "{out}/g"], str(src), str(dst / "out"), **options)
        done = sorted(p.parent.name for p in (dst / "out").glob(f"*/{DONE_MARKER}"))
        assert len(done) == 1, done
        tenant.unlink()
        result = map_items(["cp", "f", "{out}/g"], str(src), str(dst / "out"), **options)
        assert result.ok and (result.items_done, result.items_skipped) == (3, 1), result.failed
    assert_cache_clean(tmp_path / "cache")


def test_a_name_that_is_not_utf8_is_mapped_and_printed_as_its_bytes(tmp_path):
    """A Latin-1 name of a local source is run and its outputs written under the same bytes; and
    under a strict stdout (en_US.UTF-8's; ``PYTHONIOENCODING=utf-8`` stands in) both entry points'
    dry runs print it as its bytes. Before, every run failed as it sized the cache ("'utf-8'
    codec can't encode"), and the dry run's listing failed to print once that was fixed."""
    src = os.fsencode(tmp_path / "src")
    os.makedirs(src + b"/caf\xe9")
    with open(src + b"/caf\xe9/a.bin", "wb") as fh:
        fh.write(b"a" * 10)
    args = [str(tmp_path / "src"), str(tmp_path / "out"), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    strict = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    for entry in (["cachepipe.map"], ["cachepipe", "map"]):
        argv = [sys.executable, "-m", *entry, *args, "--no-progress", "--dry-run", "--", "true"]
        done = subprocess.run(argv, capture_output=True, env=strict, timeout=60, check=False)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        assert done.stdout.splitlines()[0] == b"would run: caf\xe9 -> " + os.fsencode(tmp_path / "out") + b"/caf\xe9/"
    command = ["--", "sh", "-c", 'cp a.bin "$CACHEPIPE_OUT/" && printf %s "$CACHEPIPE_NAME" > "$CACHEPIPE_OUT/name"']
    argv = [sys.executable, "-m", "cachepipe.map", *args, "--out-reserve", "64KiB", "--no-progress", *command]  # 2 files
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = os.fsencode(tmp_path / "out") + b"/caf\xe9"
    with open(out + b"/name", "rb") as fh, open(out + b"/a.bin", "rb") as data:
        assert (fh.read(), data.read()) == (b"caf\xe9", b"a" * 10)


def test_an_infinite_ratio_or_timeout_is_a_usage_error_naming_the_option(tmp_path, capsys):
    """Before: ``--out-ratio inf`` crashed the command with an OverflowError traceback, and
    ``--timeout inf`` ran every item's command and failed each with an OverflowError."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "in.txt").write_text("a")
    sized = [str(src), str(tmp_path / "dst"), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB"]
    for flag in ("--out-ratio", "--timeout", "--unpack-ratio"):
        assert main([*sized, flag, "inf", "--", "true"]) == 2
        assert f"{flag} inf: Input should be a finite number" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


KILLED_RUN = r"""
import sys
from cachepipe.map import map_items
src, dst, cache = sys.argv[1:4]
map_items(["sh", "-c", "kill -9 $PPID"], src, dst, cache_dir=cache, capacity="256KiB", out_reserve=1024, out_margin=1024, jobs=1)
"""


def test_names_of_undecodable_bytes_are_sized_as_the_cache_budgets_them_on_a_rerun(tmp_path):
    """A rerun after a killed run reopens the cache over the whole catalog, whose journal budget
    counts a name's undecodable byte as its surrogate's three UTF-8 bytes (Catalog.name_bytes);
    the run's sizing counted one. An item the sizing let through as fitting beside its state
    then crashed the rerun (OversizeError out of map_items): 20 names of 50 such bytes, 16,000
    bytes more budget than sized. Now the sizing counts as the cache does: the item is refused
    before anything is downloaded, and the rest are done."""
    from cachepipe.cache.core import journal_budget_of

    src = os.fsencode(tmp_path / "src")
    names = [b"\xe9" * 50 + b"%02d" % i for i in range(20)]
    (tmp_path / "one" / "a").mkdir(parents=True)
    (tmp_path / "one" / "a" / "a.bin").write_bytes(b"a")
    options = {"cache_dir": tmp_path / "cache", "capacity": "256KiB", "out_reserve": 1024, "out_margin": 1024, "jobs": 1}
    slot = map_items(["true"], str(tmp_path / "one"), str(tmp_path / "dst"), dry_run=True, **options)  # a job's share
    # in whole blocks, as the cache counts: the largest item, its names' undecodable bytes counted one byte a byte
    # (the journal's budget, the state's 4 blocks and the work folder's; the item's file beside its folder's block)
    block = clamp_block(os.statvfs(tmp_path).f_frsize)
    state = round_up(journal_budget_of(sum(map(len, names)), len(names)), block) + 5 * block
    sized = (256 * KIB - (slot.reserve + slot.margin) - state) // block * block - block
    for i, name in enumerate(names):
        os.makedirs(src + b"/" + name)
        with open(src + b"/" + name + b"/a.bin", "wb") as fh:
            fh.write(b"a" * (sized if i == len(names) - 1 else 100))
    argv = [sys.executable, "-c", KILLED_RUN, str(tmp_path / "src"), str(tmp_path / "dst"), str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run(argv, capture_output=True, timeout=120, env=env, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode(errors="replace")
    result = map_items(["true"], str(tmp_path / "src"), str(tmp_path / "dst"), **options)
    assert [(f.name, f.attempts) for f in result.failed] == [(os.fsdecode(names[-1]), 0)], result.failed  # refused
    assert "give capacity (--capacity) at least" in result.failed[0].error and result.items_done == len(names) - 1
    assert_cache_clean(tmp_path / "cache")


def test_a_timeout_longer_than_a_wait_can_take_is_kept_and_its_command_is_waited_for(tmp_path):
    """A timeout past what one wait of the kernel can take (``epoll``: 24.8 days) failed every
    item with ``OverflowError: timeout is too large``, and left its command running while the
    item's next attempt started beside it (the command was never waited for)."""
    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "a.bin").write_bytes(os.urandom(300))
    log = tmp_path / "runs.log"
    result = map_items(
        [sys.executable, "-c", "import time; time.sleep(0.5); " + COPY, str(log)],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        timeout=30 * 86400.0,  # a month
    )
    assert result.ok and result.items_done == 2, result.failed
    assert sorted(runs(log)) == ["a", "b"]  # each command ran once, to its end
    assert (tmp_path / "dst" / "a" / "out.bin").read_bytes() == (src / "a" / "a.bin").read_bytes()
    assert_cache_clean(tmp_path / "cache")


def test_a_command_that_closed_its_stderr_is_not_stopped_when_one_wait_ends_before_its_timeout(tmp_path, monkeypatch):
    """Without a pidfd (Linux before 5.3, or refused by a seccomp filter), a command that
    closed its stderr and ran on is waited for by its process alone, a wait of at most
    LONGEST_WAIT (a day) at a time. Each wait that ended was taken for the deadline: the
    command got SIGTERM a day in, whatever its timeout (a month), and its item failed as timed
    out. (LONGEST_WAIT made 0.2 s here, the command's run 1.5 s, its timeout 60 s.)"""
    monkeypatch.setattr(map_child, "LONGEST_WAIT", 0.2)
    monkeypatch.setattr(map_child, "_exit_fd", lambda _pid: None)
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "a.bin").write_bytes(os.urandom(300))
    result = map_items(
        ["sh", "-c", 'exec 2>&-; sleep 1.5; cp a.bin "$CACHEPIPE_OUT/out.bin"'],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=tmp_path / "cache",
        capacity="1MiB",
        timeout=60.0,
        retries=0,
    )
    assert result.ok and result.items_done == 1, result.failed
    assert (tmp_path / "dst" / "a" / "out.bin").read_bytes() == (src / "a" / "a.bin").read_bytes()
    assert_cache_clean(tmp_path / "cache")


class MeasuringDest(FsspecStore):
    """A local destination that measures the jobs' slots as each completion marker is uploaded."""

    def __init__(self, url: str, work: Path) -> None:
        super().__init__(url, {})
        self.work = work
        self.at_marker: list[int] = []

    def put(self, local_path, key):
        if key.endswith(DONE_MARKER):
            self.at_marker.append(tree_bytes(self.work))
        super().put(local_path, key)


def test_the_completion_marker_takes_no_room_in_the_cache(tmp_path):
    """Outputs may fill their job's slot (reserve + margin) to the last byte. The marker, which
    lists every output, was written into the slot beside them: 600 output files made it ~13 KB
    where the margin was 1 KiB, and the cache passed its capacity by that much."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "in.bin").write_bytes(os.urandom(1000))
    many = (
        "import os; out = os.environ['CACHEPIPE_OUT']; open(os.path.join(out, 'all.bin'), 'wb').write(os.urandom(4096))\n"
        "for i in range(600): open(os.path.join(out, f'frame_{i:06d}.jpg'), 'wb').close()"
    )
    cache = tmp_path / "cache"
    dest = MeasuringDest(str(tmp_path / "dst"), cache / WORK_DIR)
    result = map_items(
        [sys.executable, "-c", many],
        str(src),
        str(tmp_path / "dst"),
        cache_dir=cache,
        capacity="1MiB",
        out_reserve="4KiB",
        out_margin="1KiB",
        dest_store=dest,
    )
    assert result.ok and result.items_done == 1, result.failed
    marker = (tmp_path / "dst" / "a" / DONE_MARKER).read_bytes()
    assert len(marker) > 10 * KIB and len(json.loads(marker)["files"]) == 601
    assert dest.at_marker == [4096]  # the outputs alone: the marker is not in the slot of 5 KiB
    assert_cache_clean(cache)


class ReadOnlyDest(FsspecStore):
    """A destination whose credentials may read but not write: every upload is refused (403)."""

    def put(self, local_path, key):
        raise PermissionError(f"access denied to {key} (AccessDenied)")


def test_a_destination_that_refuses_writes_stops_the_run_at_its_first_refusal(tmp_path):
    """Credentials that may not write to DST (or that expired) pass the bucket's check: every
    item was downloaded, its command run and its upload refused, three times an item, through
    the whole dataset. The first refusal now stops the run, saying what to do."""
    src = tmp_path / "src"
    for i in range(4):
        (src / f"item{i}").mkdir(parents=True)
        (src / f"item{i}" / "a.bin").write_bytes(os.urandom(300))
    log = tmp_path / "runs.log"
    with pytest.raises(DestinationDeniedError, match=r"the destination refused .*item0/out.bin.*the run stops") as caught:
        map_items(
            [sys.executable, "-c", COPY, str(log)],
            str(src),
            str(tmp_path / "dst"),
            cache_dir=tmp_path / "cache",
            capacity="1MiB",
            dest_store=ReadOnlyDest(str(tmp_path / "dst"), {}),
        )
    assert isinstance(caught.value, PermissionError)
    assert runs(log) == ["item0"]  # one command run, once
    assert_cache_clean(tmp_path / "cache")


READ_ONLY_DEST = r"""
import sys
from cachepipe.map import map_items
from cachepipe.map.uploader import DestinationDeniedError
src, dst, cache = sys.argv[1:4]
try:
    map_items(["sh", "-c", 'cp f "$CACHEPIPE_OUT/g"'], src, dst, cache_dir=cache, capacity="1MiB", out_reserve="4KiB")
except DestinationDeniedError as exc:
    print(exc)
"""


def test_a_local_destination_that_refuses_writes_is_named_with_what_to_do_for_it(tmp_path):
    """A local DST its user may not write (chmod 555) stops the run as S3's AccessDenied does;
    what to do is write permission on its folders. The message named only S3's permission
    (s3:PutObject), which a local destination has no use for."""
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "f").write_bytes(os.urandom(100))
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst").chmod(0o555)
    argv = [
        *as_a_user(),
        sys.executable,
        "-c",
        READ_ONLY_DEST,
        str(tmp_path / "src"),
        str(tmp_path / "dst"),
        str(tmp_path / "cache"),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "the destination refused" in proc.stdout and "write permission on its folders" in proc.stdout, proc.stdout


READ_ONLY_OUTPUTS = r"""
import json, os, sys
from cachepipe.map import map_items
src, dst, cache = sys.argv[1:4]
script = 'mkdir "$CACHEPIPE_OUT/ro" && cp f "$CACHEPIPE_OUT/ro/g" && chmod 555 "$CACHEPIPE_OUT/ro" "$CACHEPIPE_OUT"'
command = ["sh", "-c", script]
result = map_items(command, src, dst, cache_dir=cache, capacity="1MiB", out_reserve="64KiB")  # a few blocks
print(json.dumps([result.items_done, [f.error for f in result.failed]]))
"""


def _map_as_a_user(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (a map of ``src`` to ``dst`` with ``cache``, from its argv) as a user runs it
    (:func:`as_a_user`), over ``tmp_path/src`` of three items (made if missing) of a file ``f``."""
    drop = as_a_user()
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        if not (src / name).exists():
            (src / name).mkdir(parents=True)
            (src / name / "f").write_bytes(os.urandom(100))
    argv = [*drop, sys.executable, "-c", code, str(src), str(tmp_path / "dst"), str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)


def test_a_read_only_folder_among_the_outputs_is_removed_with_its_slot(tmp_path):
    """A command that leaves a folder it cannot write in its output (``chmod 555``; ``cp -r`` or
    ``tar x`` of a read-only tree) crashed the run after its first item (PermissionError
    clearing the slot), and every later run on that cache at its start (clearing the slot
    left). Run without the capabilities that let root write anywhere, as a user runs it."""
    src = tmp_path / "src"
    done = []
    for _run in range(2):  # the second finds nothing to do
        proc = _map_as_a_user(READ_ONLY_OUTPUTS, tmp_path)
        assert proc.returncode == 0, proc.stderr
        done.append(json.loads(proc.stdout))
    assert done == [[3, []], [0, []]]
    for name in ("a", "b", "c"):
        assert (tmp_path / "dst" / name / "ro" / "g").read_bytes() == (src / name / "f").read_bytes()
    assert_cache_clean(tmp_path / "cache")


UNREADABLE_OUTPUTS = r"""
import json, os, sys
from cachepipe.map import map_items
src, dst, cache = sys.argv[1:4]
script = 'mkdir "$CACHEPIPE_OUT/sub" && cp f "$CACHEPIPE_OUT/sub/g" && cp f "$CACHEPIPE_OUT/top"'
script += ' && chmod 000 "$CACHEPIPE_OUT/sub"'
result = map_items(["sh", "-c", script], src, dst, cache_dir=cache, capacity="1MiB", out_reserve="64KiB", retries=0)
print(json.dumps([result.items_done, [f.error for f in result.failed]]))
"""


def test_a_folder_of_the_outputs_that_cannot_be_listed_fails_its_item(tmp_path):
    """A command that leaves a folder of its outputs it cannot list (``chmod 000``): the walk of
    the outputs passed over it (``os.walk`` omits errors), so its files were not uploaded, the
    marker was written and the item counted done (3 done, nothing failed). It fails the item
    now, naming the folder. Run without the capabilities that let root read any folder."""
    proc = _map_as_a_user(UNREADABLE_OUTPUTS, tmp_path)
    assert proc.returncode == 0, proc.stderr
    done, errors = json.loads(proc.stdout)
    assert done == 0 and len(errors) == 3, proc.stdout
    assert all("'sub'" in e and "cannot be listed" in e for e in errors), errors
    assert not any((tmp_path / "dst" / name / ".cachepipe-done").exists() for name in ("a", "b", "c"))
    assert_cache_clean(tmp_path / "cache")


READ_ONLY_INPUT = r"""
import json, os, sys
from cachepipe.map import map_items
src, dst, cache = sys.argv[1:4]
command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g" && mkdir sub && chmod 555 sub .']  # its input folder made read-only
result = map_items(command, src, dst, cache_dir=cache, capacity="1MiB", out_reserve="64KiB")  # a few blocks
print(json.dumps([result.items_done, [f.error for f in result.failed]]))
"""


def test_an_input_folder_its_command_made_read_only_is_still_removed_from_the_cache(tmp_path):
    """A command that makes its working directory (the item's folder in the cache) read-only
    left the item there for good, run by a user other than root: its ack could not delete it
    ('could not delete b ... counted as foreign'), and a later run on the cache failed the item
    ('exists and is not managed by cachepipe')."""
    drop = as_a_user()
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(os.urandom(100))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = []
    for dst in ("dst1", "dst2"):  # the second, to another destination, downloads every item again
        argv = [*drop, sys.executable, "-c", READ_ONLY_INPUT, str(src), str(tmp_path / dst), str(tmp_path / "cache")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
        assert proc.returncode == 0, proc.stderr
        assert "could not delete" not in proc.stderr, proc.stderr
        done.append(json.loads(proc.stdout))
    assert done == [[3, []], [3, []]]
    assert_cache_clean(tmp_path / "cache")


def test_a_command_that_deletes_its_input_folder_is_done(tmp_path):
    """Its folder's permissions, restored after the command (a read-only input, above), are
    looked for in a folder that may be gone."""
    src = tmp_path / "src"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(os.urandom(100))
    command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g" && rm -rf "$CACHEPIPE_ITEM"']
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "out_reserve": "4KiB"}
    result = map_items(command, str(src), str(tmp_path / "dst"), **options)
    assert result.ok and result.items_done == 2 and result.items_retried == 0, result.failed
    assert (tmp_path / "dst" / "b" / "g").read_bytes() == (src / "b" / "f").read_bytes()
    assert_cache_clean(tmp_path / "cache")


UNREADABLE_OUTPUT = r"""
import json, os, sys
from cachepipe.map import map_items
src, dst, cache = sys.argv[1:4]
script = 'cp f "$CACHEPIPE_OUT/g" && if [ "$CACHEPIPE_NAME" = b ]; then chmod 000 "$CACHEPIPE_OUT/g"; fi'
result = map_items(["sh", "-c", script], src, dst, cache_dir=cache, capacity="1MiB", out_reserve="4KiB", retries=0)
print(json.dumps([result.items_done, [(f.name, f.error) for f in result.failed]]))
"""


def test_an_output_its_command_made_unreadable_fails_its_item_not_the_run(tmp_path):
    """An upload refused for reading the local output (``chmod 000`` by the command, run by a
    user) is the item's failure. It was taken for the destination refusing writes
    (``DestinationDeniedError``), which stops the whole run."""
    src = tmp_path / "src"
    for name in ("a", "b", "c"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_bytes(os.urandom(100))
    argv = [*as_a_user(), sys.executable, "-c", UNREADABLE_OUTPUT, str(src), str(tmp_path / "dst"), str(tmp_path / "cache")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    done, failed = json.loads(proc.stdout)
    assert done == 2 and [name for name, _ in failed] == ["b"] and "Permission denied" in failed[0][1], failed
    assert not (tmp_path / "dst" / "b" / DONE_MARKER).exists() and (tmp_path / "dst" / "c" / DONE_MARKER).exists()


def test_a_destination_that_refuses_writes_is_told_once_on_the_command_line(s3_source, s3_endpoint, moto_iam, tmp_path):
    """Credentials that may read the bucket but not write it, against the moto server with its
    IAM checks on: the run stops at the first upload. The error was printed twice without -v,
    logged by the job that met it (the library's fallback handler writes warnings and errors to
    stderr) and then by the command line."""
    s3_source.folders(2, {"f": 100})
    key, secret = moto_iam.user("reads-only", ["s3:GetObject", "s3:ListBucket"])
    moto_iam.enforce()
    options = {"endpoint_url": s3_endpoint, "key": key, "secret": secret}
    proc = cli(
        s3_source.url, "s3://data/out/", "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--no-progress",
        *storage_args(options), "--", "sh", "-c", 'cp f "$CACHEPIPE_OUT/g"',
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cachepipe map: uploading item000/g: the destination refused it"), proc.stderr
    assert "give credentials that may write there (s3:PutObject" in lines[0]


def _held_upload_run(s3_client, fault_proxy, tmp_path) -> tuple[list[str], threading.Event]:
    """The command line of a map run of items ``a`` and ``b`` into s3://data/out/ through the
    fault proxy, which holds every upload (``a``'s) until the returned gate is set; ``b``'s
    command writes its pid to ``tmp_path/b.pid`` and sleeps, so that its death tells a stop has
    begun. The cache is ``tmp_path/cache``."""
    s3_client.create_bucket(Bucket="data")
    proxy, endpoint = fault_proxy
    src, cache = tmp_path / "src", tmp_path / "cache"
    for name in ("a", "b"):
        (src / name).mkdir(parents=True)
        (src / name / "f").write_text(name)
    gate = threading.Event()
    proxy.hold(lambda head: head.startswith("PUT "), gate)
    script = 'echo $$ > "$0/$CACHEPIPE_NAME.pid"; cp f "$CACHEPIPE_OUT/g"; [ "$CACHEPIPE_NAME" = a ] || exec sleep 60'
    argv = [sys.executable, "-m", "cachepipe.map", str(src), "s3://data/out/", "--cache", str(cache), "--capacity", "1MiB"]
    argv += ["--jobs", "2", "--no-progress", "--retries", "0"]
    argv += [arg for opt in (f"endpoint_url={endpoint}", "key=k", "secret=s") for arg in ("--dest-option", opt)]
    return [*argv, "--", "sh", "-c", script, str(tmp_path)], gate


def _stop_begun(proc: subprocess.Popen, proxy, tmp_path, sig: int, stderr) -> None:
    """Wait for ``a``'s upload held and ``b``'s command started, send ``sig``, wait for ``b``'s
    command killed by the stop (``stderr()``: what the run wrote, for a failure's message)."""
    wait_until(lambda: any(h.startswith("PUT ") for h in proxy.requests) or proc.poll() is not None, what="a's upload held")
    assert proc.poll() is None, stderr()
    sleeper = int(wait_until(lambda: (tmp_path / "b.pid").exists() and (tmp_path / "b.pid").read_text().strip()))
    proc.send_signal(sig)
    wait_until(lambda: not alive(sleeper), what="b's command killed by the stop")


def test_a_second_sigterm_while_the_run_stops_does_not_cut_the_stop_short(s3_client, fault_proxy, tmp_path):
    """SIGTERM stops the run as Ctrl-C does (exit 143). A second one that came while it stopped
    (a supervisor or a user sending it again) raised into the stop itself: the joins of the
    jobs, the uploads' end, the slots' removal were cut short, and the run ended with an error
    of what was half closed, or died by the signal (exit -15) once the handler was put back.
    Here item ``a``'s upload is held at the proxy, so the stop waits for it; item ``b``'s command
    sleeps, and its death tells the stop has begun. The second SIGTERM is then sent, and the
    upload let go. Now it is ignored, noted once (the note shows it came while the run stopped)."""
    argv, gate = _held_upload_run(s3_client, fault_proxy, tmp_path)
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        _stop_begun(proc, fault_proxy[0], tmp_path, signal.SIGTERM, lambda: proc.communicate()[1])
        proc.send_signal(signal.SIGTERM)  # the run is stopping: waiting for a's upload
        gate.set()
        _, stderr = proc.communicate(timeout=60)
    finally:
        gate.set()
        proc.kill()
    cache = tmp_path / "cache"
    assert proc.returncode == 143, stderr
    assert stderr.splitlines()[-2:] == [
        (
            "cachepipe map: already stopping (commands killed, uploads in flight ending); a third signal (or SIGKILL) ends it "
            "at once, and the next run resumes"
        ),
        "cachepipe map: terminated (SIGTERM); run the same command again to resume",
    ], stderr
    assert sorted(os.listdir(cache / WORK_DIR)) == ["lock"]  # the slots removed: the stop ran to its end
    assert bucket(s3_client, "out/").get(f"a/{DONE_MARKER}") is None  # stopped: a is not marked done


def test_a_third_signal_ends_a_stop_held_by_an_upload_at_once(s3_client, fault_proxy, tmp_path):
    """A stop waits for the uploads in flight, and a second signal is ignored so that it runs to
    its end; an upload that hangs (``a``'s, held at the proxy here and never let go) held the stop
    until the store's timeouts, minutes, and only SIGKILL ended it. A third signal ends it at
    once, with the first one's status (Ctrl-C: 130). ``b``'s command sleeps: its death tells the
    stop has begun."""
    argv, gate = _held_upload_run(s3_client, fault_proxy, tmp_path)
    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen(argv, stderr=sink)
    try:
        _stop_begun(proc, fault_proxy[0], tmp_path, signal.SIGINT, err.read_text)
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "already stopping" in err.read_text() or proc.poll() is not None, what="the second noted")
        assert proc.poll() is None, err.read_text()  # the stop waits for a's held upload
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        gate.set()
        proc.kill()
        proc.wait()
    stderr = err.read_text()
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (
        "cachepipe map: ended at once by a third signal, uploads in flight cut short; the next run resumes"
    ), stderr
    assert bucket(s3_client, "out/").get(f"a/{DONE_MARKER}") is None


def test_the_completion_marker_is_stored_as_json(remote_source, s3_client, tmp_path):
    """The marker is uploaded from memory (``/proc/self/fd/N``), whose name tells no media type:
    S3 (s3fs) and OBS (its SDK) stored it as binary/octet-stream, where it had been
    application/json, guessed from the name of the file it was uploaded from. Its type is now
    given; the outputs keep the stores' own guess by their names."""
    remote_source.folders(1, {"f": 100})
    dst = remote_source.url.replace("/video/", "/out/")
    command = ["sh", "-c", 'cp f "$CACHEPIPE_OUT/g.json"']
    result = map_items(
        command, remote_source.url, dst, cache_dir=tmp_path / "cache", capacity="1MiB", storage_options=remote_source.options
    )
    assert result.ok and result.items_done == 1, result.failed
    marker = s3_client.head_object(Bucket="data", Key=f"out/item000/{DONE_MARKER}")
    assert marker["ContentType"] == "application/json"
    assert s3_client.head_object(Bucket="data", Key="out/item000/g.json")["ContentType"] == "application/json"


def test_an_item_whose_results_folder_lies_in_another_s_is_refused_with_it(s3_source, s3_client, tmp_path, capsys):
    """S3 holds an object ``a.tar`` and one under ``a.tar/``: with ``--items files --unpack``
    both were items, with their results in ``DST/a.tar/`` and ``DST/a.tar/b.tar/``. ``a.tar``'s
    outputs named ``b.tar/...`` then landed among ``a.tar/b.tar``'s, whose objects a rerun
    deletes (the listing gives a key to the item of the longest folder holding it), leaving
    ``a.tar``'s marker listing what was gone. Both are refused now, each naming the other
    (the dry run first); the others run."""
    for key in ("a.tar", "a.tar/b.tar", "x.tar"):
        s3_source.put(key, tar_bytes({"b.tar/f": b"from " + key.encode()}))
    dst = "s3://data/out/"
    options = {"cache_dir": tmp_path / "cache", "capacity": "1MiB", "storage_options": s3_source.options, "items": "files"}
    args = [s3_source.url, dst, "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--items", "files", "--unpack"]
    assert main([*args, "--dry-run", *storage_args(s3_source.options)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "would run: x.tar -> s3://data/out/x.tar/", out
    assert out[1].startswith("would refuse: a.tar: item 'a.tar' has its results in DST/a.tar/, which holds the folder of ")
    assert out[2].startswith("would refuse: a.tar/b.tar: item 'a.tar/b.tar' has its results in DST/a.tar/b.tar/, inside ")
    result = map_items(None, s3_source.url, dst, unpack=True, **options)
    assert result.items_done == 1 and sorted(f.name for f in result.failed) == ["a.tar", "a.tar/b.tar"], result.failed
    assert "rename or move one of them in SRC" in result.failed[0].error
    assert set(bucket(s3_client, "out/")) == {"x.tar/b.tar/f", f"x.tar/{DONE_MARKER}"}


def test_a_stop_by_sigterm_in_a_call_from_python_gives_the_caller_its_signal_handlers_back(tmp_path):
    """``cachepipe.map.cli.main([...])`` called from a Python program and stopped by SIGTERM (or
    Ctrl-C) returned 143 (130) as it should, but left both signals ignored (SIG_IGN) in the
    caller for good, meant for the command line's process, which exits: the program could no
    longer be stopped by Ctrl-C or a supervisor's SIGTERM. The caller's handlers are put back."""
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_text("a")
    argv = [str(src), str(tmp_path / "dst"), "--cache", str(tmp_path / "cache"), "--capacity", "1MiB", "--no-progress"]
    argv += ["--", "sh", "-c", 'echo $$ > "$0/pid"; exec sleep 60', str(tmp_path)]
    program = (
        "import signal, sys\n"
        "from cachepipe.map.cli import main\n"
        f"code = main({argv!r})\n"
        "print(code, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "
        "signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (tmp_path / "pid").exists() or proc.poll() is not None, what="the command started")
        assert proc.poll() is None, proc.communicate()
        sleeper = int(wait_until(lambda: (tmp_path / "pid").read_text().strip(), what="the command's pid written"))
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert not alive(sleeper)
    assert proc.returncode == 0, err
    assert "cachepipe map: terminated (SIGTERM); run the same command again to resume" in err
    assert out.split() == ["143", "True", "True"], (out, err)  # before: "143 False False" (both SIG_IGN)


def test_a_slot_whose_file_a_dying_process_still_holds_on_nfs_is_removed_once_it_is_closed(tmp_path):
    """On NFS a file removed while a process holds it open stays in its folder (``.nfsXXXX``,
    its removal refused with ``EBUSY``) until it is closed. A command's process that map has just
    killed (at a stop, SIGTERM: or a leftover killed when its command exited) holds its output
    for a moment more: the slot's removal failed, and a SIGTERM's run ended with "[Errno 39]
    Directory not empty: 'out'", exit 1, instead of the stop (seen on ``tests/nfslike.py``). Now
    the removal is tried again while that is what it meets, for a few seconds."""
    with nfs_like(tmp_path / "nfs") as nfs:
        slot = nfs / "0"
        (slot / "out").mkdir(parents=True)
        (slot / "out" / "part").write_bytes(b"x" * 100)
        holder = open(slot / "out" / "part", "rb")  # noqa: SIM115 - the dying process's, closed below
        removing = threading.Thread(target=lambda: map_job.remove_slot(slot))
        removing.start()  # (a failure is the thread's exception: an error of the test)
        try:
            wait_until(lambda: [p for p in os.listdir(slot / "out") if p.startswith(".fuse_hidden")], 30, "the open file hidden")
        finally:
            holder.close()
            removing.join(30)
        assert not slot.exists()
