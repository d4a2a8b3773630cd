"""``JobClient`` across daemons that restart faster than the lane notices them.

A lane runs in a child process, so that the test can stop it (SIGSTOP) while its daemon is
killed and the next one starts, and let it go (SIGCONT) once that one is ready: the lane then
finds the new daemon at its first attempt, with no outage in between, as a lane whose process
is put off for a few seconds on a busy node does. One real daemon subprocess at a time over the
moto server, read through the fault proxy, which holds the job's first item so that the lane's
take waits in each daemon.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import yaml
from conftest import via
from waiting import wait_until

from cachepipe.client import Client
from cachepipe.service.testing import DaemonProcess

ROOT = Path(__file__).resolve().parent.parent
KIB = 1024

LANE = """
import json, sys
from cachepipe.jobclient import JobClient
sock, spec = sys.argv[1], json.loads(sys.argv[2])
with JobClient("train", spec, 0, socket=sock, startup_timeout=30, outage_timeout=60) as lane:
    lane.register()
    try:
        item = lane.take((0, 0), timeout=120)
        print(json.dumps({"item": item.name}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


def restart(daemon: DaemonProcess, lane: subprocess.Popen[str], config: Path) -> DaemonProcess:
    """Kill ``daemon`` (SIGKILL) and start the next one while ``lane`` is stopped; let it go once that one is ready."""
    lane.send_signal(signal.SIGSTOP)
    try:
        daemon.signal(signal.SIGKILL)
        assert daemon.proc is not None
        daemon.proc.wait(30)
        daemon.close()
        return DaemonProcess(config).start()
    finally:
        lane.send_signal(signal.SIGCONT)


def test_a_take_through_two_restarts_that_the_lane_sees_no_outage_of_registers_the_job_with_each_daemon(
    s3_source, fault_proxy, tmp_path, short_dir
):
    """Before, a lane registered the job again once per outage it waited out, and a daemon killed
    and back before the lane's next attempt was no outage: after the second such restart within
    one take, the third daemon's 404 ("no job 'train'") was raised (ServiceError), though the
    job had only been forgotten again. Now a 404 is raised only from the daemon that registered
    the job in this call (the same connection): from any other the job is registered again."""
    proxy, endpoint = fault_proxy
    first = min(s3_source.folders(2, {"a.bin": KIB}))
    sock = short_dir / "api.sock"
    jobs = {"root": str(tmp_path / "jobs"), "capacity": "1MiB", "sources": [s3_source.url]}
    jobs["options"] = {"storage_options": via(s3_source, endpoint)}
    config = tmp_path / "cachepipe.yaml"
    config.write_text(yaml.safe_dump({"socket": str(sock), "jobs": jobs}))
    spec = {"source": s3_source.url, "world_size": 1, "ranks": [0], "num_workers": 1}
    gate = threading.Event()
    proxy.hold(lambda head: f"{first}/a.bin" in head, gate, limit=600)  # not ready under any daemon until the gate opens

    def waiting() -> bool:
        with Client(socket=sock) as admin:
            return bool(admin.status()["jobs"].get("job/train", {}).get("waiting"))

    # the cachepipe of this checkout, not one in the working directory (PYTHONSAFEPATH, as DaemonProcess)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env["PYTHONSAFEPATH"] = "1"
    daemon = DaemonProcess(config).start()
    lane = subprocess.Popen([sys.executable, "-c", LANE, str(sock), json.dumps(spec)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        wait_until(waiting, 60, "the lane's take waiting in the first daemon")
        daemon = restart(daemon, lane, config)
        wait_until(waiting, 60, "the lane registering the job again and waiting in the second daemon")
        daemon = restart(daemon, lane, config)
        gate.set()
        out, _ = lane.communicate(timeout=120)
    finally:
        gate.set()
        if lane.poll() is None:
            lane.send_signal(signal.SIGCONT)
            lane.kill()
            lane.wait()
        daemon.close()
    assert json.loads(out) == {"item": first}  # before: {"error": "ServiceError: no job 'train' ... (HTTP 404 not_found)"}


def test_a_server_that_forgets_the_job_at_every_answer_is_not_asked_forever(short_dir):
    """A lane registers the job again when a 404 comes over another connection than the last
    registration's (another daemon). A server that closes the connection after every answer
    and never knows the job (a proxy that sends ``Connection: close``, before a daemon that
    drops the job) made that loop forever, registering and asking with no pause. Now at most
    ``MAX_REGISTRATIONS`` times in one call; then its 404 is raised. Here a stand-in daemon on a
    real Unix socket answers every registration 200 and every take 404, closing each connection;
    past 50 registrations it answers 500, which ends the loop of the code before the fix."""
    import http.server
    import socketserver
    from collections import Counter

    from cachepipe.client import ServiceError
    from cachepipe.jobclient import MAX_REGISTRATIONS, JobClient

    counts: Counter[str] = Counter()

    class Forgetful(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, body: dict) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def do_PUT(self) -> None:
            counts["PUT"] += 1
            if counts["PUT"] > 50:
                self._answer(500, {"error": "internal", "message": "registered too often"})
            else:
                self._answer(200, {"lanes": 1, "items": 1, "catalog_digest": "d"})

        def do_POST(self) -> None:
            counts["POST"] += 1
            self._answer(404, {"error": "not_found", "message": "no job 'train'"})

        def log_message(self, *_args: object) -> None:
            pass

    class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
        daemon_threads = True

    sock = str(short_dir / "forgetful.sock")
    server = Server(sock, Forgetful)
    thread = threading.Thread(target=server.serve_forever, name="forgetful-daemon")
    thread.start()
    try:
        with JobClient("train", {"source": "s3://data/video/"}, 0, socket=sock, startup_timeout=0) as lane:
            lane.register()
            try:
                lane.take((0, 0), timeout=5)
            except ServiceError as exc:
                error = exc
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert (error.status, error.code) == (404, "not_found"), error
    assert counts == {"PUT": 1 + MAX_REGISTRATIONS, "POST": 1 + MAX_REGISTRATIONS}
