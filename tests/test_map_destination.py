"""A destination that refuses uploads (``DestinationError``) while the run is already stopping:
each refusal reaches the user once, whether or not it is the error the run raises. A destination
endpoint that is not the store's API (a web page) is said to be so."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import ThreadingHTTPServer

import pytest
from test_first_hour import _WebPage
from test_map import alive
from waiting import wait_until

from cachepipe.stores import open_store

PUT = "PUT "


def _denied_uploads_run(s3_client, fault_proxy, tmp_path, names: tuple[str, ...]) -> tuple[list[str], threading.Event]:
    """The command line of a map run of ``names`` (one job each) into s3://data/out/ through
    the fault proxy, which holds every upload until the returned gate is set and then answers
    it 403 AccessDenied; the command of an item named ``sleeper`` writes its pid to
    ``tmp_path/sleeper.pid`` and sleeps (its death tells a stop has begun), the others' copy
    their input to an output."""
    s3_client.create_bucket(Bucket="data")
    proxy, endpoint = fault_proxy
    src = tmp_path / "src"
    for name in names:
        (src / name).mkdir(parents=True)
        (src / name / "f").write_text(name)
    gate = threading.Event()
    proxy.hold(lambda head: head.startswith(PUT), gate, limit=600, answer="403")
    script = 'if [ "$CACHEPIPE_NAME" = sleeper ]; then echo $$ > "$0/sleeper.pid"; exec sleep 60; fi; cp f "$CACHEPIPE_OUT/g"'
    argv = [sys.executable, "-m", "cachepipe.map", str(src), "s3://data/out/", "--cache", str(tmp_path / "cache")]
    argv += ["--capacity", "1MiB", "--jobs", str(len(names)), "--no-progress", "--retries", "0"]
    argv += [arg for opt in (f"endpoint_url={endpoint}", "key=k", "secret=s") for arg in ("--dest-option", opt)]
    return [*argv, "--", "sh", "-c", script, str(tmp_path)], gate


def _puts_held(proxy, proc: subprocess.Popen, count: int, stderr) -> None:
    wait_until(
        lambda: sum(h.startswith(PUT) for h in proxy.requests) >= count or proc.poll() is not None,
        timeout=60,
        what=f"{count} uploads held",
    )
    assert proc.poll() is None, stderr()


@contextlib.contextmanager
def _running(argv: list[str], gate: threading.Event, tmp_path) -> Iterator[tuple[subprocess.Popen, Callable[[], str]]]:
    """The map run ``argv`` started, with its stderr's text as a function; at the end of the
    block the held uploads are let go (answered) and the run waited for, killed if it fails."""
    err = tmp_path / "stderr"
    with err.open("w") as sink:
        proc = subprocess.Popen(argv, stderr=sink)
    try:
        yield proc, err.read_text
        gate.set()
        proc.wait(timeout=60)
    finally:
        gate.set()
        proc.kill()
        proc.wait()


def _refusals(stderr: str) -> dict[str, list[str]]:
    """The lines of ``stderr`` that tell an upload's refusal, by the item's output they name."""
    told: dict[str, list[str]] = {}
    for line in stderr.splitlines():
        for key in ("a/g", "b/g"):
            if f"uploading {key}: the destination refused it" in line:
                told.setdefault(key, []).append(line)
    return told


def test_a_second_refusal_after_the_first_stopped_the_run_is_told_too(s3_client, fault_proxy, tmp_path):
    """Two jobs' uploads in flight, both refused (403 held at the proxy, then answered): the first
    refusal stops the run and is the error it raises (the command line's last line); the second
    came from a job once the run had a crash, and was neither raised nor logged. Now it is
    logged, once; the one raised is not logged as well."""
    argv, gate = _denied_uploads_run(s3_client, fault_proxy, tmp_path, ("a", "b"))
    with _running(argv, gate, tmp_path) as (proc, read):
        _puts_held(fault_proxy[0], proc, 2, read)
    stderr = read()
    assert proc.returncode == 1, stderr
    told = _refusals(stderr)
    assert sorted(told) == ["a/g", "b/g"] and all(len(lines) == 1 for lines in told.values()), stderr
    raised = [key for key, lines in told.items() if lines[0].startswith("cachepipe map: uploading")]
    logged = [key for key, lines in told.items() if lines[0].startswith("cachepipe.map ERROR: uploading")]
    assert len(raised) == 1 and len(logged) == 1, stderr
    assert stderr.splitlines()[-1].startswith(f"cachepipe map: uploading {raised[0]}"), stderr


STOPS = [(signal.SIGTERM, 143, "terminated (SIGTERM)"), (signal.SIGINT, 130, "interrupted")]


@pytest.mark.parametrize(("sig", "status", "how"), STOPS)
def test_refusals_of_the_uploads_a_stop_waits_for_are_told(s3_client, fault_proxy, tmp_path, sig, status, how):
    """A stop (SIGTERM, Ctrl-C) waits for the uploads in flight; refused then, each was the
    run's crash (the first) or came after it, and the run raised the stop: the user was told
    "terminated", never that the destination refuses writes. Now each refusal is logged, once,
    before the stop's own line. ``sleeper``'s command sleeps: its death tells the stop has begun."""
    argv, gate = _denied_uploads_run(s3_client, fault_proxy, tmp_path, ("a", "b", "sleeper"))
    with _running(argv, gate, tmp_path) as (proc, read):
        _puts_held(fault_proxy[0], proc, 2, read)
        pid = tmp_path / "sleeper.pid"
        sleeper = int(wait_until(lambda: pid.exists() and pid.read_text().strip(), what="the sleeper started"))
        proc.send_signal(sig)
        wait_until(lambda: not alive(sleeper), what="the sleeper's command killed by the stop")
    stderr = read()
    assert proc.returncode == status, stderr
    told = _refusals(stderr)
    assert sorted(told) == ["a/g", "b/g"], stderr
    assert all(len(lines) == 1 and lines[0].startswith("cachepipe.map ERROR: uploading") for lines in told.values()), stderr
    assert stderr.splitlines()[-1] == f"cachepipe map: {how}; run the same command again to resume", stderr


@pytest.mark.parametrize("status", [404, 403])
def test_an_upload_to_an_endpoint_that_is_a_web_page_is_named_as_perhaps_not_the_stores_api(tmp_path, status):
    """An upload (``cachepipe map``'s, to DST) answered by a web server (a console one port off
    the API) said "not found (404: Not Found)" or "access denied (403: Forbidden)": botocore gives
    an answer that is not S3's XML its status as a code, so the web-page hint of a listing or a
    GET was not given (a HEAD's answer has no body to tell: not hinted)."""
    local = tmp_path / "f"
    local.write_text("x")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WebPage)
    server.status = status  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, name="web-page")
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    store = open_store("s3://bucket/out/", {"endpoint_url": endpoint, "key": "k", "secret": "s", "skip_instance_cache": True})
    try:
        with pytest.raises(OSError, match=re.escape(f"not an S3 answer: is {endpoint} the store's S3 API endpoint")):
            store.put(local, "item/f")
    finally:
        store.close()
        server.shutdown()
        server.server_close()
        thread.join()
