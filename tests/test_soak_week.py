"""A week of uptime, compressed: what a long-running daemon or pipeline must not accumulate per
job, per epoch or per reload. Each test repeats the thing a few times and counts what is left
(files, folders, threads, descriptors, entries), a count that must not depend on the repeats.
The soaks that found these ran for minutes (their figures are in the commit messages)."""

from __future__ import annotations

import fcntl
import os
import shutil

import yaml
from test_jobs_api import one_rank_job

from cachepipe import Pipeline
from cachepipe.client import Client
from cachepipe.jobclient import JobClient
from cachepipe.service.testing import DaemonProcess

KIB = 1024


def test_a_deleted_job_leaves_no_folder_under_the_jobs_root(s3_source, tmp_path, short_dir):
    """Node mode registers a job per run (``torch-<digest of its spec>``: a new name for each new
    seed or setting) and a script deletes it when the run ends. Each deleted job left
    ``root/NAME/.cachepipe`` (lock, journal, held) behind for good: a week of runs, a folder each."""
    s3_source.folders(3, {"a.bin": KIB})
    sock = short_dir / "api.sock"
    config, spec = one_rank_job(s3_source, tmp_path, sock)
    # no periodic cache check meanwhile: the job whose folder is replaced below is deleted, not dropped first
    config.write_text(yaml.safe_dump({**yaml.safe_load(config.read_text()), "status_interval": 3600}))
    root = tmp_path / "jobs"
    with DaemonProcess(config), Client(socket=sock) as admin:
        for run in range(3):
            name = f"run{run}"
            with JobClient(name, {**spec, "seed": run}, 0, socket=sock) as lane:
                cursor, taken = (0, 0), 0
                while (item := lane.take(cursor, timeout=30)) is not None:
                    cursor, taken = item.next, taken + 1
                lane.consume(cursor)
            assert taken == 3
            admin.delete_job(name)
            assert sorted(p.name for p in root.iterdir()) == [".daemon", ".manifests"], run  # before: run0 .. run{run} left there
            # the writers' lock file, and the jobs' notes folder, empty
            assert sorted(p.name for p in (root / ".manifests").rglob("*")) == [".lock", "jobs"], run
        with JobClient("kept", spec, 0, socket=sock) as lane:
            assert lane.take((0, 0), timeout=30) is not None
        (root / "kept" / "notes.txt").write_text("a file not of the cache")  # or an item its close could not delete
        admin.delete_job("kept")
        assert sorted(p.name for p in (root / "kept").iterdir()) == [".cachepipe", "notes.txt"]  # its journal kept with it
        # noted as planning from no manifest: a folder without a note keeps every manifest
        assert (root / ".manifests" / "jobs" / "kept").read_text() == ""
        # A job's folder removed and made again under it, by another owner (a pipeline of the same
        # cache_dir, holding the lock): the close touches nothing of it ("closing without deleting
        # anything"), and the removal after it deleted that owner's lock and journal under it.
        with JobClient("moved", spec, 0, socket=sock) as lane:
            cursor = (0, 0)  # every item taken: no download is still writing into the folder removed below
            while (item := lane.take(cursor, timeout=30)) is not None:
                cursor = item.next
        shutil.rmtree(root / "moved")
        (root / "moved" / ".cachepipe").mkdir(parents=True)
        fd = os.open(root / "moved" / ".cachepipe" / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            admin.delete_job("moved")
            assert sorted(p.name for p in (root / "moved" / ".cachepipe").iterdir()) == ["lock"]  # before: removed
        finally:
            os.close(fd)


def test_a_pipeline_keeps_one_object_per_item_whose_leases_expire_not_one_per_lease(tmp_path):
    """A consumer that dies holding an item (a daemon's client killed mid-batch, a worker gone)
    leaves its lease to expire, and the item is handed out again. The pipeline kept the object
    of every lease handed out until its ack or release, by lease id: an expired lease is never
    acknowledged, so each stayed for the life of the pipeline (a daemon soak with consumers
    killed every few seconds: 5, 9, 15, 27 CachedItem objects at 0, 30, 60, 90 s, and on)."""
    source = tmp_path / "src" / "item0"
    source.mkdir(parents=True)
    (source / "a.bin").write_bytes(b"x" * KIB)
    with Pipeline(str(tmp_path / "src"), tmp_path / "cache", "1MiB", lease_timeout=0.05, auto_ack=False) as pipe:
        leases = set()
        for _ in range(5):  # taken and dropped: each get waits for the last lease to expire
            item = pipe.get(timeout=30)
            assert item is not None and item.name == "item0"
            leases.add(item.lease)
        assert len(leases) == 5
        assert len(pipe._handed) == 1  # before: 5, one per lease
        pipe.ack(item, item.lease)
        assert pipe._handed == {}
