"""Crash safety: a consumer process killed with SIGKILL at random moments and restarted."""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import via
from sampling import Sampler
from waiting import wait_until
from zygote import Zygote

from cachepipe import ConfigError, Pipeline
from cachepipe.cache.recovery import plan_differences

HERE = Path(__file__).parent
KIB = 1024


class Child:
    """One run of tests/crash_child.py, its stdout read line by line in a thread; forked by
    ``zygote`` if given (its imports done once), else a process of its own."""

    def __init__(self, cfg: dict, zygote: Zygote | None = None) -> None:
        self.proc = (
            zygote.spawn(cfg)
            if zygote is not None
            else subprocess.Popen(
                [sys.executable, str(HERE / "crash_child.py"), json.dumps(cfg)],
                stdin=subprocess.PIPE,  # where a child run with "hold_after_acks" waits
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="test-child-reader")
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.endswith("\n"):
                continue  # torn by the kill: its write never completed
            with self.changed:
                self.lines.append(line.split())
                self.changed.notify_all()
        with self.changed:
            self.lines.append(["EOF"])
            self.changed.notify_all()

    def wait_for(self, predicate, timeout: float = 60) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(self.lines) or self.lines[-1:] == [["EOF"]], timeout):
                raise AssertionError(f"child did not get there in {timeout}s; stderr: {self.proc.stderr.read()}")

    def kill(self) -> None:
        self.proc.kill()
        self.finish()

    def finish(self) -> int:
        code = self.proc.wait(60)
        self._reader.join()
        self.stderr = self.proc.stderr.read()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return code


def test_kill_soak(s3_source, tmp_path):
    rng = random.Random(1234)
    n_items, kills = 300, 22
    data, objects = {}, {}
    for i in range(n_items):
        files = {"a.bin": rng.randbytes(rng.randint(1, 9) * KIB), "sub/b.txt": rng.randbytes(rng.randint(10, 900))}
        objects |= {f"s{i:04d}/{rel}": body for rel, body in files.items()}
        data[f"s{i:04d}"] = hashlib.md5(b"".join(files[rel] for rel in sorted(files))).hexdigest()
    s3_source.put_many(objects)
    capacity = 128 * KIB  # a dozen items beside the saved listing and the journal budget (~40 KiB)
    cache = tmp_path / "cache"
    cfg = {"url": s3_source.url, "cache": str(cache), "capacity": capacity, "options": s3_source.options, "work_seconds": 0.004}

    got: dict[str, int] = {}
    acked_before: set[str] = set()
    corrupt: list[str] = []
    came_back: list[str] = []
    with Zygote("crash_child", s3_source.url) as zygote, Sampler(cache) as sampler:
        for _run in range(kills):
            child = Child(cfg, zygote)
            target = rng.randint(0, 25)  # kill after this many more items were taken, plus a random delay
            child.wait_for(lambda lines: sum(1 for line in lines if line[0] == "GOT") >= target)  # noqa: B023 - the lambda is called at once, inside this iteration
            threading.Event().wait(rng.random() * 0.05)
            child.kill()
            _tally(child.lines, data, got, acked_before, corrupt, came_back)
            assert "Traceback" not in child.stderr, child.stderr
        final = Child(cfg, zygote)
        assert final.finish() == 0, final.stderr
        _tally(final.lines, data, got, acked_before, corrupt, came_back)
        assert final.lines[-2] == ["DONE"]

    redelivered = sum(n - 1 for n in got.values())
    print(
        f"\nkill soak: {kills} kills, {n_items} items, {sum(got.values())} deliveries, {redelivered} re-deliveries, "
        f"max cache {sampler.peak} bytes of {capacity} ({sampler.samples} samples), corrupt items: {len(corrupt)}"
    )
    assert set(got) == set(data), f"never delivered: {sorted(set(data) - set(got))[:10]}"
    assert corrupt == []
    assert came_back == [], f"acknowledged before a kill, delivered again after it: {came_back[:10]}"
    assert sampler.peak <= capacity, f"cache reached {sampler.peak} bytes, capacity {capacity}"
    assert sampler.samples > 100
    leftovers = [p for p in cache.rglob("*") if p.is_file() and p.parent.name != ".cachepipe"]
    assert leftovers == [], leftovers[:5]


def _tally(lines, data, got, acked_before, corrupt, came_back) -> None:
    acked_now = set()
    for line in lines:
        if line[0] == "GOT":
            name, digest = line[1], line[2]
            got[name] = got.get(name, 0) + 1
            if digest != data[name]:
                corrupt.append(name)
            if name in acked_before:
                came_back.append(name)
        elif line[0] == "ACKED":
            acked_now.add(line[1])
    acked_before |= acked_now


def test_restart_reuses_published_items_and_redelivers_leased_ones(s3_source, tmp_path):
    s3_source.folders(6, {"f": 2 * KIB})
    cache = tmp_path / "cache"
    cfg = {
        "url": s3_source.url,
        "cache": str(cache),
        "capacity": 1024**2,
        "options": s3_source.options,
        "wait_ready": 6,
        "hold_after_acks": 2,
    }  # the child acks two items, takes a third and waits, holding it: the kill lands there
    child = Child(cfg)
    child.wait_for(lambda lines: any(line[0] == "HOLDING" for line in lines))
    child.kill()
    acked = {line[1] for line in child.lines if line[0] == "ACKED"}
    taken = {line[1] for line in child.lines if line[0] == "GOT"}
    assert len(acked) == 2 and len(taken) == 3, child.lines
    (cache / ".cachepipe" / "staging" / "999").mkdir(parents=True)  # a staging leftover
    (cache / ".cachepipe" / "staging" / "999" / "half").write_bytes(b"x" * 100)
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        names = [p.name for p in pipe]
        stats = pipe.stats()
    everything = {f"item{i:03d}" for i in range(6)}
    assert not acked & set(names), "acknowledged items came back"
    assert taken - acked <= set(names), "the item leased when the child was killed was not delivered again"
    assert everything - taken <= set(names) and set(names) | taken == everything
    assert stats.items_reused == len(names) >= 3, "published items were downloaded again"
    assert stats.bytes_downloaded == 0
    assert not (cache / ".cachepipe" / "staging" / "999").exists()


def test_corrupt_journal_is_rebuilt_from_disk(s3_source, tmp_path):
    s3_source.folders(3, {"f": 100})
    cache = tmp_path / "cache"
    with Pipeline(
        s3_source.url, cache, "1MiB", storage_options=s3_source.options, keep_on_close=True, auto_ack=False, prefetch=3
    ) as pipe:
        pipe.get(timeout=30)
    (cache / ".cachepipe" / "journal").write_bytes(b"\x00garbage\nZ what\n")
    (cache / ".cachepipe" / "catalog").write_text("not json\n")
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        assert [p.name for p in pipe] == ["item000", "item001", "item002"]
        # the journal held the versions (ETags) the items on disk were downloaded at: without
        # it, an item matching the listing's sizes may be an object rewritten since, so it is
        # downloaded again (an item of a source without ETags is reused: the test below)
        assert pipe.stats().items_reused == 0


def test_corrupt_journal_reuses_items_of_a_source_without_etags(tmp_path):
    src = tmp_path / "src"
    for i in range(3):
        (src / f"item{i:03d}").mkdir(parents=True)
        (src / f"item{i:03d}" / "f").write_bytes(b"x" * 100)
    cache = tmp_path / "cache"
    with Pipeline(str(src), cache, "1MiB", keep_on_close=True, auto_ack=False, prefetch=3) as pipe:
        pipe.get(timeout=30)
    (cache / ".cachepipe" / "journal").write_bytes(b"\x00garbage\nZ what\n")
    with Pipeline(str(src), cache, "1MiB", resume=True) as pipe:
        assert [p.name for p in pipe] == ["item000", "item001", "item002"]
        assert pipe.stats().items_reused >= 1


def test_resume_over_another_source_or_items_mode_is_refused(s3_source, tmp_path):
    """Two prefixes of items of the same sizes: the plan's count and sizes are the same, so only
    the recorded source and items mode tell the passes apart. Before, the other source's first
    items were skipped, unreported, as if consumed."""
    for prefix in ("a", "b"):
        for i in range(4):
            s3_source.put(f"{prefix}/item{i:03d}/f", b"x" * 100)
    url_a, url_b, cache = s3_source.url + "a/", s3_source.url + "b/", tmp_path / "cache"
    with Pipeline(url_a, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        it = iter(pipe)
        next(it), next(it), next(it)  # item000 and item001 acked (auto-ack), item002 in hand
        it.close()
    with pytest.raises(ConfigError, match=rf"another plan: source '{url_a}' there, '{url_b}' here"):
        Pipeline(url_b, cache, "1MiB", storage_options=s3_source.options, resume=True).open()
    with pytest.raises(ConfigError, match="another plan: items 'folders' there, 'files' here"):
        Pipeline(url_a, cache, "1MiB", storage_options=s3_source.options, resume=True, items="files").open()
    with Pipeline(url_a, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        assert [p.name for p in pipe] == ["item002", "item003"]  # the refusals changed nothing


def test_a_pass_recorded_before_its_source_was_resumes_and_other_plans_are_named():
    old = json.dumps({"n_items": 4, "sizes_digest": "d", "epochs": 1})
    assert (
        plan_differences(old, json.dumps({"n_items": 4, "sizes_digest": "d", "epochs": 1, "source": "s3://b/", "items": "files"}))
        == ""
    )
    new = json.dumps({"n_items": 5, "sizes_digest": "d", "epochs": 1, "source": "s3://b/"})
    assert plan_differences(old, new) == "n_items 4 there, 5 here"
    assert (
        plan_differences(new, json.dumps({"n_items": 5, "sizes_digest": "d", "epochs": 1})) == "source 's3://b/' there, None here"
    )


def test_resume_skips_acked_items_without_relisting(s3_source, tmp_path):
    s3_source.folders(4, {"f": 100})
    cache = tmp_path / "cache"
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        it = iter(pipe)
        next(it), next(it), next(it)  # item000 and item001 acked (auto-ack), item002 in hand
        it.close()
    s3_source.put("zzz/f", b"new")  # not seen: the saved listing is used
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, resume=True) as pipe:
        assert [p.name for p in pipe] == ["item002", "item003"]
    with pytest.raises(ValueError, match="another plan"):  # the data changed under the pass
        Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options, resume=True, relist=True).open()
    with Pipeline(s3_source.url, cache, "1MiB", storage_options=s3_source.options) as pipe:
        assert len(list(pipe)) == 5  # without resume: a new pass over the new listing


_ORPHANED_WORKERS = """
import json, sys, threading
from cachepipe.downloads import DownloadWorkers

url, options, size, a, b = json.loads(sys.argv[1])
workers = DownloadWorkers(url, options, processes=1, threads=1)
threading.Thread(target=workers.get, args=("a.bin", a, 0, size, True), daemon=True).start()
sys.stdin.readline()  # the test saw the GET of a.bin held at the proxy
threading.Thread(target=workers.get, args=("b.bin", b, 0, size, True), daemon=True).start()
worker = workers._workers[0]  # read, not changed: when b.bin's request is sent too (queued there: one thread)
while len(worker.pending) < 2:
    threading.Event().wait(0.005)
with worker.lock:  # taken by the send of b.bin's request until it is written to the worker's pipe
    pass
print(worker.process.pid, flush=True)
threading.Event().wait()
"""


def test_a_download_worker_whose_parent_was_killed_writes_nothing_more(s3_source, fault_proxy, tmp_path):
    """A download worker (``download_processes``) whose pipeline process was killed ran the
    requests it had queued: each opened its staging path by name and wrote an object's bytes
    there, after the next owner of the cache may have made that path its own staging file (it
    counts the bytes it writes, so bytes written over them were not noticed). The worker now
    drops its queued requests when its parent is gone and aborts those under way."""
    proxy, endpoint = fault_proxy
    size = 64 * KIB
    s3_source.put("a.bin", random.Random(1).randbytes(size))
    s3_source.put("b.bin", random.Random(2).randbytes(size))
    gate = threading.Event()
    proxy.hold(lambda head: "a.bin" in head.split("\r\n", 1)[0], gate)
    args = [s3_source.url, via(s3_source, endpoint), size, str(tmp_path / "a"), str(tmp_path / "b")]
    child = subprocess.Popen(
        [sys.executable, "-c", _ORPHANED_WORKERS, json.dumps(args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    pidfd = -1
    try:
        assert child.stdin is not None and child.stdout is not None
        wait_until(lambda: any("a.bin" in head.split("\r\n", 1)[0] for head in proxy.requests), 60, "the GET of a.bin")
        child.stdin.write("go\n")
        child.stdin.flush()
        worker = int(child.stdout.readline())
        pidfd = os.pidfd_open(worker)
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        gate.set()  # a.bin's GET goes on, if the worker still waits for it
        assert select.select([pidfd], [], [], 60)[0], "the orphaned worker did not exit"
    finally:
        gate.set()
        child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
        if pidfd >= 0:
            os.close(pidfd)
    assert not (tmp_path / "b").exists()  # before: the queued request created and wrote it
    assert not any("b.bin" in head.split("\r\n", 1)[0] for head in proxy.requests)
