"""What a chaos run of the daemon found, each reduced to one deterministic test: a real daemon
subprocess over the moto server, faults at the network (the fault proxy, a silent endpoint).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from conftest import via
from faultproxy import silent
from mounts import mounted
from test_jobs_api import one_rank_job, register
from test_service import raw_request
from waiting import wait_until

from cachepipe.client import Client, ServiceError
from cachepipe.service.testing import DaemonProcess


@contextlib.contextmanager
def _registering(s3_source, tmp_path, short_dir, extra: str = "") -> Iterator[tuple[DaemonProcess, Path, list]]:
    """A daemon (its config plus ``extra``) whose job ``train`` registers over a source whose
    endpoint takes requests and never answers: yields once the registration's listing is asked
    for, with the daemon, its socket and the registration's answers (``(status, body)``, one
    once it ends); at the end of the block the registration is waited for."""
    s3_source.folders(2, {"a.bin": 100})
    sock = short_dir / "api.sock"
    answers: list[tuple[int, dict]] = []
    with silent() as (endpoint, asked):
        config, spec = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint))
        config.write_text(config.read_text() + extra)
        body = json.dumps(spec).encode()
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon:

            def register() -> None:
                put = b"PUT /v1/jobs/train HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                answers.append(raw_request(sock, put, timeout=120))

            registering = threading.Thread(target=register)
            registering.start()
            try:
                wait_until(asked.is_set, what="the job's listing request")
                yield daemon, sock, answers
            finally:
                registering.join()


def test_a_stop_ends_a_job_registration_whose_listing_gets_no_answer(s3_source, tmp_path, short_dir):
    # A job's registration lists its source while it holds the jobs' lock; the stop closed the
    # jobs under that lock, so a SIGTERM waited for the listing's read timeout (60 s, then
    # retried), once per lane registering: a chaos run's stop under a stalled store took over
    # 80 s, past systemd's TimeoutStopSec. The stop now closes the pipeline being opened, which
    # aborts its listing, and the registration is answered 503 stopping (the lane asks the next
    # daemon).
    with _registering(s3_source, tmp_path, short_dir) as (daemon, _, answers):
        assert daemon.stop(timeout=20) == 0  # before: the read timeout of the listing, 60 s and more
    assert len(answers) == 1
    status, answer = answers[0]
    assert status == 503 and answer.get("error") == "stopping", answers
    assert "Traceback" not in daemon.log()


def test_a_job_registration_listing_holds_neither_the_status_nor_the_stop(s3_source, tmp_path, short_dir):
    # A job's registration held the jobs' lock while it listed its source, and every other use
    # of the jobs waited for it: `cachepipe status`, the other jobs' lanes, and the daemon's
    # main loop, which checks the jobs' caches every status_interval, so that it did not even
    # see a SIGTERM until the listing's read timeout (a chaos run: no "stopping (signal)" for
    # 40 s, under a stalled store). The registration now lists without that lock.
    often = "status_interval: 0.1\n"  # the main loop checks the jobs' caches often
    with _registering(s3_source, tmp_path, short_dir, often) as (daemon, sock, answers):
        with Client(socket=str(sock), request_timeout=20) as admin:
            assert admin.status()["jobs"] == {}  # before: no answer until the listing timed out
        assert daemon.stop(timeout=20) == 0
    assert [status for status, _ in answers] == [503], answers
    assert "stopping (signal)" in daemon.log() and "Traceback" not in daemon.log()


def test_a_job_registered_while_its_disk_is_full_is_answered_507_and_registers_once_there_is_room(s3_source, tmp_path, short_dir):
    # Another writer filled the disk of jobs.root: the job's pipeline could not write its state
    # when it opened (ENOSPC), and the registration was answered 500 internal with a traceback
    # in the log (a chaos run). It is answered 507 insufficient_storage, as every write of the daemon
    # that meets a full disk, saying the disk is full; the lane
    # registers once there is room.
    s3_source.folders(2, {"a.bin": 100})
    sock = short_dir / "api.sock"
    with mounted(tmp_path / "disk", ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tmp_path / "disk")]) as disk:
        config, spec = one_rank_job(s3_source, tmp_path, sock)
        jobs = yaml.safe_load(config.read_text())
        jobs["jobs"]["root"], jobs["jobs"]["capacity"] = str(disk / "jobs"), "128KiB"
        config.write_text(yaml.safe_dump(jobs))
        filler = disk / "other-writer.bin"
        with DaemonProcess(config, log_path=tmp_path / "daemon.log") as daemon:
            # the disk full, as another writer leaves it
            with open(filler, "wb", buffering=0) as out, contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * 4096)
            with pytest.raises(ServiceError) as refused:
                register(sock, "train", spec)
            assert refused.value.status == 507 and refused.value.code == "insufficient_storage", refused.value
            assert "No space left on device" in str(refused.value) and "full" in str(refused.value)
            filler.unlink()
            assert register(sock, "train", spec)["job"] == "train"
            assert daemon.stop() == 0
    assert "Traceback" not in daemon.log()
