"""GETs made by worker processes (``download_processes``): same items, same errors, nothing leaked."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import pytest
from waiting import wait_until

from cachepipe import ConfigError, ItemFailedError, Pipeline
from cachepipe.node import NodePipeline

KIB = 1024


def worker_pids() -> list[int]:
    """This process's children that are download workers."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*/children"):
        try:
            children = task.read_text().split()
        except FileNotFoundError:  # the thread ended after the listing (seen under load on 3.12)
            continue
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"cachepipe.downloads" in cmdline:
                pids.append(int(pid))
    return pids


def test_items_come_whole_through_worker_processes_and_none_outlives_the_pipeline(s3_source, tmp_path):
    data = s3_source.folders(12, {"video.mp4": 70 * KIB, "text.txt": 300})
    got = {}
    options = {"storage_options": s3_source.options, "download_processes": 2, "part_size": "16KiB", "max_concurrency": 4}
    with Pipeline(s3_source.url, tmp_path / "c", "256KiB", **options) as pipe:
        for item in pipe:
            got[item.name] = {rel: (item.path / rel).read_bytes() for rel in ("video.mp4", "text.txt")}
        assert len(worker_pids()) == 2
        stats = pipe.stats()
    assert got == data  # ranged parts (16 KiB) written by the workers into one staging file each
    assert stats.requests == 12 * (5 + 1) and stats.bytes_downloaded == sum(70 * KIB + 300 for _ in range(12))
    assert worker_pids() == []


def test_a_store_error_in_a_worker_fails_the_item_as_it_would_in_process(s3_source, tmp_path):
    s3_source.folders(3, {"f": 1000})
    options = {"storage_options": s3_source.options, "download_processes": 1, "prefetch": 1}
    with Pipeline(s3_source.url, tmp_path / "c", "1MiB", **options) as pipe:
        it = iter(pipe)
        assert next(it).name == "item000"
        s3_source.delete("item002/f")  # vanishes between listing and download
        assert next(it).name == "item001"
        with pytest.raises(ItemFailedError) as info:
            next(it)
    assert "item002/f" in str(info.value) and isinstance(info.value.__cause__, FileNotFoundError)


def test_a_killed_worker_is_replaced_and_its_requests_retried(s3_source, tmp_path, caplog):
    data = s3_source.folders(10, {"f": 2000})
    got = {}
    options = {"storage_options": s3_source.options, "download_processes": 2, "prefetch": 2, "retry_backoff": 0.01}
    with caplog.at_level(logging.WARNING, logger="cachepipe"), Pipeline(s3_source.url, tmp_path / "c", "1MiB", **options) as pipe:
        it = iter(pipe)
        first = next(it)
        got[first.name] = (first.path / "f").read_bytes()
        wait_until(lambda: len(worker_pids()) == 2)
        killed = worker_pids()
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        for item in it:
            got[item.name] = (item.path / "f").read_bytes()
        assert set(worker_pids()).isdisjoint(killed) and len(worker_pids()) == 2
    assert got == {name: files["f"] for name, files in data.items()}
    assert "starting another" in caplog.text


def test_a_node_pipeline_downloads_through_workers(s3_source, tmp_path):
    data = s3_source.folders(8, {"f": 500})
    options = {"storage_options": s3_source.options, "download_processes": 1}
    with NodePipeline(s3_source.url, tmp_path / "n", "1MiB", ranks=[0], world_size=1, num_workers=2, **options) as pipe:
        names = []
        for worker in (0, 1):
            taken = pipe.take_many(0, worker, (0, 0), count=8, timeout=30)
            while taken:
                names += [t.item.name for t in taken]
                taken = pipe.take_many(0, worker, taken[-1].after, count=8, timeout=30)
    assert sorted(names) == sorted(data)


def test_worker_processes_need_a_source_they_can_open(tmp_path):
    with pytest.raises(ValueError, match=r"download_processes=2 with source 'memory://x'.*private to this process"):
        Pipeline("memory://x", tmp_path / "c", "1MiB", download_processes=2)
    from cachepipe.stores import open_store

    store = open_store(f"file://{tmp_path}/src")
    with pytest.raises(ConfigError, match=r"download_processes=1 with store=.*cannot be shared"):
        Pipeline(f"file://{tmp_path}/src", tmp_path / "c", "1MiB", store=store, download_processes=1)
    with pytest.raises(ValueError, match="download_processes"):
        Pipeline("memory://x", tmp_path / "c", "1MiB", download_processes=-1)
