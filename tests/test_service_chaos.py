"""What a chaos run of the daemon found, each reduced to one deterministic test: a real daemon
subprocess over the moto server, faults at the network (the fault proxy, a silent endpoint).
"""

from __future__ import annotations

import json
import threading

from conftest import via
from faultproxy import silent
from test_jobs_api import one_rank_job
from test_service import raw_request
from waiting import wait_until

from cachepipe.service.testing import DaemonProcess


def test_a_stop_ends_a_job_registration_whose_listing_gets_no_answer(s3_source, tmp_path, short_dir):
    # A job's registration lists its source while it holds the jobs' lock; the stop closed the
    # jobs under that lock, so a SIGTERM waited for the listing's read timeout (60 s, then
    # retried), once per lane registering: a chaos run's stop under a stalled store took over
    # 80 s, past systemd's TimeoutStopSec. The stop now closes the pipeline being opened, which
    # aborts its listing, and the registration is answered 503 stopping (the lane asks the next
    # daemon).
    s3_source.folders(2, {"a.bin": 100})
    sock = short_dir / "api.sock"
    answers: list[tuple[int, dict]] = []
    with silent() as (endpoint, asked):
        config, spec = one_rank_job(s3_source, tmp_path, sock, storage_options=via(s3_source, endpoint))
        body = json.dumps(spec).encode()
        with DaemonProcess(config) as daemon:

            def register() -> None:
                put = b"PUT /v1/jobs/train HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
                answers.append(raw_request(sock, put, timeout=120))

            registering = threading.Thread(target=register)
            registering.start()
            try:
                wait_until(asked.is_set, what="the job's listing request")
                assert daemon.stop(timeout=20) == 0  # before: the read timeout of the listing, 60 s and more
            finally:
                registering.join()
    assert len(answers) == 1
    status, answer = answers[0]
    assert status == 503 and answer.get("error") == "stopping", answers
    assert "Traceback" not in daemon.log()
